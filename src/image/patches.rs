//! Rescale + normalise in float32 and cut into merge-ordered patches (`pixel_values`).
//!
//! [`preprocess_rgb`] stops at the resized 8-bit pixels and the normalisation table; the rows are
//! cut where they are used ([`patchify`] on the CPU, the `image_patches` kernel on the GPU).
//!
//! Exists because the order and the float32 rounding must match transformers exactly:
//!
//! * `TorchvisionBackend.rescale_and_normalize` fuses the two steps: `mean' = f32(mean) ·
//!   f32(1/rescale_factor)` and `std' = f32(std) · f32(1/rescale_factor)` (float32 tensor times a
//!   Python float: torch converts the scalar to float32 and multiplies in float32), then
//!   `(f32(x) − mean') / std'` in float32 — `(x − 127.5) / 127.5` for Qwen3.5, which is exact
//!   up to the one rounding of the division.
//! * `Qwen2VLImageProcessor.patchify`: rows run over merge-block row, merge-block column,
//!   in-block row, in-block column; each row holds `[channel][temporal][patch row][patch col]`,
//!   the temporal axis being the same frame repeated `temporal_patch_size` times.

use super::{
    resize::resize_bicubic_aa_u8, resize::smart_resize, DecodedImage, ImageError, ImageProcessorConfig,
};
use std::borrow::Cow;

/// The processor's output for one image: the resized 8-bit pixels and what turns them into rows.
///
/// The f32 rows themselves (`pixel_values`, 1536 values per patch: 400 MB for a 4096² photo,
/// eight times its pixels) are not kept: [`PatchedImage::pixel_values`] computes them for the
/// CPU and the goldens, and the CUDA backend cuts them on the device from the uploaded pixels
/// (`Backend::image_patches`) — the same values, looked up in the same table.
#[derive(Debug, Clone)]
pub struct PatchedImage {
    /// The image after smart_resize, RGB8 HWC `[resized_h, resized_w, 3]`.
    pub rgb: Vec<u8>,
    /// Per channel, `u8 → f32` of the processor's fused rescale + normalise.
    pub lut: [[f32; 256]; 3],
    /// `image_grid_thw = [1, H/patch, W/patch]`.
    pub grid_thw: [usize; 3],
    /// Size after smart_resize, `(height, width)`.
    pub resized_hw: (usize, usize),
    /// `3 · temporal_patch_size · patch_size²`.
    pub patch_dim: usize,
    /// `patch_size` (pixels per patch side).
    pub patch_size: usize,
    /// `temporal_patch_size` (copies of the frame in each row).
    pub temporal_patch_size: usize,
    /// `merge_size` (for [`PatchedImage::merged_tokens`]).
    pub merge_size: usize,
}

impl PatchedImage {
    /// Number of `<|image_pad|>` tokens this image takes after the vision merger:
    /// `grid_t · grid_h · grid_w / merge²`.
    pub fn merged_tokens(&self) -> usize {
        let [t, h, w] = self.grid_thw;
        t * h * w / (self.merge_size * self.merge_size)
    }

    /// Rows of `pixel_values` (`grid_t · grid_h · grid_w`).
    pub fn n_patches(&self) -> usize {
        self.grid_thw.iter().product()
    }

    /// The transformers processor's `pixel_values`, `[n_patches, patch_dim]` row-major.
    pub fn pixel_values(&self) -> Vec<f32> {
        let mut pv = vec![0f32; self.n_patches() * self.patch_dim];
        self.write_pixel_values(&mut pv);
        pv
    }

    /// [`PatchedImage::pixel_values`] into `out` (`n_patches · patch_dim` values).
    pub fn write_pixel_values(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.n_patches() * self.patch_dim, "pixel_values buffer size");
        patchify(
            &self.rgb,
            self.resized_hw.1,
            &self.lut,
            PatchGeometry {
                patch: self.patch_size,
                temporal: self.temporal_patch_size,
                merge: self.merge_size,
            },
            out,
        );
    }

    /// `pixel_values` as little-endian bytes (what the goldens hash).
    pub fn pixel_values_le_bytes(&self) -> Vec<u8> {
        self.pixel_values().iter().flat_map(|v| v.to_le_bytes()).collect()
    }
}

/// How an image is cut into rows: square patches of `patch` pixels, each row holding the patch
/// `temporal` times, rows in `merge × merge` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatchGeometry {
    pub patch: usize,
    pub temporal: usize,
    pub merge: usize,
}

impl PatchGeometry {
    /// Values per row: `3 · temporal · patch²`.
    pub fn row_len(&self) -> usize {
        3 * self.temporal * self.patch * self.patch
    }
}

/// Cuts an RGB8 HWC image `width` pixels wide into merge-ordered patch rows of `lut` values
/// (`Qwen2VLImageProcessor.patchify`): rows run over merge-block row, merge-block column, in-block
/// row, in-block column; each row is `[channel][temporal][patch row][patch col]`. `out` holds
/// `(height/patch) · (width/patch)` rows. The CPU twin of the CUDA kernel `image_patches`.
pub fn patchify(rgb: &[u8], width: usize, lut: &[[f32; 256]; 3], g: PatchGeometry, out: &mut [f32]) {
    let (ps, m, tp) = (g.patch, g.merge, g.temporal);
    let patch_dim = g.row_len();
    let plane = tp * ps * ps;
    let gw = width / ps;
    // One merge-block row (m patch rows of the grid) is a contiguous run of m·gw output rows.
    let block_row_len = m * gw * patch_dim;
    let fill = |(bh, out): (usize, &mut [f32])| {
        for (r, dst) in out.chunks_exact_mut(patch_dim).enumerate() {
            // r = (bw·m + mh)·m + mw within this merge-block row
            let (bw, mh, mw) = (r / (m * m), r / m % m, r % m);
            let y0 = (bh * m + mh) * ps;
            let x0 = (bw * m + mw) * ps;
            for (c, table) in lut.iter().enumerate() {
                let base = c * plane;
                for py in 0..ps {
                    let start = ((y0 + py) * width + x0) * 3;
                    let src = &rgb[start..start + ps * 3];
                    let d = &mut dst[base + py * ps..base + (py + 1) * ps];
                    for (o, p) in d.iter_mut().zip(src.chunks_exact(3)) {
                        *o = table[p[c] as usize];
                    }
                }
                // the temporal copies repeat the frame
                for t in 1..tp {
                    dst.copy_within(base..base + ps * ps, base + t * ps * ps);
                }
            }
        }
    };
    if out.len() >= 1 << 20 {
        use rayon::prelude::*;
        out.par_chunks_mut(block_row_len).enumerate().for_each(fill);
    } else {
        out.chunks_mut(block_row_len).enumerate().for_each(fill);
    }
}

/// Per-channel lookup table `u8 → f32` with torch's float32 arithmetic.
pub(crate) fn normalize_lut(cfg: &ImageProcessorConfig) -> [[f32; 256]; 3] {
    let mut lut = [[0f32; 256]; 3];
    for (c, table) in lut.iter_mut().enumerate() {
        for (v, out) in table.iter_mut().enumerate() {
            let x = v as f32;
            *out = if cfg.do_normalize {
                let (mean, std) = if cfg.do_rescale {
                    let inv = (1.0 / cfg.rescale_factor) as f32;
                    (cfg.image_mean[c] as f32 * inv, cfg.image_std[c] as f32 * inv)
                } else {
                    (cfg.image_mean[c] as f32, cfg.image_std[c] as f32)
                };
                (x - mean) / std
            } else if cfg.do_rescale {
                x * cfg.rescale_factor as f32
            } else {
                x
            };
        }
    }
    lut
}

/// Full processor on an RGB8 HWC buffer: smart_resize → bicubic AA resize, with the normalise
/// table and the patch geometry that turn the result into `pixel_values`.
pub fn preprocess_rgb(
    rgb_hwc: &[u8],
    width: usize,
    height: usize,
    cfg: &ImageProcessorConfig,
) -> Result<PatchedImage, ImageError> {
    preprocess_pixels(Cow::Borrowed(rgb_hwc), width, height, cfg)
}

/// [`preprocess_rgb`] on pixels it may keep: an image already of the processor's size (a 4096²
/// photo is) becomes the result's pixels without a copy (50 MB there: ~20 ms of copying and
/// page faults on the request's critical path, `bench_host_image`).
pub fn preprocess_owned(
    rgb_hwc: Vec<u8>,
    width: usize,
    height: usize,
    cfg: &ImageProcessorConfig,
) -> Result<PatchedImage, ImageError> {
    preprocess_pixels(Cow::Owned(rgb_hwc), width, height, cfg)
}

fn preprocess_pixels(
    rgb_hwc: Cow<'_, [u8]>,
    width: usize,
    height: usize,
    cfg: &ImageProcessorConfig,
) -> Result<PatchedImage, ImageError> {
    cfg.validate()?;
    if rgb_hwc.len() != width * height * 3 {
        return Err(ImageError::Config(format!(
            "RGB buffer has {} bytes, expected {width}x{height}x3",
            rgb_hwc.len()
        )));
    }
    let (ps, m, tp) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (rh, rw) = if cfg.do_resize {
        smart_resize(height, width, cfg.factor(), cfg.min_pixels, cfg.max_pixels)?
    } else {
        if width == 0 || height == 0 {
            return Err(ImageError::Empty { width: width as u64, height: height as u64 });
        }
        (height, width)
    };
    if rh % (ps * m) != 0 || rw % (ps * m) != 0 {
        return Err(ImageError::Config(format!(
            "image of {rw}x{rh} is not a multiple of patch_size·merge_size = {} (do_resize is off)",
            ps * m
        )));
    }
    let rgb = if (rh, rw) != (height, width) {
        resize_bicubic_aa_u8(&rgb_hwc, width, height, rw, rh)
    } else {
        rgb_hwc.into_owned()
    };
    Ok(PatchedImage {
        rgb,
        lut: normalize_lut(cfg),
        grid_thw: [1, rh / ps, rw / ps],
        resized_hw: (rh, rw),
        patch_dim: 3 * tp * ps * ps,
        patch_size: ps,
        temporal_patch_size: tp,
        merge_size: m,
    })
}

/// [`preprocess_rgb`] on a decoded image.
pub fn preprocess(img: &DecodedImage, cfg: &ImageProcessorConfig) -> Result<PatchedImage, ImageError> {
    preprocess_rgb(&img.rgb, img.width as usize, img.height as usize, cfg)
}

/// The resized uint8 image (HWC) the processor works on — for tests and debugging.
pub fn resized_rgb(
    img: &DecodedImage,
    cfg: &ImageProcessorConfig,
) -> Result<(usize, usize, Vec<u8>), ImageError> {
    let (w, h) = (img.width as usize, img.height as usize);
    let (rh, rw) = smart_resize(h, w, cfg.factor(), cfg.min_pixels, cfg.max_pixels)?;
    let out = if (rh, rw) != (h, w) { resize_bicubic_aa_u8(&img.rgb, w, h, rw, rh) } else { img.rgb.clone() };
    Ok((rh, rw, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_pixels_give_what_borrowed_ones_do() {
        // 64x64 (a multiple of 32: kept as is, moved) and 70x45 (resized), default processor.
        let cfg = ImageProcessorConfig { min_pixels: 32 * 32, ..Default::default() };
        for (w, h) in [(64usize, 64usize), (70, 45)] {
            let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 251) as u8).collect();
            let borrowed = preprocess_rgb(&rgb, w, h, &cfg).unwrap();
            let owned = preprocess_owned(rgb.clone(), w, h, &cfg).unwrap();
            assert_eq!(owned.grid_thw, borrowed.grid_thw, "{w}x{h}");
            assert_eq!(owned.pixel_values_le_bytes(), borrowed.pixel_values_le_bytes(), "{w}x{h}");
        }
    }

    #[test]
    fn layout_matches_patchify() {
        // 64x64 image whose pixel (y, x, c) = distinct small value; no resize needed (64 < min
        // pixels would upscale, so switch resize off).
        let (w, h) = (64usize, 64usize);
        let rgb: Vec<u8> = (0..h * w * 3).map(|i| ((i / 3 % 97) + (i % 3) * 50) as u8).collect();
        let cfg = ImageProcessorConfig { do_resize: false, ..Default::default() };
        let p = preprocess_rgb(&rgb, w, h, &cfg).unwrap();
        assert_eq!(p.grid_thw, [1, 4, 4]);
        let pv = p.pixel_values();
        assert_eq!(p.merged_tokens(), 4);
        let lut = normalize_lut(&cfg);
        // row r = ((bh*2 + bw)*2 + mh)*2 + mw for gw/2 = 2
        for (bh, bw, mh, mw) in [(0, 0, 0, 0), (0, 1, 1, 0), (1, 0, 0, 1), (1, 1, 1, 1)] {
            let r = ((bh * 2 + bw) * 2 + mh) * 2 + mw;
            for (c, t, py, px) in [(0, 0, 0, 0), (1, 1, 3, 15), (2, 0, 15, 7), (2, 1, 15, 7)] {
                let y = (bh * 2 + mh) * 16 + py;
                let x = (bw * 2 + mw) * 16 + px;
                let v = pv[r * 1536 + ((c * 2 + t) * 16 + py) * 16 + px];
                assert_eq!(v, lut[c][rgb[(y * w + x) * 3 + c] as usize]);
            }
        }
    }

    #[test]
    fn qwen_normalisation_is_x_over_127_5_minus_1() {
        let lut = normalize_lut(&ImageProcessorConfig::default());
        for (v, &x) in lut[0].iter().enumerate() {
            assert_eq!(x, (v as f32 - 127.5) / 127.5);
        }
        assert_eq!(lut[1][0], -1.0);
        assert_eq!(lut[2][255], 1.0);
    }
}
