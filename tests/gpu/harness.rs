//! What every device check shares: the one CUDA backend of the test binary (tests take turns on
//! it), the report table, error measures, and the inputs (random tensors, golden fixtures).

use anyhow::{anyhow, Result};
use imajev_serve::backend::cpu::CpuBackend;
use imajev_serve::backend::cuda::{CudaBackend, CudaOptions};
use imajev_serve::image::{load_and_preprocess, ImageLimits, ImageProcessorConfig};
use imajev_serve::synth::{self, SynthDtype};
use serde_json::Value;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The device for one test: the shared CUDA backend (created once, with the kernels compiled or
/// loaded from the cache) and the CPU reference. Holding it keeps other tests off the GPU, so
/// timings and memory are one test's own.
pub struct Gpu {
    _turn: MutexGuard<'static, ()>,
    pub g: CudaBackend,
    pub c: CpuBackend,
}

/// The device, or None (after printing `skipped: no CUDA device (...)`) on a machine without one.
pub fn gpu(test: &str) -> Option<Gpu> {
    static TURN: Mutex<()> = Mutex::new(());
    static BACKEND: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    let turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let backend = BACKEND.get_or_init(|| {
        let g = CudaBackend::new(0, CudaOptions::default()).map_err(|e| format!("{e:#}"))?;
        let i = g.info();
        println!("{}", imajev_serve::backend::Backend::describe(&g));
        println!(
            "kernels: {} from cache, {} compiled, {:.2} s",
            i.kernels_cached, i.kernels_compiled, i.kernel_seconds
        );
        Ok(g)
    });
    match backend {
        Ok(g) => {
            println!("\n== {test}");
            Some(Gpu { _turn: turn, g: g.clone(), c: CpuBackend::default() })
        }
        Err(e) => {
            println!("{test}: skipped: no CUDA device ({e})");
            None
        }
    }
}

/// A second backend on the same GPU with other options (the reference of a fused path).
pub fn variant(g: &CudaBackend, options: impl FnOnce(&mut CudaOptions)) -> Result<CudaBackend> {
    let mut o = g.options().clone();
    options(&mut o);
    CudaBackend::new(0, o)
}

/// One line of a report: a checked value against its tolerance, a flag, or information.
pub struct Row {
    part: &'static str,
    name: String,
    value: f64,
    tol: f64,
    ok: bool,
    note: String,
}

#[derive(Default)]
pub struct Report {
    pub rows: Vec<Row>,
}

impl Report {
    pub fn check(&mut self, part: &'static str, name: impl Into<String>, value: f64, tol: f64) -> bool {
        let ok = value.is_finite() && value <= tol;
        self.rows.push(Row { part, name: name.into(), value, tol, ok, note: String::new() });
        ok
    }
    pub fn flag(&mut self, part: &'static str, name: impl Into<String>, ok: bool, note: impl Into<String>) {
        self.rows.push(Row {
            part,
            name: name.into(),
            value: f64::NAN,
            tol: f64::NAN,
            ok,
            note: note.into(),
        });
    }
    pub fn info(&mut self, part: &'static str, name: impl Into<String>, value: f64, note: impl Into<String>) {
        self.rows.push(Row { part, name: name.into(), value, tol: f64::NAN, ok: true, note: note.into() });
    }
    pub fn fail(&mut self, part: &'static str, name: impl Into<String>, e: anyhow::Error) {
        self.rows.push(Row {
            part,
            name: name.into(),
            value: f64::NAN,
            tol: f64::NAN,
            ok: false,
            note: format!("ERROR: {e:#}"),
        });
    }
    /// Runs one group of checks; an error becomes a failed row instead of ending the test.
    pub fn guard(&mut self, part: &'static str, name: &str, f: impl FnOnce(&mut Report) -> Result<()>) {
        if let Err(e) = f(self) {
            self.fail(part, name.to_string(), e);
        }
    }
    /// Prints the table and fails the test if any row failed.
    pub fn finish(self, test: &str) {
        self.print();
        let failed: Vec<String> = self
            .rows
            .iter()
            .filter(|r| !r.ok)
            .map(|r| format!("{} {}: {:.3e} {}", r.part, r.name, r.value, r.note))
            .collect();
        assert!(failed.is_empty(), "{test}: {} GPU checks failed:\n{}", failed.len(), failed.join("\n"));
    }
    pub fn print(&self) {
        println!("\n{:<6} {:<64} {:>10} {:>9}  {:<4} note", "part", "check", "value", "tol", "ok");
        println!("{}", "-".repeat(110));
        for r in &self.rows {
            let v = if r.value.is_nan() { "-".to_string() } else { format!("{:.3e}", r.value) };
            let t = if r.tol.is_nan() { "-".to_string() } else { format!("{:.0e}", r.tol) };
            println!(
                "{:<6} {:<64} {:>10} {:>9}  {:<4} {}",
                r.part,
                r.name,
                v,
                t,
                if r.ok { "ok" } else { "FAIL" },
                r.note
            );
        }
        let bad = self.rows.iter().filter(|r| !r.ok).count();
        println!("{} checks, {} failed", self.rows.len(), bad);
    }
}

/// `max |got − want| / max |want|` (infinite on a length mismatch or a NaN).
pub fn rel(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    got.iter().zip(want).map(|(g, w)| (*g as f64 - *w as f64).abs()).fold(0f64, |m, d| {
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    }) / scale
}

/// `‖got − want‖₂ / ‖want‖₂`.
pub fn rms_rel(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

/// Index of the largest value (the first on ties).
pub fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0
}

/// Positions where two f32 slices differ in their bits (a length mismatch counts every position of
/// the longer one).
pub fn bit_diff(a: &[f32], b: &[f32]) -> usize {
    if a.len() != b.len() {
        return a.len().max(b.len());
    }
    a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count()
}

/// Consecutive row ranges of the given lengths (a packed batch's segments).
pub fn tiling(lens: &[usize]) -> Vec<Range<usize>> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            at += l;
            at - l..at
        })
        .collect()
}

/// Row-major `[n, w_i]` blocks concatenated along columns into `[n, Σ w_i]` (the layout of a
/// fused projection). Returns the data and the total width.
pub fn cat_cols(n: usize, parts: &[&[f32]]) -> (Vec<f32>, usize) {
    let widths: Vec<usize> = parts.iter().map(|p| p.len().checked_div(n).unwrap_or(0)).collect();
    let w: usize = widths.iter().sum();
    let mut out = Vec::with_capacity(n * w);
    for r in 0..n {
        for (p, &pw) in parts.iter().zip(&widths) {
            out.extend_from_slice(&p[r * pw..(r + 1) * pw]);
        }
    }
    (out, w)
}

/// ` parents [..]` for a call that runs a tree, else nothing.
pub fn tree_note(parents: &[Option<usize>]) -> String {
    if parents.is_empty() {
        return String::new();
    }
    let p: Vec<String> = parents.iter().map(|p| p.map_or("-".into(), |i| i.to_string())).collect();
    format!(" parents [{}]", p.join(","))
}

/// The golden fixtures: beside the sources this was built from, else under the current directory
/// (the test binary is built on one machine and run from the repository root on the GPU machine).
pub fn fixtures() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden");
    if built.join("cases.json").exists() {
        built
    } else {
        PathBuf::from("tests/fixtures/golden")
    }
}

/// A JSON array of numbers as f32.
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

/// A synthetic model and adapter written from a golden case's spec (removed on drop).
pub struct Synthesized {
    _dir: tempfile::TempDir,
    pub model: PathBuf,
    pub adapter: PathBuf,
}

pub fn synthesize(spec: &Value) -> Result<Synthesized> {
    let dir = tempfile::tempdir()?;
    let cfg_name = spec["config"].as_str().unwrap();
    let cfg = if cfg_name.ends_with(".json") {
        synth::preset(fixtures().join(cfg_name).to_str().unwrap())?
    } else {
        synth::preset(cfg_name)?
    };
    let dtype = match spec["dtype"].as_str().unwrap() {
        "f32" => SynthDtype::F32,
        "bf16" => SynthDtype::Bf16,
        "fp8" => SynthDtype::Fp8,
        other => return Err(anyhow!("dtype {other}")),
    };
    let seed = spec["seed"].as_u64().unwrap();
    let (model, adapter) = (dir.path().join("model"), dir.path().join("adapter"));
    synth::write_model(&cfg, dtype, seed, &model)?;
    let a = &spec["adapter"];
    synth::write_adapter(
        &cfg,
        a["rank"].as_u64().unwrap() as usize,
        a["alpha"].as_f64().unwrap(),
        a["readout_rows"].as_u64().unwrap() as usize,
        seed,
        &adapter,
    )?;
    Ok(Synthesized { _dir: dir, model, adapter })
}

/// A golden case's images, preprocessed for the model.
pub fn images(case: &Value, model: &Path) -> Result<Vec<imajev_serve::image::PatchedImage>> {
    let pcfg = ImageProcessorConfig::from_model_dir(model)?;
    case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let bytes = std::fs::read(fixtures().join("images").join(n.as_str().unwrap()))?;
            Ok(load_and_preprocess(&bytes, &ImageLimits::default(), &pcfg)?.1)
        })
        .collect()
}
