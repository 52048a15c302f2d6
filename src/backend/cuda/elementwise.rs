//! Row gathers and scatters, column splits, concatenation, residual adds and the activation
//! functions. Kernels: kernels/elementwise.cu; CPU twins: src/backend/cpu/elementwise.rs.

use super::launch::{grid1, launch_config, Arg};
use super::tensor::{Buf, CudaTensor};
use super::CudaBackend;
use crate::backend::{image_patch_rows, Gelu, PatchGeometry, RgbImage};
use anyhow::{bail, ensure, Result};

/// `Backend::embed` (the trait documents the contract).
pub(super) fn embed(be: &CudaBackend, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
    let (v, d) = table.rows_cols();
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= v) {
        bail!("token id {bad} is outside the embedding table ({v} rows)");
    }
    let n = ids.len();
    let tab = be.bf16_of(table)?;
    let ids_d = be.htod(ids)?;
    let y = be.alloc_bf16(n * d)?;
    be.launch(
        "gather_rows",
        launch_config((grid1(n * d, 256), 1, 1), 256, 0),
        &[
            Arg::Ptr(be.p(tab.s())),
            Arg::Ptr(be.p(&ids_d)),
            Arg::Ptr(be.p(&y)),
            Arg::I64(n as i64),
            Arg::I32(d as i32),
        ],
    )?;
    Ok(be.bf16_tensor(y, &[n, d]))
}

/// `Backend::embed_bag` (the trait documents the contract).
pub(super) fn embed_bag(
    be: &CudaBackend,
    table: &CudaTensor,
    idx: &[u32],
    w: &[f32],
    taps: usize,
) -> Result<CudaTensor> {
    let (v, d) = table.rows_cols();
    ensure!(idx.len() == w.len() && taps > 0 && idx.len() % taps == 0, "embed_bag shapes");
    if let Some(&bad) = idx.iter().find(|&&i| i as usize >= v) {
        bail!("embed_bag index {bad} out of range ({v} rows)");
    }
    let n = idx.len() / taps;
    let tab = be.bf16_of(table)?;
    let (idx_d, w_d) = (be.htod(idx)?, be.htod(w)?);
    let y = be.alloc_bf16(n * d)?;
    be.launch(
        "embed_bag",
        launch_config((grid1(n * d, 256), 1, 1), 256, 0),
        &[
            Arg::Ptr(be.p(tab.s())),
            Arg::Ptr(be.p(&idx_d)),
            Arg::Ptr(be.p(&w_d)),
            Arg::Ptr(be.p(&y)),
            Arg::I64(n as i64),
            Arg::I32(d as i32),
            Arg::I32(taps as i32),
        ],
    )?;
    Ok(be.bf16_tensor(y, &[n, d]))
}

/// `Backend::image_patches` (the trait documents the contract): each image's pixels and table
/// uploaded as they are, its rows cut by `image_patches` into its slice of one BF16 buffer — the
/// values `cast_f32_bf16` makes of the host's f32 rows, bit for bit (the same table entries,
/// rounded once).
pub(super) fn image_patches(
    be: &CudaBackend,
    images: &[RgbImage<'_>],
    g: PatchGeometry,
) -> Result<CudaTensor> {
    let rows = image_patch_rows(images, g)?;
    let d = g.row_len();
    let y = be.alloc_bf16(rows * d)?;
    let mut row = 0;
    for im in images {
        let (gh, gw) = (im.height / g.patch, im.width / g.patch);
        let n = gh * gw * d;
        let rgb = be.htod(im.rgb)?;
        let lut: Vec<f32> = im.lut.iter().flatten().copied().collect();
        let lut = be.htod(&lut)?;
        be.launch(
            "image_patches",
            launch_config((grid1(n, 256), 1, 1), 256, 0),
            &[
                Arg::Ptr(be.p(&rgb)),
                Arg::Ptr(be.p(&lut)),
                Arg::Ptr(be.p(&y) + (row * d * std::mem::size_of::<half::bf16>()) as u64),
                Arg::I32(gh as i32),
                Arg::I32(gw as i32),
                Arg::I32(g.patch as i32),
                Arg::I32(g.temporal as i32),
                Arg::I32(g.merge as i32),
            ],
        )?;
        row += gh * gw;
    }
    Ok(be.bf16_tensor(y, &[rows, d]))
}

/// `Backend::scatter_rows` (the trait documents the contract).
pub(super) fn scatter_rows(
    be: &CudaBackend,
    dst: &mut CudaTensor,
    rows: &[usize],
    src: &CudaTensor,
) -> Result<()> {
    let (n, d) = dst.rows_cols();
    let (sn, sd) = src.rows_cols();
    ensure!(sd == d && sn == rows.len(), "scatter_rows: {} rows of width {sd} into width {d}", rows.len());
    if let Some(&r) = rows.iter().find(|&&r| r >= n) {
        bail!("scatter_rows: row {r} out of range");
    }
    let db = be.bf16_for_update(dst)?;
    let s = be.bf16_of(src)?;
    let rows_d = be.htod(&rows.iter().map(|&r| r as u32).collect::<Vec<_>>())?;
    be.launch(
        "scatter_rows",
        launch_config((grid1(sn * d, 256), 1, 1), 256, 0),
        &[
            Arg::Ptr(be.p(db)),
            Arg::Ptr(be.p(&rows_d)),
            Arg::Ptr(be.p(s.s())),
            Arg::I64(sn as i64),
            Arg::I32(d as i32),
        ],
    )
}

/// `Backend::gather_rows` (the trait documents the contract).
pub(super) fn gather_rows(be: &CudaBackend, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
    let (n, d) = x.rows_cols();
    if let Some(&r) = rows.iter().find(|&&r| r >= n) {
        bail!("gather_rows: row {r} out of range");
    }
    let xs = be.bf16_of(x)?;
    let rows_d = be.htod(&rows.iter().map(|&r| r as u32).collect::<Vec<_>>())?;
    let y = be.alloc_bf16(rows.len() * d)?;
    be.launch(
        "gather_rows",
        launch_config((grid1(rows.len() * d, 256), 1, 1), 256, 0),
        &[
            Arg::Ptr(be.p(xs.s())),
            Arg::Ptr(be.p(&rows_d)),
            Arg::Ptr(be.p(&y)),
            Arg::I64(rows.len() as i64),
            Arg::I32(d as i32),
        ],
    )?;
    Ok(be.bf16_tensor(y, &[rows.len(), d]))
}

/// `Backend::split_cols` (the trait documents the contract).
pub(super) fn split_cols(be: &CudaBackend, x: &CudaTensor, widths: &[usize]) -> Result<Vec<CudaTensor>> {
    let (n, d) = x.rows_cols();
    ensure!(widths.iter().sum::<usize>() == d, "split_cols: widths {widths:?} do not sum to {d}");
    let xs = be.bf16_of(x)?;
    let mut out = Vec::with_capacity(widths.len());
    let mut off = 0;
    for &w in widths {
        let y = be.alloc_bf16(n * w)?;
        if n * w > 0 {
            be.launch(
                "copy_cols",
                launch_config((grid1(n * w, 256), 1, 1), 256, 0),
                &[
                    Arg::Ptr(be.p(xs.s())),
                    Arg::I32(d as i32),
                    Arg::I32(off as i32),
                    Arg::Ptr(be.p(&y)),
                    Arg::I32(w as i32),
                    Arg::I64(n as i64),
                ],
            )?;
        }
        out.push(be.bf16_tensor(y, &[n, w]));
        off += w;
    }
    Ok(out)
}

/// `Backend::concat_rows` (the trait documents the contract).
pub(super) fn concat_rows(be: &CudaBackend, parts: &[&CudaTensor]) -> Result<CudaTensor> {
    let d = parts.first().map(|p| p.rows_cols().1).unwrap_or(0);
    for p in parts {
        ensure!(p.rows_cols().1 == d, "concat_rows: widths differ");
    }
    let total: usize = parts.iter().map(|p| p.numel()).sum();
    let rows = total.checked_div(d).unwrap_or(0);
    if !parts.is_empty() && parts.iter().all(|p| !p.is_bf16()) {
        let y = be.alloc_f32(total)?;
        let mut at = 0;
        for p in parts {
            let Buf::F32(s) = &p.buf else { unreachable!() };
            be.dtod_bytes(be.p(&y) + 4 * at as u64, be.p(s), 4 * p.numel())?;
            at += p.numel();
        }
        return Ok(CudaTensor { buf: Buf::F32(y), shape: vec![rows, d], fp8: None });
    }
    let y = be.alloc_bf16(total)?;
    let mut at = 0;
    for p in parts {
        let s = be.bf16_of(p)?;
        be.dtod_bytes(be.p(&y) + 2 * at as u64, be.p(s.s()), 2 * p.numel())?;
        at += p.numel();
    }
    Ok(be.bf16_tensor(y, &[rows, d]))
}

/// `Backend::add_assign` (the trait documents the contract).
pub(super) fn add_assign(be: &CudaBackend, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
    ensure!(x.numel() == y.numel(), "add: shapes {:?} and {:?}", x.shape, y.shape);
    let n = x.numel();
    let xb = be.bf16_for_update(x)?;
    let ys = be.bf16_of(y)?;
    if n > 0 {
        be.launch(
            "add_bf16",
            launch_config((grid1(n, 256), 1, 1), 256, 0),
            &[Arg::Ptr(be.p(xb)), Arg::Ptr(be.p(ys.s())), Arg::I64(n as i64)],
        )?;
    }
    Ok(())
}

/// `Backend::swiglu` (the trait documents the contract).
pub(super) fn swiglu(be: &CudaBackend, gate_up: &CudaTensor) -> Result<CudaTensor> {
    let (n, d2) = gate_up.rows_cols();
    ensure!(d2 % 2 == 0, "swiglu needs an even width");
    let d = d2 / 2;
    let gs = be.bf16_of(gate_up)?;
    let y = be.alloc_bf16(n * d)?;
    if n * d > 0 {
        be.launch(
            "swiglu",
            launch_config((grid1(n * d, 256), 1, 1), 256, 0),
            &[Arg::Ptr(be.p(gs.s())), Arg::Ptr(be.p(&y)), Arg::I64(n as i64), Arg::I32(d as i32)],
        )?;
    }
    Ok(be.bf16_tensor(y, &[n, d]))
}

/// `Backend::gelu` (the trait documents the contract).
pub(super) fn gelu(be: &CudaBackend, x: &mut CudaTensor, kind: Gelu) -> Result<()> {
    let n = x.numel();
    let xb = be.bf16_for_update(x)?;
    if n > 0 {
        be.launch(
            "gelu",
            launch_config((grid1(n, 256), 1, 1), 256, 0),
            &[Arg::Ptr(be.p(xb)), Arg::I64(n as i64), Arg::I32((kind == Gelu::Tanh) as i32)],
        )?;
    }
    Ok(())
}
