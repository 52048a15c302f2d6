//! `config.json` of a Qwen3.5 (`model_type: qwen3_5`) checkpoint, mirrored field by field.
//!
//! Only what the prefill needs is read; unknown keys are ignored the way transformers ignores
//! them. Defaults are the transformers 5.17 class defaults, and the legacy spellings transformers
//! still accepts (`rope_scaling` + `rope_theta`, `full_attention_interval`, `mamba`/`attention`
//! layer types) are normalised here so the rest of the engine sees one shape.

use crate::backend::{AttentionDims, DeltaNetDims};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attn`).
    LinearAttention,
    /// Gated softmax attention (`self_attn`).
    FullAttention,
}

#[derive(Debug, Clone, Deserialize, Serialize, Default)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_type: Option<String>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub mrope_section: Option<Vec<usize>>,
    #[serde(default)]
    pub mrope_interleaved: Option<bool>,
}

fn d_vocab() -> usize {
    248320
}
fn d_hidden() -> usize {
    4096
}
fn d_inter() -> usize {
    12288
}
fn d_layers() -> usize {
    32
}
fn d_heads() -> usize {
    16
}
fn d_kv_heads() -> usize {
    4
}
fn d_head_dim() -> usize {
    256
}
fn d_eps() -> f64 {
    1e-6
}
fn d_conv() -> usize {
    4
}
fn d_128() -> usize {
    128
}
fn d_lin_k_heads() -> usize {
    16
}
fn d_lin_v_heads() -> usize {
    32
}
fn d_act() -> String {
    "silu".into()
}

/// `text_config` (`qwen3_5_text`).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct TextConfig {
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_kv_heads")]
    pub num_key_value_heads: usize,
    #[serde(default = "d_head_dim")]
    pub head_dim: usize,
    #[serde(default = "d_act")]
    pub hidden_act: String,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "d_conv")]
    pub linear_conv_kernel_dim: usize,
    #[serde(default = "d_128")]
    pub linear_key_head_dim: usize,
    #[serde(default = "d_128")]
    pub linear_value_head_dim: usize,
    #[serde(default = "d_lin_k_heads")]
    pub linear_num_key_heads: usize,
    #[serde(default = "d_lin_v_heads")]
    pub linear_num_value_heads: usize,
    /// As written in config.json; see [`TextConfig::layer_kinds`] for the normalised form.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub full_attention_interval: Option<usize>,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Legacy spelling of `rope_parameters`.
    #[serde(default, skip_serializing)]
    pub rope_scaling: Option<RopeParameters>,
    #[serde(default, skip_serializing)]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
}

fn d_v_depth() -> usize {
    27
}
fn d_v_hidden() -> usize {
    1152
}
fn d_v_act() -> String {
    "gelu_pytorch_tanh".into()
}
fn d_v_inter() -> usize {
    4304
}
fn d_v_heads() -> usize {
    16
}
fn d_v_in() -> usize {
    3
}
fn d_v_patch() -> usize {
    16
}
fn d_v_merge() -> usize {
    2
}
fn d_v_tpatch() -> usize {
    2
}
fn d_v_out() -> usize {
    3584
}
fn d_v_pos() -> usize {
    2304
}

/// `vision_config` (`qwen3_5_vision`).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct VisionConfig {
    #[serde(default = "d_v_depth")]
    pub depth: usize,
    #[serde(default = "d_v_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_v_act")]
    pub hidden_act: String,
    #[serde(default = "d_v_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_v_heads")]
    pub num_heads: usize,
    #[serde(default = "d_v_in")]
    pub in_channels: usize,
    #[serde(default = "d_v_patch")]
    pub patch_size: usize,
    #[serde(default = "d_v_merge")]
    pub spatial_merge_size: usize,
    #[serde(default = "d_v_tpatch")]
    pub temporal_patch_size: usize,
    #[serde(default = "d_v_out")]
    pub out_hidden_size: usize,
    #[serde(default = "d_v_pos")]
    pub num_position_embeddings: usize,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
}

/// `quantization_config` of a fine-grained (block) FP8 checkpoint.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct QuantizationConfig {
    pub quant_method: String,
    #[serde(default)]
    pub fmt: Option<String>,
    #[serde(default)]
    pub activation_scheme: Option<String>,
    #[serde(default)]
    pub weight_block_size: Option<Vec<usize>>,
    #[serde(default)]
    pub modules_to_not_convert: Option<Vec<String>>,
}

fn d_image_token() -> u32 {
    248056
}
fn d_video_token() -> u32 {
    248057
}
fn d_vs_token() -> u32 {
    248053
}
fn d_ve_token() -> u32 {
    248054
}

/// Top-level `config.json` (`qwen3_5`).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ModelConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    pub text_config: TextConfig,
    pub vision_config: VisionConfig,
    #[serde(default = "d_image_token")]
    pub image_token_id: u32,
    #[serde(default = "d_video_token")]
    pub video_token_id: u32,
    #[serde(default = "d_vs_token")]
    pub vision_start_token_id: u32,
    #[serde(default = "d_ve_token")]
    pub vision_end_token_id: u32,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub quantization_config: Option<QuantizationConfig>,
}

/// Text RoPE after normalisation.
#[derive(Debug, Clone, PartialEq)]
pub struct TextRope {
    pub theta: f64,
    /// Rotated dims per head (`head_dim · partial_rotary_factor`).
    pub rotary_dim: usize,
    /// Interleaved mRoPE sections `[T, H, W]` over `rotary_dim / 2` frequencies.
    pub mrope_section: [usize; 3],
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_json(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let cfg: ModelConfig = serde_json::from_str(text)?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        if let Some(mt) = &self.model_type {
            if mt != "qwen3_5" {
                bail!("model_type is {mt:?}; this engine serves Qwen3.5 dense checkpoints (model_type \"qwen3_5\")");
            }
        }
        let t = &self.text_config;
        if t.hidden_act != "silu" {
            bail!("text_config.hidden_act {:?} is not supported (Qwen3.5 uses silu)", t.hidden_act);
        }
        if t.num_attention_heads % t.num_key_value_heads.max(1) != 0 {
            bail!("num_attention_heads must be a multiple of num_key_value_heads");
        }
        if t.linear_num_value_heads % t.linear_num_key_heads.max(1) != 0 {
            bail!("linear_num_value_heads must be a multiple of linear_num_key_heads");
        }
        let kinds = t.layer_kinds()?;
        if kinds.len() != t.num_hidden_layers {
            bail!("layer_types has {} entries but num_hidden_layers is {}", kinds.len(), t.num_hidden_layers);
        }
        let rope = t.rope()?;
        if rope.rotary_dim == 0 || rope.rotary_dim % 2 != 0 || rope.rotary_dim > t.head_dim {
            bail!("rotary dim {} is invalid for head_dim {}", rope.rotary_dim, t.head_dim);
        }
        let v = &self.vision_config;
        if v.hidden_size % v.num_heads != 0 {
            bail!("vision hidden_size must be a multiple of num_heads");
        }
        let side = (v.num_position_embeddings as f64).sqrt() as usize;
        if side * side != v.num_position_embeddings {
            bail!("vision num_position_embeddings must be a square");
        }
        if !matches!(v.hidden_act.as_str(), "gelu_pytorch_tanh" | "gelu" | "silu" | "gelu_new") {
            bail!("vision hidden_act {:?} is not supported", v.hidden_act);
        }
        if let Some(q) = &self.quantization_config {
            if q.quant_method != "fp8" {
                bail!(
                    "quantization_config.quant_method {:?} is not supported; use a BF16/F32 checkpoint or \
                     fine-grained block FP8 (quant_method \"fp8\", weight_block_size [128, 128])",
                    q.quant_method
                );
            }
        }
        Ok(())
    }

    /// Whether the LM head is the embedding (always true for Qwen3.5-4B; we never compute it).
    pub fn tied(&self) -> bool {
        self.tie_word_embeddings.or(self.text_config.tie_word_embeddings).unwrap_or(false)
    }
}

impl TextConfig {
    pub fn layer_kinds(&self) -> Result<Vec<LayerKind>> {
        match &self.layer_types {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    "linear_attention" | "mamba" | "conv" => Ok(LayerKind::LinearAttention),
                    "full_attention" | "attention" => Ok(LayerKind::FullAttention),
                    other => bail!("unknown layer type {other:?} in layer_types"),
                })
                .collect(),
            None => {
                let every = self.full_attention_interval.unwrap_or(4).max(1);
                Ok((0..self.num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % every == 0 {
                            LayerKind::FullAttention
                        } else {
                            LayerKind::LinearAttention
                        }
                    })
                    .collect())
            }
        }
    }

    /// The shapes of the gated-attention layers.
    pub fn attention_dims(&self) -> Result<AttentionDims> {
        Ok(AttentionDims {
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rotary_dim: self.rope()?.rotary_dim,
            norm_eps: self.rms_norm_eps as f32,
        })
    }

    /// The shapes of the Gated DeltaNet layers.
    pub fn deltanet_dims(&self) -> DeltaNetDims {
        DeltaNetDims {
            key_heads: self.linear_num_key_heads,
            value_heads: self.linear_num_value_heads,
            key_dim: self.linear_key_head_dim,
            value_dim: self.linear_value_head_dim,
            conv_kernel: self.linear_conv_kernel_dim,
            norm_eps: self.rms_norm_eps as f32,
        }
    }

    pub fn rope(&self) -> Result<TextRope> {
        let p = self.rope_parameters.clone().or_else(|| self.rope_scaling.clone()).unwrap_or_default();
        if let Some(rt) = &p.rope_type {
            if rt != "default" && rt != "mrope" {
                bail!("text rope_type {rt:?} is not supported (Qwen3.5 uses the default rope)");
            }
        }
        let theta = p.rope_theta.or(self.rope_theta).unwrap_or(10_000.0);
        let factor = p.partial_rotary_factor.or(self.partial_rotary_factor).unwrap_or(0.25);
        let rotary_dim = (self.head_dim as f64 * factor) as usize;
        let sec = p.mrope_section.unwrap_or_else(|| vec![11, 11, 10]);
        if sec.len() != 3 {
            bail!("mrope_section must have 3 entries, got {:?}", sec);
        }
        Ok(TextRope { theta, rotary_dim, mrope_section: [sec[0], sec[1], sec[2]] })
    }

    pub fn key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters.as_ref().and_then(|p| p.rope_theta).unwrap_or(10_000.0)
    }
    /// Values per flattened patch row (`C · T · P · P`).
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
    pub fn pos_grid_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt() as usize
    }
}
