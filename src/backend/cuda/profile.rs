//! Per-kernel GPU timings for finding where device time goes (`IMAJEV_PROFILE=kernels`): a pair of
//! CUDA events around every kernel launch and GEMM, read back when the engine asks for a report.
//! Unlike the stage timer this never synchronises between launches, so the host keeps queueing
//! as it would in production, and the report can compare the host's wall time with the summed
//! device time (launch-bound vs device-bound). Off by default: events cost host time.

use anyhow::Result;
use cudarc::driver::{sys, CudaEvent, CudaStream};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub struct KernelProfiler {
    stream: Arc<CudaStream>,
    state: Mutex<Pending>,
}

struct Pending {
    since: Option<Instant>,
    events: Vec<(String, CudaEvent, CudaEvent)>,
}

impl KernelProfiler {
    pub fn from_env(stream: &Arc<CudaStream>) -> Option<Self> {
        let on = std::env::var("IMAJEV_PROFILE").is_ok_and(|v| v.eq_ignore_ascii_case("kernels"));
        on.then(|| KernelProfiler {
            stream: stream.clone(),
            state: Mutex::new(Pending { since: None, events: Vec::new() }),
        })
    }

    /// Times `f` (which queues device work on the stream) under `name`.
    pub fn time<T>(&self, name: impl Into<String>, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = self.stream.record_event(flags)?;
        let out = f()?;
        let b = self.stream.record_event(flags)?;
        let mut st = self.state.lock().expect("profiler lock");
        st.since.get_or_insert_with(Instant::now);
        st.events.push((name.into(), a, b));
        Ok(out)
    }

    /// Waits for the device, then returns one line per kernel name (total ms, launches, share)
    /// and a summary of host wall time vs summed device time since the previous report, and the
    /// device's span from the first kernel's start to the last one's end: span − device time is
    /// how long the device waited for the host inside those launches (a host-bound stretch).
    pub fn report(&self) -> Result<String> {
        let mut st = self.state.lock().expect("profiler lock");
        let queued = st.since.map(|t| t.elapsed().as_secs_f64() * 1e3).unwrap_or(0.0);
        self.stream.synchronize()?;
        let wall = st.since.take().map(|t| t.elapsed().as_secs_f64() * 1e3).unwrap_or(0.0);
        let span = match (st.events.first(), st.events.last()) {
            (Some((_, a, _)), Some((_, _, b))) => a.elapsed_ms(b)? as f64,
            _ => 0.0,
        };
        let mut totals: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        let mut device = 0.0;
        for (name, a, b) in st.events.drain(..) {
            let ms = a.elapsed_ms(&b)? as f64;
            device += ms;
            let e = totals.entry(name).or_insert((0.0, 0));
            e.0 += ms;
            e.1 += 1;
        }
        let launches: usize = totals.values().map(|v| v.1).sum();
        let mut rows: Vec<_> = totals.into_iter().collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let mut s = format!(
            "device {device:.3} ms in {launches} launches (span {span:.3} ms: idle {:.3}); host queued them in {queued:.3} ms, done after {wall:.3} ms\n",
            (span - device).max(0.0)
        );
        for (name, (ms, n)) in rows {
            s.push_str(&format!("  {ms:9.3} ms {n:6}x {:5.1}%  {name}\n", 100.0 * ms / device.max(1e-9)));
        }
        Ok(s)
    }
}
