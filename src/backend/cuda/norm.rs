//! Row norms: RMSNorm and LayerNorm (plain, and fused with the residual add), and the DeltaNet's
//! gated RMSNorm. Kernels: kernels/norm.cu; CPU twins: src/backend/cpu/norm.rs. When FP8
//! projections are loaded, the norms feeding them also write the 1×128 FP8 quantisation of their
//! output (the `*_quant` kernels), attached to the tensor they return.

use super::launch::{grid1, launch_config, Arg};
use super::tensor::{ActFp8, CudaTensor};
use super::CudaBackend;
use crate::weights::fp8::FP8_BLOCK;
use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

/// Threads per row of the row-norm kernels (`rms_norm`, `add_rms_norm` share it, so they reduce in
/// the same order and give the same bits).
fn norm_block(d: usize) -> u32 {
    d.div_ceil(32).clamp(1, 8) as u32 * 32
}

impl CudaBackend {
    /// The RMSNorm launches of `rms_norm` (`residual` None: normalises `x`) and `add_rms_norm`
    /// (`residual` = the residual stream, updated in place to `residual + x` first), one block per
    /// row of `d` with the same block size (so the same reduction order and bits). When the rows
    /// are the tensor's rows (`cols == d`) and FP8 projections are loaded, the `_quant` kernel
    /// also writes the output's 1×128 FP8 quantisation, returned for the tensor to carry.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn row_norm(
        &self,
        x: u64,
        residual: Option<u64>,
        w: &CudaSlice<f32>,
        out: &CudaSlice<bf16>,
        rows: usize,
        cols: usize,
        d: usize,
        eps: f32,
        offset: f32,
    ) -> Result<Option<ActFp8>> {
        let name = if residual.is_some() { "add_rms_norm" } else { "rms_norm" };
        // add_rms_norm's first argument is the residual it updates, then the addend.
        let mut args: Vec<Arg> = residual.into_iter().map(Arg::Ptr).collect();
        args.extend([Arg::Ptr(x), Arg::Ptr(self.p(w)), Arg::Ptr(self.p(out))]);
        self.launch_row_norm(
            name,
            args,
            &[Arg::I32(d as i32), Arg::F32(eps), Arg::F32(offset)],
            rows,
            cols,
            d,
        )
    }

    /// The LayerNorm launches of `layer_norm` and `add_layer_norm`, as [`Self::row_norm`] for
    /// RMSNorm: one block per row with `layer_norm`'s block size, the `_quant` kernel when the
    /// output feeds FP8 projections.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_row_norm(
        &self,
        x: u64,
        residual: Option<u64>,
        w: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        out: &CudaSlice<bf16>,
        rows: usize,
        cols: usize,
        d: usize,
        eps: f32,
    ) -> Result<Option<ActFp8>> {
        let name = if residual.is_some() { "add_layer_norm" } else { "layer_norm" };
        let mut args: Vec<Arg> = residual.into_iter().map(Arg::Ptr).collect();
        args.extend([Arg::Ptr(x), Arg::Ptr(self.p(w)), Arg::Ptr(self.p(b)), Arg::Ptr(self.p(out))]);
        self.launch_row_norm(name, args, &[Arg::I32(d as i32), Arg::F32(eps)], rows, cols, d)
    }

    /// One row-norm launch (`base`, or `base_quant` when [`Self::norm_quant_args`] attaches the
    /// quantisation): the kernel's leading arguments `args`, the quantisation's, then `tail`; one
    /// block per row (or padded row) of `norm_block(d)` threads.
    fn launch_row_norm(
        &self,
        base: &str,
        mut args: Vec<Arg>,
        tail: &[Arg],
        rows: usize,
        cols: usize,
        d: usize,
    ) -> Result<Option<ActFp8>> {
        if rows == 0 {
            return Ok(None);
        }
        let (fp8, blocks) = self.norm_quant_args(rows, cols, d, &mut args)?;
        args.extend_from_slice(tail);
        let name = if fp8.is_some() { format!("{base}_quant") } else { base.to_string() };
        self.launch(&name, launch_config((blocks as u32, 1, 1), norm_block(d), 0), &args)?;
        Ok(fp8)
    }

    /// The quantisation a `*_quant` row norm writes beside its output: when the rows are the
    /// tensor's rows (`cols == d`) and FP8 projections are loaded, allocates it, appends its
    /// arguments (codes, scales, M, Mpad) and returns it with the grid (Mpad blocks: the kernel
    /// writes the padding rows); else nothing and `rows` blocks.
    fn norm_quant_args(
        &self,
        rows: usize,
        cols: usize,
        d: usize,
        args: &mut Vec<Arg>,
    ) -> Result<(Option<ActFp8>, usize)> {
        if cols != d || !self.fuse_act_quant(d) {
            return Ok((None, rows));
        }
        let a = self.alloc_act_fp8(rows, d)?;
        args.extend([
            Arg::Ptr(self.p(&a.q)),
            Arg::Ptr(self.p(&a.s)),
            Arg::I32(rows as i32),
            Arg::I32(a.mpad as i32),
        ]);
        let blocks = a.mpad;
        Ok((Some(a), blocks))
    }

    /// The DeltaNet output norm: `rms_norm_gated` of the f32 delta-rule output `core`
    /// `[n·heads, d]` with the gate `z` (`z_ptr`, row stride `z_ld`), as `[n, heads·d]` BF16; with
    /// `d == 128` fused with the FP8 quantisation of that output (`rms_norm_gated_quant`: each
    /// (token, head) row is one 128-block) for the out projection.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_norm(
        &self,
        core: &CudaSlice<f32>,
        z_ptr: u64,
        z_ld: i64,
        heads: usize,
        w: &CudaSlice<f32>,
        n: usize,
        d: usize,
        eps: f32,
    ) -> Result<CudaTensor> {
        let y = self.alloc_bf16(n * heads * d)?;
        let mut args = vec![
            Arg::Ptr(self.p(core)),
            Arg::Ptr(z_ptr),
            Arg::I64(z_ld),
            Arg::I32(heads as i32),
            Arg::Ptr(self.p(w)),
            Arg::Ptr(self.p(&y)),
        ];
        let (name, rows, fp8) = if n > 0 && d == FP8_BLOCK && self.fuse_act_quant(heads * d) {
            let a = self.alloc_act_fp8(n, heads * d)?;
            args.extend([
                Arg::Ptr(self.p(&a.q)),
                Arg::Ptr(self.p(&a.s)),
                Arg::I32(n as i32),
                Arg::I32(a.mpad as i32),
            ]);
            ("rms_norm_gated_quant", a.mpad * heads, Some(a))
        } else {
            args.push(Arg::I64((n * heads) as i64));
            ("rms_norm_gated", n * heads, None)
        };
        args.extend([Arg::I32(d as i32), Arg::F32(eps)]);
        self.launch(name, launch_config((grid1(rows * 32, 256), 1, 1), 256, 0), &args)?;
        let mut t = self.bf16_tensor(y, &[n, heads * d]);
        t.fp8 = fp8;
        Ok(t)
    }
}

/// `Backend::rms_norm` (the trait documents the contract).
pub(super) fn rms_norm(
    be: &CudaBackend,
    x: &CudaTensor,
    w: &CudaTensor,
    eps: f32,
    offset: f32,
) -> Result<CudaTensor> {
    let d = w.numel();
    ensure!(d > 0 && x.numel() % d == 0, "rms_norm: {} values do not split into rows of {d}", x.numel());
    let rows = x.numel() / d;
    let (xs, ws) = (be.bf16_of(x)?, be.f32_of(w)?);
    let y = be.alloc_bf16(rows * d)?;
    let fp8 = be.row_norm(be.p(xs.s()), None, ws.s(), &y, rows, x.rows_cols().1, d, eps, offset)?;
    let mut t = be.bf16_tensor(y, &x.shape);
    t.fp8 = fp8;
    Ok(t)
}

/// `Backend::add_rms_norm` (the trait documents the contract).
pub(super) fn add_rms_norm(
    be: &CudaBackend,
    x: &mut CudaTensor,
    y: &CudaTensor,
    w: &CudaTensor,
    eps: f32,
    offset: f32,
) -> Result<CudaTensor> {
    ensure!(x.numel() == y.numel(), "add: shapes {:?} and {:?}", x.shape, y.shape);
    let d = w.numel();
    ensure!(d > 0 && x.numel() % d == 0, "rms_norm: {} values do not split into rows of {d}", x.numel());
    let rows = x.numel() / d;
    let (shape, cols) = (x.shape.clone(), x.rows_cols().1);
    let xb = be.bf16_for_update(x)?;
    let (ys, ws) = (be.bf16_of(y)?, be.f32_of(w)?);
    let out = be.alloc_bf16(rows * d)?;
    let fp8 = be.row_norm(be.p(ys.s()), Some(be.p(xb)), ws.s(), &out, rows, cols, d, eps, offset)?;
    let mut t = be.bf16_tensor(out, &shape);
    t.fp8 = fp8;
    Ok(t)
}

/// `Backend::layer_norm` (the trait documents the contract).
pub(super) fn layer_norm(
    be: &CudaBackend,
    x: &CudaTensor,
    w: &CudaTensor,
    b: &CudaTensor,
    eps: f32,
) -> Result<CudaTensor> {
    let d = w.numel();
    ensure!(b.numel() == d && d > 0 && x.numel() % d == 0, "layer_norm shapes");
    let rows = x.numel() / d;
    let (xs, ws, bs) = (be.bf16_of(x)?, be.f32_of(w)?, be.f32_of(b)?);
    let y = be.alloc_bf16(rows * d)?;
    let fp8 = be.layer_row_norm(be.p(xs.s()), None, ws.s(), bs.s(), &y, rows, x.rows_cols().1, d, eps)?;
    let mut t = be.bf16_tensor(y, &x.shape);
    t.fp8 = fp8;
    Ok(t)
}

/// `Backend::add_layer_norm` (the trait documents the contract).
pub(super) fn add_layer_norm(
    be: &CudaBackend,
    x: &mut CudaTensor,
    y: &CudaTensor,
    w: &CudaTensor,
    b: &CudaTensor,
    eps: f32,
) -> Result<CudaTensor> {
    ensure!(x.numel() == y.numel(), "add: shapes {:?} and {:?}", x.shape, y.shape);
    let d = w.numel();
    ensure!(b.numel() == d && d > 0 && x.numel() % d == 0, "layer_norm shapes");
    let rows = x.numel() / d;
    let (shape, cols) = (x.shape.clone(), x.rows_cols().1);
    let xb = be.bf16_for_update(x)?;
    let (ys, ws, bs) = (be.bf16_of(y)?, be.f32_of(w)?, be.f32_of(b)?);
    let out = be.alloc_bf16(rows * d)?;
    let fp8 = be.layer_row_norm(be.p(ys.s()), Some(be.p(xb)), ws.s(), bs.s(), &out, rows, cols, d, eps)?;
    let mut t = be.bf16_tensor(out, &shape);
    t.fp8 = fp8;
    Ok(t)
}
