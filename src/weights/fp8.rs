//! The block-FP8 formats of the project, on the CPU: the E4M3 value table, the weight format
//! (128×128 blocks with f32 `weight_scale_inv` multipliers, as Qwen's FP8 checkpoints store them)
//! and the activation format (per token, 1×128 blocks) the FP8 GEMMs read.
//!
//! Both backends, the checkpoint writer and the tests use these definitions: the CPU backend
//! dequantises FP8 checkpoints with [`dequantize_fp8_blocks`]; the CUDA backend quantises BF16
//! weights at load with [`quantize_fp8_blocks`] (the RTN recipe), and its `quant_act_1x128`
//! kernel has [`quantize_act_1x128`] as its CPU twin. Nothing here knows about devices or models.

use anyhow::{bail, Result};

/// Side of a block-FP8 scale block (1×128 for activations, 128×128 for weights).
pub const FP8_BLOCK: usize = 128;
/// Largest finite E4M3 value.
pub const FP8_MAX: f32 = 448.0;
/// FP8 GEMMs run on a row count padded to this multiple (pad rows are zero with scale 1).
pub const FP8_ROW_ALIGN: usize = 16;
/// Rows an FP8 GEMM with `m` activation rows is run on.
pub fn fp8_rows(m: usize) -> usize {
    m.div_ceil(FP8_ROW_ALIGN).max(1) * FP8_ROW_ALIGN
}

/// Index of the scale of activation row `m`, 128-block `kb`, in the `[K/128][mpad]` layout that
/// cuBLASLt's `VEC128_32F` B-scale mode reads (rows contiguous per k-block).
#[inline]
pub fn act_scale_index(m: usize, kb: usize, mpad: usize) -> usize {
    kb * mpad + m
}

/// CPU twin of `quant_act_1x128` (kernels/quant.cu): per row and 128-wide block,
/// `s = max|x| / 448` (1 for an all-zero block), `q = e4m3(x / s)` round-to-nearest-even.
/// `x` is `[m, k]` (already bf16-representable values); returns `q` `[mpad, k]` and the scales
/// `[k/128][mpad]`, with `mpad = fp8_rows(m)` and zero pad rows.
pub fn quantize_act_1x128(x: &[f32], m: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(x.len(), m * k);
    assert_eq!(k % FP8_BLOCK, 0, "K must be a multiple of 128");
    let mpad = fp8_rows(m);
    let kb_n = k / FP8_BLOCK;
    let mut q = vec![0u8; mpad * k];
    let mut s = vec![1f32; kb_n * mpad];
    for r in 0..m {
        for kb in 0..kb_n {
            let blk = &x[r * k + kb * FP8_BLOCK..r * k + (kb + 1) * FP8_BLOCK];
            let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
            let sc = if amax > 0.0 { amax / FP8_MAX } else { 1.0 };
            s[act_scale_index(r, kb, mpad)] = sc;
            for (j, &v) in blk.iter().enumerate() {
                q[r * k + kb * FP8_BLOCK + j] = float8::F8E4M3::from_f32(v / sc).to_bits();
            }
        }
    }
    (q, s)
}

/// `x[r, c] = e4m3(q[r, c]) · s[c/128][r]` for the first `m` rows.
pub fn dequantize_act_1x128(q: &[u8], s: &[f32], m: usize, mpad: usize, k: usize) -> Vec<f32> {
    let lut = fp8_e4m3_table();
    let mut out = vec![0f32; m * k];
    for r in 0..m {
        for c in 0..k {
            out[r * k + c] = lut[q[r * k + c] as usize] * s[act_scale_index(r, c / FP8_BLOCK, mpad)];
        }
    }
    out
}

/// `W[o, i] = fp8(w[o, i]) · scale_inv[o / bn, i / bk]`. The block size is the checkpoint's
/// `weight_block_size` when it tiles the scale grid (`ceil(dim / block)` blocks, ragged last
/// block), else inferred from the grid (`dim / blocks`, as transformers infers it).
pub fn dequantize_fp8_blocks(
    w: &[u8],
    shape: &[usize],
    scale: &[u8],
    scale_shape: &[usize],
    block: Option<[usize; 2]>,
) -> Result<Vec<f32>> {
    let (rows, cols) = match shape {
        [r, c] => (*r, *c),
        _ => bail!("FP8 weights must be 2-D, got shape {shape:?}"),
    };
    let (sr, sc) = match scale_shape {
        [a, b] => (*a, *b),
        _ => bail!("weight_scale_inv must be 2-D, got shape {scale_shape:?}"),
    };
    if sr == 0 || sc == 0 {
        bail!("empty weight_scale_inv");
    }
    let (bn, bk) = match block {
        Some([bn, bk]) if bn > 0 && bk > 0 && rows.div_ceil(bn) == sr && cols.div_ceil(bk) == sc => (bn, bk),
        _ => (rows.div_ceil(sr), cols.div_ceil(sc)),
    };
    if rows.div_ceil(bn) != sr || cols.div_ceil(bk) != sc {
        bail!("weight_scale_inv shape {scale_shape:?} does not tile weight shape {shape:?}");
    }
    let scales: Vec<f32> =
        scale.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if scales.len() != sr * sc {
        bail!("weight_scale_inv must be F32 with {} values", sr * sc);
    }
    let lut = fp8_e4m3_table();
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        let srow = &scales[(r / bn) * sc..(r / bn + 1) * sc];
        let wrow = &w[r * cols..(r + 1) * cols];
        let orow = &mut out[r * cols..(r + 1) * cols];
        for (c, (o, &b)) in orow.iter_mut().zip(wrow).enumerate() {
            *o = lut[b as usize] * srow[c / bk];
        }
    }
    Ok(out)
}

/// All 256 E4M3 (fn) values.
pub fn fp8_e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    for (i, v) in t.iter_mut().enumerate() {
        *v = float8::F8E4M3::from_bits(i as u8).to_f32();
    }
    t
}

/// Round-to-nearest block FP8: per 128×128 block `s = 448 / max|W|` (1 for an all-zero block),
/// `q = e4m3(W·s)`, stored multiplier `1/s`. Returns (fp8 bytes, `[⌈out/128⌉, ⌈in/128⌉]` scales).
pub fn quantize_fp8_blocks(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    const B: usize = 128;
    let (br, bc) = (rows.div_ceil(B), cols.div_ceil(B));
    let mut scale_inv = vec![0f32; br * bc];
    let mut q = vec![0u8; rows * cols];
    for bi in 0..br {
        for bj in 0..bc {
            let mut amax = 0f32;
            for r in bi * B..((bi + 1) * B).min(rows) {
                for c in bj * B..((bj + 1) * B).min(cols) {
                    amax = amax.max(w[r * cols + c].abs());
                }
            }
            let s = if amax > 0.0 { 448.0 / amax } else { 1.0 };
            scale_inv[bi * bc + bj] = 1.0 / s;
            for r in bi * B..((bi + 1) * B).min(rows) {
                for c in bj * B..((bj + 1) * B).min(cols) {
                    q[r * cols + c] = float8::F8E4M3::from_f32(w[r * cols + c] * s).to_bits();
                }
            }
        }
    }
    (q, scale_inv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_rows_pad_to_sixteen() {
        assert_eq!(fp8_rows(0), 16);
        assert_eq!(fp8_rows(1), 16);
        assert_eq!(fp8_rows(16), 16);
        assert_eq!(fp8_rows(17), 32);
        assert_eq!(fp8_rows(1000), 1008);
    }

    #[test]
    fn activation_scales_are_k_block_major() {
        // Row r, block kb lives at kb·mpad + r: all rows of one k-block are contiguous.
        let (m, k) = (3, 256);
        let mpad = fp8_rows(m);
        let mut x = vec![0f32; m * k];
        for r in 0..m {
            for c in 0..k {
                // A different magnitude in every (row, block), so a transposed read would be wrong.
                x[r * k + c] = (1 + r * 2 + c / 128) as f32 * if c % 2 == 0 { 1.0 } else { -0.5 };
            }
        }
        let (q, s) = quantize_act_1x128(&x, m, k);
        assert_eq!(s.len(), 2 * mpad);
        for r in 0..m {
            for kb in 0..2 {
                let want = (1 + r * 2 + kb) as f32 / FP8_MAX;
                assert_eq!(s[kb * mpad + r], want, "scale of row {r} block {kb}");
            }
        }
        // Pad rows: zero bytes, unit scale.
        assert!(q[m * k..].iter().all(|&b| b == 0));
        assert!((m..mpad).all(|r| s[r] == 1.0 && s[mpad + r] == 1.0));
        // Each block's largest value maps to ±448 exactly.
        let back = dequantize_act_1x128(&q, &s, m, mpad, k);
        for r in 0..m {
            for c in [0, 128] {
                assert_eq!(q[r * k + c], float8::F8E4M3::from_f32(448.0).to_bits());
                assert!((back[r * k + c] - x[r * k + c]).abs() <= 1e-6 * x[r * k + c].abs());
            }
        }
    }

    #[test]
    fn activation_quantisation_error_is_e4m3_sized() {
        let (m, k) = (5, 384);
        let x: Vec<f32> =
            (0..m * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 << (i % 5)) as f32).collect();
        let (q, s) = quantize_act_1x128(&x, m, k);
        let back = dequantize_act_1x128(&q, &s, m, fp8_rows(m), k);
        for r in 0..m {
            for kb in 0..k / 128 {
                let blk = r * k + kb * 128..r * k + (kb + 1) * 128;
                let amax = x[blk.clone()].iter().fold(0f32, |a, v| a.max(v.abs()));
                for i in blk {
                    // 3 mantissa bits: half an ulp is ≤ 1/16 relative, plus subnormal spacing near 0.
                    let tol = x[i].abs() / 16.0 + amax / 448.0 * 2f32.powi(-9);
                    assert!((back[i] - x[i]).abs() <= tol * 1.0001, "x {} back {}", x[i], back[i]);
                }
            }
        }
    }

    #[test]
    fn zero_block_gets_unit_scale() {
        let (q, s) = quantize_act_1x128(&[0f32; 128], 1, 128);
        assert!(q.iter().all(|&b| b == 0));
        assert_eq!(s[0], 1.0);
    }

    #[test]
    fn fp8_blocks_round_trip_within_e4m3_precision() {
        let w: Vec<f32> =
            (0..200 * 300).map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i / 300) as f32)).collect();
        let (q, s) = quantize_fp8_blocks(&w, 200, 300);
        assert_eq!(s.len(), 2 * 3);
        let back = dequantize_fp8_blocks(
            &q,
            &[200, 300],
            &s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
            &[2, 3],
            Some([128, 128]),
        )
        .unwrap();
        for (a, b) in w.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() * 0.0625 + 1e-3, "{a} vs {b}");
        }
        // The block maximum maps to ±448 exactly.
        assert!(q.iter().any(|&b| float8::F8E4M3::from_bits(b).to_f32().abs() == 448.0));
    }
}
