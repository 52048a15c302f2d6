//! The API's Prometheus metrics, registered in the same registry as the engine's
//! ([`crate::worker::EngineMetrics`]), so `GET /metrics` shows both: every HTTP response (count
//! and latency by route and status code; routes are the registered patterns or `unmatched`, so
//! label values stay bounded), requests in flight (a scrape does not count itself), answered
//! decisions (latency by processed-token bucket, input length, counts by question type and
//! abstention, the `unknown_probability` distribution by type: how operators see routing drift),
//! the standard `process_*` metrics (the `prometheus` crate's process collector) and
//! `imajev_build_info` (what is served: version, commit, backend, contract, model, calibration).
//!
//! Label sets that alerts and `rate()` read are created at 0 up front (every token bucket, every
//! question type × abstained). Latency buckets are dense between 5 ms and 250 ms, where GPU medians live.
//!
//! Knows HTTP routes and question types, not tensors.

use crate::decision::answer::Tally;
use crate::decision::QuestionKind;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

pub struct HttpMetrics {
    /// `imajev_http_requests_total{route, code}`.
    pub requests: IntCounterVec,
    /// `imajev_http_requests_in_flight`: requests being served, `/metrics` scrapes left out.
    pub in_flight: IntGauge,
    /// `imajev_http_request_duration_seconds{route, code}`: every response, whatever its status.
    pub request_seconds: HistogramVec,
    /// `imajev_decision_duration_seconds{tokens}`: answered decisions, by processed-token bucket.
    pub decision_seconds: HistogramVec,
    /// `imajev_request_tokens`: processed tokens per answered decision.
    pub request_tokens: Histogram,
    /// `imajev_decisions_total{type, abstained}`: answered questions.
    pub decisions: IntCounterVec,
    /// `imajev_unknown_probability{type}`: of every scored question answered (a multi: per label).
    pub unknown_probability: HistogramVec,
}

/// Latency buckets (seconds): dense from 5 ms to 250 ms, then coarse up to two minutes.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09,
    0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Processed tokens per decision: the token buckets' bounds and the steps between them.
const TOKEN_BUCKETS: &[f64] = &[
    64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0, 131072.0, 262144.0,
];

const PROBABILITY_BUCKETS: &[f64] =
    &[0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99];

/// The `tokens` label values of `imajev_decision_duration_seconds`: each bucket's largest
/// processed-token count, and the label of the bucket above the last.
const TOKEN_LABELS: [(usize, &str); 5] =
    [(256, "256"), (1024, "1k"), (4096, "4k"), (16384, "16k"), (65536, "64k")];
const OVER_LABEL: &str = "over_64k";

/// The processed-token bucket label of a decision.
pub fn token_bucket(tokens: usize) -> &'static str {
    TOKEN_LABELS.iter().find(|(max, _)| tokens <= *max).map_or(OVER_LABEL, |(_, label)| label)
}

/// The route label of a response: the matched resource's pattern, or `unmatched`.
pub fn route_label(pattern: Option<String>) -> String {
    pattern.unwrap_or_else(|| "unmatched".into())
}

impl HttpMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = HttpMetrics {
            requests: IntCounterVec::new(
                Opts::new("imajev_http_requests_total", "HTTP requests answered, by route and status code"),
                &["route", "code"],
            )?,
            in_flight: IntGauge::new(
                "imajev_http_requests_in_flight",
                "HTTP requests being served (scrapes of /metrics not counted)",
            )?,
            request_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "imajev_http_request_duration_seconds",
                    "Wall time of every HTTP response, by route and status code",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["route", "code"],
            )?,
            decision_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "imajev_decision_duration_seconds",
                    "Wall time of answered POST /v1/systemone requests, by processed tokens (≤256, ≤1k, ≤4k, ≤16k, ≤64k, over)",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["tokens"],
            )?,
            request_tokens: Histogram::with_opts(
                HistogramOpts::new("imajev_request_tokens", "Processed tokens per answered decision")
                    .buckets(TOKEN_BUCKETS.to_vec()),
            )?,
            decisions: IntCounterVec::new(
                Opts::new(
                    "imajev_decisions_total",
                    "Answered questions, by type and whether the answer abstained (unknown selected)",
                ),
                &["type", "abstained"],
            )?,
            unknown_probability: HistogramVec::new(
                HistogramOpts::new(
                    "imajev_unknown_probability",
                    "unknown_probability of answered questions, by type (a multi: one per label)",
                )
                .buckets(PROBABILITY_BUCKETS.to_vec()),
                &["type"],
            )?,
        };
        for (_, label) in TOKEN_LABELS {
            m.decision_seconds.with_label_values(&[label]);
        }
        m.decision_seconds.with_label_values(&[OVER_LABEL]);
        for kind in QuestionKind::TYPE_NAMES {
            for abstained in ["true", "false"] {
                m.decisions.with_label_values(&[kind, abstained]);
            }
            m.unknown_probability.with_label_values(&[kind]);
        }
        registry.register(Box::new(m.requests.clone()))?;
        registry.register(Box::new(m.in_flight.clone()))?;
        registry.register(Box::new(m.request_seconds.clone()))?;
        registry.register(Box::new(m.decision_seconds.clone()))?;
        registry.register(Box::new(m.request_tokens.clone()))?;
        registry.register(Box::new(m.decisions.clone()))?;
        registry.register(Box::new(m.unknown_probability.clone()))?;
        registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
        Ok(m)
    }

    /// Records an answered decision: its latency, its processed tokens and every question's tally.
    pub fn record_decision(&self, tokens: usize, seconds: f64, tallies: &[Tally]) {
        self.decision_seconds.with_label_values(&[token_bucket(tokens)]).observe(seconds);
        self.request_tokens.observe(tokens as f64);
        for t in tallies {
            let abstained = if t.abstained { "true" } else { "false" };
            self.decisions.with_label_values(&[t.kind, abstained]).inc();
            let h = self.unknown_probability.with_label_values(&[t.kind]);
            for &u in &t.unknowns {
                h.observe(u);
            }
        }
    }

    /// Records a response (any route, any status).
    pub fn record_response(&self, route: &str, code: u16, seconds: f64) {
        let code = code.to_string();
        self.requests.with_label_values(&[route, &code]).inc();
        self.request_seconds.with_label_values(&[route, &code]).observe(seconds);
    }
}

/// What `imajev_build_info` says is served.
#[derive(Debug, Clone)]
pub struct BuildInfo {
    /// `cpu` or `cuda`.
    pub backend: String,
    /// The contract mode (`imajev`, `typesafe`).
    pub contract: String,
    /// The served model's name.
    pub model: String,
    /// The calibration's version, or `none`.
    pub calibration_version: String,
}

/// Registers `imajev_build_info{version,commit,backend,contract,model,calibration_version} 1`:
/// the crate's version, the commit it was built from (`unknown` outside git; see build.rs) and `info`.
pub fn register_build_info(registry: &Registry, info: &BuildInfo) -> prometheus::Result<()> {
    let g = IntGaugeVec::new(
        Opts::new(
            "imajev_build_info",
            "What is served: version, commit, backend, contract, model, calibration (value 1)",
        ),
        &["version", "commit", "backend", "contract", "model", "calibration_version"],
    )?;
    g.with_label_values(&[
        env!("CARGO_PKG_VERSION"),
        env!("IMAJEV_GIT_COMMIT"),
        &info.backend,
        &info.contract,
        &info.model,
        &info.calibration_version,
    ])
    .set(1);
    registry.register(Box::new(g))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        assert_eq!(token_bucket(256), "256");
        assert_eq!(token_bucket(257), "1k");
        assert_eq!(token_bucket(65536), "64k");
        assert_eq!(token_bucket(65537), "over_64k");
    }

    #[test]
    fn latency_buckets_are_dense_between_5_and_250_ms() {
        let inside: Vec<f64> =
            LATENCY_BUCKETS.iter().copied().filter(|b| (0.005..=0.25).contains(b)).collect();
        assert!(inside.len() >= 20, "{inside:?}");
        for w in inside.windows(2) {
            // No step wider than half the bound below it (or 2.5 ms).
            assert!(w[1] - w[0] <= (w[0] * 0.5).max(0.0025) + 1e-12, "{w:?}");
        }
    }

    #[test]
    fn decisions_are_preinitialised_and_counted() {
        let registry = Registry::new();
        let m = HttpMetrics::new(&registry).unwrap();
        let series = |name: &str| -> usize {
            registry.gather().iter().find(|f| f.name() == name).map_or(0, |f| f.get_metric().len())
        };
        assert_eq!(series("imajev_decisions_total"), 8);
        assert_eq!(series("imajev_decision_duration_seconds"), 6);
        assert_eq!(series("imajev_unknown_probability"), 4);
        let tally =
            |kind, abstained, unknowns: &[f64]| Tally { kind, abstained, unknowns: unknowns.to_vec() };
        m.record_decision(300, 0.02, &[tally("multi", true, &[0.7, 0.9]), tally("choice", false, &[0.1])]);
        assert_eq!(m.decisions.with_label_values(&["multi", "true"]).get(), 1);
        assert_eq!(m.decisions.with_label_values(&["choice", "false"]).get(), 1);
        assert_eq!(m.unknown_probability.with_label_values(&["multi"]).get_sample_count(), 2);
        assert_eq!(m.decision_seconds.with_label_values(&["1k"]).get_sample_count(), 1);
        assert_eq!(m.request_tokens.get_sample_sum(), 300.0);
    }

    #[test]
    fn build_info_names_what_is_served() {
        let registry = Registry::new();
        let info = BuildInfo {
            backend: "cpu".into(),
            contract: "imajev".into(),
            model: "m".into(),
            calibration_version: "none".into(),
        };
        register_build_info(&registry, &info).unwrap();
        let f = registry.gather().into_iter().find(|f| f.name() == "imajev_build_info").unwrap();
        let m = &f.get_metric()[0];
        let labels: Vec<(&str, &str)> = m.get_label().iter().map(|l| (l.name(), l.value())).collect();
        assert!(labels.contains(&("version", env!("CARGO_PKG_VERSION"))), "{labels:?}");
        assert!(labels.contains(&("backend", "cpu")) && labels.contains(&("calibration_version", "none")));
        assert_eq!(m.get_gauge().get_value(), 1.0);
    }
}
