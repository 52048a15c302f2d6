//! TMA tensor maps: the 128-byte descriptors by which Hopper's tensor memory accelerator copies a
//! box of a 2-D tensor from global to shared memory (`cp.async.bulk.tensor`, one instruction
//! from one thread, the 128-byte swizzle done by the copy engine). The driver encodes a map on the
//! host; kernels take it by value as a `const __grid_constant__ TmaMap` (kernels/common.cuh).
//!
//! Why by hand: cudarc 0.19 exposes the driver's `cuTensorMapEncodeTiled` only as a raw `sys`
//! call. This module checks the driver's rules itself (alignment, strides, box sizes) so a shape it
//! cannot take is an error naming the operand and the rule, not `CUDA_ERROR_INVALID_VALUE`, and
//! makes the map a kernel argument (`launch::Arg::Map`).
//!
//! What it does not know: which kernel reads a map, or where in shared memory the box lands. A box
//! may reach past the tensor's edges (negative coordinates too): those elements read as zeros and
//! still count toward the bytes a barrier expects.

use anyhow::{bail, ensure, Result};
use cudarc::driver::sys;
use cudarc::driver::DeviceRepr;
use std::collections::HashMap;
use std::sync::Mutex;

/// An element type a map can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Elem {
    /// Bytes: E4M3 codes.
    U8,
    Bf16,
    F32,
}

impl Elem {
    fn bytes(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::Bf16 => 2,
            Elem::F32 => 4,
        }
    }
    fn driver(self) -> sys::CUtensorMapDataType {
        match self {
            Elem::U8 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            Elem::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            Elem::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        }
    }
}

/// A row-major 2-D tensor in device memory and the box one copy moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tile2d {
    /// The operand, for errors.
    pub what: &'static str,
    pub elem: Elem,
    /// Device address of element (0, 0).
    pub addr: u64,
    /// Elements along the contiguous dimension, and rows.
    pub cols: usize,
    pub rows: usize,
    /// Elements from one row to the next.
    pub row_stride: usize,
    /// The box: `box_cols` contiguous elements of `box_rows` rows.
    pub box_cols: usize,
    pub box_rows: usize,
    /// Shared-memory layout of the box: 128-byte swizzle (rows of exactly 128 bytes, the 16-byte
    /// chunk c of row r at chunk c ^ (r % 8), as the wgmma descriptors read it), or dense.
    pub swizzle_128b: bool,
}

impl Tile2d {
    /// A dense `rows` x `cols` tensor (rows follow each other) whose boxes land 128-byte swizzled.
    pub fn swizzled(
        what: &'static str,
        elem: Elem,
        addr: u64,
        cols: usize,
        rows: usize,
        box_cols: usize,
        box_rows: usize,
    ) -> Tile2d {
        Tile2d { what, elem, addr, cols, rows, row_stride: cols, box_cols, box_rows, swizzle_128b: true }
    }

    /// The driver's rules for a tiled, non-interleaved map (CUDA driver API,
    /// `cuTensorMapEncodeTiled`), checked here so that a failure names what to fix.
    pub fn check(&self) -> Result<()> {
        let what = self.what;
        let e = self.elem.bytes();
        ensure!(self.addr % 16 == 0, "{what}: TMA needs a 16-byte aligned address, got {:#x}", self.addr);
        ensure!(
            self.cols > 0 && self.rows > 0,
            "{what}: TMA needs a non-empty tensor ({} x {})",
            self.rows,
            self.cols
        );
        ensure!(self.cols <= 1 << 32 && self.rows <= 1 << 32, "{what}: a dimension over 2^32 elements");
        ensure!(
            self.row_stride >= self.cols,
            "{what}: row stride {} below the row's {} elements",
            self.row_stride,
            self.cols
        );
        ensure!(
            (self.row_stride * e) % 16 == 0 && self.row_stride * e < 1 << 40,
            "{what}: TMA needs a row stride that is a multiple of 16 bytes (and below 2^40), got {} bytes",
            self.row_stride * e
        );
        for (name, b) in [("box columns", self.box_cols), ("box rows", self.box_rows)] {
            ensure!((1..=256).contains(&b), "{what}: {name} {b} outside 1..=256");
        }
        ensure!(
            (self.box_cols * e) % 16 == 0,
            "{what}: a box row of {} bytes is not a multiple of 16",
            self.box_cols * e
        );
        if self.swizzle_128b {
            ensure!(
                self.box_cols * e == 128,
                "{what}: the 128-byte swizzle takes box rows of 128 bytes, got {}",
                self.box_cols * e
            );
        }
        Ok(())
    }

    /// The map, from the driver (a host-side call: no GPU work, no synchronisation).
    pub fn encode(&self) -> Result<TensorMap> {
        self.check()?;
        let e = self.elem.bytes() as u64;
        let dims = [self.cols as u64, self.rows as u64];
        let strides = [self.row_stride as u64 * e];
        let boxes = [self.box_cols as u32, self.box_rows as u32];
        let element_strides = [1u32, 1];
        let swizzle = if self.swizzle_128b {
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
        } else {
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
        };
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every pointer refers to a live local array of the rank (2) the call is told; the
        // driver only writes the 128 bytes of `map` and reads the arrays.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                self.elem.driver(),
                2,
                self.addr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            bail!("{}: cuTensorMapEncodeTiled failed ({r:?}) for {self:?}", self.what);
        }
        // SAFETY: the driver filled the map (and it started zeroed in any case).
        Ok(TensorMap(unsafe { map.assume_init() }))
    }
}

/// Encoded maps by what they describe. A map is a pure function of its [`Tile2d`] (address,
/// sizes, strides, box, swizzle: not the memory's contents), so one encoded for an earlier tensor
/// at the same address and shape is the same bytes. Activation buffers come back at the same
/// addresses from the stream's pool and weights never move, so after the first forward nearly
/// every GEMM finds its maps here instead of encoding four to six per launch (the driver's encode
/// is host work on the launch path, which short requests are bound by).
pub struct TensorMapCache {
    maps: Mutex<HashMap<Tile2d, TensorMap>>,
}

impl TensorMapCache {
    /// Entries kept before the cache starts over (a forward of the 4B model holds a few hundred
    /// distinct maps; a bound keeps address churn from growing it forever).
    pub const CAPACITY: usize = 8192;

    pub fn new() -> Self {
        TensorMapCache { maps: Mutex::new(HashMap::new()) }
    }

    /// The map of `t`, encoded by the driver once.
    pub fn get(&self, t: &Tile2d) -> Result<TensorMap> {
        self.get_with(t, Tile2d::encode)
    }

    /// [`Self::get`] with the encoder given (tests count its calls).
    fn get_with(&self, t: &Tile2d, encode: impl FnOnce(&Tile2d) -> Result<TensorMap>) -> Result<TensorMap> {
        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = maps.get(t) {
            return Ok(*m);
        }
        let m = encode(t)?;
        if maps.len() >= Self::CAPACITY {
            maps.clear();
        }
        maps.insert(*t, m);
        Ok(m)
    }
}

impl Default for TensorMapCache {
    fn default() -> Self {
        Self::new()
    }
}

/// An encoded map, passed to a kernel by value.
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub struct TensorMap(sys::CUtensorMap);

// SAFETY: plain bytes (the driver's 128-byte opaque struct) that the kernel parameter `TmaMap`
// mirrors; the launch copies them into the parameter space.
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// All zeros: for a map parameter that this launch never reads (e.g. the LoRA operands of a
    /// GEMM without LoRA).
    pub fn unused() -> Self {
        TensorMap(sys::CUtensorMap { opaque: [0; 16] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x_tile() -> Tile2d {
        Tile2d {
            what: "X",
            elem: Elem::U8,
            addr: 1 << 20,
            cols: 2560,
            rows: 7824,
            row_stride: 2560,
            box_cols: 128,
            box_rows: 192,
            swizzle_128b: true,
        }
    }

    #[test]
    fn accepts_the_fp8_gemm_operands() {
        x_tile().check().unwrap();
        // X scales [K/128][M] f32, a dense box of a tile's rows; the box may exceed a small M.
        let xs = Tile2d {
            elem: Elem::F32,
            cols: 16,
            rows: 20,
            row_stride: 16,
            box_cols: 192,
            box_rows: 1,
            swizzle_128b: false,
            ..x_tile()
        };
        xs.check().unwrap();
        // A LoRA product T [m][rank] bf16: rank 16 is narrower than the 64-column box.
        let t = Tile2d { elem: Elem::Bf16, cols: 16, rows: 300, row_stride: 16, box_cols: 64, ..x_tile() };
        t.check().unwrap();
    }

    #[test]
    fn the_cache_encodes_each_description_once() {
        let cache = TensorMapCache::new();
        let mut calls = 0;
        let mut get = |t: &Tile2d| {
            cache
                .get_with(t, |_| {
                    calls += 1;
                    Ok(TensorMap::unused())
                })
                .unwrap()
        };
        get(&x_tile());
        get(&x_tile());
        get(&Tile2d { addr: 2 << 20, ..x_tile() });
        get(&Tile2d { box_rows: 128, ..x_tile() });
        get(&x_tile());
        assert_eq!(calls, 3, "one encode per distinct description");
        // A failed encode is an error and caches nothing.
        let bad = Tile2d { addr: 3, ..x_tile() };
        assert!(cache.get_with(&bad, |t| t.check().map(|_| TensorMap::unused())).is_err());
        assert_eq!(cache.maps.lock().unwrap().len(), 3);
    }

    #[test]
    fn names_the_rule_a_shape_breaks() {
        let err = |t: Tile2d| t.check().unwrap_err().to_string();
        assert!(err(Tile2d { addr: (1 << 20) + 8, ..x_tile() }).contains("16-byte aligned address"));
        assert!(err(Tile2d { row_stride: 2568 + 4, cols: 2568, ..x_tile() }).contains("multiple of 16 bytes"));
        assert!(err(Tile2d { box_rows: 257, ..x_tile() }).contains("box rows 257"));
        assert!(err(Tile2d { box_cols: 64, ..x_tile() }).contains("rows of 128 bytes"));
        assert!(err(Tile2d { rows: 0, ..x_tile() }).contains("non-empty"));
        assert!(err(Tile2d { row_stride: 128, ..x_tile() }).contains("below the row"));
        let t = Tile2d { elem: Elem::Bf16, box_cols: 4, swizzle_128b: false, ..x_tile() };
        assert!(err(t).contains("8 bytes is not a multiple of 16"));
    }
}
