//! Device selection: which backend runs the model (`--device`), how its projection weights are
//! stored on a GPU (`--quantize`), and loading the model there (`auto` falls back to the CPU when
//! no GPU is usable).

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::engine::Qwen35;
use crate::worker::DecisionEngine;
use anyhow::Result;
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

/// Loads the model on the requested device (`auto`: CUDA when usable, else CPU).
pub fn load_engine(
    device: Device,
    quantize: Quantize,
    model: &Path,
    adapter: &Path,
) -> Result<Box<dyn DecisionEngine>> {
    match device {
        Device::Cuda => Ok(Box::new(Qwen35::load(cuda_backend(quantize)?, model, Some(adapter))?)),
        Device::Cpu => Ok(Box::new(Qwen35::load(CpuBackend::default(), model, Some(adapter))?)),
        Device::Auto => match cuda_backend(quantize) {
            Ok(b) => Ok(Box::new(Qwen35::load(b, model, Some(adapter))?)),
            Err(e) => {
                tracing::info!("no usable GPU ({e:#}); using the CPU backend");
                Ok(Box::new(Qwen35::load(CpuBackend::default(), model, Some(adapter))?))
            }
        },
    }
}
