//! Random-weight Qwen3.5 checkpoints (and imajev-style adapters) in the real file layouts.
//!
//! No real weights can be downloaded where this project is built and tested, so correctness is
//! proven on random weights of the exact Qwen3.5 shapes, loaded unchanged by transformers + PEFT.
//! Values are deterministic in the seed and the tensor name only (counter-based: each block of
//! values has its own generator), so a checkpoint is the same on every machine and thread count.
//!
//! The safetensors writer here streams one generated tensor at a time and writes an FP8 weight
//! together with its block scales; the `safetensors` crate's writer needs every tensor up front
//! and orders them itself, so it cannot do either.

use super::config::{LayerKind, ModelConfig};
use crate::tokenizer::QwenTokenizer;
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde_json::json;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Storage precision of a synthetic checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthDtype {
    F32,
    Bf16,
    /// BF16 with the text projections in block FP8 (E4M3, 128×128 scales), as Qwen's FP8 packs.
    Fp8,
}

/// The named configurations `synth --config` accepts (besides a path to a config.json).
pub fn preset(name: &str) -> Result<ModelConfig> {
    let v = match name {
        "tiny" => tiny_config(),
        "qwen3.5-4b" | "qwen3_5-4b" | "4b" => qwen35_4b_config(),
        path => {
            let p = Path::new(path);
            if !p.exists() {
                bail!("--config {path:?} is neither a preset (tiny, qwen3.5-4b) nor an existing config.json");
            }
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {path}"))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {path}"))?
        }
    };
    let cfg: ModelConfig = serde_json::from_value(v)?;
    cfg.validate()?;
    Ok(cfg)
}

/// A small model with every Qwen3.5 feature (GQA, gated attention, partial interleaved mRoPE,
/// grouped DeltaNet heads, a vision tower with 2×2 merge) and the real 248,320-row vocabulary.
pub fn tiny_config() -> serde_json::Value {
    json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
        "tie_word_embeddings": true,
        "text_config": {
            "model_type": "qwen3_5_text",
            "vocab_size": 248320, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": false,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "full_attention_interval": 4,
            "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": [3, 3, 2], "mrope_interleaved": true},
            "tie_word_embeddings": true, "eos_token_id": 248044, "dtype": "float32"
        },
        "vision_config": {
            "model_type": "qwen3_5_vision",
            "depth": 2, "hidden_size": 32, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 64,
            "num_heads": 2, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "out_hidden_size": 64, "num_position_embeddings": 256,
            "deepstack_visual_indexes": []
        }
    })
}

/// Qwen/Qwen3.5-4B (spec §1.1).
pub fn qwen35_4b_config() -> serde_json::Value {
    let types: Vec<&str> = (0..32).map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" }).collect();
    json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
        "tie_word_embeddings": true,
        "text_config": {
            "model_type": "qwen3_5_text",
            "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216,
            "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": false, "attn_output_gate": true,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "layer_types": types, "full_attention_interval": 4,
            "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": true},
            "mtp_num_hidden_layers": 1, "mamba_ssm_dtype": "float32",
            "tie_word_embeddings": true, "eos_token_id": 248044, "dtype": "bfloat16"
        },
        "vision_config": {
            "model_type": "qwen3_5_vision",
            "depth": 24, "hidden_size": 1024, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4096,
            "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "out_hidden_size": 2560, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": []
        }
    })
}

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy)]
enum Init {
    /// `mean + std·N(0,1)`
    Normal { mean: f32, std: f32 },
    /// `ln(U(lo, hi))`
    LogUniform { lo: f32, hi: f32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Store {
    F32,
    Bf16,
    Fp8,
}

struct Spec {
    name: String,
    shape: Vec<usize>,
    init: Init,
    store: Store,
}

/// Deterministic counter-based generator: SplitMix64 seeded per (tensor, block).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Approximately standard normal (Irwin–Hall of four 16-bit uniforms, rescaled).
    fn normal(&mut self) -> f32 {
        let r = self.next();
        let s: u32 = (0..4).map(|i| ((r >> (16 * i)) & 0xFFFF) as u32).sum();
        let u = (s as f32 + 2.0) / 65536.0; // sum of 4 U(0,1), mean 2, variance 1/3
        (u - 2.0) * 3f32.sqrt()
    }
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
}

fn name_seed(seed: u64, name: &str) -> u64 {
    // FNV-1a over the name, mixed with the seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

const BLOCK: usize = 1 << 14;

fn generate(spec: &Spec, seed: u64) -> Vec<f32> {
    let n: usize = spec.shape.iter().product();
    let base = name_seed(seed, &spec.name);
    let mut v = vec![0f32; n];
    v.par_chunks_mut(BLOCK).enumerate().for_each(|(bi, chunk)| {
        let mut rng = SplitMix(base ^ (bi as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        match spec.init {
            Init::Normal { mean, std } => chunk.iter_mut().for_each(|x| *x = mean + std * rng.normal()),
            Init::LogUniform { lo, hi } => chunk.iter_mut().for_each(|x| *x = (lo + (hi - lo) * rng.uniform()).ln()),
        }
    });
    v
}

/// Round-to-nearest block FP8: per 128×128 block `s = 448 / max|W|` (1 for an all-zero block),
/// `q = e4m3(W·s)`, stored multiplier `1/s`. Returns (fp8 bytes, `[⌈out/128⌉, ⌈in/128⌉]` scales).
pub fn quantize_fp8_blocks(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    const B: usize = 128;
    let (br, bc) = (rows.div_ceil(B), cols.div_ceil(B));
    let mut scale_inv = vec![0f32; br * bc];
    let mut q = vec![0u8; rows * cols];
    for bi in 0..br {
        for bj in 0..bc {
            let mut amax = 0f32;
            for r in bi * B..((bi + 1) * B).min(rows) {
                for c in bj * B..((bj + 1) * B).min(cols) {
                    amax = amax.max(w[r * cols + c].abs());
                }
            }
            let s = if amax > 0.0 { 448.0 / amax } else { 1.0 };
            scale_inv[bi * bc + bj] = 1.0 / s;
            for r in bi * B..((bi + 1) * B).min(rows) {
                for c in bj * B..((bj + 1) * B).min(cols) {
                    q[r * cols + c] = float8::F8E4M3::from_f32(w[r * cols + c] * s).to_bits();
                }
            }
        }
    }
    (q, scale_inv)
}

fn dtype_name(s: Store) -> &'static str {
    match s {
        Store::F32 => "F32",
        Store::Bf16 => "BF16",
        Store::Fp8 => "F8_E4M3",
    }
}

/// One output tensor (or an FP8 weight + its scales) ready to write.
struct Encoded {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn encode(spec: &Spec, seed: u64) -> Vec<Encoded> {
    let v = generate(spec, seed);
    match spec.store {
        Store::F32 => vec![Encoded {
            name: spec.name.clone(),
            dtype: "F32",
            shape: spec.shape.clone(),
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }],
        Store::Bf16 => vec![Encoded {
            name: spec.name.clone(),
            dtype: "BF16",
            shape: spec.shape.clone(),
            bytes: v.par_iter().flat_map_iter(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        }],
        Store::Fp8 => {
            let (rows, cols) = (spec.shape[0], spec.shape[1]);
            let (q, s) = quantize_fp8_blocks(&v, rows, cols);
            let sname = super::weights::scale_name(&spec.name);
            vec![
                Encoded { name: spec.name.clone(), dtype: dtype_name(Store::Fp8), shape: spec.shape.clone(), bytes: q },
                Encoded {
                    name: sname,
                    dtype: "F32",
                    shape: vec![rows.div_ceil(128), cols.div_ceil(128)],
                    bytes: s.iter().flat_map(|x| x.to_le_bytes()).collect(),
                },
            ]
        }
    }
}

/// Bytes a spec will occupy on disk.
fn stored_bytes(spec: &Spec) -> u64 {
    let n: u64 = spec.shape.iter().product::<usize>() as u64;
    match spec.store {
        Store::F32 => 4 * n,
        Store::Bf16 => 2 * n,
        Store::Fp8 => n + 4 * (spec.shape[0].div_ceil(128) * spec.shape[1].div_ceil(128)) as u64,
    }
}

/// Writes safetensors files, streaming: the header is computed from the specs, then each tensor
/// is generated and written in header order.
fn write_safetensors(path: &Path, specs: &[Spec], seed: u64, mut on_tensor: impl FnMut(u64)) -> Result<()> {
    // Layout pass: names, dtypes, shapes and offsets without generating any values.
    let mut entries = serde_json::Map::new();
    entries.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0u64;
    for s in specs {
        let mut push = |name: &str, dtype: &str, shape: &[usize], len: u64| {
            entries.insert(name.to_string(), json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}));
            offset += len;
        };
        let n = s.shape.iter().product::<usize>() as u64;
        match s.store {
            Store::Fp8 => {
                push(&s.name, "F8_E4M3", &s.shape, n);
                let ss = [s.shape[0].div_ceil(128), s.shape[1].div_ceil(128)];
                push(&super::weights::scale_name(&s.name), "F32", &ss, 4 * (ss[0] * ss[1]) as u64);
            }
            other => push(&s.name, dtype_name(other), &s.shape, stored_bytes(s)),
        }
    }
    let mut header = serde_json::to_vec(&serde_json::Value::Object(entries))?;
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    w.write_all(&(header.len() as u64).to_le_bytes())?;
    w.write_all(&header)?;
    for s in specs {
        for e in encode(s, seed) {
            debug_assert!(!e.name.is_empty() && !e.dtype.is_empty() && !e.shape.is_empty());
            w.write_all(&e.bytes)?;
        }
        on_tensor(stored_bytes(s));
    }
    w.flush()?;
    Ok(())
}

fn is_fp8_target(name: &str) -> bool {
    const T: [&str; 10] = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "linear_attn.in_proj_qkv.weight",
        "linear_attn.in_proj_z.weight",
        "linear_attn.out_proj.weight",
    ];
    name.starts_with("model.language_model.") && T.iter().any(|t| name.ends_with(t))
}

/// The tensors of a Qwen3.5 checkpoint with their init rules.
fn model_specs(cfg: &ModelConfig, dtype: SynthDtype) -> Result<Vec<Spec>> {
    let t = &cfg.text_config;
    let v = &cfg.vision_config;
    let kinds = t.layer_kinds()?;
    let base = match dtype {
        SynthDtype::F32 => Store::F32,
        _ => Store::Bf16,
    };
    let mut specs = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, init: Init| {
        let store = if dtype == SynthDtype::Fp8 && is_fp8_target(&name) { Store::Fp8 } else { base };
        specs.push(Spec { name, shape, init, store });
    };
    let n = |std: f32| Init::Normal { mean: 0.0, std };
    let fan = |i: usize| 1.0 / (i as f32).sqrt();
    let out_scale = 1.0 / ((2 * t.num_hidden_layers) as f32).sqrt();
    let h = t.hidden_size;
    let p = "model.language_model.";
    add(format!("{p}embed_tokens.weight"), vec![t.vocab_size, h], n(1.0));
    add(format!("{p}norm.weight"), vec![h], n(0.1));
    for (i, k) in kinds.iter().enumerate() {
        let l = format!("{p}layers.{i}.");
        add(format!("{l}input_layernorm.weight"), vec![h], n(0.1));
        add(format!("{l}post_attention_layernorm.weight"), vec![h], n(0.1));
        add(format!("{l}mlp.gate_proj.weight"), vec![t.intermediate_size, h], n(fan(h)));
        add(format!("{l}mlp.up_proj.weight"), vec![t.intermediate_size, h], n(fan(h)));
        add(format!("{l}mlp.down_proj.weight"), vec![h, t.intermediate_size], n(fan(t.intermediate_size) * out_scale));
        match k {
            LayerKind::FullAttention => {
                let (nh, kvh, hd) = (t.num_attention_heads, t.num_key_value_heads, t.head_dim);
                add(format!("{l}self_attn.q_proj.weight"), vec![nh * hd * 2, h], n(fan(h)));
                add(format!("{l}self_attn.k_proj.weight"), vec![kvh * hd, h], n(fan(h)));
                add(format!("{l}self_attn.v_proj.weight"), vec![kvh * hd, h], n(fan(h)));
                add(format!("{l}self_attn.o_proj.weight"), vec![h, nh * hd], n(fan(nh * hd) * out_scale));
                add(format!("{l}self_attn.q_norm.weight"), vec![hd], n(0.1));
                add(format!("{l}self_attn.k_norm.weight"), vec![hd], n(0.1));
            }
            LayerKind::LinearAttention => {
                let vh = t.linear_num_value_heads;
                add(format!("{l}linear_attn.in_proj_qkv.weight"), vec![t.conv_dim(), h], n(fan(h)));
                add(format!("{l}linear_attn.in_proj_z.weight"), vec![t.value_dim(), h], n(fan(h)));
                add(format!("{l}linear_attn.in_proj_b.weight"), vec![vh, h], n(fan(h)));
                add(format!("{l}linear_attn.in_proj_a.weight"), vec![vh, h], n(fan(h)));
                add(format!("{l}linear_attn.conv1d.weight"), vec![t.conv_dim(), 1, t.linear_conv_kernel_dim], n(0.5));
                add(format!("{l}linear_attn.dt_bias"), vec![vh], Init::Normal { mean: 1.0, std: 0.2 });
                add(format!("{l}linear_attn.A_log"), vec![vh], Init::LogUniform { lo: 1.0, hi: 16.0 });
                add(format!("{l}linear_attn.norm.weight"), vec![t.linear_value_head_dim], Init::Normal { mean: 1.0, std: 0.1 });
                add(format!("{l}linear_attn.out_proj.weight"), vec![h, t.value_dim()], n(fan(t.value_dim()) * out_scale));
            }
        }
    }
    let d = v.hidden_size;
    let vp = "model.visual.";
    let v_out = 1.0 / ((2 * v.depth.max(1)) as f32).sqrt();
    add(
        format!("{vp}patch_embed.proj.weight"),
        vec![d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size],
        n(fan(v.patch_dim())),
    );
    add(format!("{vp}patch_embed.proj.bias"), vec![d], n(0.02));
    add(format!("{vp}pos_embed.weight"), vec![v.num_position_embeddings, d], n(0.3));
    for i in 0..v.depth {
        let b = format!("{vp}blocks.{i}.");
        for ln in ["norm1", "norm2"] {
            add(format!("{b}{ln}.weight"), vec![d], Init::Normal { mean: 1.0, std: 0.1 });
            add(format!("{b}{ln}.bias"), vec![d], n(0.02));
        }
        add(format!("{b}attn.qkv.weight"), vec![3 * d, d], n(fan(d)));
        add(format!("{b}attn.qkv.bias"), vec![3 * d], n(0.02));
        add(format!("{b}attn.proj.weight"), vec![d, d], n(fan(d) * v_out));
        add(format!("{b}attn.proj.bias"), vec![d], n(0.02));
        add(format!("{b}mlp.linear_fc1.weight"), vec![v.intermediate_size, d], n(fan(d)));
        add(format!("{b}mlp.linear_fc1.bias"), vec![v.intermediate_size], n(0.02));
        add(format!("{b}mlp.linear_fc2.weight"), vec![d, v.intermediate_size], n(fan(v.intermediate_size) * v_out));
        add(format!("{b}mlp.linear_fc2.bias"), vec![d], n(0.02));
    }
    let m = d * v.spatial_merge_size * v.spatial_merge_size;
    add(format!("{vp}merger.norm.weight"), vec![d], Init::Normal { mean: 1.0, std: 0.1 });
    add(format!("{vp}merger.norm.bias"), vec![d], n(0.02));
    add(format!("{vp}merger.linear_fc1.weight"), vec![m, m], n(fan(m)));
    add(format!("{vp}merger.linear_fc1.bias"), vec![m], n(0.02));
    add(format!("{vp}merger.linear_fc2.weight"), vec![v.out_hidden_size, m], n(fan(m)));
    add(format!("{vp}merger.linear_fc2.bias"), vec![v.out_hidden_size], n(0.02));
    Ok(specs)
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

/// Writes `config.json`, the safetensors (sharded with an index above 4 GiB), the Qwen3.5
/// `tokenizer.json`, `tokenizer_config.json` and `preprocessor_config.json` into `dir`.
pub fn write_model(cfg: &ModelConfig, dtype: SynthDtype, seed: u64, dir: &Path) -> Result<SynthReport> {
    let started = std::time::Instant::now();
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let specs = model_specs(cfg, dtype)?;
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
    let mut progress = super::progress::LoadProgress::new("writing weights", total);
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
                weight_map.insert(super::weights::scale_name(&s.name), json!(fname));
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
        std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index)? + "\n")?;
    }
    std::fs::write(dir.join("tokenizer.json"), QwenTokenizer::builtin_json()?)?;
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&tokenizer_config())? + "\n")?;
    std::fs::write(dir.join("preprocessor_config.json"), crate::image::ImageProcessorConfig::default().to_json())?;
    std::fs::write(dir.join("chat_template.jinja"), CHAT_TEMPLATE)?;
    Ok(SynthReport { dir: dir.to_path_buf(), files, tensors, parameters: params, bytes: total, seconds: started.elapsed().as_secs_f64() })
}

/// The Qwen3.5 chat template (`chat_template.jinja` of Qwen/Qwen3.5, sha256 a4aee8af…f715),
/// so transformers renders prompts for a synthetic model exactly as for the real one.
pub const CHAT_TEMPLATE: &str = include_str!("assets/qwen3_5_chat_template.jinja");

fn tokenizer_config() -> serde_json::Value {
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
pub const LORA_TARGETS: &str =
    r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z|out_proj)";

/// Writes a PEFT LoRA adapter (`adapter_config.json`, F32 `adapter_model.safetensors`) for every
/// text projection imajev adapts, and an F32 `decision_readout.safetensors` `[readout_rows, hidden]`.
pub fn write_adapter(cfg: &ModelConfig, rank: usize, alpha: f64, readout_rows: usize, seed: u64, dir: &Path) -> Result<SynthReport> {
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
    let b_std = 0.1 / (rank as f32).sqrt();
    let mut specs = Vec::new();
    for (m, i, o) in &modules {
        specs.push(Spec {
            name: format!("base_model.model.{m}.lora_A.weight"),
            shape: vec![rank, *i],
            init: Init::Normal { mean: 0.0, std: 1.0 / (*i as f32).sqrt() },
            store: Store::F32,
        });
        specs.push(Spec {
            name: format!("base_model.model.{m}.lora_B.weight"),
            shape: vec![*o, rank],
            init: Init::Normal { mean: 0.0, std: b_std },
            store: Store::F32,
        });
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
    let readout = [Spec {
        name: "weight".into(),
        shape: vec![readout_rows, h],
        init: Init::Normal { mean: 0.0, std: 3.0 / (h as f32).sqrt() },
        store: Store::F32,
    }];
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
    use super::*;

    #[test]
    fn generation_is_deterministic_and_name_dependent() {
        let s = |name: &str| Spec { name: name.into(), shape: vec![3, 40000], init: Init::Normal { mean: 0.0, std: 1.0 }, store: Store::F32 };
        let a = generate(&s("x.weight"), 7);
        assert_eq!(a, generate(&s("x.weight"), 7));
        assert_ne!(a, generate(&s("y.weight"), 7));
        assert_ne!(a, generate(&s("x.weight"), 8));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        let var = a.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.02 && (var - 1.0).abs() < 0.03, "mean {mean} var {var}");
    }

    #[test]
    fn fp8_blocks_round_trip_within_e4m3_precision() {
        let w: Vec<f32> = (0..200 * 300).map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i / 300) as f32)).collect();
        let (q, s) = quantize_fp8_blocks(&w, 200, 300);
        assert_eq!(s.len(), 2 * 3);
        let back = super::super::weights::dequantize_fp8_blocks(
            &q,
            &[200, 300],
            &s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
            &[2, 3],
            Some([128, 128]),
        )
        .unwrap();
        for (a, b) in w.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() * 0.0625 + 1e-3, "{a} vs {b}");
        }
        // The block maximum maps to ±448 exactly.
        assert!(q.iter().any(|&b| float8::F8E4M3::from_bits(b).to_f32().abs() == 448.0));
    }
}
