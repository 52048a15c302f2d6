//! Random-weight Qwen3.5 checkpoints (and imajev-style adapters) in the real file layouts.
//!
//! No real weights can be downloaded where this project is built and tested, so correctness is
//! proven on random weights of the exact Qwen3.5 shapes, loaded unchanged by transformers + PEFT.
//! Values are deterministic in the seed and the tensor name only (counter-based: each block of
//! values has its own generator), so a checkpoint is the same on every machine and thread count.
//!
//! * [`tensors`] — every tensor's name, shape, init rule and storage;
//! * [`profile`] — `random` (the default) or `trained-like` statistics, and why;
//! * [`release`] — the file set of the published Qwen3.5-4B and of a block-FP8 pack;
//! * [`writer`] — the streaming safetensors writer;
//! * [`rng`] — the deterministic generator (also what the tests draw inputs from);
//! * `configs/*.json` — the presets `--config` accepts (`tiny`, `mid`, `qwen3.5-4b`).
//!
//! Only tests, benchmarks, the `synth` command and the built-in demo model use this module; the
//! serving path never does (FP8 quantisation at load lives in [`crate::weights::fp8`]).

pub mod memory;
pub mod profile;
pub mod release;
pub mod rng;
pub mod tensors;
pub mod writer;

pub use profile::Profile;

use crate::engine::config::{LayerKind, ModelConfig};
use crate::tokenizer::QwenTokenizer;
use crate::weights::scale_name;
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::path::{Path, PathBuf};
use tensors::{profile_specs, Init, Spec, Store};
use writer::{stored_bytes, write_safetensors};

/// Storage precision of a synthetic checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthDtype {
    F32,
    Bf16,
    /// BF16 with the text projections in block FP8 (E4M3, 128×128 scales), as Qwen's FP8 packs.
    Fp8,
}

/// The named configurations `synth --config` accepts (besides a path to a config.json).
/// `mid` has the 4B's head sizes (128-wide DeltaNet heads, 128-multiple projections, so FP8
/// applies everywhere) at 512 hidden and 8 layers: small enough for CPU measurements.
pub const PRESETS: &[(&str, &str)] = &[
    ("tiny", include_str!("configs/tiny.json")),
    ("mid", include_str!("configs/mid.json")),
    ("qwen3.5-4b", include_str!("configs/qwen3_5-4b.json")),
];

/// The config.json of a preset (`qwen3_5-4b` and `4b` name the 4B one too), as JSON to edit.
pub fn preset_json(name: &str) -> Option<serde_json::Value> {
    let name = match name {
        "qwen3_5-4b" | "4b" => "qwen3.5-4b",
        n => n,
    };
    let (_, text) = PRESETS.iter().find(|(n, _)| *n == name)?;
    Some(serde_json::from_str(text).expect("the preset configs are valid JSON"))
}

/// A preset by name, or a config.json by path, checked.
pub fn preset(name: &str) -> Result<ModelConfig> {
    let v = match preset_json(name) {
        Some(v) => v,
        None => {
            let p = Path::new(name);
            if !p.exists() {
                bail!("--config {name:?} is neither a preset (tiny, mid, qwen3.5-4b) nor an existing config.json");
            }
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {name}"))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {name}"))?
        }
    };
    let cfg: ModelConfig = serde_json::from_value(v)?;
    cfg.validate()?;
    Ok(cfg)
}

/// What `synth` wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SynthReport {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
    pub seconds: f64,
}

/// Shard size for large checkpoints (the real Qwen3.5-4B also ships two shards).
const SHARD_BYTES: u64 = 4 << 30;

/// Which files a synthetic checkpoint is written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// One `model.safetensors` (sharded above 4 GiB), no MTP: what the tests use.
    #[default]
    Flat,
    /// The published Qwen3.5-4B's file set ([`release`]): at least two
    /// `model-0000k-of-0000n.safetensors` shards and their index, the `mtp.*` tensors,
    /// `generation_config.json` and the release's config keys.
    Release,
}

/// How `synth` writes a checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct ModelOptions {
    pub dtype: SynthDtype,
    pub seed: u64,
    pub profile: Profile,
    pub layout: Layout,
}

/// Writes `config.json`, the safetensors (sharded with an index above 4 GiB), the Qwen3.5
/// `tokenizer.json`, `tokenizer_config.json` and `preprocessor_config.json` into `dir`.
pub fn write_model(cfg: &ModelConfig, dtype: SynthDtype, seed: u64, dir: &Path) -> Result<SynthReport> {
    let opts = ModelOptions { dtype, seed, profile: Profile::Random, layout: Layout::Flat };
    write_model_with(cfg, &opts, dir)
}

/// [`write_model`] with a profile and a layout.
pub fn write_model_with(cfg: &ModelConfig, opts: &ModelOptions, dir: &Path) -> Result<SynthReport> {
    if opts.layout == Layout::Release {
        return release::write_release(cfg, opts, dir);
    }
    let (dtype, seed) = (opts.dtype, opts.seed);
    let started = std::time::Instant::now();
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let specs = profile_specs(cfg, dtype, opts.profile, seed)?;
    let mut config = serde_json::to_value(cfg)?;
    let obj = config.as_object_mut().expect("config is an object");
    obj.retain(|_, v| !v.is_null());
    obj.insert("model_type".into(), json!("qwen3_5"));
    obj.insert("architectures".into(), json!(["Qwen3_5ForConditionalGeneration"]));
    obj.insert("transformers_version".into(), json!("5.17.0"));
    if let Some(tc) = obj.get_mut("text_config").and_then(|v| v.as_object_mut()) {
        tc.retain(|_, v| !v.is_null());
        tc.insert("model_type".into(), json!("qwen3_5_text"));
        tc.insert("dtype".into(), json!(if dtype == SynthDtype::F32 { "float32" } else { "bfloat16" }));
    }
    if let Some(vc) = obj.get_mut("vision_config").and_then(|v| v.as_object_mut()) {
        vc.retain(|_, v| !v.is_null());
        vc.insert("model_type".into(), json!("qwen3_5_vision"));
    }
    obj.insert("dtype".into(), json!(if dtype == SynthDtype::F32 { "float32" } else { "bfloat16" }));
    if dtype == SynthDtype::Fp8 {
        let mut skip: Vec<String> = vec!["model.visual".into(), "lm_head".into()];
        for (i, k) in cfg.text_config.layer_kinds()?.iter().enumerate() {
            if *k == LayerKind::LinearAttention {
                skip.push(format!("model.language_model.layers.{i}.linear_attn.in_proj_a"));
                skip.push(format!("model.language_model.layers.{i}.linear_attn.in_proj_b"));
            }
        }
        obj.insert(
            "quantization_config".into(),
            json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128], "modules_to_not_convert": skip}),
        );
    } else {
        obj.remove("quantization_config");
    }
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)? + "\n")?;

    // Group tensors into shards.
    let total: u64 = specs.iter().map(stored_bytes).sum();
    let mut shards: Vec<Vec<Spec>> = vec![vec![]];
    let mut cur = 0u64;
    for s in specs {
        let b = stored_bytes(&s);
        if cur > 0 && cur + b > SHARD_BYTES {
            shards.push(vec![]);
            cur = 0;
        }
        cur += b;
        shards.last_mut().unwrap().push(s);
    }
    let mut progress = crate::engine::progress::LoadProgress::new("writing weights", total);
    let mut files = Vec::new();
    let mut weight_map = serde_json::Map::new();
    let count = shards.len();
    let mut tensors = 0;
    let mut params = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let fname = if count == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, count)
        };
        for s in shard {
            weight_map.insert(s.name.clone(), json!(fname));
            if s.store == Store::Fp8 {
                weight_map.insert(scale_name(&s.name), json!(fname));
            }
            tensors += if s.store == Store::Fp8 { 2 } else { 1 };
            params += s.shape.iter().product::<usize>() as u64;
        }
        let path = dir.join(&fname);
        write_safetensors(&path, shard, seed, |b| progress.advance(b))?;
        files.push(path);
    }
    progress.finish();
    if count > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)? + "\n",
        )?;
    }
    std::fs::write(dir.join("tokenizer.json"), QwenTokenizer::builtin_json()?)?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tokenizer_config())? + "\n",
    )?;
    std::fs::write(
        dir.join("preprocessor_config.json"),
        crate::image::ImageProcessorConfig::default().to_json(),
    )?;
    std::fs::write(dir.join("chat_template.jinja"), CHAT_TEMPLATE)?;
    Ok(SynthReport {
        dir: dir.to_path_buf(),
        files,
        tensors,
        parameters: params,
        bytes: total,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The Qwen3.5 chat template (`chat_template.jinja` of Qwen/Qwen3.5, sha256 a4aee8af…f715),
/// so transformers renders prompts for a synthetic model exactly as for the real one.
pub const CHAT_TEMPLATE: &str = include_str!("assets/qwen3_5_chat_template.jinja");

pub(crate) fn tokenizer_config() -> serde_json::Value {
    json!({
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 262144,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": null,
        "bos_token": null,
        "add_bos_token": false,
        "add_prefix_space": false,
        "errors": "replace",
        "clean_up_tokenization_spaces": false,
        "split_special_tokens": false,
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>"
    })
}

/// The text projections imajev adapts (its `target_modules` regex).
pub const LORA_TARGETS: &str = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z|out_proj)";

/// Writes a PEFT LoRA adapter (`adapter_config.json`, F32 `adapter_model.safetensors`) for every
/// text projection imajev adapts, and an F32 `decision_readout.safetensors` `[readout_rows, hidden]`.
pub fn write_adapter(
    cfg: &ModelConfig,
    rank: usize,
    alpha: f64,
    readout_rows: usize,
    seed: u64,
    dir: &Path,
) -> Result<SynthReport> {
    write_adapter_with(cfg, rank, alpha, readout_rows, seed, Profile::Random, SynthDtype::Bf16, dir)
}

/// [`write_adapter`] for a checkpoint of the given profile (and storage `dtype`, which the
/// trained-like readout is computed for). Trained-like: LoRA with ‖B·A·α/r‖ = [`profile::LORA_RATIO`]
/// × ‖W‖, and a readout whose first rows read the decision circuit.
#[allow(clippy::too_many_arguments)]
pub fn write_adapter_with(
    cfg: &ModelConfig,
    rank: usize,
    alpha: f64,
    readout_rows: usize,
    seed: u64,
    profile: Profile,
    dtype: SynthDtype,
    dir: &Path,
) -> Result<SynthReport> {
    let started = std::time::Instant::now();
    if rank == 0 {
        bail!("--lora-rank must be at least 1");
    }
    if readout_rows < 2 {
        bail!("--readout-rows must be at least 2");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let t = &cfg.text_config;
    let h = t.hidden_size;
    let mut modules: Vec<(String, usize, usize)> = Vec::new(); // (path, in, out)
    for (i, k) in t.layer_kinds()?.iter().enumerate() {
        let l = format!("model.language_model.layers.{i}.");
        match k {
            LayerKind::FullAttention => {
                let (nh, kvh, hd) = (t.num_attention_heads, t.num_key_value_heads, t.head_dim);
                modules.push((format!("{l}self_attn.q_proj"), h, nh * hd * 2));
                modules.push((format!("{l}self_attn.k_proj"), h, kvh * hd));
                modules.push((format!("{l}self_attn.v_proj"), h, kvh * hd));
                modules.push((format!("{l}self_attn.o_proj"), nh * hd, h));
            }
            LayerKind::LinearAttention => {
                modules.push((format!("{l}linear_attn.in_proj_qkv"), h, t.conv_dim()));
                modules.push((format!("{l}linear_attn.in_proj_z"), h, t.value_dim()));
                modules.push((format!("{l}linear_attn.out_proj"), t.value_dim(), h));
            }
        }
        modules.push((format!("{l}mlp.gate_proj"), h, t.intermediate_size));
        modules.push((format!("{l}mlp.up_proj"), h, t.intermediate_size));
        modules.push((format!("{l}mlp.down_proj"), t.intermediate_size, h));
    }
    let base = profile_specs(cfg, dtype, Profile::Random, seed)?;
    let mut specs = Vec::new();
    for (m, i, o) in &modules {
        let b_std = match profile {
            Profile::Random => 0.1 / (rank as f32).sqrt(),
            // ‖B·A·(α/r)‖_F ≈ (α/r)·σ_A·σ_B·√(r·in·out) = ratio·σ_W·√(in·out).
            Profile::TrainedLike => {
                let w_std = match base.iter().find(|s| s.name == format!("{m}.weight")).map(|s| s.init) {
                    Some(Init::Normal { std, .. }) => std,
                    _ => 1.0 / (*i as f32).sqrt(),
                };
                let a_std = 1.0 / (*i as f32).sqrt();
                profile::LORA_RATIO * w_std * rank as f32 / (alpha as f32 * a_std * (rank as f32).sqrt())
            }
        };
        specs.push(Spec::new(
            format!("base_model.model.{m}.lora_A.weight"),
            vec![rank, *i],
            Init::Normal { mean: 0.0, std: 1.0 / (*i as f32).sqrt() },
            Store::F32,
        ));
        specs.push(Spec::new(
            format!("base_model.model.{m}.lora_B.weight"),
            vec![*o, rank],
            Init::Normal { mean: 0.0, std: b_std },
            Store::F32,
        ));
    }
    let lora_bytes: u64 = specs.iter().map(stored_bytes).sum();
    let lora_params: u64 = specs.iter().map(|s| s.shape.iter().product::<usize>() as u64).sum();
    let n_tensors = specs.len();
    let lora_path = dir.join("adapter_model.safetensors");
    write_safetensors(&lora_path, &specs, seed ^ 0x4C4F_5241, |_| {})?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": null,
        "base_model_name_or_path": "Qwen/Qwen3.5-4B",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "target_modules": LORA_TARGETS,
    });
    std::fs::write(dir.join("adapter_config.json"), serde_json::to_string_pretty(&config)? + "\n")?;
    let mut readout = [Spec::new(
        "weight".into(),
        vec![readout_rows, h],
        Init::Normal { mean: 0.0, std: 3.0 / (h as f32).sqrt() },
        Store::F32,
    )];
    if profile == Profile::TrainedLike {
        // Rows of the bound codes read the decision circuit (plus a little noise); the rest are
        // random rows of logit scale ~1.
        readout[0].init = Init::Normal { mean: 0.0, std: 1.0 / (h as f32).sqrt() };
        if let Some(rows) = tensors::circuit_readout(cfg, dtype, seed)? {
            let rows = std::sync::Arc::new(rows);
            readout[0].edit = Some(std::sync::Arc::new(move |v: &mut [f32]| {
                let n = rows.len().min(v.len());
                for (o, r) in v[..n].iter_mut().zip(rows.iter()) {
                    *o = r + 0.1 * *o;
                }
            }));
        }
    }
    let readout_path = dir.join("decision_readout.safetensors");
    write_safetensors(&readout_path, &readout, seed ^ 0x5245_4144, |_| {})?;
    Ok(SynthReport {
        dir: dir.to_path_buf(),
        files: vec![lora_path, readout_path],
        tensors: n_tensors + 1,
        parameters: lora_params + (readout_rows * h) as u64,
        bytes: lora_bytes + stored_bytes(&readout[0]),
        seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::tensors::*;

    #[test]
    fn generation_is_deterministic_and_name_dependent() {
        let s = |name: &str| {
            Spec::new(name.into(), vec![3, 40000], Init::Normal { mean: 0.0, std: 1.0 }, Store::F32)
        };
        let a = generate(&s("x.weight"), 7);
        assert_eq!(a, generate(&s("x.weight"), 7));
        assert_ne!(a, generate(&s("y.weight"), 7));
        assert_ne!(a, generate(&s("x.weight"), 8));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        let var = a.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.02 && (var - 1.0).abs() < 0.03, "mean {mean} var {var}");
    }
}
