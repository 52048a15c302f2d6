//! The f32 reference kernels. Each is the CPU twin of a CUDA kernel and is written for clarity:
//! plain loops in the order the math is stated, f32 throughout (as a float32 transformers run),
//! parallel over independent rows or heads only, so results never depend on thread count.

use rayon::prelude::*;

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` (+ `y` when `accumulate`), via the `gemm` crate.
pub fn matmul_xwt(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32], accumulate: bool) {
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), n * k);
    assert_eq!(y.len(), m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            y.fill(0.0);
        }
        return;
    }
    let threads = rayon::current_num_threads();
    let par = if m * n * k >= 1 << 16 && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the slices are exactly m·k, n·k and m·n long (asserted above) and the strides
    // below address x row-major, wᵀ through w row-major, and y row-major within those bounds.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// PyTorch's `softplus` (β = 1, threshold 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[inline]
pub fn gelu(x: f32, tanh: bool) -> f32 {
    if tanh {
        let c = (2.0f32 / std::f32::consts::PI).sqrt();
        0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
    } else {
        0.5 * x * (1.0 + libm::erff(x / std::f32::consts::SQRT_2))
    }
}

/// RMSNorm over rows of length `w.len()`: `x · rsqrt(mean(x²) + eps) · (offset + w)`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, offset: f32) -> Vec<f32> {
    let d = w.len();
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(d.max(1)).zip(x.par_chunks(d.max(1))).for_each(|(yr, xr)| {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
            *o = v * r * (offset + g);
        }
    });
    y
}

/// LayerNorm with bias over rows of length `w.len()` (biased variance, as `nn.LayerNorm`).
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(yr, xr)| {
        let mean = xr.iter().sum::<f32>() / d as f32;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let r = 1.0 / (var + eps).sqrt();
        for i in 0..d {
            yr[i] = (xr[i] - mean) * r * w[i] + b[i];
        }
    });
    y
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
fn visible_parts<'a>(parts: &'a [&'a [f32]], w: usize, visible: usize) -> impl Iterator<Item = (usize, usize, &'a [f32])> {
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

/// Causal depthwise conv over time + SiLU for one sequence.
///
/// `x`: `[n, c]` new inputs; `hist`: `[kernel−1, c]` previous inputs (oldest first), updated to
/// the last `kernel−1` inputs; `w`: `[c, kernel]` with tap `kernel−1` on the current token.
pub fn causal_conv_silu(x: &[f32], n: usize, c: usize, hist: &mut [f32], w: &[f32], kernel: usize) -> Vec<f32> {
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

/// Gated RMSNorm per row of length `w.len()`: `w · x̂ · silu(z)` (norm before gate).
pub fn rms_norm_gated(x: &[f32], z: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(d).zip(x.par_chunks(d)).zip(z.par_chunks(d)).for_each(|((yr, xr), zr)| {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for i in 0..d {
            yr[i] = w[i] * (xr[i] * r) * silu(zr[i]);
        }
    });
    y
}
