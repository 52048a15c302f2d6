//! The HTTP API end to end: a real server on 127.0.0.1 with the tiny synthetic Qwen3.5 on the
//! CPU, driven by a minimal HTTP/1.1 client (so disconnects and raw framing are real).

mod common;

use common::TinyModel;
use imajev_serve::api::{
    build_app_state, decide_direct, run_engine, run_http_server, RequestBody, ServerConfig,
};
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::decision::{Codebook, ContractMode, Decider, DecisionSettings, Plan};
use imajev_serve::engine::Qwen35;
use imajev_serve::image::{ImageProcessorConfig, PatchedImage};
use imajev_serve::synth::{self, SynthDtype};
use imajev_serve::tokenizer::QwenTokenizer;
use imajev_serve::worker::{
    self, BatchLimits, DecisionEngine, EngineMetrics, EngineOutput, RunError, StopReason,
};
use serde_json::{json, Value};
use sha2::Digest;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

// ------------------------------------------------------------------------------------ fixtures

struct Models {
    tiny: TinyModel,
    /// An adapter for the same model with a 256-row readout (255 options).
    adapter256: PathBuf,
    _dir: tempfile::TempDir,
}

fn models() -> &'static Models {
    static M: OnceLock<Models> = OnceLock::new();
    M.get_or_init(|| {
        let tiny = common::tiny(SynthDtype::Bf16, 7);
        let dir = tempfile::tempdir().unwrap();
        let adapter256 = dir.path().join("adapter256");
        synth::write_adapter(&synth::preset("tiny").unwrap(), 4, 8.0, 256, 7, &adapter256).unwrap();
        Models { tiny, adapter256, _dir: dir }
    })
}

fn tokenizer() -> Arc<QwenTokenizer> {
    static T: OnceLock<Arc<QwenTokenizer>> = OnceLock::new();
    T.get_or_init(|| Arc::new(QwenTokenizer::from_model_dir(&models().tiny.model).unwrap())).clone()
}

/// Runs the real engine after a pause (to hold the queue).
struct Slow {
    inner: Box<dyn DecisionEngine>,
    delay: Duration,
}

impl DecisionEngine for Slow {
    fn run(
        &self,
        plan: &Plan,
        images: &[&PatchedImage],
        limits: BatchLimits,
        keep_going: &dyn Fn() -> Result<(), StopReason>,
    ) -> Result<EngineOutput, RunError> {
        std::thread::sleep(self.delay);
        self.inner.run(plan, images, limits, keep_going)
    }
    fn backend_name(&self) -> String {
        format!("slow {}", self.inner.backend_name())
    }
    fn readout_rows(&self) -> Option<usize> {
        self.inner.readout_rows()
    }
}

#[derive(Clone)]
struct Setup {
    mode: ContractMode,
    api_keys: Vec<String>,
    queue_depth: usize,
    slow: Option<Duration>,
    rows256: bool,
    rotations: usize,
    max_input_tokens: usize,
    request_timeout: Duration,
    /// Loading waits until this file exists.
    hold_load: Option<PathBuf>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            mode: ContractMode::Imajev,
            api_keys: vec![],
            queue_depth: 16,
            slow: None,
            rows256: false,
            rotations: 2,
            max_input_tokens: 8192,
            request_timeout: Duration::from_secs(30),
            hold_load: None,
        }
    }
}

struct Server {
    addr: SocketAddr,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    http: Mutex<Option<JoinHandle<anyhow::Result<()>>>>,
    engine: Mutex<Option<JoinHandle<()>>>,
}

const MAX_BODY: usize = 32 << 20;

fn start(s: Setup) -> Server {
    let m = models();
    let adapter = if s.rows256 { m.adapter256.clone() } else { m.tiny.adapter.clone() };
    let rows = if s.rows256 { 256 } else { 12 };
    let tok = tokenizer();
    let codebook = Codebook::for_adapter(&adapter, &tok, rows).unwrap();
    let settings = DecisionSettings {
        rotations: s.rotations,
        calibration: None,
        mode: s.mode,
        max_input_tokens: s.max_input_tokens,
        model_name: "imajev-test".into(),
    };
    let decider = Arc::new(Decider::new(tok, codebook, settings));
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(EngineMetrics::new(&registry).unwrap());
    let model_dir = m.tiny.model.clone();
    let (hold, slow) = (s.hold_load.clone(), s.slow);
    let (handle, engine) = worker::spawn(
        move || {
            if let Some(h) = hold {
                while !h.exists() {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let e: Box<dyn DecisionEngine> =
                Box::new(Qwen35::load(CpuBackend::default(), &model_dir, Some(&adapter))?);
            Ok(match slow {
                Some(delay) => Box::new(Slow { inner: e, delay }),
                None => e,
            })
        },
        s.queue_depth,
        BatchLimits::default(),
        metrics,
    );
    let cfg = ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        workers: 2,
        max_body_bytes: MAX_BODY,
        api_keys: s.api_keys.clone(),
        request_timeout: s.request_timeout,
        adapter_label: Some("tiny-adapter".into()),
        ..ServerConfig::default()
    };
    let state = build_app_state(
        &cfg,
        handle,
        registry,
        ImageProcessorConfig::default(), /* from_model_dir fails: src/image Triple + arbitrary_precision */
    )
    .unwrap();
    state.set_decider(decider);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let http = std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(run_http_server(listener, cfg, state, async move {
            let _ = rx.await;
        }))
    });
    let server = Server {
        addr,
        stop: Mutex::new(Some(tx)),
        http: Mutex::new(Some(http)),
        engine: Mutex::new(Some(engine)),
    };
    if s.hold_load.is_none() {
        server.wait_ready();
    }
    server
}

impl Server {
    fn wait_ready(&self) {
        let t = Instant::now();
        loop {
            if let Ok(r) = try_request(self.addr, "GET", "/healthz", &[], b"") {
                if r.status == 200 {
                    return;
                }
            }
            assert!(t.elapsed() < Duration::from_secs(60), "server never became ready");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn req(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
        request(self.addr, method, path, headers, body)
    }

    fn post_json(&self, body: &Value) -> Resp {
        self.req(
            "POST",
            "/v1/systemone",
            &[("Content-Type", "application/json")],
            &serde_json::to_vec(body).unwrap(),
        )
    }

    fn metric(&self, name_and_labels: &str) -> f64 {
        let text = String::from_utf8(self.req("GET", "/metrics", &[], b"").body).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name_and_labels).and_then(|rest| rest.trim().parse::<f64>().ok()))
            .unwrap_or(0.0)
    }

    /// Waits (≤ 20 s) until a metric line reaches `at_least`.
    fn wait_metric(&self, name_and_labels: &str, at_least: f64) {
        let t = Instant::now();
        while self.metric(name_and_labels) < at_least {
            assert!(t.elapsed() < Duration::from_secs(20), "{name_and_labels} never reached {at_least}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops the server gracefully; returns once the HTTP server has stopped.
    fn shutdown(&self) {
        if let Some(tx) = self.stop.lock().unwrap().take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.http.lock().unwrap().take() {
            h.join().unwrap().unwrap();
        }
    }

    /// Whether the engine thread ends within `within` (after [`Server::shutdown`]).
    fn engine_stops(&self, within: Duration) -> bool {
        let Some(e) = self.engine.lock().unwrap().take() else { return true };
        let t = Instant::now();
        while !e.is_finished() {
            if t.elapsed() > within {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        e.join().unwrap();
        true
    }
}

/// The shared default server (imajev contract, 12-row readout, rotations 2).
fn main_server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| start(Setup::default()))
}

// ------------------------------------------------------------------------------------ client

#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    fn code(&self) -> String {
        self.json()["error"].as_str().unwrap_or("").to_string()
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).to_string()
    }
}

fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
    try_request(addr, method, path, headers, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Resp> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-length")) {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut msg = head.into_bytes();
    msg.extend_from_slice(body);
    // The server may answer (and close) before reading everything; the answer still counts.
    let _ = s.write_all(&msg);
    let mut raw = Vec::new();
    if let Err(e) = s.read_to_end(&mut raw) {
        if raw.is_empty() {
            return Err(e);
        }
    }
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> std::io::Result<Resp> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("no header end"))?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| bad("head not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("status"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[end + 4..].to_vec();
    if headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked")) {
        let mut out = Vec::new();
        let mut rest = &body[..];
        loop {
            let nl = rest.windows(2).position(|w| w == b"\r\n").ok_or_else(|| bad("chunk"))?;
            let n = usize::from_str_radix(std::str::from_utf8(&rest[..nl]).unwrap().trim(), 16)
                .map_err(|_| bad("chunk size"))?;
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[nl + 2..nl + 2 + n]);
            rest = &rest[nl + 4 + n..];
        }
        body = out;
    }
    Ok(Resp { status, headers, body })
}

fn multipart(parts: &[(&str, Option<&str>, &str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "imajevTestBoundary7MA4YWxkTrZu0gW";
    let mut body = Vec::new();
    for (name, filename, ctype, data) in parts {
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"").as_bytes(),
        );
        if let Some(f) = filename {
            body.extend_from_slice(format!("; filename=\"{f}\"").as_bytes());
        }
        body.extend_from_slice(format!("\r\nContent-Type: {ctype}\r\n\r\n").as_bytes());
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

// ------------------------------------------------------------------------------------ data

fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x * 7) as u8 ^ seed, (y * 5) as u8, seed.wrapping_mul(3)])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

fn jpeg(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 3) as u8, (y * 3) as u8, 128]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Jpeg).unwrap();
    out.into_inner()
}

fn b64(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(b)
}

fn data_url(b: &[u8]) -> String {
    format!("data:image/png;base64,{}", b64(b))
}

fn sha(b: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(b))
}

fn noul(i: &str) -> Value {
    json!({"type": "noul", "instructions": i})
}

fn valid() -> Value {
    json!({
        "model": "jev-latest",
        "state": {"ticket": "The printer on floor 3 is jammed again."},
        "questions": {
            "hw": noul("Is it a hardware problem?"),
            "team": {"type": "choice", "instructions": "Which team?", "criteria": {"infra": "servers", "facilities": {"owns": ["printers"]}, "it": null}},
            "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]},
            "tags": {"type": "multi", "instructions": "Which tags apply?", "criteria": {"printer": null, "network": "cables"}, "threshold": 0.4}
        }
    })
}

fn assert_answers_shape(body: &Value, typesafe: bool) {
    let a = &body["answers"];
    let x = if typesafe { "x_" } else { "" };
    assert_eq!(body["model"], "imajev-test");
    let p = a["hw"]["noul"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&p));
    assert!(a["hw"].get("confidence").is_none());
    assert!(a["hw"][format!("{x}unknown_probability")].is_number(), "{a}");
    let probs = a["team"]["probabilities"].as_object().unwrap();
    assert_eq!(probs.keys().collect::<Vec<_>>(), ["infra", "facilities", "it"]);
    assert!((probs.values().map(|v| v.as_f64().unwrap()).sum::<f64>() - 1.0).abs() < 1e-9);
    assert!(probs.contains_key(a["team"]["choice"].as_str().unwrap()));
    let s = &a["urgency"];
    let expect: f64 = (0..3).map(|i| i as f64 * s["probabilities"][i.to_string()].as_f64().unwrap()).sum();
    assert!((s["score"].as_f64().unwrap() - expect).abs() < 1e-12);
    assert_eq!(s["legend"], json!({"0": "can wait", "1": "this week", "2": "today"}));
    if let Some(t) = a.get("tags") {
        assert_eq!(t["type"], "multi");
        assert_eq!(t["threshold"], 0.4);
    }
    let u = &body["usage"];
    assert!(u["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(u["output_tokens"], 0);
    // The response round-trips through the schema types: they describe it completely.
    let typed: imajev_serve::api::schema::SystemOneResponse = serde_json::from_value(body.clone()).unwrap();
    assert_eq!(&serde_json::to_value(typed).unwrap(), body);
}

// ------------------------------------------------------------------------------------ tests

#[test]
fn answers_a_valid_request_with_request_ids() {
    let s = main_server();
    let r = s.post_json(&valid());
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("content-type").unwrap().starts_with("application/json"));
    let id = r.header("x-request-id").unwrap().to_string();
    assert_eq!(id.len(), 32);
    assert_eq!(r.header("x-typesafe-request-id"), Some(id.as_str()));
    let body = r.json();
    assert_answers_shape(&body, false);
    assert_eq!(
        body["answers"].as_object().unwrap().keys().collect::<Vec<_>>(),
        ["hw", "team", "urgency", "tags"]
    );
    // A sane incoming id is echoed; an insane one is replaced.
    let body = serde_json::to_vec(&valid()).unwrap();
    let r = s.req(
        "POST",
        "/v1/systemone",
        &[("Content-Type", "application/json"), ("X-Request-Id", "abc-123.x:y_z")],
        &body,
    );
    assert_eq!(r.header("x-request-id"), Some("abc-123.x:y_z"));
    assert_eq!(r.header("x-typesafe-request-id"), Some("abc-123.x:y_z"));
    let r = s.req(
        "POST",
        "/v1/systemone",
        &[("Content-Type", "application/json"), ("X-Request-Id", "bad id {}")],
        &body,
    );
    assert_ne!(r.header("x-request-id"), Some("bad id {}"));
    // Error responses carry them too.
    let r = s.req("GET", "/nope", &[], b"");
    assert_eq!(r.status, 404);
    assert!(r.header("x-request-id").is_some());
    // Any Authorization header is accepted when no keys are configured; charset param accepted.
    let r = s.req(
        "POST",
        "/v1/systemone",
        &[("Content-Type", "application/json; charset=utf-8"), ("Authorization", "Bearer whatever")],
        &body,
    );
    assert_eq!(r.status, 200);
    // Question ids are never shown to the model: renaming them keeps the answers.
    let mut renamed = valid();
    let q = renamed["questions"].as_object_mut().unwrap();
    let hw = q.remove("hw").unwrap();
    q.insert("질문 🎯 with space.1".into(), hw);
    let a = s.post_json(&valid()).json();
    let b = s.post_json(&renamed).json();
    assert_eq!(a["answers"]["hw"]["noul"], b["answers"]["질문 🎯 with space.1"]["noul"]);
    assert_eq!(a["answers"]["team"], b["answers"]["team"]);
}

#[test]
fn compressed_bodies_give_the_same_answers() {
    let s = main_server();
    let raw = serde_json::to_vec(&valid()).unwrap();
    let plain = s.post_json(&valid()).json();
    let z = zstd::encode_all(&raw[..], 3).unwrap();
    let r = s.req(
        "POST",
        "/v1/systemone",
        &[("Content-Type", "application/json"), ("Content-Encoding", "zstd")],
        &z,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["answers"], plain["answers"]);
    let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    g.write_all(&raw).unwrap();
    let gz = g.finish().unwrap();
    let r = s.req(
        "POST",
        "/v1/systemone",
        &[("Content-Type", "application/json"), ("Content-Encoding", "gzip")],
        &gz,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["answers"], plain["answers"]);
}

#[test]
fn two_images_in_every_encoding_give_the_same_answers() {
    let s = main_server();
    let (a, b) = (png(40, 30, 1), jpeg(48, 64));
    let q = json!({"same": noul("Do [image 1] and [image 2] show the same thing?"), "kind": {"type": "choice", "instructions": "What is it?", "criteria": {"photo": null, "drawing": null}}});
    // JSON data URLs.
    let r = s.post_json(
        &json!({"state": {"note": "two photos"}, "images": [data_url(&a), data_url(&b)], "questions": q}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let base = r.json();
    assert_eq!(
        base["usage"]["images"],
        json!([{"sha256": sha(&a), "width": 40, "height": 30}, {"sha256": sha(&b), "width": 48, "height": 64}])
    );
    // Multipart uploads: `image` before `images`, whatever the part order.
    let req = serde_json::to_vec(&json!({"state": {"note": "two photos"}, "questions": q})).unwrap();
    let (ct, body) = multipart(&[
        ("images", Some("b.jpg"), "image/jpeg", &b),
        ("request", None, "application/json", &req),
        ("image", Some("a.png"), "image/png", &a),
    ]);
    let r = s.req("POST", "/v1/systemone", &[("Content-Type", &ct)], &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["answers"], base["answers"]);
    assert_eq!(r.json()["usage"]["images"], base["usage"]["images"]);
    // The same multipart body zstd-compressed (as the TypeSafe SDK sends it).
    let z = zstd::encode_all(&body[..], 3).unwrap();
    let r = s.req("POST", "/v1/systemone", &[("Content-Type", &ct), ("Content-Encoding", "zstd")], &z);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["answers"], base["answers"]);
    // The first image embedded in the state instead: it becomes the second image, and the state text says [image 1].
    let r = s.post_json(&json!({"state": {"note": format!("two photos {}", data_url(&b))}, "images": [data_url(&a)], "questions": q}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["images"], base["usage"]["images"]);
}

#[test]
fn assets_with_placeholders_are_images_in_the_text() {
    let s = main_server();
    let (a, b) = (png(36, 20, 9), png(20, 36, 4));
    let (p1, p2) = ("<image:0123456789abcdef0123456789abcdef>", "<image:fedcba9876543210fedcba9876543210>");
    let questions = |x: &str, y: &str| {
        json!({
            "same": {"type": "noul", "instructions": format!("Is {x} the same product as {y}?"), "criteria": {"true": format!("{y} shows it")}},
            "which": {"type": "choice", "instructions": "Which is sharper?", "criteria": {"first": format!("{x}"), "second": [y]}}
        })
    };
    let state = |x: &str, y: &str| json!({"listing": format!("Photos: {x}, {y}"), "refs": [x, {"k": y}]});
    // TypeSafe SDK style: multipart with `request` + `asset-N` parts.
    let req = json!({"model": "jev-latest", "state": state(p1, p2), "questions": questions(p1, p2),
                     "assets": {p1: {"type": "image", "part": "asset-0"}, p2: {"type": "image", "part": "asset-1"}}});
    let req = serde_json::to_vec(&req).unwrap();
    let (ct, body) = multipart(&[
        ("request", None, "application/json", &req),
        ("asset-0", Some("asset-0"), "image/png", &a),
        ("asset-1", Some("asset-1"), "image/png", &b),
    ]);
    let r = s.req("POST", "/v1/systemone", &[("Content-Type", &ct)], &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let with_assets = r.json();
    assert_eq!(with_assets["usage"]["images"][0]["sha256"], sha(&a));
    assert_eq!(with_assets["usage"]["images"][1]["sha256"], sha(&b));
    // Inline base64 assets in a JSON body: the same.
    let req = json!({"state": state(p1, p2), "questions": questions(p1, p2),
                     "assets": {p1: {"type": "image", "format": "png", "data_base64": b64(&a)}, p2: {"type": "image", "format": "png", "data_base64": b64(&b)}}});
    let r = s.post_json(&req);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["answers"], with_assets["answers"]);
    // And the same as writing "[image K]" by hand with explicit images: the placeholders were replaced.
    let r = s.post_json(
        &json!({"state": state("[image 1]", "[image 2]"), "questions": questions("[image 1]", "[image 2]"),
                                "images": [data_url(&a), data_url(&b)]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["answers"], with_assets["answers"]);
}

#[test]
fn malformed_requests_get_exact_statuses_and_codes() {
    let s = main_server();
    let q = json!({"q": noul("Is it?")});
    let png_ok = png(16, 16, 3);
    let j = |v: Value| serde_json::to_vec(&v).unwrap();
    let json_ct: &[(&str, &str)] = &[("Content-Type", "application/json")];
    let with = |v: Value| -> Vec<u8> { j(v) };
    let bomb_zstd = zstd::encode_all(std::io::repeat(b' ').take(MAX_BODY as u64 + 1024), 19).unwrap();
    let bomb_gzip = {
        let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::copy(&mut std::io::repeat(b' ').take(MAX_BODY as u64 + 1024), &mut g).unwrap();
        g.finish().unwrap()
    };
    assert!(bomb_zstd.len() < 64 << 10 && bomb_gzip.len() < 256 << 10);
    let big_url = format!("data:image/png;base64,{}", "A".repeat(4 * (20usize << 20).div_ceil(3) + 4));
    let opts =
        |n: usize| json!((0..n).map(|i| (format!("o{i}"), Value::Null)).collect::<serde_json::Map<_, _>>());
    let (mp_ct, mp_no_request) = multipart(&[("image", Some("a.png"), "image/png", &png_ok)]);
    let req_asset = j(json!({"questions": q, "assets": {"<image:1>": {"type": "image", "part": "asset-0"}}}));
    let (mp_ct2, mp_unclaimed) = multipart(&[
        ("request", None, "application/json", &req_asset),
        ("asset-0", Some("asset-0"), "image/png", &png_ok),
        ("asset-1", Some("asset-1"), "image/png", &png_ok),
    ]);
    let req_plain = j(json!({"questions": q}));
    let (mp_ct3, mp_big_upload) = multipart(&[
        ("request", None, "application/json", &req_plain),
        ("image", Some("big.png"), "image/png", &vec![0u8; (20 << 20) + 1]),
    ]);
    let (mp_ct4, mp_bad_json) = multipart(&[("request", None, "application/json", b"{not json")]);
    let long_state = "word ".repeat(12_000);

    type Case = (&'static str, Vec<(String, String)>, Vec<u8>, u16, &'static str);
    let h = |pairs: &[(&str, &str)]| {
        pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>()
    };
    let cases: Vec<Case> = vec![
        ("not json", h(json_ct), b"{\"questions\": {".to_vec(), 422, "bad_json"),
        ("empty body", h(json_ct), vec![], 422, "bad_json"),
        ("not an object", h(json_ct), b"[1, 2]".to_vec(), 422, "bad_request"),
        ("missing questions", h(json_ct), with(json!({"state": {}})), 422, "invalid_request"),
        ("empty questions", h(json_ct), with(json!({"questions": {}})), 422, "invalid_request"),
        (
            "65 questions",
            h(json_ct),
            with(
                json!({"questions": (0..65).map(|i| (format!("q{i}"), noul("?"))).collect::<serde_json::Map<_, _>>()}),
            ),
            422,
            "invalid_request",
        ),
        (
            "empty question id",
            h(json_ct),
            with(json!({"questions": {"": noul("?")}})),
            422,
            "invalid_request",
        ),
        (
            "question not an object",
            h(json_ct),
            with(json!({"questions": {"q": "Is it?"}})),
            422,
            "invalid_request",
        ),
        (
            "missing type",
            h(json_ct),
            with(json!({"questions": {"q": {"instructions": "?"}}})),
            422,
            "invalid_request",
        ),
        (
            "type boolean",
            h(json_ct),
            with(json!({"questions": {"q": {"type": "boolean", "instructions": "?"}}})),
            422,
            "invalid_request",
        ),
        (
            "missing instructions",
            h(json_ct),
            with(json!({"questions": {"q": {"type": "noul", "criteria": {"true": "x"}}}})),
            422,
            "invalid_request",
        ),
        (
            "empty instructions",
            h(json_ct),
            with(json!({"questions": {"q": noul("")}})),
            422,
            "invalid_request",
        ),
        (
            "2001-char instructions",
            h(json_ct),
            with(json!({"questions": {"q": noul(&"i".repeat(2001))}})),
            422,
            "invalid_request",
        ),
        (
            "noul criteria string",
            h(json_ct),
            with(json!({"questions": {"q": {"type": "noul", "instructions": "?", "criteria": "yes"}}})),
            422,
            "invalid_request",
        ),
        (
            "choice no options",
            h(json_ct),
            with(json!({"questions": {"q": {"type": "choice", "instructions": "?", "criteria": {}}}})),
            422,
            "invalid_request",
        ),
        (
            "choice 1 option",
            h(json_ct),
            with(json!({"questions": {"q": {"type": "choice", "instructions": "?", "criteria": opts(1)}}})),
            422,
            "invalid_request",
        ),
        (
            "choice 12 options on 12 codes",
            h(json_ct),
            with(json!({"questions": {"q": {"type": "choice", "instructions": "?", "criteria": opts(12)}}})),
            422,
            "invalid_request",
        ),
        (
            "choice 256 options",
            h(json_ct),
            with(json!({"questions": {"q": {"type": "choice", "instructions": "?", "criteria": opts(256)}}})),
            422,
            "invalid_request",
        ),
        (
            "choice __unknown__",
            h(json_ct),
            with(
                json!({"questions": {"q": {"type": "choice", "instructions": "?", "criteria": {"a": null, "__unknown__": null}}}}),
            ),
            422,
            "invalid_request",
        ),
        (
            "choice 129-char value",
            h(json_ct),
            with(
                json!({"questions": {"q": {"type": "choice", "instructions": "?", "criteria": {"a": null, "y".repeat(129): null}}}}),
            ),
            422,
            "invalid_request",
        ),
        (
            "choice numeric description",
            h(json_ct),
            with(
                json!({"questions": {"q": {"type": "choice", "instructions": "?", "criteria": {"a": 5, "b": null}}}}),
            ),
            422,
            "invalid_request",
        ),
        (
            "score map",
            h(json_ct),
            with(
                json!({"questions": {"q": {"type": "score", "instructions": "?", "criteria": {"0": "a", "1": "b"}}}}),
            ),
            422,
            "invalid_request",
        ),
        (
            "score 11 levels",
            h(json_ct),
            with(
                json!({"questions": {"q": {"type": "score", "instructions": "?", "criteria": (0..11).map(|i| i.to_string()).collect::<Vec<_>>()}}}),
            ),
            422,
            "invalid_request",
        ),
        (
            "score 1 level",
            h(json_ct),
            with(json!({"questions": {"q": {"type": "score", "instructions": "?", "criteria": ["a"]}}})),
            422,
            "invalid_request",
        ),
        (
            "score null level",
            h(json_ct),
            with(
                json!({"questions": {"q": {"type": "score", "instructions": "?", "criteria": ["a", null]}}}),
            ),
            422,
            "invalid_request",
        ),
        (
            "multi 33 labels",
            h(json_ct),
            with(json!({"questions": {"q": {"type": "multi", "instructions": "?", "criteria": opts(33)}}})),
            422,
            "invalid_request",
        ),
        (
            "multi threshold 1.5",
            h(json_ct),
            with(
                json!({"questions": {"q": {"type": "multi", "instructions": "?", "criteria": {"a": null}, "threshold": 1.5}}}),
            ),
            422,
            "invalid_request",
        ),
        (
            "multi threshold bool",
            h(json_ct),
            with(
                json!({"questions": {"q": {"type": "multi", "instructions": "?", "criteria": {"a": null}, "threshold": true}}}),
            ),
            422,
            "invalid_request",
        ),
        (
            "state depth 9",
            h(json_ct),
            with(
                json!({"state": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}}, "questions": q}),
            ),
            422,
            "invalid_request",
        ),
        (
            "state over 128 KiB",
            h(json_ct),
            with(json!({"state": {"s": "z".repeat(131_072)}, "questions": q})),
            422,
            "invalid_request",
        ),
        (
            "state non-finite",
            h(json_ct),
            br#"{"state": {"x": 1e400}, "questions": {"q": {"type": "noul", "instructions": "?"}}}"#.to_vec(),
            422,
            "invalid_request",
        ),
        (
            "images not a list",
            h(json_ct),
            with(json!({"images": data_url(&png_ok), "questions": q})),
            422,
            "bad_image",
        ),
        (
            "three images",
            h(json_ct),
            with(
                json!({"images": [data_url(&png_ok), data_url(&png_ok)], "state": data_url(&png_ok), "questions": q}),
            ),
            422,
            "bad_image",
        ),
        (
            "image not a data URL",
            h(json_ct),
            with(json!({"images": ["https://example.com/a.png"], "questions": q})),
            422,
            "bad_image",
        ),
        (
            "image not base64",
            h(json_ct),
            with(json!({"images": ["data:image/png;base64,iVBORw0KGgo*AAAA"], "questions": q})),
            422,
            "bad_image",
        ),
        (
            "image corrupt",
            h(json_ct),
            with(json!({"images": [data_url(b"\x89PNG\r\n\x1a\nnot really a png")], "questions": q})),
            422,
            "bad_image",
        ),
        (
            "image gif",
            h(json_ct),
            with(json!({"images": [data_url(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;")], "questions": q})),
            422,
            "bad_image",
        ),
        (
            "image oversized",
            h(json_ct),
            with(json!({"images": [big_url], "questions": q})),
            413,
            "image_too_large",
        ),
        ("assets empty", h(json_ct), with(json!({"questions": q, "assets": {}})), 422, "invalid_request"),
        (
            "asset part in JSON",
            h(json_ct),
            with(json!({"questions": q, "assets": {"<image:1>": {"type": "image", "part": "asset-0"}}})),
            422,
            "invalid_request",
        ),
        (
            "asset bad format",
            h(json_ct),
            with(
                json!({"questions": q, "assets": {"<image:1>": {"type": "image", "format": "gif", "data_base64": b64(&png_ok)}}}),
            ),
            422,
            "invalid_request",
        ),
        (
            "over the token limit",
            h(json_ct),
            with(json!({"state": long_state, "questions": q})),
            413,
            "request_too_large",
        ),
        (
            "zstd bomb",
            h(&[("Content-Type", "application/json"), ("Content-Encoding", "zstd")]),
            bomb_zstd,
            413,
            "request_too_large",
        ),
        (
            "gzip bomb",
            h(&[("Content-Type", "application/json"), ("Content-Encoding", "gzip")]),
            bomb_gzip,
            413,
            "request_too_large",
        ),
        (
            "corrupt zstd",
            h(&[("Content-Type", "application/json"), ("Content-Encoding", "zstd")]),
            b"definitely not zstd".to_vec(),
            422,
            "bad_request",
        ),
        (
            "unknown encoding",
            h(&[("Content-Type", "application/json"), ("Content-Encoding", "br")]),
            j(valid()),
            415,
            "unsupported_media_type",
        ),
        ("text/plain", h(&[("Content-Type", "text/plain")]), j(valid()), 415, "unsupported_media_type"),
        (
            "form-urlencoded",
            h(&[("Content-Type", "application/x-www-form-urlencoded")]),
            j(valid()),
            415,
            "unsupported_media_type",
        ),
        ("no content type", vec![], j(valid()), 415, "unsupported_media_type"),
        (
            "body over the cap",
            h(&[("Content-Type", "application/json"), ("Content-Length", &(MAX_BODY + 1).to_string())]),
            vec![],
            413,
            "request_too_large",
        ),
        ("multipart without request", h(&[("Content-Type", &mp_ct)]), mp_no_request, 422, "bad_request"),
        ("multipart unclaimed part", h(&[("Content-Type", &mp_ct2)]), mp_unclaimed, 422, "invalid_request"),
        (
            "multipart upload over 20 MiB",
            h(&[("Content-Type", &mp_ct3)]),
            mp_big_upload,
            413,
            "image_too_large",
        ),
        ("multipart bad request JSON", h(&[("Content-Type", &mp_ct4)]), mp_bad_json, 422, "bad_json"),
        (
            "multipart garbage",
            h(&[("Content-Type", "multipart/form-data; boundary=xyz")]),
            b"garbage".to_vec(),
            422,
            "bad_request",
        ),
    ];
    assert!(cases.len() >= 30);
    let mut failures = Vec::new();
    for (name, headers, body, status, code) in &cases {
        let hs: Vec<(&str, &str)> = headers.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        let r = s.req("POST", "/v1/systemone", &hs, body);
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        if r.status != *status || v["error"] != *code {
            failures.push(format!(
                "{name}: got {} {}, want {status} {code}",
                r.status,
                r.text().chars().take(300).collect::<String>()
            ));
            continue;
        }
        // Shapes: 422 = detail list with loc starting at "body"; others = {error_type, message}.
        if r.status == 422 {
            let d = v["detail"].as_array().expect("detail list");
            assert!(
                d.iter().all(|x| x["loc"][0] == "body" && x["msg"].is_string() && x["type"].is_string()),
                "{name}: {v}"
            );
        } else {
            assert_eq!(v["detail"]["error_type"], *code, "{name}");
            assert!(v["detail"]["message"].is_string(), "{name}");
        }
        assert!(r.header("x-request-id").is_some(), "{name}");
        // The server still answers a valid request.
        let ok = s.post_json(&json!({"questions": q}));
        assert_eq!(ok.status, 200, "after {name}: {}", ok.text());
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    // Routing errors have the same shapes.
    let r = s.req("GET", "/v1/systemone", &[], b"");
    assert_eq!((r.status, r.code()), (405, "method_not_allowed".into()));
    assert_eq!(r.header("allow"), Some("POST"));
    let r = s.req("POST", "/v1/nothing", &[("Content-Type", "application/json")], b"{}");
    assert_eq!((r.status, r.code()), (404, "not_found".into()));
    assert_eq!(r.json()["detail"]["error_type"], "not_found");
}

#[test]
fn auth_when_keys_are_configured() {
    let s = start(Setup { api_keys: vec!["k-one".into(), "second-key".into()], ..Setup::default() });
    let body = serde_json::to_vec(&json!({"questions": {"q": noul("?")}})).unwrap();
    let post = |auth: Option<&str>| {
        let mut h = vec![("Content-Type", "application/json")];
        if let Some(a) = auth {
            h.push(("Authorization", a));
        }
        s.req("POST", "/v1/systemone", &h, &body)
    };
    for (auth, want) in [
        (None, 401),
        (Some("Bearer wrong"), 401),
        (Some("Bearer k-on"), 401),
        (Some("Basic k-one"), 401),
        (Some("k-one"), 401),
        (Some("Bearer k-one"), 200),
        (Some("bearer second-key"), 200),
    ] {
        let r = post(auth);
        assert_eq!(r.status, want, "{auth:?}: {}", r.text());
        if want == 401 {
            let v = r.json();
            assert_eq!(v["error"], "authentication_error");
            assert_eq!(v["detail"]["error_type"], "authentication_error");
            assert!(v["detail"]["message"].is_string());
            assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        }
    }
    s.shutdown();
}

#[test]
fn typesafe_contract_mode() {
    let s = start(Setup { mode: ContractMode::Typesafe, rotations: 1, ..Setup::default() });
    let mut v = valid();
    v["questions"].as_object_mut().unwrap().remove("tags");
    let r = s.post_json(&v);
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    assert_answers_shape(&body, true);
    // Only model/answers/usage at the top; imajev's extras are x_-prefixed.
    assert_eq!(body.as_object().unwrap().keys().collect::<Vec<_>>(), ["model", "answers", "usage"]);
    for (_, a) in body["answers"].as_object().unwrap() {
        for k in a.as_object().unwrap().keys() {
            assert!(
                ["type", "noul", "choice", "probabilities", "confidence", "score", "legend"]
                    .contains(&k.as_str())
                    || k.starts_with("x_"),
                "{k}"
            );
        }
    }
    // TypeSafe confidence for choice: (max − 1/n)/(1 − 1/n).
    let p: Vec<f64> = body["answers"]["team"]["probabilities"]
        .as_object()
        .unwrap()
        .values()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let max = p.iter().cloned().fold(0.0, f64::max);
    assert!(
        (body["answers"]["team"]["confidence"].as_f64().unwrap() - (max - 1.0 / 3.0) / (2.0 / 3.0)).abs()
            < 1e-12
    );
    // state is required and not null; a noul without instructions takes its criteria's text.
    assert_eq!(s.post_json(&json!({"questions": {"q": noul("?")}})).status, 422);
    assert_eq!(s.post_json(&json!({"state": null, "questions": {"q": noul("?")}})).status, 422);
    let r = s.post_json(&json!({"state": ["a", "b"], "questions": {"q": {"type": "noul", "criteria": {"true": "The customer threatens a chargeback"}}}}));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = s.post_json(
        &json!({"model": "no-such-model", "state": "x", "x_trace": 1, "questions": {"q": noul("?")}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    s.shutdown();
}

#[test]
fn readout_with_256_rows_takes_255_options() {
    let s = start(Setup { rows256: true, rotations: 1, ..Setup::default() });
    let opts = |n: usize| {
        json!((0..n).map(|i| (format!("Queue {i:03}"), Value::Null)).collect::<serde_json::Map<_, _>>())
    };
    let r = s.post_json(&json!({"state": "route me", "questions": {"q": {"type": "choice", "instructions": "Which queue?", "criteria": opts(255)}}}));
    assert_eq!(r.status, 200, "{}", r.text());
    let a = &r.json()["answers"]["q"];
    assert_eq!(a["probabilities"].as_object().unwrap().len(), 255);
    let r = s.post_json(&json!({"state": "route me", "questions": {"q": {"type": "choice", "instructions": "Which queue?", "criteria": opts(256)}}}));
    assert_eq!((r.status, r.code()), (422, "invalid_request".into()));
    let m = s.req("GET", "/v1/models", &[], b"").json();
    assert_eq!((m["readout_codes"].as_u64(), m["max_options"].as_u64()), (Some(256), Some(255)));
    s.shutdown();
}

#[test]
fn models_healthz_metrics_openapi() {
    let s = main_server();
    let m = s.req("GET", "/v1/models", &[], b"");
    assert_eq!(m.status, 200);
    let m = m.json();
    assert_eq!(m["model"], "imajev-test");
    assert_eq!(m["models"][0]["name"], "imajev-test");
    assert!(m["models"][0]["description"].is_string());
    let date = m["models"][0]["release_date"].as_str().unwrap();
    assert!(date.len() == 10 && date.as_bytes()[4] == b'-' && date.as_bytes()[7] == b'-');
    assert_eq!(m["adapter"], "tiny-adapter");
    assert_eq!(m["loaded"], true);
    assert!(m["backend"].as_str().unwrap().to_lowercase().contains("cpu"), "{m}");
    assert_eq!(
        (m["readout_codes"].as_u64(), m["max_options"].as_u64(), m["prompt_layout"].as_str()),
        (Some(12), Some(11), Some("standard"))
    );
    let typed: imajev_serve::api::schema::ModelsResponse = serde_json::from_value(m.clone()).unwrap();
    assert_eq!(serde_json::to_value(typed).unwrap(), m);
    let h = s.req("GET", "/healthz", &[], b"");
    assert_eq!((h.status, h.json()["status"].as_str()), (200, Some("ok")));
    assert_eq!(s.post_json(&valid()).status, 200);
    let text = s.req("GET", "/metrics", &[], b"").text();
    for needle in [
        "imajev_http_requests_total{code=\"200\",route=\"/v1/systemone\"}",
        "imajev_decision_duration_seconds_bucket{tokens=",
        "imajev_http_requests_in_flight",
        "\nprocess_resident_memory_bytes ",
        "imajev_queue_capacity 16",
        "imajev_http_request_duration_seconds_count{code=\"200\",route=\"/v1/systemone\"}",
        "imajev_engine_weight_bytes",
        "imajev_queue_depth",
        "imajev_passes_total",
    ] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    let o = s.req("GET", "/openapi.json", &[], b"");
    assert_eq!(o.status, 200);
    assert_eq!(o.json(), imajev_serve::api::schema::openapi());
    assert_eq!(o.json()["openapi"], "3.1.0");
    let r = s.req("POST", "/metrics", &[], b"");
    assert_eq!((r.status, r.code()), (405, "method_not_allowed".into()));
}

#[test]
fn loading_answers_503_until_the_model_is_ready() {
    let dir = tempfile::tempdir().unwrap();
    let flag = dir.path().join("go");
    let s = start(Setup { hold_load: Some(flag.clone()), ..Setup::default() });
    let r = s.post_json(&json!({"questions": {"q": noul("?")}}));
    assert_eq!((r.status, r.code()), (503, "loading".into()));
    assert!(r.header("retry-after").is_some());
    let m = s.req("GET", "/v1/models", &[], b"");
    assert_eq!((m.status, m.code()), (503, "loading".into()));
    let h = s.req("GET", "/healthz", &[], b"");
    assert_eq!((h.status, h.json()["status"].as_str()), (503, Some("loading")));
    std::fs::write(&flag, b"").unwrap();
    s.wait_ready();
    assert_eq!(s.post_json(&json!({"questions": {"q": noul("?")}})).status, 200);
    s.shutdown();
}

#[test]
fn a_full_queue_answers_529_with_retry_after() {
    let s = Arc::new(start(Setup {
        queue_depth: 1,
        slow: Some(Duration::from_millis(1200)),
        ..Setup::default()
    }));
    let body = json!({"questions": {"q": noul("Is it?")}});
    let spawn = |s: &Arc<Server>| {
        let (s, b) = (s.clone(), body.clone());
        std::thread::spawn(move || s.post_json(&b))
    };
    let running = spawn(&s);
    s.wait_metric("imajev_queue_wait_seconds_count ", 1.0); // the engine has taken the first job
    let queued = spawn(&s);
    s.wait_metric("imajev_queue_depth ", 1.0); // the second fills the queue
    let r = s.post_json(&body);
    assert_eq!((r.status, r.code()), (529, "overloaded".into()), "{}", r.text());
    let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
    let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    assert!(secs >= 1 && ms >= 1 && ms <= secs * 1000);
    assert_eq!(r.json()["detail"]["error_type"], "overloaded");
    assert_eq!(running.join().unwrap().status, 200);
    assert_eq!(queued.join().unwrap().status, 200);
    s.shutdown();
}

#[test]
fn a_caller_that_leaves_while_queued_is_skipped() {
    let s = Arc::new(start(Setup {
        queue_depth: 4,
        slow: Some(Duration::from_millis(1000)),
        ..Setup::default()
    }));
    let body = serde_json::to_vec(&json!({"questions": {"q": noul("Is it?")}})).unwrap();
    let before = s.metric("imajev_jobs_dropped_total{reason=\"disconnected\"}");
    let first = {
        let (s, b) = (s.clone(), body.clone());
        std::thread::spawn(move || {
            s.req("POST", "/v1/systemone", &[("Content-Type", "application/json")], &b)
        })
    };
    s.wait_metric("imajev_queue_wait_seconds_count ", 1.0); // the engine runs the first job
                                                            // A second caller sends its request, waits until it is queued, and hangs up.
    let mut c = TcpStream::connect(s.addr).unwrap();
    let head = format!("POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(&body).unwrap();
    let t = Instant::now();
    while s.metric("imajev_queue_depth ") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(10), "the request never reached the queue");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Hang up with a reset (SO_LINGER 0, then close): a FIN alone is a half-close, which HTTP/1.1
    // allows while the client still waits for its answer, so only a reset means "gone".
    reset(c);
    assert_eq!(first.join().unwrap().status, 200);
    let t = Instant::now();
    while s.metric("imajev_jobs_dropped_total{reason=\"disconnected\"}") < before + 1.0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the queued job of the departed caller was not skipped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The skipped job cost no compute: one job's passes ran (plus nothing for the second).
    assert_eq!(s.post_json(&json!({"questions": {"q": noul("?")}})).status, 200);
    s.shutdown();
}

#[test]
fn deadline_passes_in_the_queue_gives_504() {
    let s = Arc::new(start(Setup {
        queue_depth: 4,
        slow: Some(Duration::from_millis(900)),
        request_timeout: Duration::from_millis(600),
        ..Setup::default()
    }));
    let body = json!({"questions": {"q": noul("Is it?")}});
    let first = {
        let (s, b) = (s.clone(), body.clone());
        std::thread::spawn(move || s.post_json(&b))
    };
    std::thread::sleep(Duration::from_millis(100));
    let second = s.post_json(&body);
    assert_eq!((second.status, second.code()), (504, "timeout".into()), "{}", second.text());
    // The first one ran past its own deadline inside the engine: also 504, never a 5xx other than that.
    let f = first.join().unwrap();
    assert!(f.status == 504 || f.status == 200, "{}", f.text());
    s.shutdown();
}

#[test]
fn graceful_shutdown_finishes_accepted_requests() {
    let s = Arc::new(start(Setup { slow: Some(Duration::from_millis(800)), ..Setup::default() }));
    let inflight = {
        let s = s.clone();
        std::thread::spawn(move || s.post_json(&json!({"questions": {"q": noul("Is it?")}})))
    };
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    s.shutdown(); // returns after the HTTP server stopped and the engine thread joined
    let r = inflight.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(t.elapsed() >= Duration::from_millis(400), "shutdown did not wait for the accepted request");
    // Nothing listens any more, and with every worker handle gone the engine thread ends.
    assert!(try_request(s.addr, "GET", "/healthz", &[], b"").is_err());
    assert!(s.engine_stops(Duration::from_secs(10)), "the engine thread still runs after the server stopped");
}

#[test]
fn the_engine_thread_ends_after_shutdown() {
    let s = start(Setup::default());
    assert_eq!(s.post_json(&json!({"questions": {"q": noul("?")}})).status, 200);
    s.shutdown();
    assert!(
        s.engine_stops(Duration::from_secs(10)),
        "the engine thread still runs after the server stopped and every handle was dropped"
    );
}

/// A server to point external tools at (jevcompat, the TypeSafe SDK, curl):
/// `IMAJEV_TEST_PORT=8799 IMAJEV_TEST_CONTRACT=typesafe [IMAJEV_TEST_KEY=k] cargo test --release
/// --test api_http serve_for_manual_testing -- --ignored --nocapture`; stops when the file named
/// by IMAJEV_TEST_STOP (default /tmp/imajev-test-stop) appears.
#[test]
#[ignore = "manual: serves until a stop file appears"]
fn serve_for_manual_testing() {
    let port: u16 = std::env::var("IMAJEV_TEST_PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(8799);
    let mode = if std::env::var("IMAJEV_TEST_CONTRACT").as_deref() == Ok("typesafe") {
        ContractMode::Typesafe
    } else {
        ContractMode::Imajev
    };
    let keys: Vec<String> = std::env::var("IMAJEV_TEST_KEY").ok().into_iter().collect();
    let stop =
        PathBuf::from(std::env::var("IMAJEV_TEST_STOP").unwrap_or_else(|_| "/tmp/imajev-test-stop".into()));
    let _ = std::fs::remove_file(&stop);
    let s = start(Setup { mode, api_keys: keys, rows256: true, rotations: 1, ..Setup::default() });
    // Forward the ephemeral port to the requested one with a plain TCP relay.
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    listener.set_nonblocking(true).unwrap();
    eprintln!("serving on http://127.0.0.1:{port} (contract {mode:?}); touch {} to stop", stop.display());
    while !stop.exists() {
        match listener.accept() {
            Ok((client, _)) => {
                client.set_nonblocking(false).unwrap();
                let upstream = TcpStream::connect(s.addr).unwrap();
                let (mut c2, mut u2) = (client.try_clone().unwrap(), upstream.try_clone().unwrap());
                let (mut c, mut u) = (client, upstream);
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut c2, &mut u2);
                    let _ = u2.shutdown(std::net::Shutdown::Write);
                });
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut u, &mut c);
                    let _ = c.shutdown(std::net::Shutdown::Write);
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    s.shutdown();
}

#[test]
fn offline_decide_json_matches_the_http_answers() {
    let m = models();
    let tok = tokenizer();
    let codebook = Codebook::for_adapter(&m.tiny.adapter, &tok, 12).unwrap();
    let settings = DecisionSettings {
        rotations: 2,
        calibration: None,
        mode: ContractMode::Imajev,
        max_input_tokens: 8192,
        model_name: "imajev-test".into(),
    };
    let decider = Arc::new(Decider::new(tok, codebook, settings));
    let engine = Qwen35::load(CpuBackend::default(), &m.tiny.model, Some(&m.tiny.adapter)).unwrap();
    let ctx = imajev_serve::api::ParseContext::for_decider(&decider, 64, ImageProcessorConfig::default());
    let decide_json = |raw: &[u8]| {
        let body = RequestBody::json(raw.to_vec());
        decide_direct(body, ctx.clone(), decider.clone(), |call| {
            run_engine(&engine, call, BatchLimits::default())
        })
        .map(|d| d.response)
    };
    let mut body = valid();
    body["images"] = json!([data_url(&png(30, 20, 5))]);
    let raw = serde_json::to_vec(&body).unwrap();
    let offline = decide_json(&raw).unwrap();
    let online = main_server().post_json(&body).json();
    assert_eq!(offline["answers"], online["answers"]);
    assert_eq!(offline["usage"]["images"], online["usage"]["images"]);
    let e = decide_json(b"{\"questions\": {}}").unwrap_err();
    assert_eq!((e.status, e.code), (422, "invalid_request"));
}

/// Closes a connection with a reset: SO_LINGER on with a zero timeout makes close() send RST.
fn reset(c: TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket descriptor and a correctly sized `linger` value.
    let rc = unsafe {
        libc::setsockopt(
            c.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "setsockopt(SO_LINGER)");
    drop(c);
}
