//! The file set of the published Qwen3.5-4B (and of a block-FP8 pack of it), with synthetic
//! values: so the loader is tested on checkpoints laid out as the real ones are, not only on the
//! flat single-file layout the other tests write.
//!
//! What the release holds (shared/spec/qwen35.md §1, §7, §8; shared/spec/imajev-contract.md: two
//! shards of 5,329,398,688 and 3,990,429,408 bytes, `chat_template.jinja`, `tokenizer.json`,
//! `preprocessor_config.json`):
//! * `model-0000k-of-0000n.safetensors` shards and `model.safetensors.index.json`
//!   (`metadata.total_size`, `weight_map`); shards are cut at 5 GiB, and small configs are still
//!   split in two so the index path is always exercised;
//! * the `mtp.*` tensors (one multi-token-prediction layer, names from vLLM's loader), which
//!   transformers and this engine ignore;
//! * `config.json` with every key the release's has (the Qwen3.5 family's published config:
//!   `initializer_range`, `mlp_only_layers`, `use_cache`, `attention_dropout`, the MTP keys,
//!   `mamba_ssm_dtype`, the legacy vision `model_type: "qwen3_5"`, `transformers_version`
//!   4.57.0.dev0, …), with this config's dimensions;
//! * `generation_config.json` (bos/pad 248044, eos [248046, 248044]; the sampling values are the
//!   Qwen3.5 family's published ones; nothing here generates text);
//! * `chat_template.jinja` at the top level (where transformers ≥ 4.5x releases keep it),
//!   `tokenizer.json`, `tokenizer_config.json`, `preprocessor_config.json`.
//!
//! The block-FP8 pack (`--dtype fp8`) is Qwen's fine-grained FP8 format: `quantization_config`
//! `{quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic", weight_block_size:
//! [128, 128], modules_to_not_convert}` with the multimodal module paths (`model.language_model.…`,
//! `model.visual.…`), E4M3 text projections with `weight_scale_inv`, `in_proj_a`/`in_proj_b` and
//! the whole vision tower in BF16 (listed module by module), the MTP layer's projections in FP8
//! (kept, as the official packs keep them), `mtp.fc` in BF16.
//!
//! What it does not know: the release's exact tensor order within shards, or whether its `A_log`
//! is stored F32 (here BF16 like the rest); neither changes what a loader must do.

use super::tensors::{profile_specs, Init, Spec, Store};
use super::writer::{stored_bytes, write_safetensors};
use super::{ModelOptions, SynthDtype, SynthReport, CHAT_TEMPLATE};
use crate::engine::config::{LayerKind, ModelConfig};
use crate::tokenizer::QwenTokenizer;
use crate::weights::scale_name;
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::path::Path;

/// The release's shard limit.
const RELEASE_SHARD_BYTES: u64 = 5 << 30;

/// The transformers version the Qwen3.5 release configs name.
const RELEASE_TRANSFORMERS: &str = "4.57.0.dev0";

/// The `mtp.*` tensors of a config (one full-attention layer with the main layers' shapes).
pub fn mtp_specs(cfg: &ModelConfig, dtype: SynthDtype) -> Vec<Spec> {
    let t = &cfg.text_config;
    let h = t.hidden_size;
    let base = if dtype == SynthDtype::F32 { Store::F32 } else { Store::Bf16 };
    let proj = if dtype == SynthDtype::Fp8 { Store::Fp8 } else { base };
    let fan = |i: usize| Init::Normal { mean: 0.0, std: 1.0 / (i as f32).sqrt() };
    let norm = Init::Normal { mean: 0.0, std: 0.1 };
    let (nh, kvh, hd, inter) =
        (t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.intermediate_size);
    let l = "mtp.layers.0.";
    vec![
        Spec::new("mtp.fc.weight".into(), vec![h, 2 * h], fan(2 * h), base),
        Spec::new("mtp.pre_fc_norm_embedding.weight".into(), vec![h], norm, base),
        Spec::new("mtp.pre_fc_norm_hidden.weight".into(), vec![h], norm, base),
        Spec::new("mtp.norm.weight".into(), vec![h], norm, base),
        Spec::new(format!("{l}input_layernorm.weight"), vec![h], norm, base),
        Spec::new(format!("{l}post_attention_layernorm.weight"), vec![h], norm, base),
        Spec::new(format!("{l}self_attn.q_proj.weight"), vec![nh * hd * 2, h], fan(h), proj),
        Spec::new(format!("{l}self_attn.k_proj.weight"), vec![kvh * hd, h], fan(h), proj),
        Spec::new(format!("{l}self_attn.v_proj.weight"), vec![kvh * hd, h], fan(h), proj),
        Spec::new(format!("{l}self_attn.o_proj.weight"), vec![h, nh * hd], fan(nh * hd), proj),
        Spec::new(format!("{l}self_attn.q_norm.weight"), vec![hd], norm, base),
        Spec::new(format!("{l}self_attn.k_norm.weight"), vec![hd], norm, base),
        Spec::new(format!("{l}mlp.gate_proj.weight"), vec![inter, h], fan(h), proj),
        Spec::new(format!("{l}mlp.up_proj.weight"), vec![inter, h], fan(h), proj),
        Spec::new(format!("{l}mlp.down_proj.weight"), vec![h, inter], fan(inter), proj),
    ]
}

/// `config.json` with the release's keys and this config's dimensions.
pub fn release_config(cfg: &ModelConfig, dtype: SynthDtype) -> Result<Value> {
    let t = &cfg.text_config;
    let v = &cfg.vision_config;
    let rope = t.rope()?;
    let kinds = t.layer_kinds()?;
    let layer_types: Vec<&str> = kinds
        .iter()
        .map(|k| match k {
            LayerKind::FullAttention => "full_attention",
            LayerKind::LinearAttention => "linear_attention",
        })
        .collect();
    let dtype_name = if dtype == SynthDtype::F32 { "float32" } else { "bfloat16" };
    let tied = cfg.tied();
    let mut config = json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": cfg.image_token_id,
        "model_type": "qwen3_5",
        "text_config": {
            "attention_bias": t.attention_bias,
            "attention_dropout": 0.0,
            "attn_output_gate": true,
            "dtype": dtype_name,
            "eos_token_id": 248044,
            "full_attention_interval": t.full_attention_interval.unwrap_or(4),
            "head_dim": t.head_dim,
            "hidden_act": t.hidden_act,
            "hidden_size": t.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": t.intermediate_size,
            "layer_types": layer_types,
            "linear_conv_kernel_dim": t.linear_conv_kernel_dim,
            "linear_key_head_dim": t.linear_key_head_dim,
            "linear_num_key_heads": t.linear_num_key_heads,
            "linear_num_value_heads": t.linear_num_value_heads,
            "linear_value_head_dim": t.linear_value_head_dim,
            "max_position_embeddings": t.max_position_embeddings.unwrap_or(262144),
            "mlp_only_layers": [],
            "model_type": "qwen3_5_text",
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": false,
            "num_attention_heads": t.num_attention_heads,
            "num_hidden_layers": t.num_hidden_layers,
            "num_key_value_heads": t.num_key_value_heads,
            "rms_norm_eps": t.rms_norm_eps,
            "tie_word_embeddings": tied,
            "use_cache": true,
            "vocab_size": t.vocab_size,
            "mamba_ssm_dtype": "float32",
            "rope_parameters": {
                "mrope_interleaved": true,
                "mrope_section": rope.mrope_section,
                "rope_type": "default",
                "rope_theta": rope.theta,
                "partial_rotary_factor": rope.rotary_dim as f64 / t.head_dim as f64,
            },
        },
        "tie_word_embeddings": tied,
        "transformers_version": RELEASE_TRANSFORMERS,
        "video_token_id": cfg.video_token_id,
        "vision_config": {
            "deepstack_visual_indexes": [],
            "depth": v.depth,
            "hidden_act": v.hidden_act,
            "hidden_size": v.hidden_size,
            "in_channels": v.in_channels,
            "initializer_range": 0.02,
            "intermediate_size": v.intermediate_size,
            "model_type": "qwen3_5",
            "num_heads": v.num_heads,
            "num_position_embeddings": v.num_position_embeddings,
            "out_hidden_size": v.out_hidden_size,
            "patch_size": v.patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "temporal_patch_size": v.temporal_patch_size,
        },
        "vision_end_token_id": cfg.vision_end_token_id,
        "vision_start_token_id": cfg.vision_start_token_id,
    });
    if dtype == SynthDtype::Fp8 {
        config["quantization_config"] = json!({
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": modules_to_not_convert(cfg)?,
        });
    }
    Ok(config)
}

/// The multimodal paths an FP8 pack keeps in BF16: `lm_head`, every vision Linear, the DeltaNet
/// `in_proj_a`/`in_proj_b`, and `mtp.fc`.
pub fn modules_to_not_convert(cfg: &ModelConfig) -> Result<Vec<String>> {
    let mut out = vec!["lm_head".to_string()];
    for m in 0..cfg.vision_config.depth {
        for part in ["attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"] {
            out.push(format!("model.visual.blocks.{m}.{part}"));
        }
    }
    out.push("model.visual.merger.linear_fc1".into());
    out.push("model.visual.merger.linear_fc2".into());
    for (i, k) in cfg.text_config.layer_kinds()?.iter().enumerate() {
        if *k == LayerKind::LinearAttention {
            out.push(format!("model.language_model.layers.{i}.linear_attn.in_proj_a"));
            out.push(format!("model.language_model.layers.{i}.linear_attn.in_proj_b"));
        }
    }
    out.push("mtp.fc".into());
    Ok(out)
}

/// `generation_config.json` of the release.
pub fn generation_config() -> Value {
    json!({
        "bos_token_id": 248044,
        "do_sample": true,
        "eos_token_id": [248046, 248044],
        "pad_token_id": 248044,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": RELEASE_TRANSFORMERS,
    })
}

/// Splits `specs` into at least two shards of at most [`RELEASE_SHARD_BYTES`], in order.
fn shard(specs: Vec<Spec>) -> Vec<Vec<Spec>> {
    let total: u64 = specs.iter().map(stored_bytes).sum();
    let count = total.div_ceil(RELEASE_SHARD_BYTES).max(2);
    let target = total.div_ceil(count);
    let mut shards: Vec<Vec<Spec>> = vec![vec![]];
    let mut cur = 0u64;
    let n = specs.len();
    for (i, s) in specs.into_iter().enumerate() {
        let b = stored_bytes(&s);
        let remaining = n - i;
        let open = shards.len() as u64;
        // Start the next shard when this one is full, or when the tensors left are only just
        // enough to give every remaining shard one.
        if cur > 0 && open < count && (cur + b > target || remaining as u64 <= count - open) {
            shards.push(vec![]);
            cur = 0;
        }
        cur += b;
        shards.last_mut().expect("one shard").push(s);
    }
    shards
}

/// Writes the release file set into `dir`.
pub fn write_release(cfg: &ModelConfig, opts: &ModelOptions, dir: &Path) -> Result<SynthReport> {
    let started = std::time::Instant::now();
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut specs = profile_specs(cfg, opts.dtype, opts.profile, opts.seed)?;
    specs.extend(mtp_specs(cfg, opts.dtype));
    let config = release_config(cfg, opts.dtype)?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)? + "\n")?;
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(&generation_config())? + "\n",
    )?;
    let total: u64 = specs.iter().map(stored_bytes).sum();
    let shards = shard(specs);
    let count = shards.len();
    let mut progress = crate::engine::progress::LoadProgress::new("writing weights", total);
    let mut weight_map = serde_json::Map::new();
    let (mut files, mut tensors, mut params) = (Vec::new(), 0, 0u64);
    for (i, shard) in shards.iter().enumerate() {
        let fname = format!("model-{:05}-of-{:05}.safetensors", i + 1, count);
        for s in shard {
            weight_map.insert(s.name.clone(), json!(fname));
            if s.store == Store::Fp8 {
                weight_map.insert(scale_name(&s.name), json!(fname));
            }
            tensors += if s.store == Store::Fp8 { 2 } else { 1 };
            params += s.shape.iter().product::<usize>() as u64;
        }
        let path = dir.join(&fname);
        write_safetensors(&path, shard, opts.seed, |b| progress.advance(b))?;
        files.push(path);
    }
    progress.finish();
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index)? + "\n")?;
    std::fs::write(dir.join("tokenizer.json"), QwenTokenizer::builtin_json()?)?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&super::tokenizer_config())? + "\n",
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
