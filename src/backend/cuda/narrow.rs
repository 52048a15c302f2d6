//! Narrow BF16 GEMMs (`n <= 128` output columns: the DeltaNet a/b projections and every LoRA A)
//! on our own kernel, `kernels/gemm_narrow.cu`, instead of cuBLASLt.
//!
//! Why by hand: batch invariance fixes one cuBLASLt algorithm per shape ([`super::gemm`]), and a
//! narrow shape's is chosen at a small M with split K so that short requests fill the GPU; at
//! 47.7K rows the same algorithm ran the DeltaNet a/b projection at ~6 TFLOP/s (2.8 ms a call,
//! `bench/NOTES.md`). No cuBLASLt algorithm is fast at both ends, and picking one per M would
//! make a row's bits depend on the batch. The kernel splits K by a constant ([`KSPLIT`] columns
//! per split, whatever M is) and adds the splits in order, so a row's result depends only on its
//! own inputs. What this layer does not know: where the GEMM comes from (projection, LoRA); the
//! caller's [`Gemm`] says everything.
//!
//! `IMAJEV_NARROW_GEMM=cublas` (or [`super::CudaOptions::narrow_gemm_cublas`]) sends these shapes
//! back to cuBLASLt, for comparisons.

use super::gemm::{Gemm, GemmKind};
use super::launch::{grid1, launch_config, Arg};
use super::CudaBackend;
use anyhow::Result;

/// Columns of K per split; the kernel's `NARROW_KS`.
pub const KSPLIT: usize = 512;
/// Rows per block; the kernel's `NARROW_BM`.
const BLOCK_ROWS: usize = 64;
/// Widest output the kernel takes.
pub const MAX_N: usize = 128;

/// The kernel instance for `n` output columns: the narrowest padded width that holds them.
fn padded_width(n: usize) -> Option<usize> {
    [32, 64, 128].into_iter().find(|&p| n <= p)
}

/// Whether the narrow kernel takes this GEMM: BF16, `β = 0`, `n <= 128` and even multiples of 8,
/// `k` a multiple of 32, X and W rows 16-byte aligned, Y rows 4-byte aligned.
pub fn eligible(g: &Gemm) -> bool {
    g.kind == GemmKind::Bf16
        && g.beta == 0.0
        && g.n > 0
        && g.n <= MAX_N
        && g.n % 8 == 0
        && g.k > 0
        && g.k % 32 == 0
        && g.ldx % 8 == 0
        && g.ldw % 8 == 0
        && g.x % 16 == 0
        && g.w % 16 == 0
        && g.ldy % 2 == 0
        && g.y % 4 == 0
}

/// How many splits of K the kernel makes (a function of `k` alone).
pub fn splits(k: usize) -> usize {
    k.div_ceil(KSPLIT)
}

impl CudaBackend {
    /// Runs `g` on the narrow kernel when it is [`eligible`] and the option allows; false when
    /// the caller must run it on cuBLASLt.
    pub(super) fn gemm_narrow(&self, g: &Gemm) -> Result<bool> {
        if self.state.options.narrow_gemm_cublas || !eligible(g) {
            return Ok(false);
        }
        if g.m == 0 {
            return Ok(true);
        }
        let width = padded_width(g.n).expect("eligible: n <= 128");
        let s = splits(g.k);
        let part = if s > 1 { Some(self.alloc_f32(s * g.m * g.n)?) } else { None };
        let part_ptr = part.as_ref().map(|p| self.p(p)).unwrap_or(0);
        let blocks = g.m.div_ceil(BLOCK_ROWS) as u32;
        let args = [
            Arg::Ptr(g.x),
            Arg::I64(g.ldx as i64),
            Arg::Ptr(g.w),
            Arg::I64(g.ldw as i64),
            Arg::I64(g.m as i64),
            Arg::I32(g.n as i32),
            Arg::I32(g.k as i32),
            Arg::F32(g.alpha),
            Arg::Ptr(g.y),
            Arg::I64(g.ldy as i64),
            Arg::Ptr(part_ptr),
        ];
        let name = match width {
            32 => "gemm_narrow_32",
            64 => "gemm_narrow_64",
            _ => "gemm_narrow_128",
        };
        self.launch(name, launch_config((blocks, s as u32, 1), 128, 0), &args)?;
        if let Some(p) = &part {
            let args = [
                Arg::Ptr(self.p(p)),
                Arg::I32(s as i32),
                Arg::I64(g.m as i64),
                Arg::I32(g.n as i32),
                Arg::F32(g.alpha),
                Arg::Ptr(g.y),
                Arg::I64(g.ldy as i64),
            ];
            let cfg = launch_config((grid1(g.m * g.n / 2, 256).min(4096), 1, 1), 256, 0);
            self.launch("gemm_narrow_reduce", cfg, &args)?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_gemm(n: usize, k: usize) -> Gemm {
        Gemm {
            kind: GemmKind::Bf16,
            n,
            m: 100,
            k,
            w: 1 << 20,
            ldw: k,
            x: 2 << 20,
            ldx: k,
            y: 3 << 20,
            ldy: n,
            alpha: 1.0,
            beta: 0.0,
            w_scale: 0,
            x_scale: 0,
        }
    }

    #[test]
    fn narrow_shapes_only() {
        assert!(eligible(&bf16_gemm(64, 2560)));
        assert!(eligible(&bf16_gemm(32, 2560)));
        assert!(eligible(&bf16_gemm(128, 9216)));
        assert!(!eligible(&bf16_gemm(136, 2560)), "wider than 128");
        assert!(!eligible(&bf16_gemm(60, 2560)), "n not a multiple of 8");
        assert!(!eligible(&bf16_gemm(64, 2570)), "k not a multiple of 32");
        assert!(!eligible(&Gemm { beta: 1.0, ..bf16_gemm(64, 2560) }), "accumulating");
        assert!(!eligible(&Gemm { kind: GemmKind::Fp8Block, ..bf16_gemm(64, 2560) }));
        assert!(!eligible(&Gemm { x: (2 << 20) + 8, ..bf16_gemm(64, 2560) }), "X not 16-byte aligned");
        assert!(!eligible(&Gemm { ldx: 2564, ..bf16_gemm(64, 2560) }), "X rows not 16-byte aligned");
    }

    #[test]
    fn splits_depend_on_k_alone() {
        assert_eq!(splits(512), 1);
        assert_eq!(splits(2560), 5);
        assert_eq!(splits(9216), 18);
        assert_eq!(padded_width(8), Some(32));
        assert_eq!(padded_width(64), Some(64));
        assert_eq!(padded_width(96), Some(128));
        assert_eq!(padded_width(129), None);
    }
}
