//! cuBLASLt GEMMs, `Y[M, N] = α · X[M, K] · W[N, K]ᵀ + β · Y` with BF16 output and f32
//! accumulation, through cudarc's `result`/`sys` layer (its safe wrapper knows no FP8 scales).
//!
//! Two kinds: block-scaled FP8 (E4M3 weights with `[N/128][K/128]` f32 scales exactly as the
//! checkpoint stores `weight_scale_inv`, E4M3 activations with 1×128 scales in the `[K/128][M]`
//! layout) and BF16×BF16. In cuBLAS terms the weights are A (transa = T, `K×N`, ld K), the
//! activations B (`K×M`, ld K) and Y is D (`N×M`, column-major = row-major `[M][ldy]`), which is
//! how `shared/spec/probes/cublaslt_fp8_block.cu` found the only working scale layouts.
//!
//! Batch invariance. cuBLASLt 13.1 promises nothing about it (a batch-invariance mode only
//! appears in cuBLAS 13.4), and its heuristic picks tiles and split-K by M, so one row's result
//! could depend on how many rows share the call. What we do: the preference forbids every
//! split-K reduction scheme (`REDUCTION_SCHEME_MASK = NONE`) except for narrow outputs (N <= 256,
//! which may split K with a deterministic f32 reduction), and the algorithm of a shape is chosen
//! ONCE, at a reference M, then reused for every M; a row's reduction over K is then the same
//! kernel's fixed order (and split) whatever the batch. If cuBLASLt rejects the fixed algorithm for some
//! M we fall back to that M's heuristic and count it (`fallbacks`); `tests/gpu.rs` checks
//! bitwise row invariance across M on the device.

use super::layout::ptr_alignment;
use anyhow::{anyhow, Result};
use cudarc::cublaslt::{result as lt, sys as lts};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// The M the algorithm of every GEMM shape is chosen for (prefill-sized).
pub const M_REF: usize = 4096;
/// Outputs at most this wide are "narrow" (see `Blas::plan`).
pub const NARROW_N: usize = 256;
/// The M narrow shapes are planned for (a request's suffix batch).
pub const M_REF_NARROW: usize = 256;
/// BF16 GEMMs with more rows run as row blocks of this many (each with the shape's fixed
/// algorithm): past ~30K rows cuBLASLt rejects some fixed algorithms (the split-K LoRA A shapes),
/// and a per-M fallback would make rows depend on the batch. FP8 GEMMs cannot be split this way
/// (their activation scales are `[K/128][M]`), and need not be: their algorithms take any M.
pub const BF16_M_BLOCK: usize = 16384;
const WORKSPACE: usize = 32 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmKind {
    Bf16,
    /// E4M3 × E4M3 with 128×128 weight scales and 1×128 activation scales.
    Fp8Block,
}

/// One GEMM on raw device addresses. Weights `w` are row-major `[n][ldw]`, activations `x`
/// `[m][ldx]` (FP8: `m` is already the padded row count), output `y` `[m][ldy]` (columns `0..n`).
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    pub kind: GemmKind,
    pub n: usize,
    pub m: usize,
    pub k: usize,
    pub w: u64,
    pub ldw: usize,
    pub x: u64,
    pub ldx: usize,
    pub y: u64,
    pub ldy: usize,
    pub alpha: f32,
    pub beta: f32,
    /// FP8 only: `[n/128][k/128]` weight multipliers and `[k/128][m]` activation scales.
    pub w_scale: u64,
    pub x_scale: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    kind: GemmKind,
    n: usize,
    k: usize,
    ldw: usize,
    ldx: usize,
    ldy: usize,
    align: [u32; 3],
    accumulate: bool,
}

/// What was chosen for one GEMM shape (for logs and the GPU test report).
#[derive(Debug, Clone)]
pub struct PlanInfo {
    pub kind: GemmKind,
    pub n: usize,
    pub k: usize,
    pub algo_id: i32,
    pub tile_id: u32,
    pub splitk: u32,
    pub stages: u32,
    pub workspace: usize,
}

struct Plan {
    desc: lts::cublasLtMatmulDesc_t,
    pref: lts::cublasLtMatmulPreference_t,
    algo: lts::cublasLtMatmulAlgo_t,
    per_m: HashMap<usize, lts::cublasLtMatmulAlgo_t>,
    /// Matrix layouts per M (creating three per call costs host time on every GEMM).
    layouts: HashMap<usize, Layouts>,
    info: PlanInfo,
}

struct State {
    plans: HashMap<Key, Plan>,
    fallbacks: usize,
}

/// A cuBLASLt handle, its workspace and the per-shape plans. All calls run on one stream.
pub struct Blas {
    handle: lts::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    state: Mutex<State>,
}

// SAFETY: the raw cuBLASLt handle and descriptors are only used under `state`'s mutex (the
// handle itself is thread-safe per the cuBLASLt docs; the descriptors are not, hence the lock).
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

fn st(s: lts::cublasStatus_t, what: &str) -> Result<()> {
    s.result().map_err(|e| anyhow!("cuBLASLt {what}: {e:?}"))
}

/// Matrix layouts of one call, destroyed on drop.
struct Layouts([lts::cublasLtMatrixLayout_t; 3]);

impl Drop for Layouts {
    fn drop(&mut self) {
        for l in self.0 {
            if !l.is_null() {
                let _ = unsafe { lt::destroy_matrix_layout(l) };
            }
        }
    }
}

fn layouts(g: &Gemm, m: usize) -> Result<Layouts> {
    let ab = match g.kind {
        GemmKind::Bf16 => lts::cudaDataType_t::CUDA_R_16BF,
        GemmKind::Fp8Block => lts::cudaDataType_t::CUDA_R_8F_E4M3,
    };
    let mut out = Layouts([std::ptr::null_mut(); 3]);
    out.0[0] = lt::create_matrix_layout(ab, g.k as u64, g.n as u64, g.ldw as i64)
        .map_err(|e| anyhow!("layout A: {e:?}"))?;
    out.0[1] = lt::create_matrix_layout(ab, g.k as u64, m as u64, g.ldx as i64)
        .map_err(|e| anyhow!("layout B: {e:?}"))?;
    out.0[2] = lt::create_matrix_layout(lts::cudaDataType_t::CUDA_R_16BF, g.n as u64, m as u64, g.ldy as i64)
        .map_err(|e| anyhow!("layout D: {e:?}"))?;
    Ok(out)
}

fn set_desc<T>(
    desc: lts::cublasLtMatmulDesc_t,
    attr: lts::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    unsafe {
        lt::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, std::mem::size_of::<T>())
    }
    .map_err(|e| anyhow!("cuBLASLt desc attribute {attr:?}: {e:?}"))
}

fn set_pref<T>(
    pref: lts::cublasLtMatmulPreference_t,
    attr: lts::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<()> {
    unsafe {
        lt::set_matmul_pref_attribute(pref, attr, v as *const T as *const c_void, std::mem::size_of::<T>())
    }
    .map_err(|e| anyhow!("cuBLASLt preference {attr:?}: {e:?}"))
}

fn algo_attr(algo: &lts::cublasLtMatmulAlgo_t, attr: lts::cublasLtMatmulAlgoConfigAttributes_t) -> u32 {
    let mut v = 0u32;
    let mut written = 0usize;
    let _ = unsafe {
        lts::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            attr,
            &mut v as *mut u32 as *mut c_void,
            4,
            &mut written,
        )
    };
    v
}

impl Blas {
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        stream.context().bind_to_thread()?;
        let handle = lt::create_handle().map_err(|e| anyhow!("cublasLtCreate: {e:?}"))?;
        // SAFETY: uninitialised device memory is fine for a workspace.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE) }?;
        Ok(Blas {
            handle,
            stream,
            workspace,
            state: Mutex::new(State { plans: HashMap::new(), fallbacks: 0 }),
        })
    }

    pub fn version() -> usize {
        unsafe { lts::cublasLtGetVersion() }
    }

    /// How many GEMM calls could not use their shape's fixed algorithm.
    pub fn fallbacks(&self) -> usize {
        self.state.lock().map(|s| s.fallbacks).unwrap_or(0)
    }

    pub fn plans(&self) -> Vec<PlanInfo> {
        let s = self.state.lock().expect("gemm state");
        let mut v: Vec<PlanInfo> = s.plans.values().map(|p| p.info.clone()).collect();
        v.sort_by_key(|p| (p.kind as u8, p.n, p.k));
        v
    }

    fn heuristic(&self, p: &Plan, g: &Gemm, m: usize) -> Result<lts::cublasLtMatmulAlgo_t> {
        let l = layouts(g, m)?;
        let mut results: [lts::cublasLtMatmulHeuristicResult_t; 8] = unsafe { std::mem::zeroed() };
        let mut count = 0i32;
        st(
            unsafe {
                lts::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    p.desc,
                    l.0[0],
                    l.0[1],
                    l.0[2],
                    l.0[2],
                    p.pref,
                    8,
                    results.as_mut_ptr(),
                    &mut count,
                )
            },
            "heuristic",
        )?;
        results[..count.max(0) as usize]
            .iter()
            .find(|r| r.state == lts::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= WORKSPACE)
            .map(|r| r.algo)
            .ok_or_else(|| anyhow!("cuBLASLt has no {:?} algorithm for N={} K={} M={m}", g.kind, g.n, g.k))
    }

    fn plan(&self, g: &Gemm) -> Result<Plan> {
        use lts::cublasLtMatmulDescAttributes_t as D;
        use lts::cublasLtMatmulPreferenceAttributes_t as P;
        let desc = lt::create_matmul_desc(
            lts::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lts::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(|e| anyhow!("cublasLtMatmulDescCreate: {e:?}"))?;
        let pref = lt::create_matmul_pref().map_err(|e| anyhow!("cublasLtMatmulPreferenceCreate: {e:?}"))?;
        let mut plan = Plan {
            desc,
            pref,
            algo: unsafe { std::mem::zeroed() },
            per_m: HashMap::new(),
            layouts: HashMap::new(),
            info: PlanInfo {
                kind: g.kind,
                n: g.n,
                k: g.k,
                algo_id: -1,
                tile_id: 0,
                splitk: 0,
                stages: 0,
                workspace: 0,
            },
        };
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?; // CUBLAS_OP_T
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?; // CUBLAS_OP_N
        if g.kind == GemmKind::Fp8Block {
            let a = lts::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
            let b = lts::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.w_scale)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.x_scale)?;
        }
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &(WORKSPACE as u64))?;
        // Narrow outputs (LoRA A, in_proj b/a: N <= 256) have too few output tiles to fill the GPU
        // at small M: they may split K, reduced out of place in f32 (deterministic, and the same
        // split for every M since the algorithm stays fixed), and their algorithm is chosen at a
        // small M. Everything else keeps one K pass.
        let narrow = g.n <= NARROW_N;
        let schemes = if narrow {
            lts::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32
                | lts::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32
        } else {
            lts::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32
        };
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes)?;
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &ptr_alignment(g.w))?;
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ptr_alignment(g.x))?;
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ptr_alignment(g.y))?;
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ptr_alignment(g.y))?;
        let m_ref = if narrow { M_REF_NARROW } else { M_REF };
        let m_ref = match g.kind {
            GemmKind::Fp8Block => crate::weights::fp8::fp8_rows(m_ref),
            GemmKind::Bf16 => m_ref,
        };
        plan.algo = self.heuristic(&plan, g, m_ref)?;
        use lts::cublasLtMatmulAlgoConfigAttributes_t as C;
        plan.info.algo_id = algo_attr(&plan.algo, C::CUBLASLT_ALGO_CONFIG_ID) as i32;
        plan.info.tile_id = algo_attr(&plan.algo, C::CUBLASLT_ALGO_CONFIG_TILE_ID);
        plan.info.splitk = algo_attr(&plan.algo, C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
        plan.info.stages = algo_attr(&plan.algo, C::CUBLASLT_ALGO_CONFIG_STAGES_ID);
        Ok(plan)
    }

    /// Enqueues one GEMM on the stream (a BF16 GEMM of more than [`BF16_M_BLOCK`] rows as
    /// several, one per block of rows: the same algorithm, so the same bits per row).
    pub fn run(&self, g: &Gemm) -> Result<()> {
        if g.kind == GemmKind::Bf16 && g.m > BF16_M_BLOCK {
            let mut at = 0;
            while at < g.m {
                let rows = (g.m - at).min(BF16_M_BLOCK);
                let x = g.x + 2 * (at * g.ldx) as u64;
                let y = g.y + 2 * (at * g.ldy) as u64;
                self.run_one(&Gemm { m: rows, x, y, ..*g })?;
                at += rows;
            }
            return Ok(());
        }
        self.run_one(g)
    }

    fn run_one(&self, g: &Gemm) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        self.stream.context().bind_to_thread()?;
        let key = Key {
            kind: g.kind,
            n: g.n,
            k: g.k,
            ldw: g.ldw,
            ldx: g.ldx,
            ldy: g.ldy,
            align: [ptr_alignment(g.w), ptr_alignment(g.x), ptr_alignment(g.y)],
            accumulate: g.beta != 0.0,
        };
        let mut state = self.state.lock().map_err(|_| anyhow!("gemm state poisoned"))?;
        if let std::collections::hash_map::Entry::Vacant(e) = state.plans.entry(key) {
            let p = self.plan(g)?;
            tracing::debug!(?p.info, "cuBLASLt plan");
            e.insert(p);
        }
        let State { plans, fallbacks } = &mut *state;
        let plan = plans.get_mut(&key).expect("plan just inserted");
        if g.kind == GemmKind::Fp8Block {
            use lts::cublasLtMatmulDescAttributes_t as D;
            set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.w_scale)?;
            set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.x_scale)?;
        }
        if !plan.layouts.contains_key(&g.m) {
            if plan.layouts.len() >= 512 {
                // M varies per request: keep the cache bounded in a long-running server.
                plan.layouts.clear();
            }
            let l = layouts(g, g.m)?;
            plan.layouts.insert(g.m, l);
        }
        let l = &plan.layouts[&g.m];
        let (ws, _guard) = self.workspace.device_ptr(&self.stream);
        let (handle, desc) = (self.handle, plan.desc);
        let call = |algo: &lts::cublasLtMatmulAlgo_t| unsafe {
            lts::cublasLtMatmul(
                handle,
                desc,
                &g.alpha as *const f32 as *const c_void,
                g.w as *const c_void,
                l.0[0],
                g.x as *const c_void,
                l.0[1],
                &g.beta as *const f32 as *const c_void,
                g.y as *const c_void,
                l.0[2],
                g.y as *mut c_void,
                l.0[2],
                algo,
                ws as *mut c_void,
                WORKSPACE,
                self.stream.cu_stream() as lts::cudaStream_t,
            )
        };
        if let Some(a) = plan.per_m.get(&g.m) {
            return st(call(a), "matmul");
        }
        let status = call(&plan.algo);
        if status == lts::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Ok(());
        }
        // The fixed algorithm does not take this M: use this M's own heuristic (not batch-invariant
        // across the two), and remember it.
        let algo = self.heuristic(plan, g, g.m)?;
        *fallbacks += 1;
        tracing::warn!(kind = ?g.kind, n = g.n, k = g.k, m = g.m, ?status, "cuBLASLt rejected the shape's fixed algorithm; using a per-M one");
        plan.per_m.insert(g.m, algo);
        st(call(&algo), "matmul")
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        if let Ok(s) = self.state.get_mut() {
            for p in s.plans.values() {
                unsafe {
                    let _ = lt::destroy_matmul_desc(p.desc);
                    let _ = lt::destroy_matmul_pref(p.pref);
                }
            }
        }
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}
