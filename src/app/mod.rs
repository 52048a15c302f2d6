//! The composition root of a serving process: flags → device → engine → worker → HTTP. It
//! resolves the model and adapter (or builds the demo), builds the decision layer from the
//! adapter's files, binds the port, starts the engine thread (which loads the weights in the
//! background, so the HTTP side can answer `503 loading` meanwhile) and serves HTTP until
//! SIGINT/SIGTERM — or until the model fails to load, which ends the process with the cause.
//! The release's name, description, date and recipe come from its manifest ([`crate::release`]).
//!
//! * [`device`] — which backend runs the model, and loading it there;
//! * [`demo`] — the random-weight demo bundle served with `--demo`.
//!
//! The only module that knows every layer; none of them knows it.

pub mod demo;
pub mod device;

pub use device::{cuda_backend, load_engine, Device, Quantize};

use crate::api::metrics::{register_build_info, BuildInfo};
use crate::api::ServerConfig;
use crate::decision::{Calibration, Codebook, ContractMode, Decider, DecisionSettings};
use crate::engine::adapter::{readout_path, ReadoutFile};
use crate::engine::ModelConfig;
use crate::image::ImageProcessorConfig;
use crate::release::cli::{download_help, is_missing, missing_release_help};
use crate::release::Manifest;
use crate::tokenizer::QwenTokenizer;
use crate::worker::{self, BatchLimits, EngineMetrics, EngineStatus, WorkerHandle};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Everything that decides which model answers and how.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Serve the built-in demo (then `model`, `adapter` and `calibration` are None).
    pub demo: bool,
    /// The release being served: its name, description, date, recipe and download commands.
    pub release: Manifest,
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
    let (contract, model) = (opts.contract.name().to_string(), p.info.model.clone());
    let calibration_version = p.info.calibration_version.clone().unwrap_or_else(|| "none".into());
    let build_registry = registry.clone();
    let (device, quantize, m, a) = (p.device, p.quantize, p.model_dir.clone(), p.adapter_dir.clone());
    // `imajev_build_info` appears once the model is loaded: only then is the backend known
    // (`--device auto` may fall back to the CPU).
    let load = move || {
        let engine = load_engine(device, quantize, &m, &a)?;
        let build = BuildInfo { backend: engine.backend_kind().into(), contract, model, calibration_version };
        register_build_info(&build_registry, &build).context("registering imajev_build_info")?;
        Ok(engine)
    };
    let (worker, engine_thread) = worker::spawn(load, p.queue_depth, p.batch, metrics);
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

/// Resolves the model and adapter (or builds the demo), checks that the flags and folders can
/// work — each refusal says what to do — and builds the decision layer from the adapter's files
/// and the tokenizer. No weights are loaded.
pub fn prepare(opts: &ServeOptions) -> Result<Prepared> {
    if opts.quantize != Quantize::None && opts.device == Device::Cpu {
        bail!(
            "--quantize {} needs a GPU (--device cuda): the CPU backend computes in f32; drop --quantize",
            opts.quantize.name()
        );
    }
    let release = &opts.release;
    let (demo, model_dir, adapter_dir) = match (opts.demo, &opts.model, &opts.adapter) {
        (true, _, _) => {
            let (d, m, a) = demo::demo_bundle().context("building the demo model")?;
            demo::announce(release);
            (Some(d), m, a)
        }
        (false, Some(m), Some(a)) => (None, m.clone(), a.clone()),
        (false, None, Some(_)) => bail!("--adapter needs --model (the base checkpoint it adapts)"),
        (false, Some(_), None) => {
            bail!("--adapter is required: decisions are read by the adapter's decision_readout.safetensors")
        }
        (false, None, None) => {
            bail!("no model to serve: give --model and --adapter, or --demo.\n{}", download_help(release))
        }
    };
    if demo.is_none() {
        for (what, dir) in [("base model", &model_dir), ("adapter", &adapter_dir)] {
            if is_missing(dir) {
                bail!("{}", missing_release_help(release, what, dir));
            }
        }
        check_weight_files(&model_dir, &adapter_dir)?;
    }
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
            demo::MODEL_NAME.into()
        } else {
            release.release.name.clone()
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

/// A model folder must hold its weights (one `*.safetensors` or an index of shards) and the
/// adapter folder its LoRA, checked here so that an incomplete download fails before the port is
/// served rather than when the engine gets to it.
fn check_weight_files(model: &Path, adapter: &Path) -> Result<()> {
    let has_weights = std::fs::read_dir(model)
        .with_context(|| format!("reading {}", model.display()))?
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"));
    if !has_weights {
        bail!(
            "{} holds no model.safetensors (nor shards): the download is incomplete; fetch it again, then \
             check it with `imajev-serve verify`",
            model.display()
        );
    }
    let lora = adapter.join("adapter_model.safetensors");
    if !lora.is_file() {
        bail!(
            "{} is missing: the adapter download is incomplete; check it with `imajev-serve verify`",
            lora.display()
        );
    }
    Ok(())
}

/// Serves HTTP with `http`'s settings and the model `opts` names until SIGINT or SIGTERM. The
/// port is bound first (a taken port fails before anything loads), then the engine thread starts
/// and the model loads in the background while `/livez` answers 200 and `/healthz` 503. A model
/// that fails to load stops the server and returns the cause. Returns once every accepted request
/// is answered and the engine thread has stopped.
pub fn serve_http(opts: &ServeOptions, mut http: ServerConfig) -> Result<()> {
    let listener = std::net::TcpListener::bind((http.host.as_str(), http.port)).with_context(|| {
        format!(
            "binding {}:{} (is another server on that port? choose another with --port)",
            http.host, http.port
        )
    })?;
    let addr = listener.local_addr()?;
    let service = start(opts)?;
    http.adapter_label = service.info.adapter.clone();
    if service.info.demo {
        http.model_description = demo::DESCRIPTION.into();
    } else {
        http.model_description = opts.release.release.description.clone();
        http.release_date = opts.release.release.release_date.clone();
        warn_off_recipe(opts);
    }
    tracing::info!(
        model = %service.info.model,
        adapter = %service.info.adapter.as_deref().unwrap_or("none"),
        rotations = service.info.rotations,
        contract = %opts.contract.name(),
        readout_codes = service.info.readout_codes,
        "listening on http://{addr} (the model loads in the background)"
    );
    // The demo's files stay until the engine thread has stopped.
    let Service { decider, worker, engine_thread, image_config, registry, demo: _demo_files, .. } = service;
    let watched = worker.clone();
    let app = crate::api::build_app_state(&http, worker, registry, image_config)?;
    app.set_decider(decider);
    let load_failure = Arc::new(std::sync::Mutex::new(None::<String>));
    let stop = stop_on_signal_or_load_failure(watched, load_failure.clone());
    let result =
        actix_web::rt::System::new().block_on(crate::api::run_http_server(listener, http, app, stop));
    // Every worker handle is gone once the server returns: the engine thread drains and stops.
    let _ = engine_thread.join();
    result?;
    let cause = load_failure.lock().unwrap_or_else(|e| e.into_inner()).take();
    match cause {
        Some(cause) => bail!("the model failed to load, so the server stopped: {cause}"),
        None => Ok(()),
    }
}

/// Resolves on SIGINT/SIGTERM, or when the engine reports that the model failed to load (then
/// the cause is left in `failure`).
async fn stop_on_signal_or_load_failure(
    worker: WorkerHandle,
    failure: Arc<std::sync::Mutex<Option<String>>>,
) {
    let load_failed = async move {
        loop {
            match worker.status() {
                EngineStatus::Failed(cause) => return cause,
                EngineStatus::Ready { .. } => return std::future::pending().await,
                EngineStatus::Loading => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
            }
        }
    };
    tokio::select! {
        _ = shutdown_signal() => {}
        cause = load_failed => {
            tracing::info!("the model failed to load; stopping the server");
            *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(cause);
        }
    }
}

/// Logs each flag that differs from the release's recipe (the manifest's `recipe`): serving
/// another way is allowed, but its answers are not the released ones.
fn warn_off_recipe(opts: &ServeOptions) {
    let r = &opts.release.recipe;
    let calibration =
        opts.calibration.as_deref().and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned());
    let differences: Vec<String> = [
        ("--rotations", opts.rotations.to_string(), r.rotations.to_string()),
        ("--quantize", opts.quantize.name().to_string(), r.quantize.clone()),
        ("--contract", opts.contract.name().to_string(), r.contract.clone()),
        ("--device", opts.device.name().to_string(), r.device.clone()),
        ("--calibration", calibration.unwrap_or_else(|| "none".into()), r.calibration.clone()),
    ]
    .into_iter()
    .filter(|(_, got, want)| got != want)
    .map(|(flag, got, want)| format!("{flag} {got} (the release: {want})"))
    .collect();
    if !differences.is_empty() {
        tracing::warn!(
            "serving {} off its released recipe: {}",
            opts.release.release.name,
            differences.join(", ")
        );
    }
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
