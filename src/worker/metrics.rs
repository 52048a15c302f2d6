//! Engine-side Prometheus metrics (the HTTP side registers its own in the same registry).

use super::EngineOutput;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

pub struct EngineMetrics {
    pub queue_depth: IntGauge,
    pub queue_seconds: Histogram,
    pub vision_seconds: Histogram,
    pub prefill_seconds: Histogram,
    pub questions_seconds: Histogram,
    pub batch_requests: Histogram,
    pub passes: IntCounter,
    pub tokens: IntCounter,
    pub dropped: IntCounterVec,
    pub loaded: IntGauge,
    pub weight_bytes: IntGauge,
}

fn stage(name: &str, help: &str) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(vec![
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ]))
    .expect("valid histogram")
}

impl EngineMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = EngineMetrics {
            queue_depth: IntGauge::new("imajev_queue_depth", "Requests waiting for the engine")?,
            queue_seconds: stage("imajev_queue_wait_seconds", "Time requests waited in the queue"),
            vision_seconds: stage("imajev_vision_seconds", "Vision tower time per request"),
            prefill_seconds: stage("imajev_prefill_seconds", "Shared-prefix prefill time per request"),
            questions_seconds: stage("imajev_questions_seconds", "Time of all question passes of a request"),
            batch_requests: Histogram::with_opts(
                HistogramOpts::new(
                    "imajev_batch_requests",
                    "Requests answered by each engine round (one packed forward; 1 when a request runs alone)",
                )
                .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
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
            weight_bytes: IntGauge::new(
                "imajev_engine_weight_bytes",
                "Bytes of checkpoint weights mapped by the engine",
            )?,
        };
        registry.register(Box::new(m.queue_depth.clone()))?;
        registry.register(Box::new(m.queue_seconds.clone()))?;
        registry.register(Box::new(m.vision_seconds.clone()))?;
        registry.register(Box::new(m.prefill_seconds.clone()))?;
        registry.register(Box::new(m.questions_seconds.clone()))?;
        registry.register(Box::new(m.batch_requests.clone()))?;
        registry.register(Box::new(m.passes.clone()))?;
        registry.register(Box::new(m.tokens.clone()))?;
        registry.register(Box::new(m.dropped.clone()))?;
        registry.register(Box::new(m.loaded.clone()))?;
        registry.register(Box::new(m.weight_bytes.clone()))?;
        Ok(m)
    }

    pub fn record(&self, out: &EngineOutput) {
        self.vision_seconds.observe(out.vision_ms / 1e3);
        self.prefill_seconds.observe(out.prefill_ms / 1e3);
        self.questions_seconds.observe(out.questions_ms / 1e3);
        self.passes.inc_by(out.passes as u64);
        self.tokens.inc_by(out.tokens as u64);
    }
}
