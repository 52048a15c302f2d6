//! SIGTERM with idle connections open (the built binary, `serve --demo`, `--shutdown-grace 30`):
//! an idle keep-alive connection, one that never sent a byte and one half-closed after its answer
//! must not hold the shutdown for the grace; a request in flight must still be answered (with
//! `Connection: close`) before the process exits.
//!
//! Before the fix every such idle connection that its client kept open held the process for the
//! whole grace (30 s here, 25 s by default: every pod termination took the full grace). The
//! connection layer's close waited for the peer to close (to drain what it still sent), bounded by
//! nothing in practice, and actix-http's dispatcher was never told that shutdown had begun.
//!
//! The bounds are loose for a busy 2-core machine: the fixed server exits within a second or two,
//! the unfixed one after 30 s.

mod common;

use common::server::Served;
use serde_json::json;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

const GRACE: &str = "30";

/// Exit bound after SIGTERM once nothing is in flight (well under the 30 s grace).
const BOUND: Duration = Duration::from_secs(10);

fn connect(port: u16) -> TcpStream {
    let c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c
}

/// Reads one response: (status, head, body); the body by its `Content-Length`.
fn read_response(c: &mut TcpStream) -> (u16, String, Vec<u8>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = c.read(&mut chunk).expect("reading a response");
        assert!(n > 0, "closed without a response after {:?}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .expect("a Content-Length");
    let mut body = buf[end..].to_vec();
    while body.len() < len {
        let n = c.read(&mut chunk).expect("reading a body");
        assert!(n > 0, "closed inside a body");
        body.extend_from_slice(&chunk[..n]);
    }
    (status, head, body)
}

/// Asserts the server closed `c` (EOF, or a reset), reading at most 60 s.
fn assert_closed_by_server(c: &mut TcpStream, what: &str) {
    let mut b = [0u8; 256];
    match c.read(&mut b) {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("{what}: unexpected bytes {:?}", String::from_utf8_lossy(&b[..n])),
    }
}

/// A keep-alive connection after one answered `GET /healthz`, left open and unread.
fn idle_keep_alive(port: u16) -> TcpStream {
    let mut c = connect(port);
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let (status, head, _) = read_response(&mut c);
    assert_eq!(status, 200, "{head}");
    assert!(!head.contains("connection: close"), "not kept alive: {head}");
    c
}

fn demo_request() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "state": {"ticket": "the printer on floor 2 is jammed"},
        "questions": {"hw": {"type": "noul", "instructions": "Is it a hardware problem?"}}
    }))
    .unwrap()
}

fn post_head(len: usize) -> String {
    format!(
        "POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
    )
}

/// Waits for the process to exit, at most `bound` after `t`; its exit must be a success.
fn exits_within(s: &mut Served, t: Instant, bound: Duration) -> Duration {
    loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            assert!(st.success(), "{st:?}\n{}", s.logs());
            return t.elapsed();
        }
        assert!(
            t.elapsed() < bound,
            "still running {:?} after SIGTERM (grace {GRACE} s) with only idle connections open:\n{}",
            t.elapsed(),
            s.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Idle connections whose clients keep them open (and never read them): one kept alive after a
/// `GET`, one after an answered `POST /v1/systemone`, one that never sent a byte, one half-closed
/// by its client after its answer. SIGTERM: the process exits well within the grace, and the
/// server closed each connection.
#[test]
fn idle_connections_do_not_hold_the_shutdown_for_the_grace() {
    let mut s = Served::demo(&["--shutdown-grace", GRACE]);
    let mut after_get = idle_keep_alive(s.port);
    let mut after_post = connect(s.port);
    let body = demo_request();
    after_post.write_all(post_head(body.len()).as_bytes()).unwrap();
    after_post.write_all(&body).unwrap();
    let (status, head, text) = read_response(&mut after_post);
    assert_eq!(status, 200, "{head}{}", String::from_utf8_lossy(&text));
    let mut silent = connect(s.port);
    let mut half = idle_keep_alive(s.port);
    half.shutdown(Shutdown::Write).unwrap();
    std::thread::sleep(Duration::from_millis(300));

    let t = Instant::now();
    s.terminate();
    let took = exits_within(&mut s, t, BOUND);
    eprintln!("exited {took:?} after SIGTERM");
    for (c, what) in [
        (&mut after_get, "kept alive after GET"),
        (&mut after_post, "kept alive after POST"),
        (&mut silent, "never sent a byte"),
        (&mut half, "half-closed"),
    ] {
        assert_closed_by_server(c, what);
    }
}

/// A request in flight at SIGTERM (its body half sent) is still read and answered, with
/// `Connection: close`, while an idle keep-alive connection beside it is closed at once; the
/// process exits once the answer is out, not after the grace.
#[test]
fn a_request_in_flight_is_answered_while_idle_connections_close() {
    let mut s = Served::demo(&["--shutdown-grace", GRACE]);
    let mut idle = idle_keep_alive(s.port);
    let body = demo_request();
    let mut busy = connect(s.port);
    busy.write_all(post_head(body.len()).as_bytes()).unwrap();
    let half = body.len() / 2;
    busy.write_all(&body[..half]).unwrap();
    std::thread::sleep(Duration::from_millis(300));

    let t = Instant::now();
    s.terminate();
    assert_closed_by_server(&mut idle, "idle keep-alive beside a request in flight");
    std::thread::sleep(Duration::from_millis(500));
    assert!(s.child.try_wait().unwrap().is_none(), "exited with a request in flight:\n{}", s.logs());
    busy.write_all(&body[half..]).unwrap();
    let (status, head, text) = read_response(&mut busy);
    assert_eq!(status, 200, "{head}{}", String::from_utf8_lossy(&text));
    assert!(head.contains("connection: close"), "an answer during shutdown keeps the connection: {head}");
    assert_closed_by_server(&mut busy, "the answered connection");
    let took = exits_within(&mut s, t, BOUND + Duration::from_secs(5));
    eprintln!("exited {took:?} after SIGTERM");
}
