//! The backend interface: tensors and the operations the Qwen3.5 prefill is written in.
//!
//! The model (`crate::engine`) is written once against [`Backend`]; `cpu` is the f32 reference
//! and the oracle for every accelerated kernel, `cuda` runs the same calls on an NVIDIA GPU and may
//! fuse behind them. The backend knows tensors, projections, norms, rotary tables, causal
//! attention over a cache and the gated delta rule over a recurrent state — it does not know
//! which layer of which model it is running.
//!
//! Activations are row-major 2-D `[rows, cols]` tensors. A *packed batch* holds the rows of several
//! sequences back to back; `segments` gives each sequence's row range, and the sequence mixers
//! take one cache or state per segment. A sequence may continue another one of the same batch
//! (`parents`): a shared prefix and its continuations run as one forward. The mixers take such
//! trees one level deep; [`tree`] runs two-level trees as two one-level calls.

pub mod cpu;
pub mod cuda;
pub mod tree;

use crate::weights::TensorRef;
use anyhow::Result;
use std::ops::Range;
use std::sync::Arc;

/// Memory of the device a backend runs on, in bytes: all of it, and what is in use (by any process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub used: u64,
    pub total: u64,
}

/// Reads the device's memory now; callable from any thread while the backend lives (it holds
/// what it needs, not the backend).
pub type MemoryProbe = Arc<dyn Fn() -> Result<DeviceMemory> + Send + Sync>;

/// One block of rows of a projection `y = x·Wᵀ + b + scale·(x·Aᵀ)·Bᵀ`.
#[derive(Clone, Copy)]
pub struct LinearPart<'a> {
    /// `[out, in]`.
    pub weight: TensorRef<'a>,
    /// `[out]`.
    pub bias: Option<TensorRef<'a>>,
    /// Unmerged LoRA adapter of this block.
    pub lora: Option<LoraPair<'a>>,
}

/// PEFT LoRA factors: `A` is `[r, in]`, `B` is `[out, r]`.
#[derive(Clone, Copy)]
pub struct LoraPair<'a> {
    pub a: TensorRef<'a>,
    pub b: TensorRef<'a>,
    pub scale: f32,
}

pub use crate::image::PatchGeometry;

/// One 8-bit RGB image for [`Backend::image_patches`]: HWC pixels and its per-channel
/// `u8 → f32` table.
#[derive(Debug, Clone, Copy)]
pub struct RgbImage<'a> {
    pub rgb: &'a [u8],
    pub width: usize,
    pub height: usize,
    pub lut: &'a [[f32; 256]; 3],
}

/// Rows of [`Backend::image_patches`] over `images`, after checking that each image's pixels fill
/// its size and that its sides are whole merge blocks of patches.
pub fn image_patch_rows(images: &[RgbImage<'_>], g: PatchGeometry) -> Result<usize> {
    let block = g.patch * g.merge;
    let mut rows = 0;
    for (i, im) in images.iter().enumerate() {
        anyhow::ensure!(
            im.rgb.len() == im.width * im.height * 3,
            "image {i}: {} bytes of pixels for {}×{} RGB",
            im.rgb.len(),
            im.width,
            im.height
        );
        anyhow::ensure!(
            block > 0 && im.width % block == 0 && im.height % block == 0 && im.width > 0,
            "image {i}: {}×{} is not a whole number of {block}-pixel merge blocks",
            im.width,
            im.height
        );
        rows += (im.width / g.patch) * (im.height / g.patch);
    }
    Ok(rows)
}

/// Which GELU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (`gelu_pytorch_tanh`).
    Tanh,
    /// `0.5·x·(1 + erf(x/√2))` (`nn.GELU()`).
    Erf,
}

/// Shapes of a gated softmax-attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionDims {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head that rotate (NeoX rotate-half over this many dims).
    pub rotary_dim: usize,
    /// eps of the zero-centred q/k RMSNorms.
    pub norm_eps: f32,
}

impl AttentionDims {
    /// Width of the fused input projection `[query/gate | key | value]` ([`AttentionInputs::qkv`]).
    pub fn qkv_width(&self) -> usize {
        self.heads * 2 * self.head_dim + 2 * self.kv_heads * self.head_dim
    }
}

/// Shapes of a Gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeltaNetDims {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    /// eps of the gated output RMSNorm.
    pub norm_eps: f32,
}

impl DeltaNetDims {
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
    /// Width of the fused input projection `[q | k | v | z | b | a]` ([`DeltaNetInputs::proj`]).
    pub fn proj_width(&self) -> usize {
        self.conv_channels() + self.value_heads * self.value_dim + 2 * self.value_heads
    }
}

/// Everything a gated-attention mixer needs besides its cache.
pub struct AttentionInputs<'t, T> {
    /// The fused input projection, `[n, heads·2·head_dim + 2·kv_heads·head_dim]`, laid out
    /// `[query/gate | key | value]`: first per head `[query | gate]` (`heads·2·head_dim` columns),
    /// then the keys and the values (`kv_heads·head_dim` columns each). Backends read the blocks
    /// in place (no split copies).
    pub qkv: &'t T,
    /// `[head_dim]` zero-centred norm weights.
    pub q_norm: &'t T,
    pub k_norm: &'t T,
    /// `[n, rotary_dim]` each.
    pub cos: &'t T,
    pub sin: &'t T,
}

/// Everything a Gated DeltaNet mixer needs besides its state.
pub struct DeltaNetInputs<'t, T> {
    /// The fused input projection, `[n, conv_channels + value_heads·value_dim + 2·value_heads]`,
    /// laid out `[q | k | v | z | b | a]`: the conv inputs `q | k | v` (`conv_channels` columns,
    /// before the causal convolution), the output-gate input `z` (`value_heads·value_dim`), then
    /// the β logits `b` and the decay inputs `a` (`value_heads` each). Backends read the blocks in
    /// place (no split copies).
    pub proj: &'t T,
    /// `[conv_channels, conv_kernel]` depthwise taps, tap `kernel−1` on the current token.
    pub conv_weight: &'t T,
    /// `[value_heads]`.
    pub a_log: &'t T,
    pub dt_bias: &'t T,
    /// `[value_dim]` gated-norm weight (not zero-centred).
    pub norm_weight: &'t T,
}

/// A packed batch's tree as [`check_parents`] returns it: per segment, its parent (if it
/// continues one) and whether it is some segment's parent.
pub struct Tree {
    pub parent: Vec<Option<usize>>,
    pub is_parent: Vec<bool>,
}

/// Checks a packed batch's tree: `parents` is empty (independent sequences) or has one entry per
/// segment, and a segment's parent comes before it and has no parent itself (one level: a shared
/// prefix and the sequences that continue it, in one forward).
pub fn check_parents(parents: &[Option<usize>], segments: usize) -> Result<Tree> {
    let mut tree = Tree { parent: vec![None; segments], is_parent: vec![false; segments] };
    if parents.is_empty() {
        return Ok(tree);
    }
    anyhow::ensure!(parents.len() == segments, "{} parents for {segments} segments", parents.len());
    for (j, p) in parents.iter().enumerate() {
        if let Some(i) = *p {
            anyhow::ensure!(i < j, "segment {j}'s parent {i} does not come before it");
            anyhow::ensure!(
                parents[i].is_none(),
                "segment {j}'s parent {i} has a parent itself (one level only)"
            );
            tree.is_parent[i] = true;
        }
    }
    tree.parent.copy_from_slice(parents);
    Ok(tree)
}

/// Which segments' final mixer states a call must leave usable: `keep` as the caller gave it
/// (empty: all), and every parent of the call whatever it says (its children read it).
pub fn kept_states(keep: &[bool], tree: &Tree) -> Result<Vec<bool>> {
    let n = tree.parent.len();
    if keep.is_empty() {
        return Ok(vec![true; n]);
    }
    anyhow::ensure!(keep.len() == n, "{} keep flags for {n} segments", keep.len());
    Ok(keep.iter().zip(&tree.is_parent).map(|(&k, &p)| k || p).collect())
}

/// Checks that `segments` tile the `n` rows of a packed batch in order.
pub fn check_tiling(segments: &[Range<usize>], n: usize) -> Result<()> {
    let mut at = 0;
    for s in segments {
        anyhow::ensure!(
            s.start == at && s.end >= s.start,
            "segments must tile the batch rows in order; got {segments:?} for {n} rows"
        );
        at = s.end;
    }
    anyhow::ensure!(at == n, "segments {segments:?} do not cover the {n} batch rows");
    Ok(())
}

/// The operations of a Qwen3.5 prefill.
pub trait Backend: Send + Sync + 'static {
    /// A dense activation or parameter tensor.
    type Tensor: Send + Sync;
    /// A projection (one or more row blocks, each with optional bias and LoRA).
    type Linear: Send + Sync;
    /// Keys and values of one attention layer for one sequence.
    type KvCache: Clone + Send + Sync;
    /// Conv history and recurrent state of one DeltaNet layer for one sequence.
    type DeltaState: Clone + Send + Sync;
    /// Readout logits on their way to the host ([`Backend::readout_start`]).
    type Readout: 'static;
    /// A point in the queue of device work ([`Backend::marker`]).
    type Marker: 'static;

    /// A one-line description for logs and `/v1/models`.
    fn describe(&self) -> String;

    /// The backend's short name (`cpu`, `cuda`): the `backend` label of `imajev_build_info`.
    fn kind(&self) -> &'static str;

    /// A reader of the device's memory, for backends that run on one (None: host memory only).
    fn memory_probe(&self) -> Option<MemoryProbe> {
        None
    }

    /// Waits until queued device work has finished (for stage timings; a no-op on the CPU).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Whether ops return before the device has run them (queued work, read back later). The
    /// worker then prepares and queues the next round while one runs; on a backend whose ops
    /// finish when they return (the CPU) that would only hold the finished round's answers back.
    fn queues_work(&self) -> bool {
        false
    }

    /// Marks the work queued so far, to wait for later ([`Backend::wait_marker`]).
    fn marker(&self) -> Result<Self::Marker>;
    /// Waits until the work queued before `marker` has run.
    fn wait_marker(&self, marker: &Self::Marker) -> Result<()>;

    /// Keeps the host at most one step ahead of the device in a loop of long steps (the vision
    /// blocks): waits until the work queued before the previous call has run, then marks the work
    /// queued so far. A stop condition asked right after it is then at most a step behind the
    /// device — without it the host queues every step in milliseconds and a check between steps
    /// asks long before the device gets there — while the device always has the next step queued.
    /// A no-op on the CPU, whose ops have finished when they return.
    fn pace(&self) -> Result<()> {
        Ok(())
    }

    /// Per-kernel device timings since the previous call, when the backend records them
    /// (`IMAJEV_PROFILE=kernels` on CUDA).
    fn kernel_report(&self) -> Result<Option<String>> {
        Ok(None)
    }

    /// A parameter tensor (norm weights, conv taps, embeddings, ...), kept in the backend's
    /// parameter precision.
    fn param(&self, t: &TensorRef) -> Result<Self::Tensor>;
    /// A parameter that must stay f32 (the readout head).
    fn param_f32(&self, t: &TensorRef) -> Result<Self::Tensor>;
    /// A projection from its row blocks, concatenated along the output dim in order.
    fn linear(&self, parts: &[LinearPart]) -> Result<Self::Linear>;
    /// Output width of a projection.
    fn linear_out(&self, w: &Self::Linear) -> usize;
    /// Bytes a tensor holds (host or device), in the precision it is kept in.
    fn tensor_bytes(&self, t: &Self::Tensor) -> usize;
    /// Bytes a projection holds: its weights as kept (FP8 codes and scales, BF16 or f32), bias
    /// and LoRA factors.
    fn linear_bytes(&self, w: &Self::Linear) -> usize;

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    fn shape<'t>(&self, t: &'t Self::Tensor) -> &'t [usize];
    /// Same data, new row-major shape with the same element count.
    fn reshape(&self, t: Self::Tensor, shape: &[usize]) -> Result<Self::Tensor>;

    /// Rows of image patches cut from 8-bit RGB images, each value looked up in its image's
    /// per-channel table: `[Σ rows, g.row_len()]`, the images one after another, each in the
    /// merge order of [`crate::image::patchify`]. The default cuts them on the host and uploads
    /// the f32 rows; a device backend uploads the pixels (an eighth of the bytes at
    /// `row_len` 1536) and cuts them there.
    fn image_patches(&self, images: &[RgbImage<'_>], g: PatchGeometry) -> Result<Self::Tensor> {
        let rows = image_patch_rows(images, g)?;
        let d = g.row_len();
        let mut v = vec![0f32; rows * d];
        let mut at = 0;
        for im in images {
            let n = (im.height / g.patch) * (im.width / g.patch) * d;
            crate::image::patchify(im.rgb, im.width, im.lut, g, &mut v[at..at + n]);
            at += n;
        }
        self.upload(&v, &[rows, d])
    }
    /// `table[ids]` → `[ids.len(), d]`.
    fn embed(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;
    /// Weighted sum of `taps` rows per output row: `out[r] = Σ_j w[r·taps+j]·table[idx[r·taps+j]]`.
    fn embed_bag(&self, table: &Self::Tensor, idx: &[u32], w: &[f32], taps: usize) -> Result<Self::Tensor>;
    /// `dst[rows[i]] = src[i]`.
    fn scatter_rows(&self, dst: &mut Self::Tensor, rows: &[usize], src: &Self::Tensor) -> Result<()>;
    /// `x[rows]`.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
    /// Splits columns into consecutive blocks of the given widths.
    fn split_cols(&self, x: &Self::Tensor, widths: &[usize]) -> Result<Vec<Self::Tensor>>;
    /// Concatenates tensors with equal column counts along rows.
    fn concat_rows(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor>;

    fn matmul(&self, x: &Self::Tensor, w: &Self::Linear) -> Result<Self::Tensor>;
    /// RMSNorm over rows of length `w.len()`: `x̂ · (offset + w)` (offset 1 = zero-centred).
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32, offset: f32) -> Result<Self::Tensor>;
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        b: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor>;
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// The residual add and the next RMSNorm: `x += y` (exactly `add_assign`), then returns
    /// `rms_norm(x, w, eps, offset)` of the updated `x`. Backends may fuse the two (CUDA: one
    /// kernel that normalises the BF16-rounded sum it stores).
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
        offset: f32,
    ) -> Result<Self::Tensor> {
        self.add_assign(x, y)?;
        self.rms_norm(x, w, eps, offset)
    }
    /// The residual add and the next LayerNorm (the vision blocks): `x += y` (exactly
    /// `add_assign`), then returns `layer_norm(x, w, b, eps)` of the updated `x`. Backends may
    /// fuse the two (CUDA: one kernel that normalises the BF16-rounded sum it stores).
    fn add_layer_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Tensor,
        b: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.add_assign(x, y)?;
        self.layer_norm(x, w, b, eps)
    }
    /// `[n, 2m]` → `silu(x[:, :m]) · x[:, m:]`.
    fn swiglu(&self, gate_up: &Self::Tensor) -> Result<Self::Tensor>;
    /// `matmul(swiglu(gate_up), w)` (the MLP's down projection). Backends may fuse the SwiGLU
    /// with the activation quantisation of an FP8 projection.
    fn swiglu_matmul(&self, gate_up: &Self::Tensor, w: &Self::Linear) -> Result<Self::Tensor> {
        self.matmul(&self.swiglu(gate_up)?, w)
    }
    /// The MLP: `swiglu_matmul(matmul(x, gate_up), down)`. Backends may fuse the gate/up
    /// projection's LoRA B side into the SwiGLU (its output is then read once).
    fn swiglu_mlp(
        &self,
        x: &Self::Tensor,
        gate_up: &Self::Linear,
        down: &Self::Linear,
    ) -> Result<Self::Tensor> {
        self.swiglu_matmul(&self.matmul(x, gate_up)?, down)
    }
    fn gelu(&self, x: &mut Self::Tensor, kind: Gelu) -> Result<()>;
    /// `gelu(x)` in place, then `matmul(x, w)` (the vision MLPs' second projection). Backends may
    /// fuse the GELU with the activation quantisation of an FP8 projection.
    fn gelu_matmul(&self, x: &mut Self::Tensor, kind: Gelu, w: &Self::Linear) -> Result<Self::Tensor> {
        self.gelu(x, kind)?;
        self.matmul(x, w)
    }
    /// `h · Wᵀ` in f32 for an f32 `[rows, d]` weight; returns `[n, rows]` on the host.
    fn readout(&self, h: &Self::Tensor, w: &Self::Tensor) -> Result<Vec<f32>> {
        let pending = self.readout_start(h, w)?;
        self.readout_finish(pending)
    }
    /// [`Backend::readout`] queued: the product and its copy to the host, collected by
    /// [`Backend::readout_finish`] (which waits for them), so that the host can queue more work
    /// in between. `h`, `w` and every other tensor may be dropped in the meantime.
    fn readout_start(&self, h: &Self::Tensor, w: &Self::Tensor) -> Result<Self::Readout>;
    /// The logits of a [`Backend::readout_start`], `[n, rows]`, once they are on the host.
    fn readout_finish(&self, pending: Self::Readout) -> Result<Vec<f32>>;

    fn new_kv_cache(&self, dims: &AttentionDims) -> Result<Self::KvCache>;
    fn kv_len(&self, cache: &Self::KvCache) -> usize;
    /// Makes the cache's current rows immutable and shared, so that clones (forks) reference them
    /// instead of copying them; later appends stay private to each clone. The default keeps
    /// deep copies, which is correct but costs memory per fork.
    fn share_kv(&self, _cache: &mut Self::KvCache) -> Result<()> {
        Ok(())
    }
    /// q/k norm, rotary, append k/v to each segment's cache, causal GQA attention over the cache,
    /// times `sigmoid(gate)`. Returns `[n, heads·head_dim]`. `parents` is empty or has one entry
    /// per segment (see [`check_parents`]): a segment with a parent starts from a fork of the
    /// parent's cache as it stands after the parent's rows of this call (its own cache is
    /// replaced). A parent's cache must not be a fork of a shared cache.
    fn gated_attention(
        &self,
        x: &AttentionInputs<Self::Tensor>,
        dims: &AttentionDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        caches: &mut [&mut Self::KvCache],
    ) -> Result<Self::Tensor>;

    /// [`Backend::gated_attention`] when only the last row of each segment is read (the model's
    /// last layer): every row's keys and values still enter the caches, but only the last row of
    /// each segment is attended and returned, `[segments, heads·head_dim]`. The default attends
    /// every row and gathers; backends may skip the rest.
    fn gated_attention_last_rows(
        &self,
        x: &AttentionInputs<Self::Tensor>,
        dims: &AttentionDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        caches: &mut [&mut Self::KvCache],
    ) -> Result<Self::Tensor> {
        let all = self.gated_attention(x, dims, segments, parents, caches)?;
        let last: Vec<usize> = segments.iter().map(|s| s.end.saturating_sub(1)).collect();
        self.gather_rows(&all, &last)
    }

    fn new_delta_state(&self, dims: &DeltaNetDims) -> Result<Self::DeltaState>;
    /// Causal conv + SiLU (continuing each segment's conv history), β/g gates, L2-normed q/k,
    /// the gated delta rule from each segment's recurrent state, and the gated RMSNorm with `z`.
    /// Returns `[n, value_heads·value_dim]` and leaves the final states in `states`. `parents` as
    /// in [`Backend::gated_attention`]: a segment with a parent continues from the parent's state
    /// after the parent's rows of this call.
    ///
    /// `keep` is empty (every final state is kept) or has one entry per segment: a segment whose
    /// entry is false and that no segment of the call continues has no use for its final state
    /// (a question pass that is only read out), so the backend need not compute or store it —
    /// no state update after its last chunk, no history or state written, no fresh buffers for
    /// it — and its state is left unusable (what it holds is unspecified; the engine marks it
    /// spent). Its output rows are the same bits either way.
    fn gated_delta_net(
        &self,
        x: &DeltaNetInputs<Self::Tensor>,
        dims: &DeltaNetDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        states: &mut [&mut Self::DeltaState],
        keep: &[bool],
    ) -> Result<Self::Tensor>;

    /// Bidirectional attention within each segment for the vision tower: `qkv` is
    /// `[n, 3·heads·head_dim]` (`[q | k | v]`), rotary over the whole head with `[n, head_dim]`
    /// tables applied in f32. Returns `[n, heads·head_dim]`.
    fn vision_attention(
        &self,
        qkv: &Self::Tensor,
        cos: &Self::Tensor,
        sin: &Self::Tensor,
        heads: usize,
        segments: &[Range<usize>],
    ) -> Result<Self::Tensor>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_states_are_the_callers_choice_and_every_parent() {
        let tree = check_parents(&[None, Some(0), Some(0), None], 4).unwrap();
        assert_eq!(kept_states(&[], &tree).unwrap(), vec![true; 4], "empty: all kept");
        assert_eq!(
            kept_states(&[false; 4], &tree).unwrap(),
            vec![true, false, false, false],
            "a parent is kept"
        );
        assert_eq!(kept_states(&[false, true, false, true], &tree).unwrap(), vec![true, true, false, true]);
        let e = kept_states(&[false; 3], &tree).unwrap_err().to_string();
        assert!(e.contains("3 keep flags for 4 segments"), "{e}");
    }
}
