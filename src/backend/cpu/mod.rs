//! The CPU backend: f32 everywhere, weights dequantised to f32 once at load.
//!
//! It is the numerical reference of the project (it matches a float32 transformers run) and the
//! backend that serves small models and runs CI. GEMMs go through the `gemm` crate; everything
//! else is in [`kernels`].

pub mod kernels;

use super::{AttentionDims, AttentionInputs, Backend, DeltaNetDims, DeltaNetInputs, Gelu, LinearPart};
use crate::weights::TensorRef;
use anyhow::{bail, ensure, Result};
use kernels::DeltaRuleInputs;
use std::ops::Range;

/// How the CPU runs the gated delta rule (both are exact; chunked is the prefill form).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaRuleMode {
    Chunked(usize),
    Recurrent,
}

#[derive(Debug, Clone)]
pub struct CpuBackend {
    pub delta_rule: DeltaRuleMode,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend { delta_rule: DeltaRuleMode::Chunked(64) }
    }
}

/// A dense row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
}

impl CpuTensor {
    pub fn new(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        ensure!(n == data.len(), "tensor of shape {shape:?} needs {n} values, got {}", data.len());
        Ok(CpuTensor { data, shape: shape.to_vec() })
    }
    /// `(rows, cols)` viewing the last dim as columns.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = *self.shape.last().unwrap_or(&1);
        (self.data.len().checked_div(cols).unwrap_or(0), cols)
    }
}

struct CpuLora {
    rows: Range<usize>,
    a: Vec<f32>,
    b: Vec<f32>,
    rank: usize,
    scale: f32,
}

pub struct CpuLinear {
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    loras: Vec<CpuLora>,
    in_dim: usize,
    out_dim: usize,
}

/// Keys and values of one attention layer: an immutable shared prefix (cheap to fork) followed by
/// this sequence's own rows.
#[derive(Clone)]
pub struct CpuKvCache {
    shared: std::sync::Arc<(Vec<f32>, Vec<f32>)>,
    shared_len: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

#[derive(Clone)]
pub struct CpuDeltaState {
    /// `[kernel−1, channels]` previous conv inputs, oldest first.
    conv: Vec<f32>,
    /// `[value_heads, key_dim, value_dim]`.
    recurrent: Vec<f32>,
}

impl CpuDeltaState {
    pub fn recurrent(&self) -> &[f32] {
        &self.recurrent
    }
}

fn check_2d(t: &TensorRef) -> Result<(usize, usize)> {
    match t.shape {
        [r, c] => Ok((*r, *c)),
        s => bail!("{} must be 2-D, has shape {s:?}", t.name),
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Linear = CpuLinear;
    type KvCache = CpuKvCache;
    type DeltaState = CpuDeltaState;

    fn describe(&self) -> String {
        format!("cpu (f32, {} threads)", rayon::current_num_threads())
    }

    fn param(&self, t: &TensorRef) -> Result<CpuTensor> {
        CpuTensor::new(t.to_f32()?, t.shape)
    }

    fn param_f32(&self, t: &TensorRef) -> Result<CpuTensor> {
        self.param(t)
    }

    fn linear(&self, parts: &[LinearPart]) -> Result<CpuLinear> {
        ensure!(!parts.is_empty(), "a projection needs at least one block");
        let in_dim = check_2d(&parts[0].weight)?.1;
        let mut weight = Vec::new();
        let mut bias: Option<Vec<f32>> = None;
        let mut loras = Vec::new();
        let mut out_dim = 0;
        for p in parts {
            let (o, i) = check_2d(&p.weight)?;
            ensure!(i == in_dim, "{} has {} inputs, expected {}", p.weight.name, i, in_dim);
            weight.extend(p.weight.to_f32()?);
            if let Some(b) = &p.bias {
                ensure!(b.shape == [o], "{} must have shape [{o}]", b.name);
                let all = bias.get_or_insert_with(|| vec![0.0; out_dim]);
                all.extend(b.to_f32()?);
            } else if let Some(all) = bias.as_mut() {
                all.extend(std::iter::repeat_n(0.0, o));
            }
            if let Some(l) = &p.lora {
                let (r, ai) = check_2d(&l.a)?;
                let (bo, br) = check_2d(&l.b)?;
                ensure!(ai == in_dim && bo == o && br == r, "LoRA {} / {} shapes do not fit {}", l.a.name, l.b.name, p.weight.name);
                loras.push(CpuLora { rows: out_dim..out_dim + o, a: l.a.to_f32()?, b: l.b.to_f32()?, rank: r, scale: l.scale });
            }
            out_dim += o;
        }
        Ok(CpuLinear { weight, bias, loras, in_dim, out_dim })
    }

    fn linear_out(&self, w: &CpuLinear) -> usize {
        w.out_dim
    }

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<CpuTensor> {
        CpuTensor::new(data.to_vec(), shape)
    }

    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn shape<'t>(&self, t: &'t CpuTensor) -> &'t [usize] {
        &t.shape
    }

    fn reshape(&self, t: CpuTensor, shape: &[usize]) -> Result<CpuTensor> {
        CpuTensor::new(t.data, shape)
    }

    fn embed(&self, table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
        let (v, d) = table.rows_cols();
        let mut out = Vec::with_capacity(ids.len() * d);
        for &id in ids {
            ensure!((id as usize) < v, "token id {id} is outside the embedding table ({v} rows)");
            out.extend_from_slice(&table.data[id as usize * d..(id as usize + 1) * d]);
        }
        CpuTensor::new(out, &[ids.len(), d])
    }

    fn embed_bag(&self, table: &CpuTensor, idx: &[u32], w: &[f32], taps: usize) -> Result<CpuTensor> {
        let (v, d) = table.rows_cols();
        ensure!(idx.len() == w.len() && taps > 0 && idx.len() % taps == 0, "embed_bag shapes");
        let n = idx.len() / taps;
        let mut out = vec![0f32; n * d];
        for r in 0..n {
            let o = &mut out[r * d..(r + 1) * d];
            for j in 0..taps {
                let i = idx[r * taps + j] as usize;
                ensure!(i < v, "embed_bag index {i} out of range");
                let wt = w[r * taps + j];
                for (oo, &x) in o.iter_mut().zip(&table.data[i * d..(i + 1) * d]) {
                    *oo += x * wt;
                }
            }
        }
        CpuTensor::new(out, &[n, d])
    }

    fn scatter_rows(&self, dst: &mut CpuTensor, rows: &[usize], src: &CpuTensor) -> Result<()> {
        let (n, d) = dst.rows_cols();
        let (sn, sd) = src.rows_cols();
        ensure!(sd == d && sn == rows.len(), "scatter_rows: {} rows of width {sd} into width {d}", rows.len());
        for (i, &r) in rows.iter().enumerate() {
            ensure!(r < n, "scatter_rows: row {r} out of range");
            dst.data[r * d..(r + 1) * d].copy_from_slice(&src.data[i * d..(i + 1) * d]);
        }
        Ok(())
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        let (n, d) = x.rows_cols();
        let mut out = Vec::with_capacity(rows.len() * d);
        for &r in rows {
            ensure!(r < n, "gather_rows: row {r} out of range");
            out.extend_from_slice(&x.data[r * d..(r + 1) * d]);
        }
        CpuTensor::new(out, &[rows.len(), d])
    }

    fn split_cols(&self, x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
        let (n, d) = x.rows_cols();
        ensure!(widths.iter().sum::<usize>() == d, "split_cols: widths {widths:?} do not sum to {d}");
        let mut outs: Vec<Vec<f32>> = widths.iter().map(|w| Vec::with_capacity(n * w)).collect();
        for r in 0..n {
            let mut c = r * d;
            for (o, &w) in outs.iter_mut().zip(widths) {
                o.extend_from_slice(&x.data[c..c + w]);
                c += w;
            }
        }
        outs.into_iter().zip(widths).map(|(o, &w)| CpuTensor::new(o, &[n, w])).collect()
    }

    fn concat_rows(&self, parts: &[&CpuTensor]) -> Result<CpuTensor> {
        let d = parts.first().map(|p| p.rows_cols().1).unwrap_or(0);
        let mut out = Vec::new();
        for p in parts {
            ensure!(p.rows_cols().1 == d, "concat_rows: widths differ");
            out.extend_from_slice(&p.data);
        }
        let n = out.len().checked_div(d).unwrap_or(0);
        CpuTensor::new(out, &[n, d])
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuLinear) -> Result<CpuTensor> {
        let (m, k) = x.rows_cols();
        ensure!(k == w.in_dim, "matmul: input width {k}, projection expects {}", w.in_dim);
        let mut y = vec![0f32; m * w.out_dim];
        kernels::matmul_xwt(&x.data, m, k, &w.weight, w.out_dim, &mut y, false);
        if let Some(b) = &w.bias {
            for row in y.chunks_mut(w.out_dim) {
                row.iter_mut().zip(b).for_each(|(o, &bb)| *o += bb);
            }
        }
        for l in &w.loras {
            // PEFT: y += scale · (x·Aᵀ)·Bᵀ on this block's columns.
            let mut xa = vec![0f32; m * l.rank];
            kernels::matmul_xwt(&x.data, m, k, &l.a, l.rank, &mut xa, false);
            let o = l.rows.len();
            let mut delta = vec![0f32; m * o];
            kernels::matmul_xwt(&xa, m, l.rank, &l.b, o, &mut delta, false);
            for r in 0..m {
                let yr = &mut y[r * w.out_dim + l.rows.start..r * w.out_dim + l.rows.end];
                for (yy, &dd) in yr.iter_mut().zip(&delta[r * o..(r + 1) * o]) {
                    *yy += dd * l.scale;
                }
            }
        }
        CpuTensor::new(y, &[m, w.out_dim])
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f32, offset: f32) -> Result<CpuTensor> {
        let d = w.data.len();
        ensure!(d > 0 && x.data.len() % d == 0, "rms_norm: {} values do not split into rows of {d}", x.data.len());
        Ok(CpuTensor { data: kernels::rms_norm(&x.data, &w.data, eps, offset), shape: x.shape.clone() })
    }

    fn layer_norm(&self, x: &CpuTensor, w: &CpuTensor, b: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        let d = w.data.len();
        ensure!(b.data.len() == d && d > 0 && x.data.len() % d == 0, "layer_norm shapes");
        Ok(CpuTensor { data: kernels::layer_norm(&x.data, &w.data, &b.data, eps), shape: x.shape.clone() })
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        ensure!(x.data.len() == y.data.len(), "add: shapes {:?} and {:?}", x.shape, y.shape);
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn swiglu(&self, gate_up: &CpuTensor) -> Result<CpuTensor> {
        let (n, d2) = gate_up.rows_cols();
        ensure!(d2 % 2 == 0, "swiglu needs an even width");
        let d = d2 / 2;
        let mut out = vec![0f32; n * d];
        for r in 0..n {
            let g = &gate_up.data[r * d2..r * d2 + d];
            let u = &gate_up.data[r * d2 + d..(r + 1) * d2];
            for i in 0..d {
                out[r * d + i] = kernels::silu(g[i]) * u[i];
            }
        }
        CpuTensor::new(out, &[n, d])
    }

    fn gelu(&self, x: &mut CpuTensor, kind: Gelu) -> Result<()> {
        let tanh = kind == Gelu::Tanh;
        x.data.iter_mut().for_each(|v| *v = kernels::gelu(*v, tanh));
        Ok(())
    }

    fn readout(&self, h: &CpuTensor, w: &CpuTensor) -> Result<Vec<f32>> {
        let (m, k) = h.rows_cols();
        let (rows, wk) = w.rows_cols();
        ensure!(k == wk, "readout: hidden {k} vs weight width {wk}");
        let mut y = vec![0f32; m * rows];
        kernels::matmul_xwt(&h.data, m, k, &w.data, rows, &mut y, false);
        Ok(y)
    }

    fn new_kv_cache(&self, _dims: &AttentionDims) -> Result<CpuKvCache> {
        Ok(CpuKvCache { shared: Default::default(), shared_len: 0, k: Vec::new(), v: Vec::new(), len: 0 })
    }

    fn kv_len(&self, cache: &CpuKvCache) -> usize {
        cache.shared_len + cache.len
    }

    fn share_kv(&self, cache: &mut CpuKvCache) -> Result<()> {
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

    fn gated_attention(
        &self,
        x: &AttentionInputs<CpuTensor>,
        dims: &AttentionDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        caches: &mut [&mut CpuKvCache],
    ) -> Result<CpuTensor> {
        let AttentionDims { heads, kv_heads, head_dim: hd, rotary_dim: rot, norm_eps } = *dims;
        ensure!(segments.len() == caches.len(), "one cache per segment");
        let tree = crate::backend::check_parents(parents, segments.len())?;
        let (n, width) = x.qkv.rows_cols();
        ensure!(width == dims.qkv_width(), "attention input width {width} != {}", dims.qkv_width());
        let qgw = heads * 2 * hd;
        let parts = self.split_cols(x.qkv, &[qgw, kv_heads * hd, kv_heads * hd])?;
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
        let mut q = kernels::rms_norm(&q, &x.q_norm.data, norm_eps, 1.0);
        let mut k = kernels::rms_norm(&key.data, &x.k_norm.data, norm_eps, 1.0);
        for t in 0..n {
            let cos = &x.cos.data[t * rot..(t + 1) * rot];
            let sin = &x.sin.data[t * rot..(t + 1) * rot];
            for h in 0..heads {
                kernels::rotate_half_inplace(&mut q[(t * heads + h) * hd..(t * heads + h + 1) * hd], cos, sin);
            }
            for h in 0..kv_heads {
                kernels::rotate_half_inplace(&mut k[(t * kv_heads + h) * hd..(t * kv_heads + h + 1) * hd], cos, sin);
            }
        }
        let mut out = vec![0f32; n * heads * hd];
        for (si, seg) in segments.iter().enumerate() {
            if let Some(p) = tree.parent[si] {
                // The parent's rows are in (it comes first): fork its cache.
                self.share_kv(caches[p])?;
                *caches[si] = caches[p].clone();
            }
            let cache = &mut *caches[si];
            let w = kv_heads * hd;
            cache.k.extend_from_slice(&k[seg.start * w..seg.end * w]);
            cache.v.extend_from_slice(&value.data[seg.start * w..seg.end * w]);
            cache.len += seg.len();
            let qs = &q[seg.start * heads * hd..seg.end * heads * hd];
            let (sk, sv) = (&cache.shared.0[..], &cache.shared.1[..]);
            let o = kernels::attention_parts(qs, &[sk, &cache.k], &[sv, &cache.v], seg.len(), heads, kv_heads, hd, true);
            out[seg.start * heads * hd..seg.end * heads * hd].copy_from_slice(&o);
        }
        out.iter_mut().zip(&gate).for_each(|(o, &g)| *o *= kernels::sigmoid(g));
        CpuTensor::new(out, &[n, heads * hd])
    }

    fn new_delta_state(&self, dims: &DeltaNetDims) -> Result<CpuDeltaState> {
        Ok(CpuDeltaState {
            conv: vec![0.0; (dims.conv_kernel - 1) * dims.conv_channels()],
            recurrent: vec![0.0; dims.value_heads * dims.key_dim * dims.value_dim],
        })
    }

    fn gated_delta_net(
        &self,
        x: &DeltaNetInputs<CpuTensor>,
        dims: &DeltaNetDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        states: &mut [&mut CpuDeltaState],
    ) -> Result<CpuTensor> {
        let DeltaNetDims { key_heads: kh, value_heads: vh, key_dim: dk, value_dim: dv, conv_kernel, norm_eps } = *dims;
        let c = dims.conv_channels();
        ensure!(segments.len() == states.len(), "one state per segment");
        let tree = crate::backend::check_parents(parents, segments.len())?;
        let (n, w) = x.proj.rows_cols();
        ensure!(w == dims.proj_width(), "DeltaNet input width {w} != {}", dims.proj_width());
        let parts = self.split_cols(x.proj, &[c, vh * dv, vh, vh])?;
        let (qkv, z, b, a) = (&parts[0], &parts[1], &parts[2], &parts[3]);
        ensure!(x.conv_weight.data.len() == c * conv_kernel, "conv weight shape");
        let rep = vh / kh;
        let a_log = &x.a_log.data;
        let dt_bias = &x.dt_bias.data;
        let mut core = vec![0f32; n * vh * dv];
        for (si, seg) in segments.iter().enumerate() {
            if let Some(p) = tree.parent[si] {
                // The parent's rows are in (it comes first): continue from its state.
                *states[si] = states[p].clone();
            }
            let st = &mut *states[si];
            let len = seg.len();
            if len == 0 {
                continue;
            }
            let mixed = kernels::causal_conv_silu(
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
            kernels::l2_normalize_rows(&mut qn, dk, 1e-6);
            kernels::l2_normalize_rows(&mut kn, dk, 1e-6);
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
                    beta[t * vh + j] = kernels::sigmoid(b.data[r]);
                    g[t * vh + j] = -a_log[j].exp() * kernels::softplus(a.data[r] + dt_bias[j]);
                }
            }
            let inputs = DeltaRuleInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta, n: len, heads: vh, dk, dv };
            let o = match self.delta_rule {
                DeltaRuleMode::Chunked(cs) => kernels::delta_rule_chunked(&inputs, &mut st.recurrent, cs.max(1)),
                DeltaRuleMode::Recurrent => kernels::delta_rule_recurrent(&inputs, &mut st.recurrent),
            };
            core[seg.start * vh * dv..seg.end * vh * dv].copy_from_slice(&o);
        }
        let y = kernels::rms_norm_gated(&core, &z.data, &x.norm_weight.data, norm_eps);
        CpuTensor::new(y, &[n, vh * dv])
    }

    fn vision_attention(
        &self,
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
                kernels::rotate_half_inplace(&mut q[t * d + h * hd..t * d + (h + 1) * hd], c, s);
                kernels::rotate_half_inplace(&mut k[t * d + h * hd..t * d + (h + 1) * hd], c, s);
            }
        }
        let mut out = vec![0f32; n * d];
        for seg in segments {
            let r = seg.start * d..seg.end * d;
            let o = kernels::attention(&q[r.clone()], &k[r.clone()], &v[r.clone()], seg.len(), seg.len(), heads, heads, hd, false);
            out[r].copy_from_slice(&o);
        }
        CpuTensor::new(out, &[n, d])
    }
}
