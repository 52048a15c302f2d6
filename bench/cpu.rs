//! CPU benchmarks of the engine (not tests: timings are recorded, never asserted).
//!
//! `cargo run --release --example bench_cpu -- [--big] [--out bench/results/cpu.json]`
//!
//! * tiny-model prefill throughput (tokens/s) at several prompt lengths, and the cost of one
//!   forked suffix extension;
//! * with `--big`: write a synthetic Qwen3.5-4B block-FP8 checkpoint (`synth --config qwen3.5-4b
//!   --dtype fp8`, ~5.5 GB under bench/work/) and time its load into the CPU backend (which
//!   dequantises every weight to f32: ~18 GB of RAM).

use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::engine::Qwen35;
use imajev_serve::synth::{self, SynthDtype};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn rss_gib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / (1024.0 * 1024.0))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let big = args.iter().any(|a| a == "--big");
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("bench/results/cpu.json"));
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();

    let dir = tempfile::tempdir()?;
    let cfg = synth::preset("tiny")?;
    let t = Instant::now();
    synth::write_model(&cfg, SynthDtype::Bf16, 1, &dir.path().join("m"))?;
    synth::write_adapter(&cfg, 64, 128.0, 256, 1, &dir.path().join("a"))?;
    let synth_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let model = Qwen35::load(CpuBackend::default(), &dir.path().join("m"), Some(&dir.path().join("a")))?;
    let load_s = t.elapsed().as_secs_f64();
    let mut rows = Vec::new();
    for &n in &[64usize, 256, 1024, 4096] {
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % 240_000).collect();
        let reps = if n <= 256 { 9 } else { 3 };
        let mut times = Vec::new();
        for _ in 0..reps {
            let t = Instant::now();
            let (_, h, _) = model.prefill(&ids, &[])?;
            let _ = model.readout(&h)?;
            times.push(t.elapsed().as_secs_f64());
        }
        let med = median(times);
        eprintln!("tiny prefill {n:5} tokens: {:8.2} ms, {:9.0} tokens/s", med * 1e3, n as f64 / med);
        rows.push(json!({"tokens": n, "median_ms": med * 1e3, "tokens_per_s": n as f64 / med, "runs": reps}));
    }
    // A 1024-token prefix, then 12 forked 24-token suffixes extended as one batch.
    let ids: Vec<u32> = (0..1024u32).map(|i| (i * 104729) % 240_000).collect();
    let (prefix, _, _) = model.prefill(&ids, &[])?;
    let suffix: Vec<u32> = (0..24u32).map(|i| 1000 + i).collect();
    let mut times = Vec::new();
    for _ in 0..9 {
        let mut forks: Vec<_> = (0..12).map(|_| prefix.fork()).collect();
        let t = Instant::now();
        let refs: Vec<&[u32]> = (0..12).map(|_| suffix.as_slice()).collect();
        model.extend(&mut forks, &refs)?;
        times.push(t.elapsed().as_secs_f64());
    }
    let ext = median(times);
    eprintln!("tiny: 12 forked 24-token suffixes after a 1024-token prefix: {:.2} ms", ext * 1e3);

    let mut doc = json!({
        "what": "CPU engine benchmarks (f32 reference backend)",
        "command": "cargo run --release --example bench_cpu".to_string() + if big { " -- --big" } else { "" },
        "machine": {"cpu": cpu, "threads": rayon::current_num_threads()},
        "date": std::process::Command::new("date").arg("-u").arg("+%Y-%m-%d").output().ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()),
        "tiny": {
            "config": "synth --config tiny --dtype bf16 (hidden 64, 4 layers, vocab 248320) + LoRA r64 + 256-row readout",
            "synth_s": synth_s, "load_s": load_s,
            "prefill": rows,
            "extend_12x24_after_1024_ms": ext * 1e3,
        },
    });
    if big {
        let work = PathBuf::from("bench/work/qwen3.5-4b-fp8");
        let cfg = synth::preset("qwen3.5-4b")?;
        let t = Instant::now();
        let r = synth::write_model(&cfg, SynthDtype::Fp8, 0, &work)?;
        let synth_s = t.elapsed().as_secs_f64();
        eprintln!("4B fp8 synth: {:.1} s, {:.2} GiB", synth_s, r.bytes as f64 / (1u64 << 30) as f64);
        drop(model);
        let t = Instant::now();
        let big_model = Qwen35::load(CpuBackend::default(), &work, None)?;
        let load_s = t.elapsed().as_secs_f64();
        eprintln!(
            "4B fp8 load into the CPU backend: {:.1} s ({} FP8 weights)",
            load_s, big_model.report.fp8_weights
        );
        let ids: Vec<u32> = (0..16u32).map(|i| 1000 + i).collect();
        let t = Instant::now();
        let (_, h, _) = big_model.prefill(&ids, &[])?;
        let fwd_s = t.elapsed().as_secs_f64();
        let _ = h;
        doc["qwen3_5_4b_fp8"] = json!({
            "synth_command": "imajev-serve synth --config qwen3.5-4b --dtype fp8 --seed 0",
            "synth_s": synth_s, "checkpoint_gib": r.bytes as f64 / (1u64 << 30) as f64,
            "parameters": r.parameters, "tensors": r.tensors,
            "cpu_load_s": load_s, "fp8_weights": big_model.report.fp8_weights,
            "cpu_prefill_16_tokens_s": fwd_s,
            "peak_rss_gib": rss_gib(),
        });
    }
    if let Some(p) = out.parent() {
        std::fs::create_dir_all(p)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&doc)? + "\n")?;
    eprintln!("wrote {}", out.display());
    Ok(())
}
