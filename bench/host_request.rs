//! Host time of the long bucket's requests before the engine starts (not a test: timings are
//! recorded, never asserted): parsing the body (JSON, base64, decoding and resizing the photos)
//! and planning it (tokenising the ~15K-token state and every pass), as `api::pipeline::decide`
//! runs them, for 0, 1 and 2 photos of 4096² — the requests `bench/gpu_bench.py --long 1,2` sends.
//! Whether planning is worth overlapping with the decoding (issue 10's "host off the critical
//! path") is what it answers: planning is ~1 ms, the photos' decoding ~100-200 ms.
//!
//! `cargo run --release --example bench_host_request -- [--state-words 15000] [--diverse] [--side 4096] [--runs 5] [--out FILE]`
//!
//! The state is gpu_bench.py's: words drawn from 30 (which the tokenizer's word cache makes
//! cheap), or with `--diverse` random lowercase words of 3-9 letters (every word new to it).

use base64::Engine as _;
use imajev_serve::api::parse::{parse_request, ParseContext, RequestBody};
use imajev_serve::decision::{Codebook, ContractMode, Decider, DecisionSettings};
use imajev_serve::image::{ImageLimits, ImageProcessorConfig};
use imajev_serve::tokenizer::QwenTokenizer;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

const WORDS: &str =
    "printer network outage invoice refund account password badge floor office laptop screen error \
update firmware vendor contract team manager urgent tomorrow meeting report customer server \
database backup restore ticket queue escalation policy budget approval";

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// xorshift64: deterministic words and noise.
fn next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// A photo-like JPEG (smooth waves plus a little noise, as gpu_bench.py's `make_image` draws them).
fn photo_jpeg(side: usize, seed: u64) -> anyhow::Result<Vec<u8>> {
    let mut s = 0x9e37_79b9_7f4a_7c15 ^ seed;
    let mut rgb = vec![0u8; side * side * 3];
    for y in 0..side {
        for x in 0..side {
            let n = (next(&mut s) % 13) as f32 - 6.0;
            let v = [
                127.0 + 100.0 * (x as f32 / (9.0 + seed as f32)).sin(),
                127.0 + 100.0 * (y as f32 / 13.0).cos(),
                ((x + 2 * y) % 256) as f32,
            ];
            for c in 0..3 {
                rgb[(y * side + x) * 3 + c] = (v[c] + n).clamp(0.0, 255.0) as u8;
            }
        }
    }
    let mut jpeg = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, 90).encode(
        &rgb,
        side as u32,
        side as u32,
        image::ExtendedColorType::Rgb8,
    )?;
    Ok(jpeg)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let words: usize = arg(&args, "--state-words").map(|s| s.parse()).transpose()?.unwrap_or(15000);
    let side: usize = arg(&args, "--side").map(|s| s.parse()).transpose()?.unwrap_or(4096);
    let runs: usize = arg(&args, "--runs").map(|s| s.parse()).transpose()?.unwrap_or(5);
    let out = arg(&args, "--out");
    let diverse = args.iter().any(|a| a == "--diverse");

    let tok = Arc::new(QwenTokenizer::builtin()?);
    let codebook = Codebook::derive(&tok, 256)?;
    let settings = DecisionSettings {
        rotations: 4,
        calibration: None,
        mode: ContractMode::Imajev,
        max_input_tokens: 65536,
        model_name: "bench".into(),
    };
    let decider = Decider::new(tok, codebook, settings);
    let ctx = ParseContext {
        mode: ContractMode::Imajev,
        max_questions: 64,
        max_options: 255,
        image_limits: ImageLimits::default(),
        image_config: ImageProcessorConfig::default(),
    };
    let vocab: Vec<&str> = WORDS.split_whitespace().collect();
    let mut s = 7u64;
    let state: Vec<String> = (0..words)
        .map(|_| {
            if diverse {
                let n = 3 + (next(&mut s) % 7) as usize;
                (0..n).map(|_| (b'a' + (next(&mut s) % 26) as u8) as char).collect()
            } else {
                vocab[(next(&mut s) % vocab.len() as u64) as usize].to_string()
            }
        })
        .collect();
    let questions = json!({
        "route": {"type": "choice", "instructions": "Which team should handle this case?",
                  "criteria": {"infra": "network and connectivity", "facilities": "physical devices and rooms",
                               "identity": "accounts and access", "billing": "invoices and refunds"}},
        "urgent": {"type": "noul", "instructions": "Does the reporter need an answer today?",
                   "criteria": {"true": "a deadline or an outage is mentioned"}},
        "impact": {"type": "score", "instructions": "How many people are affected?",
                   "criteria": ["nobody", "one person", "a team", "a department", "the whole company"]},
    });
    let photos: Vec<String> = (0..2)
        .map(|i| {
            photo_jpeg(side, 10 + i).map(|j| {
                format!("data:image/jpeg;base64,{}", base64::engine::general_purpose::STANDARD.encode(j))
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let mut rows = Vec::new();
    for n_images in 0..=2 {
        let body = serde_json::to_vec(&json!({
            "model": "jev-latest",
            "state": {"case": state.join(" ")},
            "questions": questions,
            "images": photos[..n_images],
        }))?;
        let (mut parse_ms, mut plan_ms) = (Vec::new(), Vec::new());
        let mut tokens = 0;
        for _ in 0..runs {
            // As the pipeline runs them: parse (images decoded), then plan.
            let t = Instant::now();
            let parsed =
                parse_request(RequestBody::json(body.clone()), &ctx).map_err(|e| anyhow::anyhow!("{e:?}"))?;
            let t1 = Instant::now();
            let plan = decider.plan(&parsed.request).map_err(|e| anyhow::anyhow!("{e}"))?;
            parse_ms.push((t1 - t).as_secs_f64() * 1e3);
            plan_ms.push(t1.elapsed().as_secs_f64() * 1e3);
            tokens = plan.processed_tokens;
        }
        let (p, q) = (median(parse_ms), median(plan_ms));
        println!("{n_images} photo(s), {tokens} processed tokens: parse {p:.1} ms, plan {q:.1} ms");
        rows.push(json!({
            "images": n_images, "processed_tokens": tokens, "body_bytes": body.len(),
            "parse_median_ms": p, "plan_median_ms": q,
        }));
    }
    let result = json!({
        "what": "host time before the engine: parse (JSON, base64, decode + resize of 4096² JPEG photos), then plan (tokenising the state and every pass)",
        "command": format!(
            "cargo run --release --example bench_host_request -- --state-words {words}{} --side {side} --runs {runs}",
            if diverse { " --diverse" } else { "" }
        ),
        "threads": rayon::current_num_threads(),
        "rows": rows,
    });
    if let Some(path) = out {
        std::fs::write(&path, serde_json::to_string_pretty(&result)? + "\n")?;
    }
    Ok(())
}
