//! The CUDA backend: the same [`Backend`] calls as the CPU reference, on an NVIDIA GPU.
//!
//! * One file per operation family, each beside its `.cu` file in `kernels/` and its CPU twin in
//!   `src/backend/cpu/`: [`linear`] (projections, LoRA, readout), [`quant`] (FP8 activations),
//!   [`norm`], [`attention`], [`deltanet`], [`elementwise`]. The plumbing they share:
//!   [`tensor`] (device tensors and views), [`staging`] (uploads), [`readback`] (readouts copied
//!   back without waiting), [`launch`] (the kernel table and launches), [`gemm`] (cuBLASLt),
//!   [`compile`] (NVRTC and the kernel cache), [`layout`] (planning that needs no GPU),
//!   [`profile`] (`IMAJEV_PROFILE=kernels`), [`tma`] (TMA tensor maps).
//! * Kernels are compiled by NVRTC for the running GPU at start-up and cached on disk as CUBIN.
//! * GEMMs go through cuBLASLt ([`gemm`]): block-scaled FP8 for projections stored as FP8 (or
//!   quantised at load with `quantize_fp8`), BF16 for the rest; LoRA stays unmerged in BF16.
//!   On Hopper by default ([`gemm_fp8`], `fp8_gemm`): the FP8 GEMMs on our own kernel with the LoRA
//!   B side in its epilogue.
//! * Precision follows a bf16 transformers run: activations are BF16 tensors, reductions, norms,
//!   softmax and gates run in f32, the DeltaNet state and chunked delta rule are f32, the readout
//!   is an f32 GEMM. Vectors (norm weights, biases, `A_log`, `dt_bias`) are kept in f32, other
//!   parameters in BF16.
//! * Fusions behind the same [`Backend`] calls (each kernel's CPU twin is the unfused ops composed):
//!   residual add with RMSNorm (`add_rms_norm`) and with LayerNorm (`add_layer_norm`); SwiGLU and
//!   GELU with the FP8 activation quantisation of the next projection (`swiglu_quant_1x128`,
//!   `gelu_quant_1x128`); and the row norms feeding FP8 projections (`rms_norm`, `add_rms_norm`,
//!   `layer_norm`, `add_layer_norm`, the DeltaNet `rms_norm_gated` with 128-wide heads) write the 1×128 FP8
//!   quantisation of their output beside it (`*_quant` kernels, bit-identical to
//!   `quant_act_1x128` on that output). That quantisation travels with the tensor
//!   ([`CudaTensor`]'s attachment, dropped by any in-place change), and `matmul` uses it instead
//!   of launching `quant_act_1x128`; norms attach it once an FP8 projection has been loaded.
//!   Opt-in on Hopper with the own FP8 GEMM (`swiglu_epilogue`): the MLP's SwiGLU and its
//!   quantisation in the gate/up GEMM's epilogue instead (`gemm_fp8_glu_<rows>`).
//!   Opt-in (`mlp_lora_fused`): the MLP's gate/up LoRA B side inside that SwiGLU kernel
//!   (`swiglu_mlp`, `swiglu_lora_quant_1x128_<r>`; its CPU twin is matmul + swiglu).
//! * One stream; cudarc's per-buffer event tracking is off (everything is stream-ordered, buffers
//!   are freed with `cuMemFreeAsync` on that stream), so kernels take raw device addresses.
//!
//! The crate always compiles this module (cudarc loads libcuda, NVRTC and cuBLASLt with `dlopen`
//! at first use), and [`CudaBackend::new`] returns an error instead of panicking on machines
//! without a GPU, driver or library.

pub mod attention;
pub mod compile;
pub mod deltanet;
pub mod elementwise;
pub mod gemm;
pub mod gemm_fp8;
pub mod launch;
pub mod layout;
pub mod linear;
pub mod narrow;
pub mod norm;
pub mod profile;
pub mod quant;
pub mod readback;
pub mod staging;
pub mod tensor;
pub mod tma;

pub use attention::{AttentionKernel, CudaKvCache};
pub use deltanet::{CudaDeltaState, GdnScan};
pub use linear::CudaLinear;
pub use readback::CudaReadout;
pub use tensor::CudaTensor;

use super::{
    AttentionDims, AttentionInputs, Backend, DeltaNetDims, DeltaNetInputs, Gelu, LinearPart, PatchGeometry,
    RgbImage,
};
use crate::weights::TensorRef;
use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use gemm::Blas;
use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// How the CUDA backend places weights and where it caches kernels.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// Quantise BF16/F32 projections whose dims are multiples of 128 to block FP8 at load (the
    /// RTN 128×128 recipe of `weights::fp8::quantize_fp8_blocks`). FP8 checkpoint weights are FP8 anyway.
    pub quantize_fp8: bool,
    /// Dequantise block-FP8 checkpoint projections to BF16 at load (BF16 GEMMs, no FP8 rounding
    /// of activations; twice the weight memory). Wins over `quantize_fp8`.
    pub dequantize_fp8: bool,
    /// Run the gated-delta chunk scan on CUDA cores (f32 FMA) instead of tensor cores.
    /// Default: `IMAJEV_GDN_FFMA=1` in the environment.
    pub gdn_ffma: bool,
    /// Which tensor-core chunk scan runs when `gdn_ffma` is off. Default ([`GdnScan::Auto`]): the
    /// warpgroup scan on Hopper, elsewhere by launch (the pipelined scan for launches with a long
    /// sequence, otherwise the plain one or, when its grid would take more than one wave, the wide
    /// one). The by-length scans give the same bits as each other; the split and warpgroup paths
    /// give their own. `IMAJEV_GDN_SCAN=by-length`, `plain-by-length`, `pipelined`, `plain`,
    /// `wide`, `split` or `warpgroup` in the environment picks one (read only when this field is
    /// left at [`GdnScan::Auto`]).
    pub gdn_scan: GdnScan,
    /// The tensor-core chunk scans' products as one TF32 MMA each (operands rounded to 10-bit
    /// mantissas, f32 accumulation; the default) rather than 3xTF32 (f32-level, `false`): about a
    /// third of the MMAs on the scan's sequential chain. Whole requests 8–12% faster on the H200,
    /// decisions within median |Δp| 1.4e-5 of 3xTF32 (bench/NOTES.md); plain and pipelined give
    /// the same bits as each other either way. `IMAJEV_GDN_TF32=0` in the environment turns it off.
    pub gdn_tf32: bool,
    /// Which warpgroup scan runs with [`GdnScan::Warpgroup`]: `None` by the launch (the producer
    /// version `gdn_chunk_scan_wg_<dk>` when its longest sequence has at least
    /// [`deltanet::PIPELINED_MIN_CHUNKS`] chunks, else the one-warpgroup `gdn_chunk_scan_wg1_<dk>`),
    /// `Some(true)` / `Some(false)` always one of them. Both give the same bits. Default:
    /// `IMAJEV_GDN_WG=producer|one` in the environment (read only when left at `None`).
    pub gdn_wg_producer: Option<bool>,
    /// Whether the warpgroup scan's short launches (no producer) run two consumer warpgroups a
    /// block that share one (sequence, value head)'s copies (`gdn_chunk_scan_wg2_<dk>`) rather than
    /// a block per 64 value columns (`gdn_chunk_scan_wg1_<dk>`): half the blocks, the same bits.
    /// `IMAJEV_GDN_WG_PAIR=1` (or `0`) in the environment sets it.
    pub gdn_wg_pair: bool,
    /// Whether the warpgroup scan's short launches (no producer, not paired) run
    /// `gdn_chunk_scan_wgl_<dk>` instead of `gdn_chunk_scan_wg1_<dk>`: the same warpgroup in a
    /// third of the shared memory (T, P and K^T copied over a chunk's Q and K once its first
    /// products are done, nothing copied ahead), so two blocks share an SM; the same bits. Default
    /// true: on an H100 the scan of 96 passes 0.68x wg1's time, packed rounds ~2% more requests/s,
    /// no request slower (bench/NOTES.md, twenty-sixth session). `IMAJEV_GDN_WG_LEAN=0` (or `1`)
    /// in the environment sets it.
    pub gdn_wg_lean: bool,
    /// How `gdn_conv` walks rows: each thread streams its channels' input rows through a register
    /// window, a group of rows ahead ([`deltanet::ConvTiling`]: the group's rows, 8 or 4, and the
    /// groups a block). `None`: by the row count ([`deltanet::ConvTiling::for_rows`]). The same
    /// bits for every tiling (a speed choice). `IMAJEV_GDN_CONV=<rows>x<groups>` (e.g. `8x4`) in
    /// the environment sets it when left at `None`.
    pub gdn_conv: Option<deltanet::ConvTiling>,
    /// Quantise the inputs of FP8 projections in their own kernel (`quant_act_1x128`) also when
    /// they come from a row norm, a SwiGLU or a GELU, instead of the fused `*_quant` kernels: the
    /// reference the fused path is tested against (same bits), and a switch for profiling. Default:
    /// `IMAJEV_UNFUSED_ACT_QUANT=1` in the environment.
    pub unfused_act_quant: bool,
    /// The MLP's gate/up LoRA B side inside the SwiGLU + FP8 quantisation kernel
    /// (`swiglu_lora_quant_1x128_<r>`: the gate/up output read once instead of three times)
    /// rather than a separate accumulating LoRA B GEMM. On by default (H200: the 96-sequence
    /// round 127 → 122 ms, whole requests unchanged); `IMAJEV_MLP_LORA_FUSED=0` (or `1`) in the
    /// environment sets it.
    pub mlp_lora_fused: bool,
    /// Which attention kernel runs (see [`AttentionKernel`]): the reference kernels are kept for
    /// comparisons and profiling. `IMAJEV_ATTENTION=auto|ov|ws|wgmma|q128|q64` overrides it when this
    /// field is left at `Auto`.
    pub attention: AttentionKernel,
    /// Which narrow BF16 GEMMs run on our kernels (`narrow.rs`: n <= 128, i.e. DeltaNet a/b and
    /// LoRA A; k <= 256 accumulating, i.e. LoRA B) rather than cuBLASLt, for comparisons.
    /// Default: `IMAJEV_NARROW_GEMM=both|n|k|cublas` in the environment, else cublas.
    pub narrow_gemm: narrow::NarrowGemm,
    /// Which kernel runs the block-scaled FP8 GEMMs ([`gemm_fp8::Fp8Gemm`]): on Hopper our own
    /// `gemm_fp8_192` with the LoRA B side in its epilogue (the default), `gemm_fp8_128`, their
    /// cluster forms, their forms that store a tile under the next tile's first MMAs, or cuBLASLt
    /// (what runs off Hopper), or `by-shape` (per launch). `IMAJEV_FP8_GEMM=cublas|own|own192|own128m|
    /// own192m|own128d|own192d|by-shape` in the environment sets it when left at the default.
    pub fp8_gemm: gemm_fp8::Fp8Gemm,
    /// Whether LoRA A sides (`T = x·Aᵀ`, BF16, N = the rank) run on the FP8 kernel's BF16 form
    /// (`gemm_bf16_<rows>`) rather than cuBLASLt, on Hopper with an own FP8 GEMM, summed by
    /// 256-column K slices; up to [`CudaOptions::lora_a_split_rows`] rows split into a unit per
    /// tile (the height of `fp8_gemm`'s) and slice, past them whole on 64-row tiles (the same
    /// bits). Opt-in: on an H100 as fast as
    /// cuBLASLt's A side at 977 rows, whole requests 0.98-1.03x (bench/NOTES.md, twenty-first
    /// session). `IMAJEV_LORA_A=own|cublas`.
    pub lora_a_own: bool,
    /// Whether the MLP's gate/up projection runs on the FP8 kernel's GLU form
    /// (`gemm_fp8_glu_<rows>`: the SwiGLU and the down projection's FP8 input in its epilogue, so
    /// the 2·9,216-wide gate/up output is never stored) rather than the GEMM then
    /// `swiglu_quant_1x128`; the same bits. On Hopper with an own FP8 GEMM. Opt-in: on an H100
    /// (bench/NOTES.md, nineteenth session) the MLP took 1.39x as long at 977 rows, 1.01x at
    /// 7,816 and 0.99x at 16,384 (the SwiGLU's `expf` and divisions and the codes' divisions run
    /// on the consumer warpgroups while the tensor cores wait, ~3 µs a tile, and a GLU tile needs
    /// both parts' LoRA ranks); whole requests 1.11x at 256 tokens, 1.00x at 4K-16K.
    /// `IMAJEV_SWIGLU_EPILOGUE=1` (or `0`) in the environment sets it.
    pub swiglu_epilogue: bool,
    /// Up to how many rows the own LoRA A side (`lora_a_own`) runs split over K slices then summed
    /// (`gemm_bf16_slices_sum`) rather than whole (the same bits either way: a speed choice);
    /// `None`: [`layout::LORA_A_SPLIT_ROWS`]. For measurements and the tests.
    pub lora_a_split_rows: Option<usize>,
    /// Tile height of the own LoRA A side's whole form, past `lora_a_split_rows` (64, 128 or 192
    /// rows; the same bits on each); `None`: [`layout::LORA_A_WHOLE_TILE_ROWS`]. For measurements
    /// and the tests.
    pub lora_a_whole_rows: Option<usize>,
    /// From how many rows a narrow-output GEMM runs whole rather than split (the same bits either
    /// way: a speed choice); `None`: [`narrow::WHOLE_ROWS`]. For measurements.
    pub narrow_whole_rows: Option<usize>,
    /// From how many query rows `AttentionKernel::Auto` runs a head-dim-256 sequence on
    /// `attn_fwd_ws_256` (key/value tiles by TMA) rather than `attn_fwd_wgmma_256`; the same bits
    /// either way (a speed choice that may follow a sequence's own length). `Some(0)`: never.
    /// `None`: `IMAJEV_ATTENTION_WS_ROWS=<rows>` in the environment (0: never), else
    /// [`layout::ATTENTION_WS_MIN_ROWS`].
    pub attention_ws_rows: Option<usize>,
    /// Whether our kernels are launched with programmatic dependent launch (sm_90 only): each may
    /// launch while the previous kernel of the stream finishes, and waits in its first statement
    /// (`pdl_begin`, kernels/common.cuh) until that kernel's writes are visible, so launches and
    /// block scheduling overlap the previous kernel's last wave instead of following it. The same
    /// work in the same order: the same bits. `None`: `IMAJEV_PDL=1` (or `0`) in the
    /// environment, else off (on an H100 whole requests and packed rounds were within noise of it
    /// off: the engine keeps the queue full; bench/NOTES.md, thirty-first session).
    pub pdl: Option<bool>,
    /// Kernel cache folder; default `$IMAJEV_KERNEL_CACHE`, `$XDG_CACHE_HOME/imajev-serve/kernels`
    /// or `~/.cache/imajev-serve/kernels`.
    pub kernel_cache_dir: Option<PathBuf>,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            quantize_fp8: false,
            dequantize_fp8: false,
            gdn_ffma: false,
            gdn_scan: GdnScan::default(),
            gdn_tf32: true,
            gdn_wg_producer: None,
            gdn_wg_pair: false,
            gdn_wg_lean: true,
            gdn_conv: None,
            unfused_act_quant: false,
            mlp_lora_fused: true,
            attention: AttentionKernel::default(),
            narrow_gemm: narrow::NarrowGemm::default(),
            fp8_gemm: gemm_fp8::Fp8Gemm::default(),
            lora_a_own: false,
            swiglu_epilogue: false,
            lora_a_split_rows: None,
            lora_a_whole_rows: None,
            narrow_whole_rows: None,
            attention_ws_rows: None,
            pdl: None,
            kernel_cache_dir: None,
        }
    }
}

/// What the backend runs on.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors: how many blocks of a kernel run at once is this times its
    /// occupancy ([`CudaBackend::resident_blocks`]).
    pub multiprocessors: usize,
    pub driver_version: i32,
    pub nvrtc_version: (i32, i32),
    pub cublaslt_version: usize,
    pub arch: String,
    pub kernels_cached: usize,
    pub kernels_compiled: usize,
    pub kernel_seconds: f64,
}

impl DeviceInfo {
    /// Hopper (sm_90): where the wgmma kernels (attention, the warpgroup DeltaNet scan) run.
    pub fn hopper(&self) -> bool {
        self.compute_capability == (9, 0)
    }
}

/// The CUDA backend (cheap to clone: clones share the context, stream, kernels and GEMM plans).
#[derive(Clone)]
pub struct CudaBackend {
    state: Arc<DeviceState>,
}

/// What every clone of a backend shares.
struct DeviceState {
    // Field order is drop order: GEMM plans, kernels and staging before the stream and context.
    blas: Blas,
    funcs: HashMap<&'static str, CudaFunction>,
    staging: std::sync::Mutex<staging::Staging>,
    /// Pinned buffers of finished readouts, for the next ones ([`readback`]).
    readback: readback::PinnedPool,
    /// The mark of the previous [`Backend::pace`] call (an event after the work queued then).
    pace: std::sync::Mutex<Option<cudarc::driver::CudaEvent>>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    options: CudaOptions,
    info: DeviceInfo,
    profiler: Option<profile::KernelProfiler>,
    /// Set once a projection with an FP8 group exists: from then on the row norms write the FP8
    /// quantisation of their output for the projection that reads it (before, it would be unused).
    /// A hint only: results are the same bits with or without it.
    fp8_linears: AtomicBool,
    /// [`CudaBackend::resident_blocks`] and `resident_clusters` by (kernel, block size, dynamic
    /// shared memory).
    resident: std::sync::Mutex<HashMap<(String, u32, usize), usize>>,
    /// TMA tensor maps already encoded ([`tma::TensorMapCache`]).
    tensor_maps: tma::TensorMapCache,
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles (or loads cached) kernels and creates the cuBLASLt handle.
    /// Returns an error, never panics, when the driver, a library or the GPU is missing.
    pub fn new(ordinal: usize, options: CudaOptions) -> Result<Self> {
        let mut options = options;
        if std::env::var("IMAJEV_GDN_FFMA").is_ok_and(|v| v == "1") {
            options.gdn_ffma = true;
        }
        if options.attention == AttentionKernel::Auto {
            match std::env::var("IMAJEV_ATTENTION").as_deref() {
                Ok("") | Err(_) => {}
                Ok(v) => {
                    options.attention = AttentionKernel::parse(v).ok_or_else(|| {
                        anyhow!("IMAJEV_ATTENTION={v}: expected {}", AttentionKernel::expected())
                    })?
                }
            }
        }
        if options.attention_ws_rows.is_none() {
            if let Ok(v) = std::env::var("IMAJEV_ATTENTION_WS_ROWS") {
                if !v.is_empty() {
                    let rows = v.parse().map_err(|_| {
                        anyhow!("IMAJEV_ATTENTION_WS_ROWS={v}: expected a row count (0: never)")
                    })?;
                    options.attention_ws_rows = Some(rows);
                }
            }
        }
        if options.pdl.is_none() {
            options.pdl = match std::env::var("IMAJEV_PDL").as_deref() {
                Ok("1") => Some(true),
                Ok("0") => Some(false),
                Ok("") | Err(_) => None,
                Ok(other) => bail!("IMAJEV_PDL={other}: expected 1 (programmatic dependent launch) or 0"),
            };
        }
        if options.gdn_scan == GdnScan::Auto {
            match std::env::var("IMAJEV_GDN_SCAN").as_deref() {
                Ok("by-length") => options.gdn_scan = GdnScan::ByLength,
                Ok("pipelined") => options.gdn_scan = GdnScan::Pipelined,
                Ok("plain") => options.gdn_scan = GdnScan::Plain,
                Ok("split") => options.gdn_scan = GdnScan::Split,
                Ok("wide") => options.gdn_scan = GdnScan::Wide,
                Ok("warpgroup") => options.gdn_scan = GdnScan::Warpgroup,
                Ok("plain-by-length") => options.gdn_scan = GdnScan::PlainByLength,
                Ok("") | Ok("auto") | Err(_) => {}
                Ok(other) => bail!(
                    "IMAJEV_GDN_SCAN={other}: expected auto, by-length, plain-by-length, pipelined, plain, wide, split or warpgroup"
                ),
            }
        }
        if options.gdn_wg_producer.is_none() {
            match std::env::var("IMAJEV_GDN_WG").as_deref() {
                Ok("producer") => options.gdn_wg_producer = Some(true),
                Ok("one") => options.gdn_wg_producer = Some(false),
                Ok("") | Ok("by-length") | Err(_) => {}
                Ok(other) => bail!("IMAJEV_GDN_WG={other}: expected by-length, producer or one"),
            }
        }
        if options.gdn_conv.is_none() {
            if let Ok(v) = std::env::var("IMAJEV_GDN_CONV") {
                if !v.is_empty() {
                    options.gdn_conv = Some(v.parse().map_err(|e| anyhow!("IMAJEV_GDN_CONV={v}: {e}"))?);
                }
            }
        }
        match std::env::var("IMAJEV_GDN_WG_PAIR").as_deref() {
            Ok("1") => options.gdn_wg_pair = true,
            Ok("0") => options.gdn_wg_pair = false,
            Ok("") | Err(_) => {}
            Ok(other) => bail!("IMAJEV_GDN_WG_PAIR={other}: expected 1 (two warpgroups a block) or 0"),
        }
        match std::env::var("IMAJEV_GDN_WG_LEAN").as_deref() {
            Ok("1") => options.gdn_wg_lean = true,
            Ok("0") => options.gdn_wg_lean = false,
            Ok("") | Err(_) => {}
            Ok(other) => bail!("IMAJEV_GDN_WG_LEAN={other}: expected 1 (two lean blocks an SM) or 0"),
        }
        match std::env::var("IMAJEV_GDN_TF32").as_deref() {
            Ok("1") => options.gdn_tf32 = true,
            Ok("0") => options.gdn_tf32 = false,
            Ok("") | Err(_) => {}
            Ok(other) => {
                bail!("IMAJEV_GDN_TF32={other}: expected 1 (TF32 products, the default) or 0 (3xTF32)")
            }
        }
        if let Ok(v) = std::env::var("IMAJEV_NARROW_GEMM") {
            if !v.is_empty() {
                options.narrow_gemm = v.parse().map_err(|e| anyhow!("IMAJEV_NARROW_GEMM={v}: {e}"))?;
            }
        }
        if options.fp8_gemm == gemm_fp8::Fp8Gemm::default() {
            if let Ok(v) = std::env::var("IMAJEV_FP8_GEMM") {
                if !v.is_empty() {
                    options.fp8_gemm = v.parse().map_err(|e| anyhow!("IMAJEV_FP8_GEMM={v}: {e}"))?;
                }
            }
        }
        match std::env::var("IMAJEV_LORA_A").as_deref() {
            Ok("own") => options.lora_a_own = true,
            Ok("cublas") => options.lora_a_own = false,
            Ok("") | Err(_) => {}
            Ok(other) => bail!("IMAJEV_LORA_A={other}: expected own or cublas (the default)"),
        }
        match std::env::var("IMAJEV_SWIGLU_EPILOGUE").as_deref() {
            Ok("1") => options.swiglu_epilogue = true,
            Ok("0") => options.swiglu_epilogue = false,
            Ok("") | Err(_) => {}
            Ok(other) => bail!(
                "IMAJEV_SWIGLU_EPILOGUE={other}: expected 1 (the SwiGLU in the gate/up GEMM's epilogue) or 0 (the default)"
            ),
        }
        if std::env::var("IMAJEV_UNFUSED_ACT_QUANT").is_ok_and(|v| v == "1") {
            options.unfused_act_quant = true;
        }
        match std::env::var("IMAJEV_MLP_LORA_FUSED").as_deref() {
            Ok("1") => options.mlp_lora_fused = true,
            Ok("0") => options.mlp_lora_fused = false,
            Ok("") | Err(_) => {}
            Ok(other) => {
                bail!("IMAJEV_MLP_LORA_FUSED={other}: expected 1 (fused) or 0 (a separate LoRA B GEMM)")
            }
        }
        gemm_fp8::whole_consumers(options.lora_a_whole_rows).context("CudaOptions::lora_a_whole_rows")?;
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
        ensure!(ordinal < count as usize, "CUDA device {ordinal} does not exist ({count} present)");
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
        ensure!(
            cc.0 >= 8,
            "GPU compute capability {}.{} is too old: the kernels need bf16 mma.sync (sm_80 or newer)",
            cc.0,
            cc.1
        );
        let mut driver = 0i32;
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }.result()?;
        let name = ctx.name()?;
        let multiprocessors = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as usize;
        let nvrtc = compile::nvrtc_version()?;
        let arch = layout::gpu_arch(cc.0, cc.1);
        let started = std::time::Instant::now();
        let (funcs, cached, compiled) =
            compile::load_kernels(&ctx, &options, &arch, &compile::device_tag(cc, nvrtc))?;
        let kernel_seconds = started.elapsed().as_secs_f64();
        let blas = Blas::new(stream.clone())?;
        let staging = std::sync::Mutex::new(staging::Staging::new(stream.clone())?);
        let info = DeviceInfo {
            ordinal,
            name,
            compute_capability: cc,
            multiprocessors,
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
            gdn_scan = match options.gdn_scan {
                _ if options.gdn_ffma => "ffma",
                // What the default runs at the key dims it has a warpgroup scan for (128 in Qwen3.5).
                GdnScan::Auto if deltanet::warpgroup_scan_runs(&options, 128, info.hopper()) => {
                    GdnScan::Warpgroup.describe()
                }
                GdnScan::Auto => GdnScan::ByLength.describe(),
                other => other.describe(),
            },
            gdn_products = if options.gdn_tf32 { "TF32" } else { "3xTF32" },
            act_quant = if options.unfused_act_quant {
                "own kernel"
            } else {
                "fused into the norms, SwiGLU and GELU"
            },
            narrow_gemm = options.narrow_gemm.describe(),
            fp8_gemm = options.fp8_gemm.on(info.hopper()).describe(),
            "CUDA backend ready"
        );
        let profiler = profile::KernelProfiler::from_env(&stream);
        Ok(CudaBackend {
            state: Arc::new(DeviceState {
                blas,
                funcs,
                staging,
                readback: Default::default(),
                pace: std::sync::Mutex::new(None),
                stream,
                ctx,
                options,
                info,
                profiler,
                fp8_linears: AtomicBool::new(false),
                resident: Default::default(),
                tensor_maps: Default::default(),
            }),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.state.info
    }

    pub fn options(&self) -> &CudaOptions {
        &self.state.options
    }

    /// The cuBLASLt algorithm chosen per GEMM shape so far.
    pub fn gemm_plans(&self) -> Vec<gemm::PlanInfo> {
        self.state.blas.plans()
    }

    /// GEMM calls that had to leave their shape's fixed (batch-invariant) algorithm.
    pub fn gemm_fallbacks(&self) -> usize {
        self.state.blas.fallbacks()
    }

    /// Waits for all queued GPU work (and surfaces asynchronous errors).
    pub fn synchronize(&self) -> Result<()> {
        self.state.stream.synchronize()?;
        Ok(())
    }

    /// The per-kernel report since the last one (`IMAJEV_PROFILE=kernels`), else None.
    pub fn kernel_report(&self) -> Result<Option<String>> {
        self.state.profiler.as_ref().map(|p| p.report()).transpose()
    }
}

/// Each operation's body lives in the file of its family (`norm::rms_norm`, ...); this impl only
/// routes the trait's calls there.
impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Linear = CudaLinear;
    type KvCache = CudaKvCache;
    type DeltaState = CudaDeltaState;
    type Readout = CudaReadout;
    /// An event recorded after the work queued so far.
    type Marker = cudarc::driver::CudaEvent;

    fn kernel_report(&self) -> Result<Option<String>> {
        CudaBackend::kernel_report(self)
    }

    fn synchronize(&self) -> Result<()> {
        self.state.stream.synchronize()?;
        Ok(())
    }

    fn queues_work(&self) -> bool {
        true
    }

    fn marker(&self) -> Result<cudarc::driver::CudaEvent> {
        Ok(self.state.stream.record_event(None)?)
    }

    fn wait_marker(&self, marker: &cudarc::driver::CudaEvent) -> Result<()> {
        marker.synchronize()?;
        Ok(())
    }

    fn pace(&self) -> Result<()> {
        let now = self.marker()?;
        let before = self.state.pace.lock().unwrap_or_else(|p| p.into_inner()).replace(now);
        if let Some(e) = before {
            self.wait_marker(&e)?;
        }
        Ok(())
    }

    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn describe(&self) -> String {
        let i = &self.state.info;
        format!(
            "cuda ({}, {}, driver {}, NVRTC {}.{}, cuBLASLt {}; bf16 activations, block-FP8 GEMMs{})",
            i.name,
            i.arch,
            i.driver_version,
            i.nvrtc_version.0,
            i.nvrtc_version.1,
            i.cublaslt_version,
            if self.state.options.quantize_fp8 { ", BF16 weights quantised to FP8 at load" } else { "" }
        )
    }

    fn param(&self, t: &TensorRef) -> Result<CudaTensor> {
        tensor::param(self, t)
    }

    fn param_f32(&self, t: &TensorRef) -> Result<CudaTensor> {
        tensor::param_f32(self, t)
    }

    fn linear(&self, parts: &[LinearPart]) -> Result<CudaLinear> {
        linear::linear(self, parts)
    }

    fn linear_out(&self, w: &CudaLinear) -> usize {
        w.out_dim
    }

    fn tensor_bytes(&self, t: &CudaTensor) -> usize {
        t.bytes()
    }

    fn linear_bytes(&self, w: &CudaLinear) -> usize {
        w.bytes()
    }

    fn memory_probe(&self) -> Option<crate::backend::MemoryProbe> {
        // The driver's free/total of the device (cuMemGetInfo, which binds the context to the
        // calling thread first): callable from the HTTP threads at scrape time.
        let ctx = self.state.ctx.clone();
        Some(std::sync::Arc::new(move || {
            let (free, total) = ctx.mem_get_info()?;
            Ok(crate::backend::DeviceMemory { used: total.saturating_sub(free) as u64, total: total as u64 })
        }))
    }

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<CudaTensor> {
        tensor::upload(self, data, shape)
    }

    fn download(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        tensor::download(self, t)
    }

    fn shape<'t>(&self, t: &'t CudaTensor) -> &'t [usize] {
        &t.shape
    }

    fn reshape(&self, t: CudaTensor, shape: &[usize]) -> Result<CudaTensor> {
        tensor::reshape(t, shape)
    }

    fn embed(&self, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
        elementwise::embed(self, table, ids)
    }

    fn image_patches(&self, images: &[RgbImage<'_>], g: PatchGeometry) -> Result<CudaTensor> {
        elementwise::image_patches(self, images, g)
    }

    fn embed_bag(&self, table: &CudaTensor, idx: &[u32], w: &[f32], taps: usize) -> Result<CudaTensor> {
        elementwise::embed_bag(self, table, idx, w, taps)
    }

    fn scatter_rows(&self, dst: &mut CudaTensor, rows: &[usize], src: &CudaTensor) -> Result<()> {
        elementwise::scatter_rows(self, dst, rows, src)
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        elementwise::gather_rows(self, x, rows)
    }

    fn split_cols(&self, x: &CudaTensor, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        elementwise::split_cols(self, x, widths)
    }

    fn concat_rows(&self, parts: &[&CudaTensor]) -> Result<CudaTensor> {
        elementwise::concat_rows(self, parts)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaLinear) -> Result<CudaTensor> {
        linear::matmul(self, x, w)
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaTensor, eps: f32, offset: f32) -> Result<CudaTensor> {
        norm::rms_norm(self, x, w, eps, offset)
    }

    fn layer_norm(&self, x: &CudaTensor, w: &CudaTensor, b: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        norm::layer_norm(self, x, w, b, eps)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        elementwise::add_assign(self, x, y)
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
        offset: f32,
    ) -> Result<CudaTensor> {
        norm::add_rms_norm(self, x, y, w, eps, offset)
    }

    fn add_layer_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        norm::add_layer_norm(self, x, y, w, b, eps)
    }

    fn swiglu(&self, gate_up: &CudaTensor) -> Result<CudaTensor> {
        elementwise::swiglu(self, gate_up)
    }

    fn swiglu_matmul(&self, gate_up: &CudaTensor, w: &CudaLinear) -> Result<CudaTensor> {
        quant::swiglu_matmul(self, gate_up, w)
    }

    fn swiglu_mlp(&self, x: &CudaTensor, gate_up: &CudaLinear, down: &CudaLinear) -> Result<CudaTensor> {
        quant::swiglu_mlp(self, x, gate_up, down)
    }

    fn gelu(&self, x: &mut CudaTensor, kind: Gelu) -> Result<()> {
        elementwise::gelu(self, x, kind)
    }

    fn gelu_matmul(&self, x: &mut CudaTensor, kind: Gelu, w: &CudaLinear) -> Result<CudaTensor> {
        quant::gelu_matmul(self, x, kind, w)
    }

    fn readout_start(&self, h: &CudaTensor, w: &CudaTensor) -> Result<CudaReadout> {
        linear::readout_start(self, h, w)
    }

    fn readout_finish(&self, pending: CudaReadout) -> Result<Vec<f32>> {
        self.readback_finish(pending)
    }

    fn new_kv_cache(&self, dims: &AttentionDims) -> Result<CudaKvCache> {
        attention::new_kv_cache(dims)
    }

    fn kv_len(&self, cache: &CudaKvCache) -> usize {
        attention::kv_len(cache)
    }

    fn share_kv(&self, c: &mut CudaKvCache) -> Result<()> {
        attention::share_kv(self, c)
    }

    fn gated_attention(
        &self,
        x: &AttentionInputs<CudaTensor>,
        dims: &AttentionDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        caches: &mut [&mut CudaKvCache],
    ) -> Result<CudaTensor> {
        attention::gated_attention(self, x, dims, segments, parents, caches)
    }

    fn gated_attention_last_rows(
        &self,
        x: &AttentionInputs<CudaTensor>,
        dims: &AttentionDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        caches: &mut [&mut CudaKvCache],
    ) -> Result<CudaTensor> {
        attention::gated_attention_last_rows(self, x, dims, segments, parents, caches)
    }

    fn new_delta_state(&self, dims: &DeltaNetDims) -> Result<CudaDeltaState> {
        deltanet::new_delta_state(self, dims)
    }

    fn gated_delta_net(
        &self,
        x: &DeltaNetInputs<CudaTensor>,
        dims: &DeltaNetDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        states: &mut [&mut CudaDeltaState],
        keep: &[bool],
    ) -> Result<CudaTensor> {
        deltanet::gated_delta_net(self, x, dims, segments, parents, states, keep)
    }

    fn vision_attention(
        &self,
        qkv: &CudaTensor,
        cos: &CudaTensor,
        sin: &CudaTensor,
        heads: usize,
        segments: &[Range<usize>],
    ) -> Result<CudaTensor> {
        attention::vision_attention(self, qkv, cos, sin, heads, segments)
    }
}
