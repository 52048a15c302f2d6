//! A checkpoint tensor held in memory: tests and benchmarks build weights in BF16, F32 or block
//! FP8 (the RTN recipe of [`crate::weights::fp8`]) and hand them to a backend as the
//! [`TensorRef`] a checkpoint file would give, without writing a file.

use crate::backend::{LinearPart, LoraPair};
use crate::weights::fp8::quantize_fp8_blocks;
use crate::weights::{ScaleRef, StoredDtype, TensorRef};

/// An owned tensor in a checkpoint's stored format.
pub struct MemoryTensor {
    pub name: String,
    pub dtype: StoredDtype,
    pub shape: Vec<usize>,
    /// Little-endian values as a safetensors file stores them.
    pub bytes: Vec<u8>,
    /// FP8 only: the `[⌈out/128⌉, ⌈in/128⌉]` f32 `weight_scale_inv`, as bytes.
    pub scale: Option<(Vec<usize>, Vec<u8>)>,
}

impl MemoryTensor {
    /// `v` stored as BF16 (rounded to nearest even).
    pub fn bf16(name: &str, shape: &[usize], v: &[f32]) -> Self {
        let bytes = v.iter().flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect();
        Self::stored(name, StoredDtype::BF16, shape, bytes, None)
    }

    /// `v` stored as F32.
    pub fn f32(name: &str, shape: &[usize], v: &[f32]) -> Self {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Self::stored(name, StoredDtype::F32, shape, bytes, None)
    }

    /// `v` (`[out, in]`) as block FP8 with 128×128 scales: what an FP8 checkpoint holds.
    pub fn fp8(name: &str, shape: &[usize], v: &[f32]) -> Self {
        let (q, s) = quantize_fp8_blocks(v, shape[0], shape[1]);
        let scale_shape = vec![shape[0].div_ceil(128), shape[1].div_ceil(128)];
        let scale = s.iter().flat_map(|x| x.to_le_bytes()).collect();
        Self::stored(name, StoredDtype::F8E4M3, shape, q, Some((scale_shape, scale)))
    }

    fn stored(
        name: &str,
        dtype: StoredDtype,
        shape: &[usize],
        bytes: Vec<u8>,
        scale: Option<(Vec<usize>, Vec<u8>)>,
    ) -> Self {
        MemoryTensor { name: name.into(), dtype, shape: shape.to_vec(), bytes, scale }
    }

    /// The tensor as a checkpoint reference (FP8: with its 128×128 scales attached).
    pub fn r(&self) -> TensorRef<'_> {
        TensorRef {
            name: &self.name,
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &self.bytes,
            scale_inv: self.scale.as_ref().map(|(shape, bytes)| ScaleRef {
                shape,
                bytes,
                block: Some([128, 128]),
            }),
        }
    }

    /// This tensor as one block of a projection ([`crate::backend::Backend::linear`]): no bias,
    /// no LoRA.
    pub fn part(&self) -> LinearPart<'_> {
        LinearPart { weight: self.r(), bias: None, lora: None }
    }

    /// This tensor as a block with a LoRA adapter `scale · (x·Aᵀ)·Bᵀ` (`a` `[r, in]`, `b` `[out, r]`).
    pub fn lora_part<'a>(&'a self, a: &'a MemoryTensor, b: &'a MemoryTensor, scale: f32) -> LinearPart<'a> {
        LinearPart { lora: Some(LoraPair { a: a.r(), b: b.r(), scale }), ..self.part() }
    }
}
