//! The built `imajev-serve` binary as a real process, for the tests that talk to it over TCP:
//! a command without the caller's `IMAJEV_*` environment, a free port, a demo server that is
//! killed when its handle drops (its log kept in a file, so a test can read what it logged), and
//! one-request-per-connection HTTP.

use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The built binary, without the caller's `IMAJEV_*` environment (a test sets what it needs).
pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_imajev-serve"));
    for (k, _) in std::env::vars() {
        if k.starts_with("IMAJEV_") {
            c.env_remove(k);
        }
    }
    c.env("NO_COLOR", "1");
    c
}

/// A port nobody listens on (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A running `imajev-serve serve --demo`; killed (if still running) when dropped.
pub struct Served {
    pub port: u16,
    pub child: Child,
    /// Its stderr (the logs).
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Served {
    /// `serve --demo --port P` plus `args`, once `/healthz` answers 200.
    pub fn demo(args: &[&str]) -> Served {
        let port = free_port();
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let log = dir.path().join("server.log");
        let child = bin()
            .args(["serve", "--demo", "--port", &port.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let served = Served { port, child, log, _dir: dir };
        let t = Instant::now();
        while http(port, "GET", "/healthz", None).map(|r| r.0) != Some(200) {
            assert!(
                t.elapsed() < Duration::from_secs(180),
                "the demo server never became ready:\n{}",
                served.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        served
    }

    /// What the server logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `POST /v1/systemone` with `body`: (status, JSON body or null).
    pub fn post(&self, body: &Value) -> (u16, Value) {
        let (status, text) = http(self.port, "POST", "/v1/systemone", Some(body)).expect("an answer");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// The process's resident memory (VmRSS), bytes.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS in /proc/PID/status");
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib << 10
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        // SAFETY: kill(2) on the pid of our own child.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) }, 0);
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request on its own connection (`Connection: close`): (status, body).
pub fn http(port: u16, method: &str, path: &str, json: Option<&Value>) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let body = json.map(|j| serde_json::to_vec(j).unwrap()).unwrap_or_default();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    if json.is_some() {
        head += &format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    }
    s.write_all(format!("{head}\r\n").as_bytes()).ok()?;
    s.write_all(&body).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let raw = String::from_utf8(raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    assert!(!head.to_ascii_lowercase().contains("transfer-encoding: chunked"), "{head}");
    Some((head.split(' ').nth(1)?.parse().ok()?, body.to_string()))
}
