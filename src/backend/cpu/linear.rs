//! Projections on the CPU: every part dequantised to f32 at load, LoRA kept unmerged, GEMMs
//! through the `gemm` crate. CPU twin of src/backend/cuda/linear.rs.

use super::CpuTensor;
use crate::backend::LinearPart;
use crate::weights::TensorRef;
use anyhow::{bail, ensure, Result};
use std::ops::Range;

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

struct CpuLora {
    rows: Range<usize>,
    a: Vec<f32>,
    b: Vec<f32>,
    rank: usize,
    scale: f32,
}

/// A projection: the parts' f32 weights stacked along the output dim, bias, LoRA pairs.
pub struct CpuLinear {
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    loras: Vec<CpuLora>,
    pub(super) in_dim: usize,
    pub(super) out_dim: usize,
}

fn check_2d(t: &TensorRef) -> Result<(usize, usize)> {
    match t.shape {
        [r, c] => Ok((*r, *c)),
        s => bail!("{} must be 2-D, has shape {s:?}", t.name),
    }
}

/// `Backend::linear` (the trait documents the contract).
pub(super) fn linear(parts: &[LinearPart]) -> Result<CpuLinear> {
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
            ensure!(
                ai == in_dim && bo == o && br == r,
                "LoRA {} / {} shapes do not fit {}",
                l.a.name,
                l.b.name,
                p.weight.name
            );
            loras.push(CpuLora {
                rows: out_dim..out_dim + o,
                a: l.a.to_f32()?,
                b: l.b.to_f32()?,
                rank: r,
                scale: l.scale,
            });
        }
        out_dim += o;
    }
    Ok(CpuLinear { weight, bias, loras, in_dim, out_dim })
}

/// `Backend::matmul` (the trait documents the contract).
pub(super) fn matmul(x: &CpuTensor, w: &CpuLinear) -> Result<CpuTensor> {
    let (m, k) = x.rows_cols();
    ensure!(k == w.in_dim, "matmul: input width {k}, projection expects {}", w.in_dim);
    let mut y = vec![0f32; m * w.out_dim];
    matmul_xwt(&x.data, m, k, &w.weight, w.out_dim, &mut y, false);
    if let Some(b) = &w.bias {
        for row in y.chunks_mut(w.out_dim) {
            row.iter_mut().zip(b).for_each(|(o, &bb)| *o += bb);
        }
    }
    for l in &w.loras {
        // PEFT: y += scale · (x·Aᵀ)·Bᵀ on this block's columns.
        let mut xa = vec![0f32; m * l.rank];
        matmul_xwt(&x.data, m, k, &l.a, l.rank, &mut xa, false);
        let o = l.rows.len();
        let mut delta = vec![0f32; m * o];
        matmul_xwt(&xa, m, l.rank, &l.b, o, &mut delta, false);
        for r in 0..m {
            let yr = &mut y[r * w.out_dim + l.rows.start..r * w.out_dim + l.rows.end];
            for (yy, &dd) in yr.iter_mut().zip(&delta[r * o..(r + 1) * o]) {
                *yy += dd * l.scale;
            }
        }
    }
    CpuTensor::new(y, &[m, w.out_dim])
}

/// `Backend::readout` (the trait documents the contract).
pub(super) fn readout(h: &CpuTensor, w: &CpuTensor) -> Result<Vec<f32>> {
    let (m, k) = h.rows_cols();
    let (rows, wk) = w.rows_cols();
    ensure!(k == wk, "readout: hidden {k} vs weight width {wk}");
    let mut y = vec![0f32; m * rows];
    matmul_xwt(&h.data, m, k, &w.data, rows, &mut y, false);
    Ok(y)
}
