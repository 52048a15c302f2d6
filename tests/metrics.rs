//! What `GET /metrics` exposes, seen from outside: the demo server runs as a real process, is
//! scraped once before any request (every preinitialised label set is there at 0), then serves a
//! mixed workload — every question type, an image, a request too large to pack (its prefix runs
//! as its own stage), a 422 and a 404 — and a second scrape is checked series by series against
//! the responses it gave. The README's Metrics table must list exactly the `imajev_*` families a
//! scrape shows; and `imajev_engine_weight_bytes` is what the engine holds, not the file size.

mod common;

use common::server::{http, Served};

use imajev_serve::api::metrics::token_bucket;
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::engine::Qwen35;
use imajev_serve::synth::SynthDtype;
use imajev_serve::worker::DecisionEngine;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

// ------------------------------------------------------------------------------------ a scrape

/// One sample line: its family's sample name, its labels, its value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A parsed Prometheus text exposition.
struct Scrape {
    text: String,
    /// Family name → `# TYPE`.
    types: BTreeMap<String, String>,
    helps: BTreeSet<String>,
    samples: Vec<Sample>,
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"").expect("label=\"value\"");
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next().expect("a closing quote") {
                (_, '\\') => match chars.next().unwrap().1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        out.insert(key.trim_start_matches(',').to_string(), value);
        rest = after[end + 1..].trim_start_matches(',');
    }
    out
}

impl Scrape {
    fn parse(text: String) -> Scrape {
        let (mut types, mut helps, mut samples) = (BTreeMap::new(), BTreeSet::new(), Vec::new());
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                types.insert(name.to_string(), kind.to_string());
            } else if let Some(rest) = line.strip_prefix("# HELP ") {
                helps.insert(rest.split_once(' ').map_or(rest, |(n, _)| n).to_string());
            } else if !line.starts_with('#') {
                let (series, value) = line.rsplit_once(' ').unwrap();
                let (name, labels) = match series.split_once('{') {
                    Some((n, l)) => (n, parse_labels(l.strip_suffix('}').unwrap())),
                    None => (series, BTreeMap::new()),
                };
                samples.push(Sample { name: name.to_string(), labels, value: value.parse().unwrap() });
            }
        }
        Scrape { text, types, helps, samples }
    }

    /// The value of the sample `name` whose labels are exactly `labels`.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> =
            labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.samples.iter().find(|s| s.name == name && s.labels == want).map(|s| s.value)
    }

    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or_else(|| panic!("no sample {name}{labels:?} in:\n{}", self.text))
    }

    /// The sum over every sample `name`, whatever its labels.
    fn total(&self, name: &str) -> f64 {
        self.samples.iter().filter(|s| s.name == name).map(|s| s.value).sum()
    }

    fn families_with_prefix(&self, prefix: &str) -> BTreeSet<String> {
        self.types.keys().filter(|n| n.starts_with(prefix)).cloned().collect()
    }
}

// ------------------------------------------------------------------------------- the demo server

/// Most tokens in one packed forward: the large request below is over it, the others under.
const BATCH_TOKENS: usize = 1000;
const QUEUE_DEPTH: usize = 7;

fn start_demo() -> Served {
    // Two-level trees: a request fits one forward exactly when its processed tokens do.
    Served::demo(&[
        "--queue-depth",
        &QUEUE_DEPTH.to_string(),
        "--batch-tokens",
        &BATCH_TOKENS.to_string(),
        "--question-tree",
        "two-level",
    ])
}

fn scrape(demo: &Served) -> Scrape {
    let (status, text) = http(demo.port, "GET", "/metrics", None).expect("a scrape");
    assert_eq!(status, 200, "{text}");
    Scrape::parse(text)
}

fn png(w: u32, h: u32) -> String {
    use base64::Engine;
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7) as u8, (y * 5) as u8, 90]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(out.into_inner()))
}

fn every_type() -> Value {
    json!({
        "hw": {"type": "noul", "instructions": "Is it a hardware problem?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"infra": "servers", "facilities": "printers", "it": null}},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]},
        "tags": {"type": "multi", "instructions": "Which tags apply?", "criteria": {"printer": null, "network": "cables", "paper": null}, "threshold": 0.4}
    })
}

/// The `unknown_probability` values an answer reports (a multi: one per label).
fn unknowns(answer: &Value) -> Vec<f64> {
    match answer.get("unknown_probabilities") {
        Some(per_label) => per_label.as_object().unwrap().values().map(|v| v.as_f64().unwrap()).collect(),
        None => vec![answer["unknown_probability"].as_f64().unwrap()],
    }
}

// ------------------------------------------------------------------------------------ the tests

#[test]
fn a_scrape_after_a_mixed_workload_shows_what_was_served() {
    let demo = start_demo();

    // Before any request: every label set that alerts read is there, at 0.
    let before = scrape(&demo);
    for reason in ["deadline", "disconnected"] {
        assert_eq!(before.value("imajev_jobs_dropped_total", &[("reason", reason)]), 0.0);
    }
    for kind in ["choice", "noul", "score", "multi"] {
        for abstained in ["true", "false"] {
            assert_eq!(
                before.value("imajev_decisions_total", &[("type", kind), ("abstained", abstained)]),
                0.0
            );
        }
        assert_eq!(before.value("imajev_unknown_probability_count", &[("type", kind)]), 0.0);
    }
    for bucket in ["256", "1k", "4k", "16k", "64k", "over_64k"] {
        assert_eq!(before.value("imajev_decision_duration_seconds_count", &[("tokens", bucket)]), 0.0);
    }
    assert_eq!(before.value("imajev_http_requests_in_flight", &[]), 0.0, "the scrape counted itself");

    // The workload, one request at a time.
    let long_state = (0..400).map(|i| format!("line {i}: the printer on floor {i} jams")).collect::<Vec<_>>();
    let requests = [
        json!({"state": {"ticket": "The printer on floor 3 is jammed again."}, "questions": every_type()}),
        json!({"state": "what is in the picture?", "images": [png(40, 30)], "questions": {"kind": {"type": "choice", "instructions": "What is it?", "criteria": {"photo": null, "drawing": null}}}}),
        json!({"state": {"log": long_state.join("\n")}, "questions": {"hw": {"type": "noul", "instructions": "Is it hardware?"}}}),
        json!({"state": "short", "questions": {"s": {"type": "score", "instructions": "How bad?", "criteria": ["fine", "bad"]}}}),
    ];
    let mut answered = Vec::new();
    for r in &requests {
        let (status, body) = demo.post(r);
        assert_eq!(status, 200, "{body}");
        answered.push(body);
    }
    let (status, body) = demo.post(&json!({"state": "x", "questions": {"q": {"type": "no-such-type"}}}));
    assert_eq!(status, 422, "{body}");
    assert_eq!(http(demo.port, "GET", "/no-such-route", None).unwrap().0, 404);

    let m = scrape(&demo);
    let n = answered.len() as f64;
    let usage = |k: &str| -> Vec<u64> { answered.iter().map(|a| a["usage"][k].as_u64().unwrap()).collect() };
    let tokens = usage("processed_tokens");

    // HTTP: every response counted and timed under a bounded route; the scrape is not in flight.
    let code =
        |route: &str, code: &str| m.get("imajev_http_requests_total", &[("code", code), ("route", route)]);
    assert_eq!(code("/v1/systemone", "200"), Some(n));
    assert_eq!(code("/v1/systemone", "422"), Some(1.0));
    assert_eq!(code("unmatched", "404"), Some(1.0));
    assert_eq!(code("/metrics", "200"), Some(1.0), "the first scrape");
    for s in m.samples.iter().filter(|s| s.name == "imajev_http_requests_total") {
        let labels: Vec<(&str, &str)> = s.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(m.get("imajev_http_request_duration_seconds_count", &labels), Some(s.value), "{labels:?}");
        assert!(["/v1/systemone", "/metrics", "/healthz", "unmatched"].contains(&s.labels["route"].as_str()));
    }
    assert_eq!(m.value("imajev_http_requests_in_flight", &[]), 0.0, "the scrape counted itself");

    // Decisions: latency by token bucket, input length, counts by type and abstained, unknowns.
    let mut by_bucket: BTreeMap<&str, f64> = BTreeMap::new();
    for &t in &tokens {
        *by_bucket.entry(token_bucket(t as usize)).or_default() += 1.0;
    }
    for (bucket, count) in &by_bucket {
        assert_eq!(m.value("imajev_decision_duration_seconds_count", &[("tokens", bucket)]), *count);
    }
    assert_eq!(m.value("imajev_request_tokens_count", &[]), n);
    assert_eq!(m.value("imajev_request_tokens_sum", &[]), tokens.iter().sum::<u64>() as f64);
    let mut decisions: BTreeMap<(String, bool), f64> = BTreeMap::new();
    let mut unknown: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for a in answered.iter().flat_map(|b| b["answers"].as_object().unwrap().values()) {
        let kind = a["type"].as_str().unwrap().to_string();
        *decisions.entry((kind.clone(), a["abstained"].as_bool().unwrap())).or_default() += 1.0;
        let u = unknowns(a);
        let e = unknown.entry(kind).or_default();
        e.0 += u.len() as f64;
        e.1 += u.iter().sum::<f64>();
    }
    assert_eq!(decisions.keys().map(|k| k.0.as_str()).collect::<BTreeSet<_>>().len(), 4, "every type asked");
    for kind in ["choice", "noul", "score", "multi"] {
        for abstained in [true, false] {
            let want = decisions.get(&(kind.to_string(), abstained)).copied().unwrap_or(0.0);
            let labels = [("type", kind), ("abstained", if abstained { "true" } else { "false" })];
            assert_eq!(m.value("imajev_decisions_total", &labels), want, "{labels:?}");
        }
        let (count, sum) = unknown[kind];
        assert_eq!(m.value("imajev_unknown_probability_count", &[("type", kind)]), count, "{kind}");
        assert!((m.value("imajev_unknown_probability_sum", &[("type", kind)]) - sum).abs() < 1e-9, "{kind}");
    }

    // The engine: stages only where they ran, passes per forward, the queue, the model.
    let with_images =
        answered.iter().filter(|a| !a["usage"]["images"].as_array().unwrap().is_empty()).count();
    let alone = tokens.iter().filter(|&&t| t as usize > BATCH_TOKENS).count();
    assert!(with_images >= 1 && alone >= 1 && alone < answered.len(), "{tokens:?}");
    assert_eq!(m.value("imajev_vision_seconds_count", &[]), with_images as f64);
    assert_eq!(m.value("imajev_prefill_seconds_count", &[]), alone as f64);
    assert_eq!(m.value("imajev_questions_seconds_count", &[]), n);
    assert_eq!(m.value("imajev_queue_wait_seconds_count", &[]), n);
    assert_eq!(
        (m.value("imajev_batch_requests_count", &[]), m.value("imajev_batch_requests_sum", &[])),
        (n, n),
        "one request per round"
    );
    let passes = m.value("imajev_passes_total", &[]);
    assert_eq!(passes, usage("passes").iter().sum::<u64>() as f64);
    assert_eq!(m.value("imajev_forward_passes_sum", &[]), passes);
    let forwards = m.value("imajev_forward_passes_count", &[]);
    assert_eq!(m.value("imajev_forward_sequences_count", &[]), forwards);
    assert!(forwards > n, "the large request ran several forwards: {forwards}");
    assert!(m.value("imajev_forward_sequences_sum", &[]) > passes, "prefixes are sequences too");
    assert!(m.value("imajev_tokens_total", &[]) > 0.0);
    assert_eq!(m.value("imajev_queue_depth", &[]), 0.0);
    assert_eq!(m.value("imajev_queue_capacity", &[]), QUEUE_DEPTH as f64);
    assert_eq!(m.value("imajev_engine_requests_running", &[]), 0.0);
    // One request a round: the engine was busy at least for every request's stages.
    let stages: f64 =
        ["imajev_vision_seconds_sum", "imajev_prefill_seconds_sum", "imajev_questions_seconds_sum"]
            .iter()
            .map(|f| m.value(f, &[]))
            .sum();
    let busy = m.value("imajev_engine_busy_seconds_total", &[]);
    assert!(busy >= stages - 1e-6 && busy > 0.0, "busy {busy} s, stages {stages} s");
    assert_eq!(m.total("imajev_jobs_dropped_total"), 0.0);
    assert_eq!(m.value("imajev_model_loaded", &[]), 1.0);
    assert!(m.value("imajev_model_load_seconds", &[]) > 0.0);
    assert!(m.value("imajev_engine_weight_bytes", &[]) > 0.0);
    assert_eq!(m.value("imajev_gpu_memory_used_bytes", &[]), 0.0, "the CPU backend");
    assert_eq!(m.value("imajev_gpu_memory_total_bytes", &[]), 0.0, "the CPU backend");
    let build = [
        ("version", env!("CARGO_PKG_VERSION")),
        ("commit", env!("IMAJEV_GIT_COMMIT")),
        ("backend", "cpu"),
        ("contract", "imajev"),
        ("model", "imajev-demo"),
        ("calibration_version", "none"),
    ];
    assert_eq!(m.value("imajev_build_info", &build), 1.0);

    // The process collector, not a hand-written gauge.
    assert!(m.value("process_resident_memory_bytes", &[]) > 0.0);
    assert!(m.value("process_open_fds", &[]) > 0.0);
    assert!(m.get("imajev_process_resident_memory_bytes", &[]).is_none());

    // Conventions promtool checks: help on every family, counters end in _total.
    for (name, kind) in &m.types {
        assert!(m.helps.contains(name), "{name} has no HELP");
        assert_eq!(kind == "counter", name.ends_with("_total"), "{name} is a {kind}");
    }
}

/// The names of the README's Metrics table (each backticked name in a row's first cell, labels
/// dropped).
fn readme_metric_names() -> BTreeSet<String> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let start = readme.find("\n## Metrics\n").expect("a Metrics section");
    let section = &readme[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let mut names = BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `")) {
        let first = row.split('|').nth(1).unwrap();
        for name in first.split('`').skip(1).step_by(2) {
            names.insert(name.split('{').next().unwrap().to_string());
        }
    }
    names
}

#[test]
fn the_readme_metrics_table_is_what_metrics_exposes() {
    let demo = start_demo();
    let scrape = scrape(&demo);
    let readme = readme_metric_names();
    let listed: BTreeSet<String> = readme.iter().filter(|n| n.starts_with("imajev_")).cloned().collect();
    let exposed = scrape.families_with_prefix("imajev_");
    assert_eq!(
        listed,
        exposed,
        "README-only: {:?}; /metrics-only: {:?}",
        listed.difference(&exposed).collect::<Vec<_>>(),
        exposed.difference(&listed).collect::<Vec<_>>()
    );
    assert!(readme.contains("process_*"), "{readme:?}");
    assert!(!scrape.families_with_prefix("process_").is_empty());
}

/// The f32 values the CPU engine keeps for every tensor of the safetensors files in `dir`.
fn numel(dir: &Path) -> usize {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files
        .iter()
        .map(|f| {
            let bytes = std::fs::read(f).unwrap();
            let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            meta.tensors().values().map(|t| t.shape.iter().product::<usize>()).sum::<usize>()
        })
        .sum()
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum()
}

#[test]
fn engine_weight_bytes_is_what_the_engine_holds() {
    // The CPU backend keeps every weight in f32: 4 bytes per value of the BF16 checkpoint, the
    // LoRA pairs and the readout — twice the checkpoint's BF16 bytes, not its size on disk.
    let tiny = common::tiny(SynthDtype::Bf16, 11);
    let engine = Qwen35::load(CpuBackend::default(), &tiny.model, Some(&tiny.adapter)).unwrap();
    let held = engine.weight_bytes().unwrap();
    assert_eq!(held, 4 * (numel(&tiny.model) + numel(&tiny.adapter)) as u64);
    assert!(held > dir_bytes(&tiny.model), "{held}");
}
