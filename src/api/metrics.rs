//! HTTP-side Prometheus metrics, registered in the same registry as the engine's
//! ([`crate::worker::EngineMetrics`]), so `GET /metrics` shows both.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry};

pub struct HttpMetrics {
    /// `imajev_http_requests_total{route, code}`.
    pub requests: IntCounterVec,
    /// `imajev_http_requests_in_flight`.
    pub in_flight: IntGauge,
    /// `imajev_decision_duration_seconds{tokens}`: answered decisions, by processed-token bucket.
    pub decision_seconds: HistogramVec,
    /// `imajev_process_resident_memory_bytes`, refreshed on every scrape.
    pub resident_bytes: IntGauge,
}

/// The processed-token bucket label of a decision.
pub fn token_bucket(tokens: usize) -> &'static str {
    match tokens {
        0..=256 => "256",
        257..=1024 => "1k",
        1025..=4096 => "4k",
        4097..=16384 => "16k",
        16385..=65536 => "64k",
        _ => "over_64k",
    }
}

impl HttpMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = HttpMetrics {
            requests: IntCounterVec::new(
                Opts::new("imajev_http_requests_total", "HTTP requests answered, by route and status code"),
                &["route", "code"],
            )?,
            in_flight: IntGauge::new("imajev_http_requests_in_flight", "HTTP requests being served")?,
            decision_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "imajev_decision_duration_seconds",
                    "Wall time of answered POST /v1/systemone requests, by processed tokens (≤256, ≤1k, ≤4k, ≤16k, ≤64k)",
                )
                .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]),
                &["tokens"],
            )?,
            resident_bytes: IntGauge::new("imajev_process_resident_memory_bytes", "Resident memory of the server process")?,
        };
        registry.register(Box::new(m.requests.clone()))?;
        registry.register(Box::new(m.in_flight.clone()))?;
        registry.register(Box::new(m.decision_seconds.clone()))?;
        registry.register(Box::new(m.resident_bytes.clone()))?;
        Ok(m)
    }

    /// Updates the gauges that are sampled rather than counted.
    pub fn refresh(&self) {
        if let Some(b) = resident_bytes() {
            self.resident_bytes.set(b as i64);
        }
    }
}

/// Resident set size from `/proc/self/statm` (Linux), else None.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
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
}
