//! The command-line interface: `tokenize`, `forward`, `synth` (and later `serve`, `decide`).
//! Output contracts here are relied upon by other tools; change them only with care.

use crate::backend::cpu::CpuBackend;
use crate::engine::synth::{self, SynthDtype};
use crate::backend::Backend;
use crate::engine::Qwen35;
use crate::image::{ImageLimits, ImageProcessorConfig};
use crate::tokenizer::QwenTokenizer;
use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(name = "imajev-serve", version, about = "Typed decisions from one prefill of Qwen3.5 + the imajev LoRA and readout")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Which backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CUDA when a usable GPU is present, else CPU.
    Auto,
    Cpu,
    Cuda,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Read UTF-8 text on stdin, print its token ids as one JSON array (special-token strings are
    /// parsed as special tokens). With --jsonl, each stdin line is a JSON string and each output
    /// line the array for it.
    Tokenize {
        /// Model directory whose tokenizer.json to use (the built-in Qwen3.5 tokenizer if it has none).
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        jsonl: bool,
    },
    /// One prefill of a prompt (+ images) and print the final-normed hidden state of the last
    /// token, and the readout logits when an adapter is given.
    Forward {
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
        #[arg(long, value_enum, default_value_t = Device::Cpu)]
        device: Device,
    },
    /// Write a random-weight Qwen3.5 checkpoint (and adapter) in the real layouts,
    /// deterministic in the seed; transformers and PEFT load it unchanged.
    Synth {
        /// `tiny`, `qwen3.5-4b`, or a path to a config.json.
        #[arg(long)]
        config: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value_t = SynthDtype::Bf16)]
        dtype: SynthDtype,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Also write an imajev-style adapter folder here.
        #[arg(long)]
        adapter_out: Option<PathBuf>,
        #[arg(long, default_value_t = 64)]
        lora_rank: usize,
        #[arg(long, default_value_t = 128.0)]
        lora_alpha: f64,
        #[arg(long, default_value_t = 256)]
        readout_rows: usize,
    },
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Tokenize { model, jsonl } => crate::tokenizer::run_tokenize_cli(&model, jsonl),
        Command::Forward { model, adapter, input, out, device } => forward(&model, adapter.as_deref(), &input, out.as_deref(), device),
        Command::Synth { config, out, dtype, seed, adapter_out, lora_rank, lora_alpha, readout_rows } => {
            let cfg = synth::preset(&config)?;
            let r = synth::write_model(&cfg, dtype, seed, &out)?;
            eprintln!(
                "wrote {} ({} tensors, {:.3} B parameters, {:.2} GiB) in {:.1} s",
                r.dir.display(),
                r.tensors,
                r.parameters as f64 / 1e9,
                r.bytes as f64 / (1u64 << 30) as f64,
                r.seconds
            );
            if let Some(a) = adapter_out {
                let r = synth::write_adapter(&cfg, lora_rank, lora_alpha, readout_rows, seed, &a)?;
                let tokenizer = QwenTokenizer::builtin()?;
                crate::decision::codebook::Codebook::derive(&tokenizer, readout_rows)
                    .context("deriving the readout codebook (use --readout-rows ≤ 256 for the Qwen3.5 tokenizer)")?
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

fn forward(model_dir: &Path, adapter: Option<&Path>, input: &Path, out: Option<&Path>, device: Device) -> Result<()> {
    if device == Device::Cuda {
        bail!("--device cuda: the CUDA backend is not part of this build yet; use --device cpu");
    }
    let text = std::fs::read_to_string(input).with_context(|| format!("reading {}", input.display()))?;
    let req: ForwardInput = serde_json::from_str(&text)
        .with_context(|| format!("{} must be {{\"prompt\": STRING, \"images\": [PATH, ...]}}", input.display()))?;
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
    let model = Qwen35::load(CpuBackend::default(), model_dir, adapter)?;
    let refs: Vec<&_> = patched.iter().collect();
    let (_state, hidden, layout) = model.prefill(&ids, &refs)?;
    let hidden_last = model.backend.download(&hidden)?;
    let readout_logits = if model.readout_rows().is_some() { Some(model.readout(&hidden)?.remove(0)) } else { None };
    let result = ForwardOutput { input_ids: layout.ids, hidden_last, readout_logits };
    let json = serde_json::to_string(&result)?;
    match out {
        Some(p) => std::fs::write(p, json + "\n").with_context(|| format!("writing {}", p.display()))?,
        None => println!("{json}"),
    }
    Ok(())
}
