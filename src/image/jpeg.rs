//! JPEG pixels through libjpeg-turbo's decoder (the `mozjpeg` crate: mozjpeg is a fork of
//! libjpeg-turbo, built from vendored C sources by `cc`; nasm only speeds it up when present).
//!
//! Exists because Pillow decodes JPEG with libjpeg-turbo (3.2 in Pillow 13) and the pure-Rust
//! decoder in the `image` crate (zune-jpeg) does not reproduce it: on the parity fixtures it
//! differs on ~27 % of the bytes of a 4:2:0 image (up to 7 LSB; its IDCT, chroma upsampling and
//! YCbCr→RGB rounding are all its own), and even 0.7 % of a grayscale image. libjpeg-turbo's
//! accurate integer IDCT (`JDCT_ISLOW`), fancy upsampling and table-driven colour conversion
//! are bit-identical between its C and SIMD code paths and across the 2.x/3.x releases for
//! baseline and progressive 8-bit JPEG, so decoding with the same settings Pillow uses
//! (defaults; `out_color_space` RGB, L or CMYK) gives Pillow's bytes.
//!
//! Colour handling follows Pillow's `JpegImagePlugin`: 1 component → L (replicated to RGB);
//! 3 components → libjpeg's RGB conversion (YCbCr or RGB per JFIF/Adobe markers); 4 components
//! → CMYK, always read as Adobe-inverted (`CMYK;I`) and converted with Pillow's `cmyk2rgb`.
//! libjpeg errors unwind out of the C code (mozjpeg's design) and are caught here.

use std::panic::{catch_unwind, AssertUnwindSafe};

use mozjpeg::ColorSpace as Cs;

use super::buffer::pixel_buffer;
use super::jpeg_bands::decode_rgb_in_bands;

/// Pillow `MULDIV255`.
#[inline]
fn muldiv255(a: i32, b: i32) -> i32 {
    let t = a * b + 128;
    ((t >> 8) + t) >> 8
}

/// Pillow `cmyk2rgb` after the `CMYK;I` unpacker (which inverts all four channels).
fn cmyk_inverted_to_rgb(cmyk: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(cmyk.len() / 4 * 3);
    for p in cmyk.chunks_exact(4) {
        let (c, m, y, k) = (255 - p[0] as i32, 255 - p[1] as i32, 255 - p[2] as i32, 255 - p[3] as i32);
        let nk = 255 - k;
        for v in [c, m, y] {
            out.push((nk - muldiv255(v, nk)).clamp(0, 255) as u8);
        }
    }
    out
}

/// Every scanline of a started decompression, `components` bytes a pixel, into a
/// [`pixel_buffer`] (mozjpeg's `read_scanlines` into a buffer whose pages are advised huge: the
/// page faults of a fresh 50 MB buffer were ~30% of a 4096² photo's decode).
fn read_all<R: std::io::BufRead>(
    s: &mut mozjpeg::decompress::DecompressStarted<R>,
    components: usize,
) -> std::io::Result<Vec<u8>> {
    let len = s.width() * s.height() * components;
    let mut px = pixel_buffer(len).map_err(|_| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
    let read = s.read_scanlines_into_uninit(&mut px.spare_capacity_mut()[..len])?.len();
    // SAFETY: read_scanlines_into_uninit initialised the first `read` (= len) bytes it returned.
    unsafe { px.set_len(read.min(len)) };
    Ok(px)
}

/// Decodes to RGB8 HWC, returning `(rgb, width, height)`; `Err` carries libjpeg's message. A large
/// single-scan colour JPEG is decoded in bands on several threads ([`decode_rgb_in_bands`]: the same
/// bytes); anything else, and anything a band met a warning or error in, on this thread.
pub(crate) fn decode_rgb(bytes: &[u8]) -> Result<(Vec<u8>, usize, usize), String> {
    if let Some(decoded) = decode_rgb_in_bands(bytes, |len| pixel_buffer(len).ok()) {
        return Ok(decoded);
    }
    let run = || -> std::io::Result<(Vec<u8>, usize, usize)> {
        let d = mozjpeg::Decompress::new_mem(bytes)?;
        let (w, h) = d.size();
        let ncomp = d.components().len();
        let (px, kind) = match ncomp {
            1 => {
                let mut s = d.grayscale()?;
                let px = read_all(&mut s, 1)?;
                s.finish()?;
                (px, 1)
            }
            4 => {
                let mut s = d.to_colorspace(Cs::JCS_CMYK)?;
                let px = read_all(&mut s, 4)?;
                s.finish()?;
                (px, 4)
            }
            3 => {
                let mut s = d.rgb()?;
                let px = read_all(&mut s, 3)?;
                s.finish()?;
                (px, 3)
            }
            n => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    format!("cannot handle {n}-layer images"),
                ))
            }
        };
        let rgb = match kind {
            1 => px.iter().flat_map(|&v| [v, v, v]).collect(),
            4 => cmyk_inverted_to_rgb(&px),
            _ => px,
        };
        if rgb.len() != w * h * 3 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short image data"));
        }
        Ok((rgb, w, h))
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => Err(panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "libjpeg error".into())),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cmyk_formula_matches_pillow_examples() {
        // Pillow: Image.new("CMYK", (1,1), (c,m,y,k)).convert("RGB") with inverted storage.
        // White (no ink) is stored as 255s in Adobe-inverted CMYK.
        assert_eq!(super::cmyk_inverted_to_rgb(&[255, 255, 255, 255]), vec![255, 255, 255]);
        assert_eq!(super::cmyk_inverted_to_rgb(&[0, 0, 0, 0]), vec![0, 0, 0]);
    }
}
