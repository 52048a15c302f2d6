//! Block-scaled FP8 GEMMs on our own Hopper kernel, `kernels/gemm_fp8.cu`, with a LoRA pair's B
//! side added in its epilogue, instead of cuBLASLt's GEMM followed by `gemm.lora_b`.
//!
//! Why by hand: cuBLASLt's block-scaled FP8 GEMM can add nothing to its output but `β·C`, so the
//! LoRA B side of every adapted projection is a second GEMM that reads and writes the whole output
//! again (bench/NOTES.md: `gemm.lora_b` 29 ms of a 16K prefill, 14 ms of a packed round). The
//! kernel keeps the LoRA product in the tile's f32 accumulators, so the output is written once and
//! rounded to BF16 once. Its tiles (64·NC rows x 128 columns), k order and scale promotion never
//! depend on M, so rows are batch invariant, as cuBLASLt's fixed plans are.
//!
//! What this layer does not know: where the GEMM comes from. The caller ([`super::linear`]) hands a
//! cuBLASLt-shaped [`Gemm`] and, for the epilogue, the pair's A-side product and B; a GEMM the
//! kernel cannot take (not Hopper, α ≠ 1, β ≠ 0, widths not multiples of 128, misaligned output)
//! returns `false` and goes to cuBLASLt as before.
//!
//! Status: opt-in (`IMAJEV_FP8_GEMM=own|own192|own128o`, [`super::CudaOptions::fp8_gemm`]). On an
//! H100 (bench/NOTES.md, 2026-12-06) its outputs are bitwise equal to cuBLASLt's and the LoRA's cost
//! fell by 55-70%, but the GEMMs ran 2.2-2.5x slower than cuBLASLt's (a W-scale load on every
//! k-block's critical path, since moved into the ring: not yet measured). tests/gpu
//! `own_fp8_gemm_matches_cpu_and_cublas` checks it; `bench_gpu_ops --only fp8-own` times it.

use super::gemm::{Gemm, GemmKind};
use super::launch::{launch_config, Arg};
use super::layout;
use super::CudaBackend;
use anyhow::{bail, Result};
use std::str::FromStr;

/// Which kernel runs the block-scaled FP8 GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Gemm {
    /// cuBLASLt (its one algorithm per shape), LoRA B as a separate accumulating GEMM.
    #[default]
    Cublas,
    /// `gemm_fp8_128`: 128-row tiles (two consumer warpgroups), LoRA B in the epilogue.
    Own128,
    /// `gemm_fp8_192`: 192-row tiles (three consumer warpgroups), LoRA B in the epilogue.
    Own192,
    /// `gemm_fp8_128o`: `Own128` with k-blocks in pairs, the first promoted while the second's
    /// MMAs run (two accumulator sets); the same bits as `Own128` (which takes an odd K/128).
    Own128Overlap,
}

impl Fp8Gemm {
    /// What runs with this choice on a GPU that is (`hopper`) or is not sm_90: off Hopper, cuBLASLt.
    pub fn on(self, hopper: bool) -> Self {
        if hopper {
            self
        } else {
            Self::Cublas
        }
    }
    /// Consumer warpgroups of the kernel, None for cuBLASLt.
    fn consumers(self) -> Option<usize> {
        match self {
            Self::Cublas => None,
            Self::Own128 | Self::Own128Overlap => Some(2),
            Self::Own192 => Some(3),
        }
    }
    /// The kernel for a reduction of `k` columns.
    fn kernel(self, k: usize) -> &'static str {
        match self {
            Self::Own128Overlap if (k / 128) % 2 == 0 => "gemm_fp8_128o",
            Self::Own192 => "gemm_fp8_192",
            _ => "gemm_fp8_128",
        }
    }
    /// For the start-up log.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Cublas => "cuBLASLt (LoRA B as its own GEMM)",
            Self::Own128 => "own kernel, 128-row tiles, LoRA B in the epilogue",
            Self::Own192 => "own kernel, 192-row tiles, LoRA B in the epilogue",
            Self::Own128Overlap => "own kernel, 128-row tiles, k-blocks in pairs, LoRA B in the epilogue",
        }
    }
}

impl FromStr for Fp8Gemm {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "cublas" => Self::Cublas,
            "own" | "own128" => Self::Own128,
            "own192" => Self::Own192,
            "own128o" => Self::Own128Overlap,
            other => bail!("{other}: expected cublas, own (= own128), own192 or own128o"),
        })
    }
}

/// A LoRA pair's B side for the epilogue of one FP8 group's GEMM: `y += scale · t·Bᵀ` over the
/// columns `col0 .. col0 + cols` of the group (relative to the group's first column).
#[derive(Debug, Clone, Copy)]
pub struct LoraEpilogue {
    /// The A side's product `[rows][rank]` BF16.
    pub t: u64,
    pub rows: usize,
    /// B `[cols][rank]` BF16.
    pub b: u64,
    pub rank: usize,
    pub col0: usize,
    pub cols: usize,
    /// `[group columns / 128][2]` i32 rank windows ([`layout::lora_rank_windows`]).
    pub windows: u64,
    pub scale: f32,
}

impl CudaBackend {
    /// Whether block-scaled FP8 GEMMs run on `gemm_fp8` (then LoRA pairs inside an FP8 group go to
    /// its epilogue).
    pub(super) fn own_fp8_gemm(&self) -> bool {
        self.fp8_gemm_runs().consumers().is_some()
    }

    fn fp8_gemm_runs(&self) -> Fp8Gemm {
        self.state.options.fp8_gemm.on(self.state.info.hopper())
    }

    /// Runs `g` on `gemm_fp8_<rows>` with `lora` in the epilogue and returns true, or returns false
    /// (nothing launched) when the kernel cannot take it.
    pub(super) fn gemm_fp8(&self, g: &Gemm, lora: Option<&LoraEpilogue>) -> Result<bool> {
        let runs = self.fp8_gemm_runs();
        let Some(nc) = runs.consumers().filter(|_| eligible(g)) else { return Ok(false) };
        if g.m == 0 {
            return Ok(true);
        }
        let rows = layout::gemm_fp8_tile_rows(nc);
        let tiles = g.m.div_ceil(rows) * (g.n / 128);
        let grid = tiles.min(self.state.info.multiprocessors) as u32;
        let name = runs.kernel(g.k);
        let (t, lm, b, lr, col0, cols, win, scale) = match lora {
            Some(l) => (l.t, l.rows, l.b, l.rank, l.col0, l.cols, l.windows, l.scale),
            None => (0, 0, 0, 0, 0, 0, 0, 0.0),
        };
        let args = [
            Arg::Ptr(g.x),
            Arg::Ptr(g.x_scale),
            Arg::Ptr(g.w),
            Arg::Ptr(g.w_scale),
            Arg::Ptr(g.y),
            Arg::I32(g.m as i32),
            Arg::I32(g.n as i32),
            Arg::I32(g.k as i32),
            Arg::I64(g.ldy as i64),
            Arg::Ptr(t),
            Arg::Ptr(b),
            Arg::Ptr(win),
            Arg::I32(lm as i32),
            Arg::I32(lr as i32),
            Arg::I32(col0 as i32),
            Arg::I32(cols as i32),
            Arg::F32(scale),
        ];
        let cfg = launch_config((grid, 1, 1), layout::gemm_fp8_threads(nc), layout::gemm_fp8_smem_bytes(nc));
        self.launch(name, cfg, &args)?;
        Ok(true)
    }
}

/// What `gemm_fp8` takes: block-scaled FP8 without α or β, widths in whole 128-blocks, rows a
/// multiple of 16 (the FP8 padding), operands as dense as cuBLASLt's plans give them, and an output
/// whose column pairs are 4-byte aligned.
fn eligible(g: &Gemm) -> bool {
    g.kind == GemmKind::Fp8Block
        && g.alpha == 1.0
        && g.beta == 0.0
        && g.n % 128 == 0
        && g.k % 128 == 0
        && g.m % 16 == 0
        && g.ldw == g.k
        && g.ldx == g.k
        && g.ldy % 2 == 0
        && g.y % 4 == 0
        && g.x % 16 == 0
        && g.w % 16 == 0
        && g.x_scale % 16 == 0
        && g.m <= i32::MAX as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp8(n: usize, m: usize, k: usize) -> Gemm {
        Gemm::placeholder(GemmKind::Fp8Block, n, m, k)
    }

    #[test]
    fn parses_and_describes() {
        assert_eq!("own".parse::<Fp8Gemm>().unwrap(), Fp8Gemm::Own128);
        assert_eq!("own192".parse::<Fp8Gemm>().unwrap(), Fp8Gemm::Own192);
        assert_eq!("cublas".parse::<Fp8Gemm>().unwrap(), Fp8Gemm::Cublas);
        assert!("fast".parse::<Fp8Gemm>().unwrap_err().to_string().contains("expected cublas"));
        assert_eq!(Fp8Gemm::default().consumers(), None);
        assert_eq!(Fp8Gemm::Own192.consumers(), Some(3));
        assert_eq!(Fp8Gemm::Own192.on(false), Fp8Gemm::Cublas, "cuBLASLt off Hopper");
        assert_eq!(Fp8Gemm::Own192.on(true), Fp8Gemm::Own192);
        assert_eq!(Fp8Gemm::Own128Overlap.kernel(2560), "gemm_fp8_128o");
        assert_eq!(Fp8Gemm::Own128Overlap.kernel(128 * 3), "gemm_fp8_128", "odd K/128: the plain kernel");
        assert_eq!("own128o".parse::<Fp8Gemm>().unwrap(), Fp8Gemm::Own128Overlap);
    }

    #[test]
    fn eligibility_follows_the_kernels_assumptions() {
        assert!(eligible(&fp8(2560, 992, 9216)));
        assert!(!eligible(&Gemm { kind: GemmKind::Bf16, ..fp8(2560, 992, 9216) }));
        assert!(!eligible(&Gemm { beta: 1.0, ..fp8(2560, 992, 9216) }));
        assert!(!eligible(&fp8(2600, 992, 9216)), "N not whole 128-blocks");
        assert!(!eligible(&fp8(2560, 990, 9216)), "M not padded to 16");
        assert!(!eligible(&Gemm { y: (3 << 20) + 2, ..fp8(2560, 992, 9216) }), "misaligned column pairs");
        assert!(!eligible(&Gemm { ldy: 2561, ..fp8(2560, 992, 9216) }));
    }
}
