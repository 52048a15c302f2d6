//! Projections on the CPU: every part dequantised to f32 at load, LoRA kept unmerged, GEMMs
//! through the `gemm` crate. CPU twin of src/backend/cuda/linear.rs.
//!
//! Batch invariance: a row's result must not depend on which other rows share the GEMM (requests
//! are packed into one forward and must get the answers they get alone). The `gemm` crate (0.19)
//! sums each output in one fixed order (one accumulator per element, K in blocks whose size
//! depends on K and the caches only) on its main path, but takes other paths with other orders
//! for small shapes: a dot-product kernel when rows × outputs ≤ 256, a GEMV for one row, and
//! 512-wide K blocks when both rows and outputs are ≤ 64. [`matmul_xwt`] therefore pads the rows
//! with zeros up to [`min_rows`], so every call with the same weight takes the same path
//! (`rows_do_not_depend_on_the_batch` checks it).

use super::CpuTensor;
use crate::backend::LinearPart;
use crate::weights::TensorRef;
use anyhow::{bail, ensure, Result};
use std::ops::Range;

/// The fewest rows with which a GEMM of `n` outputs takes the `gemm` crate's main path: more than
/// one row (no GEMV), more than 256 outputs in all (no dot-product kernel) and, for 64 outputs or
/// fewer, more than 64 rows (no small-size K blocking). With at least this many rows, a row's
/// arithmetic is the same whatever the row count.
pub fn min_rows(n: usize) -> usize {
    let not_dot = 256 / n.max(1) + 1;
    if n > 64 {
        not_dot.max(2)
    } else {
        not_dot.max(65)
    }
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` (+ `y` when `accumulate`), via the `gemm` crate; each row's
/// bits independent of `m` and of the other rows (see the module doc).
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
    let rows = min_rows(n);
    if m < rows {
        // Zero rows below the real ones; their results are dropped.
        let mut xp = vec![0f32; rows * k];
        xp[..m * k].copy_from_slice(x);
        let mut yp = vec![0f32; rows * n];
        if accumulate {
            yp[..m * n].copy_from_slice(y);
        }
        gemm_xwt(&xp, rows, k, w, n, &mut yp, accumulate);
        y.copy_from_slice(&yp[..m * n]);
        return;
    }
    gemm_xwt(x, m, k, w, n, y, accumulate);
}

/// [`matmul_xwt`] straight through the `gemm` crate (whose path depends on the shape).
fn gemm_xwt(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32], accumulate: bool) {
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

impl CpuLinear {
    /// Bytes of its f32 weights, bias and LoRA factors.
    pub fn bytes(&self) -> usize {
        let floats = self.weight.len()
            + self.bias.as_ref().map_or(0, Vec::len)
            + self.loras.iter().map(|l| l.a.len() + l.b.len()).sum::<usize>();
        floats * std::mem::size_of::<f32>()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        // A fixed, irregular sequence (no RNG needed): rounding differs with the summation order.
        (0..n).map(|i| ((i as f32 * 0.7548777 + seed as f32 * 0.5698403).fract() - 0.5) * 1.37).collect()
    }

    /// Every row of `matmul_xwt` has the same bits whatever the other rows are and however many
    /// there are: the output widths of projections, LoRA A sides (rank-wide) and readouts, with
    /// reductions shorter and longer than one of the gemm crate's K blocks.
    #[test]
    fn rows_do_not_depend_on_the_batch() {
        let mut checked = 0;
        for &n in &[1usize, 2, 3, 4, 8, 16, 64, 65, 100, 256, 700] {
            for &k in &[1usize, 2, 3, 64, 300, 513, 1100, 2560] {
                let w = values(n * k, 1);
                let row = values(k, 2);
                let mut alone = vec![0f32; n];
                matmul_xwt(&row, 1, k, &w, n, &mut alone, false);
                for &m in &[2usize, 3, 5, 12, 64, 65, 130, 300, 600] {
                    // The row sits at a different place among other rows each time.
                    let at = (m * 7 + 3) % m;
                    let mut x = values(m * k, 3 + m as u32);
                    x[at * k..(at + 1) * k].copy_from_slice(&row);
                    let mut y = vec![0f32; m * n];
                    matmul_xwt(&x, m, k, &w, n, &mut y, false);
                    let got = &y[at * n..(at + 1) * n];
                    let same = got.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "out {n}, k {k}: row {at} of {m} differs from the row alone");
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 11 * 8 * 9);
    }
}
