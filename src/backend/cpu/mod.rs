//! The CPU backend: f32 everywhere, weights dequantised to f32 once at load.
//!
//! It is the numerical reference of the project (it matches a float32 transformers run), the
//! oracle every CUDA kernel is tested against, and the backend that serves small models and runs
//! CI. Its files mirror `src/backend/cuda/`, one per operation family, each holding the CPU twins
//! of that family's kernels (plain loops in the order the math is stated, parallel over
//! independent rows or heads only, so results never depend on thread count) and the ops built
//! from them: [`linear`] (GEMMs through the `gemm` crate), [`norm`], [`attention`], [`deltanet`],
//! [`elementwise`].

pub mod attention;
pub mod deltanet;
pub mod elementwise;
pub mod linear;
pub mod norm;

pub use attention::CpuKvCache;
pub use deltanet::{CpuDeltaState, DeltaRuleInputs};
pub use linear::CpuLinear;

use super::{AttentionDims, AttentionInputs, Backend, DeltaNetDims, DeltaNetInputs, Gelu, LinearPart};
use crate::weights::TensorRef;
use anyhow::{ensure, Result};
use std::ops::Range;

/// How the CPU runs the gated delta rule (both are exact; chunked is the prefill form).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaRuleMode {
    Chunked(usize),
    Recurrent,
}

#[derive(Debug, Clone)]
pub struct CpuBackend {
    pub delta_rule: DeltaRuleMode,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend { delta_rule: DeltaRuleMode::Chunked(64) }
    }
}

/// A dense row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
}

impl CpuTensor {
    pub fn new(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        ensure!(n == data.len(), "tensor of shape {shape:?} needs {n} values, got {}", data.len());
        Ok(CpuTensor { data, shape: shape.to_vec() })
    }
    /// `(rows, cols)` viewing the last dim as columns.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = *self.shape.last().unwrap_or(&1);
        (self.data.len().checked_div(cols).unwrap_or(0), cols)
    }
}

/// The larger operations live in the file of their family; the one-liners are written here.
impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Linear = CpuLinear;
    type KvCache = CpuKvCache;
    type DeltaState = CpuDeltaState;
    /// The CPU's ops have finished when they return: the logits themselves.
    type Readout = Vec<f32>;
    type Marker = ();

    fn kind(&self) -> &'static str {
        "cpu"
    }

    fn describe(&self) -> String {
        format!("cpu (f32, {} threads)", rayon::current_num_threads())
    }

    fn param(&self, t: &TensorRef) -> Result<CpuTensor> {
        CpuTensor::new(t.to_f32()?, t.shape)
    }

    fn param_f32(&self, t: &TensorRef) -> Result<CpuTensor> {
        self.param(t)
    }

    fn linear(&self, parts: &[LinearPart]) -> Result<CpuLinear> {
        linear::linear(parts)
    }

    fn linear_out(&self, w: &CpuLinear) -> usize {
        w.out_dim
    }

    fn tensor_bytes(&self, t: &CpuTensor) -> usize {
        std::mem::size_of_val(t.data.as_slice())
    }

    fn linear_bytes(&self, w: &CpuLinear) -> usize {
        w.bytes()
    }

    fn upload(&self, data: &[f32], shape: &[usize]) -> Result<CpuTensor> {
        CpuTensor::new(data.to_vec(), shape)
    }

    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn shape<'t>(&self, t: &'t CpuTensor) -> &'t [usize] {
        &t.shape
    }

    fn reshape(&self, t: CpuTensor, shape: &[usize]) -> Result<CpuTensor> {
        CpuTensor::new(t.data, shape)
    }

    fn embed(&self, table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
        elementwise::embed(table, ids)
    }

    fn embed_bag(&self, table: &CpuTensor, idx: &[u32], w: &[f32], taps: usize) -> Result<CpuTensor> {
        elementwise::embed_bag(table, idx, w, taps)
    }

    fn scatter_rows(&self, dst: &mut CpuTensor, rows: &[usize], src: &CpuTensor) -> Result<()> {
        elementwise::scatter_rows(dst, rows, src)
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        elementwise::gather_rows(x, rows)
    }

    fn split_cols(&self, x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
        elementwise::split_cols(x, widths)
    }

    fn concat_rows(&self, parts: &[&CpuTensor]) -> Result<CpuTensor> {
        elementwise::concat_rows(parts)
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuLinear) -> Result<CpuTensor> {
        linear::matmul(x, w)
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f32, offset: f32) -> Result<CpuTensor> {
        let d = w.data.len();
        ensure!(
            d > 0 && x.data.len() % d == 0,
            "rms_norm: {} values do not split into rows of {d}",
            x.data.len()
        );
        Ok(CpuTensor { data: norm::rms_norm(&x.data, &w.data, eps, offset), shape: x.shape.clone() })
    }

    fn layer_norm(&self, x: &CpuTensor, w: &CpuTensor, b: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        let d = w.data.len();
        ensure!(b.data.len() == d && d > 0 && x.data.len() % d == 0, "layer_norm shapes");
        Ok(CpuTensor { data: norm::layer_norm(&x.data, &w.data, &b.data, eps), shape: x.shape.clone() })
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        elementwise::add_assign(x, y)
    }

    fn swiglu(&self, gate_up: &CpuTensor) -> Result<CpuTensor> {
        elementwise::swiglu(gate_up)
    }

    fn gelu(&self, x: &mut CpuTensor, kind: Gelu) -> Result<()> {
        let tanh = kind == Gelu::Tanh;
        x.data.iter_mut().for_each(|v| *v = elementwise::gelu(*v, tanh));
        Ok(())
    }

    fn readout_start(&self, h: &CpuTensor, w: &CpuTensor) -> Result<Vec<f32>> {
        linear::readout(h, w)
    }

    fn readout_finish(&self, logits: Vec<f32>) -> Result<Vec<f32>> {
        Ok(logits)
    }

    fn marker(&self) -> Result<()> {
        Ok(())
    }

    fn wait_marker(&self, _marker: &()) -> Result<()> {
        Ok(())
    }

    fn new_kv_cache(&self, _dims: &AttentionDims) -> Result<CpuKvCache> {
        Ok(CpuKvCache::default())
    }

    fn kv_len(&self, cache: &CpuKvCache) -> usize {
        cache.len()
    }

    fn share_kv(&self, cache: &mut CpuKvCache) -> Result<()> {
        attention::share_kv(cache)
    }

    fn gated_attention(
        &self,
        x: &AttentionInputs<CpuTensor>,
        dims: &AttentionDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        caches: &mut [&mut CpuKvCache],
    ) -> Result<CpuTensor> {
        attention::gated_attention(self, x, dims, segments, parents, caches)
    }

    fn new_delta_state(&self, dims: &DeltaNetDims) -> Result<CpuDeltaState> {
        Ok(CpuDeltaState::new(dims))
    }

    fn gated_delta_net(
        &self,
        x: &DeltaNetInputs<CpuTensor>,
        dims: &DeltaNetDims,
        segments: &[Range<usize>],
        parents: &[Option<usize>],
        states: &mut [&mut CpuDeltaState],
        keep: &[bool],
    ) -> Result<CpuTensor> {
        deltanet::gated_delta_net(self, x, dims, segments, parents, states, keep)
    }

    fn vision_attention(
        &self,
        qkv: &CpuTensor,
        cos: &CpuTensor,
        sin: &CpuTensor,
        heads: usize,
        segments: &[Range<usize>],
    ) -> Result<CpuTensor> {
        attention::vision_attention(qkv, cos, sin, heads, segments)
    }
}
