//! `smart_resize` and torch's CPU uint8 antialiased bicubic resize, bit for bit.
//!
//! Why hand-written: transformers' torchvision backend calls
//! `torchvision.transforms.v2.functional.resize(uint8 tensor, BICUBIC, antialias=True)`, which on
//! CPU runs ATen's native uint8 path (`_upsample_bicubic2d_aa`, `UpSampleKernel.cpp` /
//! `UpSampleKernelAVXAntialias.h`). Its exact arithmetic is specific to torch and not what any
//! Rust crate implements:
//!
//! * per axis, `scale = in / out` (f64), `support = 2·scale` when downscaling else 2, window
//!   `[trunc(center − support + 0.5), trunc(center + support + 0.5))` around
//!   `center = scale·(i + 0.5)`, Keys cubic with **a = −0.5** evaluated at
//!   `(j + xmin − center + 0.5) / max(scale, 1)`, all in f64, normalised to sum 1;
//! * weights become **int16** with a per-axis precision: the largest `p ≤ 22` such that
//!   `trunc(0.5 + w_max · 2^(p+1)) < 2^15` fails next, i.e. the highest precision whose rounded
//!   largest weight still fits in 15 bits; each weight is `trunc(w·2^p ± 0.5)` (half away from 0);
//! * the **horizontal pass runs first** into a uint8 intermediate, then the vertical pass; each
//!   output is `clamp((2^(p−1) + Σ px·w) >> p, 0, 255)` in 32-bit integers (arithmetic shift);
//! * a pass whose size does not change is skipped (and the whole resize when neither changes).
//!
//! Pillow (22-bit int32 weights), the `image` crate (f32) and `fast_image_resize` (its own
//! precision choice) each differ from this by ±1 on some pixels. torch's AVX2 kernel and its
//! generic C++ kernel implement the same arithmetic; the goldens come from the AVX path (what x86
//! servers run). The one divergence found between the two (outputs one pixel wide, where torch's
//! AVX kernel mis-detects channels-last) cannot occur here since outputs are ≥ 32×32.

use rayon::prelude::*;

use super::ImageError;

/// transformers' `smart_resize` (qwen2_vl/image_processing_qwen2_vl.py), in f64 like Python.
///
/// Returns `(height, width)`, both multiples of `factor`.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), ImageError> {
    if height == 0 || width == 0 || factor == 0 {
        return Err(ImageError::Empty { width: width as u64, height: height as u64 });
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(ImageError::AspectRatio { width, height, ratio });
    }
    // Python's round() is round-half-to-even on the (correctly rounded) float quotient.
    let mut h_bar = (h / f).round_ties_even() as usize * factor;
    let mut w_bar = (w / f).round_ties_even() as usize * factor;
    if h_bar * w_bar > max_pixels {
        // (height * width) / max_pixels: exact ints, one correctly rounded division (as Python).
        let beta = ((height as f64 * width as f64) / max_pixels as f64).sqrt();
        h_bar = factor.max((h / beta / f).floor() as usize * factor);
        w_bar = factor.max((w / beta / f).floor() as usize * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (height as f64 * width as f64)).sqrt();
        h_bar = (h * beta / f).ceil() as usize * factor;
        w_bar = (w * beta / f).ceil() as usize * factor;
    }
    Ok((h_bar, w_bar))
}

/// Keys cubic convolution kernel with a = −0.5 (`HelperInterpCubic::aa_filter<double, true>`),
/// written with torch's operation order so every f64 rounding is the same.
#[inline]
fn aa_cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// One axis of the separable filter: taps, int16 weights and their precision.
#[derive(Debug, Clone)]
pub(crate) struct AxisWeights {
    /// first input index per output index
    pub xmin: Vec<usize>,
    /// number of taps per output index (≤ kmax)
    pub xsize: Vec<usize>,
    /// weights stride
    pub kmax: usize,
    /// `out · kmax` int16 weights
    pub weights: Vec<i16>,
    /// fixed-point precision (bits)
    pub precision: u32,
}

impl AxisWeights {
    /// `HelperInterpBase::_compute_index_ranges_int16_weights` for bicubic, antialias=True,
    /// align_corners=False, no explicit scale factor.
    pub(crate) fn new(in_size: usize, out_size: usize) -> Self {
        assert!(in_size > 0 && out_size > 0);
        let scale = in_size as f64 / out_size as f64;
        let interp_size = 4.0_f64;
        let support = if scale >= 1.0 { (interp_size * 0.5) * scale } else { interp_size * 0.5 };
        let kmax = support.ceil() as usize * 2 + 1;
        let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };

        let mut wf = vec![0.0f64; out_size * kmax];
        let mut xmin_v = Vec::with_capacity(out_size);
        let mut xsize_v = Vec::with_capacity(out_size);
        let mut wt_max = 0.0f64;
        for i in 0..out_size {
            let center = scale * (i as f64 + 0.5);
            // C++ static_cast<int64_t> truncates toward zero, as does `as i64`.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xsize = ((center + support + 0.5) as i64).min(in_size as i64) - xmin;
            let xsize = xsize.clamp(0, kmax as i64);
            let row = &mut wf[i * kmax..(i + 1) * kmax];
            let mut total = 0.0f64;
            for j in 0..xsize {
                let w = aa_cubic(((j + xmin) as f64 - center + 0.5) * invscale);
                row[j as usize] = w;
                total += w;
            }
            if total != 0.0 {
                for w in row[..xsize as usize].iter_mut() {
                    *w /= total;
                    wt_max = wt_max.max(*w);
                }
            }
            xmin_v.push(xmin as usize);
            xsize_v.push(xsize as usize);
        }

        let mut precision = 0u32;
        while precision < 22 {
            let next = (0.5 + wt_max * (1i64 << (precision + 1)) as f64) as i32;
            if next >= (1 << 15) {
                break;
            }
            precision += 1;
        }
        let mult = (1i64 << precision) as f64;
        let weights = wf
            .iter()
            .map(|&w| {
                let v = w * mult;
                (if v < 0.0 { (-0.5 + v) as i32 } else { (0.5 + v) as i32 }) as i16
            })
            .collect();
        Self { xmin: xmin_v, xsize: xsize_v, kmax, weights, precision }
    }

    #[inline]
    fn taps(&self, i: usize) -> (usize, &[i16]) {
        let k = &self.weights[i * self.kmax..i * self.kmax + self.xsize[i]];
        (self.xmin[i], k)
    }
}

#[inline]
fn finish(acc: i32, precision: u32) -> u8 {
    (acc >> precision).clamp(0, 255) as u8
}

/// Rows below this many output bytes are not worth a rayon task.
const PAR_MIN_BYTES: usize = 1 << 16;

fn horizontal(src: &[u8], w: usize, h: usize, c: usize, new_w: usize) -> Vec<u8> {
    let ax = AxisWeights::new(w, new_w);
    let init = 1i32 << (ax.precision - 1);
    let mut out = vec![0u8; h * new_w * c];
    let row = |(y, dst): (usize, &mut [u8])| {
        let s = &src[y * w * c..(y + 1) * w * c];
        if c == 3 {
            for (x, d) in dst.chunks_exact_mut(3).enumerate() {
                let (x0, k) = ax.taps(x);
                let px = &s[x0 * 3..(x0 + k.len()) * 3];
                let (mut r, mut g, mut b) = (init, init, init);
                for (p, &wt) in px.chunks_exact(3).zip(k) {
                    let wt = wt as i32;
                    r += p[0] as i32 * wt;
                    g += p[1] as i32 * wt;
                    b += p[2] as i32 * wt;
                }
                d[0] = finish(r, ax.precision);
                d[1] = finish(g, ax.precision);
                d[2] = finish(b, ax.precision);
            }
            return;
        }
        for x in 0..new_w {
            let (x0, k) = ax.taps(x);
            for ch in 0..c {
                let mut acc = init;
                for (j, &wt) in k.iter().enumerate() {
                    acc += s[(x0 + j) * c + ch] as i32 * wt as i32;
                }
                dst[x * c + ch] = finish(acc, ax.precision);
            }
        }
    };
    if out.len() >= PAR_MIN_BYTES {
        out.par_chunks_mut(new_w * c).enumerate().for_each(row);
    } else {
        out.chunks_mut(new_w * c).enumerate().for_each(row);
    }
    out
}

fn vertical(src: &[u8], row_len: usize, h: usize, new_h: usize) -> Vec<u8> {
    let ax = AxisWeights::new(h, new_h);
    let init = 1i32 << (ax.precision - 1);
    let mut out = vec![0u8; new_h * row_len];
    let row = |(y, dst): (usize, &mut [u8])| {
        let (y0, k) = ax.taps(y);
        let mut acc = vec![init; row_len];
        for (j, &wt) in k.iter().enumerate() {
            let s = &src[(y0 + j) * row_len..(y0 + j + 1) * row_len];
            let wt = wt as i32;
            for (a, &p) in acc.iter_mut().zip(s) {
                *a += p as i32 * wt;
            }
        }
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = finish(a, ax.precision);
        }
    };
    if out.len() >= PAR_MIN_BYTES {
        out.par_chunks_mut(row_len).enumerate().for_each(row);
    } else {
        out.chunks_mut(row_len).enumerate().for_each(row);
    }
    out
}

/// Resizes an interleaved RGB8 (HWC) image exactly like torch 2.11's CPU
/// `interpolate(uint8, mode="bicubic", antialias=True, align_corners=False)`.
pub fn resize_bicubic_aa_u8(rgb_hwc: &[u8], w: usize, h: usize, new_w: usize, new_h: usize) -> Vec<u8> {
    resize_bicubic_aa_u8_channels(rgb_hwc, w, h, 3, new_w, new_h)
}

/// [`resize_bicubic_aa_u8`] for any number of interleaved channels (channels are independent).
pub fn resize_bicubic_aa_u8_channels(
    src: &[u8],
    w: usize,
    h: usize,
    channels: usize,
    new_w: usize,
    new_h: usize,
) -> Vec<u8> {
    assert_eq!(src.len(), w * h * channels, "buffer is not {w}x{h}x{channels}");
    assert!(w > 0 && h > 0 && new_w > 0 && new_h > 0, "empty resize {w}x{h} -> {new_w}x{new_h}");
    let tmp;
    let horiz: &[u8] = if new_w != w {
        tmp = horizontal(src, w, h, channels, new_w);
        &tmp
    } else {
        src
    };
    if new_h != h {
        vertical(horiz, new_w * channels, h, new_h)
    } else {
        horiz.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for &(i, o) in &[(37usize, 224usize), (700, 704), (1000, 100), (1, 32), (300, 32), (5, 1)] {
            let ax = AxisWeights::new(i, o);
            assert!(ax.precision >= 1 && ax.precision <= 22);
            for x in 0..o {
                let s: i32 = ax.taps(x).1.iter().map(|&v| v as i32).sum();
                let one = 1i32 << ax.precision;
                assert!((s - one).abs() <= ax.kmax as i32, "{i}->{o} x={x}: {s} vs {one}");
            }
        }
    }

    #[test]
    fn identity_and_constant() {
        let img: Vec<u8> = (0..5 * 4 * 3).map(|v| (v * 7) as u8).collect();
        assert_eq!(resize_bicubic_aa_u8(&img, 5, 4, 5, 4), img);
        let flat = vec![77u8; 9 * 7 * 3];
        assert!(resize_bicubic_aa_u8(&flat, 9, 7, 64, 32).iter().all(|&v| v == 77));
        assert!(resize_bicubic_aa_u8(&flat, 9, 7, 2, 3).iter().all(|&v| v == 77));
    }
}
