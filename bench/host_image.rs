//! Host time of one large photo (not a test: timings are recorded, never asserted): what the CPU
//! does for a 4096² JPEG before and while the vision tower runs — decoding, the processor's
//! resize + normalise + patchify into f32 `pixel_values` (what the reference hands its vision
//! tower), and the copy of those rows into one buffer for the upload — against the resized 8-bit
//! pixels alone, which is all a device-side patchify needs.
//!
//! `cargo run --release --example bench_host_image -- [--side 4096] [--out FILE]`

use imajev_serve::engine::positions;
use imajev_serve::image::{decode_image, load_and_preprocess, preprocess, ImageLimits, ImageProcessorConfig};
use serde_json::json;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

/// A deterministic photo-like image: smooth gradients plus a little noise (as bench/gpu_bench.py
/// makes its photos), so the JPEG has realistic entropy.
fn photo(side: usize) -> Vec<u8> {
    let mut rgb = vec![0u8; side * side * 3];
    let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
    for y in 0..side {
        for x in 0..side {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let n = (s % 13) as i32 - 6;
            let i = (y * side + x) * 3;
            let v = [(x * 255 / side) as i32, (y * 255 / side) as i32, ((x + y) * 127 / side) as i32];
            for c in 0..3 {
                rgb[i + c] = (v[c] + n).clamp(0, 255) as u8;
            }
        }
    }
    rgb
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let side: usize = arg(&args, "--side").map(|s| s.parse()).transpose()?.unwrap_or(4096);
    let out = arg(&args, "--out");
    let rgb = photo(side);
    let mut jpeg = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, 90).encode(
        &rgb,
        side as u32,
        side as u32,
        image::ExtendedColorType::Rgb8,
    )?;
    let cfg = ImageProcessorConfig::default();
    let limits = ImageLimits::default();
    let runs = 5;
    let time = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let mut v = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            f()?;
            v.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(median(v))
    };
    let decoded = decode_image(&jpeg, &limits)?;
    let decode_ms = time(&mut || {
        decode_image(&jpeg, &limits)?;
        Ok(())
    })?;
    let patched = preprocess(&decoded, &cfg)?;
    // What the server keeps per image now: the resized pixels and the normalise table (here from
    // borrowed pixels, so a photo of the processor's size is copied).
    let resized_ms = time(&mut || {
        preprocess(&decoded, &cfg)?;
        Ok(())
    })?;
    // What the server runs per image: decode, then the processor on the pixels it may keep.
    let load_ms = time(&mut || {
        load_and_preprocess(&jpeg, &limits, &cfg)?;
        Ok(())
    })?;
    // What it made before (and what the CPU backend still makes, in the engine): the f32 rows.
    let pixel_values = patched.pixel_values();
    let rows_ms = time(&mut || {
        std::hint::black_box(patched.pixel_values());
        Ok(())
    })?;
    // And what the engine then did with the rows of a two-image request: one buffer, one upload.
    let concat_ms = time(&mut || {
        let mut all = Vec::new();
        all.extend_from_slice(&pixel_values);
        all.extend_from_slice(&pixel_values);
        std::hint::black_box(&all);
        Ok(())
    })?;
    // The engine's other host tables for the tower: position-embedding taps and rotary tables
    // (head dim 64, θ = 10000, a 48-side position grid: the Qwen3.5 vision tower).
    let grid = patched.grid_thw;
    let tables_ms = time(&mut || {
        let (i, w) = positions::pos_embed_taps(grid, patched.merge_size, 48);
        let coords = positions::patch_coords(grid, patched.merge_size);
        let (c, s) = positions::vision_rope_tables(&coords, 64, 10000.0);
        std::hint::black_box((i, w, c, s));
        Ok(())
    })?;
    // Of which the rotary tables (what the tower keeps on the device for the next photo of the
    // same size).
    let rope_ms = time(&mut || {
        let coords = positions::patch_coords(grid, patched.merge_size);
        std::hint::black_box(positions::vision_rope_tables(&coords, 64, 10000.0));
        Ok(())
    })?;
    let f32_mb = pixel_values.len() as f64 * 4.0 / 1e6;
    let u8_mb = (patched.resized_hw.0 * patched.resized_hw.1 * 3) as f64 / 1e6;
    println!(
        "{side}² JPEG ({:.1} MB): decode {decode_ms:.1} ms, resize to u8 {resized_ms:.1} ms ({u8_mb:.0} MB), \
         decode + processor as the server runs them {load_ms:.1} ms, \
         f32 rows from it {rows_ms:.1} ms ({f32_mb:.0} MB), two images' rows into one buffer {concat_ms:.1} ms, position and rotary tables {tables_ms:.1} ms \
         (rotary {rope_ms:.1} ms)",
        jpeg.len() as f64 / 1e6
    );
    let doc = json!({
        "what": "host time of one photo: decode, resize to u8 (what is kept), decode + resize as the server runs them (load_and_preprocess: no copy when no resize is needed), f32 pixel_values rows from it (what was kept before), the two-image concat the engine did before its upload",
        "command": format!("cargo run --release --example bench_host_image -- --side {side}"),
        "threads": rayon::current_num_threads(),
        "side": side,
        "jpeg_bytes": jpeg.len(),
        "runs": runs,
        "decode_median_ms": decode_ms,
        "rows_f32_median_ms": rows_ms,
        "rows_f32_mb": f32_mb,
        "resized_u8_median_ms": resized_ms,
        "load_and_preprocess_median_ms": load_ms,
        "resized_u8_mb": u8_mb,
        "two_image_concat_median_ms": concat_ms,
        "position_rotary_tables_median_ms": tables_ms,
        "rotary_tables_median_ms": rope_ms,
    });
    if let Some(out) = out {
        std::fs::write(&out, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    Ok(())
}
