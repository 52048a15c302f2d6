//! The container's start logic without Docker: runtime/entrypoint.sh run on a synthetic release
//! (verify against a lock, then serve; a tampered file refused before serving; the released flags
//! of runtime/serve.env applied unless set; `--demo` only when asked; a missing release answered
//! with the download commands), and runtime/serve.env kept equal to the manifest's recipe.

mod common;

use common::fixtures;
use imajev_serve::release::Manifest;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_imajev-serve"))
}

/// runtime/serve.env as name → value.
fn serve_env() -> BTreeMap<String, String> {
    std::fs::read_to_string(repo().join("runtime/serve.env"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("serve.env line without '=': {l}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

#[test]
fn serve_env_is_the_manifest_recipe_in_the_container_layout() {
    let m = Manifest::builtin();
    let r = &m.recipe;
    let want: BTreeMap<String, String> = [
        ("IMAJEV_MODEL", format!("/models/{}", m.base.folder)),
        ("IMAJEV_ADAPTER", format!("/models/{}", m.adapter.folder)),
        ("IMAJEV_CALIBRATION", format!("/models/{}/{}", m.adapter.folder, r.calibration)),
        ("IMAJEV_DEVICE", r.device.clone()),
        ("IMAJEV_QUANTIZE", r.quantize.clone()),
        ("IMAJEV_ROTATIONS", r.rotations.to_string()),
        ("IMAJEV_CONTRACT", r.contract.clone()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(serve_env(), want);
}

/// runtime/entrypoint.sh with a clean IMAJEV_* environment, this build's binary and `env`.
fn entrypoint(env: &[(&str, &str)], args: &[&str]) -> Command {
    let mut c = Command::new("sh");
    c.arg(repo().join("runtime/entrypoint.sh")).args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("IMAJEV_") {
            c.env_remove(k);
        }
    }
    c.env("IMAJEV_BIN", env!("CARGO_BIN_EXE_imajev-serve")).env("IMAJEV_LOG_FORMAT", "text");
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// Runs to completion, killing it after `limit`.
fn run_within(mut c: Command, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    loop {
        if child.try_wait().unwrap().is_some() {
            return (child.wait_with_output().unwrap(), started.elapsed());
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `GET path` → (status, body); None while nothing listens.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let status = raw.split(' ').nth(1)?.parse().ok()?;
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((status, body))
}

/// A server process started in the background; killed if the test fails.
struct Running {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Running {
    fn start(mut c: Command, port: u16, log: PathBuf) -> Self {
        let f = std::fs::File::create(&log).unwrap();
        let child = c.stdout(f.try_clone().unwrap()).stderr(f).spawn().unwrap();
        Running { child, port, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_ready(&mut self, limit: Duration) {
        let started = Instant::now();
        while started.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the server exited ({status}) before it was ready:\n{}", self.log());
            }
            if matches!(get(self.port, "/healthz"), Some((200, _))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("not ready after {limit:?}:\n{}", self.log());
    }

    /// SIGTERM (what `docker stop` sends) and the exit status.
    fn stop(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let started = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no exit 30 s after SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A pinned synthetic release: (model, adapter, lock).
fn pinned_synth_release(root: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let (model, adapter, lock) = (root.join("model"), root.join("adapter"), root.join("release.lock.json"));
    let st = bin()
        .args(["synth", "--config", "tiny", "--seed", "11", "--out"])
        .arg(&model)
        .arg("--adapter-out")
        .arg(&adapter)
        .args(["--lora-rank", "8", "--lora-alpha", "16", "--readout-rows", "256"])
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::copy(fixtures().join("release/calibration-rot4.json"), adapter.join("calibration-rot4.json"))
        .unwrap();
    let out = bin()
        .arg("verify")
        .arg("--pin")
        .arg("--manifest")
        .arg(fixtures().join("release/tiny-manifest.json"))
        .arg("--lock")
        .arg(&lock)
        .arg("--model")
        .arg(&model)
        .arg("--adapter")
        .arg(&adapter)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    (model, adapter, lock)
}

fn synth_env<'a>(
    model: &'a str,
    adapter: &'a str,
    calibration: &'a str,
    lock: &'a str,
    manifest: &'a str,
    port: &'a str,
) -> Vec<(&'static str, &'a str)> {
    vec![
        ("IMAJEV_MODEL", model),
        ("IMAJEV_ADAPTER", adapter),
        ("IMAJEV_CALIBRATION", calibration),
        ("IMAJEV_LOCK", lock),
        ("IMAJEV_MANIFEST", manifest),
        ("IMAJEV_HOST", "127.0.0.1"),
        ("IMAJEV_PORT", port),
        // The caller's settings win over serve.env's cuda/fp8 (this machine has no GPU).
        ("IMAJEV_DEVICE", "cpu"),
        ("IMAJEV_QUANTIZE", "none"),
    ]
}

#[test]
fn the_entrypoint_verifies_a_pinned_release_then_serves_it_and_refuses_it_once_tampered() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, adapter, lock) = pinned_synth_release(tmp.path());
    let manifest = fixtures().join("release/tiny-manifest.json");
    let calibration = adapter.join("calibration-rot4.json");
    let port = free_port();
    let (m, a, c, l, mf, p) = (
        model.to_str().unwrap(),
        adapter.to_str().unwrap(),
        calibration.to_str().unwrap(),
        lock.to_str().unwrap(),
        manifest.to_str().unwrap(),
        port.to_string(),
    );
    let env = synth_env(m, a, c, l, mf, &p);

    let mut server = Running::start(entrypoint(&env, &[]), port, tmp.path().join("serve.log"));
    server.wait_ready(Duration::from_secs(120));
    let log = server.log();
    assert!(log.contains("checking the release against the lock"), "{log}");
    assert!(log.contains("checks passed"), "{log}");
    // The release facts come from the manifest the server was given.
    let (status, body) = get(port, "/v1/models").unwrap();
    assert_eq!(status, 200, "{body}");
    let models: serde_json::Value = serde_json::from_str(&body).unwrap();
    let fixture = Manifest::load(&manifest).unwrap();
    assert_eq!(models["models"][0]["name"], fixture.release.name.as_str());
    assert_eq!(models["models"][0]["description"], fixture.release.description.as_str());
    assert_eq!(models["models"][0]["release_date"], fixture.release.release_date.as_str());
    assert_eq!(get(port, "/livez").map(|r| r.0), Some(200));
    // The image's HEALTHCHECK.
    let hc = Command::new("bash")
        .arg(repo().join("runtime/healthcheck.sh"))
        .env("IMAJEV_PORT", &p)
        .status()
        .unwrap();
    assert!(hc.success());
    assert!(server.stop().success(), "SIGTERM must drain and exit 0");
    let hc = Command::new("bash")
        .arg(repo().join("runtime/healthcheck.sh"))
        .env("IMAJEV_PORT", &p)
        .status()
        .unwrap();
    assert!(!hc.success(), "nothing listens any more");

    // One byte of the LoRA flipped: the entrypoint stops before the server starts.
    let lora = adapter.join("adapter_model.safetensors");
    let mut bytes = std::fs::read(&lora).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&lora, bytes).unwrap();
    let (out, _) = run_within(entrypoint(&env, &[]), Duration::from_secs(60));
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("adapter/adapter_model.safetensors") && t.contains("REFUSED"), "{t}");
    assert!(t.contains("not serving it"), "{t}");
    assert!(!t.contains("serving POST"), "the server must not start:\n{t}");
}

#[test]
fn the_entrypoint_without_a_release_exits_with_the_download_commands() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    std::fs::create_dir(&models).unwrap();
    let (base, adapter) = (models.join("Qwen3.5-4B"), models.join("imajev-4b"));
    // The image's defaults (serve.env: cuda, fp8) with the empty mount: refused before any device
    // is touched, with the commands that fetch the release.
    let env = [
        ("IMAJEV_MODEL", base.to_str().unwrap()),
        ("IMAJEV_ADAPTER", adapter.to_str().unwrap()),
        ("IMAJEV_PORT", "0"),
    ];
    let (out, took) = run_within(entrypoint(&env, &[]), Duration::from_secs(30));
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    for cmd in Manifest::builtin().download_commands("models") {
        assert!(t.contains(&cmd), "missing {cmd:?} in:\n{t}");
    }
    assert!(t.contains("serve --demo"), "{t}");
}

#[test]
fn the_entrypoint_serves_the_demo_only_when_asked_and_without_the_released_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let p = port.to_string();
    // serve.env's IMAJEV_DEVICE=cuda would fail here: --demo must not get it.
    let env = [("IMAJEV_HOST", "127.0.0.1"), ("IMAJEV_PORT", p.as_str())];
    let mut server =
        Running::start(entrypoint(&env, &["serve", "--demo"]), port, tmp.path().join("demo.log"));
    server.wait_ready(Duration::from_secs(120));
    let (_, body) = get(port, "/v1/models").unwrap();
    let models: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["models"][0]["name"], "imajev-demo", "{body}");
    assert!(server.log().contains("DEMO MODE"), "{}", server.log());
    assert!(server.stop().success());
}
