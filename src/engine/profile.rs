//! Stage timings for finding where time goes (`IMAJEV_PROFILE=1`): the device is synchronised at
//! every mark so each stage gets its own wall time. Off by default — synchronising costs speed.

use crate::backend::Backend;
use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Instant;

/// Stage timings: `IMAJEV_PROFILE` set to anything but empty, `0` or `kernels` (which asks the
/// backend for per-kernel device timings instead, without synchronising between stages).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("IMAJEV_PROFILE")
            .is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("kernels"))
    })
}

/// Logs the backend's per-kernel report for `what`, if it keeps one.
pub fn kernel_report<B: Backend>(backend: &B, what: &str) {
    match backend.kernel_report() {
        Ok(Some(r)) => tracing::info!("kernels of {what}: {r}"),
        Ok(None) => {}
        Err(e) => tracing::warn!("kernel profile of {what} failed: {e:#}"),
    }
}

pub struct StageTimer {
    on: bool,
    last: Instant,
    totals: BTreeMap<&'static str, (f64, usize)>,
}

impl StageTimer {
    pub fn start<B: Backend>(backend: &B) -> Self {
        let on = enabled();
        if on {
            let _ = backend.synchronize();
        }
        StageTimer { on, last: Instant::now(), totals: BTreeMap::new() }
    }

    /// Attributes the time since the previous mark to `stage`.
    pub fn mark<B: Backend>(&mut self, backend: &B, stage: &'static str) {
        if !self.on {
            return;
        }
        let _ = backend.synchronize();
        let now = Instant::now();
        let e = self.totals.entry(stage).or_insert((0.0, 0));
        e.0 += (now - self.last).as_secs_f64() * 1e3;
        e.1 += 1;
        self.last = now;
    }

    pub fn report(&self, what: &str, tokens: usize) {
        if !self.on || self.totals.is_empty() {
            return;
        }
        let parts: Vec<String> =
            self.totals.iter().map(|(k, (ms, n))| format!("{k} {ms:.2} ms/{n}")).collect();
        tracing::info!("profile {what} ({tokens} tokens): {}", parts.join(", "));
    }
}
