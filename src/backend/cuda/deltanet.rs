//! Gated DeltaNet: causal conv + SiLU, β/g gates and L2-normed q/k (`gdn_conv`), the chunked
//! gated delta rule (`gdn_chunk_prep_<dk>`, then a chunk scan walking each sequence's chunks from
//! its state: `gdn_chunk_scan_tc_pipelined_<dk>` for launches with a long sequence,
//! `gdn_chunk_scan_tc_<dk>` otherwise, their one-TF32-MMA twins `gdn_chunk_scan_tf32[_pipelined]_<dk>`
//! with `gdn_tf32`, the wide plain scan `gdn_chunk_scan_{tc,tf32}_wide_<dk>` for short launches
//! whose plain grid would take more than one wave ([`scan_kernel`]), `gdn_chunk_scan_<dk>` with
//! `gdn_ffma`; opt-in, the split path of
//! kernels/deltanet_split.cu ([`GdnScan::Split`]) and the warpgroup scan of
//! kernels/deltanet_wg.cu ([`GdnScan::Warpgroup`])), and the gated
//! output norm. Kernels: kernels/deltanet.cu; CPU twin: src/backend/cpu/deltanet.rs. States are
//! copy-on-write ([`CudaDeltaState`]).

use super::launch::{grid1, launch_config, Arg};
use super::layout;
use super::tensor::CudaTensor;
use super::{CudaBackend, CudaOptions};
use crate::backend::{check_parents, check_tiling, kept_states, DeltaNetDims, DeltaNetInputs, Tree};
use anyhow::{ensure, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::ops::Range;
use std::sync::Arc;

/// Which tensor-core chunk scan runs (with `gdn_ffma` off). The plain, wide and pipelined kernels
/// give the same bits for every sequence (the same products in the same order on the same values;
/// the device suite checks it), so this is a choice of speed only, and choosing by the batch
/// keeps a sequence's result independent of the batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GdnScan {
    /// [`GdnScan::Warpgroup`] where it runs with one TF32 MMA per product (an sm_90 GPU, key dim
    /// 32, 64 or 128, `gdn_tf32` on, not the FMA scan), else [`GdnScan::ByLength`]. Decided by the
    /// GPU, the model and the options only, never by the batch, so a sequence's bits do not depend
    /// on what runs beside it. The warpgroup scan made whole requests 6–7% faster on the H100
    /// (bench/NOTES.md, session of 2026-12-05, fourteenth).
    #[default]
    Auto,
    /// By the launch: `gdn_chunk_scan_{tc,tf32}_pipelined_<dk>` when its longest sequence has at
    /// least [`PIPELINED_MIN_CHUNKS`] chunks or its grid runs in one wave (a lone sequence);
    /// otherwise the plain scan `gdn_chunk_scan_{tc,tf32}_<dk>` when its grid runs in one wave, the
    /// wide one `gdn_chunk_scan_{tc,tf32}_wide_<dk>` when it would take more (see [`scan_kernel`]).
    /// The default off Hopper (the default before 2026-12-05 everywhere).
    ByLength,
    /// [`GdnScan::ByLength`] without the wide scan (the default before 2026-12-04), to compare.
    PlainByLength,
    /// Always `gdn_chunk_scan_tc_pipelined_<dk>`.
    Pipelined,
    /// Always `gdn_chunk_scan_tc_<dk>`.
    Plain,
    /// The delta rule split as flash-linear-attention does it (`gdn_split_{wu,state,out}_<dk>`,
    /// kernels/deltanet_split.cu): W and U for all chunks in parallel, then only the state
    /// recurrence in order, then the outputs of all chunks in parallel. Not the tc scans' bits
    /// (the same mathematics summed in another order), so it is chosen for every launch, never
    /// per launch. Value dims over 128 fall back to [`GdnScan::PlainByLength`]. Opt-in while measured.
    Split,
    /// Always `gdn_chunk_scan_{tc,tf32}_wide_<dk>`: the plain scan with one block per (sequence,
    /// value head) over all value columns instead of four blocks of 32 (q, k, T and P staged once
    /// per head, a quarter of the blocks). The plain scan's bits. Value dims over 128 run the plain
    /// scan.
    Wide,
    /// `gdn_chunk_scan_wg_<dk>` / `gdn_chunk_scan_wg1_<dk>` (kernels/deltanet_wg.cu, Hopper; the
    /// same bits, chosen per launch by [`warpgroup_kernel`]): one warpgroup per (sequence, value
    /// head, 64 value columns) holding the state as a wgmma accumulator, after
    /// `gdn_chunk_prep_rm_<dk>`. TF32 products like the default scans, but summed by the tensor
    /// cores in another order, so not their bits: chosen for every launch, never mixed with them. Key
    /// dims other than 32, 64 and 128, the FMA scan and other GPUs fall back to
    /// [`GdnScan::PlainByLength`]. Runs also with `gdn_tf32` off (its products stay TF32).
    Warpgroup,
}

impl GdnScan {
    pub fn describe(self) -> &'static str {
        match self {
            GdnScan::Auto => "the warpgroup scan on Hopper, else by length",
            GdnScan::ByLength => {
                "tensor cores, pipelined for long or lone sequences, one block per head for many short ones"
            }
            GdnScan::PlainByLength => "tensor cores, pipelined for long sequences",
            GdnScan::Pipelined => "tensor cores, pipelined",
            GdnScan::Plain => "tensor cores, not pipelined",
            GdnScan::Split => "split: W/U and outputs in parallel, only the state in order",
            GdnScan::Wide => "tensor cores, one block per head over all value columns",
            GdnScan::Warpgroup => "warpgroup MMAs, the state held in registers",
        }
    }
}

/// Chunks (of 64 rows) of a launch's longest sequence from which [`GdnScan::ByLength`] picks the
/// pipelined scan whatever the grid (below it, only when its grid fits one wave). That kernel
/// holds one block per SM (224 KB of shared memory at dk 128) where the plain one holds two, and
/// what it gains is chunk c+1's loads hidden behind chunk c's arithmetic, which a sequence's first
/// chunk cannot have. A launch takes about as long as its longest sequence's chain of chunks once
/// its blocks fit the GPU, so the pipelined scan pays when that chain is long: from 8 chunks (512
/// tokens) the latency hidden in 7 or more chunks outweighs the halved occupancy, while a
/// request's passes (a few chunks each, ~1,400 plain blocks for 11 passes at dk 128) run more
/// blocks at once on the plain or wide scan. `bench_gpu_ops --long` times both scans at 2K, 4K and
/// 16K tokens and on 11 forks × 73 tokens to check this threshold.
pub const PIPELINED_MIN_CHUNKS: usize = 8;

/// One chunk-scan launch: the kernel, its dynamic shared memory, its block size and how many
/// blocks of value columns each (sequence, value head) gets (the grid's z).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanKernel {
    pub name: String,
    pub smem: usize,
    pub threads: u32,
    pub column_blocks: u32,
}

/// The chunk-scan kernel of one launch, for key dim `dk`, value dim `dv` and the chunk count of
/// the launch's longest sequence. `one_wave(kernel)` says whether `kernel`'s grid for this launch
/// (`kernel.column_blocks` blocks per sequence and value head) runs in one wave of the GPU.
///
/// Why [`GdnScan::ByLength`] asks: a short launch's time is its waves times a wave's time (a
/// block walks its sequence's few chunks at a fixed latency per chunk). The pipelined scan is the
/// fastest block (chunk c+1's loads behind chunk c's arithmetic: 1×447 tokens 0.140 ms a layer
/// against the plain scan's 0.169 on the H200) but holds one block per SM, the plain scan two,
/// and the wide scan does a head's 128 value columns in one 16-warp block at ~1.4–1.6× the plain
/// block's time (1×447: 0.229 ms; 1×2,048: 0.83 vs 0.53) with a quarter of the blocks. So: the
/// pipelined scan for long sequences or when its grid fits one wave (a lone prefix, 128 blocks),
/// else the plain scan when its grid fits one wave, else the wide scan, whose fewer waves win
/// (11 passes of 73 tokens: 1.15×; a packed round of 96 sequences: 29.3 → 21.1 ms, NOTES).
pub fn scan_kernel(
    options: &CudaOptions,
    dk: usize,
    dv: usize,
    longest_chunks: usize,
    mut one_wave: impl FnMut(&ScanKernel) -> bool,
) -> ScanKernel {
    let narrow =
        |name: String, smem| ScanKernel { name, smem, threads: 256, column_blocks: dv.div_ceil(32) as u32 };
    if options.gdn_ffma {
        return narrow(format!("gdn_chunk_scan_{dk}"), layout::delta_scan_smem_bytes(dk));
    }
    // The TF32 kernels are the same code with one MMA per product: same layouts, same memory.
    let products = if options.gdn_tf32 { "tf32" } else { "tc" };
    let short = longest_chunks < PIPELINED_MIN_CHUNKS;
    let pipelined = narrow(
        format!("gdn_chunk_scan_{products}_pipelined_{dk}"),
        layout::delta_tc_pipelined_smem_bytes(dk),
    );
    let use_pipelined = match options.gdn_scan {
        GdnScan::Pipelined => true,
        GdnScan::Plain | GdnScan::Wide => false,
        GdnScan::PlainByLength | GdnScan::Split | GdnScan::Warpgroup => !short,
        GdnScan::ByLength | GdnScan::Auto => !short || one_wave(&pipelined),
    };
    if use_pipelined {
        return pipelined;
    }
    let plain = narrow(format!("gdn_chunk_scan_{products}_{dk}"), layout::delta_tc_smem_bytes(dk));
    let wide = dv <= 128
        && match options.gdn_scan {
            GdnScan::Wide => true,
            GdnScan::ByLength | GdnScan::Auto => !one_wave(&plain),
            _ => false,
        };
    if wide {
        ScanKernel {
            name: format!("gdn_chunk_scan_{products}_wide_{dk}"),
            smem: layout::delta_tc_wide_smem_bytes(dk),
            threads: 512,
            column_blocks: 1,
        }
    } else {
        plain
    }
}

impl CudaBackend {
    /// [`scan_kernel`] for a launch of `sequences` sequences of `dims` on this GPU: a kernel's grid
    /// fits one wave when its `sequences × value_heads × column_blocks` blocks are resident at once.
    pub fn chunk_scan_kernel(
        &self,
        dims: &DeltaNetDims,
        longest_chunks: usize,
        sequences: usize,
    ) -> Result<ScanKernel> {
        let mut asked = Ok(());
        let kernel = scan_kernel(&self.state.options, dims.key_dim, dims.value_dim, longest_chunks, |k| {
            let blocks = sequences * dims.value_heads * k.column_blocks as usize;
            match self.resident_blocks(&k.name, k.threads, k.smem) {
                Ok(resident) => blocks <= resident,
                Err(e) => {
                    asked = Err(e);
                    true
                }
            }
        });
        asked.map(|()| kernel)
    }
}

/// The three kernels of the split delta rule (`GdnScan::Split`) with their dynamic shared
/// memory, or `None` where that path does not run (another scan chosen, the FMA scan, value dims
/// over 128).
pub fn split_kernels(options: &CudaOptions, dk: usize, dv: usize) -> Option<[(String, usize); 3]> {
    if options.gdn_ffma || options.gdn_scan != GdnScan::Split || dv > 128 {
        return None;
    }
    let p = if options.gdn_tf32 { "_tf32" } else { "" };
    Some([
        (format!("gdn_split_wu{p}_{dk}"), layout::delta_split_wu_smem_bytes(dk)),
        (format!("gdn_split_state{p}_{dk}"), layout::delta_split_state_smem_bytes(dk)),
        (format!("gdn_split_out{p}_{dk}"), layout::delta_split_out_smem_bytes(dk)),
    ])
}

/// The warpgroup scan (`GdnScan::Warpgroup`) with its dynamic shared memory, or `None` where it does
/// not run: another scan chosen, the FMA scan, a GPU other than sm_90 (`hopper`), key dims other
/// than 32, 64 and 128 (its operand rows are whole 128-byte swizzle blocks).
///
/// Of its two kernels (the same bits), `gdn_chunk_scan_wg_<dk>` (a producer warpgroup copies ahead
/// of the consumer warpgroup) for launches whose longest sequence has at least
/// [`PIPELINED_MIN_CHUNKS`] chunks, `gdn_chunk_scan_wg1_<dk>` (one warpgroup copying between its
/// products) below, unless `gdn_wg_producer` forces one: with two chunks a sequence there is nothing
/// for a producer to run ahead of (11 passes of 73 tokens: mixer 0.229 ms with one warpgroup, 0.272
/// with the producer on the H100, NOTES). With `gdn_wg_pair` (and more than 64 value columns) the
/// short launches run `gdn_chunk_scan_wg2_<dk>` instead: two such warpgroups a block sharing the
/// copies of one (sequence, head), half the blocks (the same bits); else with `gdn_wg_lean`
/// `gdn_chunk_scan_wgl_<dk>`: one warpgroup in a third of the shared memory, two blocks an SM (the
/// same bits).
pub fn warpgroup_kernel(
    options: &CudaOptions,
    dk: usize,
    dv: usize,
    longest_chunks: usize,
    hopper: bool,
) -> Option<ScanKernel> {
    if !warpgroup_scan_runs(options, dk, hopper) {
        return None;
    }
    let producer = options.gdn_wg_producer.unwrap_or(longest_chunks >= PIPELINED_MIN_CHUNKS);
    if !producer && options.gdn_wg_pair && dv > 64 {
        return Some(ScanKernel {
            name: format!("gdn_chunk_scan_wg2_{dk}"),
            smem: layout::delta_wg2_smem_bytes(dk),
            threads: 256,
            column_blocks: dv.div_ceil(128) as u32,
        });
    }
    let (kind, threads, smem) = if producer {
        ("wg", WARPGROUP_SCAN_THREADS, layout::delta_wg_smem_bytes(dk))
    } else if options.gdn_wg_lean {
        ("wgl", 128, layout::delta_wgl_smem_bytes(dk))
    } else {
        ("wg1", 128, layout::delta_wg_smem_bytes(dk))
    };
    Some(ScanKernel {
        name: format!("gdn_chunk_scan_{kind}_{dk}"),
        smem,
        threads,
        column_blocks: dv.div_ceil(64) as u32,
    })
}

/// Whether [`warpgroup_kernel`] gives a kernel (whatever the launch): the warpgroup scan chosen
/// ([`GdnScan::Warpgroup`], or [`GdnScan::Auto`] with one TF32 MMA per product), not the FMA scan,
/// an sm_90 GPU, key dim 32, 64 or 128.
pub fn warpgroup_scan_runs(options: &CudaOptions, dk: usize, hopper: bool) -> bool {
    let chosen = match options.gdn_scan {
        GdnScan::Warpgroup => true,
        GdnScan::Auto => options.gdn_tf32,
        _ => false,
    };
    chosen && !options.gdn_ffma && hopper && [32, 64, 128].contains(&dk)
}

/// Threads of a `gdn_chunk_scan_wg_<dk>` block: the producer warpgroup and the consumer warpgroup
/// (its `__launch_bounds__`; with fewer, no consumer runs and the producer waits forever).
/// `gdn_chunk_scan_wg1_<dk>` is one warpgroup, 128.
pub const WARPGROUP_SCAN_THREADS: u32 = 256;

/// Conv history `[kernel−1, channels]` and recurrent state `[value_heads, key_dim, value_dim]` of
/// one DeltaNet layer of one sequence, f32, copy-on-write: `clone()` (a fork) shares the buffers,
/// and the next `gated_delta_net` on a state whose buffers are shared reads them and writes its
/// result to fresh buffers (one allocation for all such states of a call) instead of copying
/// first. A state that owns its buffers alone is updated in place.
#[derive(Clone)]
pub struct CudaDeltaState {
    cur: Arc<DeltaBufs>,
}

/// Where a state's two arrays live: offsets (in f32 elements) into a device allocation that may
/// hold other states' arrays too.
struct DeltaBufs {
    buf: Arc<CudaSlice<f32>>,
    conv: usize,
    recurrent: usize,
    conv_len: usize,
    recurrent_len: usize,
}

impl DeltaBufs {
    fn ptrs(&self, stream: &CudaStream) -> (u64, u64) {
        let base = self.buf.device_ptr(stream).0;
        (base + 4 * self.conv as u64, base + 4 * self.recurrent as u64)
    }
    fn read(&self, off: usize, len: usize) -> Result<Vec<f32>> {
        let stream = self.buf.stream();
        Ok(stream.clone_dtoh(&self.buf.slice(off..off + len))?)
    }
}

impl CudaDeltaState {
    /// The recurrent state `[value_heads, key_dim, value_dim]` (for tests).
    pub fn recurrent(&self) -> Result<Vec<f32>> {
        self.cur.read(self.cur.recurrent, self.cur.recurrent_len)
    }
    /// The conv history `[kernel−1, channels]` (for tests).
    pub fn conv_history(&self) -> Result<Vec<f32>> {
        self.cur.read(self.cur.conv, self.cur.conv_len)
    }
}

/// `Backend::new_delta_state`: zero conv history and recurrent state in one allocation.
pub(super) fn new_delta_state(be: &CudaBackend, dims: &DeltaNetDims) -> Result<CudaDeltaState> {
    let conv_len = dims.conv_kernel.saturating_sub(1) * dims.conv_channels();
    let recurrent_len = dims.value_heads * dims.key_dim * dims.value_dim;
    Ok(CudaDeltaState {
        cur: Arc::new(DeltaBufs {
            buf: Arc::new(be.zeros_f32(conv_len + recurrent_len)?),
            conv: 0,
            recurrent: conv_len,
            conv_len,
            recurrent_len,
        }),
    })
}

/// `Backend::gated_delta_net`: the states are planned (copy-on-write buffers, the order of the
/// per-sequence tables), then three stages run: the conv with the gates, the chunked delta rule,
/// the gated output norm.
pub(super) fn gated_delta_net(
    be: &CudaBackend,
    x: &DeltaNetInputs<CudaTensor>,
    dims: &DeltaNetDims,
    segments: &[Range<usize>],
    parents: &[Option<usize>],
    states: &mut [&mut CudaDeltaState],
    keep: &[bool],
) -> Result<CudaTensor> {
    check_inputs(x, dims, segments, states.len())?;
    let tree = check_parents(parents, segments.len())?;
    let keep = kept_states(keep, &tree)?;
    let n = x.proj.rows_cols().0;
    let (vh, dv) = (dims.value_heads, dims.value_dim);
    if n == 0 {
        return Ok(be.bf16_tensor(be.alloc_bf16(0)?, &[0, vh * dv]));
    }
    let proj = be.bf16_of(x.proj)?;
    let blocks = ProjectionBlocks::new(be.p(proj.s()), dims);
    let plan = plan_states(be, dims, segments, &tree, &keep, states)?;
    let mixed = conv(be, x, dims, &blocks, &plan, n)?;
    let core = delta_rule(be, dims, &mixed, &plan, n)?;
    let normw = be.f32_of(x.norm_weight)?;
    let y = be.gated_norm(&core, blocks.z, blocks.ld, vh, normw.s(), n, dv, dims.norm_eps);
    // The arrays the plan replaced were read by the launches above; they may be freed now.
    drop(plan.replaced);
    y
}

fn check_inputs(
    x: &DeltaNetInputs<CudaTensor>,
    dims: &DeltaNetDims,
    segments: &[Range<usize>],
    states: usize,
) -> Result<()> {
    let DeltaNetDims { key_heads: kh, value_heads: vh, key_dim: dk, value_dim: dv, conv_kernel: kw, .. } =
        *dims;
    ensure!(segments.len() == states, "one state per segment");
    let (n, pw) = x.proj.rows_cols();
    ensure!(pw == dims.proj_width(), "DeltaNet input width {pw} != {}", dims.proj_width());
    ensure!(x.conv_weight.numel() == dims.conv_channels() * kw && kw >= 1, "conv weight shape");
    ensure!(kh > 0 && vh % kh == 0, "{vh} value heads do not group over {kh} key heads");
    ensure!(
        [16, 32, 64, 128].contains(&dk) && dv % 4 == 0,
        "DeltaNet key_dim {dk} / value_dim {dv}: the CUDA kernels support key_dim 16, 32, 64 or 128 and value_dim a multiple of 4"
    );
    ensure!(
        x.a_log.numel() == vh && x.dt_bias.numel() == vh && x.norm_weight.numel() == dv,
        "A_log/dt_bias/norm shapes"
    );
    check_tiling(segments, n)
}

/// The blocks of the fused input projection `[q | k | v | z | b | a]`, read in place: device
/// addresses of each block's first column (bf16: 2 bytes per element), row stride `ld`.
struct ProjectionBlocks {
    qkv: u64,
    z: u64,
    b: u64,
    a: u64,
    ld: i64,
}

impl ProjectionBlocks {
    fn new(base: u64, dims: &DeltaNetDims) -> Self {
        let z = base + 2 * dims.conv_channels() as u64;
        let b = z + 2 * (dims.value_heads * dims.value_dim) as u64;
        let a = b + 2 * dims.value_heads as u64;
        ProjectionBlocks { qkv: base, z, b, a, ld: dims.proj_width() as i64 }
    }
}

/// Where every sequence reads and writes its state, and in which order the per-sequence launches
/// take them: the device tables of the conv (`[row_start, len, hist_in, hist_out]` per sequence)
/// and of the scan (`[first_chunk, n_chunks, state_in, state_out]`), in launch order (parents,
/// then the other independent sequences, then the children), and the chunk table.
struct StatePlan {
    /// The conv table in launch order (`sequences` entries), then the same entries of the
    /// sequences that have rows again in row order (`conv_by_row` of them: what `gdn_conv`
    /// binary-searches for a row's sequence), in one upload.
    conv_meta: CudaSlice<i64>,
    conv_by_row: usize,
    /// Per entry of the conv table in launch order: whether its history is written (`hist_out`
    /// not 0). A history launch whose entries all write nowhere is skipped.
    conv_kept: Vec<bool>,
    scan_meta: CudaSlice<i64>,
    /// Chunks of each sequence, in launch order (the scan kernel is chosen per launch by them).
    scan_chunks: Vec<usize>,
    chunks: CudaSlice<i32>,
    chunk_count: usize,
    sequences: usize,
    /// Table entries `0..parents`: the parents; `0..roots`: every sequence without a parent.
    parents: usize,
    roots: usize,
    /// Arrays replaced by copy-on-write, still read by this call's kernels: they must outlive
    /// the launches (dropping the last reference frees the memory in stream order).
    replaced: Vec<Arc<DeltaBufs>>,
}

impl StatePlan {
    /// Entries `range` of a table in launch order: a pointer to the first and the count.
    fn entries(&self, be: &CudaBackend, meta: &CudaSlice<i64>, range: Range<usize>) -> (u64, usize) {
        (be.p(meta) + 32 * range.start as u64, range.len())
    }
}

/// The conv table entries (`[row_start, len, hist_in, hist_out]`) of the sequences that have rows,
/// ordered by their first row: the table `gdn_conv` binary-searches (their row ranges are disjoint).
fn conv_rows_in_order(entries: impl Iterator<Item = [i64; 4]>) -> Vec<[i64; 4]> {
    let mut rows: Vec<[i64; 4]> = entries.filter(|e| e[1] > 0).collect();
    rows.sort_by_key(|e| e[0]);
    rows
}

/// Copy-on-write: states sharing their buffers (forks) get fresh ones, all from one allocation;
/// the kernels read the old arrays and write the new. Parents and the children that fork them
/// always get fresh ones (a parent's arrays before and after its rows are both read during the
/// call). A child starts from its parent's state as it stands after the parent's rows.
///
/// A state not kept (`keep`, see [`kept_states`]) gets no fresh buffers and its table entries
/// write nowhere (`hist_out` and `state_out` 0: the kernels skip the history, the state update
/// after the last chunk and the state's store); it is left pointing at what it read.
fn plan_states(
    be: &CudaBackend,
    dims: &DeltaNetDims,
    segments: &[Range<usize>],
    tree: &Tree,
    keep: &[bool],
    states: &mut [&mut CudaDeltaState],
) -> Result<StatePlan> {
    let Tree { parent, is_parent } = tree;
    let table = layout::chunk_table(segments, layout::DELTA_CHUNK);
    let conv_len = dims.conv_kernel.saturating_sub(1) * dims.conv_channels();
    let rec_len = dims.value_heads * dims.key_dim * dims.value_dim;
    let needs_fresh: Vec<bool> = (0..segments.len())
        .map(|si| {
            keep[si] && (is_parent[si] || parent[si].is_some() || Arc::get_mut(&mut states[si].cur).is_none())
        })
        .collect();
    let shared = needs_fresh.iter().filter(|&&f| f).count();
    let fresh = if shared == 0 { None } else { Some(Arc::new(be.alloc_f32(shared * (conv_len + rec_len))?)) };
    let stream = &be.state.stream;
    // The conv history of the parents is written before the conv (their children read it),
    // everyone else's after it (an in-place history is read by the conv); the scan of the
    // children runs after everyone else's (they start from their parents' states).
    let rank = |si: usize| {
        if is_parent[si] {
            0
        } else if parent[si].is_none() {
            1
        } else {
            2
        }
    };
    let mut order: Vec<usize> = (0..segments.len()).collect();
    order.sort_by_key(|&si| rank(si));
    let mut entries = Vec::with_capacity(segments.len());
    let mut replaced: Vec<Arc<DeltaBufs>> = Vec::new();
    let mut slot = 0;
    for si in 0..segments.len() {
        if let Some(p) = parent[si] {
            // The parent comes first, so its state already points at its output arrays.
            let fork = states[p].clone();
            replaced.push(std::mem::replace(&mut *states[si], fork).cur);
        }
        let st = &mut *states[si];
        ensure!(
            st.cur.conv_len == conv_len && st.cur.recurrent_len == rec_len,
            "DeltaNet state of another shape"
        );
        let (conv_in, rec_in) = st.cur.ptrs(stream);
        if needs_fresh[si] {
            let off = slot * (conv_len + rec_len);
            slot += 1;
            let new = Arc::new(DeltaBufs {
                buf: fresh.clone().expect("allocated above"),
                conv: off,
                recurrent: off + conv_len,
                conv_len,
                recurrent_len: rec_len,
            });
            replaced.push(std::mem::replace(&mut st.cur, new));
        }
        let (conv_out, rec_out) = if keep[si] { st.cur.ptrs(stream) } else { (0, 0) };
        let (seg, (first, count)) = (&segments[si], table.per_segment[si]);
        entries.push((
            [seg.start as i64, seg.len() as i64, conv_in as i64, conv_out as i64],
            [first as i64, count as i64, rec_in as i64, rec_out as i64],
        ));
    }
    let by_row = conv_rows_in_order(entries.iter().map(|e| e.0));
    let conv_by_row = by_row.len();
    let conv_meta: Vec<i64> = order.iter().map(|&si| entries[si].0).chain(by_row).flatten().collect();
    let scan_meta: Vec<i64> = order.iter().flat_map(|&si| entries[si].1).collect();
    Ok(StatePlan {
        conv_meta: be.htod(&conv_meta)?,
        conv_by_row,
        conv_kept: order.iter().map(|&si| entries[si].0[3] != 0).collect(),
        scan_meta: be.htod(&scan_meta)?,
        scan_chunks: order.iter().map(|&si| table.per_segment[si].1).collect(),
        chunks: be.htod(&table.chunks)?,
        chunk_count: table.len(),
        sequences: segments.len(),
        parents: is_parent.iter().filter(|&&p| p).count(),
        roots: order.iter().filter(|&&si| rank(si) < 2).count(),
        replaced,
    })
}

/// What the conv stage hands the delta rule, f32: L2-normed q and k per key head `[n, kh·dk]`,
/// v `[n, vh·dv]`, and β and the log-decay g per value head `[n, vh]`.
struct ConvOutputs {
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    g: CudaSlice<f32>,
}

/// How `gdn_conv` walks its rows ([`super::CudaOptions::gdn_conv`]): a thread computes `group`
/// rows (8: `gdn_conv_8`, two blocks an SM; 4: `gdn_conv_4`, three) from one window of loads while
/// the next group's loads are in flight, `groups` groups a block. Every tiling gives the same bits.
/// Built by [`ConvTiling::new`] (or parsed), so the launch's rows per block always match the
/// kernel's group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvTiling {
    group: usize,
    groups: usize,
}

impl ConvTiling {
    /// The most groups a block takes.
    pub const MAX_GROUPS: usize = 64;

    /// `group` rows (8 or 4) from one window, `groups` (1 to [`ConvTiling::MAX_GROUPS`]) a block.
    pub fn new(group: usize, groups: usize) -> Result<Self, String> {
        if group != 8 && group != 4 {
            return Err(format!("rows {group}: expected 8 or 4"));
        }
        if !(1..=Self::MAX_GROUPS).contains(&groups) {
            return Err(format!("groups {groups}: expected 1 to {}", Self::MAX_GROUPS));
        }
        Ok(Self { group, groups })
    }

    /// The tiling for `n` rows, from `gpu-ops --only conv` on an H100 (bench/NOTES.md, twenty-fifth
    /// session): groups of 4 rows (`gdn_conv_4`: 80 registers, three blocks an SM) beat groups
    /// of 8 (123 registers, two) at every length; two groups a block while a grid of such blocks
    /// is a few waves, four up to 8,192 rows, sixteen beyond, so that each thread keeps its next
    /// group's loads in flight while it computes.
    pub fn for_rows(n: usize) -> Self {
        let groups = match n {
            0..1536 => 2,
            1536..8192 => 4,
            _ => 16,
        };
        Self { group: 4, groups }
    }

    fn kernel(self) -> &'static str {
        if self.group == 8 {
            "gdn_conv_8"
        } else {
            "gdn_conv_4"
        }
    }

    fn rows_per_block(self) -> usize {
        self.group * self.groups
    }
}

impl std::str::FromStr for ConvTiling {
    type Err = String;
    /// `<rows>x<groups>`, rows 8 or 4, groups 1 to [`ConvTiling::MAX_GROUPS`].
    fn from_str(s: &str) -> Result<Self, String> {
        let (g, n) =
            s.split_once('x').ok_or_else(|| format!("expected <rows>x<groups>, e.g. 8x4, not {s:?}"))?;
        let group: usize = g.parse().map_err(|_| format!("rows {g:?}: expected 8 or 4"))?;
        let groups: usize = n.parse().map_err(|_| format!("groups {n:?}: expected a number"))?;
        Self::new(group, groups)
    }
}

/// `gdn_conv` (causal conv + SiLU from each sequence's history, the gates, the L2 norms) with the
/// history updates around it (`gdn_conv_hist`: the parents' before, everyone else's after).
fn conv(
    be: &CudaBackend,
    x: &DeltaNetInputs<CudaTensor>,
    dims: &DeltaNetDims,
    blocks: &ProjectionBlocks,
    plan: &StatePlan,
    n: usize,
) -> Result<ConvOutputs> {
    let DeltaNetDims { key_heads: kh, value_heads: vh, key_dim: dk, value_dim: dv, conv_kernel: kw, .. } =
        *dims;
    let c = dims.conv_channels();
    let convw = be.bf16_of(x.conv_weight)?;
    let (alog, dtb) = (be.f32_of(x.a_log)?, be.f32_of(x.dt_bias)?);
    let out = ConvOutputs {
        q: be.alloc_f32(n * kh * dk)?,
        k: be.alloc_f32(n * kh * dk)?,
        v: be.alloc_f32(n * vh * dv)?,
        beta: be.alloc_f32(n * vh)?,
        g: be.alloc_f32(n * vh)?,
    };
    // gdn_conv: a thread owns 4 channels (C % 4 == 0 as dk % 16 == 0 and dv % 4 == 0) and a
    // block's rows (groups of the tiling's group); it stores 4 f32 at once (16-byte aligned: fresh
    // buffers, offsets in multiples of 4 elements), and loads 4 bf16 at once when the projection
    // allows it.
    let tiling = be.state.options.gdn_conv.unwrap_or_else(|| ConvTiling::for_rows(n));
    for o in [&out.q, &out.k, &out.v] {
        ensure!(be.p(o) % 16 == 0, "gdn_conv output buffers must be 16-byte aligned");
    }
    let vec = blocks.ld % 4 == 0 && blocks.qkv % 8 == 0;
    let groups = c / 4;
    let threads = groups.next_multiple_of(32).min(256);
    let history = |range: Range<usize>| -> Result<()> {
        if !plan.conv_kept[range.clone()].iter().any(|&k| k) {
            return Ok(());
        }
        let (meta, count) = plan.entries(be, &plan.conv_meta, range);
        be.launch(
            "gdn_conv_hist",
            launch_config((grid1(c, 256), count as u32, 1), 256, 0),
            &[
                Arg::Ptr(blocks.qkv),
                Arg::I64(blocks.ld),
                Arg::Ptr(meta),
                Arg::I32(c as i32),
                Arg::I32(kw as i32),
            ],
        )
    };
    history(0..plan.parents)?;
    be.launch(
        tiling.kernel(),
        launch_config(
            (n.div_ceil(tiling.rows_per_block()) as u32, groups.div_ceil(threads) as u32, 1),
            threads as u32,
            0,
        ),
        &[
            Arg::Ptr(blocks.qkv),
            Arg::I64(blocks.ld),
            Arg::I32(vec as i32),
            Arg::Ptr(be.p(convw.s())),
            Arg::I32(kw as i32),
            Arg::Ptr(be.p(&plan.conv_meta) + 32 * plan.sequences as u64),
            Arg::I32(plan.conv_by_row as i32),
            Arg::I64(n as i64),
            Arg::I32(tiling.groups as i32),
            Arg::Ptr(blocks.b),
            Arg::Ptr(blocks.a),
            Arg::Ptr(be.p(alog.s())),
            Arg::Ptr(be.p(dtb.s())),
            Arg::Ptr(be.p(&out.q)),
            Arg::Ptr(be.p(&out.k)),
            Arg::Ptr(be.p(&out.v)),
            Arg::Ptr(be.p(&out.beta)),
            Arg::Ptr(be.p(&out.g)),
            Arg::I32(kh as i32),
            Arg::I32(vh as i32),
            Arg::I32(dk as i32),
            Arg::I32(dv as i32),
        ],
    )?;
    history(plan.parents..plan.sequences)?;
    Ok(out)
}

/// The chunked gated delta rule: `gdn_chunk_prep_<dk>` (per chunk and key head, the chunk's
/// triangular systems), then a chunk scan ([`scan_kernel`], chosen per launch) walking each
/// sequence's chunks from its state, the roots first and then the children from their parents'
/// new states. With [`GdnScan::Warpgroup`] (where [`warpgroup_scan_runs`]) the prep is
/// `gdn_chunk_prep_rm_<dk>` and every launch runs one of the warpgroup scan's two kernels
/// ([`warpgroup_kernel`]). Returns the f32 output `[n·vh, dv]`.
fn delta_rule(
    be: &CudaBackend,
    dims: &DeltaNetDims,
    x: &ConvOutputs,
    plan: &StatePlan,
    n: usize,
) -> Result<CudaSlice<f32>> {
    let DeltaNetDims { key_heads: kh, value_heads: vh, key_dim: dk, value_dim: dv, .. } = *dims;
    let core = be.alloc_f32(n * vh * dv)?;
    if plan.chunk_count == 0 {
        return Ok(core);
    }
    let chunk = layout::DELTA_CHUNK;
    let tp = be.alloc_f32(plan.chunk_count * vh * 2 * chunk * chunk)?;
    let hopper = be.state.info.hopper();
    // Whether the warpgroup scan runs (its kernel is chosen per launch below).
    let warpgroup = warpgroup_scan_runs(&be.state.options, dk, hopper);
    // The warpgroup scan reads T and P row-major and each chunk's K^T, which its prep writes.
    let kt = if warpgroup { Some(be.alloc_f32(plan.chunk_count * kh * dk * chunk)?) } else { None };
    be.launch(
        &format!("gdn_chunk_prep_{}{dk}", if kt.is_some() { "rm_" } else { "" }),
        launch_config((plan.chunk_count as u32, kh as u32, 1), 256, layout::delta_prep_smem_bytes(dk)),
        &[
            Arg::Ptr(be.p(&x.q)),
            Arg::Ptr(be.p(&x.k)),
            Arg::Ptr(be.p(&x.beta)),
            Arg::Ptr(be.p(&x.g)),
            Arg::Ptr(be.p(&plan.chunks)),
            Arg::I32(kh as i32),
            Arg::I32(vh as i32),
            Arg::Ptr(be.p(&tp)),
            Arg::Ptr(kt.as_ref().map_or(0, |kt| be.p(kt))),
        ],
    )?;
    // (The split path and the warpgroup scan are two values of `gdn_scan`: never both.)
    if let Some(kernels) = split_kernels(&be.state.options, dk, dv) {
        delta_rule_split(be, dims, x, plan, &tp, &kernels, &core)?;
        return Ok(core);
    }
    for range in [0..plan.roots, plan.roots..plan.sequences] {
        let longest = plan.scan_chunks[range.clone()].iter().copied().max().unwrap_or(0);
        let (meta, count) = plan.entries(be, &plan.scan_meta, range);
        if count == 0 {
            continue;
        }
        let scan = match warpgroup_kernel(&be.state.options, dk, dv, longest, hopper) {
            Some(wg) => wg,
            None => be.chunk_scan_kernel(dims, longest, count)?,
        };
        // The warpgroup scan also reads the chunks' K^T, after T and P.
        let mut args = vec![
            Arg::Ptr(be.p(&x.q)),
            Arg::Ptr(be.p(&x.k)),
            Arg::Ptr(be.p(&x.v)),
            Arg::Ptr(be.p(&x.beta)),
            Arg::Ptr(be.p(&x.g)),
            Arg::Ptr(be.p(&tp)),
        ];
        args.extend(kt.as_ref().map(|kt| Arg::Ptr(be.p(kt))));
        args.extend([
            Arg::Ptr(be.p(&plan.chunks)),
            Arg::Ptr(meta),
            Arg::I32(kh as i32),
            Arg::I32(vh as i32),
            Arg::I32(dv as i32),
            Arg::Ptr(be.p(&core)),
        ]);
        be.launch(
            &scan.name,
            launch_config((count as u32, vh as u32, scan.column_blocks), scan.threads, scan.smem),
            &args,
        )?;
    }
    Ok(core)
}

/// [`GdnScan::Split`]: W and U of every (chunk, value head), then the state recurrence per
/// sequence (the roots, then the children from their parents' new states) saving each chunk's
/// starting state and Vn, then the outputs of every chunk. Scratch: W, U, Vn and the chunks'
/// starting states, f32 (at 16K tokens of Qwen3.5-4B ~1.3 GB, freed in stream order on return).
fn delta_rule_split(
    be: &CudaBackend,
    dims: &DeltaNetDims,
    x: &ConvOutputs,
    plan: &StatePlan,
    tp: &CudaSlice<f32>,
    kernels: &[(String, usize); 3],
    core: &CudaSlice<f32>,
) -> Result<()> {
    let DeltaNetDims { key_heads: kh, value_heads: vh, key_dim: dk, value_dim: dv, .. } = *dims;
    let (chunks, rows) = (plan.chunk_count, plan.chunk_count * vh * layout::DELTA_CHUNK);
    let (w, u, vn) = (be.alloc_f32(rows * dk)?, be.alloc_f32(rows * dv)?, be.alloc_f32(rows * dv)?);
    let h = be.alloc_f32(chunks * vh * dk * dv)?;
    let [(wu, wu_smem), (state, state_smem), (out, out_smem)] = kernels;
    let cols = dv.div_ceil(32) as u32;
    be.launch(
        wu,
        launch_config((chunks as u32, vh as u32, 1), 256, *wu_smem),
        &[
            Arg::Ptr(be.p(&x.k)),
            Arg::Ptr(be.p(&x.v)),
            Arg::Ptr(be.p(&x.beta)),
            Arg::Ptr(be.p(&x.g)),
            Arg::Ptr(be.p(tp)),
            Arg::Ptr(be.p(&plan.chunks)),
            Arg::I32(kh as i32),
            Arg::I32(vh as i32),
            Arg::I32(dv as i32),
            Arg::Ptr(be.p(&w)),
            Arg::Ptr(be.p(&u)),
        ],
    )?;
    for range in [0..plan.roots, plan.roots..plan.sequences] {
        let (meta, count) = plan.entries(be, &plan.scan_meta, range);
        if count == 0 {
            continue;
        }
        be.launch(
            state,
            launch_config((count as u32, vh as u32, cols), 128, *state_smem),
            &[
                Arg::Ptr(be.p(&x.k)),
                Arg::Ptr(be.p(&x.g)),
                Arg::Ptr(be.p(&w)),
                Arg::Ptr(be.p(&u)),
                Arg::Ptr(be.p(&plan.chunks)),
                Arg::Ptr(meta),
                Arg::I32(kh as i32),
                Arg::I32(vh as i32),
                Arg::I32(dv as i32),
                Arg::Ptr(be.p(&h)),
                Arg::Ptr(be.p(&vn)),
            ],
        )?;
    }
    be.launch(
        out,
        launch_config((chunks as u32, vh as u32, cols), 128, *out_smem),
        &[
            Arg::Ptr(be.p(&x.q)),
            Arg::Ptr(be.p(&x.beta)),
            Arg::Ptr(be.p(&x.g)),
            Arg::Ptr(be.p(tp)),
            Arg::Ptr(be.p(&h)),
            Arg::Ptr(be.p(&vn)),
            Arg::Ptr(be.p(&plan.chunks)),
            Arg::I32(kh as i32),
            Arg::I32(vh as i32),
            Arg::I32(dv as i32),
            Arg::Ptr(be.p(core)),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::launch::KERNELS;

    #[test]
    fn conv_tilings_parse_and_grow_with_the_rows() {
        assert_eq!("8x4".parse::<ConvTiling>(), Ok(ConvTiling { group: 8, groups: 4 }));
        assert_eq!("4x64".parse::<ConvTiling>(), Ok(ConvTiling { group: 4, groups: 64 }));
        assert_eq!(ConvTiling::new(4, 16), Ok(ConvTiling { group: 4, groups: 16 }));
        assert!(ConvTiling::new(5, 4).is_err() && ConvTiling::new(8, 0).is_err());
        for bad in ["8", "6x4", "8x0", "8x65", "x4", "8x-1", "eightx4"] {
            assert!(bad.parse::<ConvTiling>().is_err(), "{bad} parsed");
        }
        let rows = |n| ConvTiling::for_rows(n).rows_per_block();
        assert_eq!((rows(977), rows(2048), rows(16384)), (8, 16, 64));
        assert!((1..70_000).step_by(97).all(|n| {
            let t = ConvTiling::for_rows(n);
            [4, 8].contains(&t.group) && (1..=ConvTiling::MAX_GROUPS).contains(&t.groups)
        }));
        assert_eq!(
            (ConvTiling::for_rows(977).kernel(), "8x4".parse::<ConvTiling>().unwrap().kernel()),
            ("gdn_conv_4", "gdn_conv_8")
        );
    }

    #[test]
    fn the_warpgroup_scan_is_launched_with_the_threads_its_kernel_is_built_for() {
        // kernels/deltanet_wg.cu: SCAN_WG_ENTRY(name, dk, producer, paired, lean, launch-bounds
        // threads, blocks an SM).
        let src = KERNELS.iter().find(|f| f.name == "deltanet").expect("deltanet unit").source;
        assert!(src.contains("__launch_bounds__(THREADS, MINB)"));
        for dk in [32, 64, 128] {
            for (kind, producer, paired, lean, threads, minb) in [
                ("wg", true, false, false, WARPGROUP_SCAN_THREADS, 1),
                ("wg1", false, false, false, 128, 1),
                ("wg2", false, true, false, 256, 1),
                ("wgl", false, false, true, 128, 2),
            ] {
                let entry = format!(
                    "SCAN_WG_ENTRY(gdn_chunk_scan_{kind}_{dk}, {dk}, {producer}, {paired}, {lean}, {threads}, {minb})"
                );
                assert!(src.contains(&entry), "kernels/deltanet_wg.cu must declare {entry}");
            }
        }
        let opts = CudaOptions {
            gdn_scan: GdnScan::Warpgroup,
            gdn_ffma: false,
            gdn_wg_lean: false,
            ..CudaOptions::default()
        };
        let long = PIPELINED_MIN_CHUNKS;
        let k = warpgroup_kernel(&opts, 128, 128, long, true).expect("dk 128 on Hopper");
        assert_eq!(
            (k.name.as_str(), k.threads, k.column_blocks, k.smem),
            ("gdn_chunk_scan_wg_128", WARPGROUP_SCAN_THREADS, 2, layout::delta_wg_smem_bytes(128))
        );
        let short = warpgroup_kernel(&opts, 128, 128, long - 1, true).expect("short launch");
        assert_eq!((short.name.as_str(), short.threads), ("gdn_chunk_scan_wg1_128", 128));
        // Paired: the short launches take two warpgroups a block over 128 value columns; the long
        // ones and 64-column heads are as before.
        let paired = CudaOptions { gdn_wg_pair: true, ..opts.clone() };
        let k = warpgroup_kernel(&paired, 128, 128, long - 1, true).expect("short launch");
        assert_eq!(
            (k.name.as_str(), k.threads, k.column_blocks, k.smem),
            ("gdn_chunk_scan_wg2_128", 256, 1, layout::delta_wg2_smem_bytes(128))
        );
        assert_eq!(warpgroup_kernel(&paired, 128, 256, 1, true).map(|k| k.column_blocks), Some(2));
        assert_eq!(
            warpgroup_kernel(&paired, 128, 128, long, true).map(|k| k.name),
            Some("gdn_chunk_scan_wg_128".into())
        );
        assert_eq!(
            warpgroup_kernel(&paired, 128, 64, 1, true).map(|k| k.name),
            Some("gdn_chunk_scan_wg1_128".into())
        );
        // Lean (the default): the short launches only (the paired form wins where both are asked for).
        assert!(CudaOptions::default().gdn_wg_lean);
        let lean = CudaOptions { gdn_wg_lean: true, ..opts.clone() };
        let k = warpgroup_kernel(&lean, 128, 128, long - 1, true).expect("short launch");
        assert_eq!(
            (k.name.as_str(), k.threads, k.column_blocks, k.smem),
            ("gdn_chunk_scan_wgl_128", 128, 2, layout::delta_wgl_smem_bytes(128))
        );
        assert_eq!(
            warpgroup_kernel(&lean, 128, 128, long, true).map(|k| k.name),
            Some("gdn_chunk_scan_wg_128".into())
        );
        let both = CudaOptions { gdn_wg_pair: true, ..lean.clone() };
        assert_eq!(
            warpgroup_kernel(&both, 128, 128, 1, true).map(|k| k.name),
            Some("gdn_chunk_scan_wg2_128".into())
        );
        let forced = CudaOptions { gdn_wg_producer: Some(true), ..opts.clone() };
        assert_eq!(
            warpgroup_kernel(&forced, 64, 128, 1, true).map(|k| k.name),
            Some("gdn_chunk_scan_wg_64".into())
        );
        assert_eq!(warpgroup_kernel(&opts, 128, 24, long, true).map(|k| k.column_blocks), Some(1));
        assert!(warpgroup_kernel(&opts, 16, 128, long, true).is_none());
        assert!(warpgroup_kernel(&opts, 128, 128, long, false).is_none());
        let other = CudaOptions { gdn_scan: GdnScan::ByLength, ..opts.clone() };
        assert!(warpgroup_kernel(&other, 128, 128, long, true).is_none());
        // The default runs it where it runs with one TF32 MMA per product, and on no other GPU.
        let auto = CudaOptions::default();
        assert!(warpgroup_scan_runs(&auto, 128, true));
        assert!(!warpgroup_scan_runs(&auto, 128, false), "by length off Hopper");
        assert!(!warpgroup_scan_runs(&auto, 16, true), "key dim 16 has no warpgroup scan");
        assert!(!warpgroup_scan_runs(&CudaOptions { gdn_tf32: false, ..auto.clone() }, 128, true), "3xTF32");
        assert!(!warpgroup_scan_runs(&CudaOptions { gdn_ffma: true, ..auto.clone() }, 128, true), "FMA scan");
        assert!(warpgroup_scan_runs(&CudaOptions { gdn_tf32: false, ..opts.clone() }, 128, true), "forced");
    }

    #[test]
    fn the_conv_row_table_is_sorted_disjoint_and_has_no_empty_sequences() {
        // Launch order (a parent, a root, its children) is not row order; an empty sequence.
        let launch = [[300, 73, 1, 2], [0, 150, 3, 4], [150, 0, 5, 6], [150, 150, 7, 8], [373, 73, 9, 10]];
        let rows = conv_rows_in_order(launch.into_iter());
        assert_eq!(rows, vec![[0, 150, 3, 4], [150, 150, 7, 8], [300, 73, 1, 2], [373, 73, 9, 10]]);
        for w in rows.windows(2) {
            assert!(w[0][0] + w[0][1] <= w[1][0], "disjoint, ascending: {w:?}");
        }
    }

    #[test]
    fn scan_kernel_follows_options_the_longest_sequence_and_the_waves() {
        let fits = |_: &ScanKernel| true;
        let spills = |_: &ScanKernel| false;
        // A launch of a few sequences: two plain blocks per SM fit it, one pipelined block does not.
        let plain_fits = |k: &ScanKernel| !k.name.contains("_pipelined_");
        let auto = CudaOptions::default();
        assert_eq!(auto.gdn_scan, GdnScan::Auto);
        assert!(auto.gdn_tf32, "one TF32 MMA per product is the default");
        let by_length = CudaOptions { gdn_scan: GdnScan::ByLength, ..auto.clone() };
        let short = PIPELINED_MIN_CHUNKS - 1;
        assert_eq!(scan_kernel(&by_length, 128, 128, short, fits).name, "gdn_chunk_scan_tf32_pipelined_128");
        assert_eq!(scan_kernel(&by_length, 128, 128, short, plain_fits).name, "gdn_chunk_scan_tf32_128");
        assert_eq!(scan_kernel(&by_length, 128, 128, short, spills).name, "gdn_chunk_scan_tf32_wide_128");
        assert_eq!(
            scan_kernel(&by_length, 128, 160, short, spills).name,
            "gdn_chunk_scan_tf32_128",
            "value dims over 128 have no wide scan"
        );
        for waves in [fits, spills] {
            assert_eq!(
                scan_kernel(&by_length, 128, 128, PIPELINED_MIN_CHUNKS, waves).name,
                "gdn_chunk_scan_tf32_pipelined_128"
            );
        }
        // The one-wave question is asked about the pipelined scan's grid, then the plain scan's.
        let mut asked = Vec::new();
        scan_kernel(&by_length, 64, 96, short, |k| {
            asked.push((k.name.clone(), k.threads, k.column_blocks));
            false
        });
        let names =
            |v: &[(&str, u32, u32)]| v.iter().map(|&(n, t, c)| (n.to_string(), t, c)).collect::<Vec<_>>();
        assert_eq!(
            asked,
            names(&[("gdn_chunk_scan_tf32_pipelined_64", 256, 3), ("gdn_chunk_scan_tf32_64", 256, 3)])
        );
        let forced = |gdn_scan| CudaOptions { gdn_scan, gdn_tf32: false, ..CudaOptions::default() };
        let plain_by_length = forced(GdnScan::PlainByLength);
        assert_eq!(scan_kernel(&plain_by_length, 128, 128, short, spills).name, "gdn_chunk_scan_tc_128");
        assert_eq!(
            scan_kernel(&plain_by_length, 128, 128, PIPELINED_MIN_CHUNKS, spills).name,
            "gdn_chunk_scan_tc_pipelined_128"
        );
        assert_eq!(
            scan_kernel(&forced(GdnScan::Pipelined), 64, 128, 1, spills).name,
            "gdn_chunk_scan_tc_pipelined_64"
        );
        assert_eq!(scan_kernel(&forced(GdnScan::Plain), 64, 128, 1000, spills).name, "gdn_chunk_scan_tc_64");
        let ffma = CudaOptions { gdn_ffma: true, gdn_scan: GdnScan::Pipelined, ..CudaOptions::default() };
        assert_eq!(scan_kernel(&ffma, 32, 128, 1000, spills).name, "gdn_chunk_scan_32");
        let tf32 = |gdn_scan| CudaOptions { gdn_tf32: true, ..forced(gdn_scan) };
        let split = |gdn_tf32| CudaOptions { gdn_tf32, ..forced(GdnScan::Split) };
        for tf32 in [false, true] {
            for dk in [16, 32, 64, 128] {
                let ks = split_kernels(&split(tf32), dk, 128).expect("the split path runs");
                for (name, smem) in ks {
                    let f = KERNELS.iter().flat_map(|f| f.functions.iter()).find(|f| f.name == name);
                    assert_eq!(f.map(|f| f.max_dynamic_smem), Some(smem), "{name}");
                }
            }
        }
        assert!(split_kernels(&split(false), 128, 160).is_none(), "value dims over 128 fall back");
        assert!(split_kernels(&forced(GdnScan::ByLength), 128, 128).is_none());
        assert!(split_kernels(&CudaOptions { gdn_ffma: true, ..split(false) }, 128, 128).is_none());
        // The FMA scan wins over the TF32 products.
        assert_eq!(
            scan_kernel(&CudaOptions { gdn_tf32: true, ..ffma.clone() }, 32, 128, 1, spills).name,
            "gdn_chunk_scan_32"
        );
        let wide = |gdn_tf32| CudaOptions { gdn_tf32, ..forced(GdnScan::Wide) };
        assert_eq!(scan_kernel(&wide(true), 128, 128, 1, fits).name, "gdn_chunk_scan_tf32_wide_128");
        assert_eq!(scan_kernel(&wide(false), 64, 24, 300, fits).name, "gdn_chunk_scan_tc_wide_64");
        assert_eq!(
            scan_kernel(&wide(true), 128, 160, 1, fits).name,
            "gdn_chunk_scan_tf32_128",
            "dv > 128 falls back"
        );
        // Every choice is a kernel of the table, launched with the shared memory it is allowed.
        let table: Vec<_> = KERNELS.iter().flat_map(|f| f.functions.iter()).collect();
        let all = [
            auto,
            by_length,
            plain_by_length,
            forced(GdnScan::Pipelined),
            forced(GdnScan::Plain),
            ffma,
            tf32(GdnScan::ByLength),
            wide(true),
            wide(false),
        ];
        for o in all {
            for dk in [16, 32, 64, 128] {
                for longest in [0, 1, PIPELINED_MIN_CHUNKS, 256] {
                    for dv in [24, 128, 160] {
                        for one_wave in [true, false] {
                            let ScanKernel { name, smem, threads, column_blocks } =
                                scan_kernel(&o, dk, dv, longest, |_| one_wave);
                            let f = table
                                .iter()
                                .find(|f| f.name == name)
                                .unwrap_or_else(|| panic!("{name} is not in KERNELS"));
                            assert_eq!(f.max_dynamic_smem, smem, "{name}");
                            // The wide scan where chosen and possible; every value column covered.
                            let wide = name.contains("_wide_");
                            let picks_wide = match o.gdn_scan {
                                GdnScan::Wide => true,
                                GdnScan::ByLength | GdnScan::Auto => {
                                    longest < PIPELINED_MIN_CHUNKS && !one_wave
                                }
                                _ => false,
                            };
                            assert_eq!(wide, picks_wide && !o.gdn_ffma && dv <= 128, "{name}");
                            let want = if wide { (512, 1) } else { (256, dv.div_ceil(32) as u32) };
                            assert_eq!((threads, column_blocks), want, "{name} at dv {dv}");
                        }
                    }
                }
            }
        }
    }
}
