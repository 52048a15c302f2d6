//! Device selection: which backend runs the model (`--device`), how its projection weights are
//! stored on a GPU (`--quantize`), and loading the model there (`auto` falls back to the CPU when
//! no GPU is usable, with a warning, unless `--quantize` asks for a GPU). Every load failure says
//! what to do about it.

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::engine::Qwen35;
use crate::worker::DecisionEngine;
use anyhow::{Context, Result};
use std::path::Path;

/// Which backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// CUDA when a usable GPU is present, else CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// How projection weights are stored on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Quantize {
    /// As the checkpoint stores them (block-FP8 checkpoints stay FP8; BF16 stays BF16).
    #[default]
    None,
    /// Quantise BF16/F32 projections to block FP8 (E4M3, 128×128 scales) at load.
    Fp8,
    /// Dequantise a block-FP8 checkpoint's projections to BF16 at load: BF16 GEMMs without FP8
    /// activation rounding, for the closest answers to a BF16 model from FP8 weights (twice the
    /// weight memory, slower at long inputs).
    Bf16,
}

impl Device {
    /// The flag value (`auto`, `cpu`, `cuda`).
    pub fn name(self) -> &'static str {
        match self {
            Device::Auto => "auto",
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

impl Quantize {
    /// The flag value (`none`, `fp8`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Quantize::None => "none",
            Quantize::Fp8 => "fp8",
            Quantize::Bf16 => "bf16",
        }
    }
}

/// What to do when no GPU is usable.
const NO_GPU_FIX: &str =
    "run where an NVIDIA driver and GPU are visible (Docker: --gpus all), or serve on the \
                          CPU with --device cpu and no --quantize (f32: correct, slow for a 4B model)";

/// The CUDA backend on GPU 0, or why there is none.
pub fn cuda_backend(quantize: Quantize) -> Result<CudaBackend> {
    CudaBackend::new(
        0,
        CudaOptions {
            quantize_fp8: quantize == Quantize::Fp8,
            dequantize_fp8: quantize == Quantize::Bf16,
            ..Default::default()
        },
    )
}

/// Loads the model on the requested device (`auto`: CUDA when usable, else the CPU with a
/// warning; with `--quantize` a GPU is required). Errors carry their fix.
pub fn load_engine(
    device: Device,
    quantize: Quantize,
    model: &Path,
    adapter: &Path,
) -> Result<Box<dyn DecisionEngine>> {
    let loaded = |r: Result<Box<dyn DecisionEngine>>| {
        r.with_context(|| {
            format!(
                "loading {} with the adapter {} (check both with `imajev-serve verify --model {} --adapter {}`)",
                model.display(),
                adapter.display(),
                model.display(),
                adapter.display()
            )
        })
    };
    let gpu = || cuda_backend(quantize).with_context(|| format!("no usable GPU; {NO_GPU_FIX}"));
    match device {
        Device::Cuda => {
            let backend = gpu()?;
            loaded(
                Qwen35::load(backend, model, Some(adapter)).map(|m| Box::new(m) as Box<dyn DecisionEngine>),
            )
        }
        Device::Cpu => loaded(
            Qwen35::load(CpuBackend::default(), model, Some(adapter))
                .map(|m| Box::new(m) as Box<dyn DecisionEngine>),
        ),
        Device::Auto => match cuda_backend(quantize) {
            Ok(b) => {
                loaded(Qwen35::load(b, model, Some(adapter)).map(|m| Box::new(m) as Box<dyn DecisionEngine>))
            }
            Err(e) if quantize != Quantize::None => Err(e).with_context(|| {
                format!("--quantize {} needs a GPU and none is usable; {NO_GPU_FIX}", quantize.name())
            }),
            Err(e) => {
                tracing::warn!(
                    cause = %format!("{e:#}"),
                    "--device auto: no usable GPU, so the model runs on the CPU in f32 (slow for a 4B model); \
                     --device cuda refuses instead"
                );
                loaded(
                    Qwen35::load(CpuBackend::default(), model, Some(adapter))
                        .map(|m| Box::new(m) as Box<dyn DecisionEngine>),
                )
            }
        },
    }
}
