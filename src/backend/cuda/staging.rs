//! Host-to-device copies of small tables (token ids, row lists, segment tables) through a pinned
//! staging ring: a copy from pageable memory synchronises the stream, one from pinned memory does
//! not, so these keep the GPU queue full. When the ring wraps, the stream is synchronised once
//! before its bytes are reused. Large copies (weights) go straight from pageable memory.

use super::CudaBackend;
use anyhow::{anyhow, Result};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// The pinned ring (one per backend, used under the backend's lock).
pub(super) struct Staging {
    ptr: *mut u8,
    size: usize,
    cursor: usize,
    stream: Arc<CudaStream>,
}

pub(super) const STAGING_BYTES: usize = 8 << 20;

// SAFETY: the pinned buffer is only touched under the Mutex in `DeviceState`.
unsafe impl Send for Staging {}

impl Staging {
    pub(super) fn new(stream: Arc<CudaStream>) -> Result<Self> {
        stream.context().bind_to_thread()?;
        let ptr = unsafe { cudarc::driver::result::malloc_host(STAGING_BYTES, 0) }? as *mut u8;
        Ok(Staging { ptr, size: STAGING_BYTES, cursor: 0, stream })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

impl CudaBackend {
    /// A new device buffer holding `v`. Small copies go through the pinned staging ring (no stream
    /// synchronisation); large ones (weights) are plain pageable copies.
    pub(super) fn htod<T: cudarc::driver::DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        let stream = &self.state.stream;
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
        let mut st = self.state.staging.lock().map_err(|_| anyhow!("staging buffer poisoned"))?;
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
}
