//! Device tensors and how ops borrow them: [`CudaTensor`] (BF16 or F32 rows, with the FP8
//! quantisation a fused kernel attached), [`View`] (a tensor's buffer in the precision an op
//! needs, borrowed or converted), allocation, and the parameter/upload/download calls of
//! [`crate::backend::Backend`]. Knows nothing about which op runs on the tensors.

use super::launch::{grid1, launch_config, Arg};
use super::CudaBackend;
use crate::weights::fp8::{fp8_rows, FP8_BLOCK};
use crate::weights::{StoredDtype, TensorRef};
use anyhow::{ensure, Result};
use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use rayon::prelude::*;

pub(super) enum Buf {
    Bf16(CudaSlice<bf16>),
    F32(CudaSlice<f32>),
}

/// A dense row-major tensor in GPU memory, BF16 (activations, matrices) or F32 (uploads,
/// vectors, the readout head). The buffer may be longer than the shape (padded GEMM rows).
pub struct CudaTensor {
    pub(super) buf: Buf,
    pub(super) shape: Vec<usize>,
    /// The per-token 1×128 FP8 quantisation of this tensor's own contents (`[rows, cols]`), when
    /// the kernel that wrote them also wrote it (the `*_quant` row norms): bit for bit what
    /// `quantize` would make, so an FP8 projection of this tensor skips `quant_act_1x128`. Every
    /// op that changes a tensor in place drops it (`bf16_for_update`), and only the op that
    /// creates a tensor attaches one, so it is never stale.
    pub(super) fp8: Option<ActFp8>,
}

/// FP8 activations of `m` rows of width `k`: E4M3 codes `[mpad, k]`, scales `[k/128][mpad]`
/// (`mpad = fp8_rows(m)`, rows `m..mpad` zero with scale 1); the layout of `quant_act_1x128`.
pub(super) struct ActFp8 {
    pub(super) q: CudaSlice<u8>,
    pub(super) s: CudaSlice<f32>,
    pub(super) mpad: usize,
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
    /// Bytes of its device buffers: the values (padding included) and any FP8 attachment.
    pub fn bytes(&self) -> usize {
        let values = match &self.buf {
            Buf::Bf16(b) => b.len() * std::mem::size_of::<bf16>(),
            Buf::F32(b) => b.len() * std::mem::size_of::<f32>(),
        };
        values + self.fp8.as_ref().map_or(0, |a| a.q.len() + a.s.len() * std::mem::size_of::<f32>())
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

/// A tensor's buffer in the precision an op reads: borrowed when the tensor already has it,
/// converted into a new buffer otherwise (freed in stream order when the view drops).
pub(super) enum View<'a, T> {
    Ref(&'a CudaSlice<T>),
    Own(CudaSlice<T>),
}

impl<T> View<'_, T> {
    pub(super) fn s(&self) -> &CudaSlice<T> {
        match self {
            View::Ref(s) => s,
            View::Own(s) => s,
        }
    }
}

/// A checkpoint tensor's values as BF16 (BF16 as stored; anything else rounded from f32).
pub(super) fn bf16_values(t: &TensorRef) -> Result<Vec<bf16>> {
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

impl CudaBackend {
    /// The device address of a buffer, for kernel arguments.
    pub(super) fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.state.stream).0
    }

    /// An uninitialised BF16 buffer (callers write every element they later read).
    pub(super) fn alloc_bf16(&self, n: usize) -> Result<CudaSlice<bf16>> {
        // SAFETY: every caller writes the elements it later reads.
        Ok(unsafe { self.state.stream.alloc::<bf16>(n.max(1)) }?)
    }

    /// An uninitialised f32 buffer (callers write every element they later read).
    pub(super) fn alloc_f32(&self, n: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: as above.
        Ok(unsafe { self.state.stream.alloc::<f32>(n.max(1)) }?)
    }

    /// A zeroed f32 buffer.
    pub(super) fn zeros_f32(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.state.stream.alloc_zeros::<f32>(n.max(1))?)
    }

    /// A BF16 tensor of `shape` on `buf`, with no FP8 attachment.
    pub(super) fn bf16_tensor(&self, buf: CudaSlice<bf16>, shape: &[usize]) -> CudaTensor {
        CudaTensor { buf: Buf::Bf16(buf), shape: shape.to_vec(), fp8: None }
    }

    /// `t` as BF16: its own buffer, or a converted copy of an F32 tensor (`cast_f32_bf16`).
    pub(super) fn bf16_of<'a>(&self, t: &'a CudaTensor) -> Result<View<'a, bf16>> {
        match &t.buf {
            Buf::Bf16(s) => Ok(View::Ref(s)),
            Buf::F32(s) => {
                let n = t.numel();
                let y = self.alloc_bf16(n)?;
                self.launch(
                    "cast_f32_bf16",
                    launch_config((grid1(n, 256), 1, 1), 256, 0),
                    &[Arg::Ptr(self.p(s)), Arg::Ptr(self.p(&y)), Arg::I64(n as i64)],
                )?;
                Ok(View::Own(y))
            }
        }
    }

    /// `t` as f32: its own buffer, or a converted copy of a BF16 tensor (`cast_bf16_f32`).
    pub(super) fn f32_of<'a>(&self, t: &'a CudaTensor) -> Result<View<'a, f32>> {
        match &t.buf {
            Buf::F32(s) => Ok(View::Ref(s)),
            Buf::Bf16(s) => {
                let n = t.numel();
                let y = self.alloc_f32(n)?;
                self.launch(
                    "cast_bf16_f32",
                    launch_config((grid1(n, 256), 1, 1), 256, 0),
                    &[Arg::Ptr(self.p(s)), Arg::Ptr(self.p(&y)), Arg::I64(n as i64)],
                )?;
                Ok(View::Own(y))
            }
        }
    }

    /// The BF16 buffer of a tensor that an op is about to change in place (every in-place op gets
    /// its buffer here): converts an F32 tensor to BF16 first, and drops the tensor's attached FP8
    /// quantisation, which would describe the old contents.
    pub(super) fn bf16_for_update<'t>(&self, t: &'t mut CudaTensor) -> Result<&'t CudaSlice<bf16>> {
        t.fp8 = None;
        if let Buf::F32(_) = t.buf {
            let y = match self.bf16_of(t)? {
                View::Own(y) => y,
                View::Ref(_) => unreachable!("an F32 tensor converts into a new buffer"),
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
    pub(super) fn alloc_act_fp8(&self, m: usize, k: usize) -> Result<ActFp8> {
        ensure!(k % FP8_BLOCK == 0, "FP8 activations need K to be a multiple of 128, got {k}");
        let mpad = fp8_rows(m);
        // SAFETY: every caller launches a kernel that writes all mpad·k bytes and all scales.
        let q = unsafe { self.state.stream.alloc::<u8>(mpad * k) }?;
        let s = self.alloc_f32(mpad * k / FP8_BLOCK)?;
        Ok(ActFp8 { q, s, mpad })
    }

    /// A device-to-device copy of `bytes` bytes on the stream.
    pub(super) fn dtod_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes > 0 {
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.state.stream.cu_stream())
            }?;
        }
        Ok(())
    }
}

/// `Backend::param` (the trait documents the contract).
pub(super) fn param(be: &CudaBackend, t: &TensorRef) -> Result<CudaTensor> {
    if t.shape.len() <= 1 {
        return param_f32(be, t);
    }
    let v = bf16_values(t)?;
    Ok(be.bf16_tensor(be.htod(&v)?, t.shape))
}

/// `Backend::param_f32` (the trait documents the contract).
pub(super) fn param_f32(be: &CudaBackend, t: &TensorRef) -> Result<CudaTensor> {
    Ok(CudaTensor { buf: Buf::F32(be.htod(&t.to_f32()?)?), shape: t.shape.to_vec(), fp8: None })
}

/// `Backend::upload` (the trait documents the contract).
pub(super) fn upload(be: &CudaBackend, data: &[f32], shape: &[usize]) -> Result<CudaTensor> {
    let n: usize = shape.iter().product();
    ensure!(n == data.len(), "tensor of shape {shape:?} needs {n} values, got {}", data.len());
    Ok(CudaTensor { buf: Buf::F32(be.htod(data)?), shape: shape.to_vec(), fp8: None })
}

/// `Backend::download` (the trait documents the contract).
pub(super) fn download(be: &CudaBackend, t: &CudaTensor) -> Result<Vec<f32>> {
    let n = t.numel();
    if n == 0 {
        return Ok(vec![]);
    }
    let s = &be.state.stream;
    Ok(match &t.buf {
        Buf::Bf16(b) => s.clone_dtoh(&b.slice(0..n))?.into_iter().map(|v| v.to_f32()).collect(),
        Buf::F32(b) => s.clone_dtoh(&b.slice(0..n))?,
    })
}

/// `Backend::reshape` (the trait documents the contract).
pub(super) fn reshape(t: CudaTensor, shape: &[usize]) -> Result<CudaTensor> {
    let n: usize = shape.iter().product();
    ensure!(n == t.numel(), "cannot reshape {:?} to {shape:?}", t.shape);
    // The attachment is dropped: a new column count would not match its layout.
    Ok(CudaTensor { buf: t.buf, shape: shape.to_vec(), fp8: None })
}
