//! Gated DeltaNet in f32: causal conv + SiLU, L2 norms, the gated delta rule in its recurrent
//! form and its chunked (prefill) form, which must agree. CPU twins of kernels/deltanet.cu
//! (src/backend/cuda/deltanet.rs).

use super::elementwise::{sigmoid, silu, softplus};
use super::norm::rms_norm_gated;
use super::{CpuBackend, CpuTensor, DeltaRuleMode};
use crate::backend::{check_parents, kept_states, Backend, DeltaNetDims, DeltaNetInputs};
use anyhow::{ensure, Result};
use rayon::prelude::*;
use std::ops::Range;

#[derive(Clone)]
pub struct CpuDeltaState {
    /// `[kernel−1, channels]` previous conv inputs, oldest first.
    conv: Vec<f32>,
    /// `[value_heads, key_dim, value_dim]`.
    recurrent: Vec<f32>,
}

impl CpuDeltaState {
    /// Zero conv history and recurrent state for a layer of shape `dims`.
    pub fn new(dims: &DeltaNetDims) -> Self {
        CpuDeltaState {
            conv: vec![0.0; (dims.conv_kernel - 1) * dims.conv_channels()],
            recurrent: vec![0.0; dims.value_heads * dims.key_dim * dims.value_dim],
        }
    }
    pub fn recurrent(&self) -> &[f32] {
        &self.recurrent
    }
}

/// Causal depthwise conv over time + SiLU for one sequence.
///
/// `x`: `[n, c]` new inputs; `hist`: `[kernel−1, c]` previous inputs (oldest first), updated to
/// the last `kernel−1` inputs; `w`: `[c, kernel]` with tap `kernel−1` on the current token.
pub fn causal_conv_silu(
    x: &[f32],
    n: usize,
    c: usize,
    hist: &mut [f32],
    w: &[f32],
    kernel: usize,
) -> Vec<f32> {
    let h = kernel - 1;
    assert_eq!(hist.len(), h * c);
    let at = |i: isize, ch: usize| -> f32 {
        if i >= 0 {
            x[i as usize * c + ch]
        } else {
            hist[(h as isize + i) as usize * c + ch]
        }
    };
    let mut y = vec![0f32; n * c];
    y.par_chunks_mut(c).enumerate().for_each(|(t, yr)| {
        for (ch, o) in yr.iter_mut().enumerate() {
            let mut s = 0f32;
            for j in 0..kernel {
                s += w[ch * kernel + j] * at(t as isize + j as isize - h as isize, ch);
            }
            *o = silu(s);
        }
    });
    // New history: the last h rows of [hist; x].
    let mut new_hist = vec![0f32; h * c];
    for r in 0..h {
        let src = n as isize - h as isize + r as isize;
        for ch in 0..c {
            new_hist[r * c + ch] = at(src, ch);
        }
    }
    hist.copy_from_slice(&new_hist);
    y
}

/// `x · rsqrt(Σx² + eps)` per row of length `d`, in place.
pub fn l2_normalize_rows(x: &mut [f32], d: usize, eps: f32) {
    x.par_chunks_mut(d).for_each(|r| {
        let s = r.iter().map(|v| v * v).sum::<f32>();
        let inv = 1.0 / (s + eps).sqrt();
        r.iter_mut().for_each(|v| *v *= inv);
    });
}

/// Inputs of the gated delta rule for one sequence, already L2-normalised (q also scaled by
/// `1/√dk`), with each value head's q/k rows resolved (`q`, `k`: `[n, vh, dk]`).
pub struct DeltaRuleInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    /// `[n, vh, dv]`
    pub v: &'a [f32],
    /// `[n, vh]` log decay (≤ 0) and β.
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub n: usize,
    pub heads: usize,
    pub dk: usize,
    pub dv: usize,
}

/// The gated delta rule token by token (the definition). `state`: `[vh, dk, dv]`, updated.
/// Returns `[n, vh, dv]`.
pub fn delta_rule_recurrent(x: &DeltaRuleInputs, state: &mut [f32]) -> Vec<f32> {
    let (n, heads, dk, dv) = (x.n, x.heads, x.dk, x.dv);
    let mut out = vec![0f32; n * heads * dv];
    let mut per_head: Vec<Vec<f32>> = state.chunks(dk * dv).map(|s| s.to_vec()).collect();
    let outs: Vec<Vec<f32>> = per_head
        .par_iter_mut()
        .enumerate()
        .map(|(h, s)| {
            let mut o = vec![0f32; n * dv];
            let mut m = vec![0f32; dv];
            for t in 0..n {
                let q = &x.q[(t * heads + h) * dk..(t * heads + h + 1) * dk];
                let k = &x.k[(t * heads + h) * dk..(t * heads + h + 1) * dk];
                let v = &x.v[(t * heads + h) * dv..(t * heads + h + 1) * dv];
                let decay = x.g[t * heads + h].exp();
                let beta = x.beta[t * heads + h];
                s.iter_mut().for_each(|e| *e *= decay);
                m.fill(0.0);
                for a in 0..dk {
                    let ka = k[a];
                    for (mm, &sv) in m.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                        *mm += sv * ka;
                    }
                }
                for a in 0..dk {
                    let ka = k[a];
                    for ((sv, &vv), &mm) in s[a * dv..(a + 1) * dv].iter_mut().zip(v).zip(&m) {
                        *sv += ka * (vv - mm) * beta;
                    }
                }
                let orow = &mut o[t * dv..(t + 1) * dv];
                for a in 0..dk {
                    let qa = q[a];
                    for (oo, &sv) in orow.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                        *oo += sv * qa;
                    }
                }
            }
            o
        })
        .collect();
    for (h, o) in outs.iter().enumerate() {
        for t in 0..n {
            out[(t * heads + h) * dv..(t * heads + h + 1) * dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
        }
    }
    for (dst, s) in state.chunks_mut(dk * dv).zip(&per_head) {
        dst.copy_from_slice(s);
    }
    out
}

/// The gated delta rule in chunks of `chunk` tokens (the WY/UT form transformers and FLA use for
/// prefill); mathematically identical to [`delta_rule_recurrent`].
pub fn delta_rule_chunked(x: &DeltaRuleInputs, state: &mut [f32], chunk: usize) -> Vec<f32> {
    let (n, heads, dk, dv) = (x.n, x.heads, x.dk, x.dv);
    let mut out = vec![0f32; n * heads * dv];
    let mut per_head: Vec<Vec<f32>> = state.chunks(dk * dv).map(|s| s.to_vec()).collect();
    let outs: Vec<Vec<f32>> = per_head
        .par_iter_mut()
        .enumerate()
        .map(|(h, s)| {
            let mut o = vec![0f32; n * dv];
            let row = |t: usize, d: usize| (t * heads + h) * d..(t * heads + h + 1) * d;
            let mut start = 0;
            while start < n {
                let c = chunk.min(n - start);
                // Cumulative log decay inside the chunk.
                let mut gam = vec![0f32; c];
                let mut acc = 0f32;
                for (i, gi) in gam.iter_mut().enumerate() {
                    acc += x.g[(start + i) * heads + h];
                    *gi = acc;
                }
                let beta: Vec<f32> = (0..c).map(|i| x.beta[(start + i) * heads + h]).collect();
                let kk = |i: usize| &x.k[row(start + i, dk)];
                let qq = |i: usize| &x.q[row(start + i, dk)];
                let vv = |i: usize| &x.v[row(start + i, dv)];
                let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
                // A[i][j] = β_i (k_i·k_j) e^{γ_i−γ_j}, j < i.
                let mut a_mat = vec![0f32; c * c];
                for i in 0..c {
                    for j in 0..i {
                        a_mat[i * c + j] = beta[i] * dot(kk(i), kk(j)) * (gam[i] - gam[j]).exp();
                    }
                }
                // (I + A) U = diag(β) V ;  (I + A) W = diag(β e^{γ}) K  — forward substitution.
                let mut u = vec![0f32; c * dv];
                let mut w = vec![0f32; c * dk];
                for i in 0..c {
                    let (done, rest) = u.split_at_mut(i * dv);
                    let ui = &mut rest[..dv];
                    for (o, &v) in ui.iter_mut().zip(vv(i)) {
                        *o = beta[i] * v;
                    }
                    let (wdone, wrest) = w.split_at_mut(i * dk);
                    let wi = &mut wrest[..dk];
                    let eg = gam[i].exp();
                    for (o, &k) in wi.iter_mut().zip(kk(i)) {
                        *o = beta[i] * eg * k;
                    }
                    for j in 0..i {
                        let aij = a_mat[i * c + j];
                        if aij != 0.0 {
                            for (o, &p) in ui.iter_mut().zip(&done[j * dv..(j + 1) * dv]) {
                                *o -= aij * p;
                            }
                            for (o, &p) in wi.iter_mut().zip(&wdone[j * dk..(j + 1) * dk]) {
                                *o -= aij * p;
                            }
                        }
                    }
                }
                // V_new = U − W·S
                let mut vnew = u;
                for i in 0..c {
                    let vi = &mut vnew[i * dv..(i + 1) * dv];
                    for a in 0..dk {
                        let wa = w[i * dk + a];
                        for (o, &sv) in vi.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                            *o -= wa * sv;
                        }
                    }
                }
                // O_i = e^{γ_i} q_i·S + Σ_{j≤i} (q_i·k_j) e^{γ_i−γ_j} V_new_j
                for i in 0..c {
                    let orow = &mut o[(start + i) * dv..(start + i + 1) * dv];
                    let q = qq(i);
                    let eg = gam[i].exp();
                    for a in 0..dk {
                        let qa = q[a] * eg;
                        for (oo, &sv) in orow.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                            *oo += qa * sv;
                        }
                    }
                    for j in 0..=i {
                        let p = dot(q, kk(j)) * (gam[i] - gam[j]).exp();
                        for (oo, &vn) in orow.iter_mut().zip(&vnew[j * dv..(j + 1) * dv]) {
                            *oo += p * vn;
                        }
                    }
                }
                // S ← e^{γ_last} S + Σ_i e^{γ_last−γ_i} k_i ⊗ V_new_i
                let last = gam[c - 1];
                let el = last.exp();
                s.iter_mut().for_each(|e| *e *= el);
                for i in 0..c {
                    let f = (last - gam[i]).exp();
                    let k = kk(i);
                    let vi = &vnew[i * dv..(i + 1) * dv];
                    for a in 0..dk {
                        let ka = k[a] * f;
                        for (sv, &vn) in s[a * dv..(a + 1) * dv].iter_mut().zip(vi) {
                            *sv += ka * vn;
                        }
                    }
                }
                start += c;
            }
            o
        })
        .collect();
    for (h, o) in outs.iter().enumerate() {
        for t in 0..n {
            out[(t * heads + h) * dv..(t * heads + h + 1) * dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
        }
    }
    for (dst, s) in state.chunks_mut(dk * dv).zip(&per_head) {
        dst.copy_from_slice(s);
    }
    out
}

/// `Backend::gated_delta_net` (the trait documents the contract).
pub(super) fn gated_delta_net(
    be: &CpuBackend,
    x: &DeltaNetInputs<CpuTensor>,
    dims: &DeltaNetDims,
    segments: &[Range<usize>],
    parents: &[Option<usize>],
    states: &mut [&mut CpuDeltaState],
    keep: &[bool],
) -> Result<CpuTensor> {
    let DeltaNetDims { key_heads: kh, value_heads: vh, key_dim: dk, value_dim: dv, conv_kernel, norm_eps } =
        *dims;
    let c = dims.conv_channels();
    ensure!(segments.len() == states.len(), "one state per segment");
    let tree = check_parents(parents, segments.len())?;
    let keep = kept_states(keep, &tree)?;
    let (n, w) = x.proj.rows_cols();
    ensure!(w == dims.proj_width(), "DeltaNet input width {w} != {}", dims.proj_width());
    let parts = be.split_cols(x.proj, &[c, vh * dv, vh, vh])?;
    let (qkv, z, b, a) = (&parts[0], &parts[1], &parts[2], &parts[3]);
    ensure!(x.conv_weight.data.len() == c * conv_kernel, "conv weight shape");
    let rep = vh / kh;
    let a_log = &x.a_log.data;
    let dt_bias = &x.dt_bias.data;
    let mut core = vec![0f32; n * vh * dv];
    for (si, seg) in segments.iter().enumerate() {
        // A state not kept runs on a scratch copy and is left as it was (unusable by contract).
        let mut scratch;
        let st: &mut CpuDeltaState = match (tree.parent[si], keep[si]) {
            (Some(p), true) => {
                // The parent's rows are in (it comes first): continue from its state.
                *states[si] = states[p].clone();
                &mut *states[si]
            }
            (None, true) => &mut *states[si],
            (from, false) => {
                scratch = states[from.unwrap_or(si)].clone();
                &mut scratch
            }
        };
        let len = seg.len();
        if len == 0 {
            continue;
        }
        let mixed = causal_conv_silu(
            &qkv.data[seg.start * c..seg.end * c],
            len,
            c,
            &mut st.conv,
            &x.conv_weight.data,
            conv_kernel,
        );
        // Split [q | k | v], L2-normalise q and k per key head, scale q, expand key heads to
        // value heads (value head j reads key head j / rep).
        let kd = kh * dk;
        let mut qn = vec![0f32; len * kd];
        let mut kn = vec![0f32; len * kd];
        let mut v = vec![0f32; len * vh * dv];
        for t in 0..len {
            let row = &mixed[t * c..(t + 1) * c];
            qn[t * kd..(t + 1) * kd].copy_from_slice(&row[..kd]);
            kn[t * kd..(t + 1) * kd].copy_from_slice(&row[kd..2 * kd]);
            v[t * vh * dv..(t + 1) * vh * dv].copy_from_slice(&row[2 * kd..]);
        }
        l2_normalize_rows(&mut qn, dk, 1e-6);
        l2_normalize_rows(&mut kn, dk, 1e-6);
        let scale = 1.0 / (dk as f32).sqrt();
        qn.iter_mut().for_each(|e| *e *= scale);
        let mut q = vec![0f32; len * vh * dk];
        let mut k = vec![0f32; len * vh * dk];
        for t in 0..len {
            for j in 0..vh {
                let src = (t * kh + j / rep) * dk;
                q[(t * vh + j) * dk..(t * vh + j + 1) * dk].copy_from_slice(&qn[src..src + dk]);
                k[(t * vh + j) * dk..(t * vh + j + 1) * dk].copy_from_slice(&kn[src..src + dk]);
            }
        }
        let mut g = vec![0f32; len * vh];
        let mut beta = vec![0f32; len * vh];
        for t in 0..len {
            for j in 0..vh {
                let r = (seg.start + t) * vh + j;
                beta[t * vh + j] = sigmoid(b.data[r]);
                g[t * vh + j] = -a_log[j].exp() * softplus(a.data[r] + dt_bias[j]);
            }
        }
        let inputs = DeltaRuleInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta, n: len, heads: vh, dk, dv };
        let o = match be.delta_rule {
            DeltaRuleMode::Chunked(cs) => delta_rule_chunked(&inputs, &mut st.recurrent, cs.max(1)),
            DeltaRuleMode::Recurrent => delta_rule_recurrent(&inputs, &mut st.recurrent),
        };
        core[seg.start * vh * dv..seg.end * vh * dv].copy_from_slice(&o);
    }
    let y = rms_norm_gated(&core, &z.data, &x.norm_weight.data, norm_eps);
    CpuTensor::new(y, &[n, vh * dv])
}
