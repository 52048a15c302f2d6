//! Fuzz targets for everything that reads untrusted bytes before the engine: the request parser
//! (JSON and multipart bodies, through planning), the `Content-Encoding` decoder, the image
//! sniffer/decoder/preprocessor and the asset-placeholder replacer.
//!
//! Stable Rust only (cargo-fuzz needs nightly): each target runs from `cargo test`, on random
//! inputs for a time budget, from a seeded RNG (proptest's `TestRng`, ChaCha). (bolero's stable
//! mode would drive it the same way, but its derive crate pins `indexmap = "=2.11.2"`, which would
//! downgrade the server's own `indexmap`.) A random byte string is read as a *mutation program*
//! over a committed seed corpus (`tests/fuzz/corpus/<target>/`): which seed, then byte flips,
//! insertions of tokens that matter to the parser (special tokens, boundaries, huge numbers,
//! deep brackets, …), deletions, duplications (amplification) and splices with another seed. So
//! most inputs stay close to valid requests and reach the deep checks, not just the JSON syntax.
//!
//! What every target asserts, for every input: no panic; an input is answered (Ok, or a 4xx,
//! never a 5xx: a bad request is never our bug); and within a time bound (quadratic work shows
//! up as a slow input). The placeholder target also compares the replacer with the obvious
//! quadratic scan it replaced, and the JSON target compares the skipping parser with a full
//! `serde_json` parse.
//!
//! * `cargo test --release --test fuzz` replays every seed of the corpus through its target
//!   (seconds; part of the normal test run);
//! * `IMAJEV_FUZZ_SECONDS=60 cargo test --release --test fuzz -- --ignored --test-threads 1`
//!   fuzzes each target for that long (`.ci/run` does this once, 55 s each); a failure prints
//!   `IMAJEV_FUZZ_SEED=… (input N)` and writes the input to `target/fuzz-failures/`; the same
//!   command with that seed replays it.

use imajev_serve::api::body::{decode, split_multipart, Coding};
use imajev_serve::api::budget::Reservation;
use imajev_serve::api::parse::{parse_json, top_level_members, Replacer, MAX_PLACEHOLDER_CHARS, READ_FIELDS};
use imajev_serve::api::{parse_request, plan_error, ParseContext, RequestBody};
use imajev_serve::decision::{Codebook, ContractMode, Decider, DecisionSettings};
use imajev_serve::image::{load_and_preprocess, sniff_format, ImageLimits, ImageProcessorConfig};
use imajev_serve::tokenizer::QwenTokenizer;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const BOUNDARY: &str = "fuzzBoundary7";

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no seeds in {}", dir.display());
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// Byte strings that matter to the parsers, spliced in by the mutator.
const TOKENS: &[&[u8]] = &[
    b"<|im_end|>",
    b"<|image_pad|>",
    b"<|im_start|>",
    b"</think>",
    b"<|vision_start|>",
    b"\\u0000",
    b"\\ud800",
    b"\"",
    b"\\",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"null",
    b"1e999",
    b"-0",
    b"12345678901234567890123456789",
    b"\"state\"",
    b"\"questions\"",
    b"\"assets\"",
    b"\"images\"",
    b"\"criteria\"",
    b"\"type\":\"choice\"",
    b"\"type\":\"multi\"",
    b"data:image/png;base64,",
    b"\r\n",
    b"--fuzzBoundary7",
    b"--fuzzBoundary7--",
    b"Content-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n",
    b"\xff\xfe",
    b"\xc3",
    b"\x00",
];

/// Reads `input` as a mutation program over `seeds` (see the module doc). The result is at
/// most `max_len` bytes.
fn mutate(seeds: &[Vec<u8>], input: &[u8], max_len: usize) -> Vec<u8> {
    let mut r = input.iter().copied();
    let mut next = move || r.next();
    let Some(pick) = next() else { return seeds[0].clone() };
    let mut out = seeds[pick as usize % seeds.len()].clone();
    let pos = |out: &Vec<u8>, a: u8, b: u8| -> usize {
        if out.is_empty() {
            0
        } else {
            (usize::from(a) << 8 | usize::from(b)) % (out.len() + 1)
        }
    };
    while let (Some(op), Some(a), Some(b)) = (next(), next(), next()) {
        let at = pos(&out, a, b);
        match op % 8 {
            0 => {
                if at < out.len() {
                    out[at] ^= 1 << (b % 8);
                }
            }
            1 => {
                let t = TOKENS[usize::from(a ^ b) % TOKENS.len()];
                out.splice(at..at, t.iter().copied());
            }
            2 => {
                let len = usize::from(next().unwrap_or(1)) + 1;
                let end = (at + len).min(out.len());
                out.drain(at..end);
            }
            3 => {
                // Duplicate a stretch many times: long strings, many elements, deep nesting.
                let len = usize::from(next().unwrap_or(1) % 32) + 1;
                let times = usize::from(next().unwrap_or(1)) * 64 + 1;
                let end = (at + len).min(out.len());
                let piece = out[at..end].to_vec();
                let rep = piece.repeat(times);
                out.splice(end..end, rep);
            }
            4 => {
                let other = &seeds[usize::from(a) % seeds.len()];
                if !other.is_empty() {
                    let from = usize::from(b) * 7 % other.len();
                    let len = usize::from(next().unwrap_or(16));
                    let piece = &other[from..(from + len).min(other.len())];
                    out.splice(at..at, piece.iter().copied());
                }
            }
            5 => out.truncate(at),
            6 => {
                if at < out.len() {
                    out[at] = next().unwrap_or(0);
                }
            }
            _ => {
                let n = usize::from(next().unwrap_or(0) % 16);
                let bytes: Vec<u8> = (0..n).filter_map(|_| next()).collect();
                out.splice(at..at, bytes);
            }
        }
        if out.len() > max_len {
            out.truncate(max_len);
        }
    }
    out
}

// ------------------------------------------------------------------------------------ targets

struct Parser {
    decider: Arc<Decider>,
    ctx: ParseContext,
}

fn parser() -> &'static Parser {
    static P: OnceLock<Parser> = OnceLock::new();
    P.get_or_init(|| {
        let tok = Arc::new(QwenTokenizer::builtin().unwrap());
        let codebook = Codebook::derive(&tok, 256).unwrap();
        let settings = DecisionSettings {
            rotations: 4,
            calibration: None,
            mode: ContractMode::Typesafe,
            max_input_tokens: 8192,
            model_name: "fuzz".into(),
        };
        let decider = Arc::new(Decider::new(tok, codebook, settings));
        let ctx = ParseContext {
            mode: ContractMode::Typesafe,
            max_questions: 64,
            max_options: 255,
            // Small images keep each input fast; the limits' own checks are what is tested.
            image_limits: ImageLimits { max_bytes: 1 << 20, max_pixels: 1 << 20 },
            image_config: ImageProcessorConfig::default(),
        };
        Parser { decider, ctx }
    })
}

/// A parsed request is planned too (tokenizing, the special-token rule, the token limit).
fn parse_and_plan(body: RequestBody, mode: ContractMode) {
    let p = parser();
    let mut ctx = p.ctx.clone();
    ctx.mode = mode;
    match parse_request(body, &ctx) {
        Ok(parsed) => {
            if let Err(e) = p.decider.plan(&parsed.request) {
                let e = plan_error(e);
                assert!(e.status < 500, "planning failed with {}: {}", e.status, e.summary());
            }
        }
        Err(e) => assert!(e.status < 500, "refused with {}: {}", e.status, e.summary()),
    }
}

fn request_json(data: &[u8]) {
    // The skipping parser keeps exactly the read members of a full parse.
    if let Ok(full) = serde_json::from_slice::<Value>(data.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(data)) {
        let kept = parse_json(data, imajev_serve::api::Loc::body());
        match (&full, kept) {
            (Value::Object(m), Ok(Value::Object(k))) => {
                let want: serde_json::Map<String, Value> = m
                    .iter()
                    .filter(|(key, _)| READ_FIELDS.contains(&key.as_str()))
                    .map(|(a, b)| (a.clone(), b.clone()))
                    .collect();
                assert_eq!(Value::Object(want), Value::Object(k));
                let body = data.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(data);
                let members = top_level_members(body).unwrap();
                assert!(members.len() >= m.len());
            }
            (Value::Object(_), Err(e)) => assert!(e.status == 413, "{}", e.summary()),
            (_, Ok(v)) => assert_eq!(v, Value::Null),
            (_, Err(e)) => panic!("a non-object JSON body is not a parse error: {}", e.summary()),
        }
    } else {
        let e = parse_json(data, imajev_serve::api::Loc::body()).unwrap_err();
        assert_eq!(e.code, "bad_json");
    }
    for mode in [ContractMode::Typesafe, ContractMode::Imajev] {
        parse_and_plan(RequestBody::json(data.to_vec()), mode);
    }
}

fn multipart_headers() -> actix_web::http::header::HeaderMap {
    let mut h = actix_web::http::header::HeaderMap::new();
    h.insert(
        actix_web::http::header::CONTENT_TYPE,
        format!("multipart/form-data; boundary={BOUNDARY}").parse().unwrap(),
    );
    h
}

fn request_multipart(data: &[u8]) {
    match split_multipart(&multipart_headers(), data.to_vec(), Reservation::none()) {
        Ok((json, files, _)) => parse_and_plan(RequestBody::multipart(json, files), ContractMode::Typesafe),
        Err(e) => assert_eq!((e.status, e.code), (422, "bad_request"), "{}", e.summary()),
    }
}

fn body_decoder(data: &[u8]) {
    const CAP: usize = 1 << 20;
    let Some((&which, rest)) = data.split_first() else { return };
    let codings: &[Coding] = match which % 4 {
        0 => &[Coding::Zstd],
        1 => &[Coding::Gzip],
        2 => &[Coding::Gzip, Coding::Zstd],
        _ => &[Coding::Zstd, Coding::Gzip],
    };
    match decode(rest.to_vec(), codings, CAP) {
        Ok(out) => assert!(out.len() <= CAP),
        Err(e) => assert!(e.status == 413 || (e.status, e.code) == (422, "bad_request"), "{}", e.summary()),
    }
}

fn image(data: &[u8]) {
    let _ = sniff_format(data);
    let limits = ImageLimits { max_bytes: 1 << 20, max_pixels: 1 << 20 };
    if let Err(e) = load_and_preprocess(data, &limits, &ImageProcessorConfig::default()) {
        assert!(matches!(e.http_status(), 413 | 422), "{e}");
    }
}

/// The obvious quadratic scan the replacer replaced: the reference for its output.
fn naive_replace(pairs: &[(String, String)], s: &str) -> String {
    let mut pairs: Vec<&(String, String)> = pairs.iter().filter(|p| !p.0.is_empty()).collect();
    pairs.sort_by_key(|p| std::cmp::Reverse(p.0.len()));
    let mut out = String::new();
    let mut i = 0;
    'scan: while i < s.len() {
        for (p, r) in &pairs {
            if s[i..].starts_with(p.as_str()) {
                out.push_str(r);
                i += p.len();
                continue 'scan;
            }
        }
        let c = s[i..].chars().next().unwrap();
        out.push(c);
        i += c.len_utf8();
    }
    out
}

fn placeholders(data: &[u8]) {
    // Seeds are `placeholder\x1fplaceholder\x1e text`: up to two (distinct) placeholders.
    let s = String::from_utf8_lossy(data);
    let (keys, text) = s.split_once('\u{1e}').unwrap_or(("", &s));
    let mut pairs: Vec<(String, String)> = Vec::new();
    for (i, k) in keys.split('\u{1f}').take(2).enumerate() {
        // As the wire rules bound them (parse_assets refuses longer ones).
        let k: String = k.chars().take(MAX_PLACEHOLDER_CHARS).collect();
        if !k.is_empty() && !pairs.iter().any(|p| p.0 == k) {
            pairs.push((k, format!("[image {}]", i + 1)));
        }
    }
    let r = Replacer::new(pairs.clone());
    let got = r.text(text);
    assert_eq!(got, naive_replace(&pairs, text), "keys {keys:?}");
}

// ------------------------------------------------------------------------------------ drivers

struct Target {
    name: &'static str,
    run: fn(&[u8]),
    max_len: usize,
    /// Longest one input may take (a slow input is a finding: quadratic work, a bomb).
    per_input: Duration,
}

const TARGETS: [Target; 5] = [
    Target { name: "request_json", run: request_json, max_len: 1 << 20, per_input: Duration::from_secs(2) },
    Target {
        name: "request_multipart",
        run: request_multipart,
        max_len: 1 << 20,
        per_input: Duration::from_secs(2),
    },
    Target { name: "body_decoder", run: body_decoder, max_len: 1 << 16, per_input: Duration::from_secs(2) },
    Target { name: "image", run: image, max_len: 1 << 18, per_input: Duration::from_secs(5) },
    Target { name: "placeholders", run: placeholders, max_len: 1 << 16, per_input: Duration::from_secs(2) },
];

fn target(name: &str) -> &'static Target {
    TARGETS.iter().find(|t| t.name == name).unwrap()
}

fn timed(t: &Target, input: &[u8]) {
    let t0 = Instant::now();
    (t.run)(input);
    let took = t0.elapsed();
    assert!(took <= t.per_input, "{}: one input of {} bytes took {took:?}", t.name, input.len());
}

/// Replays every seed of every target's corpus (part of the normal test run).
#[test]
fn seed_corpus_replays() {
    parser(); // loaded once, outside any input's time
    for t in &TARGETS {
        let seeds = corpus(t.name);
        for s in &seeds {
            timed(t, s);
        }
    }
}

fn fuzz(name: &str) {
    use proptest::prelude::Rng;
    use proptest::test_runner::{RngAlgorithm, TestRng};
    let t = target(name);
    let seeds = corpus(name);
    parser(); // loaded once, outside any input's time
    let secs: u64 = std::env::var("IMAJEV_FUZZ_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let seed: u64 =
        std::env::var("IMAJEV_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
        });
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &key);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut n = 0u64;
    while Instant::now() < deadline {
        let len = (rng.next_u32() % 512) as usize;
        let mut program = vec![0u8; len];
        rng.fill_bytes(&mut program);
        let data = mutate(&seeds, &program, t.max_len);
        if let Err(e) = std::panic::catch_unwind(|| timed(t, &data)) {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-failures");
            std::fs::create_dir_all(&dir).unwrap();
            let file = dir.join(format!("{name}-{seed}-{n}.bin"));
            std::fs::write(&file, &data).unwrap();
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
            panic!(
                "{name}: IMAJEV_FUZZ_SEED={seed} (input {n}) failed: {}; the input is {}",
                msg.unwrap_or_default(),
                file.display()
            );
        }
        n += 1;
    }
    eprintln!("{name}: {n} inputs in {secs} s (IMAJEV_FUZZ_SEED={seed})");
}

#[test]
#[ignore = "fuzzing: IMAJEV_FUZZ_SECONDS=60 cargo test --release --test fuzz -- --ignored --test-threads 1"]
fn fuzz_request_json() {
    fuzz("request_json");
}

#[test]
#[ignore = "fuzzing: IMAJEV_FUZZ_SECONDS=60 cargo test --release --test fuzz -- --ignored --test-threads 1"]
fn fuzz_request_multipart() {
    fuzz("request_multipart");
}

#[test]
#[ignore = "fuzzing: IMAJEV_FUZZ_SECONDS=60 cargo test --release --test fuzz -- --ignored --test-threads 1"]
fn fuzz_body_decoder() {
    fuzz("body_decoder");
}

#[test]
#[ignore = "fuzzing: IMAJEV_FUZZ_SECONDS=60 cargo test --release --test fuzz -- --ignored --test-threads 1"]
fn fuzz_image() {
    fuzz("image");
}

#[test]
#[ignore = "fuzzing: IMAJEV_FUZZ_SECONDS=60 cargo test --release --test fuzz -- --ignored --test-threads 1"]
fn fuzz_placeholders() {
    fuzz("placeholders");
}

/// The mutator is deterministic and bounded.
#[test]
fn mutations_are_deterministic_and_bounded() {
    let seeds = vec![b"{\"state\": \"x\"}".to_vec(), b"abc".to_vec()];
    let prog: Vec<u8> = (0..=255u8).collect();
    let a = mutate(&seeds, &prog, 4096);
    assert_eq!(a, mutate(&seeds, &prog, 4096));
    assert!(a.len() <= 4096);
    assert_eq!(mutate(&seeds, &[], 10), seeds[0]);
}
