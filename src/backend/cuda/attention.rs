//! Softmax attention: the decoder's gated attention over per-sequence KV caches (q/k norm,
//! rotary, append, causal GQA, output gate), shared KV prefixes for forks, and the vision tower's
//! bidirectional attention. Kernels: kernels/attention.cu (`attn_prep`, `attn_fwd_<head dim>`);
//! CPU twin: src/backend/cpu/attention.rs.

use super::launch::{launch_config, Arg};
use super::layout;
use super::tensor::CudaTensor;
use super::tma::{Elem, TensorMap, Tile2d};
use super::CudaBackend;
use crate::backend::{check_parents, check_tiling, AttentionDims, AttentionInputs, Tree};
use anyhow::{anyhow, ensure, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use std::ops::Range;
use std::sync::Arc;

/// Which attention kernel runs (for the head dims it serves; other head dims take `attn_fwd`).
/// The choice depends on the options, the GPU and the head dim only, never on the batch, so a
/// row's arithmetic is the same whatever shares a call. Passes over long caches split their keys:
/// on Hopper with `attn_fwd_wgmma_split` (a KV group's query heads in one tile; `_splitg`, the
/// sequences fastest in the grid, with `Auto` and `WgmmaGrouped`) unless `Rows128` or `Rows64` is
/// chosen, else with `attn_fwd_q128`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// On Hopper `attn_fwd_wgmma`: 128-key tiles at head dim 64 with the blocks in KV-group order
    /// and three K/V buffers (as `WgmmaGrouped3`: 0.90-0.95x `WgmmaK128`'s time at the vision
    /// tower's 65,536 patches on an H100), 64-key tiles at 256 (heads fastest: the group order
    /// measured no faster there) except for sequences of at least
    /// [`super::CudaOptions::attention_ws_rows`] query rows, which run on `attn_fwd_ws_256`
    /// (`WarpSpecialized`, TMA-fed: the same bits; 16K causal 0.767x wgmma's time on an H100),
    /// split passes with the sequences fastest (as `WgmmaGrouped`); else `attn_fwd_q128`.
    #[default]
    Auto,
    /// `attn_fwd_wgmma` with 64-key tiles where the GPU and head dim allow it (the default at head
    /// dim 64 until 2026-12-04: bench/NOTES.md).
    Wgmma,
    /// `attn_fwd_wgmma` with 128-key tiles at head dim 64 (`attn_fwd_wgmma_k128_64`: the vision
    /// tower; the same bits as `WarpSpecialized`, whose tiles are 128 keys there too; 1.23x the
    /// 64-key kernel at 16K patches, bench/NOTES.md), 64-key tiles at 256.
    WgmmaK128,
    /// `attn_fwd_wgmma` with the blocks in KV-group order (`attn_fwd_wgmma_k128g_64`: 128-key
    /// tiles at head dim 64, `attn_fwd_wgmma_g_256`: 64-key tiles at 256): a group's query tiles
    /// run together, its query heads fastest, so the blocks on the GPU at once share one or two
    /// groups' keys and values in L2 (the heads-fastest order streams every group's at once, past
    /// the L2 from ~16K keys on); the same bits as `WgmmaK128` / `Wgmma`. `Auto`'s order at head
    /// dim 64 (bench/NOTES.md, eighteenth session). Passes over long caches split their keys with
    /// the sequences fastest (`attn_fwd_wgmma_splitg`), so the passes over one shared prefix read
    /// each of its key ranges together.
    WgmmaGrouped,
    /// `WgmmaGrouped` with three K/V buffers at head dim 64 (`attn_fwd_wgmma_k128g3_64`: each tile's
    /// copies issued two tiles ahead, for the barrier stalls at every tile's start; 113 KB of shared
    /// memory, two blocks an SM as before); the same bits. `Auto` at head dim 64: 0.984x
    /// `WgmmaGrouped`'s time at 65,536 patches, 0.993x at 16K on an H100 (bench/NOTES.md).
    WgmmaGrouped3,
    /// `WgmmaK128` with the rows' softmax sums taken by the tensor cores from the BF16 P the P·V
    /// MMAs multiply (`attn_fwd_wgmma_tsum_64`: a `wgmma m64n8k16` against ones per 16 keys instead
    /// of an add per score; not `WgmmaK128`'s bits, whose sums are of the f32 P). Opt-in: on an H100
    /// 5% slower at 16K patches and as fast at 65,536 (bench/NOTES.md).
    WgmmaTensorSums,
    /// `attn_fwd_wgmma_ov`: `attn_fwd_wgmma` with each tile's softmax overlapped with the previous
    /// tile's P·V MMAs in the warpgroup (the same bits; as fast as `Wgmma` within the noise of two
    /// runs: bench/NOTES.md), where the GPU and head dim allow it.
    Overlap,
    /// `attn_fwd_ws`: warpgroup MMAs, warp-specialised (a producer warpgroup feeding the key/value
    /// tiles by TMA, two consumers that take MMA turns and overlap the softmax with the MMAs)
    /// where the GPU and head dim allow it, for every sequence (`Auto` uses it at head dim 256 for
    /// long sequences only). The same bits as `Wgmma` / `WgmmaK128` (128-key tiles at head dim 64).
    WarpSpecialized,
    /// `attn_fwd_ws3_64` at head dim 64 (the vision tower): `WarpSpecialized` with three consumers
    /// over 192 query rows, FlashAttention-3's tiles there (`WgmmaK128`'s bits); other head dims
    /// as `Auto`. Opt-in: on an H100 as fast as `WgmmaK128` at 65,536 patches and 7% slower at
    /// 16K (bench/NOTES.md), both in the heads-first order; its blocks run in KV-group order (as
    /// `WgmmaGrouped`) since the eighteenth session, not yet measured so.
    WarpSpecialized3,
    /// `attn_fwd_q128` (mma.sync, 128 query rows per block).
    Rows128,
    /// `attn_fwd` (mma.sync, 64 query rows per block): the first kernel, kept as a reference.
    Rows64,
}

impl AttentionKernel {
    /// Every kernel by its `IMAJEV_ATTENTION` name, in the order the error message lists them.
    pub const NAMED: [(&'static str, AttentionKernel); 11] = [
        ("auto", AttentionKernel::Auto),
        ("ov", AttentionKernel::Overlap),
        ("ws", AttentionKernel::WarpSpecialized),
        ("ws3", AttentionKernel::WarpSpecialized3),
        ("wgmma", AttentionKernel::Wgmma),
        ("wgmma-k128", AttentionKernel::WgmmaK128),
        ("wgmma-grouped", AttentionKernel::WgmmaGrouped),
        ("wgmma-grouped3", AttentionKernel::WgmmaGrouped3),
        ("wgmma-tsum", AttentionKernel::WgmmaTensorSums),
        ("q128", AttentionKernel::Rows128),
        ("q64", AttentionKernel::Rows64),
    ];

    /// From `IMAJEV_ATTENTION` (a name of [`AttentionKernel::NAMED`]).
    pub fn parse(v: &str) -> Option<Self> {
        Self::NAMED.iter().find(|(name, _)| *name == v).map(|&(_, kernel)| kernel)
    }

    /// The names [`AttentionKernel::parse`] accepts, for an error message: "auto, ov, …or q64".
    pub fn expected() -> String {
        let names: Vec<&str> = Self::NAMED.iter().map(|(name, _)| *name).collect();
        let (last, rest) = names.split_last().expect("kernels have names");
        format!("{} or {last}", rest.join(", "))
    }
}

/// The grid of a kernel whose blocks run in KV-group order (`block_head` in
/// kernels/attention.cu): x = r + R·(query tile from the last) for query head r < R = heads / kvh
/// of its group, y the group, z the sequence; `tiles` query tiles of the longest sequence.
fn group_order_grid(tiles: usize, heads: usize, kvh: usize, sequences: u32) -> (u32, u32, u32) {
    ((heads / kvh * tiles) as u32, kvh as u32, sequences)
}

/// Keys and values of one attention layer of one sequence: an optional immutable shared prefix
/// (made by `share_kv`, referenced by every fork), then the sequence's own rows
/// `[capacity, kv_heads·head_dim]` BF16, grown geometrically. `clone()` shares the prefix and
/// deep-copies the own rows on the GPU.
pub struct CudaKvCache {
    shared: Option<Arc<SharedKv>>,
    k: Option<CudaSlice<bf16>>,
    v: Option<CudaSlice<bf16>>,
    pub(super) width: usize,
    cap: usize,
    len: usize,
}

struct SharedKv {
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    len: usize,
}

impl CudaKvCache {
    /// Rows the own buffers can hold before they are reallocated.
    pub fn capacity(&self) -> usize {
        self.cap
    }
    /// Rows in the shared (immutable) prefix.
    pub fn shared_len(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.len)
    }
}

/// A new buffer of `cap` elements whose first `n` are copied from `src`.
fn copy_prefix<T>(src: &CudaSlice<T>, cap: usize, n: usize) -> Result<CudaSlice<T>>
where
    T: cudarc::driver::DeviceRepr,
{
    let stream = src.stream().clone();
    // SAFETY: the first n elements are written below; the rest is unused capacity.
    let mut dst = unsafe { stream.alloc::<T>(cap.max(1)) }?;
    if n > 0 {
        stream.memcpy_dtod(&src.slice(0..n), &mut dst.slice_mut(0..n))?;
    }
    Ok(dst)
}

impl Clone for CudaKvCache {
    fn clone(&self) -> Self {
        let copy = |s: &Option<CudaSlice<bf16>>| {
            s.as_ref().map(|s| {
                copy_prefix(s, self.cap * self.width, self.len * self.width)
                    .expect("copying a KV cache on the GPU")
            })
        };
        CudaKvCache {
            shared: self.shared.clone(),
            k: copy(&self.k),
            v: copy(&self.v),
            width: self.width,
            cap: self.cap,
            len: self.len,
        }
    }
}

impl CudaBackend {
    /// Grows the own buffers of `c` to hold `needed` rows (see `layout::kv_capacity`).
    pub(super) fn reserve_kv(&self, c: &mut CudaKvCache, needed: usize) -> Result<()> {
        if c.k.is_some() && needed <= c.cap {
            return Ok(());
        }
        let cap = layout::kv_capacity(c.cap, needed);
        let (n, total) = (c.len * c.width, cap * c.width);
        let grow = |old: &Option<CudaSlice<bf16>>| -> Result<CudaSlice<bf16>> {
            match old {
                Some(s) => copy_prefix(s, total, n),
                None => self.alloc_bf16(total),
            }
        };
        let k = grow(&c.k)?;
        let v = grow(&c.v)?;
        c.k = Some(k);
        c.v = Some(v);
        c.cap = cap;
        Ok(())
    }

    /// The attention kernel over the segment table `meta` (see kernels/attention.cu; `meta_host`
    /// is the same table on the host). Passes over long caches split their keys into ranges
    /// (`attn_fwd_wgmma_split` on Hopper, else `attn_fwd_q128` in split mode, then
    /// `attn_split_combine`); the rest run as one launch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_core(
        &self,
        q: &CudaSlice<bf16>,
        meta_host: &[i64],
        meta: &CudaSlice<i64>,
        segments: &[Range<usize>],
        heads: usize,
        kvh: usize,
        hd: usize,
        causal: bool,
        gate: Option<(u64, usize, usize)>,
        out: &CudaSlice<bf16>,
    ) -> Result<()> {
        let hdp =
            layout::attention_head_dim(hd).ok_or_else(|| anyhow!("head_dim {hd} is larger than 256"))?;
        if segments.iter().all(|s| s.is_empty()) {
            return Ok(());
        }
        let scale_log2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
        let (gp, grow, ghead) = gate.unwrap_or((0, 0, 0));
        let args = |table: u64| {
            vec![
                Arg::Ptr(self.p(q)),
                Arg::Ptr(table),
                Arg::I32(heads as i32),
                Arg::I32(kvh as i32),
                Arg::I32(hd as i32),
                Arg::I32(causal as i32),
                Arg::F32(scale_log2),
                Arg::Ptr(gp),
                Arg::I64(grow as i64),
                Arg::I32(ghead as i32),
                Arg::Ptr(self.p(out)),
            ]
        };
        let longest = |idx: &[usize]| idx.iter().map(|&si| segments[si].len()).max().unwrap_or(0);
        // The kernel depends on the head dim and the options only, never on the batch, so a row's
        // arithmetic is the same whatever shares the call.
        let kernel = self.state.options.attention;
        let hopper = self.state.info.hopper() && matches!(hdp, 64 | 256);
        if !layout::attention_q128_serves(hd) || kernel == AttentionKernel::Rows64 {
            let all: Vec<usize> = (0..segments.len()).collect();
            let grid = (longest(&all).div_ceil(64) as u32, heads as u32, segments.len() as u32);
            let cfg = launch_config(grid, 128, layout::attention_smem_bytes(hdp));
            return self.launch(&format!("attn_fwd_{hdp}"), cfg, &args(self.p(meta)));
        }
        // Whether a sequence splits its keys depends on its own rows and cache length only.
        let ranges: Vec<usize> = segments
            .iter()
            .enumerate()
            .map(|(si, s)| {
                let kvlen = (meta_host[8 * si + 4] + meta_host[8 * si + 7]) as usize + s.len();
                layout::attention_key_ranges(s.len(), kvlen)
            })
            .collect();
        let (split, whole): (Vec<usize>, Vec<usize>) = (0..segments.len()).partition(|&si| ranges[si] > 1);
        let name = format!("attn_fwd_q128_{hdp}");
        let (threads, smem) = (layout::attention_q128_threads(hdp), layout::attention_q128_smem_bytes(hdp));
        let subset = |idx: &[usize]| -> Result<CudaSlice<i64>> {
            self.htod(
                &idx.iter().flat_map(|&si| meta_host[8 * si..8 * si + 8].iter().copied()).collect::<Vec<_>>(),
            )
        };
        // The segment table of the sequences `idx` (in order): the whole table when they are all
        // of them (split, long and whole partition it), else a subset uploaded for the launch.
        let table_of = |idx: &[usize]| -> Result<Option<CudaSlice<i64>>> {
            if idx.len() == segments.len() {
                Ok(None)
            } else {
                subset(idx).map(Some)
            }
        };
        // An attn_fwd_ws entry (`consumers` of them, TMA key/value tiles) over the sequences `idx`
        // of the table at `tp`: its maps are the launch's last argument.
        let launch_ws = |name: &str, consumers: usize, grid: (u32, u32, u32), idx: &[usize], tp: u64| {
            let cfg = launch_config(
                grid,
                layout::attention_ws_threads(consumers),
                layout::attention_ws_smem_bytes(hdp, consumers),
            );
            let maps = self.ws_kv_maps(meta_host, idx, segments, kvh, hd, hdp, consumers)?;
            let mut a = args(tp);
            a.push(Arg::Ptr(maps.as_ref().map_or(0, |m| self.p(m))));
            self.launch(name, cfg, &a)
        };
        let heads_first_grid =
            |idx: &[usize]| (heads as u32, longest(idx).div_ceil(128) as u32, idx.len() as u32);
        // Auto at head dim 256 (and WarpSpecialized3, which is Auto off head dim 64, so that an A/B
        // of the vision kernel changes nothing else): sequences of at least `attention_ws_rows`
        // query rows on attn_fwd_ws_256, the others on attn_fwd_wgmma_256. The two give the same
        // bits (tests/gpu compares them bitwise), so the kernel may follow a sequence's own length
        // without its rows depending on the batch.
        let ws_rows = self.state.options.attention_ws_rows.unwrap_or(layout::ATTENTION_WS_MIN_ROWS);
        let (long, whole): (Vec<usize>, Vec<usize>) = if hopper
            && matches!(kernel, AttentionKernel::Auto | AttentionKernel::WarpSpecialized3)
            && hdp == 256
            && ws_rows > 0
        {
            whole.into_iter().partition(|&si| segments[si].len() >= ws_rows)
        } else {
            (vec![], whole)
        };
        if !long.is_empty() {
            let table = table_of(&long)?;
            launch_ws(
                &format!("attn_fwd_ws_{hdp}"),
                2,
                heads_first_grid(&long),
                &long,
                table.as_ref().map_or(self.p(meta), |t| self.p(t)),
            )?;
        }
        if !whole.is_empty() && longest(&whole) > 0 {
            let table = table_of(&whole)?;
            let tp = table.as_ref().map_or(self.p(meta), |t| self.p(t));
            let grid = heads_first_grid(&whole);
            if hopper && kernel == AttentionKernel::WarpSpecialized {
                launch_ws(&format!("attn_fwd_ws_{hdp}"), 2, grid, &whole, tp)?;
            } else if hopper && kernel == AttentionKernel::WarpSpecialized3 && hdp == 64 {
                // KV-group order, as WgmmaGrouped.
                let rows = layout::attention_ws_query_rows(3);
                let grid = group_order_grid(longest(&whole).div_ceil(rows), heads, kvh, grid.2);
                launch_ws("attn_fwd_ws3_64", 3, grid, &whole, tp)?;
            } else if hopper && kernel == AttentionKernel::Overlap {
                let cfg = launch_config(grid, 256, layout::attention_wgmma_smem_bytes(hdp));
                self.launch(&format!("attn_fwd_wgmma_ov_{hdp}"), cfg, &args(tp))?;
            } else if hopper && kernel == AttentionKernel::WgmmaTensorSums && hdp == 64 {
                let cfg = launch_config(grid, 256, layout::attention_wgmma_tsum_smem_bytes());
                self.launch("attn_fwd_wgmma_tsum_64", cfg, &args(tp))?;
            } else if hopper
                && (matches!(kernel, AttentionKernel::WgmmaGrouped | AttentionKernel::WgmmaGrouped3)
                    || (kernel == AttentionKernel::Auto && hdp == 64))
            {
                let (name, smem) = match (hdp, kernel) {
                    (64, AttentionKernel::WgmmaGrouped3 | AttentionKernel::Auto) => {
                        ("attn_fwd_wgmma_k128g3_64", layout::attention_wgmma_smem_bytes_ring(64, 128, 3))
                    }
                    (64, _) => ("attn_fwd_wgmma_k128g_64", layout::attention_wgmma_smem_bytes_tiles(64, 128)),
                    _ => ("attn_fwd_wgmma_g_256", layout::attention_wgmma_smem_bytes(hdp)),
                };
                let cfg = launch_config(group_order_grid(grid.1 as usize, heads, kvh, grid.2), 256, smem);
                self.launch(name, cfg, &args(tp))?;
            } else if hopper
                && matches!(kernel, AttentionKernel::Auto | AttentionKernel::WgmmaK128)
                && hdp == 64
            {
                let cfg = launch_config(grid, 256, layout::attention_wgmma_smem_bytes_tiles(hdp, 128));
                self.launch("attn_fwd_wgmma_k128_64", cfg, &args(tp))?;
            } else if hopper
                && matches!(
                    kernel,
                    AttentionKernel::Auto
                        | AttentionKernel::Wgmma
                        | AttentionKernel::WgmmaK128
                        | AttentionKernel::WgmmaTensorSums
                        | AttentionKernel::WarpSpecialized3
                )
            {
                let cfg = launch_config(grid, 256, layout::attention_wgmma_smem_bytes(hdp));
                self.launch(&format!("attn_fwd_wgmma_{hdp}"), cfg, &args(tp))?;
            } else {
                let mut a = args(tp);
                a.extend([Arg::I32(0), Arg::I32(0), Arg::Ptr(0)]);
                self.launch(&name, launch_config(grid, threads, smem), &a)?;
            }
        }
        if split.is_empty() {
            return Ok(());
        }
        let table = subset(&split)?;
        let nsplit = split.iter().map(|&si| ranges[si]).max().unwrap_or(1);
        let slot = layout::attention_split_slot_floats(hdp);
        let part = self.alloc_f32(split.len() * heads * nsplit * slot)?;
        let range = Arg::I32(layout::ATTENTION_KEY_RANGE as i32);
        let grid = (heads as u32, nsplit as u32, split.len() as u32);
        if hopper && !matches!(kernel, AttentionKernel::Rows128 | AttentionKernel::Rows64) {
            // Auto and WgmmaGrouped: the sequences fastest (grid: sequences, heads, ranges), so the
            // passes over one shared prefix read each of its key ranges together (0.956x the time
            // of 11 passes x 73 over 16K on an H100; the same bits).
            let (name, grid) = match kernel {
                AttentionKernel::Auto | AttentionKernel::WgmmaGrouped | AttentionKernel::WgmmaGrouped3 => {
                    (format!("attn_fwd_wgmma_splitg_{hdp}"), (grid.2, grid.0, grid.1))
                }
                _ => (format!("attn_fwd_wgmma_split_{hdp}"), grid),
            };
            // A KV group's query heads stacked in tiles of 128 rows: at most heads / kvh tiles per
            // group (sequences that split have at most 128 rows), so `heads` blocks across.
            let a = [
                Arg::Ptr(self.p(q)),
                Arg::Ptr(self.p(&table)),
                Arg::I32(heads as i32),
                Arg::I32(kvh as i32),
                Arg::I32(hd as i32),
                Arg::I32(causal as i32),
                Arg::F32(scale_log2),
                range,
                Arg::I32(nsplit as i32),
                Arg::Ptr(self.p(&part)),
            ];
            let cfg = launch_config(grid, 256, layout::attention_wgmma_smem_bytes(hdp));
            self.launch(&name, cfg, &a)?;
        } else {
            let mut a = args(self.p(&table));
            a.extend([range, Arg::I32(nsplit as i32), Arg::Ptr(self.p(&part))]);
            self.launch(&name, launch_config(grid, threads, smem), &a)?;
        }
        let grid = (layout::ATTENTION_SPLIT_MAX_ROWS as u32, heads as u32, split.len() as u32);
        self.launch(
            &format!("attn_split_combine_{hdp}"),
            launch_config(grid, 64, 0),
            &[
                Arg::Ptr(self.p(&part)),
                Arg::Ptr(self.p(&table)),
                Arg::I32(heads as i32),
                Arg::I32(hd as i32),
                Arg::I32(nsplit as i32),
                Arg::Ptr(gp),
                Arg::I64(grow as i64),
                Arg::I32(ghead as i32),
                Arg::Ptr(self.p(out)),
            ],
        )
    }

    /// The TMA maps `attn_fwd_ws` reads its key/value tiles through (kernels/attention.cu): for
    /// each sequence `idx[z]` of the launch's segment table, in table order, four maps — K and V
    /// of its shared prefix, K and V of its own rows — each over that range's rows (own: the
    /// cached rows and this call's, which `attn_prep` appended) x `kvh·hd` columns, boxes of 64
    /// columns x the kernel's key tile, 128-byte swizzled as the kernel's tiles are. An empty
    /// range gets a zero map the kernel never reads (no tile lies in it). None (the kernel copies
    /// with cp.async) when the head dim is padded (`hd` < `hdp`): the maps' boxes would carry the
    /// next head's columns where the copies write zeros. Encoded through the cache (the own
    /// rows' count changes each call, the prefixes' not) and uploaded as one array.
    #[allow(clippy::too_many_arguments)]
    fn ws_kv_maps(
        &self,
        meta_host: &[i64],
        idx: &[usize],
        segments: &[Range<usize>],
        kvh: usize,
        hd: usize,
        hdp: usize,
        consumers: usize,
    ) -> Result<Option<CudaSlice<TensorMap>>> {
        if hd != hdp {
            return Ok(None);
        }
        let (bk, _) = layout::attention_ws_tiles(hdp, consumers);
        let maps = ws_kv_tiles(meta_host, idx, segments, kvh * hd, bk)
            .iter()
            .map(|t| t.as_ref().map_or(Ok(TensorMap::unused()), |t| self.state.tensor_maps.get(t)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(self.htod(&maps)?))
    }
}

/// What [`CudaBackend::ws_kv_maps`] encodes, for the sequences `idx` of the segment table
/// `meta_host` in that order: K shared, V shared, K own, V own, each over its range's rows x
/// `width` (= kv heads x head dim) BF16 columns, boxes of 64 columns x `bk` rows, 128-byte
/// swizzled; None for an empty range (a zero map the kernel never reads).
fn ws_kv_tiles(
    meta_host: &[i64],
    idx: &[usize],
    segments: &[Range<usize>],
    width: usize,
    bk: usize,
) -> Vec<Option<Tile2d>> {
    let tile = |what: &'static str, addr: i64, rows: usize| {
        (rows > 0).then(|| Tile2d::swizzled(what, Elem::Bf16, addr as u64, width, rows, 64, bk))
    };
    idx.iter()
        .flat_map(|&si| {
            let m = &meta_host[8 * si..8 * si + 8];
            // The own rows: those cached before this call and this call's, which attn_prep
            // appended before the attention launch.
            let (shared, own) = (m[4] as usize, m[7] as usize + segments[si].len());
            [
                tile("attention K (shared prefix)", m[2], shared),
                tile("attention V (shared prefix)", m[3], shared),
                tile("attention K (own rows)", m[5], own),
                tile("attention V (own rows)", m[6], own),
            ]
        })
        .collect()
}

/// `Backend::new_kv_cache` (the trait documents the contract).
pub(super) fn new_kv_cache(dims: &AttentionDims) -> Result<CudaKvCache> {
    Ok(CudaKvCache { shared: None, k: None, v: None, width: dims.kv_heads * dims.head_dim, cap: 0, len: 0 })
}

/// Rows in the cache: the shared prefix and the own rows.
pub(super) fn kv_len(cache: &CudaKvCache) -> usize {
    cache.shared_len() + cache.len
}

/// `Backend::share_kv` (the trait documents the contract).
pub(super) fn share_kv(be: &CudaBackend, c: &mut CudaKvCache) -> Result<()> {
    if c.len == 0 {
        return Ok(());
    }
    // New shared prefix = old shared rows + own rows, exactly sized; the own buffers are
    // dropped so forks start with none.
    let (old, own) = (c.shared_len() * c.width, c.len * c.width);
    let k = be.alloc_bf16(old + own)?;
    let v = be.alloc_bf16(old + own)?;
    for (dst, sh, mine) in
        [(&k, c.shared.as_ref().map(|s| &s.k), &c.k), (&v, c.shared.as_ref().map(|s| &s.v), &c.v)]
    {
        if let Some(sh) = sh {
            be.dtod_bytes(be.p(dst), be.p(sh), 2 * old)?;
        }
        let mine = mine.as_ref().ok_or_else(|| anyhow!("KV cache has rows but no buffer"))?;
        be.dtod_bytes(be.p(dst) + 2 * old as u64, be.p(mine), 2 * own)?;
    }
    c.shared = Some(Arc::new(SharedKv { k, v, len: c.shared_len() + c.len }));
    c.k = None;
    c.v = None;
    c.cap = 0;
    c.len = 0;
    Ok(())
}

/// `Backend::gated_attention` (the trait documents the contract).
pub(super) fn gated_attention(
    be: &CudaBackend,
    x: &AttentionInputs<CudaTensor>,
    dims: &AttentionDims,
    segments: &[Range<usize>],
    parents: &[Option<usize>],
    caches: &mut [&mut CudaKvCache],
) -> Result<CudaTensor> {
    attend(be, x, dims, segments, parents, caches, false)
}

/// `Backend::gated_attention_last_rows`: every row is prepared (its keys and values enter the
/// caches), then only the last query row of each segment is attended: the segment table says
/// one query row over all the keys (`nq` 1, the own length of the cache one short), which the
/// attention kernel treats like any sequence (a long one splits its keys).
pub(super) fn gated_attention_last_rows(
    be: &CudaBackend,
    x: &AttentionInputs<CudaTensor>,
    dims: &AttentionDims,
    segments: &[Range<usize>],
    parents: &[Option<usize>],
    caches: &mut [&mut CudaKvCache],
) -> Result<CudaTensor> {
    let all = attend(be, x, dims, segments, parents, caches, true)?;
    let last: Vec<usize> = segments.iter().map(|s| s.end.saturating_sub(1)).collect();
    super::elementwise::gather_rows(be, &all, &last)
}

/// Gated attention of every row, or (`last_only`) of the last row of each segment; either way
/// `[n, heads·head_dim]` (with `last_only` only the last rows are written).
fn attend(
    be: &CudaBackend,
    x: &AttentionInputs<CudaTensor>,
    dims: &AttentionDims,
    segments: &[Range<usize>],
    parents: &[Option<usize>],
    caches: &mut [&mut CudaKvCache],
    last_only: bool,
) -> Result<CudaTensor> {
    let AttentionDims { heads, kv_heads: kvh, head_dim: hd, rotary_dim: rot, norm_eps } = *dims;
    ensure!(segments.len() == caches.len(), "one cache per segment");
    let Tree { parent, is_parent } = check_parents(parents, segments.len())?;
    let (n, width) = x.qkv.rows_cols();
    ensure!(width == dims.qkv_width(), "attention input width {width} != {}", dims.qkv_width());
    ensure!(x.cos.rows_cols() == (n, rot) && x.sin.rows_cols() == (n, rot), "rotary table shapes");
    ensure!(kvh > 0 && heads % kvh == 0, "{heads} heads do not group over {kvh} kv heads");
    ensure!(
        hd <= 256 && rot <= hd && rot % 2 == 0,
        "head_dim {hd} / rotary_dim {rot} not supported (head_dim ≤ 256)"
    );
    ensure!(x.q_norm.numel() == hd && x.k_norm.numel() == hd, "q/k norm weights must have {hd} values");
    check_tiling(segments, n)?;
    for c in caches.iter() {
        ensure!(c.width == kvh * hd, "KV cache width {} does not match {kvh}×{hd}", c.width);
    }
    if n == 0 {
        return Ok(be.bf16_tensor(be.alloc_bf16(0)?, &[0, heads * hd]));
    }
    // The blocks of the fused projection [query/gate | key | value], read in place: base
    // pointers offset by each block's first column (bf16: 2 bytes per element), row stride
    // `width` elements.
    let qkv = be.bf16_of(x.qkv)?;
    let qg_ptr = be.p(qkv.s());
    let k_ptr = qg_ptr + 2 * (heads * 2 * hd) as u64;
    let v_ptr = k_ptr + 2 * (kvh * hd) as u64;
    let row = width as i64;
    let (qw, kw) = (be.f32_of(x.q_norm)?, be.f32_of(x.k_norm)?);
    let (cos, sin) = (be.f32_of(x.cos)?, be.f32_of(x.sin)?);
    let mut meta = Vec::with_capacity(8 * segments.len());
    for (si, seg) in segments.iter().enumerate() {
        if let Some(p) = parent[si] {
            // A fork of the parent, whose rows (all of them shared, see below) the prep
            // launch writes before the attention launch reads them.
            let shared = caches[p].shared.clone();
            let c = &mut *caches[si];
            *c = CudaKvCache { shared, k: None, v: None, width: c.width, cap: 0, len: 0 };
        }
        let c = &mut *caches[si];
        be.reserve_kv(c, c.len + seg.len())?;
        if is_parent[si] {
            // The parent's own rows, this call's included, become the immutable prefix its
            // children read: the own buffers move into the shared part as they are (the
            // prep launch writes this call's rows into them), so nothing is copied.
            ensure!(c.shared.is_none(), "a parent's KV cache must not continue a shared cache");
            let (k, v) = (c.k.take().expect("reserved"), c.v.take().expect("reserved"));
            let (kp, vp, before) = (be.p(&k), be.p(&v), c.len);
            c.shared = Some(Arc::new(SharedKv { k, v, len: before + seg.len() }));
            (c.cap, c.len) = (0, 0);
            meta.extend([seg.start as i64, seg.len() as i64, 0, 0, 0, kp as i64, vp as i64, before as i64]);
            continue;
        }
        let (sk, sv, sl) = match &c.shared {
            Some(s) => (be.p(&s.k), be.p(&s.v), s.len),
            None => (0, 0, 0),
        };
        let (kc, vc) = (c.k.as_ref().expect("reserved"), c.v.as_ref().expect("reserved"));
        meta.extend([
            seg.start as i64,
            seg.len() as i64,
            sk as i64,
            sv as i64,
            sl as i64,
            be.p(kc) as i64,
            be.p(vc) as i64,
            c.len as i64,
        ]);
    }
    let meta_host = meta;
    let meta = be.htod(&meta_host)?;
    let q = be.alloc_bf16(n * heads * hd)?;
    be.launch(
        "attn_prep",
        launch_config((n as u32, 1, 1), 128, 0),
        &[
            Arg::Ptr(qg_ptr),
            Arg::I64(row),
            Arg::I32((2 * hd) as i32),
            Arg::Ptr(k_ptr),
            Arg::I64(row),
            Arg::Ptr(v_ptr),
            Arg::I64(row),
            Arg::Ptr(be.p(qw.s())),
            Arg::Ptr(be.p(kw.s())),
            Arg::I32(1),
            Arg::F32(norm_eps),
            Arg::Ptr(be.p(cos.s())),
            Arg::Ptr(be.p(sin.s())),
            Arg::I32(rot as i32),
            Arg::Ptr(be.p(&meta)),
            Arg::I32(segments.len() as i32),
            Arg::Ptr(be.p(&q)),
            Arg::I32(heads as i32),
            Arg::I32(kvh as i32),
            Arg::I32(hd as i32),
        ],
    )?;
    for ((seg, c), parent) in segments.iter().zip(caches.iter_mut()).zip(&is_parent) {
        if !parent {
            c.len += seg.len();
        }
    }
    let out = be.alloc_bf16(n * heads * hd)?;
    // The gate of head h, dim c, row t is qkv[t, h·2·hd + hd + c] (offset hd elements).
    let gate = (qg_ptr + 2 * hd as u64, width, 2 * hd);
    if last_only {
        // [q_start, nq, .., own_len]: the last row, over every key before it and its own.
        let last_meta: Vec<i64> = meta_host
            .chunks_exact(8)
            .flat_map(|e| {
                let rows = e[1].min(1);
                [e[0] + e[1] - rows, rows, e[2], e[3], e[4], e[5], e[6], e[7] + e[1] - rows]
            })
            .collect();
        let last_segments: Vec<Range<usize>> =
            segments.iter().map(|s| s.end.saturating_sub(1).max(s.start)..s.end).collect();
        let last_dev = be.htod(&last_meta)?;
        be.attention_core(&q, &last_meta, &last_dev, &last_segments, heads, kvh, hd, true, Some(gate), &out)?;
    } else {
        be.attention_core(&q, &meta_host, &meta, segments, heads, kvh, hd, true, Some(gate), &out)?;
    }
    Ok(be.bf16_tensor(out, &[n, heads * hd]))
}

/// `Backend::vision_attention` (the trait documents the contract).
pub(super) fn vision_attention(
    be: &CudaBackend,
    qkv: &CudaTensor,
    cos: &CudaTensor,
    sin: &CudaTensor,
    heads: usize,
    segments: &[Range<usize>],
) -> Result<CudaTensor> {
    let (n, w) = qkv.rows_cols();
    ensure!(heads > 0 && w % (3 * heads) == 0, "vision qkv width {w} is not 3·heads·head_dim");
    let hd = w / (3 * heads);
    let d = heads * hd;
    ensure!(hd <= 256 && hd % 2 == 0, "vision head_dim {hd} not supported");
    ensure!(cos.rows_cols() == (n, hd) && sin.rows_cols() == (n, hd), "vision rotary shapes");
    check_tiling(segments, n)?;
    if n == 0 {
        return Ok(be.bf16_tensor(be.alloc_bf16(0)?, &[0, d]));
    }
    let x = be.bf16_of(qkv)?;
    let (cs, sn) = (be.f32_of(cos)?, be.f32_of(sin)?);
    let q = be.alloc_bf16(n * d)?;
    let kb = be.alloc_bf16(n * d)?;
    let vb = be.alloc_bf16(n * d)?;
    let mut meta = Vec::with_capacity(8 * segments.len());
    for s in segments {
        let off = 2 * (s.start * d) as u64;
        meta.extend([
            s.start as i64,
            s.len() as i64,
            0,
            0,
            0,
            (be.p(&kb) + off) as i64,
            (be.p(&vb) + off) as i64,
            0,
        ]);
    }
    let meta_host = meta;
    let meta = be.htod(&meta_host)?;
    let xp = be.p(x.s());
    let row = (3 * d) as i64;
    be.launch(
        "attn_prep",
        launch_config((n as u32, 1, 1), 128, 0),
        &[
            Arg::Ptr(xp),
            Arg::I64(row),
            Arg::I32(hd as i32),
            Arg::Ptr(xp + 2 * d as u64),
            Arg::I64(row),
            Arg::Ptr(xp + 4 * d as u64),
            Arg::I64(row),
            Arg::Ptr(0),
            Arg::Ptr(0),
            Arg::I32(0),
            Arg::F32(0.0),
            Arg::Ptr(be.p(cs.s())),
            Arg::Ptr(be.p(sn.s())),
            Arg::I32(hd as i32),
            Arg::Ptr(be.p(&meta)),
            Arg::I32(segments.len() as i32),
            Arg::Ptr(be.p(&q)),
            Arg::I32(heads as i32),
            Arg::I32(heads as i32),
            Arg::I32(hd as i32),
        ],
    )?;
    let out = be.alloc_bf16(n * d)?;
    be.attention_core(&q, &meta_host, &meta, segments, heads, heads, hd, false, None, &out)?;
    Ok(be.bf16_tensor(out, &[n, d]))
}

#[cfg(test)]
mod tests {
    use super::{ws_kv_tiles, AttentionKernel};
    use crate::backend::cuda::layout;

    /// The maps of attn_fwd_ws cover exactly the rows its tiles may read by TMA: a sequence's
    /// shared prefix (shared_len rows) and its own rows (cached + this call's), in the launch's
    /// table order, with the kernel's box; an empty range gets no map.
    #[test]
    fn ws_maps_cover_each_sequences_ranges_in_table_order() {
        let (kvh, hd) = (4, 256);
        let width = kvh * hd;
        let (bk, _) = layout::attention_ws_tiles(256, 2);
        // [q_start, nq, k_shared, v_shared, shared_len, k_own, v_own, own_len] per sequence:
        // 0 a prefix forward (no shared rows, nothing cached), 1 a fork of a 100-row prefix with
        // 7 cached own rows, 2 a short pass (not in the launch's subset).
        let meta: Vec<i64> = vec![
            0, 4097, 0, 0, 0, 0x10000, 0x90000, 0, //
            4097, 2500, 0x200000, 0x300000, 100, 0x400000, 0x500000, 7, //
            6597, 73, 0, 0, 0, 0x600000, 0x700000, 0,
        ];
        let segments = [0..4097, 4097..6597, 6597..6670];
        let tiles = ws_kv_tiles(&meta, &[1, 0], &segments, width, bk);
        assert_eq!(tiles.len(), 8, "four maps a sequence of the subset");
        let rows_addr = |i: usize| tiles[i].map(|t| (t.rows, t.addr));
        // Sequence 1 first (the subset's order): its prefix's 100 rows, then 7 + 2,500 own rows.
        assert_eq!(rows_addr(0), Some((100, 0x200000)));
        assert_eq!(rows_addr(1), Some((100, 0x300000)));
        assert_eq!(rows_addr(2), Some((2507, 0x400000)));
        assert_eq!(rows_addr(3), Some((2507, 0x500000)));
        // Sequence 0: no shared prefix, so no map for it; its 4,097 own rows.
        assert_eq!(rows_addr(4), None);
        assert_eq!(rows_addr(5), None);
        assert_eq!(rows_addr(6), Some((4097, 0x10000)));
        assert_eq!(rows_addr(7), Some((4097, 0x90000)));
        for t in tiles.iter().flatten() {
            assert_eq!((t.cols, t.row_stride, t.box_cols, t.box_rows), (width, width, 64, bk));
            assert!(t.swizzle_128b);
            t.check().unwrap();
        }
    }

    #[test]
    fn every_attention_kernel_has_one_name_and_the_error_lists_them_all() {
        for (name, kernel) in AttentionKernel::NAMED {
            assert_eq!(AttentionKernel::parse(name), Some(kernel), "{name}");
            assert_eq!(AttentionKernel::NAMED.iter().filter(|(_, k)| *k == kernel).count(), 1, "{kernel:?}");
        }
        assert_eq!(AttentionKernel::parse("wgmma-k64"), None);
        assert_eq!(
            AttentionKernel::expected(),
            "auto, ov, ws, ws3, wgmma, wgmma-k128, wgmma-grouped, wgmma-grouped3, wgmma-tsum, q128 or q64"
        );
    }
}
