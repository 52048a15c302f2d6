//! Readout logits copied to the host without waiting for them ([`Backend::readout_start`]).
//!
//! A copy into pageable memory returns only once the device has run everything queued before it,
//! so the host could not queue the next round behind a round's readout. Here each readout copies
//! into a pinned buffer and records an event after the copy; [`CudaBackend::readback_finish`]
//! waits for that event and moves the values out. Pinning memory costs far more than a round's
//! copy, so the buffers are kept and reused (a round's logits are kilobytes; a few buffers serve
//! any number of rounds, two of which are in flight at most).
//!
//! This layer knows nothing of rounds or requests: it moves `len` floats and says when they are
//! there.
//!
//! [`Backend::readout_start`]: crate::backend::Backend::readout_start

use super::CudaBackend;
use anyhow::{anyhow, ensure, Result};
use cudarc::driver::{CudaEvent, CudaSlice};
use std::sync::{Arc, Mutex};

/// Buffers kept for reuse beyond this many are freed (two rounds in flight need two).
const KEPT_BUFFERS: usize = 4;

/// Smallest pinned buffer, in floats (64 KiB): a round's logits fit many times over.
const MIN_FLOATS: usize = 16 << 10;

/// Page-locked host memory for `cap` floats, freed on drop.
pub(super) struct PinnedFloats {
    ptr: *mut f32,
    cap: usize,
}

// SAFETY: plain host memory owned by this value; only read after the copy into it has completed.
unsafe impl Send for PinnedFloats {}

impl PinnedFloats {
    fn new(cap: usize) -> Result<Self> {
        // SAFETY: a fresh allocation of `cap` floats (flags 0: cached, so the host reads it fast).
        let ptr = unsafe { cudarc::driver::result::malloc_host(cap * std::mem::size_of::<f32>(), 0) }?;
        Ok(PinnedFloats { ptr: ptr as *mut f32, cap })
    }
}

impl Drop for PinnedFloats {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`; every copy into it has completed (see `Readback`).
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// The buffers of finished readouts, waiting to be reused.
pub(super) type PinnedPool = Arc<Mutex<Vec<PinnedFloats>>>;

/// Floats on their way to the host: the CUDA backend's [`crate::backend::Backend::Readout`].
pub struct CudaReadout {
    /// `None` once finished (or for an empty readout).
    buf: Option<PinnedFloats>,
    len: usize,
    /// Recorded after the copy.
    done: Option<CudaEvent>,
    pool: PinnedPool,
}

impl Drop for CudaReadout {
    fn drop(&mut self) {
        // Dropped unfinished (an error path): the copy may still be writing into the buffer, which
        // must not be freed or reused before it is done.
        if let Some(buf) = self.buf.take() {
            if let Some(done) = &self.done {
                let _ = done.synchronize();
            }
            keep(&self.pool, buf);
        }
    }
}

/// Returns `buf` to the pool, or frees it when the pool is full.
fn keep(pool: &PinnedPool, buf: PinnedFloats) {
    let mut kept = pool.lock().unwrap_or_else(|p| p.into_inner());
    if kept.len() < KEPT_BUFFERS {
        kept.push(buf);
    }
}

/// The size of a buffer for `len` floats: at least [`MIN_FLOATS`], else `len` rounded up to a
/// power of two (so that a few sizes serve every round).
pub(super) fn buffer_floats(len: usize) -> usize {
    len.max(MIN_FLOATS).next_power_of_two()
}

impl CudaBackend {
    /// A readout of no floats (nothing to copy or wait for).
    pub(super) fn readback_empty(&self) -> CudaReadout {
        CudaReadout { buf: None, len: 0, done: None, pool: self.state.readback.clone() }
    }

    /// Queues the copy of `src[..len]` to the host and returns without waiting for it.
    pub(super) fn readback_start(&self, src: &CudaSlice<f32>, len: usize) -> Result<CudaReadout> {
        if len == 0 {
            return Ok(self.readback_empty());
        }
        let pool = self.state.readback.clone();
        ensure!(src.len() >= len, "readback of {len} floats from a buffer of {}", src.len());
        let reused = {
            let mut kept = pool.lock().unwrap_or_else(|p| p.into_inner());
            kept.iter().position(|b| b.cap >= len).map(|i| kept.swap_remove(i))
        };
        let buf = match reused {
            Some(b) => b,
            None => {
                self.state.ctx.bind_to_thread()?;
                PinnedFloats::new(buffer_floats(len))?
            }
        };
        let stream = &self.state.stream;
        // SAFETY: `buf` holds at least `len` floats and is neither read nor freed until the event
        // recorded below has completed (`readback_finish`, or the readout's drop); the source is
        // read in stream order before any later free of it.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                buf.ptr as *mut std::ffi::c_void,
                self.p(src),
                len * std::mem::size_of::<f32>(),
                stream.cu_stream(),
            )
            .result()?;
        }
        let done = match stream.record_event(None) {
            Ok(e) => e,
            Err(e) => {
                // Nothing to wait on: make sure the copy is done before the buffer goes back.
                stream.synchronize()?;
                keep(&pool, buf);
                return Err(anyhow!("recording the readout's event: {e:?}"));
            }
        };
        Ok(CudaReadout { buf: Some(buf), len, done: Some(done), pool })
    }

    /// Waits for a [`CudaBackend::readback_start`] copy and returns its floats.
    pub(super) fn readback_finish(&self, mut r: CudaReadout) -> Result<Vec<f32>> {
        let Some(buf) = r.buf.take() else { return Ok(Vec::new()) };
        if let Some(done) = &r.done {
            if let Err(e) = done.synchronize() {
                // The buffer may still be written to: wait for the whole stream before reusing it.
                let _ = self.state.stream.synchronize();
                keep(&r.pool, buf);
                return Err(anyhow!("waiting for the readout: {e:?}"));
            }
        }
        // SAFETY: the copy of `len <= cap` floats into `buf` has completed.
        let values = unsafe { std::slice::from_raw_parts(buf.ptr, r.len) }.to_vec();
        keep(&r.pool, buf);
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_in_few_sizes_and_hold_the_readout() {
        assert_eq!(buffer_floats(1), MIN_FLOATS);
        assert_eq!(buffer_floats(MIN_FLOATS), MIN_FLOATS);
        assert_eq!(buffer_floats(MIN_FLOATS + 1), 2 * MIN_FLOATS);
        for len in [1, 777, 96 * 61, 100_000, 1 << 20] {
            let cap = buffer_floats(len);
            assert!(cap >= len && cap.is_power_of_two(), "{len} -> {cap}");
        }
    }
}
