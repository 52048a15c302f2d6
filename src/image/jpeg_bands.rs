//! A large baseline JPEG decoded in bands of rows on several threads, with the bytes of the
//! one-thread decode.
//!
//! Why: a JPEG's entropy-coded data is one serial bit stream (no restart markers in most
//! photos), so libjpeg-turbo decodes a 4096² photo on one core: ~40 ms of the development host's
//! time, ~100 ms or more on the device host, on the critical path of every photo request before
//! the vision tower can start. About 60% of that is the entropy decoding and 40% the IDCT,
//! upsampling and colour conversion of the rows. `jpeg_skip_scanlines` entropy-decodes rows but
//! skips their IDCT and colour work, so band k of n runs its own decompressor that skips the rows
//! before its band and decodes its own: band 0 takes the top rows whole, later bands skip more and
//! decode fewer ([`band_edges`] sizes them so that they end together), and the decode takes ~62%
//! of its one-thread time with 4 bands. The rows are libjpeg-turbo's own bytes either way
//! (`jpeg_skip_scanlines` keeps the upsampling context; checked against the one-thread decode in
//! the tests below at every band edge, for 4:4:4, 4:2:2, 4:2:0 and 4:4:0 sampling).
//!
//! What this layer does not do: anything but clean, single-scan, three-component JPEGs. Any
//! libjpeg warning in any band (corrupt or truncated data, which libjpeg would patch over), or a
//! band that cannot skip or read all its rows, makes [`decode_rgb_in_bands`] return `None`, and the
//! caller decodes on one thread as before, so its errors and messages are unchanged. The raw API is
//! used because the `mozjpeg` crate exposes no way to skip rows.

use std::mem::MaybeUninit;
use std::panic::{catch_unwind, AssertUnwindSafe};

use mozjpeg_sys as ffi;
use rayon::prelude::*;

/// Images below this many pixels decode on one thread (a band's own header parse and start-up
/// cost more than they save).
pub(crate) const BANDED_MIN_PIXELS: usize = 1 << 21;

/// Bands a decode is split into at most: with the entropy decoding ~60% of the work, 4 bands
/// already end at ~62% of the one-thread time (8 would give ~60%).
pub(crate) const MAX_BANDS: usize = 4;

/// The share of a decode's time its entropy decoding takes (what skipping a row still costs), the
/// model [`band_edges`] balances with; measured 0.62 for a 4096² q90 4:2:0 photo.
const ENTROPY_SHARE: f64 = 0.6;

/// Row edges of `n` bands over `height` rows (`n + 1` edges, 0 first, `height` last) so that
/// every band takes about the same time when skipping a row costs [`ENTROPY_SHARE`] of decoding
/// it: band k, from row s to row e, costs ENTROPY_SHARE·s + (e − s), so with all costs equal to τ,
/// e = (1 − ENTROPY_SHARE)·s + τ, and τ is what makes the last band end at `height`. Empty bands
/// are dropped (a very short image has fewer edges).
pub(crate) fn band_edges(height: usize, n: usize) -> Vec<usize> {
    let keep = 1.0 - ENTROPY_SHARE;
    let tau = ENTROPY_SHARE / (1.0 - keep.powi(n as i32));
    let mut edges = vec![0usize];
    let mut start = 0.0f64;
    for k in 0..n {
        let end = if k + 1 == n { 1.0 } else { keep * start + tau };
        let row = ((end * height as f64).round() as usize).min(height);
        if row > *edges.last().unwrap() {
            edges.push(row);
        }
        start = end;
    }
    if *edges.last().unwrap() != height {
        edges.push(height);
    }
    edges
}

/// A decompressor of the raw API with its error manager, destroyed on drop (also after an
/// error unwound out of libjpeg, which leaves it in a state `jpeg_destroy_decompress` accepts).
struct Decompressor {
    cinfo: Box<ffi::jpeg_decompress_struct>,
    err: Box<ffi::jpeg_error_mgr>,
}

/// What an error exit unwinds with (the caller falls back; the message is the one-thread path's).
struct Fatal;

extern "C-unwind" fn error_exit(_cinfo: &mut ffi::jpeg_common_struct) {
    std::panic::resume_unwind(Box::new(Fatal));
}

/// Counts warnings (level −1: corrupt data, premature end) without printing; traces are ignored.
extern "C-unwind" fn emit_message(cinfo: &mut ffi::jpeg_common_struct, level: std::os::raw::c_int) {
    if level < 0 {
        // SAFETY: `err` is the error manager this decompressor was created with (a live Box).
        unsafe { (*cinfo.err).num_warnings += 1 };
    }
}

impl Decompressor {
    /// A decompressor over `bytes` with its header read, nothing decoded yet.
    fn open(bytes: &[u8]) -> Decompressor {
        // SAFETY: both structs are zeroed as libjpeg expects before jpeg_std_error /
        // jpeg_create_decompress fill them; they are boxed so the pointers libjpeg keeps (cinfo.err,
        // and its own pools' back-references through the cinfo it is handed) stay valid; `bytes`
        // outlives the decompressor (it is dropped before decode_rgb_in_bands returns).
        unsafe {
            let mut err: Box<ffi::jpeg_error_mgr> = Box::new(std::mem::zeroed());
            ffi::jpeg_std_error(&mut err);
            err.error_exit = Some(error_exit);
            err.emit_message = Some(emit_message);
            let mut cinfo: Box<ffi::jpeg_decompress_struct> = Box::new(std::mem::zeroed());
            cinfo.common.err = &mut *err;
            ffi::jpeg_create_decompress(&mut *cinfo);
            let mut d = Decompressor { cinfo, err };
            ffi::jpeg_mem_src(&mut d.cinfo, bytes.as_ptr(), bytes.len() as std::os::raw::c_ulong);
            ffi::jpeg_read_header(&mut d.cinfo, 1);
            d
        }
    }

    /// [`Self::open`], then RGB output started (for a single-scan file this reads no entropy data;
    /// for a multi-scan one it would read them all, which is why [`banded_size`] only opens).
    fn start(bytes: &[u8]) -> Decompressor {
        let mut d = Self::open(bytes);
        d.cinfo.out_color_space = ffi::J_COLOR_SPACE::JCS_RGB;
        // SAFETY: a decompressor with its header read.
        unsafe { ffi::jpeg_start_decompress(&mut d.cinfo) };
        d
    }

    /// Whether libjpeg warned (corrupt or missing data it patched over).
    fn warned(&self) -> bool {
        self.err.num_warnings != 0
    }
}

impl Drop for Decompressor {
    fn drop(&mut self) {
        // SAFETY: the struct was created by jpeg_create_decompress and is destroyed once.
        unsafe { ffi::jpeg_destroy_decompress(&mut self.cinfo) };
    }
}

/// Whether `bytes` is a JPEG worth decoding in bands: three components, one scan (not
/// progressive), at least [`BANDED_MIN_PIXELS`]; `Some((width, height))` then.
fn banded_size(bytes: &[u8]) -> Option<(usize, usize)> {
    catch_unwind(AssertUnwindSafe(|| {
        // The header only: starting the output would decode a progressive file's every scan.
        let d = Decompressor::open(bytes);
        let c = &d.cinfo;
        // SAFETY: a decompressor with its header read (what jpeg_has_multiple_scans needs).
        let multi_scan = unsafe { ffi::jpeg_has_multiple_scans(c) } != 0;
        let (w, h) = (c.image_width as usize, c.image_height as usize);
        (c.num_components == 3 && !multi_scan && w * h >= BANDED_MIN_PIXELS && !d.warned()).then_some((w, h))
    }))
    .ok()
    .flatten()
}

/// Rows `start .. start + out.len() / row_bytes` of the RGB output into `out`; false on any
/// libjpeg error or warning, or if the rows could not all be skipped and read.
fn decode_band(bytes: &[u8], start: usize, row_bytes: usize, out: &mut [MaybeUninit<u8>]) -> bool {
    catch_unwind(AssertUnwindSafe(|| {
        let mut d = Decompressor::start(bytes);
        if d.cinfo.output_width as usize * d.cinfo.output_components as usize != row_bytes {
            return false;
        }
        // SAFETY: a started decompressor whose rows are row_bytes long (checked above); each row
        // pointer names row_bytes writable bytes of `out`.
        unsafe {
            if start > 0 && ffi::jpeg_skip_scanlines(&mut d.cinfo, start as ffi::JDIMENSION) as usize != start
            {
                return false;
            }
            for row in out.chunks_exact_mut(row_bytes) {
                let mut ptr = row.as_mut_ptr().cast::<ffi::JSAMPLE>();
                if ffi::jpeg_read_scanlines(&mut d.cinfo, &mut ptr, 1) != 1 {
                    return false;
                }
            }
            ffi::jpeg_abort_decompress(&mut d.cinfo);
        }
        !d.warned()
    }))
    .unwrap_or(false)
}

/// The RGB8 rows of a large single-scan three-component JPEG decoded in bands on the rayon pool,
/// into a buffer from `alloc(len)`; `None` when the image is not one (or is too small, or the
/// pool has one thread) or any band met an error or warning: decode it on one thread then.
pub(crate) fn decode_rgb_in_bands(
    bytes: &[u8],
    alloc: impl FnOnce(usize) -> Option<Vec<u8>>,
) -> Option<(Vec<u8>, usize, usize)> {
    let threads = rayon::current_num_threads();
    if threads < 2 {
        return None;
    }
    let (w, h) = banded_size(bytes)?;
    let row_bytes = w * 3;
    let edges = band_edges(h, threads.min(MAX_BANDS));
    let mut px = alloc(row_bytes * h)?;
    let mut bands = Vec::with_capacity(edges.len() - 1);
    let mut rest = &mut px.spare_capacity_mut()[..row_bytes * h];
    for pair in edges.windows(2) {
        let (band, tail) = rest.split_at_mut((pair[1] - pair[0]) * row_bytes);
        bands.push((pair[0], band));
        rest = tail;
    }
    let ok = bands.into_par_iter().map(|(start, out)| decode_band(bytes, start, row_bytes, out)).all(|b| b);
    if !ok {
        return None;
    }
    // SAFETY: the bands cover rows 0..h and each wrote all its rows (decode_band returned true).
    unsafe { px.set_len(row_bytes * h) };
    Some((px, w, h))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A photo-like RGB pattern (gradients and noise) of w x h.
    fn pattern(w: usize, h: usize) -> Vec<u8> {
        let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rgb = vec![0u8; w * h * 3];
        for y in 0..h {
            for x in 0..w {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let n = (s % 31) as i32 - 15;
                let v = [(x * 255 / w) as i32, (y * 255 / h) as i32, ((x * y / 7) % 256) as i32];
                for c in 0..3 {
                    rgb[(y * w + x) * 3 + c] = (v[c] + n).clamp(0, 255) as u8;
                }
            }
        }
        rgb
    }

    /// A baseline JPEG of `pattern(w, h)` at quality 90 by libjpeg-turbo's settings, its chroma
    /// "pixels" `chroma` luma pixels wide and high ((2, 2): 4:2:0, (2, 1): 4:2:2, (1, 2): 4:4:0).
    fn jpeg(w: usize, h: usize, chroma: (u8, u8)) -> Vec<u8> {
        let mut c = mozjpeg::Compress::new(mozjpeg::ColorSpace::JCS_RGB);
        c.set_fastest_defaults();
        c.set_size(w, h);
        c.set_quality(90.0);
        c.set_chroma_sampling_pixel_sizes(chroma, chroma);
        let mut s = c.start_compress(Vec::new()).unwrap();
        s.write_scanlines(&pattern(w, h)).unwrap();
        s.finish().unwrap()
    }

    fn one_thread(bytes: &[u8]) -> Vec<u8> {
        let d = mozjpeg::Decompress::new_mem(bytes).unwrap();
        let mut s = d.rgb().unwrap();
        let px: Vec<u8> = s.read_scanlines().unwrap();
        s.finish().unwrap();
        px
    }

    #[test]
    fn band_edges_cover_the_rows_and_balance_skipping_against_decoding() {
        assert_eq!(band_edges(4096, 1), vec![0, 4096]);
        let e = band_edges(4096, 2);
        assert_eq!(e.len(), 3);
        assert!((2900..3000).contains(&e[1]), "{e:?}"); // τ = 0.6 / 0.84 = 0.714
        for n in 2..=8 {
            let e = band_edges(1000, n);
            assert_eq!((e[0], *e.last().unwrap()), (0, 1000));
            assert!(e.windows(2).all(|p| p[0] < p[1]), "{e:?}");
            // Every band's cost, ENTROPY_SHARE·start + rows, is the first band's within a row.
            let cost = |k: usize| ENTROPY_SHARE * e[k] as f64 + (e[k + 1] - e[k]) as f64;
            assert!((0..e.len() - 1).all(|k| (cost(k) - cost(0)).abs() <= 1.5), "{e:?}");
        }
        assert_eq!(band_edges(3, 4), vec![0, 2, 3]);
    }

    #[test]
    fn bands_give_the_one_thread_bytes_for_every_sampling() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        for (w, h, samp) in
            [(1601, 1313, (2, 2)), (1600, 1312, (1, 1)), (1599, 1315, (2, 1)), (1603, 1311, (1, 2))]
        {
            let bytes = jpeg(w, h, samp);
            let banded = pool.install(|| decode_rgb_in_bands(&bytes, |n| Some(Vec::with_capacity(n))));
            let (px, bw, bh) = banded.unwrap_or_else(|| panic!("{w}x{h} {samp:?} not decoded in bands"));
            assert_eq!((bw, bh), (w, h));
            let reference = one_thread(&bytes);
            assert_eq!(px.len(), reference.len());
            let first_bad = px.iter().zip(&reference).position(|(a, b)| a != b);
            assert_eq!(
                first_bad,
                None,
                "{w}x{h} {samp:?}: first differing byte (row {:?})",
                first_bad.map(|i| i / (w * 3))
            );
        }
    }

    #[test]
    fn small_progressive_or_damaged_images_are_left_to_one_thread() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        let alloc = |n: usize| Some(Vec::with_capacity(n));
        pool.install(|| {
            assert!(decode_rgb_in_bands(&jpeg(640, 480, (2, 2)), alloc).is_none(), "small");
            let mut c = mozjpeg::Compress::new(mozjpeg::ColorSpace::JCS_RGB);
            c.set_size(1600, 1400);
            c.set_progressive_mode();
            let mut s = c.start_compress(Vec::new()).unwrap();
            s.write_scanlines(&pattern(1600, 1400)).unwrap();
            assert!(decode_rgb_in_bands(&s.finish().unwrap(), alloc).is_none(), "progressive");
            let whole = jpeg(1600, 1400, (2, 2));
            assert!(decode_rgb_in_bands(&whole[..whole.len() / 2], alloc).is_none(), "truncated");
            let mut flipped = whole.clone();
            for b in &mut flipped[whole.len() / 3..whole.len() / 3 + 64] {
                *b ^= 0x5a;
            }
            let _ = decode_rgb_in_bands(&flipped, alloc); // a corrupt stream: no panic, either way
            assert!(decode_rgb_in_bands(b"not a jpeg at all", alloc).is_none(), "garbage");
        });
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        assert!(
            one.install(|| decode_rgb_in_bands(&jpeg(1600, 1400, (2, 2)), alloc)).is_none(),
            "one thread"
        );
    }
}
