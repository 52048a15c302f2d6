//! Block-scaled FP8 GEMMs on our own Hopper kernel, `kernels/gemm_fp8.cu`, with a LoRA pair's B
//! side added in its epilogue, instead of cuBLASLt's GEMM followed by `gemm.lora_b`.
//!
//! Why by hand: cuBLASLt's block-scaled FP8 GEMM can add nothing to its output but `β·C`, so the
//! LoRA B side of every adapted projection is a second GEMM that reads and writes the whole output
//! again (bench/NOTES.md: `gemm.lora_b` 29 ms of a 16K prefill, 14 ms of a packed round). The
//! kernel adds the LoRA product to the tile while it is on chip (to the base rounded to BF16, as
//! the separate GEMM adds it to the stored output), so the output is written once. Its tiles
//! (64·NC rows x 128 columns), k order and scale promotion never depend on M, so rows are batch
//! invariant, as cuBLASLt's fixed plans are.
//!
//! What this layer does not know: where the GEMM comes from. The caller ([`super::linear`]) hands a
//! cuBLASLt-shaped [`Gemm`] and, for the epilogue, the pair's A-side product and B; a GEMM the
//! kernel cannot take (not Hopper, α ≠ 1, β ≠ 0, widths not multiples of 128, misaligned output)
//! returns `false` and goes to cuBLASLt as before.
//!
//! The operands reach shared memory by TMA ([`super::tma`]): one thread issues a stage's copies.
//! A one-group projection's bias (the vision tower's) is added in the same epilogue, with
//! `add_bias8`'s arithmetic (bitwise: tests/gpu `own_fp8_gemm_matches_cpu_and_cublas`).
//! The same kernel's BF16 form (`gemm_bf16_<rows>`, `CudaBackend::gemm_bf16_own`) can run the
//! LoRA A sides (`IMAJEV_LORA_A=own`, opt-in), and its GLU form (`gemm_fp8_glu_<rows>`,
//! `CudaBackend::gemm_fp8_glu`) the MLP's gate/up projection with the SwiGLU and the down
//! projection's FP8 input in the epilogue (`IMAJEV_SWIGLU_EPILOGUE=1`, opt-in: slower at short M).
//!
//! Status: the default on Hopper (`own192`; `IMAJEV_FP8_GEMM=cublas|own|own192|own128m|own192m|own128d|own192d|by-shape`,
//! [`super::CudaOptions::fp8_gemm`]). On an H100 (bench/NOTES.md, seventeenth session) it gives
//! cuBLASLt's bits on every projection without LoRA, runs them at 0.95-1.02x cuBLASLt's time and
//! the adapted ones at 0.70-0.95x of cuBLASLt + its LoRA B GEMM; whole requests took 0.90-0.98x.
//! (The first, cp.async version ran 2.2-2.5x slower: its producer warpgroup spent ~20 instructions
//! a 16-byte copy and the consumers waited on it.) tests/gpu `own_fp8_gemm_matches_cpu_and_cublas`
//! checks it; `bench_gpu_ops --only fp8-own` times it.

use super::gemm::{Gemm, GemmKind};
use super::launch::{grid1, launch_config, Arg};
use super::layout;
use super::tensor::ActFp8;
use super::tma::{Elem, TensorMap, Tile2d};
use super::CudaBackend;
use anyhow::{bail, Result};
use std::str::FromStr;

/// Which kernel runs the block-scaled FP8 GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Gemm {
    /// cuBLASLt (its one algorithm per shape), LoRA B as a separate accumulating GEMM; what runs
    /// off Hopper whatever is chosen.
    Cublas,
    /// `gemm_fp8_128`: 128-row tiles (two consumer warpgroups), LoRA B in the epilogue.
    Own128,
    /// `gemm_fp8_192`: 192-row tiles (three consumer warpgroups), LoRA B in the epilogue. The
    /// default (on Hopper): the fastest form measured (bench/NOTES.md, seventeenth session).
    #[default]
    Own192,
    /// `gemm_fp8_128m`: `Own128` in clusters of two blocks (row tiles 2i, 2i + 1 of one column
    /// tile) that share each W tile, each loading half of it for both; the same bits.
    Own128Multicast,
    /// `gemm_fp8_192m`: `Own192` in clusters of two, as `Own128Multicast`.
    Own192Multicast,
    /// `gemm_fp8_128d`: `Own128` with each tile's store (the BF16 staging writes, barriers and
    /// TMA store) issued under the next tile's first k-block MMAs instead of between the tiles,
    /// while the tensor cores would idle; the same bits. On an H100 4-6% under `Own128`.
    Own128Deferred,
    /// `gemm_fp8_192d`: `Own192` with the deferred store, as `Own128Deferred`. On an H100 1-4%
    /// over `Own192` (likely: three consumers of 160 registers have no room for the packed tile).
    Own192Deferred,
    /// Per launch: `Own128Deferred` for a wide projection (N ≥ 8,192) of at most
    /// [`Fp8Gemm::BY_SHAPE_ROWS`] rows, `Own192` otherwise (what measured fastest for each on an
    /// H100: at 977 rows own128d took gate/up, in_proj and qkv with LoRA 4-7% under own192, which
    /// kept N = 2,560 and every shape at 7,816 rows). The same bits either way (tests/gpu: own128
    /// and own192 equal bitwise, own128d and own128 too), so the choice may follow M.
    ByShape,
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
    /// Up to how many rows `ByShape` runs the wide projections on `Own128Deferred` (the crossover
    /// lies between the 977 and 7,816 rows measured; not yet narrowed).
    pub const BY_SHAPE_ROWS: usize = 1024;

    /// The form a launch of `m` rows and `n` columns runs on: `ByShape`'s choice, else itself.
    fn for_shape(self, m: usize, n: usize) -> Self {
        match self {
            Self::ByShape if n >= 8192 && m <= Self::BY_SHAPE_ROWS => Self::Own128Deferred,
            Self::ByShape => Self::Own192,
            other => other,
        }
    }
    /// Consumer warpgroups of the kernel, None for cuBLASLt (`ByShape`: its usual form's).
    fn consumers(self) -> Option<usize> {
        match self {
            Self::Cublas => None,
            Self::Own128 | Self::Own128Multicast | Self::Own128Deferred => Some(2),
            Self::Own192 | Self::Own192Multicast | Self::Own192Deferred | Self::ByShape => Some(3),
        }
    }
    /// Blocks of a cluster: 2 where they share W tiles.
    fn cluster(self) -> usize {
        match self {
            Self::Own128Multicast | Self::Own192Multicast => 2,
            _ => 1,
        }
    }
    /// The GLU form's kernel (the MLP's gate/up projection with the SwiGLU in its epilogue), for
    /// the same tile height; it runs without clusters.
    fn glu_kernel(self) -> &'static str {
        match self.consumers() {
            Some(3) => "gemm_fp8_glu_192",
            _ => "gemm_fp8_glu_128",
        }
    }
    /// The kernel's name.
    fn kernel(self) -> &'static str {
        match self {
            Self::Cublas | Self::Own128 => "gemm_fp8_128",
            Self::Own192 => "gemm_fp8_192",
            Self::Own128Multicast => "gemm_fp8_128m",
            Self::Own192Multicast => "gemm_fp8_192m",
            Self::Own128Deferred => "gemm_fp8_128d",
            Self::Own192Deferred => "gemm_fp8_192d",
            Self::ByShape => Self::Own192.kernel(),
        }
    }
    /// For the start-up log.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Cublas => "cuBLASLt (LoRA B as its own GEMM)",
            Self::Own128 => "own kernel, 128-row tiles, LoRA B in the epilogue",
            Self::Own192 => "own kernel, 192-row tiles, LoRA B in the epilogue",
            Self::Own128Multicast => {
                "own kernel, 128-row tiles in clusters of two sharing W, LoRA B in the epilogue"
            }
            Self::Own192Multicast => {
                "own kernel, 192-row tiles in clusters of two sharing W, LoRA B in the epilogue"
            }
            Self::Own128Deferred => {
                "own kernel, 128-row tiles, LoRA B in the epilogue, stores under the next tile's MMAs"
            }
            Self::Own192Deferred => {
                "own kernel, 192-row tiles, LoRA B in the epilogue, stores under the next tile's MMAs"
            }
            Self::ByShape => {
                "own kernel, 128-row tiles storing under the next tile's MMAs for wide projections of few rows, else 192-row tiles"
            }
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
            "own128m" => Self::Own128Multicast,
            "own192m" => Self::Own192Multicast,
            "own128d" => Self::Own128Deferred,
            "own192d" => Self::Own192Deferred,
            "by-shape" => Self::ByShape,
            other => bail!(
                "{other}: expected cublas, own (= own128), own192, own128m, own192m, own128d, own192d or by-shape"
            ),
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
    /// `[group columns / 128][2]` i32 rank windows ([`layout::lora_rank_windows`]; for the GLU
    /// form [`layout::lora_rank_windows_glu`]).
    pub windows: u64,
    pub scale: f32,
}

impl CudaBackend {
    /// Whether block-scaled FP8 GEMMs run on `gemm_fp8` (then LoRA pairs inside an FP8 group go to
    /// its epilogue).
    pub(super) fn own_fp8_gemm(&self) -> bool {
        self.fp8_gemm_runs().consumers().is_some()
    }

    /// Whether LoRA A sides go to `gemm_bf16_<rows>` when they fit it (see `gemm_bf16_own`).
    pub fn own_lora_a(&self) -> bool {
        self.state.options.lora_a_own && self.own_fp8_gemm()
    }

    fn fp8_gemm_runs(&self) -> Fp8Gemm {
        self.state.options.fp8_gemm.on(self.state.info.hopper())
    }

    /// Runs `g` on `gemm_fp8_<rows>` with `lora` in the epilogue, then `bias` (a device pointer to
    /// `g.n` f32 for `g`'s columns, 0 for none: added to the output rounded to BF16 and rounded
    /// again, `add_bias8`'s arithmetic), and returns true, or returns false (nothing launched)
    /// when the kernel cannot take it.
    pub(super) fn gemm_fp8(&self, g: &Gemm, lora: Option<&LoraEpilogue>, bias: u64) -> Result<bool> {
        let runs = self.fp8_gemm_runs().for_shape(g.m, g.n);
        let Some(nc) = runs.consumers().filter(|_| eligible(g) && lora.is_none_or(lora_eligible)) else {
            return Ok(false);
        };
        let tiles = operand_tiles(g, lora, layout::gemm_fp8_tile_rows(nc), runs.cluster());
        let (win, col0, scale) = lora.map_or((0, 0, 0.0), |l| (l.windows, l.col0, l.scale));
        let launch = KernelLaunch {
            name: runs.kernel(),
            consumers: nc,
            cluster: runs.cluster(),
            tiles_per_unit: 1,
            slices: 1,
            part: 0,
            tiles,
        };
        self.launch_gemm_kernel(&launch, g, g.w_scale, win, col0, scale, bias, 0)?;
        Ok(true)
    }

    /// Runs the MLP's gate/up projection `g` (W's rows: gate's `g.n / 2`, then up's) on
    /// `gemm_fp8_glu_<rows>`: writes `h = silu(gate)·up` `[g.m][g.n / 2]` in BF16 to `g.y` (row
    /// stride `g.ldy` = `g.n / 2`) and its per-token 1×128 FP8 quantisation to `q` (what
    /// `swiglu_quant_1x128` writes from the stored gate/up output: the same bits), with `lora` in
    /// the epilogue (its windows per GLU tile, [`layout::lora_rank_windows_glu`]). Returns false
    /// (nothing launched) when the kernel cannot take it (not Hopper, or `g`'s shape).
    pub(super) fn gemm_fp8_glu(&self, g: &Gemm, lora: Option<&LoraEpilogue>, q: &ActFp8) -> Result<bool> {
        let runs = self.fp8_gemm_runs();
        // (Whether the GLU form is wanted at all, `swiglu_epilogue`, is the caller's choice:
        // `CudaBackend::swiglu_project`.)
        let Some(nc) = runs.consumers().filter(|_| {
            eligible(g)
                && g.n % 256 == 0
                && g.ldy == g.n / 2
                && q.mpad == g.m
                && lora.is_none_or(lora_eligible)
        }) else {
            return Ok(false);
        };
        let rows = layout::gemm_fp8_tile_rows(nc);
        let mut tiles = operand_tiles(g, lora, rows, 2);
        let h = g.n / 2;
        tiles[5] =
            Some(Tile2d { row_stride: g.ldy, ..Tile2d::swizzled("GLU h", Elem::Bf16, g.y, h, g.m, 64, 64) });
        tiles[6] = Some(Tile2d::swizzled("GLU h codes", Elem::U8, self.p(&q.q), h, g.m, 128, 64));
        let (win, col0, scale) = lora.map_or((0, 0, 0.0), |l| (l.windows, l.col0, l.scale));
        let launch = KernelLaunch {
            name: runs.glu_kernel(),
            consumers: nc,
            cluster: 1,
            tiles_per_unit: 2,
            slices: 1,
            part: 0,
            tiles,
        };
        self.launch_gemm_kernel(&launch, g, g.w_scale, win, col0, scale, 0, self.p(&q.s))?;
        Ok(true)
    }

    /// Runs the BF16 GEMM `g` (a LoRA A side: `y = x·wᵀ`, N the rank) on `gemm_bf16_<rows>` and
    /// returns true, or returns false (nothing launched) when that form is off
    /// ([`super::CudaOptions::lora_a_own`], or no own FP8 GEMM on this GPU) or cannot take `g`.
    /// Up to [`super::CudaOptions::lora_a_split_rows`] rows it runs split: a unit per tile and K
    /// slice writing f32 sums, then `gemm_bf16_slices_sum` adds the slices in order (the whole
    /// form's arithmetic: the same bits). Past that it runs whole, a unit per row tile, on 64-row
    /// tiles ([`layout::LORA_A_WHOLE_TILE_ROWS`], `gemm_bf16_64`): a LoRA A side is one column
    /// tile, so taller tiles would leave most SMs idle below ~25,000 rows.
    pub(super) fn gemm_bf16_own(&self, g: &Gemm) -> Result<bool> {
        let runs = self.fp8_gemm_runs();
        let Some(nc) = runs.consumers().filter(|_| self.own_lora_a() && bf16_eligible(g)) else {
            return Ok(false);
        };
        let slices = layout::lora_a_slices(g.k);
        let split_rows = self.state.options.lora_a_split_rows.unwrap_or(layout::LORA_A_SPLIT_ROWS);
        let split = slices > 1 && g.m > 0 && g.m <= split_rows;
        // Split: the FP8 GEMM's tile height; whole: the whole form's own (64 rows by default).
        let nc = match split {
            true => nc,
            false => whole_consumers(self.state.options.lora_a_whole_rows)?,
        };
        let rows = layout::gemm_fp8_tile_rows(nc);
        let part = if split { Some(self.alloc_f32(slices * g.m * g.n)?) } else { None };
        // The form reads only its LoRA operands and Y: X goes in T's place, W in B's.
        let tiles = [
            None,
            None,
            None,
            Some(Tile2d::swizzled("BF16 GEMM X", Elem::Bf16, g.x, g.k, g.m, 64, rows)),
            Some(Tile2d::swizzled("BF16 GEMM W", Elem::Bf16, g.w, g.k, g.n, 64, 128)),
            Some(Tile2d::swizzled("BF16 GEMM Y", Elem::Bf16, g.y, g.n, g.m, 64, 64)),
            None,
        ];
        let launch = KernelLaunch {
            name: bf16_kernel(nc),
            consumers: nc,
            cluster: 1,
            tiles_per_unit: 1,
            slices: if split { slices } else { 1 },
            part: part.as_ref().map_or(0, |p| self.p(p)),
            tiles,
        };
        self.launch_gemm_kernel(&launch, g, 0, 0, 0, 1.0, 0, 0)?;
        if let Some(part) = &part {
            let quads = g.m * g.n / 4;
            let args = [
                Arg::Ptr(self.p(part)),
                Arg::I32(slices as i32),
                Arg::I32(g.m as i32),
                Arg::I32(g.n as i32),
                Arg::Ptr(g.y),
            ];
            self.launch("gemm_bf16_slices_sum", launch_config((grid1(quads, 256), 1, 1), 256, 0), &args)?;
        }
        Ok(true)
    }

    /// Launches an entry of kernels/gemm_fp8.cu (they share one parameter list) over `g`'s M, N
    /// and K on a persistent grid: its seven tensor maps (from the cache; zeros where the entry
    /// reads none), then the W scales, the sizes, the LoRA windows, first column and scale, the
    /// bias and the GLU form's activation scales.
    #[allow(clippy::too_many_arguments)]
    fn launch_gemm_kernel(
        &self,
        l: &KernelLaunch,
        g: &Gemm,
        w_scale: u64,
        windows: u64,
        col0: usize,
        scale: f32,
        bias: u64,
        glu_scales: u64,
    ) -> Result<()> {
        if g.m == 0 {
            return Ok(());
        }
        let mut args = Vec::with_capacity(16);
        for tile in &l.tiles {
            let map = match tile {
                Some(t) => self.state.tensor_maps.get(t)?,
                None => TensorMap::unused(),
            };
            args.push(Arg::Map(map));
        }
        args.extend([
            Arg::Ptr(w_scale),
            Arg::I32(g.m as i32),
            Arg::I32(g.n as i32),
            Arg::I32(g.k as i32),
            Arg::Ptr(windows),
            Arg::I32(col0 as i32),
            Arg::F32(scale),
            Arg::Ptr(bias),
            Arg::Ptr(glu_scales),
            Arg::I32(layout::LORA_A_KSLICE as i32),
            Arg::Ptr(l.part),
        ]);
        let (threads, smem) =
            (layout::gemm_fp8_threads(l.consumers), layout::gemm_fp8_smem_bytes(l.consumers));
        // Units of work run at once: one block an SM, or the clusters the GPCs hold at once (a
        // cluster that had to wait for another to finish would double the time).
        let slots = match l.cluster {
            1 => self.state.info.multiprocessors,
            _ => self.resident_clusters(l.name, threads, smem)?,
        };
        let grid =
            layout::gemm_fp8_grid(g.m, g.n / l.tiles_per_unit, l.consumers, l.cluster, l.slices, slots);
        self.launch(l.name, launch_config((grid, 1, 1), threads, smem), &args)
    }
}

/// The BF16 form's kernel (`gemm_bf16_<rows>`) with `consumers` consumer warpgroups.
fn bf16_kernel(consumers: usize) -> &'static str {
    match consumers {
        1 => "gemm_bf16_64",
        3 => "gemm_bf16_192",
        _ => "gemm_bf16_128",
    }
}

/// Consumer warpgroups of the BF16 form's whole launches for a tile height of `rows`
/// ([`super::CudaOptions::lora_a_whole_rows`]; None: [`layout::LORA_A_WHOLE_TILE_ROWS`]). Also
/// checked by `CudaBackend::new`, so that a bad value fails at startup, not in a forward.
pub(super) fn whole_consumers(rows: Option<usize>) -> Result<usize> {
    match rows.unwrap_or(layout::LORA_A_WHOLE_TILE_ROWS) {
        r @ (64 | 128 | 192) => Ok(r / 64),
        r => anyhow::bail!("LoRA A whole-form tiles of {r} rows: the kernel has 64, 128 and 192"),
    }
}

/// Which entry of kernels/gemm_fp8.cu a launch runs and what its tensor maps describe.
struct KernelLaunch {
    name: &'static str,
    consumers: usize,
    cluster: usize,
    /// Column tiles a unit of work: 2 for the GLU form (the pair quantised together), else 1.
    tiles_per_unit: usize,
    /// Units a tile: the split BF16 form's K slices, else 1.
    slices: usize,
    /// The split BF16 form's f32 sums `[slices][m][n]` (a device address), else 0.
    part: u64,
    tiles: [Option<Tile2d>; 7],
}

/// What the kernel's seven tensor maps describe, in its parameter order: X (a tile's rows x one
/// 128-byte k-block, swizzled), the X scales (a tile's rows of one k-block), W (a column tile's
/// rows, or half of them: per block of a cluster of two, or per half of a GLU tile, `parts` = 2),
/// the LoRA's T and B (64 rank columns, the same rows as X and W; None without LoRA: zero maps the
/// kernel never reads), Y (64 columns x a warpgroup's 64 rows) and the GLU form's codes (None: the
/// caller sets them).
fn operand_tiles(g: &Gemm, lora: Option<&LoraEpilogue>, rows: usize, parts: usize) -> [Option<Tile2d>; 7] {
    let swizzled = Tile2d::swizzled;
    let x_scales = swizzled("FP8 GEMM X scales", Elem::F32, g.x_scale, g.m, g.k / 128, rows, 1);
    [
        Some(swizzled("FP8 GEMM X", Elem::U8, g.x, g.k, g.m, 128, rows)),
        Some(Tile2d { swizzle_128b: false, ..x_scales }),
        Some(swizzled("FP8 GEMM W", Elem::U8, g.w, g.k, g.n, 128, 128 / parts)),
        lora.map(|l| swizzled("LoRA T", Elem::Bf16, l.t, l.rank, l.rows, 64, rows)),
        lora.map(|l| swizzled("LoRA B", Elem::Bf16, l.b, l.rank, l.cols, 64, 128 / parts)),
        Some(Tile2d { row_stride: g.ldy, ..swizzled("FP8 GEMM Y", Elem::Bf16, g.y, g.n, g.m, 64, 64) }),
        None,
    ]
}

/// What `gemm_fp8` takes: block-scaled FP8, widths in whole 128-blocks, rows a multiple of 16
/// (the FP8 padding), an output whose rows are whole 16-byte chunks, and what every entry needs.
fn eligible(g: &Gemm) -> bool {
    g.kind == GemmKind::Fp8Block
        && g.n % 128 == 0
        && g.k % 128 == 0
        && g.k > 0 // (the _d kernels store a tile under the next one's first k-block)
        && g.m % 16 == 0
        && g.ldy % 8 == 0
        && g.x_scale % 16 == 0
        && plain_dense_and_aligned(g)
}

/// What `gemm_bf16_<rows>` takes: BF16, K in whole 64-column stages, a dense output whose rows are
/// whole 16-byte chunks, and what every entry needs.
fn bf16_eligible(g: &Gemm) -> bool {
    g.kind == GemmKind::Bf16 && g.k % 64 == 0 && g.n % 8 == 0 && g.ldy == g.n && plain_dense_and_aligned(g)
}

/// What every entry of kernels/gemm_fp8.cu needs: no α or β, operands as dense as cuBLASLt's plans
/// give them, 16-byte aligned for the TMA, and sizes that fit its `int` parameters.
fn plain_dense_and_aligned(g: &Gemm) -> bool {
    g.alpha == 1.0
        && g.beta == 0.0
        && g.ldw == g.k
        && g.ldx == g.k
        && g.x % 16 == 0
        && g.w % 16 == 0
        && g.y % 16 == 0
        && g.m <= i32::MAX as usize
        && g.n <= i32::MAX as usize
        && g.k <= i32::MAX as usize
}

/// What the epilogue's TMA copies take of a LoRA pair: 16-byte aligned T and B whose rows (the
/// rank, in BF16) are whole 16-byte chunks.
fn lora_eligible(l: &LoraEpilogue) -> bool {
    l.t % 16 == 0 && l.b % 16 == 0 && l.rank % 8 == 0 && l.rows > 0 && l.cols > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp8(n: usize, m: usize, k: usize) -> Gemm {
        Gemm::placeholder(GemmKind::Fp8Block, n, m, k)
    }

    /// A rank-64 pair over 2,560 output columns, T of `rows` rows (placeholder addresses).
    fn rank64_pair(rows: usize) -> LoraEpilogue {
        LoraEpilogue { t: 1 << 20, rows, b: 2 << 20, rank: 64, col0: 0, cols: 2560, windows: 0, scale: 2.0 }
    }

    #[test]
    fn parses_and_describes() {
        assert_eq!("own".parse::<Fp8Gemm>().unwrap(), Fp8Gemm::Own128);
        assert_eq!("own192".parse::<Fp8Gemm>().unwrap(), Fp8Gemm::Own192);
        assert_eq!("cublas".parse::<Fp8Gemm>().unwrap(), Fp8Gemm::Cublas);
        assert!("fast".parse::<Fp8Gemm>().unwrap_err().to_string().contains("expected cublas"));
        assert_eq!(Fp8Gemm::default(), Fp8Gemm::Own192);
        assert_eq!(Fp8Gemm::Cublas.consumers(), None);
        assert_eq!(Fp8Gemm::Own192.consumers(), Some(3));
        assert_eq!(Fp8Gemm::Own192.on(false), Fp8Gemm::Cublas, "cuBLASLt off Hopper");
        assert_eq!("own192d".parse::<Fp8Gemm>().unwrap(), Fp8Gemm::Own192Deferred);
        assert_eq!(Fp8Gemm::Own192Deferred.kernel(), "gemm_fp8_192d");
        assert_eq!(Fp8Gemm::Own192Deferred.consumers(), Some(3));
        assert_eq!(Fp8Gemm::Own192Deferred.glu_kernel(), "gemm_fp8_glu_192");
        assert_eq!("own128d".parse::<Fp8Gemm>().unwrap().kernel(), "gemm_fp8_128d");
        let by = "by-shape".parse::<Fp8Gemm>().unwrap();
        assert_eq!(by.for_shape(992, 18432), Fp8Gemm::Own128Deferred, "a wide projection of few rows");
        assert_eq!(by.for_shape(992, 2560), Fp8Gemm::Own192, "a narrow one");
        assert_eq!(by.for_shape(7824, 18432), Fp8Gemm::Own192, "many rows");
        assert_eq!(Fp8Gemm::Own192.for_shape(992, 18432), Fp8Gemm::Own192, "only by-shape chooses");
        assert_eq!(by.consumers(), Some(3));
        assert_eq!(Fp8Gemm::Own192.on(true), Fp8Gemm::Own192);
        assert_eq!("own192m".parse::<Fp8Gemm>().unwrap(), Fp8Gemm::Own192Multicast);
        assert_eq!(Fp8Gemm::Own192Multicast.kernel(), "gemm_fp8_192m");
        assert_eq!((Fp8Gemm::Own128Multicast.consumers(), Fp8Gemm::Own128Multicast.cluster()), (Some(2), 2));
        assert_eq!(Fp8Gemm::Own192.cluster(), 1);
    }

    #[test]
    fn eligibility_follows_the_kernels_assumptions() {
        assert!(eligible(&fp8(2560, 992, 9216)));
        assert!(!eligible(&Gemm { kind: GemmKind::Bf16, ..fp8(2560, 992, 9216) }));
        assert!(!eligible(&Gemm { beta: 1.0, ..fp8(2560, 992, 9216) }));
        assert!(!eligible(&fp8(2600, 992, 9216)), "N not whole 128-blocks");
        assert!(!eligible(&fp8(2560, 990, 9216)), "M not padded to 16");
        assert!(!eligible(&fp8(2560, 992, 0)), "no k-block");
        assert!(!eligible(&Gemm { y: (3 << 20) + 8, ..fp8(2560, 992, 9216) }), "Y not 16-byte aligned");
        assert!(!eligible(&Gemm { ldy: 2564, ..fp8(2560, 992, 9216) }), "Y rows not whole 16-byte chunks");
        let l = rank64_pair(992);
        assert!(lora_eligible(&l));
        assert!(!lora_eligible(&LoraEpilogue { rank: 20, ..l }), "rank rows not whole 16-byte chunks");
        assert!(!lora_eligible(&LoraEpilogue { t: (1 << 20) + 8, ..l }), "T misaligned for TMA");
    }

    #[test]
    fn the_bf16_form_takes_lora_a_sides() {
        let a = Gemm::placeholder(GemmKind::Bf16, 64, 977, 2560);
        assert!(bf16_eligible(&a));
        assert!(bf16_eligible(&Gemm { n: 256, ldy: 256, ..a }));
        assert!(!bf16_eligible(&fp8(2560, 992, 9216)), "FP8 goes to gemm_fp8");
        assert!(
            !bf16_eligible(&Gemm { k: 2560 + 32, ldx: 2592, ldw: 2592, ..a }),
            "K not whole 64-column stages"
        );
        assert!(!bf16_eligible(&Gemm { beta: 1.0, ..a }), "an accumulating GEMM (LoRA B)");
        assert_eq!(bf16_kernel(Fp8Gemm::Own192.consumers().unwrap()), "gemm_bf16_192");
        assert_eq!(bf16_kernel(Fp8Gemm::Own128Multicast.consumers().unwrap()), "gemm_bf16_128");
        // The whole form: 64-row tiles unless told otherwise, and only heights the kernel has.
        assert_eq!(bf16_kernel(whole_consumers(None).unwrap()), "gemm_bf16_64");
        assert_eq!(bf16_kernel(whole_consumers(Some(192)).unwrap()), "gemm_bf16_192");
        assert!(whole_consumers(Some(96)).is_err());
    }

    #[test]
    fn operand_tiles_pass_the_tma_rules() {
        // What the kernel copies, for the shapes of the 4B model's projections: every map the
        // driver will be asked for passes its rules (encoding itself needs the driver).
        let l = rank64_pair(977);
        for (n, k) in [(18432, 2560), (12288, 2560), (2560, 9216), (2560, 4096)] {
            for (rows, cluster) in [(128, 1), (192, 1), (128, 2), (192, 2)] {
                let tiles = operand_tiles(&fp8(n, 992, k), Some(&l), rows, cluster);
                assert!(tiles[..6].iter().all(|t| t.is_some()));
                for t in tiles.iter().flatten() {
                    t.check().unwrap_or_else(|e| panic!("N={n} K={k} rows {rows}: {e}"));
                }
            }
        }
        assert!(operand_tiles(&fp8(2560, 992, 9216), None, 128, 1)[3..5].iter().all(|t| t.is_none()));
        // An X that is not 16-byte aligned cannot be a TMA tensor (eligible() keeps such GEMMs off
        // the kernel): the check names it.
        let g = Gemm { x: (2 << 20) + 8, ..fp8(2560, 992, 9216) };
        let e = operand_tiles(&g, None, 128, 1)[0].unwrap().check().unwrap_err().to_string();
        assert!(e.contains("FP8 GEMM X") && e.contains("16-byte aligned"), "{e}");
    }
}
