//! Tokenizer timing (not a test: timings are recorded, never asserted): a long state encoded in
//! one piece (`encode_whole`) vs cut into pieces encoded in parallel (`encode`, which
//! `tests/tokenizer_parity.rs` proves gives the same ids).
//!
//! `cargo run --release --example bench_tokenizer -- [--out bench/results/tokenizer.json]`

use imajev_serve::tokenizer::QwenTokenizer;
use serde_json::json;
use std::time::Instant;

const WORDS: &str =
    "printer network outage invoice refund account password badge floor office laptop screen \
error update firmware vendor contract team manager urgent tomorrow meeting report customer server database \
backup restore ticket queue escalation policy budget approval";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "bench/results/tokenizer.json".into());
    let tok = QwenTokenizer::builtin()?;
    let words: Vec<&str> = WORDS.split(' ').collect();
    let mut rows = Vec::new();
    for n_words in [1000usize, 4000, 16000] {
        // A deterministic state of the shape bench/gpu_bench.py sends, in the prompt's JSON line.
        let text: Vec<&str> = (0..n_words).map(|i| words[(i * 7 + i / 3) % words.len()]).collect();
        let prompt = format!("<|im_start|>user\nState: {{\"case\": \"{}\"}}\nQuestion", text.join(" "));
        let ids = tok.encode_whole(&prompt)?;
        anyhow::ensure!(tok.encode(&prompt)? == ids, "pieces differ from the whole");
        let time = |f: &dyn Fn() -> anyhow::Result<Vec<u32>>| -> anyhow::Result<f64> {
            let mut v = Vec::new();
            for _ in 0..7 {
                let t = Instant::now();
                f()?;
                v.push(t.elapsed().as_secs_f64() * 1e3);
            }
            Ok(median(v))
        };
        let whole = time(&|| tok.encode_whole(&prompt))?;
        let pieces = time(&|| tok.encode(&prompt))?;
        println!("{} tokens: whole {whole:.1} ms, pieces {pieces:.1} ms", ids.len());
        rows.push(json!({"tokens": ids.len(), "bytes": prompt.len(), "whole_median_ms": whole, "pieces_median_ms": pieces, "runs": 7}));
    }
    let doc = json!({
        "what": "QwenTokenizer::encode (long texts cut into pieces encoded in parallel) vs encode_whole",
        "command": "cargo run --release --example bench_tokenizer",
        "threads": rayon::current_num_threads(),
        "date": std::process::Command::new("date").arg("-u").arg("+%Y-%m-%d").output().ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()),
        "rows": rows,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&doc)? + "\n")?;
    println!("wrote {out}");
    Ok(())
}
