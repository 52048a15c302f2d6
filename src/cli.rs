//! The command-line interface: `serve`, `decide`, `verify`, `tokenize`, `forward`, `synth`. Flags are
//! defined and mapped to options here; the serving process itself is put together in
//! [`crate::app`].
//! Output contracts here are relied upon by other tools; change them only with care.

use crate::app::{self, Device, Quantize, ServeOptions};
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::decision::ContractMode;
use crate::engine::Qwen35;
use crate::image::{ImageLimits, ImageProcessorConfig};
use crate::synth::{self, SynthDtype};
use crate::tokenizer::QwenTokenizer;
use crate::worker::{BatchLimits, QuestionTree};
use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// `--version`: the package version and the commit it was built from (build.rs).
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("IMAJEV_GIT_COMMIT"), ")");

#[derive(Parser, Debug)]
#[command(
    name = "imajev-serve",
    version = VERSION,
    about = "Typed decisions from one prefill of Qwen3.5 + the imajev LoRA and readout"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// What decides the answers (shared by `serve` and `decide`).
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Hugging Face model folder (config.json, *.safetensors, tokenizer.json,
    /// preprocessor_config.json): the release's is Qwen3.5-4B (see `verify`).
    #[arg(long, env = "IMAJEV_MODEL")]
    pub model: Option<PathBuf>,
    /// imajev adapter folder: adapter_config.json, adapter_model.safetensors,
    /// decision_readout.safetensors (+ decision_readout.json).
    #[arg(long, env = "IMAJEV_ADAPTER")]
    pub adapter: Option<PathBuf>,
    /// Temperature calibration file (imajev calibration.json, schema 1.0/1.1/1.2).
    #[arg(long, env = "IMAJEV_CALIBRATION")]
    pub calibration: Option<PathBuf>,
    /// Option orders averaged per question, at least 1 (the release's recipe is 4).
    #[arg(long, default_value_t = 4, value_parser = at_least_one, env = "IMAJEV_ROTATIONS")]
    pub rotations: usize,
    /// Refuse requests whose longest pass exceeds this many tokens (image tokens included).
    #[arg(long, default_value_t = 65536, env = "IMAJEV_MAX_INPUT_TOKENS")]
    pub max_input_tokens: usize,
    /// Backend: auto (CUDA when a GPU is usable, else CPU), cpu or cuda.
    #[arg(long, value_enum, default_value_t = Device::Auto, env = "IMAJEV_DEVICE")]
    pub device: Device,
    /// GPU only (refused with --device cpu): `fp8` quantises a BF16/F32 checkpoint's projections
    /// to block FP8 at load, `bf16` dequantises a block-FP8 checkpoint's (block-FP8 checkpoints are
    /// served as FP8 with `none`).
    #[arg(long, value_enum, default_value_t = Quantize::None, env = "IMAJEV_QUANTIZE")]
    pub quantize: Quantize,
    /// Name reported as `model` in responses (default: the manifest's release name, imajev-4b;
    /// imajev-demo for the demo).
    #[arg(long, env = "IMAJEV_MODEL_NAME")]
    pub model_name: Option<String>,
    /// Answer shape: imajev (imajev's fields and confidence) or typesafe (extra fields prefixed
    /// x_, TypeSafe's confidence formulas).
    #[arg(long, value_enum, default_value_t = ContractMode::Imajev, env = "IMAJEV_CONTRACT")]
    pub contract: ContractMode,
    /// Most tokens per packed forward: a request's prefix and passes, and the trees of the
    /// queued requests packed with it. A larger request runs alone (prefix first).
    #[arg(long, default_value_t = BatchLimits::default().max_tokens, value_parser = at_least_one, env = "IMAJEV_BATCH_TOKENS")]
    pub batch_tokens: usize,
    /// Most sequences (a request's prefix, shared question tokens and passes, over all packed
    /// requests) per packed forward. Each prefix and shared part holds its DeltaNet state on the
    /// GPU while it runs (~48 MB for Qwen3.5-4B; a pass, which is only read out, holds none):
    /// lower it on a small GPU.
    #[arg(long, default_value_t = BatchLimits::default().max_sequences, value_parser = at_least_one, env = "IMAJEV_BATCH_SEQUENCES")]
    pub batch_sequences: usize,
    /// Inside a forward, each question's tokens shared by its rotations: repeated in every pass
    /// (one-level) or run once with the passes continuing them (two-level).
    #[arg(long, value_enum, default_value_t = QuestionTree::OneLevel, env = "IMAJEV_QUESTION_TREE")]
    pub question_tree: QuestionTree,
    /// A request over the packing budget runs alone; with at most this many tokens in its whole
    /// tree (prefix, shared question tokens and passes; its passes within --batch-tokens) it still
    /// runs as ONE forward, its passes alongside its prefix, instead of the prefix first and the
    /// passes in a second forward over its state. 0 (the default: on the H100 it made the 16K
    /// request only 0.998x as long, bench/results/h100-ab-alone-forward-d9add75.txt): never.
    /// Deadlines and disconnects are still checked before every layer.
    #[arg(long, default_value_t = BatchLimits::default().alone_forward_tokens, env = "IMAJEV_ALONE_FORWARD_TOKENS")]
    pub alone_forward_tokens: usize,
    /// Queue the next packed round while the GPU still runs the current one, instead of reading
    /// out and answering first: the same answers, and the GPU no longer waits for the host between
    /// rounds under load. No effect on the CPU (a round there is done when launched). On by
    /// default. Takes true/false (also 1/0, yes/no, on/off).
    #[arg(long, default_value_t = BatchLimits::default().overlap_rounds, action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new(), env = "IMAJEV_OVERLAP_ROUNDS")]
    pub overlap_rounds: bool,
    /// Serve the built-in demo instead of a model: a tiny random-weight Qwen3.5 with the real
    /// tokenizer (the API works, the answers are meaningless).
    #[arg(long, conflicts_with_all = ["model", "adapter", "calibration"])]
    pub demo: bool,
    /// The release manifest whose name, description, release date and recipe the server reports
    /// (default: the one built in, adapter/manifest.json).
    #[arg(long, env = "IMAJEV_MANIFEST")]
    pub manifest: Option<PathBuf>,
}

/// A count that must be at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(e) => Err(e.to_string()),
    }
}

impl ModelArgs {
    /// The batching flags.
    pub fn batch_limits(&self) -> BatchLimits {
        BatchLimits {
            max_tokens: self.batch_tokens,
            max_sequences: self.batch_sequences,
            question_tree: self.question_tree,
            alone_forward_tokens: self.alone_forward_tokens,
            overlap_rounds: self.overlap_rounds,
            ..Default::default()
        }
    }

    /// The serving options these flags give, with `queue_depth` requests allowed to wait.
    pub fn options(&self, queue_depth: usize) -> Result<ServeOptions> {
        Ok(ServeOptions {
            demo: self.demo,
            release: crate::release::cli::manifest(self.manifest.as_deref())?,
            model: self.model.clone(),
            adapter: self.adapter.clone(),
            calibration: self.calibration.clone(),
            rotations: self.rotations,
            max_input_tokens: self.max_input_tokens,
            device: self.device,
            quantize: self.quantize,
            model_name: self.model_name.clone(),
            contract: self.contract,
            queue_depth,
            batch: self.batch_limits(),
        })
    }
}

/// What a connection may hold and for how long (`serve`).
#[derive(Args, Debug, Clone)]
pub struct ConnArgs {
    /// Most open connections; one more is answered 503 `too_many_connections` and closed.
    #[arg(long, default_value_t = 512, value_parser = at_least_one, env = "IMAJEV_MAX_CONNECTIONS")]
    pub max_connections: usize,
    /// Seconds a request head (request line and headers) may take, from the connection's start
    /// (a later request's: from its first byte); a slower head is answered 408 and its connection
    /// closed.
    #[arg(long, default_value_t = 5, value_parser = at_least_one, env = "IMAJEV_HEAD_TIMEOUT")]
    pub head_timeout: usize,
    /// Seconds a request body may take before --min-body-rate counts; a body slower than that is
    /// answered 408 and its connection closed.
    #[arg(long, default_value_t = 10, env = "IMAJEV_BODY_TIMEOUT")]
    pub body_timeout: u64,
    /// KiB per second a request body must average after --body-timeout.
    #[arg(long, default_value_t = 64, value_parser = at_least_one, env = "IMAJEV_MIN_BODY_RATE")]
    pub min_body_rate: usize,
    /// On SIGTERM/SIGINT, seconds accepted requests may still take before the server exits
    /// anyway (keep it under the orchestrator's kill timeout: Docker --stop-timeout, Kubernetes
    /// terminationGracePeriodSeconds).
    #[arg(long, default_value_t = 25, value_parser = at_least_one, env = "IMAJEV_SHUTDOWN_GRACE")]
    pub shutdown_grace: usize,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve POST /v1/systemone, GET /v1/models, /healthz, /metrics, /openapi.json and the
    /// playground page at /.
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        /// Address to listen on (0.0.0.0: every interface).
        #[arg(long, default_value = "127.0.0.1", env = "IMAJEV_HOST")]
        host: String,
        /// TCP port; it is bound before the model loads, so a taken port fails at once.
        #[arg(long, default_value_t = 8765, env = "IMAJEV_PORT")]
        port: u16,
        /// File with one API key per line; when given, requests need `Authorization: Bearer <key>`.
        #[arg(long, env = "IMAJEV_API_KEY_FILE")]
        api_key_file: Option<PathBuf>,
        /// Requests that may wait for the engine; beyond that the server answers 529 + Retry-After.
        #[arg(long, default_value_t = 64, env = "IMAJEV_QUEUE_DEPTH")]
        queue_depth: usize,
        /// Seconds from arrival until a request is abandoned (504).
        #[arg(long, default_value_t = 120, env = "IMAJEV_REQUEST_TIMEOUT")]
        request_timeout: u64,
        /// Most questions per request.
        #[arg(long, default_value_t = 64, env = "IMAJEV_MAX_QUESTIONS")]
        max_questions: usize,
        /// Largest request body in MiB (after decompression too).
        #[arg(long, default_value_t = 128, env = "IMAJEV_MAX_BODY_MB")]
        max_body_mb: usize,
        /// Request memory in flight, in MiB, over all requests being read, decoded and parsed at
        /// once (bodies, decoded bodies, multipart parts, parsed JSON); beyond it 529 (413 for a
        /// request that alone needs more).
        #[arg(long, default_value_t = 1024, value_parser = at_least_one, env = "IMAJEV_MAX_INFLIGHT_MB")]
        max_inflight_mb: usize,
        /// HTTP worker threads (default: the CPU count, at most 4).
        #[arg(long, default_value_t = crate::api::ServerConfig::default().workers, value_parser = at_least_one,
              env = "IMAJEV_HTTP_WORKERS")]
        http_workers: usize,
        /// Do not serve the playground page at `/` (then `/` is a 404 like any unknown path).
        #[arg(long, env = "IMAJEV_NO_PLAYGROUND")]
        no_playground: bool,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Answer requests offline: one JSON request (or JSONL, one per line) → one line each, the
    /// response or the error object the HTTP API would answer; exits 1 if any request failed.
    Decide {
        #[command(flatten)]
        model: ModelArgs,
        /// A request body (.json) or one per line (.jsonl; blank lines are skipped).
        #[arg(long)]
        request: PathBuf,
        /// Where to write the response(s) (stdout if absent).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Run every request this many times (timings in usage reflect each run; the last is written).
        #[arg(long, default_value_t = 1)]
        repeat: usize,
        /// Also write every pass's full token ids (one `<|image_pad|>` per image) and readout
        /// logits here, as JSONL.
        #[arg(long)]
        emit_passes: Option<PathBuf>,
        /// Write each run's timings (ms per stage) here, as JSONL (one line per request and run).
        #[arg(long)]
        timings: Option<PathBuf>,
    },
    /// Read UTF-8 text on stdin, print its token ids as one JSON array (special-token strings are
    /// parsed as special tokens). With --jsonl, each stdin line is a JSON string and each output
    /// line the array for it.
    Tokenize {
        /// Model directory whose tokenizer.json to use (without it, or if it has none: the built-in
        /// Qwen3.5 tokenizer).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Read one JSON string per line and print one array per line.
        #[arg(long)]
        jsonl: bool,
    },
    /// Check a downloaded release against the manifest (adapter/manifest.json) and its hash lock:
    /// sha256 of every file, tensor names/dtypes/shapes, config.json, LoRA coverage, the codebook
    /// against the tokenizer, calibration. Prints a table; exits 1 on any mismatch. With --pin,
    /// writes the lock from a download you trust.
    Verify(crate::release::cli::VerifyArgs),
    /// One prefill of a prompt (+ images) and print the final-normed hidden state of the last
    /// token, and the readout logits when an adapter is given.
    Forward {
        /// Hugging Face model folder.
        #[arg(long)]
        model: PathBuf,
        /// Adapter folder (adapter_config.json, adapter_model.safetensors, decision_readout.safetensors).
        #[arg(long)]
        adapter: Option<PathBuf>,
        /// `{"prompt": STRING, "images": [PATH, ...]}`; each image appears in the prompt as one
        /// `<|vision_start|><|image_pad|><|vision_end|>`.
        #[arg(long)]
        input: PathBuf,
        /// Where to write `{"input_ids", "hidden_last", "readout_logits"?}` (stdout if absent).
        #[arg(long)]
        out: Option<PathBuf>,
        /// cpu (the f32 reference) or cuda.
        #[arg(long, value_enum, default_value_t = Device::Cpu)]
        device: Device,
        /// cuda only: how projections are stored (see `decide --quantize`).
        #[arg(long, value_enum, default_value_t = Quantize::None)]
        quantize: Quantize,
        /// Also write every token's hidden state at each layer boundary to
        /// DIR/hidden_states.safetensors (f32 `hidden_states.{i}` `[tokens, hidden]`: 0 = the
        /// decoder input, i = after decoder layer i−1, as transformers' `output_hidden_states`;
        /// `final_norm`; `input_ids` with image pads expanded). tools/first_divergence.py reads it.
        #[arg(long, value_name = "DIR")]
        dump_layers: Option<PathBuf>,
    },
    /// Compile every CUDA kernel for a GPU that need not be here, into a kernel cache folder that
    /// the server reads (`IMAJEV_KERNEL_CACHE`): a machine with a GPU of that compute capability
    /// (any name: an H100 and an H200 are both 9.0), a driver at least as new as this NVRTC and
    /// the same NVRTC version then starts without compiling (~50 s on an H200's first start).
    /// Needs NVRTC (libnvrtc) and the CUDA headers (`CUDA_HOME`), of the NVRTC version the target
    /// machine has.
    PrecompileKernels {
        /// The cache folder to fill (created if missing).
        #[arg(long, value_name = "DIR")]
        cache: PathBuf,
        /// Its compute capability, major.minor.
        #[arg(long, default_value = "9.0")]
        compute_capability: String,
    },
    /// Write a synthetic Qwen3.5 checkpoint (and adapter) in the real layouts, random or
    /// trained-like, deterministic in the seed; transformers and PEFT load it unchanged.
    Synth {
        /// `tiny`, `mid`, `qwen3.5-4b`, or a path to a config.json.
        #[arg(long)]
        config: String,
        /// The model folder to write (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Storage precision of the weights.
        #[arg(long, value_enum, default_value_t = SynthDtype::Bf16)]
        dtype: SynthDtype,
        /// Random seed: the same seed writes the same bytes.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// random (the tests' checkpoints) or trained-like (the statistics of a trained model,
        /// with decisions that follow the options; see src/synth/profile.rs).
        #[arg(long, value_enum, default_value_t = synth::Profile::Random)]
        profile: synth::Profile,
        /// flat (one model.safetensors) or release (the published Qwen3.5-4B's file set: shards
        /// and their index, mtp.* tensors, generation_config.json, the release's config keys;
        /// with `--dtype fp8`, Qwen's block-FP8 pack).
        #[arg(long, value_enum, default_value_t = synth::Layout::Flat)]
        layout: synth::Layout,
        /// Also write an imajev-style adapter folder here.
        #[arg(long)]
        adapter_out: Option<PathBuf>,
        /// LoRA rank of the adapter.
        #[arg(long, default_value_t = 64)]
        lora_rank: usize,
        /// LoRA alpha of the adapter (scale = alpha / rank).
        #[arg(long, default_value_t = 128.0)]
        lora_alpha: f64,
        /// Rows of the adapter's readout (option codes + unknown; at most 256 for Qwen3.5).
        #[arg(long, default_value_t = 256)]
        readout_rows: usize,
    },
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve {
            model,
            host,
            port,
            api_key_file,
            queue_depth,
            request_timeout,
            max_questions,
            max_body_mb,
            max_inflight_mb,
            http_workers,
            no_playground,
            conn,
        } => {
            crate::api::budget::set_global_capacity(max_inflight_mb << 20);
            serve_cmd(
                &model,
                host,
                port,
                api_key_file,
                queue_depth,
                request_timeout,
                max_questions,
                max_body_mb,
                http_workers,
                !no_playground,
                &conn,
            )
        }
        Command::Decide { model, request, out, repeat, emit_passes, timings } => {
            decide_cmd(&model, &request, out.as_deref(), repeat, emit_passes.as_deref(), timings.as_deref())
        }
        Command::Tokenize { model, jsonl } => crate::tokenizer::run_tokenize_cli(model.as_deref(), jsonl),
        Command::PrecompileKernels { cache, compute_capability } => {
            precompile_kernels_cmd(&cache, &compute_capability)
        }
        Command::Verify(args) => crate::release::cli::run(&args),
        Command::Forward { model, adapter, input, out, device, quantize, dump_layers } => forward(
            &model,
            adapter.as_deref(),
            &input,
            out.as_deref(),
            device,
            quantize,
            dump_layers.as_deref(),
        ),
        Command::Synth {
            config,
            out,
            dtype,
            seed,
            profile,
            layout,
            adapter_out,
            lora_rank,
            lora_alpha,
            readout_rows,
        } => {
            let cfg = synth::preset(&config)?;
            let r =
                synth::write_model_with(&cfg, &synth::ModelOptions { dtype, seed, profile, layout }, &out)?;
            eprintln!(
                "wrote {} ({} tensors, {:.3} B parameters, {:.2} GiB) in {:.1} s",
                r.dir.display(),
                r.tensors,
                r.parameters as f64 / 1e9,
                r.bytes as f64 / (1u64 << 30) as f64,
                r.seconds
            );
            if let Some(a) = adapter_out {
                let r = synth::write_adapter_with(
                    &cfg,
                    lora_rank,
                    lora_alpha,
                    readout_rows,
                    seed,
                    profile,
                    dtype,
                    &a,
                )?;
                let tokenizer = QwenTokenizer::builtin()?;
                crate::decision::codebook::Codebook::derive(&tokenizer, readout_rows)
                    .context(
                        "deriving the readout codebook (use --readout-rows ≤ 256 for the Qwen3.5 tokenizer)",
                    )?
                    .write(&a.join("decision_readout.json"))?;
                eprintln!(
                    "wrote adapter {} (LoRA r={lora_rank}, alpha={lora_alpha}, readout {readout_rows} rows; {:.1} M parameters) in {:.1} s",
                    r.dir.display(),
                    r.parameters as f64 / 1e6,
                    r.seconds
                );
            }
            Ok(())
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForwardInput {
    prompt: String,
    #[serde(default)]
    images: Vec<PathBuf>,
}

#[derive(Serialize)]
struct ForwardOutput {
    input_ids: Vec<u32>,
    hidden_last: Vec<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    readout_logits: Option<Vec<f32>>,
}

fn resolve_image(path: &Path, input_file: &Path) -> PathBuf {
    if path.is_absolute() || path.exists() {
        return path.to_path_buf();
    }
    match input_file.parent() {
        Some(dir) if dir.join(path).exists() => dir.join(path),
        _ => path.to_path_buf(),
    }
}

/// `serve`: the HTTP settings from the flags, then [`crate::app::serve_http`].
#[allow(clippy::too_many_arguments)]
fn serve_cmd(
    model: &ModelArgs,
    host: String,
    port: u16,
    api_key_file: Option<PathBuf>,
    queue_depth: usize,
    request_timeout: u64,
    max_questions: usize,
    max_body_mb: usize,
    http_workers: usize,
    playground: bool,
    conn: &ConnArgs,
) -> Result<()> {
    use std::time::Duration;
    let api_keys = api_key_file.as_deref().map(app::read_api_keys).transpose()?.unwrap_or_default();
    crate::api::conn::raise_fd_limit(conn.max_connections)?;
    let http = crate::api::ServerConfig {
        host,
        port,
        workers: http_workers,
        max_body_bytes: max_body_mb << 20,
        max_questions,
        api_keys,
        request_timeout: Duration::from_secs(request_timeout.max(1)),
        playground,
        conn: crate::api::conn::ConnLimits {
            max_connections: conn.max_connections,
            head_timeout: Duration::from_secs(conn.head_timeout as u64),
            body_timeout: Duration::from_secs(conn.body_timeout),
            min_body_rate: (conn.min_body_rate as u64) << 10,
        },
        shutdown_grace: Duration::from_secs(conn.shutdown_grace as u64),
        ..Default::default()
    };
    app::serve_http(&model.options(queue_depth)?, http)
}

/// `decide`: every request of the file gets one output line, its response or the error object
/// the HTTP API would answer (with `status` and the input `line` added); a failed request does
/// not stop the others, and the command fails (exit 1) after writing them all if any failed.
fn decide_cmd(
    model: &ModelArgs,
    request: &Path,
    out: Option<&Path>,
    repeat: usize,
    emit: Option<&Path>,
    timings_out: Option<&Path>,
) -> Result<()> {
    use crate::api::{decide_direct, run_engine, ParseContext, RequestBody};
    let prepared = app::prepare(&model.options(1)?)?;
    let engine = app::load_engine(model.device, model.quantize, &prepared.model_dir, &prepared.adapter_dir)?;
    let (decider, image_config) = (prepared.decider.clone(), prepared.image_config.clone());
    let ctx = ParseContext::for_decider(&decider, crate::api::parse::DEFAULT_MAX_QUESTIONS, image_config);
    let limits = model.batch_limits();
    let text = std::fs::read_to_string(request).with_context(|| format!("reading {}", request.display()))?;
    // (line number, body): a .jsonl file is one request per non-blank line.
    let bodies: Vec<(usize, &str)> = if request.extension().is_some_and(|e| e == "jsonl") {
        text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()).map(|(i, l)| (i + 1, l)).collect()
    } else {
        vec![(1, text.as_str())]
    };
    let mut lines = Vec::new();
    let mut failed = Vec::new();
    let mut passes_out = Vec::new();
    let mut timing_lines = Vec::new();
    for (i, (line, body)) in bodies.iter().enumerate() {
        let mut last = None;
        for run_index in 0..repeat.max(1) {
            let body = RequestBody::json(body.as_bytes().to_vec());
            let decided = match decide_direct(body, ctx.clone(), decider.clone(), |call| {
                run_engine(engine.as_ref(), call, limits)
            }) {
                Ok(d) => d,
                Err(e) => {
                    last = Some(Err(e));
                    break;
                }
            };
            let (plan, t) = (&decided.plan, decided.timings);
            if emit.is_some() && last.is_none() {
                // "field" (the scored question's index) is the key the bench scripts read.
                for (q, sp) in plan.scored.iter().enumerate() {
                    for (p, pass) in sp.passes.iter().enumerate() {
                        let mut ids = plan.prefix.clone();
                        ids.extend(&sp.common);
                        ids.extend(&pass.suffix);
                        passes_out.push(
                            serde_json::json!({"request": i, "field": q, "pass": p, "offset": pass.offset,
                            "input_ids": ids, "logits": decided.output.logits[q][p]}),
                        );
                    }
                }
            }
            timing_lines.push(
                serde_json::json!({"request": i, "run": run_index, "total_ms": t.total_ms,
                "vision_ms": t.vision_ms, "prefill_ms": t.prefill_ms, "questions_ms": t.questions_ms,
                "input_tokens": plan.max_pass_tokens, "processed_tokens": plan.processed_tokens,
                "passes": plan.pass_count(), "images": decided.request.images.len()})
                .to_string(),
            );
            last = Some(Ok(decided.response));
        }
        match last.expect("at least one run") {
            Ok(response) => lines.push(serde_json::to_string(&response)?),
            Err(e) => {
                let mut body = e.body();
                body["status"] = e.status.into();
                body["line"] = (*line).into();
                lines.push(body.to_string());
                failed.push(format!("line {line}: {e}"));
            }
        }
    }
    let text = lines.join("\n") + "\n";
    match out {
        Some(p) => std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?,
        None => print!("{text}"),
    }
    if let Some(p) = timings_out {
        std::fs::write(p, timing_lines.join("\n") + "\n")
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = emit {
        let lines: Vec<String> = passes_out.iter().map(|v| v.to_string()).collect();
        std::fs::write(p, lines.join("\n") + "\n").with_context(|| format!("writing {}", p.display()))?;
    }
    if !failed.is_empty() {
        anyhow::bail!(
            "{} of {} requests failed (their lines hold the error objects):\n  {}",
            failed.len(),
            bodies.len(),
            failed.join("\n  ")
        );
    }
    Ok(())
}

fn run_forward<B: Backend>(
    model: Qwen35<B>,
    ids: &[u32],
    images: &[&crate::image::PatchedImage],
    dump_dir: Option<&Path>,
) -> Result<ForwardOutput> {
    let (hidden, layout) = match dump_dir {
        Some(dir) => {
            let (hidden, layout, dump) = model.prefill_dumped(ids, images)?;
            write_layer_dump(dir, &dump, &layout.ids, &model.kinds)?;
            (hidden, layout)
        }
        None => {
            let (_state, hidden, layout) = model.prefill(ids, images)?;
            (hidden, layout)
        }
    };
    let hidden_last = model.backend.download(&hidden)?;
    let readout_logits =
        if model.readout_rows().is_some() { Some(model.readout(&hidden)?.remove(0)) } else { None };
    Ok(ForwardOutput { input_ids: layout.ids, hidden_last, readout_logits })
}

/// Writes a [`crate::engine::LayerDump`] as `dir/hidden_states.safetensors` (f32, little-endian).
fn write_layer_dump(
    dir: &Path,
    dump: &crate::engine::LayerDump,
    ids: &[u32],
    kinds: &[crate::engine::LayerKind],
) -> Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let shape = vec![dump.rows, dump.hidden_size];
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = dump
        .hidden
        .iter()
        .enumerate()
        .map(|(i, h)| (format!("hidden_states.{i}"), Dtype::F32, shape.clone(), f32_bytes(h)))
        .collect();
    owned.push(("final_norm".into(), Dtype::F32, shape.clone(), f32_bytes(&dump.final_norm)));
    let id_bytes = ids.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect();
    owned.push(("input_ids".into(), Dtype::I64, vec![ids.len()], id_bytes));
    let views = owned
        .iter()
        .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let layer_types: Vec<&str> = kinds
        .iter()
        .map(|k| match k {
            crate::engine::LayerKind::FullAttention => "full_attention",
            crate::engine::LayerKind::LinearAttention => "linear_attention",
        })
        .collect();
    let meta = std::collections::HashMap::from([
        ("format".to_string(), "imajev-layer-dump".to_string()),
        ("layer_types".to_string(), layer_types.join(",")),
    ]);
    let path = dir.join("hidden_states.safetensors");
    safetensors::serialize_to_file(views, Some(meta), &path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn forward(
    model_dir: &Path,
    adapter: Option<&Path>,
    input: &Path,
    out: Option<&Path>,
    device: Device,
    quantize: Quantize,
    dump_dir: Option<&Path>,
) -> Result<()> {
    let text = std::fs::read_to_string(input).with_context(|| format!("reading {}", input.display()))?;
    let req: ForwardInput = serde_json::from_str(&text).with_context(|| {
        format!("{} must be {{\"prompt\": STRING, \"images\": [PATH, ...]}}", input.display())
    })?;
    let tokenizer = QwenTokenizer::from_model_dir(model_dir)?;
    let ids = tokenizer.encode(&req.prompt)?;
    let proc_cfg = ImageProcessorConfig::from_model_dir(model_dir)?;
    let limits = ImageLimits::default();
    let mut patched = Vec::new();
    for p in &req.images {
        let path = resolve_image(p, input);
        let bytes = std::fs::read(&path).with_context(|| format!("reading image {}", path.display()))?;
        let (_, img) = crate::image::load_and_preprocess(&bytes, &limits, &proc_cfg)
            .with_context(|| format!("image {}", path.display()))?;
        patched.push(img);
    }
    let refs: Vec<&_> = patched.iter().collect();
    let result = match device {
        Device::Cuda => run_forward(
            Qwen35::load(app::cuda_backend(quantize)?, model_dir, adapter)?,
            &ids,
            &refs,
            dump_dir,
        )?,
        _ => run_forward(Qwen35::load(CpuBackend::default(), model_dir, adapter)?, &ids, &refs, dump_dir)?,
    };
    let json = serde_json::to_string(&result)?;
    match out {
        Some(p) => std::fs::write(p, json + "\n").with_context(|| format!("writing {}", p.display()))?,
        None => println!("{json}"),
    }
    Ok(())
}

/// `precompile-kernels`: the cache entries of every kernel file for the GPU described.
fn precompile_kernels_cmd(cache: &std::path::Path, cc: &str) -> Result<()> {
    use crate::backend::cuda::{compile, layout};
    let parse = |s: &str| s.trim().parse::<i32>().ok();
    let cc = match cc.split_once('.') {
        Some((a, b)) => parse(a).zip(parse(b)),
        None => None,
    }
    .ok_or_else(|| anyhow::anyhow!("--compute-capability {cc}: expected major.minor, e.g. 9.0"))?;
    anyhow::ensure!(cc.0 >= 8, "--compute-capability {}.{}: the kernels need sm_80 or newer", cc.0, cc.1);
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        anyhow::bail!(
            "NVRTC (libnvrtc.so) was not found: install the CUDA toolkit or put libnvrtc on LD_LIBRARY_PATH"
        );
    }
    let nvrtc = compile::nvrtc_version()?;
    let tag = compile::device_tag(cc, nvrtc);
    let arch = layout::gpu_arch(cc.0, cc.1);
    let t = std::time::Instant::now();
    let written = compile::precompile(cache, &tag, &arch)?;
    for p in &written {
        println!("{}", p.display());
    }
    eprintln!(
        "{} kernel files compiled for {arch} ({tag}) in {:.1} s into {}",
        written.len(),
        t.elapsed().as_secs_f64(),
        cache.display()
    );
    Ok(())
}
