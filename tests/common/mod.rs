//! Shared test helpers: synthetic checkpoints in temporary folders ([`server`]: the built binary
//! as a real process).
#![allow(dead_code)]

pub mod packing;
pub mod server;

use imajev_serve::synth::{self, SynthDtype};
use std::path::{Path, PathBuf};

pub struct TinyModel {
    _dir: tempfile::TempDir,
    pub model: PathBuf,
    pub adapter: PathBuf,
}

/// Writes a synthetic checkpoint (`config`: a preset name or a config.json path) and an
/// imajev-style adapter (LoRA rank/alpha, a readout of `rows` rows, its decision_readout.json)
/// into a temporary folder.
pub fn bundle(config: &str, dtype: SynthDtype, seed: u64, rank: usize, alpha: f64, rows: usize) -> TinyModel {
    let dir = tempfile::tempdir().unwrap();
    let cfg = synth::preset(config).unwrap();
    let model = dir.path().join("model");
    let adapter = dir.path().join("adapter");
    synth::write_model(&cfg, dtype, seed, &model).unwrap();
    synth::write_adapter(&cfg, rank, alpha, rows, seed, &adapter).unwrap();
    let tokenizer = imajev_serve::tokenizer::QwenTokenizer::builtin().unwrap();
    imajev_serve::decision::Codebook::derive(&tokenizer, rows)
        .unwrap()
        .write(&adapter.join("decision_readout.json"))
        .unwrap();
    TinyModel { _dir: dir, model, adapter }
}

/// The `tiny` preset with a rank-4 adapter and a 12-row readout.
pub fn tiny(dtype: SynthDtype, seed: u64) -> TinyModel {
    bundle("tiny", dtype, seed, 4, 8.0, 12)
}

/// A synthetic model described by a fixture's model spec (`config`?, `dtype`, `seed`, and the
/// adapter's `rank`/`lora_rank`, `alpha`/`lora_alpha`, `readout_rows`).
pub fn from_spec(spec: &serde_json::Value, config_dir: &Path) -> TinyModel {
    let config = match spec.get("config").and_then(|c| c.as_str()) {
        Some(c) if c.ends_with(".json") => config_dir.join(c).to_string_lossy().to_string(),
        Some(c) => c.to_string(),
        None => "tiny".to_string(),
    };
    let dtype = match spec["dtype"].as_str().unwrap() {
        "f32" => SynthDtype::F32,
        "bf16" => SynthDtype::Bf16,
        "fp8" => SynthDtype::Fp8,
        other => panic!("dtype {other}"),
    };
    let adapter = spec.get("adapter").unwrap_or(spec);
    let num = |a: &str, b: &str| {
        adapter.get(a).or_else(|| adapter.get(b)).unwrap_or_else(|| panic!("model spec lacks {a}"))
    };
    bundle(
        &config,
        dtype,
        spec["seed"].as_u64().unwrap(),
        num("rank", "lora_rank").as_u64().unwrap() as usize,
        num("alpha", "lora_alpha").as_f64().unwrap(),
        num("readout_rows", "readout_rows").as_u64().unwrap() as usize,
    )
}

/// The fixtures beside the sources this was built from, else under the current directory (GPU
/// test binaries are built on one machine and run from the repository root on another).
pub fn fixtures() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    if built.exists() {
        built
    } else {
        PathBuf::from("tests/fixtures")
    }
}

/// max |a − b| / max |b|
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).abs()).fold(0f64, f64::max) / scale
}
