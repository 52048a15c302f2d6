//! How the backend starts work on the GPU: the one table of kernels (which `.cu` file, which
//! functions, how much dynamic shared memory each may use), kernel arguments, launch shapes,
//! and the launch and GEMM calls (timed per kernel when `IMAJEV_PROFILE=kernels`).
//!
//! Adding a kernel means one row here and its code in `kernels/`; [`super::compile`] builds and
//! loads every file of the table and sets each function's shared-memory limit from it.

use super::gemm::Gemm;
use super::layout;
use super::tma::TensorMap;
use super::CudaBackend;
use anyhow::{anyhow, Result};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

/// One `.cu` file of `kernels/` (embedded in the binary) and the functions loaded from it.
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    pub functions: &'static [KernelFn],
}

/// A kernel function and the dynamic shared memory it is allowed (0: the 48 KiB default).
#[derive(Debug, Clone, Copy)]
pub struct KernelFn {
    pub name: &'static str,
    pub max_dynamic_smem: usize,
}

const fn k(name: &'static str) -> KernelFn {
    KernelFn { name, max_dynamic_smem: 0 }
}

const fn k_smem(name: &'static str, bytes: usize) -> KernelFn {
    KernelFn { name, max_dynamic_smem: bytes }
}

/// Every kernel the backend launches.
pub const KERNELS: &[KernelFile] = &[
    KernelFile {
        name: "elementwise",
        source: include_str!("../../../kernels/elementwise.cu"),
        functions: &[
            k("cast_f32_bf16"),
            k("cast_bf16_f32"),
            k("gather_rows"),
            k("scatter_rows"),
            k("copy_cols"),
            k("embed_bag"),
            k("image_patches"),
            k("add_bf16"),
            k("add_bias"),
            k("add_bias8"),
            k("swiglu"),
            k("gelu"),
            k("readout_f32"),
        ],
    },
    KernelFile {
        name: "gemm_narrow",
        source: include_str!("../../../kernels/gemm_narrow.cu"),
        functions: &[
            k("gemm_narrow_32"),
            k("gemm_narrow_64"),
            k("gemm_narrow_128"),
            k("gemm_narrow_whole_32"),
            k("gemm_narrow_whole_64"),
            k("gemm_narrow_whole_128"),
            k("gemm_narrow_sum"),
            k_smem("gemm_narrow_k_acc", super::narrow::ACC_SMEM_BYTES),
        ],
    },
    KernelFile {
        name: "gemm_fp8",
        source: include_str!("../../../kernels/gemm_fp8.cu"),
        functions: &[
            k_smem("gemm_fp8_128", layout::gemm_fp8_smem_bytes(2)),
            k_smem("gemm_fp8_192", layout::gemm_fp8_smem_bytes(3)),
            k_smem("gemm_fp8_128m", layout::gemm_fp8_smem_bytes(2)),
            k_smem("gemm_fp8_192m", layout::gemm_fp8_smem_bytes(3)),
            k_smem("gemm_fp8_128d", layout::gemm_fp8_smem_bytes(2)),
            k_smem("gemm_fp8_192d", layout::gemm_fp8_smem_bytes(3)),
            k_smem("gemm_bf16_64", layout::gemm_fp8_smem_bytes(1)),
            k_smem("gemm_bf16_128", layout::gemm_fp8_smem_bytes(2)),
            k_smem("gemm_bf16_192", layout::gemm_fp8_smem_bytes(3)),
            k_smem("gemm_fp8_glu_128", layout::gemm_fp8_smem_bytes(2)),
            k_smem("gemm_fp8_glu_192", layout::gemm_fp8_smem_bytes(3)),
            k("gemm_bf16_slices_sum"),
        ],
    },
    KernelFile {
        name: "norm",
        source: include_str!("../../../kernels/norm.cu"),
        functions: &[
            k("rms_norm"),
            k("rms_norm_quant"),
            k("add_rms_norm"),
            k("add_rms_norm_quant"),
            k("layer_norm"),
            k("layer_norm_quant"),
            k("add_layer_norm"),
            k("add_layer_norm_quant"),
            k("rms_norm_gated"),
            k("rms_norm_gated_quant"),
        ],
    },
    KernelFile {
        name: "quant",
        source: include_str!("../../../kernels/quant.cu"),
        functions: &[
            k("quant_act_1x128"),
            k("swiglu_quant_1x128"),
            k("gelu_quant_1x128"),
            k_smem("swiglu_lora_quant_1x128_16", layout::swiglu_lora_smem_bytes(16)),
            k_smem("swiglu_lora_quant_1x128_32", layout::swiglu_lora_smem_bytes(32)),
            k_smem("swiglu_lora_quant_1x128_64", layout::swiglu_lora_smem_bytes(64)),
        ],
    },
    KernelFile {
        name: "attention",
        // attention_overlap.cu and attention_split.cu continue attention.cu (they use its helpers):
        // one compilation unit.
        source: concat!(
            include_str!("../../../kernels/attention.cu"),
            include_str!("../../../kernels/attention_overlap.cu"),
            include_str!("../../../kernels/attention_split.cu")
        ),
        functions: &[
            k("attn_prep"),
            k_smem("attn_fwd_16", layout::attention_smem_bytes(16)),
            k_smem("attn_fwd_32", layout::attention_smem_bytes(32)),
            k_smem("attn_fwd_64", layout::attention_smem_bytes(64)),
            k_smem("attn_fwd_128", layout::attention_smem_bytes(128)),
            k_smem("attn_fwd_256", layout::attention_smem_bytes(256)),
            k_smem("attn_fwd_q128_64", layout::attention_q128_smem_bytes(64)),
            k_smem("attn_fwd_q128_128", layout::attention_q128_smem_bytes(128)),
            k_smem("attn_fwd_q128_256", layout::attention_q128_smem_bytes(256)),
            k_smem("attn_fwd_wgmma_64", layout::attention_wgmma_smem_bytes(64)),
            k_smem("attn_fwd_wgmma_256", layout::attention_wgmma_smem_bytes(256)),
            k_smem("attn_fwd_wgmma_g_256", layout::attention_wgmma_smem_bytes(256)),
            k_smem("attn_fwd_wgmma_k128_64", layout::attention_wgmma_smem_bytes_tiles(64, 128)),
            k_smem("attn_fwd_wgmma_k128g_64", layout::attention_wgmma_smem_bytes_tiles(64, 128)),
            k_smem("attn_fwd_wgmma_k128g3_64", layout::attention_wgmma_smem_bytes_ring(64, 128, 3)),
            k_smem("attn_fwd_wgmma_tsum_64", layout::attention_wgmma_tsum_smem_bytes()),
            k_smem("attn_fwd_wgmma_split_64", layout::attention_wgmma_smem_bytes(64)),
            k_smem("attn_fwd_wgmma_split_256", layout::attention_wgmma_smem_bytes(256)),
            k_smem("attn_fwd_wgmma_splitg_64", layout::attention_wgmma_smem_bytes(64)),
            k_smem("attn_fwd_wgmma_splitg_256", layout::attention_wgmma_smem_bytes(256)),
            k_smem("attn_fwd_wgmma_ov_64", layout::attention_wgmma_smem_bytes(64)),
            k_smem("attn_fwd_wgmma_ov_256", layout::attention_wgmma_smem_bytes(256)),
            k_smem("attn_fwd_ws_64", layout::attention_ws_smem_bytes(64, 2)),
            k_smem("attn_fwd_ws_256", layout::attention_ws_smem_bytes(256, 2)),
            k_smem("attn_fwd_ws3_64", layout::attention_ws_smem_bytes(64, 3)),
            k("attn_split_combine_64"),
            k("attn_split_combine_128"),
            k("attn_split_combine_256"),
        ],
    },
    KernelFile {
        name: "deltanet",
        // deltanet_split.cu and deltanet_wg.cu continue deltanet.cu (they use its helpers): one
        // compilation unit.
        source: concat!(
            include_str!("../../../kernels/deltanet.cu"),
            include_str!("../../../kernels/deltanet_split.cu"),
            include_str!("../../../kernels/deltanet_wg.cu")
        ),
        functions: &[
            k("gdn_conv_8"),
            k("gdn_conv_4"),
            k("gdn_conv_hist"),
            k_smem("gdn_chunk_prep_16", layout::delta_prep_smem_bytes(16)),
            k_smem("gdn_chunk_prep_32", layout::delta_prep_smem_bytes(32)),
            k_smem("gdn_chunk_prep_64", layout::delta_prep_smem_bytes(64)),
            k_smem("gdn_chunk_prep_128", layout::delta_prep_smem_bytes(128)),
            k_smem("gdn_chunk_prep_rm_32", layout::delta_prep_smem_bytes(32)),
            k_smem("gdn_chunk_prep_rm_64", layout::delta_prep_smem_bytes(64)),
            k_smem("gdn_chunk_prep_rm_128", layout::delta_prep_smem_bytes(128)),
            k_smem("gdn_chunk_scan_wg_32", layout::delta_wg_smem_bytes(32)),
            k_smem("gdn_chunk_scan_wg_64", layout::delta_wg_smem_bytes(64)),
            k_smem("gdn_chunk_scan_wg_128", layout::delta_wg_smem_bytes(128)),
            k_smem("gdn_chunk_scan_wg1_32", layout::delta_wg_smem_bytes(32)),
            k_smem("gdn_chunk_scan_wg1_64", layout::delta_wg_smem_bytes(64)),
            k_smem("gdn_chunk_scan_wg1_128", layout::delta_wg_smem_bytes(128)),
            k_smem("gdn_chunk_scan_wg2_32", layout::delta_wg2_smem_bytes(32)),
            k_smem("gdn_chunk_scan_wg2_64", layout::delta_wg2_smem_bytes(64)),
            k_smem("gdn_chunk_scan_wg2_128", layout::delta_wg2_smem_bytes(128)),
            k_smem("gdn_chunk_scan_wgl_32", layout::delta_wgl_smem_bytes(32)),
            k_smem("gdn_chunk_scan_wgl_64", layout::delta_wgl_smem_bytes(64)),
            k_smem("gdn_chunk_scan_wgl_128", layout::delta_wgl_smem_bytes(128)),
            k_smem("gdn_chunk_scan_16", layout::delta_scan_smem_bytes(16)),
            k_smem("gdn_chunk_scan_32", layout::delta_scan_smem_bytes(32)),
            k_smem("gdn_chunk_scan_64", layout::delta_scan_smem_bytes(64)),
            k_smem("gdn_chunk_scan_128", layout::delta_scan_smem_bytes(128)),
            k_smem("gdn_chunk_scan_tc_16", layout::delta_tc_smem_bytes(16)),
            k_smem("gdn_chunk_scan_tc_32", layout::delta_tc_smem_bytes(32)),
            k_smem("gdn_chunk_scan_tc_64", layout::delta_tc_smem_bytes(64)),
            k_smem("gdn_chunk_scan_tc_128", layout::delta_tc_smem_bytes(128)),
            k_smem("gdn_chunk_scan_tc_pipelined_16", layout::delta_tc_pipelined_smem_bytes(16)),
            k_smem("gdn_chunk_scan_tc_pipelined_32", layout::delta_tc_pipelined_smem_bytes(32)),
            k_smem("gdn_chunk_scan_tc_pipelined_64", layout::delta_tc_pipelined_smem_bytes(64)),
            k_smem("gdn_chunk_scan_tc_pipelined_128", layout::delta_tc_pipelined_smem_bytes(128)),
            k_smem("gdn_chunk_scan_tf32_16", layout::delta_tc_smem_bytes(16)),
            k_smem("gdn_chunk_scan_tf32_32", layout::delta_tc_smem_bytes(32)),
            k_smem("gdn_chunk_scan_tf32_64", layout::delta_tc_smem_bytes(64)),
            k_smem("gdn_chunk_scan_tf32_128", layout::delta_tc_smem_bytes(128)),
            k_smem("gdn_chunk_scan_tf32_pipelined_16", layout::delta_tc_pipelined_smem_bytes(16)),
            k_smem("gdn_chunk_scan_tf32_pipelined_32", layout::delta_tc_pipelined_smem_bytes(32)),
            k_smem("gdn_chunk_scan_tf32_pipelined_64", layout::delta_tc_pipelined_smem_bytes(64)),
            k_smem("gdn_chunk_scan_tf32_pipelined_128", layout::delta_tc_pipelined_smem_bytes(128)),
            k_smem("gdn_chunk_scan_tc_wide_16", layout::delta_tc_wide_smem_bytes(16)),
            k_smem("gdn_chunk_scan_tc_wide_32", layout::delta_tc_wide_smem_bytes(32)),
            k_smem("gdn_chunk_scan_tc_wide_64", layout::delta_tc_wide_smem_bytes(64)),
            k_smem("gdn_chunk_scan_tc_wide_128", layout::delta_tc_wide_smem_bytes(128)),
            k_smem("gdn_chunk_scan_tf32_wide_16", layout::delta_tc_wide_smem_bytes(16)),
            k_smem("gdn_chunk_scan_tf32_wide_32", layout::delta_tc_wide_smem_bytes(32)),
            k_smem("gdn_chunk_scan_tf32_wide_64", layout::delta_tc_wide_smem_bytes(64)),
            k_smem("gdn_chunk_scan_tf32_wide_128", layout::delta_tc_wide_smem_bytes(128)),
            k_smem("gdn_split_wu_16", layout::delta_split_wu_smem_bytes(16)),
            k_smem("gdn_split_state_16", layout::delta_split_state_smem_bytes(16)),
            k_smem("gdn_split_out_16", layout::delta_split_out_smem_bytes(16)),
            k_smem("gdn_split_wu_32", layout::delta_split_wu_smem_bytes(32)),
            k_smem("gdn_split_state_32", layout::delta_split_state_smem_bytes(32)),
            k_smem("gdn_split_out_32", layout::delta_split_out_smem_bytes(32)),
            k_smem("gdn_split_wu_64", layout::delta_split_wu_smem_bytes(64)),
            k_smem("gdn_split_state_64", layout::delta_split_state_smem_bytes(64)),
            k_smem("gdn_split_out_64", layout::delta_split_out_smem_bytes(64)),
            k_smem("gdn_split_wu_128", layout::delta_split_wu_smem_bytes(128)),
            k_smem("gdn_split_state_128", layout::delta_split_state_smem_bytes(128)),
            k_smem("gdn_split_out_128", layout::delta_split_out_smem_bytes(128)),
            k_smem("gdn_split_wu_tf32_16", layout::delta_split_wu_smem_bytes(16)),
            k_smem("gdn_split_state_tf32_16", layout::delta_split_state_smem_bytes(16)),
            k_smem("gdn_split_out_tf32_16", layout::delta_split_out_smem_bytes(16)),
            k_smem("gdn_split_wu_tf32_32", layout::delta_split_wu_smem_bytes(32)),
            k_smem("gdn_split_state_tf32_32", layout::delta_split_state_smem_bytes(32)),
            k_smem("gdn_split_out_tf32_32", layout::delta_split_out_smem_bytes(32)),
            k_smem("gdn_split_wu_tf32_64", layout::delta_split_wu_smem_bytes(64)),
            k_smem("gdn_split_state_tf32_64", layout::delta_split_state_smem_bytes(64)),
            k_smem("gdn_split_out_tf32_64", layout::delta_split_out_smem_bytes(64)),
            k_smem("gdn_split_wu_tf32_128", layout::delta_split_wu_smem_bytes(128)),
            k_smem("gdn_split_state_tf32_128", layout::delta_split_state_smem_bytes(128)),
            k_smem("gdn_split_out_tf32_128", layout::delta_split_out_smem_bytes(128)),
        ],
    },
];

/// One kernel argument, typed as the kernel's parameter: a device address (`T*`), `long long`,
/// `int`, `float`, or a TMA tensor map (`const __grid_constant__ TmaMap`, 128 bytes by value).
#[derive(Debug, Clone, Copy)]
pub(super) enum Arg {
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
    Map(TensorMap),
}

/// Blocks of a 1-D grid-stride launch over `n` items, `per_block` per block.
pub(super) fn grid1(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).clamp(1, 1 << 20) as u32
}

/// A launch of `grid` blocks of `block` threads with `smem` bytes of dynamic shared memory.
pub(super) fn launch_config(grid: (u32, u32, u32), block: u32, smem: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem as u32 }
}

impl CudaBackend {
    fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.state.funcs.get(name).ok_or_else(|| anyhow!("kernel {name} is not loaded"))
    }

    /// How many blocks of kernel `name` (block size `threads`, dynamic shared memory `smem`) the
    /// whole GPU runs at once: its occupancy per SM, from the driver, times the SMs. A grid of at
    /// most this many blocks runs in one wave. Asked of the driver once per shape.
    pub(super) fn resident_blocks(&self, name: &str, threads: u32, smem: usize) -> Result<usize> {
        self.resident_memo((name.to_string(), threads, smem), || {
            let per_sm =
                self.func(name)?.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)?;
            Ok(per_sm as usize * self.state.info.multiprocessors)
        })
    }

    /// How many clusters of kernel `name` (compiled with `__cluster_dims__`; block size `threads`,
    /// dynamic shared memory `smem`) the whole GPU runs at once, from the driver (clusters must fit
    /// within one GPC, so this can be fewer than SMs / cluster size). Asked once per shape.
    pub(super) fn resident_clusters(&self, name: &str, threads: u32, smem: usize) -> Result<usize> {
        self.resident_memo((format!("{name} (clusters)"), threads, smem), || {
            let grid = (self.state.info.multiprocessors as u32 / 2 * 2).max(2);
            let cfg = launch_config((grid, 1, 1), threads, smem);
            Ok(self.func(name)?.occupancy_max_active_clusters(cfg, &self.state.stream)? as usize)
        })
    }

    /// The driver's occupancy answer under `key` (kernel, block size, shared memory), asked once.
    fn resident_memo(&self, key: (String, u32, usize), ask: impl FnOnce() -> Result<usize>) -> Result<usize> {
        let mut memo = self.state.resident.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&n) = memo.get(&key) {
            return Ok(n);
        }
        let n = ask()?;
        memo.insert(key, n);
        Ok(n)
    }

    /// Whether launches use programmatic dependent launch ([`super::CudaOptions::pdl`]): only
    /// on sm_90, where `griddepcontrol` exists.
    fn pdl(&self) -> bool {
        self.state.options.pdl == Some(true) && self.state.info.hopper()
    }

    /// Queues kernel `name` on the backend's stream (timed when kernel profiling is on).
    pub(super) fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        let f = self.func(name)?;
        let go = || {
            if self.pdl() {
                self.launch_pdl(name, f, cfg, args)
            } else {
                self.launch_plain(name, f, cfg, args)
            }
        };
        match &self.state.profiler {
            Some(p) => p.time(name, go),
            None => go(),
        }
    }

    /// [`Self::launch`] through cudarc's launch builder.
    fn launch_plain(&self, name: &str, f: &CudaFunction, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        let mut b = self.state.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::Map(v) => b.arg(v),
            };
        }
        // SAFETY: every kernel's parameter list matches the argument list its caller builds
        // (pointers as u64, `int` as i32, `long long` as i64, `float` as f32, tensor maps as the
        // 128-byte TmaMap), and the buffers behind the pointers outlive the launch in stream order.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| anyhow!("launching {name}: {e:?}"))
    }

    /// [`Self::launch`] through `cuLaunchKernelEx` with the programmatic-stream-serialization
    /// attribute (cudarc's launch builder has no launch attributes): the kernel may start before
    /// the previous one of the stream completes, and waits for it in `pdl_begin`.
    fn launch_pdl(&self, name: &str, f: &CudaFunction, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        use cudarc::driver::sys;
        use std::ffi::c_void;
        // The driver copies each parameter from the address given, during the call.
        let mut params: Vec<*mut c_void> = args
            .iter()
            .map(|a| match a {
                Arg::Ptr(v) => v as *const u64 as *mut c_void,
                Arg::I64(v) => v as *const i64 as *mut c_void,
                Arg::I32(v) => v as *const i32 as *mut c_void,
                Arg::F32(v) => v as *const f32 as *mut c_void,
                Arg::Map(v) => v as *const TensorMap as *mut c_void,
            })
            .collect();
        // SAFETY: a plain C struct and union of the driver's headers; zero is a valid value.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.state.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        self.state.ctx.bind_to_thread().map_err(|e| anyhow!("launching {name}: {e:?}"))?;
        // SAFETY: as in `launch` (the parameter list matches the kernel's; the buffers outlive the
        // launch in stream order); `params`, `attr` and `config` outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| anyhow!("launching {name}: {e:?}"))
    }

    /// One GEMM, timed under its kind and shape when kernel profiling is on: narrow BF16 shapes
    /// (n <= 128, or k <= 256 accumulating) on `gemm_narrow` (its kernels timed under their own
    /// names), the rest on cuBLASLt.
    pub(super) fn gemm(&self, g: &Gemm) -> Result<()> {
        if self.gemm_narrow(g)? {
            return Ok(());
        }
        match &self.state.profiler {
            Some(p) => p.time(format!("gemm.{:?} N={} K={}", g.kind, g.n, g.k), || self.state.blas.run(g)),
            None => self.state.blas.run(g),
        }
    }

    /// One GEMM (as [`Self::gemm`]), timed under `name` when it runs on cuBLASLt.
    pub(super) fn gemm_named(&self, g: &Gemm, name: &str) -> Result<()> {
        if self.gemm_narrow(g)? {
            return Ok(());
        }
        match &self.state.profiler {
            Some(p) => p.time(name, || self.state.blas.run(g)),
            None => self.state.blas.run(g),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_function_is_listed_once_and_big_smem_only_where_needed() {
        let mut seen = std::collections::HashSet::new();
        for f in KERNELS {
            for kf in f.functions {
                assert!(seen.insert(kf.name), "{} listed twice", kf.name);
                assert!(kf.max_dynamic_smem <= 227 * 1024, "{} asks for more than an SM has", kf.name);
                // Each function name (or its macro stem) occurs in its file.
                let stem = kf.name.trim_end_matches(|c: char| c.is_ascii_digit() || c == '_');
                assert!(f.source.contains(stem), "{} not found in kernels/{}.cu", kf.name, f.name);
            }
        }
    }
}
