//! Engine-side Prometheus metrics: the queue, the engine's stages and forwards, drops, the model
//! and its memory. The HTTP side ([`crate::api::metrics`]) registers its own in the same
//! registry, so `GET /metrics` shows both.
//!
//! What operators alert and scale on is here: queue depth against capacity, requests running,
//! tokens per second (`rate(imajev_tokens_total)`), passes and sequences per packed forward (how
//! well requests pack), drops by reason. Every reason of [`super::DROP_REASONS`] is a label from the
//! start (at 0), so `rate()` and absence alerts work before the first drop. Stage histograms
//! observe only the requests in which that stage ran (vision: requests with images; prefill:
//! requests whose prefix ran as its own stage), so their percentiles are not diluted by zeros.
//! GPU memory is read from the driver at scrape time ([`EngineMetrics::refresh`]); on the CPU
//! backend both GPU gauges stay 0.
//!
//! Knows the worker's outputs, not HTTP or questions.

use super::EngineOutput;
use crate::backend::MemoryProbe;
use prometheus::{
    Counter, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};
use std::sync::Mutex;

pub struct EngineMetrics {
    /// `imajev_queue_depth`: requests waiting for the engine.
    pub queue_depth: IntGauge,
    /// `imajev_queue_capacity`: how many may wait (`--queue-depth`).
    pub queue_capacity: IntGauge,
    /// `imajev_engine_requests_running`: requests in the engine's current round (with
    /// `--overlap-rounds`, also those of the round queued behind it).
    pub requests_running: IntGauge,
    /// `imajev_engine_busy_seconds_total`: wall time the engine thread spent in rounds (from
    /// taking a round's requests to having their results; a round queued behind another counts
    /// from that one's results, so overlapping rounds are counted once). Its rate is the engine's
    /// utilisation: near 1 the one GPU worker is saturated (scale out), and 1 − rate is the time
    /// it spent waiting for requests or between rounds.
    pub busy_seconds: Counter,
    pub queue_seconds: Histogram,
    pub vision_seconds: Histogram,
    pub prefill_seconds: Histogram,
    pub questions_seconds: Histogram,
    pub batch_requests: Histogram,
    /// `imajev_forward_passes`: passes (read-out sequences) per forward of the model.
    pub forward_passes: Histogram,
    /// `imajev_forward_sequences`: sequences (prefixes, shared tokens, passes) per forward.
    pub forward_sequences: Histogram,
    pub passes: IntCounter,
    pub tokens: IntCounter,
    pub dropped: IntCounterVec,
    pub loaded: IntGauge,
    /// `imajev_model_load_seconds`: how long the last model load took.
    pub load_seconds: Gauge,
    pub weight_bytes: IntGauge,
    pub gpu_memory_used: IntGauge,
    pub gpu_memory_total: IntGauge,
    /// Set once a model on a device is loaded; read on every scrape.
    memory_probe: Mutex<Option<MemoryProbe>>,
}

/// Buckets of the per-stage histograms (seconds): dense from 1 ms to 250 ms, where stages of
/// small requests on a GPU fall, then coarse up to a minute.
const STAGE_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Buckets of counts per round or forward (requests, passes, sequences).
const COUNT_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

fn stage(name: &str, help: &str) -> prometheus::Result<Histogram> {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(STAGE_BUCKETS.to_vec()))
}

fn counts(name: &str, help: &str) -> prometheus::Result<Histogram> {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(COUNT_BUCKETS.to_vec()))
}

impl EngineMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = EngineMetrics {
            queue_depth: IntGauge::new("imajev_queue_depth", "Requests waiting for the engine")?,
            queue_capacity: IntGauge::new(
                "imajev_queue_capacity",
                "Requests that may wait for the engine (--queue-depth); beyond that 529",
            )?,
            requests_running: IntGauge::new(
                "imajev_engine_requests_running",
                "Requests inside the engine now (its current round and any round queued behind it)",
            )?,
            busy_seconds: Counter::new(
                "imajev_engine_busy_seconds_total",
                "Seconds the engine spent running rounds (rate: its utilisation, 1 = saturated)",
            )?,
            queue_seconds: stage("imajev_queue_wait_seconds", "Time requests waited in the queue")?,
            vision_seconds: stage(
                "imajev_vision_seconds",
                "Vision tower time per request, of requests with images",
            )?,
            prefill_seconds: stage(
                "imajev_prefill_seconds",
                "Shared-prefix prefill time per request, of requests whose prefix ran as its own stage",
            )?,
            questions_seconds: stage("imajev_questions_seconds", "Time of all question passes of a request")?,
            batch_requests: counts(
                "imajev_batch_requests",
                "Requests answered by each engine round (one packed forward; 1 when a request runs alone)",
            )?,
            forward_passes: counts(
                "imajev_forward_passes",
                "Passes (read-out sequences) per forward of the model (0 for a prefix-only forward)",
            )?,
            forward_sequences: counts(
                "imajev_forward_sequences",
                "Sequences (prefixes, shared question tokens, passes) per forward of the model",
            )?,
            passes: IntCounter::new("imajev_passes_total", "Forward passes (question × rotation) run")?,
            tokens: IntCounter::new(
                "imajev_tokens_total",
                "Tokens processed by the engine (prefix once, suffixes per pass)",
            )?,
            dropped: IntCounterVec::new(
                Opts::new(
                    "imajev_jobs_dropped_total",
                    "Accepted requests stopped before finishing, by reason",
                ),
                &["reason"],
            )?,
            loaded: IntGauge::new("imajev_model_loaded", "1 once the model is loaded")?,
            load_seconds: Gauge::new("imajev_model_load_seconds", "Seconds the last model load took")?,
            weight_bytes: IntGauge::new(
                "imajev_engine_weight_bytes",
                "Bytes of weights the engine holds in host or device memory (after conversion and quantisation)",
            )?,
            gpu_memory_used: IntGauge::new(
                "imajev_gpu_memory_used_bytes",
                "Memory in use on the engine's GPU, by any process (0 on the CPU backend)",
            )?,
            gpu_memory_total: IntGauge::new(
                "imajev_gpu_memory_total_bytes",
                "Memory of the engine's GPU (0 on the CPU backend)",
            )?,
            memory_probe: Mutex::new(None),
        };
        for reason in super::DROP_REASONS {
            m.dropped.with_label_values(&[reason]);
        }
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.queue_depth.clone()),
            Box::new(m.queue_capacity.clone()),
            Box::new(m.requests_running.clone()),
            Box::new(m.busy_seconds.clone()),
            Box::new(m.queue_seconds.clone()),
            Box::new(m.vision_seconds.clone()),
            Box::new(m.prefill_seconds.clone()),
            Box::new(m.questions_seconds.clone()),
            Box::new(m.batch_requests.clone()),
            Box::new(m.forward_passes.clone()),
            Box::new(m.forward_sequences.clone()),
            Box::new(m.passes.clone()),
            Box::new(m.tokens.clone()),
            Box::new(m.dropped.clone()),
            Box::new(m.loaded.clone()),
            Box::new(m.load_seconds.clone()),
            Box::new(m.weight_bytes.clone()),
            Box::new(m.gpu_memory_used.clone()),
            Box::new(m.gpu_memory_total.clone()),
        ];
        for c in collectors {
            registry.register(c)?;
        }
        Ok(m)
    }

    /// Records one answered request's stages, passes, tokens and the forwards it opened.
    pub fn record(&self, out: &EngineOutput) {
        if out.vision_ran {
            self.vision_seconds.observe(out.vision_ms / 1e3);
        }
        if out.prefill_ran {
            self.prefill_seconds.observe(out.prefill_ms / 1e3);
        }
        self.questions_seconds.observe(out.questions_ms / 1e3);
        self.passes.inc_by(out.passes as u64);
        self.tokens.inc_by(out.tokens as u64);
        for f in &out.forwards {
            self.forward_passes.observe(f.passes as f64);
            self.forward_sequences.observe(f.sequences as f64);
        }
    }

    /// Keeps `probe` to read the device's memory on every [`EngineMetrics::refresh`], and reads it now.
    pub fn set_memory_probe(&self, probe: MemoryProbe) {
        *self.memory_probe.lock().unwrap_or_else(|e| e.into_inner()) = Some(probe);
        self.refresh();
    }

    /// Updates the sampled gauges (GPU memory) before a scrape.
    pub fn refresh(&self) {
        let probe = self.memory_probe.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(probe) = probe else { return };
        match probe() {
            Ok(m) => {
                self.gpu_memory_used.set(m.used as i64);
                self.gpu_memory_total.set(m.total as i64);
            }
            Err(e) => tracing::warn!("reading the GPU's memory for /metrics failed: {e:#}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DeviceMemory;
    use crate::worker::ForwardShape;
    use std::sync::Arc;

    #[test]
    fn drop_reasons_exist_before_the_first_drop() {
        let registry = Registry::new();
        let _m = EngineMetrics::new(&registry).unwrap();
        let family = registry.gather().into_iter().find(|f| f.name() == "imajev_jobs_dropped_total").unwrap();
        let mut labels: Vec<String> =
            family.get_metric().iter().map(|m| m.get_label()[0].value().to_string()).collect();
        labels.sort();
        assert_eq!(labels, ["deadline", "disconnected", "over_budget"]);
        assert!(family.get_metric().iter().all(|m| m.get_counter().get_value() == 0.0));
    }

    #[test]
    fn stages_that_did_not_run_are_not_observed() {
        let m = EngineMetrics::new(&Registry::new()).unwrap();
        let fused = EngineOutput {
            questions_ms: 3.0,
            passes: 4,
            tokens: 40,
            forwards: vec![ForwardShape { sequences: 5, passes: 4 }],
            ..Default::default()
        };
        m.record(&fused);
        assert_eq!((m.vision_seconds.get_sample_count(), m.prefill_seconds.get_sample_count()), (0, 0));
        assert_eq!(m.questions_seconds.get_sample_count(), 1);
        let alone = EngineOutput {
            vision_ms: 2.0,
            vision_ran: true,
            prefill_ms: 5.0,
            prefill_ran: true,
            passes: 2,
            forwards: vec![
                ForwardShape { sequences: 1, passes: 0 },
                ForwardShape { sequences: 2, passes: 2 },
            ],
            ..Default::default()
        };
        m.record(&alone);
        assert_eq!((m.vision_seconds.get_sample_count(), m.prefill_seconds.get_sample_count()), (1, 1));
        assert_eq!(m.prefill_seconds.get_sample_sum(), 0.005);
        assert_eq!(m.forward_passes.get_sample_count(), 3);
        assert_eq!(m.forward_passes.get_sample_sum(), m.passes.get() as f64);
        assert_eq!(m.forward_sequences.get_sample_sum(), 8.0);
    }

    #[test]
    fn gpu_memory_is_read_on_refresh() {
        let m = EngineMetrics::new(&Registry::new()).unwrap();
        m.refresh();
        assert_eq!((m.gpu_memory_used.get(), m.gpu_memory_total.get()), (0, 0));
        let used = Arc::new(std::sync::atomic::AtomicU64::new(10));
        let u = used.clone();
        m.set_memory_probe(Arc::new(move || {
            Ok(DeviceMemory { used: u.load(std::sync::atomic::Ordering::SeqCst), total: 100 })
        }));
        assert_eq!((m.gpu_memory_used.get(), m.gpu_memory_total.get()), (10, 100));
        used.store(30, std::sync::atomic::Ordering::SeqCst);
        m.refresh();
        assert_eq!(m.gpu_memory_used.get(), 30);
    }
}
