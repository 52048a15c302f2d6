//! The serving process seen from outside: the port is bound before the model loads (a taken port
//! fails at once), `/livez` answers while the model loads and `/healthz` only once it is ready, a
//! model that fails to load ends the process with its cause, incomplete folders are refused before
//! anything loads, `decide` answers every JSONL line (or gives its error object), and the demo
//! and the logs behave as the README says.

mod common;

use common::server::{bin, free_port};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The tiny synthetic model and adapter, written once for all tests of this file (under
/// cargo's target/tmp, so nothing is left elsewhere).
fn synth() -> (&'static Path, &'static Path) {
    static DIRS: OnceLock<(tempfile::TempDir, PathBuf, PathBuf)> = OnceLock::new();
    let (_, m, a) = DIRS.get_or_init(|| {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let (m, a) = (dir.path().join("model"), dir.path().join("adapter"));
        let st = bin()
            .args(["synth", "--config", "tiny", "--seed", "4", "--out"])
            .arg(&m)
            .arg("--adapter-out")
            .arg(&a)
            .args(["--lora-rank", "4", "--lora-alpha", "8", "--readout-rows", "256"])
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success());
        (dir, m, a)
    });
    (m, a)
}

/// A copy of the synthetic model folder whose `model.safetensors` is `replace`d.
fn model_copy(root: &Path, replace: impl FnOnce(&Path)) -> PathBuf {
    let (m, _) = synth();
    let dir = root.join("model");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(m).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
        }
    }
    replace(&dir.join("model.safetensors"));
    dir
}

fn get(port: u16, path: &str) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let status = raw.split(' ').nth(1)?.parse().ok()?;
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Some((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

/// Waits for the process to end within `limit` (killing it and failing otherwise).
fn finish(mut child: Child, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return (child.wait_with_output().unwrap(), started.elapsed());
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("still running after {limit:?}; stderr:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A model whose `model.safetensors` is a FIFO: the engine's open() blocks until the test opens
/// the other end, so the test decides how long "loading" lasts.
fn blocked_model(root: &Path) -> PathBuf {
    model_copy(root, |p| assert!(Command::new("mkfifo").arg(p).status().unwrap().success()))
}

#[test]
fn a_taken_port_fails_at_once_even_while_the_model_would_still_load() {
    let tmp = tempfile::tempdir().unwrap();
    let model = blocked_model(tmp.path());
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let child = bin()
        .args(["serve", "--device", "cpu", "--port", &port, "--model"])
        .arg(&model)
        .arg("--adapter")
        .arg(synth().1)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The model never finishes loading; the port error must not wait for it.
    let (out, took) = finish(child, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert!(stderr(&out).contains(&format!("binding 127.0.0.1:{port}")), "{}", stderr(&out));
    assert!(stderr(&out).contains("choose another with --port"), "{}", stderr(&out));
}

#[test]
fn livez_answers_while_loading_and_a_failed_load_ends_the_process_with_its_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let model = blocked_model(tmp.path());
    let port = free_port();
    let child = bin()
        .args(["serve", "--device", "cpu", "--port", &port.to_string(), "--model"])
        .arg(&model)
        .arg("--adapter")
        .arg(synth().1)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let live = loop {
        if let Some(r) = get(port, "/livez") {
            break r;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the port was not served while loading");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(live, (200, serde_json::json!({"status": "alive", "model": "loading"})));
    let (status, body) = get(port, "/healthz").unwrap();
    assert_eq!((status, body["status"].as_str()), (503, Some("loading")));
    // Let the engine's open() return: mapping a FIFO fails, so the load fails.
    drop(std::fs::OpenOptions::new().write(true).open(model.join("model.safetensors")).unwrap());
    let (out, _) = finish(child, Duration::from_secs(30));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or("");
    assert!(last.starts_with("error: the model failed to load, so the server stopped"), "{err}");
    assert!(last.contains("model.safetensors") && last.contains("imajev-serve verify"), "{err}");
}

#[test]
fn a_load_failure_on_a_missing_gpu_ends_the_process_and_names_the_cpu_fix() {
    if Path::new("/dev/nvidiactl").exists() {
        eprintln!("a GPU is present: --device cuda would load; nothing to check here");
        return;
    }
    let (m, a) = synth();
    // --device cuda, and --device auto with --quantize (which only a GPU can do): the port is
    // bound, the load fails in the background, and the process ends with the cause and the fix.
    for flags in [&["--device", "cuda"][..], &["--device", "auto", "--quantize", "fp8"]] {
        let child = bin()
            .arg("serve")
            .args(flags)
            .args(["--port", "0", "--model"])
            .arg(m)
            .arg("--adapter")
            .arg(a)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (out, took) = finish(child, Duration::from_secs(30));
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {err}");
        assert!(took < Duration::from_secs(10), "{flags:?} took {took:?}");
        let last = err.lines().last().unwrap_or("");
        assert!(
            last.starts_with("error: the model failed to load, so the server stopped"),
            "{flags:?}: {err}"
        );
        // The fix: make the GPU visible (Docker: --gpus all) or serve on the CPU.
        assert!(last.contains("--gpus all") && last.contains("--device cpu"), "{flags:?}: {err}");
    }
}

#[test]
fn incomplete_folders_and_impossible_flags_are_refused_before_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, a) = synth();
    let no_weights = model_copy(&tmp.path().join("a"), |_| {});
    let run = |args: &[&str], model: &Path| {
        let out =
            bin().arg("serve").args(args).arg("--model").arg(model).arg("--adapter").arg(a).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        stderr(&out)
    };
    let err = run(&["--port", "0"], &no_weights);
    assert!(err.contains("holds no model.safetensors"), "{err}");
    let err = run(&["--port", "0", "--device", "cpu", "--quantize", "fp8"], m);
    assert!(err.contains("--quantize fp8 needs a GPU"), "{err}");
    let err = run(&["--port", "0"], &tmp.path().join("nowhere"));
    assert!(
        err.contains("does not exist or is empty") && err.contains("hf download Qwen/Qwen3.5-4B"),
        "{err}"
    );
    let out = bin().args(["serve", "--rotations", "0", "--demo"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "clap refuses --rotations 0: {}", stderr(&out));
    // No model and no --demo: the release's download commands, and the demo.
    let out = bin().args(["serve", "--port", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no model to serve") && stderr(&out).contains("serve --demo"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn decide_answers_every_jsonl_line_or_gives_its_error_object_and_fails_if_any_failed() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, a) = synth();
    let good = r#"{"state": {"t": "x"}, "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}"#;
    let reqs = tmp.path().join("reqs.jsonl");
    let invalid = r#"{"state": {}, "questions": {"q": {"type": "choice", "instructions": "Which?", "criteria": {"only": "one"}}}}"#;
    std::fs::write(&reqs, format!("{good}\n{{not json\n\n{invalid}\n{good}\n")).unwrap();
    let out = bin()
        .args(["decide", "--device", "cpu", "--rotations", "1", "--request"])
        .arg(&reqs)
        .arg("--model")
        .arg(m)
        .arg("--adapter")
        .arg(a)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let lines: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    // One output line per request, in input order; line numbers count the blank line.
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[0]["answers"]["q"]["type"], "noul");
    assert_eq!(lines[1]["error"], "bad_json");
    assert_eq!((lines[1]["status"].as_u64(), lines[1]["line"].as_u64()), (Some(422), Some(2)));
    assert_eq!(lines[2]["error"], "invalid_request");
    assert_eq!((lines[2]["status"].as_u64(), lines[2]["line"].as_u64()), (Some(422), Some(4)));
    assert_eq!(lines[2]["detail"][0]["loc"], serde_json::json!(["body", "questions", "q", "criteria"]));
    assert_eq!(lines[3]["answers"], lines[0]["answers"]);
    let err = stderr(&out);
    assert!(
        err.contains("2 of 4 requests failed") && err.contains("line 2:") && err.contains("line 4:"),
        "{err}"
    );
    // All good: exit 0.
    std::fs::write(&reqs, format!("{good}\n")).unwrap();
    let out = bin()
        .args(["decide", "--device", "cpu", "--request"])
        .arg(&reqs)
        .arg("--model")
        .arg(m)
        .arg("--adapter")
        .arg(a)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn the_demo_runs_only_when_asked_and_says_so_in_the_log_format_asked_for() {
    let port = free_port();
    let mut child = bin()
        .args(["serve", "--demo", "--port", &port.to_string()])
        .env("IMAJEV_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !matches!(get(port, "/healthz"), Some((200, _))) {
        assert!(started.elapsed() < Duration::from_secs(120), "the demo did not get ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, models) = get(port, "/v1/models").unwrap();
    assert_eq!(models["models"][0]["name"], "imajev-demo");
    assert_eq!(get(port, "/livez"), Some((200, serde_json::json!({"status": "alive", "model": "ready"}))));
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(child.wait().unwrap().success());
    // Every line is JSON (the banner too), fields print as values, not Rust debug, and
    // milliseconds carry one decimal.
    let lines: Vec<Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["fields"]["message"].as_str().is_some_and(|m| m.contains("DEMO MODE"))),
        "{err}"
    );
    assert!(!err.contains("Some("), "{err}");
    // The default --device auto without a GPU: a warning with its cause, not a quiet INFO line.
    if !Path::new("/dev/nvidiactl").exists() {
        let fallback = lines.iter().find(|l| {
            l["fields"]["message"].as_str().is_some_and(|m| m.starts_with("--device auto: no usable GPU"))
        });
        assert!(fallback.is_some_and(|l| l["level"] == "WARN" && l["fields"]["cause"].is_string()), "{err}");
    }
    let listening =
        lines.iter().find(|l| l["fields"]["message"].as_str().is_some_and(|m| m.starts_with("listening")));
    assert!(listening.is_some_and(|l| l["fields"]["contract"] == "imajev"), "{err}");
    let decimals = |v: &Value| v.to_string().split('.').nth(1).map_or(0, str::len);
    let timed: Vec<&Value> = lines.iter().filter(|l| l["fields"]["ms"].is_number()).collect();
    assert!(timed.len() >= 3, "the GETs above are logged with their ms: {err}");
    for l in timed {
        assert!(decimals(&l["fields"]["ms"]) <= 1, "ms in {l}");
    }
    let loaded = lines.iter().find(|l| l["fields"]["message"] == "model loaded").expect("a load line");
    assert!(
        loaded["fields"]["load_seconds"].is_number() && decimals(&loaded["fields"]["load_seconds"]) <= 2,
        "{loaded}"
    );
}

#[test]
fn tokenize_needs_no_model_folder() {
    let run = |model: Option<&Path>| {
        let mut c = bin();
        c.arg("tokenize");
        if let Some(m) = model {
            c.arg("--model").arg(m);
        }
        let mut child = c.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all("Printer shows E-204 — Zoë".as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    // The synthetic model folder holds the same Qwen3.5 tokenizer.json as the built-in one.
    assert_eq!(run(None), run(Some(synth().0)));
    assert!(run(None).starts_with('['));
}

#[test]
fn version_names_the_commit_it_was_built_from() {
    let out = bin().arg("--version").output().unwrap();
    let v = String::from_utf8(out.stdout).unwrap();
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8(o.stdout).unwrap().trim().to_string());
    let want = head.unwrap_or_else(|| "unknown".into());
    assert_eq!(v.trim(), format!("imajev-serve {} (commit {want})", env!("CARGO_PKG_VERSION")));
}
