//! Composition root of a serving process: resolves the model and adapter (or builds the demo),
//! builds the decision layer from the adapter's files, and starts the engine thread, which loads
//! the weights in the background so the HTTP side can answer `503 loading` meanwhile.

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::decision::{Calibration, Codebook, ContractMode, Decider, DecisionSettings};
use crate::engine::adapter::{readout_path, ReadoutFile};
use crate::synth::{self, SynthDtype};
use crate::engine::{ModelConfig, Qwen35};
use crate::image::ImageProcessorConfig;
use crate::tokenizer::QwenTokenizer;
use crate::worker::{self, BatchLimits, DecisionEngine, EngineMetrics, WorkerHandle};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

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

/// Everything that decides which model answers and how.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// None: the built-in demo model.
    pub model: Option<PathBuf>,
    pub adapter: Option<PathBuf>,
    pub calibration: Option<PathBuf>,
    pub rotations: usize,
    pub max_input_tokens: usize,
    pub device: Device,
    pub quantize: Quantize,
    pub model_name: Option<String>,
    pub contract: ContractMode,
    pub queue_depth: usize,
    pub batch: BatchLimits,
}

/// What `/v1/models` reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelInfo {
    pub model: String,
    pub model_dir: String,
    pub adapter: Option<String>,
    pub readout_codes: usize,
    pub max_options: usize,
    pub prompt_layout: &'static str,
    pub rotations: usize,
    pub calibration_version: Option<String>,
    pub contract: ContractMode,
    pub demo: bool,
}

/// The decision layer of a model + adapter, ready before any weight is loaded.
pub struct Prepared {
    pub decider: Arc<Decider>,
    pub image_config: ImageProcessorConfig,
    pub info: ModelInfo,
    pub model_dir: PathBuf,
    pub adapter_dir: PathBuf,
    pub device: Device,
    pub quantize: Quantize,
    pub queue_depth: usize,
    pub batch: BatchLimits,
    /// Keeps the demo checkpoint's temporary folder alive.
    pub demo: Option<tempfile::TempDir>,
}

pub struct Service {
    pub decider: Arc<Decider>,
    pub worker: WorkerHandle,
    pub engine_thread: JoinHandle<()>,
    pub image_config: ImageProcessorConfig,
    pub info: ModelInfo,
    pub registry: prometheus::Registry,
    /// Keeps the demo checkpoint's temporary folder alive.
    pub demo: Option<tempfile::TempDir>,
}

/// The demo bundle: the tiny synthetic Qwen3.5 (real tokenizer, random weights) and an
/// imajev-style adapter with a 256-code readout, written to a temporary folder.
pub fn demo_bundle() -> Result<(tempfile::TempDir, PathBuf, PathBuf)> {
    let dir = tempfile::Builder::new().prefix("imajev-demo-").tempdir()?;
    let cfg = synth::preset("tiny")?;
    let model = dir.path().join("model");
    let adapter = dir.path().join("adapter");
    synth::write_model(&cfg, SynthDtype::Bf16, 20261202, &model)?;
    synth::write_adapter(&cfg, 8, 16.0, 256, 20261202, &adapter)?;
    Codebook::derive(&QwenTokenizer::builtin()?, 256)?.write(&adapter.join("decision_readout.json"))?;
    Ok((dir, model, adapter))
}

const DEMO_NOTICE: &str = "\n\
==============================================================================\n\
  DEMO MODE: no --model given. Serving a tiny RANDOM-WEIGHT Qwen3.5 with the\n\
  real tokenizer. The API is real; the ANSWERS ARE MEANINGLESS. Point --model\n\
  at Qwen/Qwen3.5-4B and --adapter at mohit67890/imajev-4b to serve decisions.\n\
==============================================================================";

/// Builds the decision layer and starts the engine thread.
pub fn start(opts: &ServeOptions) -> Result<Service> {
    let p = prepare(opts)?;
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(EngineMetrics::new(&registry)?);
    metrics.weight_bytes.set(dir_bytes(&p.model_dir) as i64);
    let (device, quantize, m, a) = (p.device, p.quantize, p.model_dir.clone(), p.adapter_dir.clone());
    let (worker, engine_thread) =
        worker::spawn(move || load_engine(device, quantize, &m, &a), p.queue_depth, p.batch, metrics);
    Ok(Service {
        decider: p.decider,
        worker,
        engine_thread,
        image_config: p.image_config,
        info: p.info,
        registry,
        demo: p.demo,
    })
}

/// Resolves the model and adapter (building the demo when no model is given) and builds the
/// decision layer from the adapter's files and the tokenizer — no weights are loaded.
pub fn prepare(opts: &ServeOptions) -> Result<Prepared> {
    let (demo, model_dir, adapter_dir) = match (&opts.model, &opts.adapter) {
        (Some(m), a) => (None, m.clone(), a.clone()),
        (None, Some(_)) => bail!("--adapter needs --model (the base checkpoint it adapts)"),
        (None, None) => {
            let (d, m, a) = demo_bundle().context("building the demo model")?;
            eprintln!("{DEMO_NOTICE}");
            tracing::warn!("demo mode: random weights, meaningless answers");
            (Some(d), m, Some(a))
        }
    };
    let adapter_dir = adapter_dir.ok_or_else(|| {
        anyhow::anyhow!("--adapter is required: decisions are read by the adapter's decision_readout.safetensors")
    })?;
    if !model_dir.join("config.json").exists() {
        bail!("{} has no config.json; --model must be a Hugging Face model folder", model_dir.display());
    }
    let config = ModelConfig::from_file(&model_dir.join("config.json"))?;
    let tokenizer = Arc::new(QwenTokenizer::from_model_dir(&model_dir)?);
    let readout = readout_path(&adapter_dir);
    if !readout.exists() {
        bail!("{} is missing: the adapter folder must hold the decision readout", readout.display());
    }
    let rows = ReadoutFile::open(&readout, config.text_config.hidden_size)?.rows();
    let codebook = Codebook::for_adapter(&adapter_dir, &tokenizer, rows)?;
    let calibration = opts.calibration.as_deref().map(Calibration::load).transpose()?;
    let model_name = opts.model_name.clone().unwrap_or_else(|| if demo.is_some() { "imajev-demo".into() } else { "imajev-4b".into() });
    let settings = DecisionSettings {
        rotations: opts.rotations.max(1),
        calibration: calibration.clone(),
        mode: opts.contract,
        max_input_tokens: opts.max_input_tokens,
        model_name: model_name.clone(),
    };
    let decider = Arc::new(Decider::new(tokenizer, codebook, settings));
    let info = ModelInfo {
        model: model_name,
        model_dir: model_dir.display().to_string(),
        adapter: Some(adapter_dir.display().to_string()),
        readout_codes: rows,
        max_options: decider.max_options(),
        prompt_layout: "standard",
        rotations: opts.rotations.max(1),
        calibration_version: calibration.map(|c| c.version),
        contract: opts.contract,
        demo: demo.is_some(),
    };
    let image_config = ImageProcessorConfig::from_model_dir(&model_dir)?;
    Ok(Prepared {
        decider,
        image_config,
        info,
        model_dir,
        adapter_dir,
        device: opts.device,
        quantize: opts.quantize,
        queue_depth: opts.queue_depth,
        batch: opts.batch,
        demo,
    })
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
    CudaBackend::new(0, CudaOptions { quantize_fp8: quantize == Quantize::Fp8, dequantize_fp8: quantize == Quantize::Bf16, ..Default::default() })
}

/// Loads the model on the requested device (`auto`: CUDA when usable, else CPU).
pub fn load_engine(device: Device, quantize: Quantize, model: &Path, adapter: &Path) -> Result<Box<dyn DecisionEngine>> {
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

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
