//! The CUDA backend: the same [`Backend`] calls as the CPU reference, on an NVIDIA GPU.
//!
//! * Kernels are the `.cu` files of `kernels/` (each names its CPU twin), compiled by NVRTC for
//!   the running GPU at start-up and cached on disk as CUBIN ([`compile`]).
//! * GEMMs go through cuBLASLt ([`gemm`]): block-scaled FP8 for projections stored as FP8 (or
//!   quantised at load with `quantize_fp8`), BF16 for the rest; LoRA stays unmerged in BF16.
//! * Precision follows a bf16 transformers run: activations are BF16 tensors, reductions, norms,
//!   softmax and gates run in f32, the DeltaNet state and chunked delta rule are f32, the readout
//!   is an f32 GEMM. Vectors (norm weights, biases, `A_log`, `dt_bias`) are kept in f32, other
//!   parameters in BF16.
//! * Fusions behind the same [`Backend`] calls (each kernel's CPU twin is the unfused ops composed):
//!   residual add + RMSNorm (`add_rms_norm`); SwiGLU + the FP8 activation quantisation of the down
//!   projection (`swiglu_quant_1x128`); and the row norms feeding FP8 projections (`rms_norm`,
//!   `add_rms_norm`, the DeltaNet `rms_norm_gated` with 128-wide heads) write the 1×128 FP8
//!   quantisation of their output beside it (`*_quant` kernels, bit-identical to
//!   `quant_act_1x128` on that output). That quantisation travels with the tensor
//!   ([`CudaTensor`]'s attachment, dropped by any in-place change), and `matmul` uses it instead
//!   of launching `quant_act_1x128`; norms attach it once an FP8 projection has been loaded.
//! * One stream; cudarc's per-buffer event tracking is off (everything is stream-ordered, buffers
//!   are freed with `cuMemFreeAsync` on that stream), so kernels take raw device addresses.
//!
//! The crate always compiles this module (cudarc loads libcuda, NVRTC and cuBLASLt with `dlopen`
//! at first use), and [`CudaBackend::new`] returns an error instead of panicking on machines
//! without a GPU, driver or library.

pub mod compile;
pub mod gemm;
pub mod host;
pub mod kprof;

use super::{
    AttentionDims, AttentionInputs, Backend, DeltaNetDims, DeltaNetInputs, Gelu, LinearPart,
};
use crate::weights::{fp8, StoredDtype, TensorRef};
use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use gemm::{Blas, Gemm, GemmKind};
use half::bf16;
use host::{PartFormat, PartInfo};
use rayon::prelude::*;
use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// How the CUDA backend places weights and where it caches kernels.
#[derive(Debug, Clone, Default)]
pub struct CudaOptions {
    /// Quantise BF16/F32 projections whose dims are multiples of 128 to block FP8 at load (the
    /// RTN 128×128 recipe of `synth::quantize_fp8_blocks`). FP8 checkpoint weights are FP8 anyway.
    pub quantize_fp8: bool,
    /// Dequantise block-FP8 checkpoint projections to BF16 at load (BF16 GEMMs, no FP8 rounding
    /// of activations; twice the weight memory). Wins over `quantize_fp8`.
    pub dequantize_fp8: bool,
    /// Run the gated-delta chunk scan on CUDA cores (f32 FMA) instead of tensor cores (3xTF32).
    /// Default: `IMAJEV_GDN_FFMA=1` in the environment.
    pub gdn_ffma: bool,
    /// Quantise the inputs of FP8 projections in their own kernel (`quant_act_1x128`) also when
    /// they come from a row norm, instead of the fused `*_quant` norms: the reference the fused
    /// path is tested against (same bits), and a switch for profiling. Default:
    /// `IMAJEV_UNFUSED_ACT_QUANT=1` in the environment.
    pub unfused_act_quant: bool,
    /// Kernel cache folder; default `$IMAJEV_KERNEL_CACHE`, `$XDG_CACHE_HOME/imajev-serve/kernels`
    /// or `~/.cache/imajev-serve/kernels`.
    pub kernel_cache_dir: Option<PathBuf>,
}

/// What the backend runs on.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub driver_version: i32,
    pub nvrtc_version: (i32, i32),
    pub cublaslt_version: usize,
    pub arch: String,
    pub kernels_cached: usize,
    pub kernels_compiled: usize,
    pub kernel_seconds: f64,
}

/// The CUDA backend (cheap to clone: clones share the context, stream, kernels and GEMM plans).
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

struct Inner {
    // Field order is drop order: GEMM plans, kernels and staging before the stream and context.
    blas: Blas,
    funcs: HashMap<&'static str, CudaFunction>,
    staging: std::sync::Mutex<Staging>,
    stream: Arc<CudaStream>,
    #[allow(dead_code)]
    ctx: Arc<CudaContext>,
    options: CudaOptions,
    info: DeviceInfo,
    kprof: Option<kprof::KernelProfiler>,
    /// Set once a projection with an FP8 group exists: from then on the row norms write the FP8
    /// quantisation of their output for the projection that reads it (before, it would be unused).
    /// A hint only: results are the same bits with or without it.
    fp8_linears: AtomicBool,
}

/// Pinned staging ring for host→device copies of small tables (token ids, row lists, segment
/// tables): a copy from pageable memory synchronises the stream, one from pinned memory does not,
/// so these keep the GPU queue full. When the ring wraps, the stream is synchronised once before
/// its bytes are reused.
struct Staging {
    ptr: *mut u8,
    size: usize,
    cursor: usize,
    stream: Arc<CudaStream>,
}

const STAGING_BYTES: usize = 8 << 20;

// SAFETY: the pinned buffer is only touched under the Mutex in `Inner`.
unsafe impl Send for Staging {}

impl Staging {
    fn new(stream: Arc<CudaStream>) -> Result<Self> {
        stream.context().bind_to_thread()?;
        let ptr = unsafe { cudarc::driver::result::malloc_host(STAGING_BYTES, 0) }? as *mut u8;
        Ok(Staging {
            ptr,
            size: STAGING_BYTES,
            cursor: 0,
            stream,
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

enum Buf {
    Bf16(CudaSlice<bf16>),
    F32(CudaSlice<f32>),
}

/// A dense row-major tensor in GPU memory, BF16 (activations, matrices) or F32 (uploads,
/// vectors, the readout head). The buffer may be longer than the shape (padded GEMM rows).
pub struct CudaTensor {
    buf: Buf,
    shape: Vec<usize>,
    /// The per-token 1×128 FP8 quantisation of this tensor's own contents (`[rows, cols]`), when
    /// the kernel that wrote them also wrote it (the `*_quant` row norms): bit for bit what
    /// `quantize` would make, so an FP8 projection of this tensor skips `quant_act_1x128`. Every
    /// op that changes a tensor in place drops it (`bf16_for_update`), and only the op that
    /// creates a tensor attaches one, so it is never stale.
    fp8: Option<ActFp8>,
}

/// FP8 activations of `m` rows of width `k`: E4M3 codes `[mpad, k]`, scales `[k/128][mpad]`
/// (`mpad = fp8::fp8_rows(m)`, rows `m..mpad` zero with scale 1); the layout of `quant_act_1x128`.
struct ActFp8 {
    q: CudaSlice<u8>,
    s: CudaSlice<f32>,
    mpad: usize,
}

impl CudaTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// `(rows, cols)` viewing the last dim as columns.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = *self.shape.last().unwrap_or(&1);
        (self.numel().checked_div(cols).unwrap_or(0), cols)
    }
    pub fn is_bf16(&self) -> bool {
        matches!(self.buf, Buf::Bf16(_))
    }
    /// Whether the tensor carries the FP8 quantisation of its contents that a fused kernel wrote
    /// (for tests; `CudaBackend::quantize_activations` returns it).
    pub fn has_fp8_activations(&self) -> bool {
        self.fp8.is_some()
    }
}

enum GroupWeight {
    Bf16(CudaSlice<bf16>),
    Fp8 {
        w: CudaSlice<u8>,
        scales: CudaSlice<f32>,
    },
}

struct LinearGroup {
    cols: Range<usize>,
    weight: GroupWeight,
}

/// The LoRA pairs of a projection's parts, fused into one pair: `a` stacks every part's A
/// (`[Σr, in]`), `b` is block-diagonal over the output columns `cols` (`[cols, Σr]`, part i's B
/// in its own rows and rank columns, exact zeros elsewhere), so two GEMMs serve all parts. Zeros
/// add nothing to the f32 sums, so each column's result is the unfused one.
struct CudaLora {
    cols: Range<usize>,
    rank: usize,
    parts: usize,
    a: CudaSlice<bf16>,
    b: CudaSlice<bf16>,
    scale: f32,
}

/// A projection: its parts concatenated along the output dim and grouped into one FP8 or BF16
/// GEMM per run of equal format; bias in f32; LoRA pairs unmerged in BF16.
pub struct CudaLinear {
    in_dim: usize,
    out_dim: usize,
    groups: Vec<LinearGroup>,
    bias: Option<CudaSlice<f32>>,
    loras: Vec<CudaLora>,
}

impl CudaLinear {
    /// E.g. `fp8[0..12288] bf16[12288..12352] lora×2`.
    pub fn summary(&self) -> String {
        let mut s: Vec<String> = self
            .groups
            .iter()
            .map(|g| {
                let f = match g.weight {
                    GroupWeight::Bf16(_) => "bf16",
                    GroupWeight::Fp8 { .. } => "fp8",
                };
                format!("{f}[{}..{}]", g.cols.start, g.cols.end)
            })
            .collect();
        if !self.loras.is_empty() {
            s.push(format!("lora×{}", self.loras.iter().map(|l| l.parts).sum::<usize>()));
        }
        s.join(" ")
    }
    pub fn has_fp8(&self) -> bool {
        self.groups
            .iter()
            .any(|g| matches!(g.weight, GroupWeight::Fp8 { .. }))
    }
}

/// Keys and values of one attention layer of one sequence: an optional immutable shared prefix
/// (made by `share_kv`, referenced by every fork), then the sequence's own rows
/// `[capacity, kv_heads·head_dim]` BF16, grown geometrically. `clone()` shares the prefix and
/// deep-copies the own rows on the GPU.
pub struct CudaKvCache {
    shared: Option<Arc<SharedKv>>,
    k: Option<CudaSlice<bf16>>,
    v: Option<CudaSlice<bf16>>,
    width: usize,
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

/// A kernel argument.
enum A {
    P(u64),
    L(i64),
    I(i32),
    F(f32),
}

/// Threads per row of the row-norm kernels (`rms_norm`, `add_rms_norm` share it, so they reduce in
/// the same order and give the same bits).
fn norm_block(d: usize) -> u32 {
    d.div_ceil(32).clamp(1, 8) as u32 * 32
}

fn grid1(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).clamp(1, 1 << 20) as u32
}

fn cfg(grid: (u32, u32, u32), block: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// A BF16 view of a tensor: borrowed when it already is BF16, converted otherwise.
enum Bf16View<'a> {
    Ref(&'a CudaSlice<bf16>),
    Own(CudaSlice<bf16>),
}
impl Bf16View<'_> {
    fn s(&self) -> &CudaSlice<bf16> {
        match self {
            Bf16View::Ref(s) => s,
            Bf16View::Own(s) => s,
        }
    }
}
enum F32View<'a> {
    Ref(&'a CudaSlice<f32>),
    Own(CudaSlice<f32>),
}
impl F32View<'_> {
    fn s(&self) -> &CudaSlice<f32> {
        match self {
            F32View::Ref(s) => s,
            F32View::Own(s) => s,
        }
    }
}

fn check_2d(t: &TensorRef) -> Result<(usize, usize)> {
    match t.shape {
        [r, c] => Ok((*r, *c)),
        s => bail!("{} must be 2-D, has shape {s:?}", t.name),
    }
}

fn bf16_values(t: &TensorRef) -> Result<Vec<bf16>> {
    if t.dtype == StoredDtype::BF16 {
        ensure!(
            t.bytes.len() == 2 * t.numel(),
            "tensor {} has {} bytes for {} BF16 values",
            t.name,
            t.bytes.len(),
            t.numel()
        );
        return Ok(t
            .bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect());
    }
    Ok(t.to_f32()?.into_par_iter().map(bf16::from_f32).collect())
}

/// FP8 bytes + `[out/128][in/128]` multipliers of one part: the checkpoint's own when they are
/// 128×128 blocks, else the RTN recipe applied to its values (in 128-row stripes, in parallel;
/// blocks are independent so this equals `quantize_fp8_blocks` on the whole matrix).
fn fp8_part(t: &TensorRef) -> Result<(Vec<u8>, Vec<f32>)> {
    let (o, i) = check_2d(t)?;
    if t.dtype == StoredDtype::F8E4M3 && scales_are_128(t) {
        let s = t.scale_inv.expect("checked");
        let scales = s
            .bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        return Ok((t.bytes.to_vec(), scales));
    }
    let w = t.to_f32()?;
    let stripes: Vec<(Vec<u8>, Vec<f32>)> = w
        .par_chunks(128 * i)
        .map(|s| crate::weights::fp8::quantize_fp8_blocks(s, s.len() / i, i))
        .collect();
    let mut q = Vec::with_capacity(o * i);
    let mut sc = Vec::with_capacity(o / 128 * (i / 128));
    for (a, b) in stripes {
        q.extend(a);
        sc.extend(b);
    }
    Ok((q, sc))
}

fn scales_are_128(t: &TensorRef) -> bool {
    match (t.scale_inv, t.shape) {
        (Some(s), [o, i]) => {
            s.shape == [o / 128, i / 128]
                && o % 128 == 0
                && i % 128 == 0
                && s.block.is_none_or(|b| b == [128, 128])
        }
        _ => false,
    }
}

fn check_tiling(segments: &[Range<usize>], n: usize) -> Result<()> {
    let mut at = 0;
    for s in segments {
        ensure!(
            s.start == at && s.end >= s.start,
            "segments must tile the batch rows in order; got {segments:?} for {n} rows"
        );
        at = s.end;
    }
    ensure!(
        at == n,
        "segments {segments:?} do not cover the {n} batch rows"
    );
    Ok(())
}

const KERNELS: &[(&str, &[&str])] = &[
    (
        "elementwise",
        &[
            "cast_f32_bf16",
            "cast_bf16_f32",
            "gather_rows",
            "scatter_rows",
            "copy_cols",
            "embed_bag",
            "add_bf16",
            "add_bias",
            "swiglu",
            "gelu",
            "readout_f32",
        ],
    ),
    (
        "norm",
        &[
            "rms_norm",
            "rms_norm_quant",
            "add_rms_norm",
            "add_rms_norm_quant",
            "layer_norm",
            "rms_norm_gated",
            "rms_norm_gated_quant",
        ],
    ),
    ("quant", &["quant_act_1x128", "swiglu_quant_1x128"]),
    (
        "attention",
        &[
            "attn_prep",
            "attn_fwd_16",
            "attn_fwd_32",
            "attn_fwd_64",
            "attn_fwd_128",
            "attn_fwd_256",
        ],
    ),
    (
        "deltanet",
        &[
            "gdn_conv",
            "gdn_conv_hist",
            "gdn_chunk_prep_16",
            "gdn_chunk_prep_32",
            "gdn_chunk_prep_64",
            "gdn_chunk_prep_128",
            "gdn_chunk_scan_16",
            "gdn_chunk_scan_32",
            "gdn_chunk_scan_64",
            "gdn_chunk_scan_128",
            "gdn_chunk_scan_tc_16",
            "gdn_chunk_scan_tc_32",
            "gdn_chunk_scan_tc_64",
            "gdn_chunk_scan_tc_128",
        ],
    ),
];

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles (or loads cached) kernels and creates the cuBLASLt handle.
    /// Returns an error, never panics, when the driver, a library or the GPU is missing.
    pub fn new(ordinal: usize, options: CudaOptions) -> Result<Self> {
        let mut options = options;
        if std::env::var("IMAJEV_GDN_FFMA").is_ok_and(|v| v == "1") {
            options.gdn_ffma = true;
        }
        if std::env::var("IMAJEV_UNFUSED_ACT_QUANT").is_ok_and(|v| v == "1") {
            options.unfused_act_quant = true;
        }
        // cudarc panics on first use of a library it cannot dlopen; look before touching it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            bail!("no NVIDIA driver found (libcuda.so could not be loaded): install the NVIDIA driver, or use the CPU backend");
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            bail!("NVRTC (libnvrtc.so) not found: install the CUDA toolkit's NVRTC (e.g. cuda-nvrtc-13-0) or put its lib directory on LD_LIBRARY_PATH");
        }
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            bail!("cuBLASLt (libcublasLt.so) not found: install the CUDA toolkit's cuBLAS (e.g. libcublas-13-0) or put its lib directory on LD_LIBRARY_PATH");
        }
        let count = CudaContext::device_count()
            .map_err(|e| anyhow!("no CUDA device: cuInit/cuDeviceGetCount failed ({e:?})"))?;
        ensure!(count > 0, "no CUDA device: the driver reports 0 GPUs");
        ensure!(
            ordinal < count as usize,
            "CUDA device {ordinal} does not exist ({count} present)"
        );
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| anyhow!("creating a CUDA context on device {ordinal}: {e:?}"))?;
        // SAFETY: called before any buffer exists; all work goes to the one stream below, so
        // stream order alone keeps reads, writes and frees in order.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        if ctx.has_async_alloc() {
            // Keep freed blocks in the pool instead of returning them at every synchronisation.
            unsafe {
                let pool = cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device())?;
                let mut threshold = u64::MAX;
                cudarc::driver::result::mem_pool::set_attribute(
                    pool,
                    cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut threshold as *mut u64 as *mut std::ffi::c_void,
                )?;
            }
        }
        let cc = ctx.compute_capability()?;
        ensure!(cc.0 >= 8, "GPU compute capability {}.{} is too old: the kernels need bf16 mma.sync (sm_80 or newer)", cc.0, cc.1);
        let mut driver = 0i32;
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }.result()?;
        let name = ctx.name()?;
        let nvrtc = compile::nvrtc_version()?;
        let arch = host::gpu_arch(cc.0, cc.1);
        let started = std::time::Instant::now();
        let (funcs, cached, compiled) = load_kernels(
            &ctx,
            &options,
            &arch,
            &format!("{name}|{}.{}|{driver}|{}.{}", cc.0, cc.1, nvrtc.0, nvrtc.1),
        )?;
        let kernel_seconds = started.elapsed().as_secs_f64();
        let blas = Blas::new(stream.clone())?;
        let staging = std::sync::Mutex::new(Staging::new(stream.clone())?);
        let info = DeviceInfo {
            ordinal,
            name,
            compute_capability: cc,
            driver_version: driver,
            nvrtc_version: nvrtc,
            cublaslt_version: Blas::version(),
            arch,
            kernels_cached: cached,
            kernels_compiled: compiled,
            kernel_seconds,
        };
        tracing::info!(
            ?info,
            gdn_scan = if options.gdn_ffma { "ffma" } else { "tensor cores (3xTF32)" },
            act_quant = if options.unfused_act_quant { "own kernel" } else { "fused into the row norms" },
            "CUDA backend ready"
        );
        let kprof = kprof::KernelProfiler::from_env(&stream);
        Ok(CudaBackend {
            inner: Arc::new(Inner {
                blas,
                funcs,
                staging,
                stream,
                ctx,
                options,
                info,
                kprof,
                fp8_linears: AtomicBool::new(false),
            }),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    pub fn options(&self) -> &CudaOptions {
        &self.inner.options
    }

    /// The cuBLASLt algorithm chosen per GEMM shape so far.
    pub fn gemm_plans(&self) -> Vec<gemm::PlanInfo> {
        self.inner.blas.plans()
    }

    /// GEMM calls that had to leave their shape's fixed (batch-invariant) algorithm.
    pub fn gemm_fallbacks(&self) -> usize {
        self.inner.blas.fallbacks()
    }

    /// Waits for all queued GPU work (and surfaces asynchronous errors).
    pub fn synchronize(&self) -> Result<()> {
        self.inner.stream.synchronize()?;
        Ok(())
    }

    /// The FP8 activations `[Mpad, K]` and `[K/128][Mpad]` scales the FP8 GEMM path uses for `x`
    /// (padding rows included): the quantisation attached to `x` when a fused kernel wrote one,
    /// else `quant_act_1x128`'s. A diagnostic for tests: the CPU twin is
    /// `host::quantize_act_1x128`.
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
        Ok((
            self.inner.stream.clone_dtoh(&a.q)?,
            self.inner.stream.clone_dtoh(&a.s)?,
        ))
    }

    fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.inner
            .funcs
            .get(name)
            .ok_or_else(|| anyhow!("kernel {name} is not loaded"))
    }

    fn launch(&self, name: &str, cfg: LaunchConfig, args: &[A]) -> Result<()> {
        let f = self.func(name)?;
        let mut b = self.inner.stream.launch_builder(f);
        for a in args {
            match a {
                A::P(v) => b.arg(v),
                A::L(v) => b.arg(v),
                A::I(v) => b.arg(v),
                A::F(v) => b.arg(v),
            };
        }
        // SAFETY: every kernel's parameter list matches the argument list its caller builds
        // (pointers as u64, `int` as i32, `long long` as i64, `float` as f32), and the buffers
        // behind the pointers outlive the launch in stream order.
        let mut go = move || unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| anyhow!("launching {name}: {e:?}"));
        match &self.inner.kprof {
            Some(p) => p.time(name, go),
            None => go(),
        }
    }

    /// One cuBLASLt GEMM (timed under its kind and shape when kernel profiling is on).
    fn gemm(&self, g: &Gemm) -> Result<()> {
        match &self.inner.kprof {
            Some(p) => p.time(format!("gemm.{:?} N={} K={}", g.kind, g.n, g.k), || self.inner.blas.run(g)),
            None => self.inner.blas.run(g),
        }
    }

    fn gemm_named(&self, g: &Gemm, name: &str) -> Result<()> {
        match &self.inner.kprof {
            Some(p) => p.time(name, || self.inner.blas.run(g)),
            None => self.inner.blas.run(g),
        }
    }

    /// The per-kernel report since the last one (`IMAJEV_PROFILE=kernels`), else None.
    pub fn kernel_report(&self) -> Result<Option<String>> {
        self.inner.kprof.as_ref().map(|p| p.report()).transpose()
    }

    fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.inner.stream).0
    }

    fn alloc_bf16(&self, n: usize) -> Result<CudaSlice<bf16>> {
        // SAFETY: every caller writes the elements it later reads.
        Ok(unsafe { self.inner.stream.alloc::<bf16>(n.max(1)) }?)
    }

    fn alloc_f32(&self, n: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: as above.
        Ok(unsafe { self.inner.stream.alloc::<f32>(n.max(1)) }?)
    }

    fn zeros_f32(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.inner.stream.alloc_zeros::<f32>(n.max(1))?)
    }

    /// A new device buffer holding `v`. Small copies go through the pinned staging ring (no stream
    /// synchronisation); large ones (weights) are plain pageable copies.
    fn htod<T: cudarc::driver::DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        let stream = &self.inner.stream;
        let bytes = std::mem::size_of_val(v);
        if bytes == 0 {
            // SAFETY: never read.
            return Ok(unsafe { stream.alloc::<T>(1) }?);
        }
        if bytes > STAGING_BYTES / 4 {
            return Ok(stream.clone_htod(v)?);
        }
        // SAFETY: written by the copy below before any kernel reads it (stream order).
        let dst = unsafe { stream.alloc::<T>(v.len()) }?;
        let mut st = self
            .inner
            .staging
            .lock()
            .map_err(|_| anyhow!("staging buffer poisoned"))?;
        let mut at = st.cursor.div_ceil(256) * 256;
        if at + bytes > st.size {
            // Every earlier copy out of the ring must be done before its bytes are reused.
            stream.synchronize()?;
            at = 0;
        }
        // SAFETY: `at + bytes <= size` bytes of the pinned ring are ours until the next wrap, which
        // synchronises first; `v` is plain data of `bytes` bytes.
        unsafe {
            let src = st.ptr.add(at);
            std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, src, bytes);
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                self.p(&dst),
                src as *const std::ffi::c_void,
                bytes,
                stream.cu_stream(),
            )
            .result()?;
        }
        st.cursor = at + bytes;
        Ok(dst)
    }

    fn bf16_tensor(&self, buf: CudaSlice<bf16>, shape: &[usize]) -> CudaTensor {
        CudaTensor {
            buf: Buf::Bf16(buf),
            shape: shape.to_vec(),
            fp8: None,
        }
    }

    fn bf16_of<'a>(&self, t: &'a CudaTensor) -> Result<Bf16View<'a>> {
        match &t.buf {
            Buf::Bf16(s) => Ok(Bf16View::Ref(s)),
            Buf::F32(s) => {
                let n = t.numel();
                let y = self.alloc_bf16(n)?;
                self.launch(
                    "cast_f32_bf16",
                    cfg((grid1(n, 256), 1, 1), 256, 0),
                    &[A::P(self.p(s)), A::P(self.p(&y)), A::L(n as i64)],
                )?;
                Ok(Bf16View::Own(y))
            }
        }
    }

    fn f32_of<'a>(&self, t: &'a CudaTensor) -> Result<F32View<'a>> {
        match &t.buf {
            Buf::F32(s) => Ok(F32View::Ref(s)),
            Buf::Bf16(s) => {
                let n = t.numel();
                let y = self.alloc_f32(n)?;
                self.launch(
                    "cast_bf16_f32",
                    cfg((grid1(n, 256), 1, 1), 256, 0),
                    &[A::P(self.p(s)), A::P(self.p(&y)), A::L(n as i64)],
                )?;
                Ok(F32View::Own(y))
            }
        }
    }

    /// The BF16 buffer of a tensor that an op is about to change in place (every in-place op gets
    /// its buffer here): converts an F32 tensor to BF16 first, and drops the tensor's attached FP8
    /// quantisation, which would describe the old contents.
    fn bf16_for_update<'t>(&self, t: &'t mut CudaTensor) -> Result<&'t CudaSlice<bf16>> {
        t.fp8 = None;
        if let Buf::F32(_) = t.buf {
            let y = match self.bf16_of(t)? {
                Bf16View::Own(y) => y,
                Bf16View::Ref(_) => unreachable!("an F32 tensor converts into a new buffer"),
            };
            t.buf = Buf::Bf16(y);
        }
        match &t.buf {
            Buf::Bf16(b) => Ok(b),
            Buf::F32(_) => unreachable!("converted above"),
        }
    }

    /// Uninitialised buffers for the FP8 activations of `m` rows of width `k` (the kernel that
    /// fills them writes every byte and scale, padding rows included).
    fn alloc_act_fp8(&self, m: usize, k: usize) -> Result<ActFp8> {
        ensure!(
            k % fp8::FP8_BLOCK == 0,
            "FP8 activations need K to be a multiple of 128, got {k}"
        );
        let mpad = fp8::fp8_rows(m);
        // SAFETY: every caller launches a kernel that writes all mpad·k bytes and all scales.
        let q = unsafe { self.inner.stream.alloc::<u8>(mpad * k) }?;
        let s = self.alloc_f32(mpad * k / fp8::FP8_BLOCK)?;
        Ok(ActFp8 { q, s, mpad })
    }

    /// Whether a row norm writing rows of width `k` also writes their FP8 quantisation: only once
    /// an FP8 projection exists (else no GEMM would read it), when `k` is whole 128-blocks, and
    /// unless `unfused_act_quant` is set.
    fn fuse_act_quant(&self, k: usize) -> bool {
        k > 0
            && k % fp8::FP8_BLOCK == 0
            && !self.inner.options.unfused_act_quant
            && self.inner.fp8_linears.load(Ordering::Relaxed)
    }

    /// The RMSNorm launches of `rms_norm` (`residual` None: normalises `x`) and `add_rms_norm`
    /// (`residual` = the residual stream, updated in place to `residual + x` first), one block per
    /// row of `d` with the same block size (so the same reduction order and bits). When the rows
    /// are the tensor's rows (`cols == d`) and FP8 projections are loaded, the `_quant` kernel
    /// also writes the output's 1×128 FP8 quantisation, returned for the tensor to carry.
    #[allow(clippy::too_many_arguments)]
    fn row_norm(
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
        if rows == 0 {
            return Ok(None);
        }
        let name = if residual.is_some() { "add_rms_norm" } else { "rms_norm" };
        // add_rms_norm's first argument is the residual it updates, then the addend.
        let mut args: Vec<A> = residual.into_iter().map(A::P).collect();
        args.extend([A::P(x), A::P(self.p(w)), A::P(self.p(out))]);
        let fused = cols == d && self.fuse_act_quant(d);
        let (fp8, blocks) = if fused {
            let a = self.alloc_act_fp8(rows, d)?;
            args.extend([A::P(self.p(&a.q)), A::P(self.p(&a.s)), A::I(rows as i32), A::I(a.mpad as i32)]);
            let blocks = a.mpad;
            (Some(a), blocks)
        } else {
            (None, rows)
        };
        args.extend([A::I(d as i32), A::F(eps), A::F(offset)]);
        let name = if fused { format!("{name}_quant") } else { name.to_string() };
        self.launch(&name, cfg((blocks as u32, 1, 1), norm_block(d), 0), &args)?;
        Ok(fp8)
    }

    /// Per-token 1×128 FP8 quantisation of `x` `[m, k]` (`quant_act_1x128`).
    fn quantize(&self, x: &CudaSlice<bf16>, m: usize, k: usize) -> Result<ActFp8> {
        let a = self.alloc_act_fp8(m, k)?;
        let warps = a.mpad * (k / fp8::FP8_BLOCK);
        self.launch(
            "quant_act_1x128",
            cfg((grid1(warps * 32, 256), 1, 1), 256, 0),
            &[
                A::P(self.p(x)),
                A::P(self.p(&a.q)),
                A::P(self.p(&a.s)),
                A::I(m as i32),
                A::I(a.mpad as i32),
                A::I(k as i32),
            ],
        )?;
        Ok(a)
    }

    /// The GEMMs of `matmul` (FP8 and BF16 groups, bias, LoRA) on the BF16 input `xs` `[m, k]`
    /// and, when the projection has FP8 groups, its quantisation (what `quantize` makes from
    /// `xs`).
    fn matmul_quantised(
        &self,
        xs: &CudaSlice<bf16>,
        fp8: Option<&ActFp8>,
        m: usize,
        k: usize,
        w: &CudaLinear,
    ) -> Result<CudaTensor> {
        let n = w.out_dim;
        let rows_alloc = fp8.map(|f| f.mpad).unwrap_or(m);
        let y = self.alloc_bf16(rows_alloc * n)?;
        let yp = self.p(&y);
        for g in &w.groups {
            let yg = yp + 2 * g.cols.start as u64;
            let gemm = match &g.weight {
                GroupWeight::Fp8 { w: wq, scales } => {
                    let a = fp8.expect("quantised by the caller");
                    Gemm {
                        kind: GemmKind::Fp8Block,
                        n: g.cols.len(),
                        m: a.mpad,
                        k,
                        w: self.p(wq),
                        ldw: k,
                        x: self.p(&a.q),
                        ldx: k,
                        y: yg,
                        ldy: n,
                        alpha: 1.0,
                        beta: 0.0,
                        w_scale: self.p(scales),
                        x_scale: self.p(&a.s),
                    }
                }
                GroupWeight::Bf16(wb) => Gemm {
                    kind: GemmKind::Bf16,
                    n: g.cols.len(),
                    m,
                    k,
                    w: self.p(wb),
                    ldw: k,
                    x: self.p(xs),
                    ldx: k,
                    y: yg,
                    ldy: n,
                    alpha: 1.0,
                    beta: 0.0,
                    w_scale: 0,
                    x_scale: 0,
                },
            };
            self.gemm(&gemm)
                .with_context(|| format!("{:?} GEMM N={} K={k} M={m}", gemm.kind, gemm.n))?;
        }
        if let Some(b) = &w.bias {
            if m > 0 {
                self.launch(
                    "add_bias",
                    cfg((grid1(m * n, 256), 1, 1), 256, 0),
                    &[A::P(yp), A::P(self.p(b)), A::L(m as i64), A::I(n as i32)],
                )?;
            }
        }
        for l in &w.loras {
            if m == 0 {
                break;
            }
            // y[:, cols] += scale · (x·Aᵀ)·Bᵀ, two BF16 GEMMs; the second accumulates (β = 1).
            let t = self.alloc_bf16(m * l.rank)?;
            let g1 = Gemm {
                kind: GemmKind::Bf16,
                n: l.rank,
                m,
                k,
                w: self.p(&l.a),
                ldw: k,
                x: self.p(xs),
                ldx: k,
                y: self.p(&t),
                ldy: l.rank,
                alpha: 1.0,
                beta: 0.0,
                w_scale: 0,
                x_scale: 0,
            };
            self.gemm_named(&g1, "gemm.lora_a").context("LoRA A GEMM")?;
            let g2 = Gemm {
                kind: GemmKind::Bf16,
                n: l.cols.len(),
                m,
                k: l.rank,
                w: self.p(&l.b),
                ldw: l.rank,
                x: self.p(&t),
                ldx: l.rank,
                y: yp + 2 * l.cols.start as u64,
                ldy: n,
                alpha: l.scale,
                beta: 1.0,
                w_scale: 0,
                x_scale: 0,
            };
            self.gemm_named(&g2, "gemm.lora_b").context("LoRA B GEMM")?;
        }
        Ok(self.bf16_tensor(y, &[m, n]))
    }

    fn reserve_kv(&self, c: &mut CudaKvCache, needed: usize) -> Result<()> {
        if c.k.is_some() && needed <= c.cap {
            return Ok(());
        }
        let cap = host::kv_capacity(c.cap, needed);
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

    fn dtod_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes > 0 {
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst,
                    src,
                    bytes,
                    self.inner.stream.cu_stream(),
                )
            }?;
        }
        Ok(())
    }

    /// The DeltaNet output norm: `rms_norm_gated` of the f32 delta-rule output `core`
    /// `[n·heads, d]` with the gate `z` (`z_ptr`, row stride `z_ld`), as `[n, heads·d]` BF16; with
    /// `d == 128` fused with the FP8 quantisation of that output (`rms_norm_gated_quant`: each
    /// (token, head) row is one 128-block) for the out projection.
    #[allow(clippy::too_many_arguments)]
    fn gated_norm(
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
        let mut args = vec![A::P(self.p(core)), A::P(z_ptr), A::L(z_ld), A::I(heads as i32), A::P(self.p(w)), A::P(self.p(&y))];
        let (name, rows, fp8) = if n > 0 && d == fp8::FP8_BLOCK && self.fuse_act_quant(heads * d) {
            let a = self.alloc_act_fp8(n, heads * d)?;
            args.extend([A::P(self.p(&a.q)), A::P(self.p(&a.s)), A::I(n as i32), A::I(a.mpad as i32)]);
            ("rms_norm_gated_quant", a.mpad * heads, Some(a))
        } else {
            args.push(A::L((n * heads) as i64));
            ("rms_norm_gated", n * heads, None)
        };
        args.extend([A::I(d as i32), A::F(eps)]);
        self.launch(name, cfg((grid1(rows * 32, 256), 1, 1), 256, 0), &args)?;
        let mut t = self.bf16_tensor(y, &[n, heads * d]);
        t.fp8 = fp8;
        Ok(t)
    }

    /// The attention kernel over the segment table `meta` (see kernels/attention.cu).
    #[allow(clippy::too_many_arguments)]
    fn attention_core(
        &self,
        q: &CudaSlice<bf16>,
        meta: &CudaSlice<i64>,
        segments: &[Range<usize>],
        heads: usize,
        kvh: usize,
        hd: usize,
        causal: bool,
        gate: Option<(u64, usize, usize)>,
        out: &CudaSlice<bf16>,
    ) -> Result<()> {
        let hdp = host::attention_head_dim(hd)
            .ok_or_else(|| anyhow!("head_dim {hd} is larger than 256"))?;
        let tiles = segments
            .iter()
            .map(|s| s.len().div_ceil(64))
            .max()
            .unwrap_or(0);
        if tiles == 0 {
            return Ok(());
        }
        let scale_log2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
        let (gp, grow, ghead) = gate.unwrap_or((0, 0, 0));
        self.launch(
            &format!("attn_fwd_{hdp}"),
            cfg(
                (tiles as u32, heads as u32, segments.len() as u32),
                128,
                host::attention_smem_bytes(hdp),
            ),
            &[
                A::P(self.p(q)),
                A::P(self.p(meta)),
                A::I(heads as i32),
                A::I(kvh as i32),
                A::I(hd as i32),
                A::I(causal as i32),
                A::F(scale_log2),
                A::P(gp),
                A::L(grow as i64),
                A::I(ghead as i32),
                A::P(self.p(out)),
            ],
        )
    }
}

/// Loads every kernel module: from the disk cache when a valid entry exists, else NVRTC (the
/// missing ones in parallel), writing the cache. Returns the functions and (cached, compiled).
fn load_kernels(
    ctx: &Arc<CudaContext>,
    options: &CudaOptions,
    arch: &str,
    device_tag: &str,
) -> Result<(HashMap<&'static str, CudaFunction>, usize, usize)> {
    let include = compile::cuda_include_dir();
    let include_path = match &include {
        Ok(p) | Err(p) => p.clone(),
    };
    let opts = compile::compile_options(arch, &include_path);
    let cache_dir = options
        .kernel_cache_dir
        .clone()
        .or_else(compile::default_cache_dir);
    struct Job {
        file: compile::KernelFile,
        source: String,
        path: Option<PathBuf>,
        cubin: Option<Vec<u8>>,
    }
    let mut jobs: Vec<Job> = compile::FILES
        .iter()
        .map(|f| {
            let source = compile::full_source(f);
            let key = compile::cache_key(&source, &opts, device_tag);
            let path = cache_dir
                .as_ref()
                .map(|d| d.join(format!("{}-{}.cubin", f.name, &key[..32])));
            let cubin = path.as_deref().and_then(compile::read_cache);
            Job {
                file: *f,
                source,
                path,
                cubin,
            }
        })
        .collect();
    let mut modules = HashMap::new();
    let mut cached = 0;
    for j in jobs.iter_mut() {
        if let Some(bin) = &j.cubin {
            match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin.clone())) {
                Ok(m) => {
                    modules.insert(j.file.name, m);
                    cached += 1;
                }
                Err(e) => {
                    tracing::warn!(
                        "cached kernels/{}.cu CUBIN was rejected by the driver ({e:?}); rebuilding",
                        j.file.name
                    );
                    j.cubin = None;
                }
            }
        }
    }
    let todo: Vec<&Job> = jobs
        .iter()
        .filter(|j| !modules.contains_key(j.file.name))
        .collect();
    let compiled = todo.len();
    if !todo.is_empty() {
        if let Err(p) = &include {
            bail!(
                "NVRTC needs the CUDA headers (cuda_bf16.h, cuda_fp8.h) to build the kernels, and {} has none: set CUDA_HOME \
                 to a CUDA 13 toolkit whose include/ holds cuda_bf16.h (or fill the kernel cache from a machine that has one)",
                p.display()
            );
        }
        tracing::info!(
            count = todo.len(),
            arch,
            "compiling CUDA kernels with NVRTC"
        );
        let bins: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
            let hs: Vec<_> = todo
                .iter()
                .map(|j| s.spawn(|| compile::nvrtc_cubin(j.file.name, &j.source, &opts)))
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("NVRTC thread panicked")))
                })
                .collect()
        });
        for (j, bin) in todo.iter().zip(bins) {
            let bin = bin?;
            if let Some(p) = &j.path {
                if let Err(e) = compile::write_cache(p, &bin) {
                    tracing::warn!("could not cache kernels/{}.cu: {e:#}", j.file.name);
                }
            }
            let m = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(bin))
                .map_err(|e| anyhow!("loading the CUBIN of kernels/{}.cu: {e:?}", j.file.name))?;
            modules.insert(j.file.name, m);
        }
    }
    let mut funcs = HashMap::new();
    for (file, names) in KERNELS {
        let m = modules
            .get(file)
            .ok_or_else(|| anyhow!("kernels/{file}.cu is not loaded"))?;
        for &n in *names {
            let f = m
                .load_function(n)
                .map_err(|e| anyhow!("kernels/{file}.cu has no function {n}: {e:?}"))?;
            funcs.insert(n, f);
        }
    }
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_SMEM;
    for hdp in [16, 32, 64, 128, 256] {
        funcs[format!("attn_fwd_{hdp}").as_str()]
            .set_attribute(MAX_SMEM, host::attention_smem_bytes(hdp) as i32)?;
    }
    for dk in [16, 32, 64, 128] {
        funcs[format!("gdn_chunk_prep_{dk}").as_str()]
            .set_attribute(MAX_SMEM, host::delta_smem_bytes(dk).0 as i32)?;
        funcs[format!("gdn_chunk_scan_tc_{dk}").as_str()]
            .set_attribute(MAX_SMEM, host::delta_tc_smem_bytes(dk) as i32)?;
        funcs[format!("gdn_chunk_scan_{dk}").as_str()]
            .set_attribute(MAX_SMEM, host::delta_smem_bytes(dk).1 as i32)?;
    }
    Ok((funcs, cached, compiled))
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Linear = CudaLinear;
    type KvCache = CudaKvCache;
    type DeltaState = CudaDeltaState;

    fn kernel_report(&self) -> Result<Option<String>> {
        CudaBackend::kernel_report(self)
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.stream.synchronize()?;
        Ok(())
    }

    fn describe(&self) -> String {
        let i = &self.inner.info;
        format!(
            "cuda ({}, {}, driver {}, NVRTC {}.{}, cuBLASLt {}; bf16 activations, block-FP8 GEMMs{})",
            i.name,
            i.arch,
            i.driver_version,
            i.nvrtc_version.0,
            i.nvrtc_version.1,
            i.cublaslt_version,
            if self.inner.options.quantize_fp8 { ", BF16 weights quantised to FP8 at load" } else { "" }
        )
    }

    fn param(&self, t: &TensorRef) -> Result<CudaTensor> {
        if t.shape.len() <= 1 {
            return self.param_f32(t);
        }
        let v = bf16_values(t)?;
        Ok(self.bf16_tensor(self.htod(&v)?, t.shape))
    }

    fn param_f32(&self, t: &TensorRef) -> Result<CudaTensor> {
        Ok(CudaTensor {
            buf: Buf::F32(self.htod(&t.to_f32()?)?),
            shape: t.shape.to_vec(),
            fp8: None,
        })
    }

    fn linear(&self, parts: &[LinearPart]) -> Result<CudaLinear> {
        ensure!(!parts.is_empty(), "a projection needs at least one block");
        let in_dim = check_2d(&parts[0].weight)?.1;
        let mut formats = Vec::with_capacity(parts.len());
        for p in parts {
            let (o, i) = check_2d(&p.weight)?;
            ensure!(
                i == in_dim,
                "{} has {} inputs, expected {}",
                p.weight.name,
                i,
                in_dim
            );
            let info = PartInfo {
                dtype: p.weight.dtype,
                out: o,
                inp: i,
                scales_are_128x128: scales_are_128(&p.weight),
            };
            formats.push((host::part_format(&info, self.inner.options.quantize_fp8, self.inner.options.dequantize_fp8), o));
        }
        let out_dim: usize = formats.iter().map(|f| f.1).sum();
        let mut groups = Vec::new();
        for g in host::group_parts(&formats) {
            let weight = match g.format {
                PartFormat::Fp8 => {
                    let mut q = Vec::with_capacity(g.cols.len() * in_dim);
                    let mut s = Vec::new();
                    for p in &parts[g.parts.clone()] {
                        let (a, b) = fp8_part(&p.weight)
                            .with_context(|| format!("FP8 weights of {}", p.weight.name))?;
                        q.extend(a);
                        s.extend(b);
                    }
                    GroupWeight::Fp8 {
                        w: self.htod(&q)?,
                        scales: self.htod(&s)?,
                    }
                }
                PartFormat::Bf16 => {
                    let mut w = Vec::with_capacity(g.cols.len() * in_dim);
                    for p in &parts[g.parts.clone()] {
                        w.extend(bf16_values(&p.weight)?);
                    }
                    GroupWeight::Bf16(self.htod(&w)?)
                }
            };
            groups.push(LinearGroup {
                cols: g.cols,
                weight,
            });
        }
        let mut bias = None;
        if parts.iter().any(|p| p.bias.is_some()) {
            let mut b = Vec::with_capacity(out_dim);
            for p in parts {
                let o = p.weight.shape[0];
                match &p.bias {
                    Some(t) => {
                        ensure!(t.shape == [o], "{} must have shape [{o}]", t.name);
                        b.extend(t.to_f32()?);
                    }
                    None => b.extend(std::iter::repeat_n(0f32, o)),
                }
            }
            bias = Some(self.htod(&b)?);
        }
        // (columns, A [r, in], B [out, r], scale) of every adapted part, fused into one pair.
        let mut found = Vec::new();
        let mut col = 0;
        for p in parts {
            let o = p.weight.shape[0];
            if let Some(l) = &p.lora {
                let (r, ai) = check_2d(&l.a)?;
                let (bo, br) = check_2d(&l.b)?;
                ensure!(
                    ai == in_dim && bo == o && br == r,
                    "LoRA {} / {} shapes do not fit {}",
                    l.a.name,
                    l.b.name,
                    p.weight.name
                );
                found.push((col..col + o, bf16_values(&l.a)?, l.b.to_f32()?, r, l.scale));
            }
            col += o;
        }
        let mut loras = Vec::new();
        if !found.is_empty() {
            let span = found[0].0.start..found[found.len() - 1].0.end;
            let rank: usize = found.iter().map(|f| f.3).sum();
            // One GEMM scale when the parts agree (PEFT: alpha/r per module), else folded into B.
            let common = found[0].4;
            let same = found.iter().all(|f| f.4 == common);
            let mut a = Vec::with_capacity(rank * in_dim);
            let mut b = vec![bf16::ZERO; span.len() * rank];
            let mut r0 = 0;
            for (cols, fa, fb, r, scale) in &found {
                a.extend_from_slice(fa);
                let k = if same { 1.0 } else { *scale };
                for (i, row) in fb.chunks_exact(*r).enumerate() {
                    let dst = (cols.start - span.start + i) * rank + r0;
                    for (j, v) in row.iter().enumerate() {
                        b[dst + j] = bf16::from_f32(v * k);
                    }
                }
                r0 += r;
            }
            loras.push(CudaLora {
                cols: span,
                rank,
                parts: found.len(),
                a: self.htod(&a)?,
                b: self.htod(&b)?,
                scale: if same { common } else { 1.0 },
            });
        }
        let linear = CudaLinear {
            in_dim,
            out_dim,
            groups,
            bias,
            loras,
        };
        if linear.has_fp8() {
            self.inner.fp8_linears.store(true, Ordering::Relaxed);
        }
        Ok(linear)
    }

    fn linear_out(&self, w: &CudaLinear) -> usize {
        w.out_dim
    }

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<CudaTensor> {
        let n: usize = shape.iter().product();
        ensure!(
            n == data.len(),
            "tensor of shape {shape:?} needs {n} values, got {}",
            data.len()
        );
        Ok(CudaTensor {
            buf: Buf::F32(self.htod(data)?),
            shape: shape.to_vec(),
            fp8: None,
        })
    }

    fn download(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        let n = t.numel();
        if n == 0 {
            return Ok(vec![]);
        }
        let s = &self.inner.stream;
        Ok(match &t.buf {
            Buf::Bf16(b) => s
                .clone_dtoh(&b.slice(0..n))?
                .into_iter()
                .map(|v| v.to_f32())
                .collect(),
            Buf::F32(b) => s.clone_dtoh(&b.slice(0..n))?,
        })
    }

    fn shape<'t>(&self, t: &'t CudaTensor) -> &'t [usize] {
        &t.shape
    }

    fn reshape(&self, t: CudaTensor, shape: &[usize]) -> Result<CudaTensor> {
        let n: usize = shape.iter().product();
        ensure!(n == t.numel(), "cannot reshape {:?} to {shape:?}", t.shape);
        // The attachment is dropped: a new column count would not match its layout.
        Ok(CudaTensor {
            buf: t.buf,
            shape: shape.to_vec(),
            fp8: None,
        })
    }

    fn embed(&self, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
        let (v, d) = table.rows_cols();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= v) {
            bail!("token id {bad} is outside the embedding table ({v} rows)");
        }
        let n = ids.len();
        let tab = self.bf16_of(table)?;
        let ids_d = self.htod(ids)?;
        let y = self.alloc_bf16(n * d)?;
        self.launch(
            "gather_rows",
            cfg((grid1(n * d, 256), 1, 1), 256, 0),
            &[
                A::P(self.p(tab.s())),
                A::P(self.p(&ids_d)),
                A::P(self.p(&y)),
                A::L(n as i64),
                A::I(d as i32),
            ],
        )?;
        Ok(self.bf16_tensor(y, &[n, d]))
    }

    fn embed_bag(
        &self,
        table: &CudaTensor,
        idx: &[u32],
        w: &[f32],
        taps: usize,
    ) -> Result<CudaTensor> {
        let (v, d) = table.rows_cols();
        ensure!(
            idx.len() == w.len() && taps > 0 && idx.len() % taps == 0,
            "embed_bag shapes"
        );
        if let Some(&bad) = idx.iter().find(|&&i| i as usize >= v) {
            bail!("embed_bag index {bad} out of range ({v} rows)");
        }
        let n = idx.len() / taps;
        let tab = self.bf16_of(table)?;
        let (idx_d, w_d) = (self.htod(idx)?, self.htod(w)?);
        let y = self.alloc_bf16(n * d)?;
        self.launch(
            "embed_bag",
            cfg((grid1(n * d, 256), 1, 1), 256, 0),
            &[
                A::P(self.p(tab.s())),
                A::P(self.p(&idx_d)),
                A::P(self.p(&w_d)),
                A::P(self.p(&y)),
                A::L(n as i64),
                A::I(d as i32),
                A::I(taps as i32),
            ],
        )?;
        Ok(self.bf16_tensor(y, &[n, d]))
    }

    fn scatter_rows(&self, dst: &mut CudaTensor, rows: &[usize], src: &CudaTensor) -> Result<()> {
        let (n, d) = dst.rows_cols();
        let (sn, sd) = src.rows_cols();
        ensure!(
            sd == d && sn == rows.len(),
            "scatter_rows: {} rows of width {sd} into width {d}",
            rows.len()
        );
        if let Some(&r) = rows.iter().find(|&&r| r >= n) {
            bail!("scatter_rows: row {r} out of range");
        }
        let db = self.bf16_for_update(dst)?;
        let s = self.bf16_of(src)?;
        let rows_d = self.htod(&rows.iter().map(|&r| r as u32).collect::<Vec<_>>())?;
        self.launch(
            "scatter_rows",
            cfg((grid1(sn * d, 256), 1, 1), 256, 0),
            &[
                A::P(self.p(db)),
                A::P(self.p(&rows_d)),
                A::P(self.p(s.s())),
                A::L(sn as i64),
                A::I(d as i32),
            ],
        )
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        let (n, d) = x.rows_cols();
        if let Some(&r) = rows.iter().find(|&&r| r >= n) {
            bail!("gather_rows: row {r} out of range");
        }
        let xs = self.bf16_of(x)?;
        let rows_d = self.htod(&rows.iter().map(|&r| r as u32).collect::<Vec<_>>())?;
        let y = self.alloc_bf16(rows.len() * d)?;
        self.launch(
            "gather_rows",
            cfg((grid1(rows.len() * d, 256), 1, 1), 256, 0),
            &[
                A::P(self.p(xs.s())),
                A::P(self.p(&rows_d)),
                A::P(self.p(&y)),
                A::L(rows.len() as i64),
                A::I(d as i32),
            ],
        )?;
        Ok(self.bf16_tensor(y, &[rows.len(), d]))
    }

    fn split_cols(&self, x: &CudaTensor, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        let (n, d) = x.rows_cols();
        ensure!(
            widths.iter().sum::<usize>() == d,
            "split_cols: widths {widths:?} do not sum to {d}"
        );
        let xs = self.bf16_of(x)?;
        let mut out = Vec::with_capacity(widths.len());
        let mut off = 0;
        for &w in widths {
            let y = self.alloc_bf16(n * w)?;
            if n * w > 0 {
                self.launch(
                    "copy_cols",
                    cfg((grid1(n * w, 256), 1, 1), 256, 0),
                    &[
                        A::P(self.p(xs.s())),
                        A::I(d as i32),
                        A::I(off as i32),
                        A::P(self.p(&y)),
                        A::I(w as i32),
                        A::L(n as i64),
                    ],
                )?;
            }
            out.push(self.bf16_tensor(y, &[n, w]));
            off += w;
        }
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&CudaTensor]) -> Result<CudaTensor> {
        let d = parts.first().map(|p| p.rows_cols().1).unwrap_or(0);
        for p in parts {
            ensure!(p.rows_cols().1 == d, "concat_rows: widths differ");
        }
        let total: usize = parts.iter().map(|p| p.numel()).sum();
        let rows = total.checked_div(d).unwrap_or(0);
        if !parts.is_empty() && parts.iter().all(|p| !p.is_bf16()) {
            let y = self.alloc_f32(total)?;
            let mut at = 0;
            for p in parts {
                let Buf::F32(s) = &p.buf else { unreachable!() };
                self.dtod_bytes(self.p(&y) + 4 * at as u64, self.p(s), 4 * p.numel())?;
                at += p.numel();
            }
            return Ok(CudaTensor {
                buf: Buf::F32(y),
                shape: vec![rows, d],
                fp8: None,
            });
        }
        let y = self.alloc_bf16(total)?;
        let mut at = 0;
        for p in parts {
            let s = self.bf16_of(p)?;
            self.dtod_bytes(self.p(&y) + 2 * at as u64, self.p(s.s()), 2 * p.numel())?;
            at += p.numel();
        }
        Ok(self.bf16_tensor(y, &[rows, d]))
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaLinear) -> Result<CudaTensor> {
        let (m, k) = x.rows_cols();
        ensure!(
            k == w.in_dim,
            "matmul: input width {k}, projection expects {}",
            w.in_dim
        );
        let xs = self.bf16_of(x)?;
        if !w.has_fp8() || m == 0 {
            return self.matmul_quantised(xs.s(), None, m, k, w);
        }
        // The quantisation a fused norm attached to x, else quant_act_1x128 (the same bits).
        let own;
        let fp8 = match &x.fp8 {
            Some(a) => {
                ensure!(a.mpad == fp8::fp8_rows(m), "attached FP8 activations of another row count");
                a
            }
            None => {
                own = self.quantize(xs.s(), m, k)?;
                &own
            }
        };
        self.matmul_quantised(xs.s(), Some(fp8), m, k, w)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
        offset: f32,
    ) -> Result<CudaTensor> {
        let d = w.numel();
        ensure!(
            d > 0 && x.numel() % d == 0,
            "rms_norm: {} values do not split into rows of {d}",
            x.numel()
        );
        let rows = x.numel() / d;
        let (xs, ws) = (self.bf16_of(x)?, self.f32_of(w)?);
        let y = self.alloc_bf16(rows * d)?;
        let fp8 = self.row_norm(self.p(xs.s()), None, ws.s(), &y, rows, x.rows_cols().1, d, eps, offset)?;
        let mut t = self.bf16_tensor(y, &x.shape);
        t.fp8 = fp8;
        Ok(t)
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        let d = w.numel();
        ensure!(
            b.numel() == d && d > 0 && x.numel() % d == 0,
            "layer_norm shapes"
        );
        let rows = x.numel() / d;
        let (xs, ws, bs) = (self.bf16_of(x)?, self.f32_of(w)?, self.f32_of(b)?);
        let y = self.alloc_bf16(rows * d)?;
        if rows > 0 {
            let block = norm_block(d);
            self.launch(
                "layer_norm",
                cfg((rows as u32, 1, 1), block, 0),
                &[
                    A::P(self.p(xs.s())),
                    A::P(self.p(ws.s())),
                    A::P(self.p(bs.s())),
                    A::P(self.p(&y)),
                    A::I(d as i32),
                    A::F(eps),
                ],
            )?;
        }
        Ok(self.bf16_tensor(y, &x.shape))
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        ensure!(
            x.numel() == y.numel(),
            "add: shapes {:?} and {:?}",
            x.shape,
            y.shape
        );
        let n = x.numel();
        let xb = self.bf16_for_update(x)?;
        let ys = self.bf16_of(y)?;
        if n > 0 {
            self.launch(
                "add_bf16",
                cfg((grid1(n, 256), 1, 1), 256, 0),
                &[A::P(self.p(xb)), A::P(self.p(ys.s())), A::L(n as i64)],
            )?;
        }
        Ok(())
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
        offset: f32,
    ) -> Result<CudaTensor> {
        ensure!(
            x.numel() == y.numel(),
            "add: shapes {:?} and {:?}",
            x.shape,
            y.shape
        );
        let d = w.numel();
        ensure!(
            d > 0 && x.numel() % d == 0,
            "rms_norm: {} values do not split into rows of {d}",
            x.numel()
        );
        let rows = x.numel() / d;
        let (shape, cols) = (x.shape.clone(), x.rows_cols().1);
        let xb = self.bf16_for_update(x)?;
        let (ys, ws) = (self.bf16_of(y)?, self.f32_of(w)?);
        let out = self.alloc_bf16(rows * d)?;
        let fp8 = self.row_norm(self.p(ys.s()), Some(self.p(xb)), ws.s(), &out, rows, cols, d, eps, offset)?;
        let mut t = self.bf16_tensor(out, &shape);
        t.fp8 = fp8;
        Ok(t)
    }

    fn swiglu(&self, gate_up: &CudaTensor) -> Result<CudaTensor> {
        let (n, d2) = gate_up.rows_cols();
        ensure!(d2 % 2 == 0, "swiglu needs an even width");
        let d = d2 / 2;
        let gs = self.bf16_of(gate_up)?;
        let y = self.alloc_bf16(n * d)?;
        if n * d > 0 {
            self.launch(
                "swiglu",
                cfg((grid1(n * d, 256), 1, 1), 256, 0),
                &[
                    A::P(self.p(gs.s())),
                    A::P(self.p(&y)),
                    A::L(n as i64),
                    A::I(d as i32),
                ],
            )?;
        }
        Ok(self.bf16_tensor(y, &[n, d]))
    }

    fn swiglu_matmul(&self, gate_up: &CudaTensor, w: &CudaLinear) -> Result<CudaTensor> {
        let (m, d2) = gate_up.rows_cols();
        let k = d2 / 2;
        if d2 % 2 != 0 || k != w.in_dim || !w.has_fp8() || m == 0 || k % fp8::FP8_BLOCK != 0 {
            // Nothing to fuse (BF16 projection), or a shape the unfused path reports.
            return self.matmul(&self.swiglu(gate_up)?, w);
        }
        let gs = self.bf16_of(gate_up)?;
        let xs = self.alloc_bf16(m * k)?;
        // The kernel writes all mpad·k bytes and all scales (pad rows zero, scale 1).
        let a = self.alloc_act_fp8(m, k)?;
        let warps = a.mpad * (k / fp8::FP8_BLOCK);
        self.launch(
            "swiglu_quant_1x128",
            cfg((grid1(warps * 32, 256), 1, 1), 256, 0),
            &[
                A::P(self.p(gs.s())),
                A::P(self.p(&xs)),
                A::P(self.p(&a.q)),
                A::P(self.p(&a.s)),
                A::I(m as i32),
                A::I(a.mpad as i32),
                A::I(k as i32),
            ],
        )?;
        self.matmul_quantised(&xs, Some(&a), m, k, w)
    }

    fn gelu(&self, x: &mut CudaTensor, kind: Gelu) -> Result<()> {
        let n = x.numel();
        let xb = self.bf16_for_update(x)?;
        if n > 0 {
            self.launch(
                "gelu",
                cfg((grid1(n, 256), 1, 1), 256, 0),
                &[
                    A::P(self.p(xb)),
                    A::L(n as i64),
                    A::I((kind == Gelu::Tanh) as i32),
                ],
            )?;
        }
        Ok(())
    }

    fn readout(&self, h: &CudaTensor, w: &CudaTensor) -> Result<Vec<f32>> {
        let (m, k) = h.rows_cols();
        let (rows, wk) = w.rows_cols();
        ensure!(k == wk, "readout: hidden {k} vs weight width {wk}");
        if m * rows == 0 {
            return Ok(vec![0.0; m * rows]);
        }
        let (hs, ws) = (self.bf16_of(h)?, self.f32_of(w)?);
        let y = self.alloc_f32(m * rows)?;
        self.launch(
            "readout_f32",
            cfg((grid1(m * rows * 32, 256), 1, 1), 256, 0),
            &[
                A::P(self.p(hs.s())),
                A::P(self.p(ws.s())),
                A::P(self.p(&y)),
                A::I(m as i32),
                A::I(rows as i32),
                A::I(k as i32),
            ],
        )?;
        Ok(self.inner.stream.clone_dtoh(&y.slice(0..m * rows))?)
    }

    fn new_kv_cache(&self, dims: &AttentionDims) -> Result<CudaKvCache> {
        Ok(CudaKvCache {
            shared: None,
            k: None,
            v: None,
            width: dims.kv_heads * dims.head_dim,
            cap: 0,
            len: 0,
        })
    }

    fn kv_len(&self, cache: &CudaKvCache) -> usize {
        cache.shared_len() + cache.len
    }

    fn share_kv(&self, c: &mut CudaKvCache) -> Result<()> {
        if c.len == 0 {
            return Ok(());
        }
        // New shared prefix = old shared rows + own rows, exactly sized; the own buffers are
        // dropped so forks start with none.
        let (old, own) = (c.shared_len() * c.width, c.len * c.width);
        let k = self.alloc_bf16(old + own)?;
        let v = self.alloc_bf16(old + own)?;
        for (dst, sh, mine) in [
            (&k, c.shared.as_ref().map(|s| &s.k), &c.k),
            (&v, c.shared.as_ref().map(|s| &s.v), &c.v),
        ] {
            if let Some(sh) = sh {
                self.dtod_bytes(self.p(dst), self.p(sh), 2 * old)?;
            }
            let mine = mine
                .as_ref()
                .ok_or_else(|| anyhow!("KV cache has rows but no buffer"))?;
            self.dtod_bytes(self.p(dst) + 2 * old as u64, self.p(mine), 2 * own)?;
        }
        c.shared = Some(Arc::new(SharedKv {
            k,
            v,
            len: c.shared_len() + c.len,
        }));
        c.k = None;
        c.v = None;
        c.cap = 0;
        c.len = 0;
        Ok(())
    }

    fn gated_attention(
        &self,
        x: &AttentionInputs<CudaTensor>,
        dims: &AttentionDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        caches: &mut [&mut CudaKvCache],
    ) -> Result<CudaTensor> {
        let AttentionDims {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            rotary_dim: rot,
            norm_eps,
        } = *dims;
        ensure!(segments.len() == caches.len(), "one cache per segment");
        let crate::backend::Tree { parent, is_parent } = crate::backend::check_parents(parents, segments.len())?;
        let (n, width) = x.qkv.rows_cols();
        ensure!(
            width == dims.qkv_width(),
            "attention input width {width} != {}",
            dims.qkv_width()
        );
        ensure!(
            x.cos.rows_cols() == (n, rot) && x.sin.rows_cols() == (n, rot),
            "rotary table shapes"
        );
        ensure!(
            kvh > 0 && heads % kvh == 0,
            "{heads} heads do not group over {kvh} kv heads"
        );
        ensure!(
            hd <= 256 && rot <= hd && rot % 2 == 0,
            "head_dim {hd} / rotary_dim {rot} not supported (head_dim ≤ 256)"
        );
        ensure!(
            x.q_norm.numel() == hd && x.k_norm.numel() == hd,
            "q/k norm weights must have {hd} values"
        );
        check_tiling(segments, n)?;
        for c in caches.iter() {
            ensure!(
                c.width == kvh * hd,
                "KV cache width {} does not match {kvh}×{hd}",
                c.width
            );
        }
        if n == 0 {
            return Ok(self.bf16_tensor(self.alloc_bf16(0)?, &[0, heads * hd]));
        }
        // The blocks of the fused projection [query/gate | key | value], read in place: base
        // pointers offset by each block's first column (bf16: 2 bytes per element), row stride
        // `width` elements.
        let qkv = self.bf16_of(x.qkv)?;
        let qg_ptr = self.p(qkv.s());
        let k_ptr = qg_ptr + 2 * (heads * 2 * hd) as u64;
        let v_ptr = k_ptr + 2 * (kvh * hd) as u64;
        let row = width as i64;
        let (qw, kw) = (self.f32_of(x.q_norm)?, self.f32_of(x.k_norm)?);
        let (cos, sin) = (self.f32_of(x.cos)?, self.f32_of(x.sin)?);
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
            self.reserve_kv(c, c.len + seg.len())?;
            if is_parent[si] {
                // The parent's own rows, this call's included, become the immutable prefix its
                // children read: the own buffers move into the shared part as they are (the
                // prep launch writes this call's rows into them), so nothing is copied.
                ensure!(
                    c.shared.is_none(),
                    "a parent's KV cache must not continue a shared cache"
                );
                let (k, v) = (c.k.take().expect("reserved"), c.v.take().expect("reserved"));
                let (kp, vp, before) = (self.p(&k), self.p(&v), c.len);
                c.shared = Some(Arc::new(SharedKv { k, v, len: before + seg.len() }));
                (c.cap, c.len) = (0, 0);
                meta.extend([seg.start as i64, seg.len() as i64, 0, 0, 0, kp as i64, vp as i64, before as i64]);
                continue;
            }
            let (sk, sv, sl) = match &c.shared {
                Some(s) => (self.p(&s.k), self.p(&s.v), s.len),
                None => (0, 0, 0),
            };
            let (kc, vc) = (
                c.k.as_ref().expect("reserved"),
                c.v.as_ref().expect("reserved"),
            );
            meta.extend([
                seg.start as i64,
                seg.len() as i64,
                sk as i64,
                sv as i64,
                sl as i64,
                self.p(kc) as i64,
                self.p(vc) as i64,
                c.len as i64,
            ]);
        }
        let meta = self.htod(&meta)?;
        let q = self.alloc_bf16(n * heads * hd)?;
        self.launch(
            "attn_prep",
            cfg((n as u32, 1, 1), 128, 0),
            &[
                A::P(qg_ptr),
                A::L(row),
                A::I((2 * hd) as i32),
                A::P(k_ptr),
                A::L(row),
                A::P(v_ptr),
                A::L(row),
                A::P(self.p(qw.s())),
                A::P(self.p(kw.s())),
                A::I(1),
                A::F(norm_eps),
                A::P(self.p(cos.s())),
                A::P(self.p(sin.s())),
                A::I(rot as i32),
                A::P(self.p(&meta)),
                A::I(segments.len() as i32),
                A::P(self.p(&q)),
                A::I(heads as i32),
                A::I(kvh as i32),
                A::I(hd as i32),
            ],
        )?;
        for ((seg, c), parent) in segments.iter().zip(caches.iter_mut()).zip(&is_parent) {
            if !parent {
                c.len += seg.len();
            }
        }
        let out = self.alloc_bf16(n * heads * hd)?;
        // The gate of head h, dim c, row t is qkv[t, h·2·hd + hd + c] (offset hd elements).
        let gate = (qg_ptr + 2 * hd as u64, width, 2 * hd);
        self.attention_core(&q, &meta, segments, heads, kvh, hd, true, Some(gate), &out)?;
        Ok(self.bf16_tensor(out, &[n, heads * hd]))
    }

    fn new_delta_state(&self, dims: &DeltaNetDims) -> Result<CudaDeltaState> {
        let conv_len = dims.conv_kernel.saturating_sub(1) * dims.conv_channels();
        let recurrent_len = dims.value_heads * dims.key_dim * dims.value_dim;
        Ok(CudaDeltaState {
            cur: Arc::new(DeltaBufs {
                buf: Arc::new(self.zeros_f32(conv_len + recurrent_len)?),
                conv: 0,
                recurrent: conv_len,
                conv_len,
                recurrent_len,
            }),
        })
    }

    fn gated_delta_net(
        &self,
        x: &DeltaNetInputs<CudaTensor>,
        dims: &DeltaNetDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        states: &mut [&mut CudaDeltaState],
    ) -> Result<CudaTensor> {
        let DeltaNetDims {
            key_heads: kh,
            value_heads: vh,
            key_dim: dk,
            value_dim: dv,
            conv_kernel: kw,
            norm_eps,
        } = *dims;
        let c = dims.conv_channels();
        ensure!(segments.len() == states.len(), "one state per segment");
        let crate::backend::Tree { parent, is_parent } = crate::backend::check_parents(parents, segments.len())?;
        let (n, pw) = x.proj.rows_cols();
        ensure!(
            pw == dims.proj_width(),
            "DeltaNet input width {pw} != {}",
            dims.proj_width()
        );
        ensure!(
            x.conv_weight.numel() == c * kw && kw >= 1,
            "conv weight shape"
        );
        ensure!(
            kh > 0 && vh % kh == 0,
            "{vh} value heads do not group over {kh} key heads"
        );
        ensure!(
            [16, 32, 64, 128].contains(&dk) && dv % 4 == 0,
            "DeltaNet key_dim {dk} / value_dim {dv}: the CUDA kernels support key_dim 16, 32, 64 or 128 and value_dim a multiple of 4"
        );
        ensure!(
            x.a_log.numel() == vh && x.dt_bias.numel() == vh && x.norm_weight.numel() == dv,
            "A_log/dt_bias/norm shapes"
        );
        check_tiling(segments, n)?;
        if n == 0 {
            return Ok(self.bf16_tensor(self.alloc_bf16(0)?, &[0, vh * dv]));
        }
        // The blocks of the fused projection [q | k | v | z | b | a], read in place: base pointers
        // offset by each block's first column (bf16: 2 bytes per element), row stride `pw`.
        let (proj, convw) = (self.bf16_of(x.proj)?, self.bf16_of(x.conv_weight)?);
        let qkv_ptr = self.p(proj.s());
        let z_ptr = qkv_ptr + 2 * c as u64;
        let b_ptr = z_ptr + 2 * (vh * dv) as u64;
        let a_ptr = b_ptr + 2 * vh as u64;
        let ld = pw as i64;
        let (alog, dtb, normw) = (
            self.f32_of(x.a_log)?,
            self.f32_of(x.dt_bias)?,
            self.f32_of(x.norm_weight)?,
        );
        let table = host::chunk_table(segments, host::DELTA_CHUNK);
        // Copy-on-write: states sharing their buffers (forks) get fresh ones, all from one
        // allocation; the kernels read the old arrays and write the new. Parents and the
        // children that fork them always get fresh ones (a parent's arrays before and after its
        // rows are both read during the call).
        let (conv_len, rec_len) = (kw.saturating_sub(1) * c, vh * dk * dv);
        let needs_fresh: Vec<bool> = (0..segments.len())
            .map(|si| is_parent[si] || parent[si].is_some() || Arc::get_mut(&mut states[si].cur).is_none())
            .collect();
        let shared = needs_fresh.iter().filter(|&&f| f).count();
        let fresh = if shared == 0 {
            None
        } else {
            Some(Arc::new(self.alloc_f32(shared * (conv_len + rec_len))?))
        };
        let stream = &self.inner.stream;
        // Table entries in launch order: parents, then the other independent sequences, then the
        // children. The conv history of the parents is written before the conv (their children
        // read it), everyone else's after it (an in-place history is read by the conv); the scan
        // of the children runs after everyone else's (they start from their parents' states).
        let rank = |si: usize| if is_parent[si] { 0 } else if parent[si].is_none() { 1 } else { 2 };
        let mut order: Vec<usize> = (0..segments.len()).collect();
        order.sort_by_key(|&si| rank(si));
        let parents_n = is_parent.iter().filter(|&&p| p).count();
        let roots_n = order.iter().filter(|&&si| rank(si) < 2).count();
        let mut conv_meta = Vec::with_capacity(4 * segments.len());
        let mut scan_meta = Vec::with_capacity(4 * segments.len());
        let mut entries = Vec::with_capacity(segments.len());
        // The arrays replaced below are read by the kernels: they must outlive the launches
        // (dropping the last reference frees the memory in stream order, before the kernels).
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
            let (conv_out, rec_out) = st.cur.ptrs(stream);
            let (seg, (first, count)) = (&segments[si], table.per_segment[si]);
            entries.push((
                [seg.start as i64, seg.len() as i64, conv_in as i64, conv_out as i64],
                [first as i64, count as i64, rec_in as i64, rec_out as i64],
            ));
        }
        for &si in &order {
            conv_meta.extend(entries[si].0);
            scan_meta.extend(entries[si].1);
        }
        let (conv_meta, scan_meta, chunks) = (
            self.htod(&conv_meta)?,
            self.htod(&scan_meta)?,
            self.htod(&table.chunks)?,
        );
        let qn = self.alloc_f32(n * kh * dk)?;
        let kn = self.alloc_f32(n * kh * dk)?;
        let vv = self.alloc_f32(n * vh * dv)?;
        let beta = self.alloc_f32(n * vh)?;
        let g = self.alloc_f32(n * vh)?;
        let nseg = segments.len();
        // gdn_conv: a thread owns 4 channels (C % 4 == 0 as dk % 16 == 0 and dv % 4 == 0) and
        // CONV_ROWS rows; it stores 4 f32 at once (16-byte aligned: fresh buffers, offsets in
        // multiples of 4 elements), and loads 4 bf16 at once when the projection allows it.
        const CONV_ROWS: usize = 8; // = CONV_ROWS in kernels/deltanet.cu
        for o in [&qn, &kn, &vv] {
            ensure!(self.p(o) % 16 == 0, "gdn_conv output buffers must be 16-byte aligned");
        }
        let vec = pw % 4 == 0 && qkv_ptr % 8 == 0;
        let groups = c / 4;
        let threads = groups.next_multiple_of(32).min(256);
        // Table entries `range` (in launch order) of a per-sequence launch: a pointer to the
        // first and the count.
        let part = |meta: &CudaSlice<i64>, range: Range<usize>| (self.p(meta) + 32 * range.start as u64, range.len());
        let conv_hist = |range: Range<usize>| -> Result<()> {
            let (meta, count) = part(&conv_meta, range);
            if count == 0 {
                return Ok(());
            }
            self.launch(
                "gdn_conv_hist",
                cfg((grid1(c, 256), count as u32, 1), 256, 0),
                &[A::P(qkv_ptr), A::L(ld), A::P(meta), A::I(c as i32), A::I(kw as i32)],
            )
        };
        conv_hist(0..parents_n)?;
        self.launch(
            "gdn_conv",
            cfg(
                (n.div_ceil(CONV_ROWS) as u32, groups.div_ceil(threads) as u32, 1),
                threads as u32,
                0,
            ),
            &[
                A::P(qkv_ptr),
                A::L(ld),
                A::I(vec as i32),
                A::P(self.p(convw.s())),
                A::I(kw as i32),
                A::P(self.p(&conv_meta)),
                A::I(nseg as i32),
                A::L(n as i64),
                A::P(b_ptr),
                A::P(a_ptr),
                A::P(self.p(alog.s())),
                A::P(self.p(dtb.s())),
                A::P(self.p(&qn)),
                A::P(self.p(&kn)),
                A::P(self.p(&vv)),
                A::P(self.p(&beta)),
                A::P(self.p(&g)),
                A::I(kh as i32),
                A::I(vh as i32),
                A::I(dk as i32),
                A::I(dv as i32),
            ],
        )?;
        conv_hist(parents_n..nseg)?;
        let core = self.alloc_f32(n * vh * dv)?;
        if !table.is_empty() {
            let (prep_smem, scan_smem) = host::delta_smem_bytes(dk);
            let tp =
                self.alloc_f32(table.len() * vh * 2 * host::DELTA_CHUNK * host::DELTA_CHUNK)?;
            self.launch(
                &format!("gdn_chunk_prep_{dk}"),
                cfg((table.len() as u32, kh as u32, 1), 256, prep_smem),
                &[
                    A::P(self.p(&qn)),
                    A::P(self.p(&kn)),
                    A::P(self.p(&beta)),
                    A::P(self.p(&g)),
                    A::P(self.p(&chunks)),
                    A::I(kh as i32),
                    A::I(vh as i32),
                    A::P(self.p(&tp)),
                ],
            )?;
            let (scan_name, scan_smem) = if self.inner.options.gdn_ffma {
                (format!("gdn_chunk_scan_{dk}"), scan_smem)
            } else {
                (format!("gdn_chunk_scan_tc_{dk}"), host::delta_tc_smem_bytes(dk))
            };
            for range in [0..roots_n, roots_n..nseg] {
                let (meta, count) = part(&scan_meta, range);
                if count == 0 {
                    continue;
                }
                self.launch(
                    &scan_name,
                    cfg((count as u32, vh as u32, dv.div_ceil(32) as u32), 256, scan_smem),
                    &[
                        A::P(self.p(&qn)),
                        A::P(self.p(&kn)),
                        A::P(self.p(&vv)),
                        A::P(self.p(&beta)),
                        A::P(self.p(&g)),
                        A::P(self.p(&tp)),
                        A::P(self.p(&chunks)),
                        A::P(meta),
                        A::I(kh as i32),
                        A::I(vh as i32),
                        A::I(dv as i32),
                        A::P(self.p(&core)),
                    ],
                )?;
            }
        }
        let y = self.gated_norm(&core, z_ptr, ld, vh, normw.s(), n, dv, norm_eps);
        drop(replaced);
        y
    }

    fn vision_attention(
        &self,
        qkv: &CudaTensor,
        cos: &CudaTensor,
        sin: &CudaTensor,
        heads: usize,
        segments: &[Range<usize>],
    ) -> Result<CudaTensor> {
        let (n, w) = qkv.rows_cols();
        ensure!(
            heads > 0 && w % (3 * heads) == 0,
            "vision qkv width {w} is not 3·heads·head_dim"
        );
        let hd = w / (3 * heads);
        let d = heads * hd;
        ensure!(
            hd <= 256 && hd % 2 == 0,
            "vision head_dim {hd} not supported"
        );
        ensure!(
            cos.rows_cols() == (n, hd) && sin.rows_cols() == (n, hd),
            "vision rotary shapes"
        );
        check_tiling(segments, n)?;
        if n == 0 {
            return Ok(self.bf16_tensor(self.alloc_bf16(0)?, &[0, d]));
        }
        let x = self.bf16_of(qkv)?;
        let (cs, sn) = (self.f32_of(cos)?, self.f32_of(sin)?);
        let q = self.alloc_bf16(n * d)?;
        let kb = self.alloc_bf16(n * d)?;
        let vb = self.alloc_bf16(n * d)?;
        let mut meta = Vec::with_capacity(8 * segments.len());
        for s in segments {
            let off = 2 * (s.start * d) as u64;
            meta.extend([
                s.start as i64,
                s.len() as i64,
                0,
                0,
                0,
                (self.p(&kb) + off) as i64,
                (self.p(&vb) + off) as i64,
                0,
            ]);
        }
        let meta = self.htod(&meta)?;
        let xp = self.p(x.s());
        let row = (3 * d) as i64;
        self.launch(
            "attn_prep",
            cfg((n as u32, 1, 1), 128, 0),
            &[
                A::P(xp),
                A::L(row),
                A::I(hd as i32),
                A::P(xp + 2 * d as u64),
                A::L(row),
                A::P(xp + 4 * d as u64),
                A::L(row),
                A::P(0),
                A::P(0),
                A::I(0),
                A::F(0.0),
                A::P(self.p(cs.s())),
                A::P(self.p(sn.s())),
                A::I(hd as i32),
                A::P(self.p(&meta)),
                A::I(segments.len() as i32),
                A::P(self.p(&q)),
                A::I(heads as i32),
                A::I(heads as i32),
                A::I(hd as i32),
            ],
        )?;
        let out = self.alloc_bf16(n * d)?;
        self.attention_core(&q, &meta, segments, heads, heads, hd, false, None, &out)?;
        Ok(self.bf16_tensor(out, &[n, d]))
    }
}
