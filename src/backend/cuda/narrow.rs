//! BF16 GEMMs with one narrow dimension on our own kernels, `kernels/gemm_narrow.cu`, instead of
//! cuBLASLt: narrow outputs (`n <= 128` columns: the DeltaNet a/b projections and every LoRA A)
//! and narrow accumulating reductions (`k <= 256`, `β = 1`: every LoRA B).
//!
//! Why by hand: batch invariance fixes one cuBLASLt algorithm per shape ([`super::gemm`]), and a
//! narrow shape's is chosen at a small M with split K so that short requests fill the GPU; at
//! 47.7K rows the same algorithm ran the DeltaNet a/b projection at ~6 TFLOP/s (2.8 ms a call,
//! `bench/NOTES.md`). No cuBLASLt algorithm is fast at both ends, and picking one per M would
//! make a row's bits depend on the batch. The kernel splits K by a constant ([`KSPLIT`] columns
//! per split, whatever M is) and adds the splits in order, so a row's result depends only on its
//! own inputs. The LoRA B side (`y += α·t·Bᵀ`, `k` = the rank) is bound by reading and writing
//! `y`; its kernel reads and writes each element once, with no split at all. What this layer does
//! not know: where the GEMM comes from (projection, LoRA); the caller's [`Gemm`] says everything.
//!
//! Status (2026-12-04, bench/NOTES.md): opt-in. With the GEMM plans fixed at `gemm::M_REF` rows,
//! cuBLASLt holds its one algorithm per narrow shape up to 65,536 rows with rows bitwise equal to
//! small batches (tests/gpu `large_batches`), and whole requests ran 2-5% faster on it than with
//! the narrow-output kernel (a second launch per split GEMM at short M, and 2x slower at
//! K = 9216); LoRA B on `gemm_narrow_k_acc` was 1.2-2.3x slower than cuBLASLt in isolation.
//! `IMAJEV_NARROW_GEMM=both|n|k|cublas` (or [`super::CudaOptions::narrow_gemm`]; default
//! `cublas`) picks which of the two kinds run here; the others go to cuBLASLt.

use super::gemm::{Gemm, GemmKind};
use super::launch::{grid1, launch_config, Arg};
use super::tensor::CudaTensor;
use super::CudaBackend;
use anyhow::{ensure, Result};

/// Columns of K per split; the kernel's `NARROW_KS`.
pub const KSPLIT: usize = 256;
/// Rows per block; the kernel's `NARROW_BM`.
const BLOCK_ROWS: usize = 64;
/// From this many rows on, a narrow-output GEMM runs whole (`gemm_narrow_whole_<n>`: one block
/// walks every split of its rows) instead of one block per split: the row blocks alone fill the
/// GPU, and the split partials would double the bytes moved. The same bits either way (the
/// kernel file says why), so this is a speed choice only; [`super::CudaOptions::narrow_whole_rows`]
/// overrides it for measurements.
pub const WHOLE_ROWS: usize = 16_384;
/// Widest output the kernel takes.
pub const MAX_N: usize = 128;
/// Longest reduction the accumulating kernel takes.
pub const MAX_K_ACC: usize = 256;
/// Rows and columns of Y per block of the accumulating kernel (`NK_BM`, `NK_BN`).
const ACC_TILE: usize = 128;
/// Dynamic shared memory of the accumulating kernel (`NK_SMEM_BYTES`): two stages of X and W
/// tiles (128 rows x 40 bf16 each) and the Y tile (128 rows x 136 bf16).
pub const ACC_SMEM_BYTES: usize = (2 * (ACC_TILE + ACC_TILE) * 40 + ACC_TILE * (ACC_TILE + 8)) * 2;

/// Which narrow GEMMs run on these kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NarrowGemm {
    /// Both kinds.
    Both,
    /// Only narrow outputs (`n <= 128`); LoRA B on cuBLASLt.
    N,
    /// Only the accumulating narrow reductions (LoRA B); narrow outputs on cuBLASLt.
    K,
    /// Neither: every GEMM on cuBLASLt (the default). Its one algorithm per shape, fixed at
    /// `gemm::M_REF` rows, holds up to the 64K-row ceiling with rows bitwise equal to small
    /// batches (tests/gpu `large_batches`), and whole requests ran 2-5% faster than with `N`
    /// (bench/NOTES.md, 2026-12-04): these kernels stay for comparisons and for a cuBLASLt that
    /// would not hold its algorithm.
    #[default]
    Cublas,
}

impl NarrowGemm {
    fn narrow_n(self) -> bool {
        matches!(self, Self::Both | Self::N)
    }
    fn narrow_k(self) -> bool {
        matches!(self, Self::Both | Self::K)
    }
    /// For the start-up log.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Both => "own kernels (n <= 128: K split by 256; LoRA B: k <= 256)",
            Self::N => "own kernel for n <= 128 (K split by 256), LoRA B on cuBLASLt",
            Self::K => "own kernel for LoRA B (k <= 256), n <= 128 on cuBLASLt",
            Self::Cublas => "cuBLASLt",
        }
    }
}

impl std::str::FromStr for NarrowGemm {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "both" | "kernel" => Ok(Self::Both),
            "n" => Ok(Self::N),
            "k" => Ok(Self::K),
            "cublas" => Ok(Self::Cublas),
            _ => Err("expected both, n, k or cublas".into()),
        }
    }
}

/// The kernel instance for `n` output columns: the narrowest padded width that holds them.
fn padded_width(n: usize) -> Option<usize> {
    [32, 64, 128].into_iter().find(|&p| n <= p)
}

/// What both kernels need: BF16, `n` and `k` multiples of 8 and 32, X and W rows 16-byte
/// aligned, Y rows 4-byte aligned.
fn shape_fits(g: &Gemm) -> bool {
    g.kind == GemmKind::Bf16
        && g.n > 0
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

/// Whether the narrow-output kernel takes this GEMM: `β = 0`, `n <= 128`, and [`shape_fits`].
pub fn eligible(g: &Gemm) -> bool {
    g.beta == 0.0 && g.n <= MAX_N && shape_fits(g)
}

/// Whether the accumulating kernel takes this GEMM: `β = 1`, `k <= 256`, [`shape_fits`], and Y
/// in 16-byte chunks (the kernel copies its Y tile with 16-byte copies).
pub fn eligible_acc(g: &Gemm) -> bool {
    g.beta == 1.0 && g.k <= MAX_K_ACC && shape_fits(g) && g.y % 16 == 0 && g.ldy % 8 == 0
}

/// How many splits of K the kernel makes (a function of `k` alone).
pub fn splits(k: usize) -> usize {
    k.div_ceil(KSPLIT)
}

/// The arguments every GEMM kernel here starts with: `x, ldx, w, ldw, m, n, k`.
fn inputs(g: &Gemm) -> Vec<Arg> {
    vec![
        Arg::Ptr(g.x),
        Arg::I64(g.ldx as i64),
        Arg::Ptr(g.w),
        Arg::I64(g.ldw as i64),
        Arg::I64(g.m as i64),
        Arg::I32(g.n as i32),
        Arg::I32(g.k as i32),
    ]
}

/// The arguments of the kernels that write Y themselves: [`inputs`], then `alpha, y, ldy`.
fn operands(g: &Gemm) -> Vec<Arg> {
    let mut a = inputs(g);
    a.extend([Arg::F32(g.alpha), Arg::Ptr(g.y), Arg::I64(g.ldy as i64)]);
    a
}

impl CudaBackend {
    /// Runs `g` on one of these kernels when it is [`eligible_acc`] or [`eligible`] and the option
    /// allows; false when the caller must run it on cuBLASLt.
    pub(super) fn gemm_narrow(&self, g: &Gemm) -> Result<bool> {
        if self.state.options.narrow_gemm.narrow_k() && eligible_acc(g) {
            return self.gemm_narrow_k_acc(g).map(|_| true);
        }
        if !self.state.options.narrow_gemm.narrow_n() || !eligible(g) {
            return Ok(false);
        }
        if g.m == 0 {
            return Ok(true);
        }
        let blocks = g.m.div_ceil(BLOCK_ROWS);
        let s = splits(g.k);
        let whole_rows = self.state.options.narrow_whole_rows.unwrap_or(WHOLE_ROWS);
        let width = padded_width(g.n).expect("eligible: n <= 128");
        if s == 1 || g.m >= whole_rows {
            let name = format!("gemm_narrow_whole_{width}");
            return self
                .launch(&name, launch_config((blocks as u32, 1, 1), 128, 0), &operands(g))
                .map(|_| true);
        }
        // Each split's f32 partial, then their sum in split order (gemm_narrow_sum).
        let part = self.alloc_f32(s * g.m * g.n)?;
        let mut args = inputs(g);
        args.push(Arg::Ptr(self.p(&part)));
        self.launch(
            &format!("gemm_narrow_{width}"),
            launch_config((blocks as u32, s as u32, 1), 128, 0),
            &args,
        )?;
        let sum = [
            Arg::Ptr(self.p(&part)),
            Arg::I32(s as i32),
            Arg::I64(g.m as i64),
            Arg::I32(g.n as i32),
            Arg::F32(g.alpha),
            Arg::Ptr(g.y),
            Arg::I64(g.ldy as i64),
        ];
        self.launch("gemm_narrow_sum", launch_config((grid1(g.m * g.n / 4, 256), 1, 1), 256, 0), &sum)?;
        Ok(true)
    }

    /// `y = α·x·wᵀ + β·y` (β 0 or 1) on BF16 tensors `x [m, k]`, `w [n, k]`, `y [m, n]`, by the
    /// route the model's BF16 GEMMs take (these kernels where they apply and the options allow,
    /// else cuBLASLt): the narrow GEMMs in isolation, for benchmarks (bench/gpu_ops.rs).
    pub fn bf16_gemm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        y: &mut CudaTensor,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let ((m, k), (n, kw), (my, ny)) = (x.rows_cols(), w.rows_cols(), y.rows_cols());
        ensure!(
            kw == k && my == m && ny == n,
            "bf16_gemm: x [{m}, {k}], w [{n}, {kw}], y [{my}, {ny}] do not fit"
        );
        ensure!(beta == 0.0 || beta == 1.0, "bf16_gemm: beta must be 0 or 1, is {beta}");
        let (xv, wv) = (self.bf16_of(x)?, self.bf16_of(w)?);
        let (xp, wp) = (self.p(xv.s()), self.p(wv.s()));
        let yp = self.p(self.bf16_for_update(y)?);
        let g = Gemm {
            kind: GemmKind::Bf16,
            n,
            m,
            k,
            w: wp,
            ldw: k,
            x: xp,
            ldx: k,
            y: yp,
            ldy: n,
            alpha,
            beta,
            w_scale: 0,
            x_scale: 0,
        };
        self.gemm(&g)
    }

    /// `y += α·x·wᵀ` on `gemm_narrow_k_acc` ([`eligible_acc`] holds).
    fn gemm_narrow_k_acc(&self, g: &Gemm) -> Result<()> {
        if g.m == 0 {
            return Ok(());
        }
        let grid = (g.n.div_ceil(ACC_TILE) as u32, g.m.div_ceil(ACC_TILE) as u32, 1);
        self.launch("gemm_narrow_k_acc", launch_config(grid, 256, ACC_SMEM_BYTES), &operands(g))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_gemm(n: usize, k: usize) -> Gemm {
        Gemm::placeholder(GemmKind::Bf16, n, 100, k)
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
    fn lora_b_shapes_only() {
        let acc = |n, k| Gemm { beta: 1.0, ldy: n + 64, ..bf16_gemm(n, k) };
        assert!(eligible_acc(&acc(18432, 128)));
        assert!(eligible_acc(&acc(2560, 64)));
        assert!(eligible_acc(&acc(6144, 192)));
        assert!(!eligible_acc(&acc(2560, 288)), "reduction longer than 256");
        assert!(!eligible_acc(&Gemm { beta: 0.0, ..acc(2560, 64) }), "not accumulating");
        assert!(!eligible(&acc(64, 64)), "the narrow-output kernel overwrites");
        assert!(!eligible_acc(&Gemm { y: (3 << 20) + 2, ..acc(2560, 64) }), "Y pairs not 4-byte aligned");
        assert!(!eligible_acc(&Gemm { y: (3 << 20) + 8, ..acc(2560, 64) }), "Y not 16-byte aligned");
        assert!(!eligible_acc(&Gemm { ldy: 2564, ..acc(2560, 64) }), "Y rows not 16-byte aligned");
    }

    #[test]
    fn option_names() {
        for (s, v) in [
            ("both", NarrowGemm::Both),
            ("n", NarrowGemm::N),
            ("k", NarrowGemm::K),
            ("cublas", NarrowGemm::Cublas),
        ] {
            assert_eq!(s.parse::<NarrowGemm>(), Ok(v));
        }
        assert!("fast".parse::<NarrowGemm>().is_err());
        assert!(NarrowGemm::K.narrow_k() && !NarrowGemm::K.narrow_n());
        assert!(NarrowGemm::N.narrow_n() && !NarrowGemm::N.narrow_k());
    }

    #[test]
    fn splits_depend_on_k_alone() {
        assert_eq!(splits(256), 1);
        assert_eq!(splits(2560), 10);
        assert_eq!(splits(9216), 36);
        assert_eq!(padded_width(8), Some(32));
        assert_eq!(padded_width(64), Some(64));
        assert_eq!(padded_width(96), Some(128));
        assert_eq!(padded_width(129), None);
    }
}
