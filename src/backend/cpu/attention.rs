//! Softmax attention in f32: rotary, the decoder's gated attention over KV caches that fork by
//! sharing an immutable prefix, and the vision tower's bidirectional attention. CPU twins of
//! kernels/attention.cu (src/backend/cuda/attention.rs).

use super::elementwise::sigmoid;
use super::norm::rms_norm;
use super::{CpuBackend, CpuTensor};
use crate::backend::{check_parents, AttentionDims, AttentionInputs, Backend};
use anyhow::{ensure, Result};
use rayon::prelude::*;
use std::ops::Range;

/// Keys and values of one attention layer: an immutable shared prefix (cheap to fork) followed by
/// this sequence's own rows.
#[derive(Clone, Default)]
pub struct CpuKvCache {
    shared: std::sync::Arc<(Vec<f32>, Vec<f32>)>,
    shared_len: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

impl CpuKvCache {
    /// Rows in the cache: the shared prefix and the own rows.
    pub fn len(&self) -> usize {
        self.shared_len + self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// NeoX rotate-half rotary on the first `cos.len()` dims of `x` (one head, in place).
#[inline]
pub fn rotate_half_inplace(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let rot = cos.len();
    let half = rot / 2;
    for i in 0..half {
        let a = x[i];
        let b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/// The first `visible` rows of key/value `parts` (row width `w`) as `(first row, rows, part)`,
/// skipping empty parts.
fn visible_parts<'a>(
    parts: &'a [&'a [f32]],
    w: usize,
    visible: usize,
) -> impl Iterator<Item = (usize, usize, &'a [f32])> {
    parts
        .iter()
        .scan(0usize, move |col, part| {
            let start = *col;
            let n = (part.len() / w).min(visible.saturating_sub(start));
            *col += n;
            Some((start, n, *part))
        })
        .take_while(move |&(start, _, _)| start < visible)
        .filter(|&(_, n, _)| n > 0)
}

/// Softmax attention of `q` rows over keys/values stored in one or more consecutive parts
/// (a shared prefix cache, then a sequence's own rows).
///
/// `q`: `[nq, heads, hd]`; each part of `k`, `v`: `[rows, kv_heads, hd]`, `nk` rows in all; query
/// `t` sees keys `0..=nk − nq + t` when `causal`, all keys otherwise. Output `[nq, heads, hd]`.
///
/// Per head and block of queries: scores `Q·Kᵀ` and `P·V` through the `gemm` crate (strided
/// views, no copies), softmax in f32 between them; heads run in parallel, each with a fixed
/// reduction order, so results do not depend on the thread count.
#[allow(clippy::too_many_arguments)]
pub fn attention_parts(
    q: &[f32],
    k: &[&[f32]],
    v: &[&[f32]],
    nq: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    causal: bool,
) -> Vec<f32> {
    const BLOCK: usize = 128;
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let w = kv_heads * hd;
    let nk: usize = k.iter().map(|p| p.len() / w).sum();
    let offset = nk - nq;
    let qs = heads * hd;
    // Per head: [nq, hd] results, later interleaved into [nq, heads, hd].
    let per_head: Vec<Vec<f32>> = (0..heads)
        .into_par_iter()
        .map(|h| {
            let kvh = h / group;
            let mut o = vec![0f32; nq * hd];
            let mut scores = Vec::new();
            for t0 in (0..nq).step_by(BLOCK) {
                let rows = BLOCK.min(nq - t0);
                // Keys any row of this block may see.
                let visible = if causal { offset + t0 + rows } else { nk };
                scores.clear();
                scores.resize(rows * visible, 0f32);
                for (col, n, part) in visible_parts(k, w, visible) {
                    // SAFETY: q rows t0..t0+rows of head h (stride heads·hd), the part's first n
                    // rows of kv head kvh (stride w), and columns col..col+n of `scores`
                    // (stride visible) are all in bounds.
                    unsafe {
                        gemm::gemm(
                            rows,
                            n,
                            hd,
                            scores.as_mut_ptr().add(col),
                            1,
                            visible as isize,
                            false,
                            q.as_ptr().add(t0 * qs + h * hd),
                            1,
                            qs as isize,
                            part.as_ptr().add(kvh * hd),
                            w as isize,
                            1,
                            0.0,
                            scale,
                            false,
                            false,
                            false,
                            gemm::Parallelism::None,
                        );
                    }
                }
                for r in 0..rows {
                    let row = &mut scores[r * visible..(r + 1) * visible];
                    let lim = if causal { offset + t0 + r + 1 } else { nk };
                    let mut max = f32::NEG_INFINITY;
                    for x in &row[..lim] {
                        max = max.max(*x);
                    }
                    let mut denom = 0f32;
                    for x in row[..lim].iter_mut() {
                        *x = (*x - max).exp();
                        denom += *x;
                    }
                    for x in row[..lim].iter_mut() {
                        *x /= denom;
                    }
                    row[lim..].fill(0.0);
                }
                for (col, n, part) in visible_parts(v, w, visible) {
                    // SAFETY: as above; the output block is rows t0..t0+rows of `o`.
                    unsafe {
                        gemm::gemm(
                            rows,
                            hd,
                            n,
                            o.as_mut_ptr().add(t0 * hd),
                            1,
                            hd as isize,
                            col > 0,
                            scores.as_ptr().add(col),
                            1,
                            visible as isize,
                            part.as_ptr().add(kvh * hd),
                            1,
                            w as isize,
                            1.0,
                            1.0,
                            false,
                            false,
                            false,
                            gemm::Parallelism::None,
                        );
                    }
                }
            }
            o
        })
        .collect();
    let mut out = vec![0f32; nq * heads * hd];
    for (h, o) in per_head.iter().enumerate() {
        for t in 0..nq {
            out[(t * heads + h) * hd..(t * heads + h + 1) * hd].copy_from_slice(&o[t * hd..(t + 1) * hd]);
        }
    }
    out
}

/// [`attention_parts`] over a single contiguous key/value buffer of `nk` rows.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    nq: usize,
    nk: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    causal: bool,
) -> Vec<f32> {
    debug_assert_eq!(k.len(), nk * kv_heads * hd);
    attention_parts(q, &[k], &[v], nq, heads, kv_heads, hd, causal)
}

/// `Backend::share_kv` (the trait documents the contract).
pub(super) fn share_kv(cache: &mut CpuKvCache) -> Result<()> {
    if cache.len == 0 {
        return Ok(());
    }
    let (mut k, mut v) = (cache.shared.0.clone(), cache.shared.1.clone());
    k.append(&mut cache.k);
    v.append(&mut cache.v);
    cache.shared = std::sync::Arc::new((k, v));
    cache.shared_len += cache.len;
    cache.len = 0;
    Ok(())
}

/// `Backend::gated_attention` (the trait documents the contract).
pub(super) fn gated_attention(
    be: &CpuBackend,
    x: &AttentionInputs<CpuTensor>,
    dims: &AttentionDims,
    segments: &[Range<usize>],
    parents: &[Option<usize>],
    caches: &mut [&mut CpuKvCache],
) -> Result<CpuTensor> {
    let AttentionDims { heads, kv_heads, head_dim: hd, rotary_dim: rot, norm_eps } = *dims;
    ensure!(segments.len() == caches.len(), "one cache per segment");
    let tree = check_parents(parents, segments.len())?;
    let (n, width) = x.qkv.rows_cols();
    ensure!(width == dims.qkv_width(), "attention input width {width} != {}", dims.qkv_width());
    let qgw = heads * 2 * hd;
    let parts = be.split_cols(x.qkv, &[qgw, kv_heads * hd, kv_heads * hd])?;
    let (query_gate, key, value) = (&parts[0], &parts[1], &parts[2]);
    ensure!(x.cos.rows_cols() == (n, rot) && x.sin.rows_cols() == (n, rot), "rotary table shapes");
    // Split query and gate (per head: [query | gate]).
    let mut q = vec![0f32; n * heads * hd];
    let mut gate = vec![0f32; n * heads * hd];
    for t in 0..n {
        for h in 0..heads {
            let src = &query_gate.data[t * qgw + h * 2 * hd..t * qgw + (h + 1) * 2 * hd];
            q[(t * heads + h) * hd..(t * heads + h + 1) * hd].copy_from_slice(&src[..hd]);
            gate[(t * heads + h) * hd..(t * heads + h + 1) * hd].copy_from_slice(&src[hd..]);
        }
    }
    let mut q = rms_norm(&q, &x.q_norm.data, norm_eps, 1.0);
    let mut k = rms_norm(&key.data, &x.k_norm.data, norm_eps, 1.0);
    for t in 0..n {
        let cos = &x.cos.data[t * rot..(t + 1) * rot];
        let sin = &x.sin.data[t * rot..(t + 1) * rot];
        for h in 0..heads {
            rotate_half_inplace(&mut q[(t * heads + h) * hd..(t * heads + h + 1) * hd], cos, sin);
        }
        for h in 0..kv_heads {
            rotate_half_inplace(&mut k[(t * kv_heads + h) * hd..(t * kv_heads + h + 1) * hd], cos, sin);
        }
    }
    let mut out = vec![0f32; n * heads * hd];
    for (si, seg) in segments.iter().enumerate() {
        if let Some(p) = tree.parent[si] {
            // The parent's rows are in (it comes first): fork its cache.
            share_kv(caches[p])?;
            *caches[si] = caches[p].clone();
        }
        let cache = &mut *caches[si];
        let w = kv_heads * hd;
        cache.k.extend_from_slice(&k[seg.start * w..seg.end * w]);
        cache.v.extend_from_slice(&value.data[seg.start * w..seg.end * w]);
        cache.len += seg.len();
        let qs = &q[seg.start * heads * hd..seg.end * heads * hd];
        let (sk, sv) = (&cache.shared.0[..], &cache.shared.1[..]);
        let o = attention_parts(qs, &[sk, &cache.k], &[sv, &cache.v], seg.len(), heads, kv_heads, hd, true);
        out[seg.start * heads * hd..seg.end * heads * hd].copy_from_slice(&o);
    }
    out.iter_mut().zip(&gate).for_each(|(o, &g)| *o *= sigmoid(g));
    CpuTensor::new(out, &[n, heads * hd])
}

/// `Backend::vision_attention` (the trait documents the contract).
pub(super) fn vision_attention(
    qkv: &CpuTensor,
    cos: &CpuTensor,
    sin: &CpuTensor,
    heads: usize,
    segments: &[Range<usize>],
) -> Result<CpuTensor> {
    let (n, w) = qkv.rows_cols();
    ensure!(w % (3 * heads) == 0, "vision qkv width {w} is not 3·heads·head_dim");
    let hd = w / (3 * heads);
    let d = heads * hd;
    ensure!(cos.rows_cols() == (n, hd) && sin.rows_cols() == (n, hd), "vision rotary shapes");
    let mut q = vec![0f32; n * d];
    let mut k = vec![0f32; n * d];
    let mut v = vec![0f32; n * d];
    for t in 0..n {
        let row = &qkv.data[t * w..(t + 1) * w];
        q[t * d..(t + 1) * d].copy_from_slice(&row[..d]);
        k[t * d..(t + 1) * d].copy_from_slice(&row[d..2 * d]);
        v[t * d..(t + 1) * d].copy_from_slice(&row[2 * d..]);
        let c = &cos.data[t * hd..(t + 1) * hd];
        let s = &sin.data[t * hd..(t + 1) * hd];
        for h in 0..heads {
            rotate_half_inplace(&mut q[t * d + h * hd..t * d + (h + 1) * hd], c, s);
            rotate_half_inplace(&mut k[t * d + h * hd..t * d + (h + 1) * hd], c, s);
        }
    }
    let mut out = vec![0f32; n * d];
    for seg in segments {
        let r = seg.start * d..seg.end * d;
        let o = attention(
            &q[r.clone()],
            &k[r.clone()],
            &v[r.clone()],
            seg.len(),
            seg.len(),
            heads,
            heads,
            hd,
            false,
        );
        out[r].copy_from_slice(&o);
    }
    CpuTensor::new(out, &[n, d])
}
