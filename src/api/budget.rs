//! The process-wide budget of request memory in flight: bytes of bodies being read, decoded
//! (`Content-Encoding`), split (multipart) and parsed (the JSON values a request builds), summed
//! over every request being parsed at once.
//!
//! Why: each request is bounded on its own (the body cap, the decoded-size cap, the JSON value
//! cap), but a few concurrent requests at those caps would still exhaust memory. Every stage
//! reserves what it is about to hold before it holds it; a reservation is given back when its
//! [`Reservation`] is dropped (when the stage's buffer is freed, or when the request ends).
//! A reservation that cannot be granted is refused at once, never waited for:
//!
//! * 413 `request_too_large` when this request alone needs more than the whole budget;
//! * 529 `overloaded` (with `Retry-After`) when other requests hold the rest for now.
//!
//! Knows nothing about HTTP or JSON: callers say how many bytes and what for.

use super::error::ApiError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Default capacity: 1 GiB (8 bodies at the default 128 MiB cap, or one such body read, decoded
/// and parsed with room to spare).
pub const DEFAULT_INFLIGHT_BYTES: usize = 1 << 30;

/// A budget of bytes shared by all requests (see the module doc).
#[derive(Debug)]
pub struct MemoryBudget {
    capacity: usize,
    used: AtomicUsize,
}

/// Bytes held from a [`MemoryBudget`] until dropped. Reservations of one request can be merged
/// ([`Reservation::merge`]) so that the request carries one value.
#[derive(Debug)]
pub struct Reservation {
    budget: Option<Arc<MemoryBudget>>,
    bytes: usize,
}

impl MemoryBudget {
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(MemoryBudget { capacity, used: AtomicUsize::new(0) })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes reserved now, by all requests.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// A reservation of nothing yet, to [`Reservation::grow`].
    pub fn empty(self: &Arc<Self>) -> Reservation {
        Reservation { budget: Some(self.clone()), bytes: 0 }
    }

    /// Reserves `bytes` for a request that already holds `held` bytes, or refuses (413 when
    /// `held + bytes` exceeds the whole budget, else 529). `what` names the stage for the message.
    pub fn reserve(self: &Arc<Self>, bytes: usize, held: usize, what: &str) -> Result<Reservation, ApiError> {
        self.take(bytes, held, what)?;
        Ok(Reservation { budget: Some(self.clone()), bytes })
    }

    fn take(&self, bytes: usize, held: usize, what: &str) -> Result<(), ApiError> {
        if held.saturating_add(bytes) > self.capacity {
            return Err(ApiError::too_large(format!(
                "{what} would hold more than the server's in-flight request memory budget of {} bytes ({} MiB, --max-inflight-mb): send a smaller request",
                self.capacity,
                self.capacity >> 20
            )));
        }
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let next = cur.saturating_add(bytes);
            if next > self.capacity {
                return Err(ApiError::message(
                    529,
                    "overloaded",
                    format!(
                        "the server is busy: requests in flight hold its request memory budget ({} MiB, --max-inflight-mb); retry shortly",
                        self.capacity >> 20
                    ),
                )
                .with_retry_after(Duration::from_secs(1)));
            }
            match self.used.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }
}

impl Reservation {
    /// Holds nothing (for callers without a budget, e.g. the `decide` command and tests).
    pub fn none() -> Self {
        Reservation { budget: None, bytes: 0 }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Reserves `bytes` more from the same budget (nothing, without one); `other` is what the
    /// request holds besides this reservation (for the 413 decision).
    pub fn grow(&mut self, bytes: usize, other: usize, what: &str) -> Result<(), ApiError> {
        if let Some(b) = &self.budget {
            b.take(bytes, self.bytes.saturating_add(other), what)?;
            self.bytes += bytes;
        }
        Ok(())
    }

    /// An empty reservation from the same budget (none, without one).
    pub fn sibling(&self) -> Reservation {
        Reservation { budget: self.budget.clone(), bytes: 0 }
    }

    /// One reservation holding both (they must come from the same budget, or one holds nothing).
    pub fn merge(mut self, mut other: Reservation) -> Reservation {
        match (&self.budget, &other.budget) {
            (_, None) => {
                other.bytes = 0;
                self
            }
            (None, Some(_)) => {
                self.bytes = 0;
                other
            }
            (Some(a), Some(b)) => {
                debug_assert!(Arc::ptr_eq(a, b), "reservations of different budgets");
                self.bytes += std::mem::take(&mut other.bytes);
                self
            }
        }
    }
}

impl Default for Reservation {
    fn default() -> Self {
        Reservation::none()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.used.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

/// The process's budget, set once at start-up by [`set_global_capacity`] (default
/// [`DEFAULT_INFLIGHT_BYTES`]).
pub fn global() -> &'static Arc<MemoryBudget> {
    GLOBAL.get_or_init(|| MemoryBudget::new(DEFAULT_INFLIGHT_BYTES))
}

static GLOBAL: std::sync::OnceLock<Arc<MemoryBudget>> = std::sync::OnceLock::new();

/// Sets the process's budget; only the first call (before any request) takes effect. Returns
/// whether it did.
pub fn set_global_capacity(bytes: usize) -> bool {
    GLOBAL.set(MemoryBudget::new(bytes)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_release_and_refusals() {
        let b = MemoryBudget::new(1000);
        let r1 = b.reserve(600, 0, "the body").unwrap();
        assert_eq!(b.used(), 600);
        // Another request: fits the budget alone but not now → 529 with Retry-After.
        let e = b.reserve(500, 0, "the body").unwrap_err();
        assert_eq!((e.status, e.code), (529, "overloaded"));
        assert!(e.retry_after.is_some());
        // More than the whole budget for one request → 413, whatever is free.
        let e = b.reserve(500, 600, "the decoded body").unwrap_err();
        assert_eq!((e.status, e.code), (413, "request_too_large"));
        assert!(e.summary().contains("the decoded body"), "{}", e.summary());
        let r2 = b.reserve(400, 0, "x").unwrap();
        let both = r1.merge(r2);
        assert_eq!((both.bytes(), b.used()), (1000, 1000));
        drop(both);
        assert_eq!(b.used(), 0);
        let none = Reservation::none().merge(b.reserve(10, 0, "x").unwrap());
        assert_eq!(b.used(), 10);
        drop(none);
        assert_eq!(b.used(), 0);
        let mut g = b.empty();
        g.grow(700, 0, "x").unwrap();
        assert_eq!(g.grow(200, 200, "y").unwrap_err().status, 413);
        g.grow(300, 0, "x").unwrap();
        assert_eq!((g.bytes(), b.used()), (1000, 1000));
        let mut none = Reservation::none();
        none.grow(1 << 40, 0, "x").unwrap();
        drop(g);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_capacity() {
        let b = MemoryBudget::new(10_000);
        std::thread::scope(|s| {
            for _ in 0..8 {
                let b = b.clone();
                s.spawn(move || {
                    for _ in 0..10_000 {
                        if let Ok(r) = b.reserve(3000, 0, "x") {
                            assert!(b.used() <= 10_000);
                            drop(r);
                        }
                    }
                });
            }
        });
        assert_eq!(b.used(), 0);
    }
}
