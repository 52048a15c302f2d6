//! The composition root of a serving process: flags → device → engine → worker → HTTP. It
//! resolves the model and adapter (or builds the demo), builds the decision layer from the
//! adapter's files, starts the engine thread (which loads the weights in the background, so the
//! HTTP side can answer `503 loading` meanwhile) and serves HTTP until SIGINT/SIGTERM.
//!
//! * [`device`] — which backend runs the model, and loading it there;
//! * [`demo`] — the random-weight demo bundle served without `--model`.
//!
//! The only module that knows every layer; none of them knows it.

pub mod demo;
pub mod device;

pub use device::{cuda_backend, load_engine, Device, Quantize};

use crate::api::{AppState, ServerConfig};
use crate::decision::{Calibration, Codebook, ContractMode, Decider, DecisionSettings};
use crate::engine::adapter::{readout_path, ReadoutFile};
use crate::engine::ModelConfig;
use crate::image::ImageProcessorConfig;
use crate::tokenizer::QwenTokenizer;
use crate::worker::{self, BatchLimits, EngineMetrics, WorkerHandle};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

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

/// A started serving process, before HTTP: the decision layer and the engine thread.
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
            let (d, m, a) = demo::demo_bundle().context("building the demo model")?;
            eprintln!("{}", demo::DEMO_NOTICE);
            tracing::warn!("demo mode: random weights, meaningless answers");
            (Some(d), m, Some(a))
        }
    };
    let adapter_dir = adapter_dir.ok_or_else(|| {
        anyhow::anyhow!(
            "--adapter is required: decisions are read by the adapter's decision_readout.safetensors"
        )
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
    let model_name = opts.model_name.clone().unwrap_or_else(|| {
        if demo.is_some() {
            "imajev-demo".into()
        } else {
            "imajev-4b".into()
        }
    });
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

/// Serves HTTP with `http`'s settings and the model `opts` names until SIGINT or SIGTERM: starts
/// the engine thread (the model loads in the background), binds `http.host:http.port`, and
/// returns once every accepted request is answered and the engine thread has stopped.
pub fn serve_http(opts: &ServeOptions, mut http: ServerConfig) -> Result<()> {
    let service = start(opts)?;
    http.adapter_label = service.info.adapter.clone();
    if service.info.demo {
        http.model_description =
            "Demo: a tiny random-weight Qwen3.5 with the real tokenizer; answers are meaningless".into();
    }
    tracing::info!(
        model = %service.info.model, adapter = ?service.info.adapter, rotations = service.info.rotations,
        contract = ?service.info.contract, readout_codes = service.info.readout_codes,
        "serving on http://{}:{} (the model loads in the background)", http.host, http.port
    );
    // The demo's files stay until the engine thread has stopped.
    let Service { decider, worker, engine_thread, image_config, registry, demo: _demo_files, .. } = service;
    let app = crate::api::build_app_state(&http, worker, registry, image_config)?;
    app.set_decider(decider);
    let result = actix_web::rt::System::new().block_on(run_http_until_signal(http, app));
    // Every worker handle is gone once the server returns: the engine thread drains and stops.
    let _ = engine_thread.join();
    result
}

/// Binds `cfg.host:cfg.port` and serves until SIGINT/SIGTERM; returns once accepted requests
/// have finished. Must run inside an actix system.
async fn run_http_until_signal(cfg: ServerConfig, app: AppState) -> Result<()> {
    let listener = std::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .with_context(|| format!("binding {}:{}", cfg.host, cfg.port))?;
    crate::api::run_http_server(listener, cfg, app, shutdown_signal()).await
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!("cannot listen for SIGTERM/SIGINT ({e}); stop the server with SIGKILL");
            return std::future::pending().await;
        }
    };
    let which = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!("{which}: stopping; accepted requests finish first");
}

/// The API keys of `--api-key-file`: one per line; blank lines and `#` comments are skipped.
pub fn read_api_keys(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --api-key-file {}", path.display()))?;
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    if keys.is_empty() {
        bail!("--api-key-file {} holds no keys (one per line)", path.display());
    }
    Ok(keys)
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
