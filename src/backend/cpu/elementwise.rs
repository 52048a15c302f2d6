//! Activations and row bookkeeping in f32: SiLU, sigmoid, softplus, GELU, embeddings, row
//! gathers and scatters, column splits, concatenation, residual adds. CPU twins of
//! kernels/elementwise.cu (src/backend/cuda/elementwise.rs).

use super::CpuTensor;
use anyhow::{ensure, Result};

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

/// `Backend::embed` (the trait documents the contract).
pub(super) fn embed(table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
    let (v, d) = table.rows_cols();
    let mut out = Vec::with_capacity(ids.len() * d);
    for &id in ids {
        ensure!((id as usize) < v, "token id {id} is outside the embedding table ({v} rows)");
        out.extend_from_slice(&table.data[id as usize * d..(id as usize + 1) * d]);
    }
    CpuTensor::new(out, &[ids.len(), d])
}

/// `Backend::embed_bag` (the trait documents the contract).
pub(super) fn embed_bag(table: &CpuTensor, idx: &[u32], w: &[f32], taps: usize) -> Result<CpuTensor> {
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

/// `Backend::scatter_rows` (the trait documents the contract).
pub(super) fn scatter_rows(dst: &mut CpuTensor, rows: &[usize], src: &CpuTensor) -> Result<()> {
    let (n, d) = dst.rows_cols();
    let (sn, sd) = src.rows_cols();
    ensure!(sd == d && sn == rows.len(), "scatter_rows: {} rows of width {sd} into width {d}", rows.len());
    for (i, &r) in rows.iter().enumerate() {
        ensure!(r < n, "scatter_rows: row {r} out of range");
        dst.data[r * d..(r + 1) * d].copy_from_slice(&src.data[i * d..(i + 1) * d]);
    }
    Ok(())
}

/// `Backend::gather_rows` (the trait documents the contract).
pub(super) fn gather_rows(x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
    let (n, d) = x.rows_cols();
    let mut out = Vec::with_capacity(rows.len() * d);
    for &r in rows {
        ensure!(r < n, "gather_rows: row {r} out of range");
        out.extend_from_slice(&x.data[r * d..(r + 1) * d]);
    }
    CpuTensor::new(out, &[rows.len(), d])
}

/// `Backend::split_cols` (the trait documents the contract).
pub(super) fn split_cols(x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
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

/// `Backend::concat_rows` (the trait documents the contract).
pub(super) fn concat_rows(parts: &[&CpuTensor]) -> Result<CpuTensor> {
    let d = parts.first().map(|p| p.rows_cols().1).unwrap_or(0);
    let mut out = Vec::new();
    for p in parts {
        ensure!(p.rows_cols().1 == d, "concat_rows: widths differ");
        out.extend_from_slice(&p.data);
    }
    let n = out.len().checked_div(d).unwrap_or(0);
    CpuTensor::new(out, &[n, d])
}

/// `Backend::add_assign` (the trait documents the contract).
pub(super) fn add_assign(x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
    ensure!(x.data.len() == y.data.len(), "add: shapes {:?} and {:?}", x.shape, y.shape);
    x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
    Ok(())
}

/// `Backend::swiglu` (the trait documents the contract).
pub(super) fn swiglu(gate_up: &CpuTensor) -> Result<CpuTensor> {
    let (n, d2) = gate_up.rows_cols();
    ensure!(d2 % 2 == 0, "swiglu needs an even width");
    let d = d2 / 2;
    let mut out = vec![0f32; n * d];
    for r in 0..n {
        let g = &gate_up.data[r * d2..r * d2 + d];
        let u = &gate_up.data[r * d2 + d..(r + 1) * d2];
        for i in 0..d {
            out[r * d + i] = silu(g[i]) * u[i];
        }
    }
    CpuTensor::new(out, &[n, d])
}
