//! Shared test helpers: synthetic checkpoints in temporary folders.
#![allow(dead_code)]

use imajev_serve::engine::synth::{self, SynthDtype};
use std::path::{Path, PathBuf};

pub struct TinyModel {
    _dir: tempfile::TempDir,
    pub model: PathBuf,
    pub adapter: PathBuf,
}

/// Writes the `tiny` preset (and an adapter with a 12-row readout) for a seed and dtype.
pub fn tiny(dtype: SynthDtype, seed: u64) -> TinyModel {
    let dir = tempfile::tempdir().unwrap();
    let cfg = synth::preset("tiny").unwrap();
    let model = dir.path().join("model");
    let adapter = dir.path().join("adapter");
    synth::write_model(&cfg, dtype, seed, &model).unwrap();
    synth::write_adapter(&cfg, 4, 8.0, 12, seed, &adapter).unwrap();
    TinyModel { _dir: dir, model, adapter }
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// max |a − b| / max |b|
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).abs()).fold(0f64, f64::max) / scale
}
