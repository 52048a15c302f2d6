//! Large pixel buffers backed by transparent huge pages.
//!
//! Why: a decoded 4096² photo is a fresh 50 MB buffer, and the first write of each 4 KiB page
//! costs the kernel a page fault (and the zeroing of that page): 12,288 faults, measured at
//! 17-22 ms of a 58-61 ms libjpeg-turbo decode on the development host (the same decode into a
//! buffer written before takes 38 ms; bench/NOTES.md, thirty-second session). Asking the kernel to
//! back the buffer with 2 MiB pages (`madvise(MADV_HUGEPAGE)`: Linux's usual
//! `transparent_hugepage=madvise` mode gives huge pages only to ranges that ask) leaves ~25
//! faults. Nothing else changes: the same allocator owns the memory and frees it as any `Vec`, the
//! bytes written are the same, and where the advice is not honoured (THP off, another OS) the
//! buffer is an ordinary one. No crate does this for a `Vec` (the huge-page allocators replace the
//! global allocator or hand out their own types).

/// Below this many bytes a buffer is left to the allocator as is (a few faults, and small
/// allocations come from the heap's already-mapped pages).
pub(crate) const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

/// An empty `Vec<u8>` with room for exactly `len` bytes, its pages advised huge when `len` is at
/// least [`HUGE_PAGE_MIN_BYTES`]. `Err` when the allocation fails (as `Vec::try_reserve_exact`).
pub(crate) fn pixel_buffer(len: usize) -> Result<Vec<u8>, std::collections::TryReserveError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)?;
    if len >= HUGE_PAGE_MIN_BYTES {
        advise_huge_pages(v.as_ptr(), v.capacity());
    }
    Ok(v)
}

/// Advises the whole 4 KiB pages inside `[ptr, ptr + len)` to be backed by huge pages.
#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: *const u8, len: usize) {
    const PAGE: usize = 4096;
    let start = (ptr as usize).next_multiple_of(PAGE);
    let end = (ptr as usize + len) & !(PAGE - 1);
    if end > start {
        // SAFETY: [start, end) lies inside the allocation the caller's Vec owns, and nothing has
        // been written to it yet; MADV_HUGEPAGE changes only how the kernel backs those pages, not
        // their contents or their ownership. A failure (EINVAL where THP is compiled out) leaves
        // the buffer as it was, so the result is ignored.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_ptr: *const u8, _len: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_hold_what_is_written() {
        for len in [0, 1, 4095, HUGE_PAGE_MIN_BYTES - 1, HUGE_PAGE_MIN_BYTES, 3 * HUGE_PAGE_MIN_BYTES + 17] {
            let mut v = pixel_buffer(len).unwrap();
            assert_eq!(v.len(), 0);
            assert!(v.capacity() >= len);
            v.extend((0..len).map(|i| (i * 7 % 251) as u8));
            assert!(v.iter().enumerate().all(|(i, &b)| b == (i * 7 % 251) as u8), "len {len}");
        }
    }

    #[test]
    fn an_impossible_size_is_an_error_not_a_panic() {
        assert!(pixel_buffer(usize::MAX / 2).is_err());
    }
}
