//! Host-to-device copies of small tables (token ids, row lists, segment tables, rotary tables)
//! through a pinned staging ring: a copy from pageable memory may wait for the stream, one from
//! pinned memory does not, so these keep the GPU queue full — and let the host queue a round's
//! uploads while the previous round still runs.
//!
//! Bytes of the ring are reused only once the copies that read them have run. The ring is cut
//! into [`QUARTERS`] parts; entering a part waits for the event recorded when the ring last left
//! it ([`Quarters`]), which follows every copy out of that part. The wait is for copies queued a
//! whole ring earlier, long finished in practice: the stream itself is never synchronised. Large
//! copies (over a quarter: weights) go straight from pageable memory.

use super::CudaBackend;
use anyhow::{anyhow, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use std::sync::Arc;

/// The pinned ring (one per backend, used under the backend's lock).
pub(super) struct Staging {
    ptr: *mut u8,
    size: usize,
    cursor: usize,
    quarters: Quarters<Arc<CudaEvent>>,
    stream: Arc<CudaStream>,
}

/// 32 MiB: a round of 8,192 tokens uploads ~4.5 MB (its rotary tables are 2 MB each), so the
/// ring turns over every ~7 rounds and a quarter (8 MiB) holds the rotary table of a 32K-token
/// prefix.
pub(super) const STAGING_BYTES: usize = 32 << 20;

/// The parts of the ring that are waited for separately.
pub(super) const QUARTERS: usize = 4;

// SAFETY: the pinned buffer is only touched under the Mutex in `DeviceState`.
unsafe impl Send for Staging {}

impl Staging {
    pub(super) fn new(stream: Arc<CudaStream>) -> Result<Self> {
        stream.context().bind_to_thread()?;
        let ptr = unsafe { cudarc::driver::result::malloc_host(STAGING_BYTES, 0) }? as *mut u8;
        Ok(Staging { ptr, size: STAGING_BYTES, cursor: 0, quarters: Quarters::default(), stream })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// Which parts of the ring have copies out of them that may not have run yet.
///
/// `open` parts are those the cursor is in (written since they were last entered). When a copy
/// enters a part that is not open, one event is recorded (it follows every copy queued so far) and
/// given to each open part the copy does not touch, which closes; then each part the copy enters
/// waits for its own event, if it has one. An open part has no event.
/// Generic over the event so that the bookkeeping is tested without a GPU.
#[derive(Debug)]
pub(super) struct Quarters<E> {
    events: [Option<E>; QUARTERS],
    open: [bool; QUARTERS],
}

impl<E> Default for Quarters<E> {
    fn default() -> Self {
        Quarters { events: std::array::from_fn(|_| None), open: [false; QUARTERS] }
    }
}

impl<E: Clone> Quarters<E> {
    /// Before bytes `at..at + len` of a ring of `size` bytes are written (`len <= size /
    /// QUARTERS`, not wrapping): records an event when needed (`record`) and waits (`wait`) for the
    /// events of the parts it enters.
    pub(super) fn enter(
        &mut self,
        at: usize,
        len: usize,
        size: usize,
        record: impl FnOnce() -> Result<E>,
        mut wait: impl FnMut(E) -> Result<()>,
    ) -> Result<()> {
        let part = size / QUARTERS;
        let (first, last) = (at / part, (at + len.max(1) - 1) / part);
        debug_assert!(last < QUARTERS && last <= first + 1, "a copy spans at most two parts");
        let entered = |q: usize| (first..=last).contains(&q);
        if (first..=last).all(|q| self.open[q]) {
            return Ok(());
        }
        // The parts left behind get one event after every copy so far (a part the copy goes on
        // writing stays open: waiting for its copies would wait for this very round).
        if (0..QUARTERS).any(|q| self.open[q] && !entered(q)) {
            let event = record()?;
            for q in (0..QUARTERS).filter(|&q| !entered(q)) {
                if std::mem::take(&mut self.open[q]) {
                    self.events[q] = Some(event.clone());
                }
            }
        }
        for q in first..=last {
            if !self.open[q] {
                if let Some(e) = self.events[q].take() {
                    wait(e)?;
                }
                self.open[q] = true;
            }
        }
        Ok(())
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
        if bytes > STAGING_BYTES / QUARTERS {
            return Ok(stream.clone_htod(v)?);
        }
        // SAFETY: written by the copy below before any kernel reads it (stream order).
        let dst = unsafe { stream.alloc::<T>(v.len()) }?;
        let mut guard = self.state.staging.lock().map_err(|_| anyhow!("staging buffer poisoned"))?;
        let st = &mut *guard;
        let mut at = st.cursor.div_ceil(256) * 256;
        if at + bytes > st.size {
            at = 0;
        }
        // Every earlier copy out of the bytes about to be written must have run.
        st.quarters.enter(
            at,
            bytes,
            st.size,
            || Ok(Arc::new(stream.record_event(None)?)),
            |e| Ok(e.synchronize()?),
        )?;
        // SAFETY: `at + bytes <= size` bytes of the pinned ring are ours: the copies that read
        // them before have run (above); `v` is plain data of `bytes` bytes.
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A ring of `size` bytes written by copies of the given lengths in order (wrapping as
    /// `htod` does). Returns, per copy, the events it waited for; events are numbered by the copy
    /// count when they were recorded (an event numbered n follows copies 0..n).
    fn run(size: usize, lens: &[usize]) -> Vec<Vec<usize>> {
        let mut q = Quarters::<usize>::default();
        let mut cursor = 0;
        let mut waits = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            let mut at = cursor;
            if at + len > size {
                at = 0;
            }
            let waited = RefCell::new(Vec::new());
            q.enter(
                at,
                len,
                size,
                || Ok(i),
                |e| {
                    waited.borrow_mut().push(e);
                    Ok(())
                },
            )
            .unwrap();
            waits.push(waited.into_inner());
            cursor = at + len;
        }
        waits
    }

    /// Replays the copies and checks the invariant the ring relies on: before a copy writes a
    /// byte, it has waited for an event recorded after every earlier copy that read that byte.
    fn check(size: usize, lens: &[usize]) {
        let waits = run(size, lens);
        // last_reader[b]: the index of the last copy that used byte b (in units of 1 byte).
        let mut last_reader: Vec<Option<usize>> = vec![None; size];
        let mut covered = 0; // every copy < covered is known to have run
        let mut cursor = 0;
        for (i, &len) in lens.iter().enumerate() {
            let mut at = cursor;
            if at + len > size {
                at = 0;
            }
            for &e in &waits[i] {
                covered = covered.max(e);
            }
            for (b, reader) in last_reader.iter_mut().enumerate().skip(at).take(len) {
                if let Some(r) = *reader {
                    assert!(r < covered, "copy {i} overwrites byte {b} of copy {r}, not yet waited for");
                }
                *reader = Some(i);
            }
            cursor = at + len;
        }
    }

    #[test]
    fn a_part_is_rewritten_only_after_its_copies_ran() {
        let size = 1024;
        check(size, &[100; 40]);
        check(size, &[256; 20]);
        check(size, &[255, 1, 256, 3, 200, 250, 17, 256, 256, 9, 100, 100, 100, 250, 250, 250]);
        let irregular: Vec<usize> = (0..200).map(|i| 1 + (i * 37 + i * i * 11) % 256).collect();
        check(size, &irregular);
    }

    #[test]
    fn the_first_pass_waits_for_nothing_and_events_are_few() {
        let size = 1024;
        // 10 copies of 100 bytes fill the ring once: no waits; the 11th wraps into part 0.
        let waits = run(size, &[100; 11]);
        assert!(waits[..10].iter().all(|w| w.is_empty()));
        // Part 0 closed when copy 5 (bytes 500..600) entered part 2: that event follows copies
        // 0..5, among them copies 0..3, the ones that read part 0.
        assert_eq!(waits[10], vec![5]);
        // Over many turns, one wait per part entered (not per copy).
        let waits = run(size, &[100; 100]);
        let total: usize = waits.iter().map(|w| w.len()).sum();
        assert!(total <= 100 * 100 * QUARTERS / size + QUARTERS, "{total} waits");
    }
}
