//! How a synthetic checkpoint's values are distributed: `random` (the default: independent
//! Gaussians scaled by fan-in, what the tests have always used) or `trained-like`, whose weights
//! have the statistics that make trained transformers numerically stable, and that stress block
//! FP8 the way real checkpoints do.
//!
//! Why: on random weights the network amplifies rounding and its decisions follow no content, so
//! combining the rotations of a question leaves them near-uniform; every comparison of two
//! engines is then dominated by noise (transformers' own bf16 vs f32 differ by median |Δp|
//! 1.8e-3, bench/results/h200-fidelity-ablation-emulated.json) and a real FP8 bug could hide in it.
//!
//! What each trained-like choice imitates, and where the statistic comes from:
//! * **Residual branches scaled by 1/√(2·layers)** (o_proj, out_proj, down_proj; the vision
//!   tower's attn.proj and linear_fc2 by 1/√(2·depth)): GPT-2's initialisation of residual
//!   projections (Radford et al. 2019, §2.3), so the residual stream grows slowly with depth.
//! * **Outlier feature channels**: [`OUTLIER_CHANNELS`] fixed channels of every token's residual
//!   stream are [`OUTLIER_SCALE`]× the typical entry (LLM.int8(), Dettmers et al. 2022, §3:
//!   outliers up to 20× larger in ~6 fixed hidden dimensions, present in most sequence positions
//!   from 6.7B parameters on). Real models grow them in the first layers; here they are put in the
//!   embedding rows, which every later layer sees the same way (RMSNorm statistics, and the 1×128
//!   FP8 activation blocks that contain them get a 20× coarser scale).
//! * **Massive activations**: [`MASSIVE_CHANNELS`] channels of the rows of `<|im_start|>` and
//!   `<|endoftext|>` are [`MASSIVE_SCALE`]× the typical entry (Sun et al. 2024, "Massive
//!   Activations in Large Language Models": a few fixed channels of the starting and delimiter
//!   tokens reach 10³–10⁴× the median, e.g. 2,622 vs a median of 0.2 in LLaMA2-7B). In their FP8
//!   blocks every other value falls to a few E4M3 steps, the hardest case for the 1×128 recipe.
//! * **Norm weights spread around 1**: the effective per-channel scale is log-normal,
//!   `exp(N(0, 0.2²))` (median 1, 90% within 0.72–1.39), the spread of trained RMSNorm/LayerNorm
//!   gains. Qwen3.5 stores the zero-centred norms (input/post-attention/final, q_norm, k_norm)
//!   as the offset `w` of `x̂·(1+w)`, so those hold `exp(·) − 1`; the DeltaNet output norm and the
//!   vision LayerNorms store the gain itself (shared/spec/qwen35.md §2.2, §3).
//! * **DeltaNet gates**: `A_log = ln U(1, 16)` and `dt_bias = softplus⁻¹(dt)`, `dt` log-uniform in
//!   [0.001, 0.1]: the A and Δt ranges of Mamba-2's initialisation (`A_init_range=(1, 16)`,
//!   `dt_min=0.001`, `dt_max=0.1`), which flash-linear-attention's GatedDeltaNet and Qwen3-Next
//!   inherit. Decays `exp(g)` then span memories from a few tokens to thousands (the random
//!   profile's `dt_bias ≈ 1` forgets within a few tokens). conv1d taps: `N(0, 0.29²)`, the spread
//!   of PyTorch's default Conv1d init for 4 taps (uniform ±1/√4).
//! * **Decisions that follow the options' content** ([`DecisionCircuit`]): one DeltaNet head of
//!   layer 0 is an associative memory (what trained linear-attention layers learn: Schlag et al.
//!   2021, "Linear Transformers Are Secretly Fast Weight Programmers"; the recall heads of Olsson
//!   et al. 2022). Its short convolution binds each option line's code (`A`, `B`, …, up to three
//!   tokens back) to the line's first word; the decision token queries the memory; the readout
//!   reads the recalled code. The decision therefore moves with the option when the rotations
//!   reorder the options, and the combined answer is peaked, as a trained adapter's answers are
//!   (the issue asks for typical top probabilities of 0.6–0.95 with some near-ties) — and it rests
//!   on a large, coherent signal instead of a random projection of the hidden state, so rounding
//!   moves it little. Measured on the `mid` preset (seed 0, CPU, the 324 decisions of
//!   `bench/fidelity_fp8.py --config mid --text-requests 100 --image-requests 8`): median top
//!   probability 0.78, p10 0.42, p90 0.98, 8% near-ties (top two within 0.1); `noul` questions
//!   0.97 (their options' first words never change), `score` 0.75, `choice` 0.50; seed 1 (120
//!   decisions, `--text-requests 40 --image-requests 0`): median 0.74, p10 0.36. Single passes
//!   are less decided: each code gets a bias that does not depend on the options (seed 0: the
//!   second code +1.2 to +2.5 in logits; which code, and how much, changes with the seed), so all
//!   rotations of a question pick the same option in only 28% (seed 1: 11%) of the questions;
//!   combining the rotations cancels that bias where they cover every position.
//!   The readout's gain is [`READOUT_GAIN`].
//! * **LoRA**: B·A·(α/r) has a Frobenius norm of [`LORA_RATIO`] × the base weight's, the order the
//!   LoRA paper reports for trained adapters (Hu et al. 2021, Table 7: ‖ΔW_q‖_F = 6.91 vs
//!   ‖W_q‖_F = 61.95 for GPT-3 at r = 4), instead of an arbitrary scale.
//! * **Vision tower**: the same rules — residual branches by 1/√(2·depth), LayerNorm gains
//!   log-normal around 1, and two outlier channels in every patch's residual stream through the
//!   patch embedding's bias (Sun et al. 2024 find massive activations in ViTs too; Darcet et al.
//!   2023 high-norm tokens).
//!
//! What this module does not know: semantics. The "content" the decisions follow is the identity
//! of each option's first token, not its meaning; questions whose options always have the same
//! first words (`noul`: yes / no / unknown) get the same answer in every context, up to the small
//! context-dependent terms.

use super::rng::SplitMix;
use super::tensors::{generate_rows, Init, Spec};
use super::SynthDtype;
use crate::engine::config::{LayerKind, ModelConfig};
use crate::tokenizer::QwenTokenizer;
use anyhow::{Context, Result};
use std::sync::Arc;

/// How a synthetic checkpoint's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// Independent Gaussians scaled by fan-in (the tests' checkpoints).
    #[default]
    Random,
    /// The statistics of a trained model (see the module doc).
    TrainedLike,
}

/// Outlier channels per residual stream (LLM.int8(): ~6 at 6.7B).
pub const OUTLIER_CHANNELS: usize = 4;
/// Their magnitude in units of the typical entry (LLM.int8(): up to 20×).
pub const OUTLIER_SCALE: f32 = 20.0;
/// Massive-activation channels of the start/delimiter tokens (Sun et al.: a handful).
pub const MASSIVE_CHANNELS: usize = 2;
/// Their magnitude in units of the typical entry (Sun et al.: 10³–10⁴×).
pub const MASSIVE_SCALE: f32 = 1000.0;
/// Tokens whose embedding rows carry the massive activations: `<|im_start|>`, `<|endoftext|>`.
pub const MASSIVE_TOKENS: [u32; 2] = [248045, 248044];
/// σ of the log-normal norm gains.
pub const NORM_LOG_STD: f32 = 0.2;
/// Range of the DeltaNet Δt at initialisation (Mamba-2).
pub const DT_RANGE: (f32, f32) = (1e-3, 1e-1);
/// ‖B·A·α/r‖_F / ‖W‖_F of the trained-like LoRA.
pub const LORA_RATIO: f32 = 0.11;
/// Logit gain of the readout along the recalled code (what it gives: see the module doc).
pub const READOUT_GAIN: f32 = 14.0;
/// Codes bound by the decision circuit (`A`…`Z`, `AA`…`AF`: questions have at most 32 options).
pub const CIRCUIT_CODES: usize = 32;

/// A post-generation change of one tensor's values (the generator stays name-addressed; the
/// edit is a pure function of the checkpoint's seed and config, so it is deterministic too).
pub type Edit = Arc<dyn Fn(&mut [f32]) + Send + Sync>;

/// Log-normal gain `exp(N(0, σ²)) − shift`.
pub fn norm_init(zero_centred: bool) -> Init {
    Init::LogNormal { sigma: NORM_LOG_STD, shift: if zero_centred { 1.0 } else { 0.0 } }
}

/// `softplus⁻¹(dt)`, dt log-uniform in [`DT_RANGE`].
pub fn dt_bias_init() -> Init {
    Init::InvSoftplusLogUniform { lo: DT_RANGE.0, hi: DT_RANGE.1 }
}

/// Picks `n` distinct channels of `0..width` from a seeded generator.
fn channels(seed: u64, width: usize, n: usize) -> Vec<usize> {
    let mut rng = SplitMix::new(seed);
    let mut out: Vec<usize> = Vec::with_capacity(n);
    while out.len() < n.min(width) {
        let c = rng.below(width);
        if !out.contains(&c) {
            out.push(c);
        }
    }
    out
}

/// Where the outlier and massive channels sit, and their signed magnitudes.
#[derive(Debug, Clone)]
pub struct ResidualOutliers {
    pub hidden: usize,
    /// `(channel, value)` added to every embedding row.
    pub outliers: Vec<(usize, f32)>,
    /// `(channel, value)` added to the rows of [`MASSIVE_TOKENS`].
    pub massive: Vec<(usize, f32)>,
}

impl ResidualOutliers {
    pub fn new(hidden: usize, seed: u64) -> Self {
        let mut rng = SplitMix::new(seed ^ 0x0u64.wrapping_sub(0x6F75_746C));
        let mut sign = || if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        let chosen = channels(seed ^ 0x4F55_544C, hidden, OUTLIER_CHANNELS + MASSIVE_CHANNELS);
        let outliers = chosen[..OUTLIER_CHANNELS.min(chosen.len())]
            .iter()
            .map(|&c| (c, sign() * OUTLIER_SCALE))
            .collect();
        let massive = chosen[OUTLIER_CHANNELS.min(chosen.len())..]
            .iter()
            .map(|&c| (c, sign() * MASSIVE_SCALE))
            .collect();
        ResidualOutliers { hidden, outliers, massive }
    }

    /// Applies the channels to embedding row `token`.
    pub fn apply_row(&self, token: usize, row: &mut [f32]) {
        for &(c, v) in &self.outliers {
            row[c] += v;
        }
        if MASSIVE_TOKENS.contains(&(token as u32)) {
            for &(c, v) in &self.massive {
                row[c] += v;
            }
        }
    }

    /// The edit of the whole `[vocab, hidden]` embedding table.
    pub fn edit(self: &Arc<Self>) -> Edit {
        let me = self.clone();
        Arc::new(move |v: &mut [f32]| {
            for (t, row) in v.chunks_mut(me.hidden).enumerate() {
                me.apply_row(t, row);
            }
        })
    }
}

/// `v` as the checkpoint will store it (bf16-rounded unless F32), so values computed from
/// other tensors match what the engine will load.
fn stored(mut v: Vec<f32>, dtype: SynthDtype) -> Vec<f32> {
    if dtype != SynthDtype::F32 {
        v.iter_mut().for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
    }
    v
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `x / rms(x) · (1 + w)`, the zero-centred RMSNorm of Qwen3.5 (eps 1e-6).
fn zero_centred_norm(x: &[f32], w: &[f32]) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + 1e-6).sqrt();
    x.iter().zip(w).map(|(v, w)| (*v as f64 * r) as f32 * (1.0 + w)).collect()
}

/// Solves `A y = b` for a small symmetric positive-definite `A` (`n×n`, row-major) by Cholesky.
fn cholesky_solve(a: &[f64], n: usize, b: &[f64]) -> Vec<f64> {
    let mut l = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum();
            if i == j {
                l[i * n + i] = (a[i * n + i] - s).max(1e-12).sqrt();
            } else {
                l[i * n + j] = (a[i * n + j] - s) / l[j * n + j];
            }
        }
    }
    let mut y = vec![0f64; n];
    for i in 0..n {
        y[i] = (b[i] - (0..i).map(|k| l[i * n + k] * y[k]).sum::<f64>()) / l[i * n + i];
    }
    let mut x = vec![0f64; n];
    for i in (0..n).rev() {
        x[i] = (y[i] - (i + 1..n).map(|k| l[k * n + i] * x[k]).sum::<f64>()) / l[i * n + i];
    }
    x
}

/// The decision circuit of the trained-like profile, in layer 0's DeltaNet head 0 (value head 0,
/// key head 0) and the readout. Token t's value is recalled by the decision token in proportion
/// to how well t's key matches its query (the "goodness" of t):
///
/// * value channels: the short convolution adds the projections of tokens t−3, t−2 and t−1;
///   the projection maps code p to a pattern `P[p]` ∈ {−2a, 0} (half the channels each), `:` to
///   `+2a` everywhere and the option lines' punctuation to 0, so the first word after `X:` (or
///   after `X: ` when a space token comes between, as before a level number) carries
///   `silu(P[p] + 2a)`, a 0/~2a pattern unique to code p, and other tokens carry little or, for
///   the two tokens after that word, an all-on pattern that the readout (mean over codes
///   removed) does not see;
/// * write strength β = sigmoid(b): ≈ 3e-4 for the codes, `:` and the punctuation (they must not
///   overwrite the bound words), near ½ for content tokens;
/// * key channels: random projections of the current token (its "content") at [`KEY_SCALE`],
///   blind to the outlier channels every token shares, so keys of different tokens are
///   near-orthogonal;
/// * query channels, output gate `z`: fixed for the decision token (the chat template's last
///   token, `\n\n`), so the query is a zero-mean ±pattern and the gate is open (`silu(3)`) only
///   there;
/// * decay `exp(g) ≈ 0.997` per token;
/// * out_proj's head-0 columns write the recalled code into the residual stream with a norm of
///   [`CIRCUIT_RESIDUAL_SHARE`] of the decision token's embedding;
/// * readout row p (codes `< CIRCUIT_CODES`) reads the direction code p's pattern takes there.
pub struct DecisionCircuit {
    h: usize,
    dk: usize,
    dv: usize,
    key_dim: usize,
    /// Layer-0 rows of in_proj_qkv: query head 0 `[dk, h]`, value head 0 `[dv, h]`.
    q_rows: Vec<f32>,
    v_rows: Vec<f32>,
    /// in_proj_z rows of value head 0 `[dv, h]`.
    z_rows: Vec<f32>,
    /// in_proj_b row of value head 0 `[h]` (its write strength β).
    b_row: Vec<f32>,
    /// Residual channels the circuit's rows do not read (outlier and massive channels).
    common: Vec<usize>,
    /// out_proj columns of value head 0, `[h, dv]` row-major.
    out_cols: Vec<f32>,
    /// Readout rows of the bound codes `[codes, h]`.
    readout: Vec<f32>,
}

/// Norm of the recalled code in the residual stream, as a share of the decision token's
/// embedding norm. At 0.6 the combined decisions of the module doc's `mid` run had a median top
/// probability of 0.56 (p10 0.30); at 2.0, 0.78 (p10 0.42).
pub const CIRCUIT_RESIDUAL_SHARE: f32 = 2.0;
/// Magnitude `a` of the value patterns.
const VALUE_A: f32 = 3.0;
/// Open gate pre-activation.
const GATE_Z: f32 = 3.0;
/// Pre-activation of the write strength β for tokens that must not write (β ≈ 3e-4).
const QUIET_B: f32 = -8.0;
/// Scale of key head 0's projection (see the in_proj_qkv edit).
const KEY_SCALE: f32 = 0.25;
/// Punctuation of the option lines, whose tokens neither carry values nor write.
const PUNCTUATION: [&str; 6] = ["\n", "?\n", " ", " —", ".\n", "\n\n"];
/// Per-token decay of the circuit head (`exp(g)`), inside the Mamba-2 Δt range (Δt = 0.003).
const CIRCUIT_DT: f32 = 0.003;

impl DecisionCircuit {
    /// The circuit for `cfg` (None when layer 0 is not a DeltaNet layer or heads are tiny).
    pub fn build(cfg: &ModelConfig, dtype: SynthDtype, seed: u64, specs: &[Spec]) -> Result<Option<Self>> {
        let t = &cfg.text_config;
        if t.layer_kinds()?.first() != Some(&LayerKind::LinearAttention)
            || t.linear_key_head_dim < 8
            || t.linear_value_head_dim < 8
        {
            return Ok(None);
        }
        let (h, dk, dv) = (t.hidden_size, t.linear_key_head_dim, t.linear_value_head_dim);
        let tok = QwenTokenizer::builtin()?;
        let book = crate::decision::Codebook::derive(&tok, CIRCUIT_CODES).context("circuit codes")?;
        let codes: Vec<u32> = book.codes.iter().map(|c| c.token_id).collect();
        let colon = *tok.encode(":")?.first().context("':' token")?;
        let last = *tok.encode(crate::decision::codebook::EMPTY_PROMPT)?.last().context("last token")?;
        // The option lines' punctuation (`X: word — detail\n`, a question line ending `?\n`, the
        // space before a level number): they carry no value of their own and do not write.
        let single = |s: &str| -> Result<Option<u32>> {
            let ids = tok.encode(s)?;
            Ok((ids.len() == 1).then(|| ids[0]))
        };
        let mut quiet: Vec<u32> = Vec::new();
        for s in PUNCTUATION {
            if let Some(id) = single(s)? {
                if !quiet.contains(&id) && id != colon {
                    quiet.push(id);
                }
            }
        }
        let find =
            |name: &str| specs.iter().find(|s| s.name == name).with_context(|| format!("no spec {name}"));
        let p = "model.language_model.";
        // Layer-0 inputs of the tokens the circuit is built on (embedding with its edits, norm).
        let embed = find(&format!("{p}embed_tokens.weight"))?;
        let w_in =
            stored(generate_rows(find(&format!("{p}layers.0.input_layernorm.weight"))?, seed, &[0]), dtype);
        let mut tokens: Vec<u32> = codes.clone();
        tokens.push(colon);
        tokens.push(last);
        tokens.extend(&quiet);
        let rows: Vec<usize> = tokens.iter().map(|&t| t as usize).collect();
        let raw = generate_rows(embed, seed, &rows);
        let outl = ResidualOutliers::new(h, seed);
        let xs: Vec<Vec<f32>> = raw
            .chunks(h)
            .zip(&rows)
            .map(|(r, &tok)| {
                let mut r = r.to_vec();
                outl.apply_row(tok, &mut r);
                let mut x = zero_centred_norm(&stored(r, dtype), &w_in);
                // The circuit's rows read only the channels that differ between tokens: the
                // outlier channels are common to every token (most of a normed row's energy), so
                // rows that read them would give every token about the same value, β and gate.
                for &(c, _) in outl.outliers.iter().chain(&outl.massive) {
                    x[c] = 0.0;
                }
                x
            })
            .collect();
        let k = codes.len();
        let x_last = &xs[k + 1];
        let last_sq: f32 = x_last.iter().map(|v| v * v).sum();

        let mut rng = SplitMix::new(seed ^ 0x0043_4952_4355_4954);
        // Value targets: P[p] ∈ {−2a, 0} per channel for code p (half the channels each), +2a for
        // ':', 0 for the punctuation. A word one or two tokens after `X:` then carries
        // silu(P[p] + 2a) ∈ {0, ~2a}, code p's pattern; ':' itself (code one token back) carries
        // silu(P[p]) ≈ 0, so the colons, which share one key, store no code.
        let mut targets: Vec<Vec<f64>> = (0..k)
            .map(|_| {
                let mut on: Vec<bool> = (0..dv).map(|c| c % 2 == 0).collect();
                for i in (1..dv).rev() {
                    on.swap(i, rng.below(i + 1));
                }
                on.iter().map(|&o| if o { 0.0 } else { -2.0 * VALUE_A as f64 }).collect()
            })
            .collect();
        targets.push(vec![2.0 * VALUE_A as f64; dv]);
        // Minimum-norm rows W with W x_i = target_i for the constrained tokens (Gram system).
        let gram_of = |idx: &[usize]| {
            let m = idx.len();
            let mut g = vec![0f64; m * m];
            for i in 0..m {
                for j in 0..m {
                    g[i * m + j] =
                        xs[idx[i]].iter().zip(&xs[idx[j]]).map(|(a, b)| *a as f64 * *b as f64).sum();
                }
            }
            g
        };
        let solve_row = |gram: &[f64], idx: &[usize], rhs: &[f64], out: &mut [f32]| {
            let coef = cholesky_solve(gram, idx.len(), rhs);
            for (co, &i) in coef.iter().zip(idx) {
                for (o, x) in out.iter_mut().zip(&xs[i]) {
                    *o += (*co * *x as f64) as f32;
                }
            }
        };
        // Codes, ':' and the punctuation (not the decision token).
        let v_idx: Vec<usize> = (0..=k).chain(k + 2..xs.len()).collect();
        let v_gram = gram_of(&v_idx);
        let mut v_rows = vec![0f32; dv * h];
        for c in 0..dv {
            let rhs: Vec<f64> = v_idx.iter().map(|&i| if i <= k { targets[i][c] } else { 0.0 }).collect();
            solve_row(&v_gram, &v_idx, &rhs, &mut v_rows[c * h..(c + 1) * h]);
        }
        // Write strength: β = sigmoid(b) ≈ 0 (b = QUIET_B) for the codes, ':' and the punctuation,
        // so only content tokens write; others get b near 0 (β near ½).
        let mut b_row = vec![0f32; h];
        solve_row(&v_gram, &v_idx, &vec![QUIET_B as f64; v_idx.len()], &mut b_row);
        // Query: zero-mean ± pattern after silu (silu(0.4504) = +0.2785 = −silu(−1.2785)).
        let q_pre: Vec<f32> = (0..dk).map(|c| if c % 2 == 0 { 0.4504 } else { -1.2785 }).collect();
        let mut order: Vec<usize> = (0..dk).collect();
        for i in (1..dk).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let q_rows: Vec<f32> = (0..dk)
            .flat_map(|c| {
                let s = q_pre[order[c]] / last_sq;
                x_last.iter().map(move |x| x * s)
            })
            .collect();
        let z_rows: Vec<f32> = (0..dv).flat_map(|_| x_last.iter().map(|x| x * GATE_Z / last_sq)).collect();
        // out_proj columns: random directions, scaled so the recalled code's norm is a share of
        // the decision token's embedding norm.
        let gn =
            stored(generate_rows(find(&format!("{p}layers.0.linear_attn.norm.weight"))?, seed, &[0]), dtype);
        let gn_rms = (gn.iter().map(|v| v * v).sum::<f32>() / dv as f32).sqrt();
        let e_last_norm = {
            let mut r = raw[(k + 1) * h..(k + 2) * h].to_vec();
            outl.apply_row(last as usize, &mut r);
            r.iter().map(|v| v * v).sum::<f32>().sqrt()
        };
        let rho = CIRCUIT_RESIDUAL_SHARE * e_last_norm / (silu(GATE_Z) * (dv as f32).sqrt() * gn_rms);
        let std = rho / (h as f32).sqrt();
        let out_cols: Vec<f32> = (0..h * dv).map(|_| rng.gaussian() * std).collect();
        // Readout: code p's recalled pattern (mean over codes removed), through the gate, the
        // gated norm's gain and out_proj, divided by the final norm's gain.
        let pats: Vec<Vec<f32>> = targets[..k]
            .iter()
            .map(|t| t.iter().map(|v| silu(*v as f32 + 2.0 * VALUE_A)).collect())
            .collect();
        let mean: Vec<f32> = (0..dv).map(|c| pats.iter().map(|p| p[c]).sum::<f32>() / k as f32).collect();
        let wf = stored(generate_rows(find(&format!("{p}norm.weight"))?, seed, &[0]), dtype);
        let mut readout = vec![0f32; k * h];
        for (pi, pat) in pats.iter().enumerate() {
            let u: Vec<f32> = (0..dv).map(|c| (pat[c] - mean[c]) * gn[c]).collect();
            let row = &mut readout[pi * h..(pi + 1) * h];
            for (r, o) in row.iter_mut().enumerate() {
                *o = (0..dv).map(|c| out_cols[r * dv + c] * u[c]).sum::<f32>();
            }
            // A trained readout ignores the channels that are the same in every context (outlier
            // and massive channels): reading them would add a fixed bias per code.
            for &(c, _) in outl.outliers.iter().chain(&outl.massive) {
                row[c] = 0.0;
            }
            let n = row.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
            for (r, o) in row.iter_mut().enumerate() {
                *o = READOUT_GAIN * *o / n / (h as f32).sqrt() / (1.0 + wf[r]).max(0.25);
            }
        }
        Ok(Some(DecisionCircuit {
            h,
            dk,
            dv,
            key_dim: t.key_dim(),
            q_rows,
            v_rows,
            z_rows,
            b_row,
            common: outl.outliers.iter().chain(&outl.massive).map(|&(c, _)| c).collect(),
            out_cols,
            readout,
        }))
    }

    /// Edits of layer 0's DeltaNet tensors, by tensor name suffix.
    pub fn edit_for(self: &Arc<Self>, name: &str) -> Option<Edit> {
        let me = self.clone();
        let l0 = "model.language_model.layers.0.linear_attn.";
        let suffix = name.strip_prefix(l0)?;
        let (h, dk, dv, kd) = (self.h, self.dk, self.dv, self.key_dim);
        let common = self.common.clone();
        let blend = move |dst: &mut [f32], src: &[f32]| {
            // Engineered rows plus a tenth of the random rows (trained heads are not exact),
            // blind to the channels every token shares (see `build`).
            dst.iter_mut().zip(src).for_each(|(d, s)| *d = s + 0.1 * *d);
            for row in dst.chunks_mut(h) {
                common.iter().for_each(|&c| row[c] = 0.0);
            }
        };
        Some(match suffix {
            "in_proj_qkv.weight" => Arc::new(move |v: &mut [f32]| {
                blend(&mut v[..dk * h], &me.q_rows);
                // Key head 0 at KEY_SCALE: silu then stays near-linear, so keys of different
                // tokens are near-orthogonal (silu's positive mean would correlate them).
                let keys = &mut v[kd * h..(kd + dk) * h];
                keys.iter_mut().for_each(|x| *x *= KEY_SCALE);
                for row in keys.chunks_mut(h) {
                    me.common.iter().for_each(|&c| row[c] = 0.0);
                }
                blend(&mut v[2 * kd * h..(2 * kd + dv) * h], &me.v_rows);
            }),
            "in_proj_z.weight" => Arc::new(move |v: &mut [f32]| blend(&mut v[..dv * h], &me.z_rows)),
            "in_proj_b.weight" => Arc::new(move |v: &mut [f32]| blend(&mut v[..h], &me.b_row)),
            "in_proj_a.weight" => Arc::new(move |v: &mut [f32]| v[..h].iter_mut().for_each(|x| *x *= 0.1)),
            "A_log" => Arc::new(|v: &mut [f32]| v[0] = 0.0),
            "dt_bias" => Arc::new(|v: &mut [f32]| v[0] = (CIRCUIT_DT.exp() - 1.0).ln()),
            "conv1d.weight" => Arc::new(move |v: &mut [f32]| {
                // [conv_dim, 1, 4]: tap j multiplies the token 3 − j steps back.
                let set = |v: &mut [f32], ch: usize, w: [f32; 4]| v[ch * 4..ch * 4 + 4].copy_from_slice(&w);
                for c in 0..dk {
                    set(v, c, [0.0, 0.0, 0.0, 1.0]);
                    set(v, kd + c, [0.0, 0.0, 0.0, 1.0]);
                }
                for c in 0..dv {
                    set(v, 2 * kd + c, [1.0, 1.0, 1.0, 0.0]);
                }
            }),
            "out_proj.weight" => Arc::new(move |v: &mut [f32]| {
                // [h, value_dim]: columns 0..dv are value head 0.
                let vd = v.len() / h;
                for r in 0..h {
                    v[r * vd..r * vd + dv].copy_from_slice(&me.out_cols[r * dv..(r + 1) * dv]);
                }
            }),
            _ => return None,
        })
    }

    /// Readout rows of the bound codes, `[CIRCUIT_CODES, hidden]`.
    pub fn readout_rows(&self) -> &[f32] {
        &self.readout
    }
}
