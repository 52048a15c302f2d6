//! The playground page through the real binary: `serve` answers `GET /` with the page (and its
//! policy) by default, and `serve --no-playground` answers `/` with the API's 404 while the API
//! is unchanged. The page itself is driven in a browser by `tests/browser/playground.py` (CI).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `(status, headers in lower case, body)` of one HTTP/1.1 request; None while nothing listens.
fn get(port: u16, method: &str, path: &str) -> Option<(u16, String, Vec<u8>)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, head, raw[split + 4..].to_vec()))
}

fn serve(extra: &[&str]) -> (Served, u16) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_imajev-serve"))
        .args(["serve", "--demo", "--port", &port.to_string(), "--http-workers", "1"])
        .args(extra)
        .env_remove("IMAJEV_NO_PLAYGROUND")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let served = Served(child);
    let t = Instant::now();
    while get(port, "GET", "/healthz").is_none() {
        assert!(t.elapsed() < Duration::from_secs(120), "the server did not start listening");
        std::thread::sleep(Duration::from_millis(100));
    }
    (served, port)
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| l.strip_prefix(&format!("{name}:")).map(str::trim))
}

#[test]
fn the_playground_is_served_unless_turned_off() {
    let (_on, port) = serve(&[]);
    let (status, head, body) = get(port, "GET", "/").unwrap();
    assert_eq!(status, 200);
    assert_eq!(header(&head, "content-type"), Some("text/html; charset=utf-8"));
    let csp = imajev_serve::api::playground::CONTENT_SECURITY_POLICY.to_ascii_lowercase();
    assert_eq!(header(&head, "content-security-policy"), Some(csp.as_str()));
    assert!(String::from_utf8(body)
        .unwrap()
        .contains("<script src=\"/playground/playground.js\" defer></script>"));
    let (status, head, _) = get(port, "GET", "/playground/playground.js").unwrap();
    assert_eq!((status, header(&head, "content-type")), (200, Some("text/javascript; charset=utf-8")));
    // The API around it is unchanged: unknown paths are still the API's 404.
    let (status, _, body) = get(port, "GET", "/playground/nothing").unwrap();
    assert_eq!(status, 404);
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&body).unwrap()["error"], "not_found");

    let (_off, port) = serve(&["--no-playground"]);
    for path in ["/", "/playground/playground.js"] {
        let (status, head, body) = get(port, "GET", path).unwrap();
        assert_eq!(status, 404, "{path} with --no-playground");
        assert!(header(&head, "content-security-policy").is_none());
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"], "not_found", "{path}: {v}");
    }
    assert_eq!(get(port, "GET", "/openapi.json").unwrap().0, 200, "the API is served without the playground");
}
