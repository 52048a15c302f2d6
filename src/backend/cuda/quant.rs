//! Per-token 1×128 FP8 activations for the FP8 projections: `quant_act_1x128` (kernels/quant.cu)
//! when no fused kernel attached them, SwiGLU and GELU fused with that quantisation for the MLPs'
//! second projections (`swiglu_quant_1x128`, `gelu_quant_1x128`; `swiglu_lora_quant_1x128_<r>`
//! also takes the gate/up projection's LoRA B side), and whether the row norms attach it. CPU twin:
//! [`crate::weights::fp8::quantize_act_1x128`] (the fused kernels: their plain op's twin, then
//! that quantiser).

use super::launch::{grid1, launch_config, Arg};
use super::linear::CudaLinear;
use super::tensor::{ActFp8, CudaTensor};
use super::{elementwise, layout, linear, CudaBackend};
use crate::backend::Gelu;
use crate::weights::fp8::FP8_BLOCK;
use anyhow::Result;
use cudarc::driver::{CudaSlice, LaunchConfig};
use half::bf16;
use std::sync::atomic::Ordering;

impl CudaBackend {
    /// The FP8 activations `[Mpad, K]` and `[K/128][Mpad]` scales the FP8 GEMM path uses for `x`
    /// (padding rows included): the quantisation attached to `x` when a fused kernel wrote one,
    /// else `quant_act_1x128`'s. A diagnostic for tests: the CPU twin is
    /// `layout::quantize_act_1x128`.
    pub fn quantize_activations(&self, x: &CudaTensor) -> Result<(Vec<u8>, Vec<f32>)> {
        let (m, k) = x.rows_cols();
        let xv = self.bf16_of(x)?;
        let own;
        let a = match &x.fp8 {
            Some(a) => a,
            None => {
                own = self.quantize(xv.s(), m, k)?;
                &own
            }
        };
        Ok((self.state.stream.clone_dtoh(&a.q)?, self.state.stream.clone_dtoh(&a.s)?))
    }

    /// Whether a kernel writing rows of width `k` (a row norm, SwiGLU, GELU) also writes their FP8
    /// quantisation: only once an FP8 projection exists (else no GEMM would read it), when `k` is
    /// whole 128-blocks, and unless `unfused_act_quant` is set.
    pub(super) fn fuse_act_quant(&self, k: usize) -> bool {
        k > 0
            && k % FP8_BLOCK == 0
            && !self.state.options.unfused_act_quant
            && self.state.fp8_linears.load(Ordering::Relaxed)
    }

    /// Per-token 1×128 FP8 quantisation of `x` `[m, k]` (`quant_act_1x128`).
    pub(super) fn quantize(&self, x: &CudaSlice<bf16>, m: usize, k: usize) -> Result<ActFp8> {
        let a = self.alloc_act_fp8(m, k)?;
        let warps = a.mpad * (k / FP8_BLOCK);
        self.launch(
            "quant_act_1x128",
            launch_config((grid1(warps * 32, 256), 1, 1), 256, 0),
            &[
                Arg::Ptr(self.p(x)),
                Arg::Ptr(self.p(&a.q)),
                Arg::Ptr(self.p(&a.s)),
                Arg::I32(m as i32),
                Arg::I32(a.mpad as i32),
                Arg::I32(k as i32),
            ],
        )?;
        Ok(a)
    }
}

/// (row, 128-block) items per warp of the fused quantisers (= QUANT_ITEMS in kernels/quant.cu; the
/// kernels stride over the grid, so another count here costs speed, never correctness).
const FUSED_QUANT_ITEMS: usize = 2;

impl CudaBackend {
    /// One launch of a fused quantiser of quant.cu (`swiglu_quant_1x128`, `gelu_quant_1x128`):
    /// its leading arguments `head`, the quantisation it writes for `m` rows of width `k` (codes,
    /// scales, M, Mpad, K), then `tail`; one warp per [`FUSED_QUANT_ITEMS`] (padded row,
    /// 128-block) items. Returns that quantisation (the kernel writes all of it: pad rows zero,
    /// scale 1).
    fn fused_quant(&self, name: &str, head: &[Arg], m: usize, k: usize, tail: &[Arg]) -> Result<ActFp8> {
        self.fused_quant_shaped(name, head, m, k, tail, |mpad| {
            let warps = (mpad * (k / FP8_BLOCK)).div_ceil(FUSED_QUANT_ITEMS);
            launch_config((grid1(warps * 32, 256), 1, 1), 256, 0)
        })
    }

    /// [`CudaBackend::fused_quant`] launched as `shape` says for the padded row count (a kernel
    /// with its own tiling, e.g. `swiglu_lora_quant_1x128_<r>`).
    fn fused_quant_shaped(
        &self,
        name: &str,
        head: &[Arg],
        m: usize,
        k: usize,
        tail: &[Arg],
        shape: impl FnOnce(usize) -> LaunchConfig,
    ) -> Result<ActFp8> {
        let a = self.alloc_act_fp8(m, k)?;
        let mut args = head.to_vec();
        args.extend([
            Arg::Ptr(self.p(&a.q)),
            Arg::Ptr(self.p(&a.s)),
            Arg::I32(m as i32),
            Arg::I32(a.mpad as i32),
            Arg::I32(k as i32),
        ]);
        args.extend_from_slice(tail);
        self.launch(name, shape(a.mpad), &args)?;
        Ok(a)
    }
}

/// `Backend::gelu_matmul` (the trait documents the contract): with an FP8 projection, GELU in
/// place fused with the quantisation the projection reads (`gelu_quant_1x128`).
pub(super) fn gelu_matmul(
    be: &CudaBackend,
    x: &mut CudaTensor,
    kind: Gelu,
    w: &CudaLinear,
) -> Result<CudaTensor> {
    let (m, k) = x.rows_cols();
    if k != w.in_dim || !w.has_fp8() || m == 0 || !be.fuse_act_quant(k) {
        elementwise::gelu(be, x, kind)?;
        return linear::matmul(be, x, w);
    }
    let xs = be.p(be.bf16_for_update(x)?);
    let a =
        be.fused_quant("gelu_quant_1x128", &[Arg::Ptr(xs)], m, k, &[Arg::I32((kind == Gelu::Tanh) as i32)])?;
    be.matmul_quantised(be.bf16_for_update(x)?, Some(&a), m, k, w)
}

/// `Backend::swiglu_matmul` (the trait documents the contract).
pub(super) fn swiglu_matmul(be: &CudaBackend, gate_up: &CudaTensor, w: &CudaLinear) -> Result<CudaTensor> {
    let (m, d2) = gate_up.rows_cols();
    let k = d2 / 2;
    if d2 % 2 != 0 || k != w.in_dim || !w.has_fp8() || m == 0 || !be.fuse_act_quant(k) {
        // Nothing to fuse (BF16 projection, or IMAJEV_UNFUSED_ACT_QUANT), or a shape the unfused
        // path reports.
        return linear::matmul(be, &elementwise::swiglu(be, gate_up)?, w);
    }
    let gs = be.bf16_of(gate_up)?;
    let xs = be.alloc_bf16(m * k)?;
    let a =
        be.fused_quant("swiglu_quant_1x128", &[Arg::Ptr(be.p(gs.s())), Arg::Ptr(be.p(&xs))], m, k, &[])?;
    be.matmul_quantised(&xs, Some(&a), m, k, w)
}

/// `Backend::swiglu_mlp` (the trait documents the contract). On Hopper's own FP8 GEMM with
/// `swiglu_epilogue` (opt-in): the gate/up GEMM's GLU form writes the SwiGLU and the down
/// projection's FP8 input (`CudaBackend::swiglu_project`), then the down projection. Else with
/// `mlp_lora_fused` and a gate/up
/// projection whose one LoRA pair is gate's and up's of equal rank (every Qwen3.5 MLP; see
/// `CudaLinear::swiglu_lora`): the gate/up GEMMs and LoRA A GEMM, then
/// `swiglu_lora_quant_1x128_<r>` (the LoRA B side, the SwiGLU and the down projection's FP8
/// input in one pass over the gate/up output) and the down projection. Otherwise (also when
/// `gemm_fp8` adds the gate/up LoRA in its own epilogue) `matmul`, then `swiglu_matmul`.
pub(super) fn swiglu_mlp(
    be: &CudaBackend,
    x: &CudaTensor,
    gate_up: &CudaLinear,
    down: &CudaLinear,
) -> Result<CudaTensor> {
    let (m, k) = (x.rows_cols().0, gate_up.out_dim / 2);
    // On gemm_fp8's GLU form the SwiGLU and its quantisation are the gate/up GEMM's epilogue.
    if m > 0 && k == down.in_dim && down.has_fp8() && be.fuse_act_quant(k) {
        if let Some((h, a)) = be.swiglu_project(x, gate_up)? {
            return be.matmul_quantised(&h, Some(&a), m, k, down);
        }
    }
    // With gemm_fp8 the gate/up GEMM adds its LoRA in its own epilogue: the plain SwiGLU follows.
    let fusable = be.state.options.mlp_lora_fused
        && !be.own_fp8_gemm()
        && m > 0
        && gate_up.out_dim % 2 == 0
        && k == down.in_dim
        && down.has_fp8()
        && be.fuse_act_quant(k);
    let Some((lora, r)) = gate_up.swiglu_lora().filter(|_| fusable) else {
        return swiglu_matmul(be, &linear::matmul(be, x, gate_up)?, down);
    };
    let (gu, t) = linear::matmul_deferring_lora(be, x, gate_up, lora)?;
    let (scale, b) = lora.b_side();
    let gs = be.bf16_of(&gu)?;
    let y = be.alloc_bf16(m * k)?;
    let head =
        [Arg::Ptr(be.p(gs.s())), Arg::Ptr(be.p(&t)), Arg::Ptr(be.p(b)), Arg::F32(scale), Arg::Ptr(be.p(&y))];
    // One block per 64 padded rows and 128 columns.
    let a = be.fused_quant_shaped(&format!("swiglu_lora_quant_1x128_{r}"), &head, m, k, &[], |mpad| {
        launch_config(
            (mpad.div_ceil(64) as u32, (k / FP8_BLOCK) as u32, 1),
            256,
            layout::swiglu_lora_smem_bytes(r),
        )
    })?;
    be.matmul_quantised(&y, Some(&a), m, k, down)
}
