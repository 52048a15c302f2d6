//! Layout planning of the CUDA backend that needs no GPU: how a fused projection's parts map to
//! FP8 and BF16 GEMMs, the delta-rule chunk table, KV-cache growth, the kernels' shared-memory
//! sizes, and the NVRTC target name. All of it is unit-tested on CPU-only machines; the kernels
//! that consume these layouts are tested on the GPU (`tests/gpu/`).

use crate::weights::fp8::FP8_BLOCK;
use crate::weights::StoredDtype;
use std::ops::Range;

/// Tokens per chunk of the chunked gated delta rule (the kernels are written for 64).
pub const DELTA_CHUNK: usize = 64;

/// How one row block of a projection is stored on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartFormat {
    /// E4M3 with `[out/128][in/128]` f32 multipliers; block-scaled cuBLASLt GEMM.
    Fp8,
    /// BF16; BF16 cuBLASLt GEMM with f32 accumulation.
    Bf16,
}

/// What a checkpoint tensor looks like, for choosing its GPU format.
#[derive(Debug, Clone, Copy)]
pub struct PartInfo {
    pub dtype: StoredDtype,
    pub out: usize,
    pub inp: usize,
    /// For an FP8 tensor: its scale grid is exactly `[out/128, in/128]` with 128×128 blocks.
    pub scales_are_128x128: bool,
}

/// FP8 checkpoint weights with 128×128 scales stay FP8; with `quantize`, other weights whose dims
/// are multiples of 128 are quantised at load; everything else (ragged dims such as in_proj_a/b
/// or small test models, FP8 tensors with other block sizes) is BF16.
/// With `dequantize`, everything is BF16 (FP8 checkpoints dequantised at load).
pub fn part_format(p: &PartInfo, quantize: bool, dequantize: bool) -> PartFormat {
    let aligned = p.out % FP8_BLOCK == 0 && p.inp % FP8_BLOCK == 0 && p.out > 0 && p.inp > 0;
    match p.dtype {
        _ if dequantize => PartFormat::Bf16,
        StoredDtype::F8E4M3 if aligned && p.scales_are_128x128 => PartFormat::Fp8,
        _ if aligned && quantize => PartFormat::Fp8,
        _ => PartFormat::Bf16,
    }
}

/// A run of consecutive parts with the same format, computed by one GEMM into output columns
/// `cols` (the projection's parts are concatenated along the output dim).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartGroup {
    pub format: PartFormat,
    pub parts: Range<usize>,
    pub cols: Range<usize>,
}

/// Groups consecutive parts of equal format. `parts[i] = (format, out_i)`.
pub fn group_parts(parts: &[(PartFormat, usize)]) -> Vec<PartGroup> {
    let mut groups: Vec<PartGroup> = Vec::new();
    let mut col = 0;
    for (i, &(f, out)) in parts.iter().enumerate() {
        match groups.last_mut() {
            Some(g) if g.format == f => {
                g.parts.end = i + 1;
                g.cols.end = col + out;
            }
            _ => groups.push(PartGroup { format: f, parts: i..i + 1, cols: col..col + out }),
        }
        col += out;
    }
    groups
}

/// Chunks of the delta rule for a packed batch: `chunks` holds `[row_start, len]` pairs (chunks
/// start at each sequence's first row and never cross sequences), `per_segment[s]` is
/// `(first chunk, chunk count)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkTable {
    pub chunks: Vec<i32>,
    pub per_segment: Vec<(usize, usize)>,
}

impl ChunkTable {
    pub fn len(&self) -> usize {
        self.chunks.len() / 2
    }
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

pub fn chunk_table(segments: &[Range<usize>], chunk: usize) -> ChunkTable {
    let mut chunks = Vec::new();
    let mut per_segment = Vec::with_capacity(segments.len());
    for seg in segments {
        let first = chunks.len() / 2;
        let mut start = seg.start;
        while start < seg.end {
            let len = chunk.min(seg.end - start);
            chunks.push(start as i32);
            chunks.push(len as i32);
            start += len;
        }
        per_segment.push((first, chunks.len() / 2 - first));
    }
    ChunkTable { chunks, per_segment }
}

/// Capacity (rows) of a KV cache that holds `current` rows and must hold `needed`: at least 1.5×
/// the old capacity (amortised O(1) appends), rounded up to 256 rows.
pub fn kv_capacity(current: usize, needed: usize) -> usize {
    let want = needed.max(current + current / 2).max(1);
    want.div_ceil(256) * 256
}

/// The NVRTC `--gpu-architecture` for a compute capability: `sm_90a` on Hopper (the arch-specific
/// target that also enables wgmma/setmaxnreg), `sm_XY` elsewhere.
pub fn gpu_arch(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// The padded head dim the attention kernel is instantiated for (`attn_fwd_<HDP>`).
pub fn attention_head_dim(hd: usize) -> Option<usize> {
    [16, 32, 64, 128, 256].into_iter().find(|&p| hd <= p)
}

/// Dynamic shared memory of `attn_fwd_<hdp>`: Q, K and V tiles of 64 rows, row stride hdp + 8.
pub const fn attention_smem_bytes(hdp: usize) -> usize {
    3 * 64 * (hdp + 8) * 2
}

/// Key/value rows per tile of `attn_fwd_q128_<hdp>` (kernels/attention.cu).
pub const fn attention_q128_key_tile(hdp: usize) -> usize {
    if hdp > 128 {
        32
    } else {
        64
    }
}

/// Keys per range when a short sequence splits its keys (`attn_fwd_q128` in split mode; a multiple
/// of every key tile).
pub const ATTENTION_KEY_RANGE: usize = 4096;
/// Query rows from which `AttentionKernel::Auto` runs a head-dim-256 sequence on `attn_fwd_ws_256`
/// (TMA key/value tiles) instead of `attn_fwd_wgmma_256` (the same bits; src/backend/cuda/attention.rs).
/// On an H100 ws took 0.77x wgmma's time at 16K causal and 0.83x at 4K, but 0.97x at 1K (3 µs a
/// layer), where the host's map encoding for each of a round's many short sequences would cost
/// more than it saves (bench/NOTES.md, thirtieth session).
pub const ATTENTION_WS_MIN_ROWS: usize = 2048;
/// Sequences of at most this many query rows (one query tile) may split their keys.
pub const ATTENTION_SPLIT_MAX_ROWS: usize = 128;

/// Key ranges of a sequence of `rows` query rows over `kvlen` keys: more than one only for short
/// sequences over long caches (passes over a long prefix). Depends on the sequence alone, so a
/// row's arithmetic never depends on the batch.
pub fn attention_key_ranges(rows: usize, kvlen: usize) -> usize {
    if rows > 0 && rows <= ATTENTION_SPLIT_MAX_ROWS && kvlen > ATTENTION_KEY_RANGE {
        kvlen.div_ceil(ATTENTION_KEY_RANGE)
    } else {
        1
    }
}

/// f32 values of one (sequence, head, key range) slot of split attention: the unnormalised
/// output `[128][hdp]`, then the row maxima and sums `[128]` each.
pub const fn attention_split_slot_floats(hdp: usize) -> usize {
    ATTENTION_SPLIT_MAX_ROWS * hdp + 2 * ATTENTION_SPLIT_MAX_ROWS
}

/// Dynamic shared memory of `attn_fwd_wgmma_<hdp>` (head dims 64 and 256): 1024 bytes of slack
/// to align the swizzled tiles, a Q tile of 128 rows and double-buffered K and V tiles of 64 rows,
/// unpadded (the 128-byte swizzle spreads the banks).
pub const fn attention_wgmma_smem_bytes(hdp: usize) -> usize {
    attention_wgmma_smem_bytes_tiles(hdp, 64)
}

/// [`attention_wgmma_smem_bytes`] with key tiles of `bk` rows (`attn_fwd_wgmma_k128_64`: 128).
pub const fn attention_wgmma_smem_bytes_tiles(hdp: usize, bk: usize) -> usize {
    attention_wgmma_smem_bytes_ring(hdp, bk, 2)
}

/// [`attention_wgmma_smem_bytes_tiles`] with `stages` K and V buffers each
/// (`attn_fwd_wgmma_k128g3_64`: 3).
pub const fn attention_wgmma_smem_bytes_ring(hdp: usize, bk: usize, stages: usize) -> usize {
    1024 + (128 + 2 * stages * bk) * hdp * 2
}

/// Bytes of BF16 ones after `attn_fwd_wgmma_tsum_64`'s K and V buffers: the B operand of its rows'
/// sums (4 KB: any layout a descriptor names from its start stays inside).
pub const ATTENTION_TSUM_ONES_BYTES: usize = 4096;

/// Dynamic shared memory of `attn_fwd_wgmma_tsum_64`: `attn_fwd_wgmma_k128_64`'s and the ones.
pub const fn attention_wgmma_tsum_smem_bytes() -> usize {
    attention_wgmma_smem_bytes_tiles(64, 128) + ATTENTION_TSUM_ONES_BYTES
}

/// Key tile and ring stages of `attn_fwd_ws_<hdp>` (`consumers` = 2) and `attn_fwd_ws3_64` (3)
/// (`WsTiles` in kernels/attention.cu): 128 keys and 3 stages at head dim 64 (4 with three
/// consumers), 64 keys and 2 stages at 256.
pub const fn attention_ws_tiles(hdp: usize, consumers: usize) -> (usize, usize) {
    match (hdp, consumers) {
        (64, 3) => (128, 4),
        (64, _) => (128, 3),
        _ => (64, 2),
    }
}

/// Query rows of one block of the warp-specialised attention: 64 per consumer warpgroup.
pub const fn attention_ws_query_rows(consumers: usize) -> usize {
    64 * consumers
}

/// Threads of one block of the warp-specialised attention: the producer warpgroup and the
/// consumers.
pub const fn attention_ws_threads(consumers: usize) -> u32 {
    128 * (consumers as u32 + 1)
}

/// Dynamic shared memory of `attn_fwd_ws_<hdp>` (head dims 64 and 256) and `attn_fwd_ws3_64`:
/// 1024 bytes of slack to align the swizzled tiles, the Q tile, the K and V rings, and four
/// mbarriers (full and empty, K and V) per stage.
pub const fn attention_ws_smem_bytes(hdp: usize, consumers: usize) -> usize {
    let (bk, stages) = attention_ws_tiles(hdp, consumers);
    1024 + (attention_ws_query_rows(consumers) + 2 * stages * bk) * hdp * 2 + 4 * stages * 8
}

/// Threads of `attn_fwd_q128_<hdp>`: 8 warps of 16 rows (`MT` = 1 in kernels/attention.cu).
pub const fn attention_q128_threads(_hdp: usize) -> u32 {
    256
}

/// Dynamic shared memory of `attn_fwd_q128_<hdp>`: a Q tile of 128 rows and double-buffered K and
/// V tiles, row stride hdp + 8.
pub const fn attention_q128_smem_bytes(hdp: usize) -> usize {
    (128 + 4 * attention_q128_key_tile(hdp)) * (hdp + 8) * 2
}

/// Whether `attn_fwd_q128` serves a head dim: instantiated for 64, 128 and 256, and its 16-byte
/// copies need head dims that are multiples of 8.
pub fn attention_q128_serves(hd: usize) -> bool {
    hd % 8 == 0 && matches!(attention_head_dim(hd), Some(64 | 128 | 256))
}

const fn max(a: usize, b: usize) -> usize {
    if a > b {
        a
    } else {
        b
    }
}

/// Dynamic shared memory of `gdn_chunk_scan_tc_<dk>` (kernels/deltanet.cu): k [dk][68], q [dk][68]
/// reused for T and P [2][64][68], S [dk][40], R and Vn [64][40], gamma, beta, decay factors [64].
pub const fn delta_tc_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    (dk * (c + 4) + max(dk * (c + 4), 2 * c * (c + 4)) + dk * 40 + 2 * c * 40 + 3 * c) * 4
}

/// Dynamic shared memory of `gdn_chunk_scan_{tc,tf32}_wide_<dk>` (kernels/deltanet.cu): as
/// `gdn_chunk_scan_tc_<dk>` with 128 value columns: k [dk][68], q [dk][68] reused for T and P
/// [2][64][68], S [dk][136], R and Vn [64][136], gamma, beta, decay factors [64]. 209,664 bytes at
/// dk 128: one block (16 warps) per SM.
pub const fn delta_tc_wide_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    (dk * (c + 4) + max(dk * (c + 4), 2 * c * (c + 4)) + dk * 136 + 2 * c * 136 + 3 * c) * 4
}

/// Dynamic shared memory of `gdn_chunk_scan_tc_pipelined_<dk>` (kernels/deltanet.cu): k and q
/// row-major [2][64][dk+4] each and v/R [2][64][40] (two chunks' inputs: the next one is copied
/// while the current one computes), T and P [64][72], S [dk][40], Vn [64][40], and the gates
/// (e^gamma, decay factors, beta) [2][3][64]. 224,768 bytes at dk 128: one block per SM.
pub const fn delta_tc_pipelined_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    (4 * c * (dk + 4) + 2 * c * 40 + 2 * c * (c + 8) + dk * 40 + c * 40 + 6 * c) * 4
}

/// Dynamic shared memory of `gdn_chunk_scan_wg_<dk>` (kernels/deltanet_wg.cu): 1,024 bytes of
/// slack to align the swizzled tiles, k and q of two chunks [2][2][64][dk], K^T [dk][64], T and P
/// [64][64], v [64][72], the gates [2][3][64], 8 mbarriers. 217,664 bytes at dk 128: one block per SM.
pub const fn delta_wg_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    1024 + (4 * c * dk + dk * c + 2 * c * c + c * (c + 8) + 6 * c) * 4 + 8 * 8
}

/// Dynamic shared memory of `gdn_chunk_scan_wg2_<dk>` (kernels/deltanet_wg.cu, PAIR): as
/// [`delta_wg_smem_bytes`] with one K, Q buffer instead of two and a V tile for each of its two
/// warpgroups. 170,560 bytes at DK 128.
pub const fn delta_wg2_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    1024 + (2 * c * dk + dk * c + 2 * c * c + 2 * c * (c + 8) + 6 * c) * 4 + 8 * 8
}

/// Dynamic shared memory of `gdn_chunk_scan_wgl_<dk>` (kernels/deltanet_wg.cu, LEAN): 1,024 bytes
/// of slack, one K tile [64][dk] (later the chunk's K^T [dk][64] over it), one Q tile (later T and
/// P [64][64] each over it: the larger of the two), v [64][72], the gates [2][3][64] (one used),
/// 8 mbarriers (unused). 86,592 bytes at dk 128: two blocks an SM.
pub const fn delta_wgl_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    let q_slot = if 2 * c * c > c * dk { 2 * c * c } else { c * dk };
    1024 + (c * dk + q_slot + c * (c + 8) + 6 * c) * 4 + 8 * 8
}

/// The row of a chunk (or the key dim) whose values `gdn_chunk_scan_wg_<dk>` keeps in accumulator
/// column / shared row `n` (`wg_row` in kernels/deltanet_wg.cu, the same arithmetic): within each
/// group of 8, `n = 8a + 2t + e` holds `8a + t + 4e`. A TF32 A fragment's lane holds the k columns
/// `tg` and `tg + 4` of its 8-column step where an accumulator's holds `2tg` and `2tg + 1`; with this
/// order an accumulator is the next product's A operand with its k index in natural order.
pub const fn wg_row(n: usize) -> usize {
    (n & !7) | ((n & 1) << 2) | ((n >> 1) & 3)
}

/// Dynamic shared memory of `gdn_split_wu_<dk>` (kernels/deltanet_split.cu): T [64][72],
/// β·e^γ·k [64][max(dk, 32) + 4], β·v [64][132] (value dims up to 128), gamma and beta [64].
pub const fn delta_split_wu_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    (c * (c + 8) + c * (max(dk, 32) + 4) + c * 132 + 2 * c) * 4
}

/// Dynamic shared memory of `gdn_split_state_<dk>` (kernels/deltanet_split.cu): k and W
/// [2][64][dk+4] each and U [2][64][40] (the next chunk's copied while the current one computes),
/// S [dk][40], Vn [64][40], the gates [2][3][64]. 187,904 bytes at dk 128: one block per SM.
pub const fn delta_split_state_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    (4 * c * (dk + 4) + 2 * c * 40 + dk * 40 + c * 40 + 6 * c) * 4
}

/// Dynamic shared memory of `gdn_split_out_<dk>` (kernels/deltanet_split.cu): q [64][dk+4], the
/// chunk's starting state H [dk][40], P [64][72], Vn [64][40], gamma and beta [64].
pub const fn delta_split_out_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    (c * (dk + 4) + dk * 40 + c * (c + 8) + c * 40 + 2 * c) * 4
}

/// Dynamic shared memory of `gdn_chunk_prep_<dk>` (kernels/deltanet.cu): max(q and k staged
/// [dk][68], A of two value heads [2][64][65]) + gamma, beta [2][64] each.
pub const fn delta_prep_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    (max(2 * dk * (c + 4), 2 * c * (c + 1)) + 4 * c) * 4
}

/// Dynamic shared memory of `gdn_chunk_scan_<dk>` (kernels/deltanet.cu): k [dk][68], q [dk][68]
/// reused for T and P [2][64][64], S [dk][32], R and Vn [64][32], gamma, beta, decay factors [64].
pub const fn delta_scan_smem_bytes(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    (dk * (c + 4) + max(dk * (c + 4), 2 * c * c) + dk * 32 + 2 * c * 32 + 3 * c) * 4
}

/// The LoRA ranks per part `swiglu_lora_quant_1x128_<r>` (kernels/quant.cu) is built for.
pub const SWIGLU_LORA_RANKS: [usize; 3] = [16, 32, 64];

/// The rank per part when a projection's one fused LoRA pair (`parts`: each part's output
/// columns and rank, over `cols` of `out_dim` columns) has the form `swiglu_lora_quant_1x128_<r>`
/// takes: two parts, gate = the first half of the columns and up = the second, of one rank in
/// [`SWIGLU_LORA_RANKS`].
pub fn swiglu_lora_rank(
    parts: &[(Range<usize>, usize)],
    cols: &Range<usize>,
    out_dim: usize,
) -> Option<usize> {
    let half = out_dim / 2;
    match parts {
        [(g, r), (u, ru)]
            if r == ru
                && out_dim % 2 == 0
                && *g == (0..half)
                && *u == (half..out_dim)
                && *cols == (0..out_dim)
                && SWIGLU_LORA_RANKS.contains(r) =>
        {
            Some(*r)
        }
        _ => None,
    }
}

/// Dynamic shared memory of `swiglu_lora_quant_1x128_<r>` (kernels/quant.cu), bf16 tiles with
/// rows padded by 8: t [64][2r + 8], B_gate and B_up [128][r + 8], gate and up [64][136].
pub const fn swiglu_lora_smem_bytes(r: usize) -> usize {
    (64 * (2 * r + 8) + 2 * 128 * (r + 8) + 2 * 64 * 136) * 2
}

/// Rows of a tile of `gemm_fp8_<rows>` (kernels/gemm_fp8.cu): 64 per consumer warpgroup.
pub const fn gemm_fp8_tile_rows(consumers: usize) -> usize {
    64 * consumers
}

/// Ring stages of `gemm_fp8_<rows>` (the kernel's `GemmFp8Tiles::ST`): what fits beside the
/// output tile's staging.
pub const fn gemm_fp8_stages(consumers: usize) -> usize {
    match consumers {
        1 => 8,
        2 => 5,
        _ => 4,
    }
}

/// Threads of `gemm_fp8_<rows>`: a producer warpgroup and the consumers.
pub const fn gemm_fp8_threads(consumers: usize) -> u32 {
    128 * (consumers as u32 + 1)
}

/// Blocks of `gemm_fp8_<rows>`'s persistent grid for an `m` x `n` output: as many units of work
/// (a tile, or with clusters of two blocks a pair of row tiles of one column tile; `slices` units
/// a tile in the split BF16 form, a unit per K slice, else 1) as run at once (`slots`: SMs, or the
/// clusters the GPU holds at once), and no more than there are, in whole clusters.
pub fn gemm_fp8_grid(
    m: usize,
    n: usize,
    consumers: usize,
    cluster: usize,
    slices: usize,
    slots: usize,
) -> u32 {
    let units = m.div_ceil(gemm_fp8_tile_rows(consumers)).div_ceil(cluster) * n.div_ceil(128) * slices;
    (units.min(slots).max(1) * cluster) as u32
}

/// The K slice of the FP8 kernel's BF16 form (`gemm_bf16_<rows>`, the LoRA A sides; the kernel's
/// `GemmFp8Args::kslice`): a slice's products are summed by the tensor cores, then the slices' sums
/// are added in f32 in order. Four 64-column stages: at 977 rows and K = 2,560 the split form has
/// 10 slices a tile (60 units at 192-row tiles instead of 6), the partial sums 10 × 977 × 128 f32
/// (5 MB, mostly in L2).
pub const LORA_A_KSLICE: usize = 256;

/// K slices of `gemm_bf16_<rows>` over `k` columns.
pub fn lora_a_slices(k: usize) -> usize {
    k.div_ceil(LORA_A_KSLICE)
}

/// Up to how many rows the own LoRA A side runs split (a unit per tile and K slice, then
/// `gemm_bf16_slices_sum`) rather than whole (a unit per tile): the same bits either way, so a
/// speed choice only. Whole, a launch has a unit per 192 rows, which at a few thousand rows leaves
/// most SMs idle; split, the partial sums cost 2 × slices × 4 bytes a row and rank column of
/// traffic, which outgrows the idle SMs past a few thousand rows. Measured on an H100 (bench/NOTES.md,
/// twenty-first session): split beats whole at 977 and 2,048 rows on every shape (in_proj + LoRA
/// 0.095 vs 0.112 ms at 977), and matches cuBLASLt's A side at 977 rows
/// ([`super::CudaOptions::lora_a_split_rows`] moves it).
pub const LORA_A_SPLIT_ROWS: usize = 2048;

/// Tile height of the own LoRA A side's whole form (`gemm_bf16_64`, one consumer warpgroup), past
/// [`LORA_A_SPLIT_ROWS`]: a LoRA A side is a single column tile, so the units are the row tiles
/// alone, and 64-row tiles fill the GPU from ~8,400 rows where 192-row tiles need ~25,000 (at
/// 7,816 rows: 123 units on 132 SMs against 41). The same bits on every height
/// ([`super::CudaOptions::lora_a_whole_rows`] moves it).
pub const LORA_A_WHOLE_TILE_ROWS: usize = 64;

/// Dynamic shared memory of `gemm_fp8_<rows>`: 1024 bytes of slack to align the swizzled tiles,
/// the output tile's BF16 staging (rows x 256 bytes), and per stage an X tile (rows x 128 bytes),
/// a W tile (128 x 128 bytes), the rows' f32 scales and the W scale (8 bytes), and two mbarriers
/// (full, empty).
pub const fn gemm_fp8_smem_bytes(consumers: usize) -> usize {
    let rows = gemm_fp8_tile_rows(consumers);
    1024 + rows * 256 + gemm_fp8_stages(consumers) * ((rows + 128) * 128 + rows * 4 + 8 + 2 * 8)
}

/// The rank columns `[begin, end)` of a fused LoRA pair that each 128-column tile of an FP8 group
/// needs in `gemm_fp8`'s epilogue, as `[tiles][2]` (`end <= begin`: none). `parts` are the pair's
/// adapted parts (output columns, rank; their rank columns follow each other from 0) and `group`
/// the group's output columns; tiles are the group's columns from its start. B is block-diagonal,
/// so a tile's rows of B are zero outside the ranks of the parts it overlaps. None when the
/// kernel cannot take the pair: a part outside the group, or a rank or the group width not a
/// multiple of 8 / 128 (the kernel copies 8 rank columns, 16 bytes, at a time).
pub fn lora_rank_windows(parts: &[(Range<usize>, usize)], group: &Range<usize>) -> Option<Vec<i32>> {
    if group.len() % FP8_BLOCK != 0 {
        return None;
    }
    let tile = |t: usize| [group.start + t * FP8_BLOCK..group.start + (t + 1) * FP8_BLOCK, 0..0];
    rank_windows(parts, group, tile)
}

/// [`lora_rank_windows`] for the tiles of `gemm_fp8_glu_<rows>` over the group: tile t holds the
/// group's columns `64t .. 64t + 64` (gate's rows of W) and `half + 64t .. half + 64t + 64` (up's),
/// `half` = the group's width / 2 (the h columns `64t .. 64t + 64`). None as there, or when the
/// group is not whole 256-column blocks (a pair of tiles quantises one 128-block of h).
pub fn lora_rank_windows_glu(parts: &[(Range<usize>, usize)], group: &Range<usize>) -> Option<Vec<i32>> {
    if group.len() % (2 * FP8_BLOCK) != 0 {
        return None;
    }
    let (g0, half) = (group.start, group.len() / 2);
    let tile = |t: usize| [g0 + 64 * t..g0 + 64 * (t + 1), g0 + half + 64 * t..g0 + half + 64 * (t + 1)];
    rank_windows(parts, group, tile)
}

/// The rank window of each of a group's `len / 128` tiles, whose output columns `tile(t)` gives
/// (two ranges, the second possibly empty): the ranks of the parts overlapping them.
fn rank_windows(
    parts: &[(Range<usize>, usize)],
    group: &Range<usize>,
    tile: impl Fn(usize) -> [Range<usize>; 2],
) -> Option<Vec<i32>> {
    if parts.is_empty() {
        return None;
    }
    let mut offsets = Vec::with_capacity(parts.len());
    let mut r0 = 0;
    for (cols, r) in parts {
        if cols.start < group.start || cols.end > group.end || r % 8 != 0 {
            return None;
        }
        offsets.push(r0);
        r0 += r;
    }
    let tiles = group.len() / FP8_BLOCK;
    let mut w = Vec::with_capacity(2 * tiles);
    for t in 0..tiles {
        let (mut b, mut e) = (usize::MAX, 0);
        for ((cols, r), &o) in parts.iter().zip(&offsets) {
            if tile(t).iter().any(|c| cols.start < c.end && c.start < cols.end) {
                b = b.min(o);
                e = e.max(o + r);
            }
        }
        if e == 0 {
            b = 0;
        }
        w.extend([b as i32, e as i32]);
    }
    Some(w)
}

/// Largest power of two (≤ 256) dividing a device address: the alignment cuBLASLt is told about.
pub fn ptr_alignment(addr: u64) -> u32 {
    if addr == 0 {
        return 256;
    }
    (1u64 << addr.trailing_zeros().min(8)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_swiglu_lora_takes_only_a_gate_and_up_pair_of_one_supported_rank() {
        let all = 0..18432;
        assert_eq!(swiglu_lora_rank(&[(0..9216, 64), (9216..18432, 64)], &all, 18432), Some(64));
        assert_eq!(swiglu_lora_rank(&[(0..9216, 16), (9216..18432, 16)], &all, 18432), Some(16));
        assert_eq!(swiglu_lora_rank(&[(0..9216, 64), (9216..18432, 32)], &all, 18432), None, "unequal ranks");
        assert_eq!(
            swiglu_lora_rank(&[(0..9216, 48), (9216..18432, 48)], &all, 18432),
            None,
            "no kernel for 48"
        );
        assert_eq!(swiglu_lora_rank(&[(0..9216, 128), (9216..18432, 128)], &all, 18432), None, "above 64");
        assert_eq!(swiglu_lora_rank(&[(0..9216, 64)], &(0..9216), 18432), None, "gate only");
        assert_eq!(swiglu_lora_rank(&[(0..9000, 64), (9000..18432, 64)], &all, 18432), None, "not halves");
        assert_eq!(swiglu_lora_rank(&[(0..9216, 64), (9216..18432, 64), (0..1, 64)], &all, 18432), None);
        // Every supported rank's tiles fit an SM twice (the kernel's launch bounds ask for two).
        for r in SWIGLU_LORA_RANKS {
            assert!(2 * swiglu_lora_smem_bytes(r) <= 227 * 1024, "rank {r}");
        }
    }

    #[test]
    fn gemm_fp8_fits_one_block_per_sm() {
        for nc in [1, 2, 3] {
            assert!(gemm_fp8_smem_bytes(nc) <= 227 * 1024, "{nc} consumers");
            // Two blocks would need twice as much: the persistent grid assumes one an SM.
            assert!(2 * gemm_fp8_smem_bytes(nc) > 228 * 1024, "{nc} consumers");
        }
        assert_eq!(gemm_fp8_smem_bytes(2), 1024 + 128 * 256 + 5 * (256 * 128 + 512 + 8 + 16));
        assert_eq!(gemm_fp8_threads(3), 512);
        // 7,816 rows x 18,432 columns: far more tiles than SMs.
        assert_eq!(gemm_fp8_grid(7816, 18432, 3, 1, 1, 132), 132);
        assert_eq!(gemm_fp8_grid(7816, 18432, 3, 2, 1, 66), 132);
        assert_eq!(gemm_fp8_grid(7816, 18432, 3, 2, 1, 60), 120, "only 60 clusters fit at once");
        // 300 rows, 2560 columns: 3 row tiles of 128 make 2 pairs, x 20 column tiles.
        assert_eq!(gemm_fp8_grid(300, 2560, 2, 1, 1, 132), 60);
        assert_eq!(gemm_fp8_grid(300, 2560, 2, 2, 1, 66), 80);
        // The BF16 form's N (a LoRA rank) need not be whole tiles: 977 rows x rank 64.
        assert_eq!(gemm_fp8_grid(977, 64, 3, 1, 1, 132), 6);
        // The split BF16 form: K = 2,560 in 10 slices of 256, K = 9,216 in 36.
        assert_eq!((lora_a_slices(2560), lora_a_slices(9216), lora_a_slices(64)), (10, 36, 1));
        assert_eq!(gemm_fp8_grid(977, 128, 3, 1, lora_a_slices(2560), 132), 60);
        assert_eq!(gemm_fp8_grid(977, 192, 3, 1, lora_a_slices(9216), 132), 132);
        // The whole BF16 form on 64-row tiles (one consumer, eight stages): a packed round's
        // 7,816 rows are 123 units, 41 on 192-row tiles.
        assert_eq!(gemm_fp8_smem_bytes(1), 1024 + 64 * 256 + 8 * (192 * 128 + 256 + 8 + 16));
        assert_eq!(gemm_fp8_threads(1), 256);
        assert_eq!(gemm_fp8_grid(7816, 64, 1, 1, 1, 132), 123);
        assert_eq!(gemm_fp8_grid(7816, 64, 3, 1, 1, 132), 41);
    }

    #[test]
    fn lora_rank_windows_cover_each_tiles_parts() {
        // The 4B in_proj: q, k (2048 each), v, z (4096 each), rank 64 each, one FP8 group.
        let parts = vec![(0..2048, 64), (2048..4096, 64), (4096..8192, 64), (8192..12288, 64)];
        let w = lora_rank_windows(&parts, &(0..12288)).unwrap();
        assert_eq!(w.len(), 2 * 96);
        assert_eq!(&w[..2], &[0, 64]);
        assert_eq!(&w[2 * 16..2 * 16 + 2], &[64, 128]);
        assert_eq!(&w[2 * 95..], &[192, 256]);
        // A tile straddling two parts takes both ranks; a tile with no part takes none.
        let parts = vec![(0..200, 16), (200..256, 32)];
        let w = lora_rank_windows(&parts, &(0..384)).unwrap();
        assert_eq!(w, vec![0, 16, 0, 48, 0, 0]);
        // Groups not starting at 0 (the LoRA's columns are absolute).
        let w = lora_rank_windows(&[(256..384, 16)], &(128..512)).unwrap();
        assert_eq!(w, vec![0, 0, 0, 16, 0, 0]);
        // What the kernel cannot take.
        assert!(lora_rank_windows(&[(0..128, 12)], &(0..128)).is_none());
        assert!(lora_rank_windows(&[(0..128, 16)], &(0..100)).is_none());
        assert!(lora_rank_windows(&[(0..256, 16)], &(0..128)).is_none());
    }

    #[test]
    fn glu_rank_windows_cover_both_halves_of_a_tile() {
        // gate (0..9216, rank 64) and up (9216..18432, rank 64): every GLU tile holds 64 columns of
        // each, so it needs both parts' ranks; the plain tiles need one part's.
        let parts = [(0..9216, 64), (9216..18432, 64)];
        let w = lora_rank_windows_glu(&parts, &(0..18432)).unwrap();
        assert_eq!(w.len(), 2 * 144);
        assert!(w.chunks(2).all(|c| c == [0, 128]));
        let plain = lora_rank_windows(&parts, &(0..18432)).unwrap();
        assert_eq!((&plain[..2], &plain[2 * 72..2 * 73]), (&[0, 64][..], &[64, 128][..]));
        // Only up adapted (rank 16): every GLU tile needs it; with gate's LoRA on its first 64
        // columns alone, only tile 0.
        assert!(lora_rank_windows_glu(&[(9216..18432, 16)], &(0..18432))
            .unwrap()
            .chunks(2)
            .all(|c| c == [0, 16]));
        let w = lora_rank_windows_glu(&[(0..64, 8)], &(0..18432)).unwrap();
        assert_eq!((&w[..2], &w[2..4]), (&[0, 8][..], &[0, 0][..]));
        assert!(lora_rank_windows_glu(&parts, &(0..18432 - 128)).is_none(), "not whole 256-column blocks");
    }

    #[test]
    fn formats_follow_dtype_alignment_and_option() {
        let p = |dtype, out, inp, sc| PartInfo { dtype, out, inp, scales_are_128x128: sc };
        use StoredDtype::*;
        assert_eq!(part_format(&p(F8E4M3, 8192, 2560, true), false, false), PartFormat::Fp8);
        assert_eq!(part_format(&p(F8E4M3, 8192, 2560, false), false, false), PartFormat::Bf16);
        assert_eq!(part_format(&p(F8E4M3, 32, 2560, true), false, false), PartFormat::Bf16);
        assert_eq!(part_format(&p(BF16, 8192, 2560, false), false, false), PartFormat::Bf16);
        assert_eq!(part_format(&p(BF16, 8192, 2560, false), true, false), PartFormat::Fp8);
        assert_eq!(part_format(&p(F32, 32, 2560, false), true, false), PartFormat::Bf16);
        assert_eq!(part_format(&p(BF16, 64, 64, false), true, false), PartFormat::Bf16);
        assert_eq!(part_format(&p(F8E4M3, 8192, 2560, true), false, true), PartFormat::Bf16);
    }

    #[test]
    fn parts_group_by_format_in_order() {
        use PartFormat::*;
        // Qwen3.5-4B in_proj: qkv 8192 (fp8) + z 4096 (fp8) + b 32 + a 32 (bf16).
        let g = group_parts(&[(Fp8, 8192), (Fp8, 4096), (Bf16, 32), (Bf16, 32)]);
        assert_eq!(
            g,
            vec![
                PartGroup { format: Fp8, parts: 0..2, cols: 0..12288 },
                PartGroup { format: Bf16, parts: 2..4, cols: 12288..12352 },
            ]
        );
        let g = group_parts(&[(Bf16, 10), (Fp8, 128), (Bf16, 5)]);
        assert_eq!(g.len(), 3);
        assert_eq!(g[2].cols, 138..143);
        assert!(group_parts(&[]).is_empty());
    }

    #[test]
    fn chunk_table_splits_each_sequence() {
        let t = chunk_table(&[0..130, 130..131, 131..131, 131..195], 64);
        assert_eq!(t.chunks, vec![0, 64, 64, 64, 128, 2, 130, 1, 131, 64]);
        assert_eq!(t.per_segment, vec![(0, 3), (3, 1), (4, 0), (4, 1)]);
        assert_eq!(t.len(), 5);
    }

    #[test]
    fn kv_capacity_grows_geometrically() {
        assert_eq!(kv_capacity(0, 1), 256);
        assert_eq!(kv_capacity(0, 3000), 3072);
        assert_eq!(kv_capacity(3072, 3073), 4608);
        assert_eq!(kv_capacity(256, 10_000), 10_240);
        // Appending one row at a time reallocates O(log n) times.
        let (mut cap, mut reallocs) = (0, 0);
        for len in 1..=100_000 {
            if len > cap {
                cap = kv_capacity(cap, len);
                reallocs += 1;
            }
        }
        assert!(reallocs < 25, "{reallocs} reallocations");
    }

    #[test]
    fn arch_names() {
        assert_eq!(gpu_arch(9, 0), "sm_90a");
        assert_eq!(gpu_arch(8, 9), "sm_89");
        assert_eq!(gpu_arch(12, 0), "sm_120");
    }

    #[test]
    fn attention_instances_and_smem() {
        assert_eq!(attention_head_dim(16), Some(16));
        assert_eq!(attention_head_dim(24), Some(32));
        assert_eq!(attention_head_dim(256), Some(256));
        assert_eq!(attention_head_dim(257), None);
        assert_eq!(attention_smem_bytes(256), 101_376);
        // The 128-row kernel: one block per SM at head dim 256, two at 64.
        assert_eq!(attention_q128_smem_bytes(256), 135_168);
        assert!(attention_q128_smem_bytes(256) + 1024 <= 228 * 1024);
        assert!(2 * (attention_q128_smem_bytes(64) + 1024) <= 228 * 1024);
        assert!(attention_q128_serves(256) && attention_q128_serves(64) && attention_q128_serves(120));
        assert_eq!(attention_wgmma_smem_bytes(256), 197_632);
        assert!(attention_wgmma_smem_bytes(256) + 1024 <= 228 * 1024);
        // Two blocks of the 128-key head-dim-64 kernel per SM (each block also reserves 1 KB).
        assert!(2 * (attention_wgmma_smem_bytes_tiles(64, 128) + 1024) <= 228 * 1024);
        // Three buffers still leave two blocks an SM (1 KB of each block is the system's).
        assert!(2 * (attention_wgmma_smem_bytes_ring(64, 128, 3) + 1024) <= 228 * 1024);
        // And of the tensor-core-sums variant, whose ones are one 16-byte store per thread of 256.
        assert!(2 * (attention_wgmma_tsum_smem_bytes() + 1024) <= 228 * 1024);
        assert_eq!(ATTENTION_TSUM_ONES_BYTES, 256 * 16);
        assert_eq!(attention_ws_smem_bytes(64, 2), 115_808);
        assert_eq!(attention_ws_smem_bytes(256, 2), 197_696);
        assert!(attention_ws_smem_bytes(256, 2) + 1024 <= 228 * 1024);
        // Q 192 x 64, 4 stages of K and V 128 x 64, 16 mbarriers.
        assert_eq!(attention_ws_smem_bytes(64, 3), 1024 + 24_576 + 131_072 + 128);
        assert!(attention_ws_smem_bytes(64, 3) + 1024 <= 228 * 1024);
        assert_eq!(attention_key_ranges(73, 16_457), 5);
        assert_eq!(attention_key_ranges(73, 4096), 1);
        assert_eq!(attention_key_ranges(129, 50_000), 1);
        assert!(
            ATTENTION_KEY_RANGE % attention_q128_key_tile(64) == 0
                && ATTENTION_KEY_RANGE % attention_q128_key_tile(256) == 0
        );
        assert!(!attention_q128_serves(32) && !attention_q128_serves(250) && !attention_q128_serves(16));
        let (prep, scan) = (delta_prep_smem_bytes(128), delta_scan_smem_bytes(128));
        assert!(prep <= 227 * 1024 && scan <= 227 * 1024, "{prep} {scan}");
        // Two scan blocks per SM (228 KiB, 1 KiB reserved per block) for either kernel.
        assert!(2 * (scan + 1024) <= 228 * 1024, "{scan}");
        let tc = delta_tc_smem_bytes(128);
        assert_eq!(tc, 111_360);
        assert!(2 * (tc + 1024) <= 228 * 1024, "{tc}");
        // The pipelined scan: 56,192 f32 at dk 128, within the 227 KiB a block may have (one per SM).
        let tcp = delta_tc_pipelined_smem_bytes(128);
        assert_eq!(tcp, 224_768);
        assert!(tcp <= 227 * 1024 && tcp + 1024 <= 228 * 1024, "{tcp}");
        assert_eq!(delta_split_state_smem_bytes(128), 187_904);
        assert_eq!(delta_wg_smem_bytes(128), 217_664);
        assert_eq!(delta_wg2_smem_bytes(128), 170_560);
        assert!(delta_wg2_smem_bytes(128) + 1024 <= 228 * 1024);
        assert!(delta_wg_smem_bytes(128) + 1024 <= 228 * 1024);
        // The lean scan: two blocks an SM at every key dim (its __launch_bounds__(128, 2)).
        assert_eq!(delta_wgl_smem_bytes(128), 86_592);
        for dk in [32, 64, 128] {
            assert!(2 * (delta_wgl_smem_bytes(dk) + 1024) <= 228 * 1024, "dk {dk}");
        }
        for dk in [16, 32, 64, 128] {
            for b in [
                delta_split_wu_smem_bytes(dk),
                delta_split_state_smem_bytes(dk),
                delta_split_out_smem_bytes(dk),
            ] {
                assert!(b + 1024 <= 228 * 1024, "dk {dk}: {b}");
            }
        }
        assert_eq!(
            delta_tc_pipelined_smem_bytes(16),
            (4 * 64 * 20 + 3 * 64 * 40 + 2 * 64 * 72 + 16 * 40 + 6 * 64) * 4
        );
    }

    #[test]
    fn the_warpgroup_scan_row_order_turns_accumulators_into_a_fragments_in_natural_k_order() {
        // A permutation of each group of 8 rows.
        for a in 0..16 {
            let mut seen: Vec<usize> = (0..8).map(|r| wg_row(8 * a + r)).collect();
            seen.sort();
            assert_eq!(seen, (8 * a..8 * a + 8).collect::<Vec<_>>());
        }
        // Lane (gr, tg) of k step kk: A fragment registers a0..a3 take accumulators 4kk + {0, 2, 1, 3}
        // (wg_a_frag); accumulator 4kk + e sits in column 8kk + 2tg + (e & 1). The A fragment's k
        // index is tg for a0/a1 and tg + 4 for a2/a3: that must be the row the column holds, minus 8kk.
        for kk in 0..8 {
            for tg in 0..4 {
                for (slot, e) in [0usize, 2, 1, 3].into_iter().enumerate() {
                    let k = if slot < 2 { tg } else { tg + 4 };
                    assert_eq!(wg_row(8 * kk + 2 * tg + (e & 1)), 8 * kk + k, "kk {kk} tg {tg} slot {slot}");
                }
            }
        }
    }

    #[test]
    fn alignment_of_addresses() {
        assert_eq!(ptr_alignment(0x7f00_0000_0000), 256);
        assert_eq!(ptr_alignment(0x7f00_0000_0008), 8);
        assert_eq!(ptr_alignment(0x7f00_0000_0082), 2);
    }
}
