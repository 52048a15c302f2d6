//! The tensors of a synthetic checkpoint: names and shapes of the Qwen3.5 layout, how each one's
//! values are drawn, and how it is stored. Values depend only on (seed, tensor name, block), so
//! generation parallelises without changing a bit.

use super::profile::{self, DecisionCircuit, Edit, Profile, ResidualOutliers};
use super::rng::{name_seed, SplitMix};
use super::SynthDtype;
use crate::engine::config::{LayerKind, ModelConfig};
use anyhow::Result;
use rayon::prelude::*;
use std::sync::Arc;

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// `mean + std·N(0,1)`
    Normal { mean: f32, std: f32 },
    /// `ln(U(lo, hi))`
    LogUniform { lo: f32, hi: f32 },
    /// `exp(sigma·N(0,1)) − shift`: a log-normal gain (shift 1 for Qwen3.5's zero-centred norms,
    /// which store the offset of `1 + w`).
    LogNormal { sigma: f32, shift: f32 },
    /// `softplus⁻¹(dt)` with `dt` log-uniform in `[lo, hi]` (a DeltaNet `dt_bias`).
    InvSoftplusLogUniform { lo: f32, hi: f32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    F32,
    Bf16,
    Fp8,
}

pub struct Spec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    pub store: Store,
    /// A change applied to the generated values (the trained-like profile's structure).
    pub edit: Option<Edit>,
}

impl Spec {
    pub fn new(name: String, shape: Vec<usize>, init: Init, store: Store) -> Self {
        Spec { name, shape, init, store, edit: None }
    }
}

const BLOCK: usize = 1 << 14;

fn fill_block(init: Init, base: u64, bi: usize, chunk: &mut [f32]) {
    let mut rng = SplitMix::new(base ^ (bi as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    match init {
        Init::Normal { mean, std } => chunk.iter_mut().for_each(|x| *x = mean + std * rng.normal()),
        Init::LogUniform { lo, hi } => {
            chunk.iter_mut().for_each(|x| *x = (lo + (hi - lo) * rng.uniform()).ln())
        }
        Init::LogNormal { sigma, shift } => {
            chunk.iter_mut().for_each(|x| *x = (sigma * rng.normal()).exp() - shift)
        }
        Init::InvSoftplusLogUniform { lo, hi } => chunk.iter_mut().for_each(|x| {
            let dt = (lo.ln() + (hi.ln() - lo.ln()) * rng.uniform()).exp();
            // softplus⁻¹(dt) = dt + ln(1 − e^(−dt)), stable for small dt.
            *x = dt + (-(-dt).exp_m1()).ln();
        }),
    }
}

/// The values a spec's init rule draws (before any [`Spec::edit`]).
pub fn generate(spec: &Spec, seed: u64) -> Vec<f32> {
    let n: usize = spec.shape.iter().product();
    let base = name_seed(seed, &spec.name);
    let mut v = vec![0f32; n];
    v.par_chunks_mut(BLOCK).enumerate().for_each(|(bi, chunk)| fill_block(spec.init, base, bi, chunk));
    v
}

/// The values of a spec, edits applied: what a checkpoint file holds (before storage rounding).
pub fn values(spec: &Spec, seed: u64) -> Vec<f32> {
    let mut v = generate(spec, seed);
    if let Some(e) = &spec.edit {
        e(&mut v);
    }
    v
}

/// Rows (units of the last dimension) of [`generate`]'s values, concatenated, without drawing
/// the rest of the tensor: only the generator blocks that hold them are drawn.
pub fn generate_rows(spec: &Spec, seed: u64, rows: &[usize]) -> Vec<f32> {
    let cols = *spec.shape.last().unwrap_or(&1);
    let base = name_seed(seed, &spec.name);
    let n: usize = spec.shape.iter().product();
    let mut out = Vec::with_capacity(rows.len() * cols);
    let mut block = vec![0f32; BLOCK];
    let mut have = usize::MAX;
    for &r in rows {
        for i in r * cols..(r + 1) * cols {
            let bi = i / BLOCK;
            if bi != have {
                let len = BLOCK.min(n - bi * BLOCK);
                fill_block(spec.init, base, bi, &mut block[..len]);
                have = bi;
            }
            out.push(block[i % BLOCK]);
        }
    }
    out
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

/// The tensors of a Qwen3.5 checkpoint with the random profile's init rules.
pub fn model_specs(cfg: &ModelConfig, dtype: SynthDtype) -> Result<Vec<Spec>> {
    profile_specs(cfg, dtype, Profile::Random, 0)
}

/// The tensors of a Qwen3.5 checkpoint with `profile`'s init rules and edits (the trained-like
/// edits depend on the checkpoint's `seed`).
pub fn profile_specs(cfg: &ModelConfig, dtype: SynthDtype, profile: Profile, seed: u64) -> Result<Vec<Spec>> {
    let mut specs = base_specs(cfg, dtype, profile)?;
    if profile == Profile::TrainedLike {
        add_trained_like_edits(cfg, dtype, seed, &mut specs)?;
    }
    Ok(specs)
}

/// Names, shapes, storage and init rules, without edits.
fn base_specs(cfg: &ModelConfig, dtype: SynthDtype, profile: Profile) -> Result<Vec<Spec>> {
    let tl = profile == Profile::TrainedLike;
    // Zero-centred (`1 + w`) norms, plain gains, DeltaNet dt_bias and conv taps, per profile.
    let zc_norm = if tl { profile::norm_init(true) } else { Init::Normal { mean: 0.0, std: 0.1 } };
    let gain = if tl { profile::norm_init(false) } else { Init::Normal { mean: 1.0, std: 0.1 } };
    let dt_bias = if tl { profile::dt_bias_init() } else { Init::Normal { mean: 1.0, std: 0.2 } };
    let conv_std = if tl { 0.29 } else { 0.5 };
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
        specs.push(Spec::new(name, shape, init, store));
    };
    let n = |std: f32| Init::Normal { mean: 0.0, std };
    let fan = |i: usize| 1.0 / (i as f32).sqrt();
    let out_scale = 1.0 / ((2 * t.num_hidden_layers) as f32).sqrt();
    let h = t.hidden_size;
    let p = "model.language_model.";
    add(format!("{p}embed_tokens.weight"), vec![t.vocab_size, h], n(1.0));
    add(format!("{p}norm.weight"), vec![h], zc_norm);
    for (i, k) in kinds.iter().enumerate() {
        let l = format!("{p}layers.{i}.");
        add(format!("{l}input_layernorm.weight"), vec![h], zc_norm);
        add(format!("{l}post_attention_layernorm.weight"), vec![h], zc_norm);
        add(format!("{l}mlp.gate_proj.weight"), vec![t.intermediate_size, h], n(fan(h)));
        add(format!("{l}mlp.up_proj.weight"), vec![t.intermediate_size, h], n(fan(h)));
        add(
            format!("{l}mlp.down_proj.weight"),
            vec![h, t.intermediate_size],
            n(fan(t.intermediate_size) * out_scale),
        );
        match k {
            LayerKind::FullAttention => {
                let (nh, kvh, hd) = (t.num_attention_heads, t.num_key_value_heads, t.head_dim);
                add(format!("{l}self_attn.q_proj.weight"), vec![nh * hd * 2, h], n(fan(h)));
                add(format!("{l}self_attn.k_proj.weight"), vec![kvh * hd, h], n(fan(h)));
                add(format!("{l}self_attn.v_proj.weight"), vec![kvh * hd, h], n(fan(h)));
                add(format!("{l}self_attn.o_proj.weight"), vec![h, nh * hd], n(fan(nh * hd) * out_scale));
                add(format!("{l}self_attn.q_norm.weight"), vec![hd], zc_norm);
                add(format!("{l}self_attn.k_norm.weight"), vec![hd], zc_norm);
            }
            LayerKind::LinearAttention => {
                let vh = t.linear_num_value_heads;
                add(format!("{l}linear_attn.in_proj_qkv.weight"), vec![t.conv_dim(), h], n(fan(h)));
                add(format!("{l}linear_attn.in_proj_z.weight"), vec![t.value_dim(), h], n(fan(h)));
                add(format!("{l}linear_attn.in_proj_b.weight"), vec![vh, h], n(fan(h)));
                add(format!("{l}linear_attn.in_proj_a.weight"), vec![vh, h], n(fan(h)));
                add(
                    format!("{l}linear_attn.conv1d.weight"),
                    vec![t.conv_dim(), 1, t.linear_conv_kernel_dim],
                    n(conv_std),
                );
                add(format!("{l}linear_attn.dt_bias"), vec![vh], dt_bias);
                add(format!("{l}linear_attn.A_log"), vec![vh], Init::LogUniform { lo: 1.0, hi: 16.0 });
                add(format!("{l}linear_attn.norm.weight"), vec![t.linear_value_head_dim], gain);
                add(
                    format!("{l}linear_attn.out_proj.weight"),
                    vec![h, t.value_dim()],
                    n(fan(t.value_dim()) * out_scale),
                );
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
            add(format!("{b}{ln}.weight"), vec![d], gain);
            add(format!("{b}{ln}.bias"), vec![d], n(0.02));
        }
        add(format!("{b}attn.qkv.weight"), vec![3 * d, d], n(fan(d)));
        add(format!("{b}attn.qkv.bias"), vec![3 * d], n(0.02));
        add(format!("{b}attn.proj.weight"), vec![d, d], n(fan(d) * v_out));
        add(format!("{b}attn.proj.bias"), vec![d], n(0.02));
        add(format!("{b}mlp.linear_fc1.weight"), vec![v.intermediate_size, d], n(fan(d)));
        add(format!("{b}mlp.linear_fc1.bias"), vec![v.intermediate_size], n(0.02));
        add(
            format!("{b}mlp.linear_fc2.weight"),
            vec![d, v.intermediate_size],
            n(fan(v.intermediate_size) * v_out),
        );
        add(format!("{b}mlp.linear_fc2.bias"), vec![d], n(0.02));
    }
    let m = d * v.spatial_merge_size * v.spatial_merge_size;
    add(format!("{vp}merger.norm.weight"), vec![d], gain);
    add(format!("{vp}merger.norm.bias"), vec![d], n(0.02));
    add(format!("{vp}merger.linear_fc1.weight"), vec![m, m], n(fan(m)));
    add(format!("{vp}merger.linear_fc1.bias"), vec![m], n(0.02));
    add(format!("{vp}merger.linear_fc2.weight"), vec![v.out_hidden_size, m], n(fan(m)));
    add(format!("{vp}merger.linear_fc2.bias"), vec![v.out_hidden_size], n(0.02));
    Ok(specs)
}

/// Vision outlier channels: this many, at this multiple of the patch embedding's typical output
/// (pixels in [−1, 1] have an RMS near 0.58 and the projection keeps it).
const VISION_OUTLIERS: usize = 2;
const VISION_OUTLIER_VALUE: f32 = profile::OUTLIER_SCALE * 0.58;

fn add_trained_like_edits(cfg: &ModelConfig, dtype: SynthDtype, seed: u64, specs: &mut [Spec]) -> Result<()> {
    let h = cfg.text_config.hidden_size;
    let outliers = Arc::new(ResidualOutliers::new(h, seed));
    let circuit = DecisionCircuit::build(cfg, dtype, seed, specs)?.map(Arc::new);
    let d = cfg.vision_config.hidden_size;
    let mut rng = SplitMix::new(seed ^ 0x5649_5355_414C);
    let vision: Vec<(usize, f32)> = (0..VISION_OUTLIERS.min(d))
        .map(|i| {
            let c = (rng.below(d / VISION_OUTLIERS.max(1)) + i * d / VISION_OUTLIERS.max(1)).min(d - 1);
            (c, if rng.next_u64() & 1 == 0 { VISION_OUTLIER_VALUE } else { -VISION_OUTLIER_VALUE })
        })
        .collect();
    for s in specs.iter_mut() {
        if s.name == "model.language_model.embed_tokens.weight" {
            s.edit = Some(outliers.edit());
        } else if s.name == "model.visual.patch_embed.proj.bias" {
            let vision = vision.clone();
            s.edit = Some(Arc::new(move |v: &mut [f32]| vision.iter().for_each(|&(c, x)| v[c] += x)));
        } else if let Some(c) = &circuit {
            if let Some(e) = c.edit_for(&s.name) {
                s.edit = Some(e);
            }
        }
    }
    Ok(())
}

/// The decision circuit's readout rows for a trained-like checkpoint (None when the config
/// has no room for the circuit).
pub fn circuit_readout(cfg: &ModelConfig, dtype: SynthDtype, seed: u64) -> Result<Option<Vec<f32>>> {
    let specs = base_specs(cfg, dtype, Profile::TrainedLike)?;
    Ok(DecisionCircuit::build(cfg, dtype, seed, &specs)?.map(|c| c.readout_rows().to_vec()))
}
