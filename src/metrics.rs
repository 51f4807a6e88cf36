//! Every metric name, label and bucket, in one place. Names are prefixed `leasehold_`;
//! counters get their `_total` suffix from the exposition.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: String,
    pub method: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    pub route: String,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    // 50 µs … ~3.3 s
    exponential_buckets(0.000_05, 2.0, 17)
}

fn size_buckets() -> impl Iterator<Item = f64> {
    // 1 … 65 536
    exponential_buckets(1.0, 2.0, 17)
}

pub struct Metrics {
    registry: Registry,
    pub sessions_active: Gauge,
    pub locks_held: Gauge,
    pub waiters: Gauge,
    pub store_failed: Gauge,
    pub sessions_opened: Counter,
    pub sessions_ended: Family<ReasonLabel, Counter>,
    pub locks_acquired: Counter,
    pub locks_released: Counter,
    pub locks_released_by_expiry: Counter,
    pub heartbeats: Counter,
    pub events_trimmed: Counter,
    pub reaper_pass_seconds: Histogram,
    pub reaper_batch_size: Histogram,
    pub commit_seconds: Histogram,
    pub commit_batch_size: Histogram,
    pub requests: Family<RequestLabels, Counter>,
    pub request_seconds: Family<RouteLabel, Histogram>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("leasehold");
        let m = Metrics {
            sessions_active: Gauge::default(),
            locks_held: Gauge::default(),
            waiters: Gauge::default(),
            store_failed: Gauge::default(),
            sessions_opened: Counter::default(),
            sessions_ended: Family::default(),
            locks_acquired: Counter::default(),
            locks_released: Counter::default(),
            locks_released_by_expiry: Counter::default(),
            heartbeats: Counter::default(),
            events_trimmed: Counter::default(),
            reaper_pass_seconds: Histogram::new(latency_buckets()),
            reaper_batch_size: Histogram::new(size_buckets()),
            commit_seconds: Histogram::new(latency_buckets()),
            commit_batch_size: Histogram::new(size_buckets()),
            requests: Family::default(),
            request_seconds: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            registry: Registry::default(),
        };
        registry.register(
            "sessions_active",
            "Sessions currently open",
            m.sessions_active.clone(),
        );
        registry.register("locks_held", "Locks currently held", m.locks_held.clone());
        registry.register(
            "lock_waiters",
            "Acquire requests waiting for a lock",
            m.waiters.clone(),
        );
        registry.register(
            "store_failed",
            "1 once a storage write failed and writes are refused (fail-stop)",
            m.store_failed.clone(),
        );
        registry.register(
            "sessions_opened",
            "Sessions opened",
            m.sessions_opened.clone(),
        );
        registry.register(
            "sessions_ended",
            "Sessions ended, by reason: closed, expired, admin",
            m.sessions_ended.clone(),
        );
        registry.register("locks_acquired", "Locks granted", m.locks_acquired.clone());
        registry.register(
            "locks_released",
            "Locks released by their holder",
            m.locks_released.clone(),
        );
        registry.register(
            "locks_released_by_expiry",
            "Locks released because their session expired",
            m.locks_released_by_expiry.clone(),
        );
        registry.register("heartbeats", "Heartbeats accepted", m.heartbeats.clone());
        registry.register(
            "events_trimmed",
            "Audit events removed by the retention setting",
            m.events_trimmed.clone(),
        );
        registry.register(
            "reaper_pass_seconds",
            "Time one reaper pass held the writer",
            m.reaper_pass_seconds.clone(),
        );
        registry.register(
            "reaper_batch_size",
            "Sessions ended by one reaper pass",
            m.reaper_batch_size.clone(),
        );
        registry.register(
            "commit_seconds",
            "Time of one group commit, fsync included",
            m.commit_seconds.clone(),
        );
        registry.register(
            "commit_batch_size",
            "Requests applied in one group commit",
            m.commit_batch_size.clone(),
        );
        registry.register(
            "http_requests",
            "HTTP requests by route, method and status",
            m.requests.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "HTTP request latency by route",
            m.request_seconds.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prefixed_names() {
        let m = Metrics::new();
        m.sessions_opened.inc();
        m.sessions_ended
            .get_or_create(&ReasonLabel { reason: "expired" })
            .inc();
        let text = m.render();
        assert!(text.contains("leasehold_sessions_opened_total 1"), "{text}");
        assert!(text.contains("leasehold_sessions_ended_total{reason=\"expired\"} 1"));
        assert!(text.contains("leasehold_sessions_active"));
    }
}
