//! Row norms in f32: RMSNorm, LayerNorm and the DeltaNet's gated RMSNorm. CPU twins of
//! kernels/norm.cu (src/backend/cuda/norm.rs).

use super::elementwise::silu;
use rayon::prelude::*;

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
