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
//!
//! Pins. The heuristic's first answer at the reference M is a guess, not a measurement: another
//! of its candidates may be faster at every M (`bench_gpu_ops --only gemm-algos` times them all).
//! A shape's fixed algorithm can therefore be pinned by its config text, the attributes cuBLASLt
//! describes an algorithm by ([`AlgoConfig`]: `algo=..,tile=..,stages=..,splitk=..,red=..,
//! swizzle=..,custom=..,cluster=..,inner=..`). Pins come from [`DEFAULT_PINS`] (compiled in,
//! filled from a measured sweep) and from `IMAJEV_GEMM_PINS` (`fp8:N:K=<config>;bf16:N:K=<config>`,
//! read once when a [`Blas`] is created; it wins over a compiled-in pin of the same shape; a first
//! entry `none` drops the compiled-in pins; bad syntax is an error naming the variable and the
//! entry). A pin is keyed by (kind, N, K) only:
//! plans of that shape that differ in leading dimensions, pointer alignment or accumulation share
//! it. Planning a pinned shape asks the heuristic for its candidates at the reference M (the same
//! descriptor and preference, so the same split-K rule) and takes the one whose config equals the
//! pin; if none does (another GPU or cuBLASLt), it warns once and takes the heuristic's first, as
//! without a pin. A pin only changes WHICH algorithm is fixed: it is still one per shape for every
//! M, and it never bypasses the preference (a pin for a split-K config of a wide shape matches no
//! candidate). The text form and the parsing are plain Rust (no GPU), tested below.

use super::layout::ptr_alignment;
use anyhow::{anyhow, bail, ensure, Result};
use cudarc::cublaslt::{result as lt, sys as lts};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::fmt;
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
/// How many heuristic answers today's plan looks through for its first usable one.
const PLAN_ANSWERS: usize = 8;
/// How many heuristic answers [`Blas::candidates`] and pinned plans ask for.
pub const CANDIDATE_ANSWERS: usize = 32;
/// The environment variable of the pins (module doc).
pub const PINS_ENV: &str = "IMAJEV_GEMM_PINS";
/// Compiled-in pins, each an `IMAJEV_GEMM_PINS` entry (`bf16:N:K=<config>`), from a measured
/// sweep (`bench_gpu_ops --only lora-a-algos`, H100, cuBLASLt 13.1, 2026-12-07,
/// `bench/results/h100-ops-lora-a-4737616.log`): the narrow BF16 shapes (two LoRA A sides, the b/a
/// projection) whose heuristic first answer at M = 256 was slow at large M, each replaced by the
/// candidate that was fastest at both 992 and 7,824 rows, with rows bitwise equal across M:
/// - `bf16:128:2560` (DeltaNet qkv+z and MLP gate+up A sides): 0.017 → 0.011 ms at 992 rows,
///   0.067 → 0.029 ms at 7,824;
/// - `bf16:192:2560` (attention q+k+v A side): 0.014 → 0.010 ms, 0.043 → 0.034 ms;
/// - `bf16:64:2560` (DeltaNet's b/a projection, BF16, output at row stride 12,352; sweep of
///   2026-12-07, `bench/results/h100-ops-lora-a-ba-fb1988f.log`): 0.014 → 0.011 ms at 992 rows,
///   0.040 → 0.025 ms at 7,824 (−0.36 ms a 7,816-row round; whole requests within noise,
///   `h100-ab-ba-pin-fb1988f.txt`).
///
/// The split-K shapes (`bf16:64:4096`, `bf16:64:9216`) had no candidate more than 1.5% faster
/// and keep the heuristic's. On another GPU or cuBLASLt a pin that matches no candidate only costs
/// a warning; `IMAJEV_GEMM_PINS=none` drops these (for an A/B against the heuristic's picks).
pub const DEFAULT_PINS: &[&str] = &[
    "bf16:128:2560=algo=66,tile=314,stages=35,splitk=1,red=0,swizzle=0,custom=3,cluster=9,inner=0",
    "bf16:192:2560=algo=66,tile=314,stages=35,splitk=1,red=0,swizzle=0,custom=3,cluster=8,inner=0",
    "bf16:64:2560=algo=66,tile=314,stages=35,splitk=1,red=0,swizzle=0,custom=3,cluster=8,inner=0",
];
/// The `IMAJEV_GEMM_PINS` value that drops the compiled-in pins (any entries after it still pin).
pub const NO_DEFAULT_PINS: &str = "none";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmKind {
    Bf16,
    /// E4M3 × E4M3 with 128×128 weight scales and 1×128 activation scales.
    Fp8Block,
}

impl GemmKind {
    /// The kind's name in pins: `fp8` or `bf16`.
    pub fn tag(self) -> &'static str {
        match self {
            GemmKind::Bf16 => "bf16",
            GemmKind::Fp8Block => "fp8",
        }
    }
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

impl Gemm {
    /// A dense GEMM of `kind` on placeholder addresses (distinct, 1 MiB aligned), for the tests of
    /// which GEMMs a kernel of our own takes from cuBLASLt.
    #[cfg(test)]
    pub(super) fn placeholder(kind: GemmKind, n: usize, m: usize, k: usize) -> Gemm {
        Gemm {
            kind,
            n,
            m,
            k,
            w: 1 << 20,
            ldw: k,
            x: 2 << 20,
            ldx: k,
            y: 3 << 20,
            ldy: n,
            alpha: 1.0,
            beta: 0.0,
            w_scale: 4 << 20,
            x_scale: 5 << 20,
        }
    }
}

/// The M a shape's algorithm is chosen at: [`M_REF`], or [`M_REF_NARROW`] for narrow outputs;
/// FP8 rows padded as the backend pads them.
pub fn reference_m(kind: GemmKind, n: usize) -> usize {
    let m = if n <= NARROW_N { M_REF_NARROW } else { M_REF };
    match kind {
        GemmKind::Fp8Block => crate::weights::fp8::fp8_rows(m),
        GemmKind::Bf16 => m,
    }
}

/// The configuration of one cuBLASLt algorithm: its `cublasLtMatmulAlgoConfigAttributes_t`
/// values (cuBLASLt 13 has these nine). The config is what a pin names: two heuristic answers
/// with equal configs are taken as one algorithm (the first stands for both). Text form (`Display`/`FromStr`), every field once,
/// in any order when parsed: `algo=66,tile=..,stages=..,splitk=1,red=0,swizzle=0,custom=0,cluster=..,inner=..`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AlgoConfig {
    /// `CUBLASLT_ALGO_CONFIG_ID`.
    pub algo: i32,
    /// `CUBLASLT_ALGO_CONFIG_TILE_ID` (`cublasLtMatmulTile_t`).
    pub tile: u32,
    /// `CUBLASLT_ALGO_CONFIG_STAGES_ID` (`cublasLtMatmulStages_t`).
    pub stages: u32,
    /// `CUBLASLT_ALGO_CONFIG_SPLITK_NUM`.
    pub splitk: u32,
    /// `CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME` (`cublasLtReductionScheme_t`).
    pub reduction: u32,
    /// `CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING`.
    pub swizzle: u32,
    /// `CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION`.
    pub custom: u32,
    /// `CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID` (`cublasLtClusterShape_t`).
    pub cluster: u32,
    /// `CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID` (`cublasLtMatmulInnerShape_t`).
    pub inner: u32,
}

/// The text names of [`AlgoConfig`]'s fields, in its order.
const CONFIG_FIELDS: [&str; 9] =
    ["algo", "tile", "stages", "splitk", "red", "swizzle", "custom", "cluster", "inner"];

impl AlgoConfig {
    fn values(&self) -> [i64; 9] {
        let c = self;
        let u = |v: u32| i64::from(v);
        [
            i64::from(c.algo),
            u(c.tile),
            u(c.stages),
            u(c.splitk),
            u(c.reduction),
            u(c.swizzle),
            u(c.custom),
            u(c.cluster),
            u(c.inner),
        ]
    }
}

impl fmt::Display for AlgoConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, v)) in CONFIG_FIELDS.iter().zip(self.values()).enumerate() {
            write!(f, "{}{name}={v}", if i == 0 { "" } else { "," })?;
        }
        Ok(())
    }
}

impl std::str::FromStr for AlgoConfig {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<Self> {
        let mut got: [Option<i64>; 9] = [None; 9];
        for item in text.split(',').map(str::trim) {
            let (name, value) = item
                .split_once('=')
                .ok_or_else(|| anyhow!("{item:?} is not NAME=VALUE (names: {})", CONFIG_FIELDS.join(",")))?;
            let (name, value) = (name.trim(), value.trim());
            let i = CONFIG_FIELDS
                .iter()
                .position(|f| *f == name)
                .ok_or_else(|| anyhow!("unknown field {name:?} (fields: {})", CONFIG_FIELDS.join(",")))?;
            ensure!(got[i].is_none(), "field {name:?} is given twice");
            let v: i64 = value.parse().map_err(|_| anyhow!("{name}={value:?} is not an integer"))?;
            let ok = if i == 0 { i32::try_from(v).is_ok() } else { u32::try_from(v).is_ok() };
            ensure!(ok, "{name}={v} is out of range");
            got[i] = Some(v);
        }
        let missing: Vec<&str> =
            CONFIG_FIELDS.iter().zip(&got).filter(|(_, v)| v.is_none()).map(|(f, _)| *f).collect();
        ensure!(missing.is_empty(), "missing field(s) {}", missing.join(","));
        let v = got.map(|v| v.unwrap_or_default());
        Ok(AlgoConfig {
            algo: v[0] as i32,
            tile: v[1] as u32,
            stages: v[2] as u32,
            splitk: v[3] as u32,
            reduction: v[4] as u32,
            swizzle: v[5] as u32,
            custom: v[6] as u32,
            cluster: v[7] as u32,
            inner: v[8] as u32,
        })
    }
}

/// One pin: the fixed algorithm of every GEMM of kind `kind` and shape `n`×`k` (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    pub kind: GemmKind,
    pub n: usize,
    pub k: usize,
    pub config: AlgoConfig,
}

impl fmt::Display for Pin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}={}", self.kind.tag(), self.n, self.k, self.config)
    }
}

/// What a pin is looked up by: (kind, N, K).
type PinKey = (GemmKind, usize, usize);

/// The pins of `text` (`IMAJEV_GEMM_PINS` syntax: entries `fp8:N:K=<config>` or
/// `bf16:N:K=<config>` separated by `;`, blanks around them and empty entries ignored). Errors
/// name `source` and the entry; a shape pinned twice is an error.
pub fn parse_pins(text: &str, source: &str) -> Result<Vec<Pin>> {
    let mut pins: Vec<Pin> = Vec::new();
    for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let pin = parse_pin(entry).map_err(|e| anyhow!("{source}: entry {entry:?}: {e}"))?;
        if pins.iter().any(|p| (p.kind, p.n, p.k) == (pin.kind, pin.n, pin.k)) {
            bail!("{source}: entry {entry:?}: {}:{}:{} is pinned twice", pin.kind.tag(), pin.n, pin.k);
        }
        pins.push(pin);
    }
    Ok(pins)
}

fn parse_pin(entry: &str) -> Result<Pin> {
    const FORM: &str = "expected KIND:N:K=CONFIG, KIND fp8 or bf16, e.g. fp8:18432:2560=algo=66,tile=..,..";
    let (shape, config) = entry.split_once('=').ok_or_else(|| anyhow!("no '=': {FORM}"))?;
    let parts: Vec<&str> = shape.split(':').map(str::trim).collect();
    let [kind, n, k] = parts[..] else { bail!("{shape:?} is not KIND:N:K: {FORM}") };
    let kind = match kind {
        "fp8" => GemmKind::Fp8Block,
        "bf16" => GemmKind::Bf16,
        other => bail!("unknown kind {other:?}: {FORM}"),
    };
    let dim = |what: &str, v: &str| -> Result<usize> {
        v.parse()
            .ok()
            .filter(|&d: &usize| d > 0)
            .ok_or_else(|| anyhow!("{what}={v:?} is not a positive integer"))
    };
    let (n, k) = (dim("N", n)?, dim("K", k)?);
    let config = config.parse().map_err(|e| anyhow!("config {:?}: {e}", config.trim()))?;
    Ok(Pin { kind, n, k, config })
}

/// The pin table: `defaults` (each a `parse_pins` text, source `DEFAULT_PINS`), then `env`
/// (source [`PINS_ENV`]) replacing a default of the same shape. An `env` whose first entry is
/// [`NO_DEFAULT_PINS`] drops the defaults; its other entries still pin.
fn pin_table(defaults: &[&str], env: Option<&str>) -> Result<HashMap<PinKey, (AlgoConfig, &'static str)>> {
    let mut table = HashMap::new();
    let (first, rest) = env.map_or(("", ""), |e| e.split_once(';').unwrap_or((e, "")));
    let (defaults, env) =
        if first.trim() == NO_DEFAULT_PINS { (&[][..], Some(rest)) } else { (defaults, env) };
    let sources = defaults.iter().map(|t| (*t, "DEFAULT_PINS")).chain(env.map(|t| (t, PINS_ENV)));
    for (text, source) in sources {
        for p in parse_pins(text, source)? {
            table.insert((p.kind, p.n, p.k), (p.config, source));
        }
    }
    Ok(table)
}

/// One algorithm cuBLASLt offers for a GEMM shape at its reference M (see [`Blas::candidates`]).
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    pub kind: GemmKind,
    pub n: usize,
    pub k: usize,
    pub config: AlgoConfig,
    /// Position among the heuristic's usable answers at the reference M (0: its first).
    pub rank: usize,
    /// Today's pick without a pin: the heuristic's first usable answer at the reference M.
    pub heuristic_first: bool,
    /// Workspace bytes it asks for at the reference M, and cuBLASLt's wave estimate there.
    pub workspace: usize,
    pub waves: f32,
    algo: lts::cublasLtMatmulAlgo_t,
}

impl Candidate {
    /// Its `IMAJEV_GEMM_PINS` entry.
    pub fn pin(&self) -> Pin {
        Pin { kind: self.kind, n: self.n, k: self.k, config: self.config }
    }
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
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
    pub workspace: usize,
    /// The algorithm's config: its id, tile, stages, split-K, … (None if cuBLASLt would not
    /// describe it).
    pub config: Option<AlgoConfig>,
    /// Whether a pin chose the algorithm (else the heuristic's first at the reference M).
    pub pinned: bool,
}

/// A matmul descriptor and preference, destroyed on drop.
struct Descs {
    desc: lts::cublasLtMatmulDesc_t,
    pref: lts::cublasLtMatmulPreference_t,
}

impl Drop for Descs {
    fn drop(&mut self) {
        unsafe {
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
            if !self.pref.is_null() {
                let _ = lt::destroy_matmul_pref(self.pref);
            }
        }
    }
}

struct Plan {
    d: Descs,
    algo: lts::cublasLtMatmulAlgo_t,
    per_m: HashMap<usize, lts::cublasLtMatmulAlgo_t>,
    /// Matrix layouts per M (creating three per call costs host time on every GEMM).
    layouts: HashMap<usize, Layouts>,
    info: PlanInfo,
}

struct State {
    plans: HashMap<Key, Plan>,
    fallbacks: usize,
    /// Pins already reported as matching no candidate (warned once per shape).
    unmatched_pins: HashSet<PinKey>,
}

/// A cuBLASLt handle, its workspace, the pins and the per-shape plans. All calls run on one stream.
pub struct Blas {
    handle: lts::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    pins: HashMap<PinKey, (AlgoConfig, &'static str)>,
    state: Mutex<State>,
}

// SAFETY: the raw cuBLASLt handle and descriptors are only used under `state`'s mutex (the
// handle itself is thread-safe per the cuBLASLt docs; the descriptors are not, hence the lock;
// `candidates` makes its own).
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

/// One config attribute of `algo`. The attributes differ in width (INNER_SHAPE_ID and
/// CLUSTER_SHAPE_ID are uint16_t, the others 32-bit) and cuBLASLt rejects a buffer of the wrong
/// size, so the size is asked first (`sizeInBytes` 0 returns the size needed); should that query
/// fail, 4 and 2 bytes are tried. Little-endian host.
fn algo_attr(
    algo: &lts::cublasLtMatmulAlgo_t,
    attr: lts::cublasLtMatmulAlgoConfigAttributes_t,
) -> Result<u64> {
    let mut size = 0usize;
    let query =
        unsafe { lts::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, std::ptr::null_mut(), 0, &mut size) };
    let sizes: &[usize] = if query == lts::cublasStatus_t::CUBLAS_STATUS_SUCCESS && (1..=8).contains(&size) {
        &[size]
    } else {
        &[4, 2]
    };
    let mut last = query;
    for &size in sizes {
        let mut buf = [0u8; 8];
        let mut written = 0usize;
        last = unsafe {
            lts::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                buf.as_mut_ptr() as *mut c_void,
                size,
                &mut written,
            )
        };
        if last == lts::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Ok(u64::from_le_bytes(buf));
        }
    }
    Err(anyhow!("cuBLASLt algorithm attribute {attr:?}: {last:?}"))
}

/// The config of `algo` (see [`AlgoConfig`]).
fn algo_config(algo: &lts::cublasLtMatmulAlgo_t) -> Result<AlgoConfig> {
    use lts::cublasLtMatmulAlgoConfigAttributes_t as C;
    let u = |attr| -> Result<u32> {
        let v = algo_attr(algo, attr)?;
        u32::try_from(v).map_err(|_| anyhow!("cuBLASLt algorithm attribute {attr:?} = {v}"))
    };
    Ok(AlgoConfig {
        algo: u(C::CUBLASLT_ALGO_CONFIG_ID)? as i32,
        tile: u(C::CUBLASLT_ALGO_CONFIG_TILE_ID)?,
        stages: u(C::CUBLASLT_ALGO_CONFIG_STAGES_ID)?,
        splitk: u(C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM)?,
        reduction: u(C::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)?,
        swizzle: u(C::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)?,
        custom: u(C::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)?,
        cluster: u(C::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)?,
        inner: u(C::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID)?,
    })
}

/// The matmul descriptor and preference of `g`'s shape (scale pointers of `g`; `run_one` sets
/// each call's own).
fn descriptors(g: &Gemm) -> Result<Descs> {
    use lts::cublasLtMatmulDescAttributes_t as D;
    use lts::cublasLtMatmulPreferenceAttributes_t as P;
    let desc =
        lt::create_matmul_desc(lts::cublasComputeType_t::CUBLAS_COMPUTE_32F, lts::cudaDataType_t::CUDA_R_32F)
            .map_err(|e| anyhow!("cublasLtMatmulDescCreate: {e:?}"))?;
    let mut d = Descs { desc, pref: std::ptr::null_mut() };
    d.pref = lt::create_matmul_pref().map_err(|e| anyhow!("cublasLtMatmulPreferenceCreate: {e:?}"))?;
    let pref = d.pref;
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
    let schemes = if g.n <= NARROW_N {
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
    Ok(d)
}

impl Blas {
    /// A handle and workspace on `stream`, with the pins of [`DEFAULT_PINS`] and `IMAJEV_GEMM_PINS`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let env = match std::env::var(PINS_ENV) {
            Ok(v) => Some(v),
            Err(std::env::VarError::NotPresent) => None,
            Err(e) => bail!("{PINS_ENV}: {e}"),
        };
        let pins = pin_table(DEFAULT_PINS, env.as_deref())?;
        for ((kind, n, k), (config, source)) in &pins {
            tracing::info!(shape = %format!("{}:{n}:{k}", kind.tag()), %config, source, "cuBLASLt pin");
        }
        stream.context().bind_to_thread()?;
        let handle = lt::create_handle().map_err(|e| anyhow!("cublasLtCreate: {e:?}"))?;
        // SAFETY: uninitialised device memory is fine for a workspace.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE) }?;
        Ok(Blas {
            handle,
            stream,
            workspace,
            pins,
            state: Mutex::new(State { plans: HashMap::new(), fallbacks: 0, unmatched_pins: HashSet::new() }),
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

    /// The pins this handle plans with (compiled-in and from the environment).
    pub fn pins(&self) -> Vec<Pin> {
        let mut v: Vec<Pin> =
            self.pins.iter().map(|(&(kind, n, k), &(config, _))| Pin { kind, n, k, config }).collect();
        v.sort_by_key(|p| (p.kind as u8, p.n, p.k));
        v
    }

    /// The heuristic's usable answers for `g`'s shape at `m` rows (successful, workspace within
    /// ours), in its order, asking for `count`.
    fn answers(
        &self,
        d: &Descs,
        g: &Gemm,
        m: usize,
        count: usize,
    ) -> Result<Vec<lts::cublasLtMatmulHeuristicResult_t>> {
        let l = layouts(g, m)?;
        let mut results: Vec<lts::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; count];
        let mut got = 0i32;
        st(
            unsafe {
                lts::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    d.desc,
                    l.0[0],
                    l.0[1],
                    l.0[2],
                    l.0[2],
                    d.pref,
                    count as i32,
                    results.as_mut_ptr(),
                    &mut got,
                )
            },
            "heuristic",
        )?;
        results.truncate(got.clamp(0, count as i32) as usize);
        results.retain(|r| {
            r.state == lts::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= WORKSPACE
        });
        Ok(results)
    }

    /// The heuristic's first usable answer at `m` rows (today's choice, from [`PLAN_ANSWERS`]).
    fn heuristic(&self, d: &Descs, g: &Gemm, m: usize) -> Result<lts::cublasLtMatmulHeuristicResult_t> {
        self.answers(d, g, m, PLAN_ANSWERS)?
            .first()
            .copied()
            .ok_or_else(|| anyhow!("cuBLASLt has no {:?} algorithm for N={} K={} M={m}", g.kind, g.n, g.k))
    }

    fn plan(&self, g: &Gemm, unmatched: &mut HashSet<PinKey>) -> Result<Plan> {
        let d = descriptors(g)?;
        let m_ref = reference_m(g.kind, g.n);
        let mut chosen = self.heuristic(&d, g, m_ref)?;
        let mut pinned = false;
        let shape = (g.kind, g.n, g.k);
        if let Some(&(pin, source)) = self.pins.get(&shape) {
            let found = self
                .answers(&d, g, m_ref, CANDIDATE_ANSWERS)?
                .into_iter()
                .find(|r| algo_config(&r.algo).is_ok_and(|c| c == pin));
            match found {
                Some(r) => (chosen, pinned) = (r, true),
                None if unmatched.insert(shape) => tracing::warn!(
                    shape = %format!("{}:{}:{}", g.kind.tag(), g.n, g.k),
                    %pin,
                    source,
                    "the pinned cuBLASLt algorithm is not among this GPU's candidates at the reference M; \
                     using the heuristic's first"
                ),
                None => {}
            }
        }
        let config = algo_config(&chosen.algo).ok();
        Ok(Plan {
            d,
            algo: chosen.algo,
            per_m: HashMap::new(),
            layouts: HashMap::new(),
            info: PlanInfo { kind: g.kind, n: g.n, k: g.k, workspace: chosen.workspaceSize, config, pinned },
        })
    }

    /// The algorithms a fixed plan of `g`'s shape could use: the heuristic's usable answers at
    /// the reference M for the same descriptor and preference as a plan (so wide outputs never
    /// split K), up to [`CANDIDATE_ANSWERS`], one per config (a pin cannot tell equal configs
    /// apart, so the first stands for them), in the heuristic's order. Today's unpinned pick
    /// (`heuristic_first`) is among them; should the longer answer not hold it, it is put first.
    /// `g.m` is not used: candidates are of the shape, to be run at any M by [`Blas::run_candidate`].
    pub fn candidates(&self, g: &Gemm) -> Result<Vec<Candidate>> {
        self.stream.context().bind_to_thread()?;
        let d = descriptors(g)?;
        let m_ref = reference_m(g.kind, g.n);
        let today = self.heuristic(&d, g, m_ref)?;
        let today_config = algo_config(&today.algo)?;
        let mut out: Vec<Candidate> = Vec::new();
        let candidate = |r: &lts::cublasLtMatmulHeuristicResult_t, config, rank| Candidate {
            kind: g.kind,
            n: g.n,
            k: g.k,
            config,
            rank,
            heuristic_first: config == today_config,
            workspace: r.workspaceSize,
            waves: r.wavesCount,
            algo: r.algo,
        };
        for (rank, r) in self.answers(&d, g, m_ref, CANDIDATE_ANSWERS)?.iter().enumerate() {
            let config = algo_config(&r.algo)?;
            if !out.iter().any(|c| c.config == config) {
                out.push(candidate(r, config, rank));
            }
        }
        if !out.iter().any(|c| c.heuristic_first) {
            out.insert(0, candidate(&today, today_config, 0));
        }
        Ok(out)
    }

    /// Enqueues one GEMM on the stream (a BF16 GEMM of more than [`BF16_M_BLOCK`] rows as
    /// several, one per block of rows: the same algorithm, so the same bits per row).
    pub fn run(&self, g: &Gemm) -> Result<()> {
        self.in_row_blocks(g, |b| self.run_one(b, None))
    }

    /// Enqueues `g` with exactly the algorithm `c` (a candidate of `g`'s shape), in row blocks as
    /// [`Blas::run`]. An error if cuBLASLt rejects it for `g.m` rows: no per-M fallback here, so
    /// a benchmark sees which candidates could be fixed for every M.
    pub fn run_candidate(&self, g: &Gemm, c: &Candidate) -> Result<()> {
        ensure!(
            (c.kind, c.n, c.k) == (g.kind, g.n, g.k),
            "candidate {c} is of {:?} N={} K={}, the GEMM is {:?} N={} K={}",
            c.kind,
            c.n,
            c.k,
            g.kind,
            g.n,
            g.k
        );
        self.in_row_blocks(g, |b| self.run_one(b, Some(c)))
    }

    fn in_row_blocks(&self, g: &Gemm, run: impl Fn(&Gemm) -> Result<()>) -> Result<()> {
        if g.kind == GemmKind::Bf16 && g.m > BF16_M_BLOCK {
            let mut at = 0;
            while at < g.m {
                let rows = (g.m - at).min(BF16_M_BLOCK);
                let x = g.x + 2 * (at * g.ldx) as u64;
                let y = g.y + 2 * (at * g.ldy) as u64;
                run(&Gemm { m: rows, x, y, ..*g })?;
                at += rows;
            }
            return Ok(());
        }
        run(g)
    }

    fn run_one(&self, g: &Gemm, fixed: Option<&Candidate>) -> Result<()> {
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
        let State { plans, fallbacks, unmatched_pins } = &mut *state;
        if let std::collections::hash_map::Entry::Vacant(e) = plans.entry(key) {
            let p = self.plan(g, unmatched_pins)?;
            tracing::debug!(?p.info, "cuBLASLt plan");
            e.insert(p);
        }
        let plan = plans.get_mut(&key).expect("plan just inserted");
        if g.kind == GemmKind::Fp8Block {
            use lts::cublasLtMatmulDescAttributes_t as D;
            set_desc(plan.d.desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.w_scale)?;
            set_desc(plan.d.desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.x_scale)?;
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
        let (handle, desc) = (self.handle, plan.d.desc);
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
        if let Some(c) = fixed {
            return st(call(&c.algo), &format!("matmul with candidate {c} at M={}", g.m));
        }
        if let Some(a) = plan.per_m.get(&g.m) {
            return st(call(a), "matmul");
        }
        let status = call(&plan.algo);
        if status == lts::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Ok(());
        }
        // The fixed algorithm does not take this M: use this M's own heuristic (not batch-invariant
        // across the two), and remember it.
        let algo = self.heuristic(&plan.d, g, g.m)?.algo;
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
            // The plans' descriptors and layouts go before the handle, as they came after it.
            s.plans.clear();
        }
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AlgoConfig {
        AlgoConfig {
            algo: 66,
            tile: 37,
            stages: 35,
            splitk: 1,
            reduction: 0,
            swizzle: 1,
            custom: 2,
            cluster: 3,
            inner: 19,
        }
    }

    #[test]
    fn config_text_round_trips() {
        let c = config();
        assert_eq!(
            c.to_string(),
            "algo=66,tile=37,stages=35,splitk=1,red=0,swizzle=1,custom=2,cluster=3,inner=19"
        );
        for c in [c, AlgoConfig::default(), AlgoConfig { algo: -1, inner: u32::MAX, ..c }] {
            assert_eq!(c.to_string().parse::<AlgoConfig>().unwrap(), c);
        }
        // Any order, blanks around the items.
        let shuffled = " inner=19, cluster=3,custom=2 ,swizzle=1,red=0,splitk=1,stages=35,tile=37,algo=66 ";
        assert_eq!(shuffled.parse::<AlgoConfig>().unwrap(), c);
    }

    #[test]
    fn config_text_errors() {
        let err = |t: &str| t.parse::<AlgoConfig>().unwrap_err().to_string();
        let good = config().to_string();
        assert!(err(&good.replace(",inner=19", "")).contains("missing field(s) inner"));
        assert!(err(&format!("{good},tile=1")).contains("field \"tile\" is given twice"));
        assert!(err(&format!("{good},warp=1")).contains("unknown field \"warp\""));
        assert!(err(&good.replace("tile=37", "tile=x")).contains("tile=\"x\" is not an integer"));
        assert!(err(&good.replace("tile=37", "tile=-1")).contains("tile=-1 is out of range"));
        assert!(err(&good.replace("tile=37", "tile")).contains("\"tile\" is not NAME=VALUE"));
    }

    #[test]
    fn pins_parse() {
        let c = config();
        let text = format!(" fp8:18432:2560={c} ; bf16 : 2560 : 64 = {c};;");
        let pins = parse_pins(&text, PINS_ENV).unwrap();
        assert_eq!(
            pins,
            [
                Pin { kind: GemmKind::Fp8Block, n: 18432, k: 2560, config: c },
                Pin { kind: GemmKind::Bf16, n: 2560, k: 64, config: c },
            ]
        );
        assert_eq!(pins[0].to_string(), format!("fp8:18432:2560={c}"));
        let back: Vec<String> = pins.iter().map(Pin::to_string).collect();
        assert_eq!(parse_pins(&back.join(";"), PINS_ENV).unwrap(), pins);
        assert!(parse_pins("", PINS_ENV).unwrap().is_empty());
        assert!(parse_pins(" ; ", PINS_ENV).unwrap().is_empty());
    }

    #[test]
    fn pin_errors_name_the_variable_and_the_entry() {
        let c = config();
        let err = |t: String| parse_pins(&t, PINS_ENV).unwrap_err().to_string();
        let e = err(format!("fp8:12288:2560={c};fp16:2560:4096={c}"));
        assert!(
            e.starts_with(&format!("IMAJEV_GEMM_PINS: entry \"fp16:2560:4096={c}\": unknown kind \"fp16\"")),
            "{e}"
        );
        let e = err("fp8:12288:2560".into());
        assert!(e.contains("entry \"fp8:12288:2560\": no '='"), "{e}");
        let e = err(format!("fp8:12288={c}"));
        assert!(e.contains("\"fp8:12288\" is not KIND:N:K"), "{e}");
        let e = err(format!("fp8:0:2560={c}"));
        assert!(e.contains("N=\"0\" is not a positive integer"), "{e}");
        let e = err(format!("fp8:12288:2k={c}"));
        assert!(e.contains("K=\"2k\" is not a positive integer"), "{e}");
        let e = err("fp8:12288:2560=algo=66".into());
        assert!(e.contains("config \"algo=66\": missing field(s) tile,stages"), "{e}");
        let e = err(format!("fp8:12288:2560={c};fp8:12288:2560={c}"));
        assert!(e.contains("fp8:12288:2560 is pinned twice"), "{e}");
    }

    #[test]
    fn environment_pins_replace_compiled_in_ones() {
        let (a, b) = (config(), AlgoConfig { tile: 9, ..config() });
        let default = format!("fp8:2560:9216={a};fp8:2560:4096={a}");
        let table = pin_table(&[default.as_str()], Some(&format!("fp8:2560:9216={b}"))).unwrap();
        assert_eq!(table[&(GemmKind::Fp8Block, 2560, 9216)], (b, PINS_ENV));
        assert_eq!(table[&(GemmKind::Fp8Block, 2560, 4096)], (a, "DEFAULT_PINS"));
        assert!(pin_table(&["fp8:1:1=x"], None).unwrap_err().to_string().starts_with("DEFAULT_PINS: entry"));
    }

    #[test]
    fn default_pins_parse() {
        let table = pin_table(DEFAULT_PINS, None).unwrap();
        assert_eq!(table.len(), DEFAULT_PINS.len());
        assert!(table.values().all(|(_, source)| *source == "DEFAULT_PINS"));
    }

    #[test]
    fn none_drops_the_compiled_in_pins_only() {
        let (a, b) = (config(), AlgoConfig { tile: 9, ..config() });
        let default = format!("fp8:2560:9216={a};fp8:2560:4096={a}");
        let defaults = [default.as_str()];
        assert!(pin_table(&defaults, Some("none")).unwrap().is_empty());
        assert!(pin_table(&defaults, Some(" none ; ")).unwrap().is_empty());
        let table = pin_table(&defaults, Some(&format!("none;fp8:2560:4096={b}"))).unwrap();
        assert_eq!(table.len(), 1);
        assert_eq!(table[&(GemmKind::Fp8Block, 2560, 4096)], (b, PINS_ENV));
        // `none` anywhere but first is an entry like any other, and not one that parses.
        let e = pin_table(&defaults, Some(&format!("fp8:2560:4096={b};none"))).unwrap_err().to_string();
        assert!(e.starts_with("IMAJEV_GEMM_PINS: entry \"none\": no '='"), "{e}");
        assert_eq!(pin_table(&defaults, Some("")).unwrap().len(), 2);
    }
}
