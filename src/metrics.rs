//! Every metric name, label and bucket, in one place. Names are prefixed `leasehold_`;
//! counters get their `_total` suffix from the exposition.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::OnceLock;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueStateLabels {
    pub queue: String,
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabel {
    pub class: &'static str,
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

/// One route's request count and latency, resolved once: counting a request on it builds,
/// hashes and allocates no label set. The series are the same as `http_requests` and
/// `http_request_duration_seconds` give any other route (route template, method, status),
/// and each appears with its first request, as there.
pub struct RouteMeter {
    route: &'static str,
    method: &'static str,
    /// The counters of the statuses in [`METERED_STATUSES`], each made on first use.
    by_status: [OnceLock<Counter>; METERED_STATUSES.len()],
    seconds: OnceLock<Histogram>,
    requests: Family<RequestLabels, Counter>,
    request_seconds: Family<RouteLabel, Histogram>,
}

/// The statuses a metered route answers often enough to keep a handle for; any other is
/// counted through its family, as every status of an unmetered route is.
const METERED_STATUSES: [u16; 8] = [200, 201, 400, 403, 404, 409, 413, 429];

impl RouteMeter {
    pub fn route(&self) -> &'static str {
        self.route
    }

    pub fn method(&self) -> &'static str {
        self.method
    }

    /// Counts one answer of `status` that took `elapsed`.
    pub fn observe(&self, status: u16, elapsed: std::time::Duration) {
        let labels = || RequestLabels {
            route: self.route.to_owned(),
            method: self.method.to_owned(),
            status,
        };
        match METERED_STATUSES.iter().position(|&s| s == status) {
            Some(i) => self.by_status[i]
                .get_or_init(|| self.requests.get_or_create(&labels()).clone())
                .inc(),
            None => self.requests.get_or_create(&labels()).inc(),
        };
        self.seconds
            .get_or_init(|| {
                self.request_seconds
                    .get_or_create(&RouteLabel {
                        route: self.route.to_owned(),
                    })
                    .clone()
            })
            .observe(elapsed.as_secs_f64());
    }
}

/// The `reason` values of `leasehold_sessions_ended_total` (`EndReason::as_str`).
pub const SESSION_END_REASONS: [&str; 3] = ["closed", "expired", "admin"];

/// The `reason` values of `leasehold_jobs_failed_total`.
pub const JOB_FAIL_REASONS: [&str; 3] = [
    crate::domain::jobs::REASON_MAX_RECOVERIES,
    crate::domain::jobs::REASON_NOT_IDEMPOTENT,
    "worker",
];

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
    /// Sessions a reaper pass ended whose rows are still to be deleted (the embedded end log).
    pub end_log_sessions: Gauge,
    /// Session watches (`GET /v1/sessions/{id}/watch` streams) open on this node.
    pub watches_open: Gauge,
    pub store_failed: Gauge,
    /// Set from the engine's readiness at each scrape.
    pub ready: Gauge,
    pub sessions_opened: Counter,
    /// Calls with a `request_id` answered from the first call's record instead of acting.
    pub request_id_replays: Counter,
    pub sessions_ended: Family<ReasonLabel, Counter>,
    pub locks_acquired: Counter,
    pub locks_released: Counter,
    pub locks_released_by_expiry: Counter,
    pub heartbeats: Counter,
    pub events_trimmed: Counter,
    /// Log lines dropped because the queue to stderr was full; read at each scrape from
    /// `log_drops`, set by whoever set up the logging.
    log_lines_dropped: Counter,
    log_drops: OnceLock<fn() -> u64>,
    pub reaper_pass_seconds: Histogram,
    pub reaper_batch_size: Histogram,
    pub commit_seconds: Histogram,
    pub commit_batch_size: Histogram,
    pub requests: Family<RequestLabels, Counter>,
    pub request_seconds: Family<RouteLabel, Histogram>,
    pub seats_in_use: Family<PoolLabel, Gauge>,
    pub seats_capacity: Family<PoolLabel, Gauge>,
    pub seats_reclaimed: Counter,
    pub seats_refused: Counter,
    pub seat_wait_seconds: Histogram,
    pub jobs: Family<QueueStateLabels, Gauge>,
    pub jobs_recovered: Counter,
    pub jobs_failed: Family<ReasonLabel, Counter>,
    pub claim_wait_seconds: Histogram,
    /// 1 for the durability class of the backend's store (the Redis backend sets it).
    pub backend_durability: Family<ClassLabel, Gauge>,
}

/// What ending sessions together freed, as a backend that ends many in one statement or
/// script reports it.
pub struct EndCounts<'a> {
    /// Sessions ended, by reason: closed, expired, by an operator.
    pub by_reason: [u64; 3],
    pub locks: u64,
    pub seats: u64,
    pub recovered: u64,
    /// The reason of each job failed by the ends.
    pub failed: &'a [String],
}

impl Metrics {
    /// Counts sessions ended together: the session and lock gauges, the end counters by
    /// reason, locks freed by expiry (when every end was an expiry), seats reclaimed and
    /// jobs recovered or failed. Per-pool and per-queue gauges are the caller's.
    pub fn count_ends(&self, e: EndCounts<'_>) {
        let sessions: u64 = e.by_reason.iter().sum();
        self.sessions_active.dec_by(sessions as i64);
        self.locks_held.dec_by(e.locks as i64);
        for (reason, n) in crate::domain::EndReason::ALL.into_iter().zip(e.by_reason) {
            if n > 0 {
                self.sessions_ended
                    .get_or_create(&ReasonLabel {
                        reason: reason.as_str().into(),
                    })
                    .inc_by(n);
            }
        }
        if e.by_reason[1] == sessions {
            self.locks_released_by_expiry.inc_by(e.locks);
        }
        self.seats_reclaimed.inc_by(e.seats);
        self.jobs_recovered.inc_by(e.recovered);
        for reason in e.failed {
            self.jobs_failed
                .get_or_create(&ReasonLabel {
                    reason: reason.clone(),
                })
                .inc();
        }
    }

    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("leasehold");
        let m = Metrics {
            sessions_active: Gauge::default(),
            locks_held: Gauge::default(),
            waiters: Gauge::default(),
            end_log_sessions: Gauge::default(),
            watches_open: Gauge::default(),
            store_failed: Gauge::default(),
            ready: Gauge::default(),
            sessions_opened: Counter::default(),
            request_id_replays: Counter::default(),
            sessions_ended: Family::default(),
            locks_acquired: Counter::default(),
            locks_released: Counter::default(),
            locks_released_by_expiry: Counter::default(),
            heartbeats: Counter::default(),
            events_trimmed: Counter::default(),
            log_lines_dropped: Counter::default(),
            log_drops: OnceLock::new(),
            reaper_pass_seconds: Histogram::new(latency_buckets()),
            reaper_batch_size: Histogram::new(size_buckets()),
            commit_seconds: Histogram::new(latency_buckets()),
            commit_batch_size: Histogram::new(size_buckets()),
            requests: Family::default(),
            request_seconds: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            seats_in_use: Family::default(),
            seats_capacity: Family::default(),
            seats_reclaimed: Counter::default(),
            seats_refused: Counter::default(),
            seat_wait_seconds: Histogram::new(latency_buckets()),
            jobs: Family::default(),
            jobs_recovered: Counter::default(),
            jobs_failed: Family::default(),
            claim_wait_seconds: Histogram::new(latency_buckets()),
            backend_durability: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "sessions_active",
            "Sessions currently open",
            m.sessions_active.clone(),
        );
        registry.register("locks_held", "Locks currently held", m.locks_held.clone());
        registry.register(
            "waiters",
            "Requests waiting for a lock, a seat or a job",
            m.waiters.clone(),
        );
        registry.register(
            "end_log_sessions",
            "Sessions the reaper ended whose rows and grants are still to be deleted (embedded store)",
            m.end_log_sessions.clone(),
        );
        registry.register(
            "watches_open",
            "Session watch streams open on this node",
            m.watches_open.clone(),
        );
        registry.register(
            "store_failed",
            "1 once a storage write failed and writes are refused (fail-stop)",
            m.store_failed.clone(),
        );
        registry.register(
            "ready",
            "1 while writes are accepted (GET /readyz answers 200), else 0",
            m.ready.clone(),
        );
        registry.register(
            "sessions_opened",
            "Sessions opened",
            m.sessions_opened.clone(),
        );
        registry.register(
            "request_id_replays",
            "Calls with a request_id answered with the first call's answer instead of acting again",
            m.request_id_replays.clone(),
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
            "log_lines_dropped",
            "Log lines dropped because stderr was not taking them",
            m.log_lines_dropped.clone(),
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
        registry.register(
            "seats_in_use",
            "Seats held, by pool",
            m.seats_in_use.clone(),
        );
        registry.register(
            "seats_capacity",
            "Capacity, by pool",
            m.seats_capacity.clone(),
        );
        registry.register(
            "seats_reclaimed",
            "Seats taken back because their session ended",
            m.seats_reclaimed.clone(),
        );
        registry.register(
            "seat_acquisitions_refused",
            "Seat requests refused because the pool was full (at once or after waiting)",
            m.seats_refused.clone(),
        );
        registry.register(
            "seat_wait_seconds",
            "Time from a seat request to its grant",
            m.seat_wait_seconds.clone(),
        );
        registry.register("jobs", "Jobs by queue and state", m.jobs.clone());
        registry.register(
            "jobs_recovered",
            "Jobs put back in their queue because their worker's session ended",
            m.jobs_recovered.clone(),
        );
        registry.register(
            "jobs_failed",
            "Jobs failed, by reason: max_recoveries_exceeded, not_idempotent, or worker (failed by its worker)",
            m.jobs_failed.clone(),
        );
        registry.register(
            "claim_wait_seconds",
            "Time from a claim request to the job it got",
            m.claim_wait_seconds.clone(),
        );
        // Every value of a labelled counter exists from start-up, at zero: a rate or an
        // alert over it then sees a series before the first increment, not an absent one.
        for reason in SESSION_END_REASONS {
            let _ = m.sessions_ended.get_or_create(&ReasonLabel {
                reason: reason.into(),
            });
        }
        for reason in JOB_FAIL_REASONS {
            let _ = m.jobs_failed.get_or_create(&ReasonLabel {
                reason: reason.into(),
            });
        }
        registry.register(
            "backend_durability",
            "1 for what the backend's store keeps through a crash: crash_durable, aof_everysec, aof_no, no_aof, unknown",
            m.backend_durability.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The request meter of one route template and method.
    pub fn route_meter(&self, route: &'static str, method: &'static str) -> RouteMeter {
        RouteMeter {
            route,
            method,
            by_status: Default::default(),
            seconds: OnceLock::new(),
            requests: self.requests.clone(),
            request_seconds: self.request_seconds.clone(),
        }
    }

    /// Publishes the backend's durability class, the only series of its family.
    pub fn set_backend_durability(&self, class: &'static str) {
        self.backend_durability.clear();
        self.backend_durability
            .get_or_create(&ClassLabel { class })
            .set(1);
    }

    /// Publishes a pool's capacity and use; `None` removes a deleted pool's series.
    pub fn set_pool(&self, pool: &str, value: Option<(u32, usize)>) {
        let label = PoolLabel { pool: pool.into() };
        match value {
            Some((capacity, in_use)) => {
                self.seats_capacity
                    .get_or_create(&label)
                    .set(i64::from(capacity));
                self.seats_in_use.get_or_create(&label).set(in_use as i64);
            }
            None => {
                self.seats_capacity.remove(&label);
                self.seats_in_use.remove(&label);
            }
        }
    }

    /// Publishes a queue's job counts by state.
    pub fn set_queue(&self, queue: &str, counts: crate::domain::QueueCounts) {
        for (state, n) in [
            ("queued", counts.queued),
            ("claimed", counts.claimed),
            ("done", counts.done),
            ("failed", counts.failed),
        ] {
            self.jobs
                .get_or_create(&QueueStateLabels {
                    queue: queue.into(),
                    state,
                })
                .set(n as i64);
        }
    }

    /// Where `leasehold_log_lines_dropped_total` is read from at each scrape (the first
    /// call wins; without one it stays 0).
    pub fn count_log_drops_from(&self, read: fn() -> u64) {
        let _ = self.log_drops.set(read);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        // The log thread counts its drops; `fetch_max` keeps the counter monotonic whatever
        // the order concurrent scrapes read it in.
        if let Some(read) = self.log_drops.get() {
            self.log_lines_dropped
                .inner()
                .fetch_max(read(), std::sync::atomic::Ordering::Relaxed);
        }
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
            .get_or_create(&ReasonLabel {
                reason: "expired".into(),
            })
            .inc();
        let text = m.render();
        assert!(text.contains("leasehold_sessions_opened_total 1"), "{text}");
        assert!(text.contains("leasehold_sessions_ended_total{reason=\"expired\"} 1"));
        assert!(text.contains("leasehold_sessions_active"));
    }

    #[test]
    fn a_route_meter_counts_into_the_request_families() {
        let m = Metrics::new();
        let meter = m.route_meter("/v1/locks/{key}/acquire", "POST");
        assert!(!m.render().contains("route=\"/v1/locks/{key}/acquire\""));
        meter.observe(200, std::time::Duration::from_micros(70));
        meter.observe(200, std::time::Duration::from_micros(70));
        meter.observe(409, std::time::Duration::from_micros(70));
        meter.observe(503, std::time::Duration::from_micros(70));
        let text = m.render();
        for (status, n) in [(200, 2), (409, 1), (503, 1)] {
            let line = format!(
                "leasehold_http_requests_total{{route=\"/v1/locks/{{key}}/acquire\",method=\"POST\",status=\"{status}\"}} {n}"
            );
            assert!(text.contains(&line), "{line} missing:\n{text}");
        }
        let count =
            "leasehold_http_request_duration_seconds_count{route=\"/v1/locks/{key}/acquire\"} 4";
        assert!(text.contains(count), "{count} missing:\n{text}");
    }

    #[test]
    fn labelled_counters_start_at_zero() {
        let text = Metrics::new().render();
        for reason in SESSION_END_REASONS {
            let line = format!("leasehold_sessions_ended_total{{reason=\"{reason}\"}} 0");
            assert!(text.contains(&line), "{line} missing:\n{text}");
        }
        for reason in JOB_FAIL_REASONS {
            let line = format!("leasehold_jobs_failed_total{{reason=\"{reason}\"}} 0");
            assert!(text.contains(&line), "{line} missing:\n{text}");
        }
    }

    #[test]
    fn dropped_log_lines_are_read_at_each_scrape_and_never_go_back() {
        use std::sync::atomic::{AtomicU64, Ordering};
        static DROPPED: AtomicU64 = AtomicU64::new(0);
        let m = Metrics::new();
        assert!(m.render().contains("leasehold_log_lines_dropped_total 0\n"));
        m.count_log_drops_from(|| DROPPED.load(Ordering::Relaxed));
        DROPPED.store(7, Ordering::Relaxed);
        assert!(m.render().contains("leasehold_log_lines_dropped_total 7\n"));
        // A reading below the last one (a source reset) leaves the counter where it was.
        DROPPED.store(3, Ordering::Relaxed);
        assert!(m.render().contains("leasehold_log_lines_dropped_total 7\n"));
    }
}
