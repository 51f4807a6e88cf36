//! The load generator behind `leasehold bench`: fixed concurrency against any Leasehold
//! server, warm-up, a progress line, and latency per request from send to full response.
//!
//! With a target rate (`--rate`) each client sends on a fixed schedule and latency is taken
//! from the *intended* send time, so a stall shows up in the percentiles instead of being
//! hidden by the clients waiting for it (no coordinated omission).

pub mod cpu;
pub mod wire;
mod workloads;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::client::ClientError;
pub use workloads::{Storm, Workload, storm_report};

#[derive(Debug, Clone)]
pub struct Options {
    pub server: String,
    pub workload: Workload,
    pub clients: usize,
    pub warmup: Duration,
    pub duration: Duration,
    /// Keys for lock-churn.
    pub keys: usize,
    /// Live sessions for heartbeat and dying sessions for mass-expiry.
    pub sessions: usize,
    /// Total target rate in operations per second, or closed loop when `None`.
    pub rate: Option<f64>,
    /// TTL of the sessions that mass-expiry lets die.
    pub ttl_ms: u64,
    pub progress: bool,
    /// The server's process id, when it runs on this machine: its CPU time over the
    /// measured window is reported per operation (`server_cpu_us_per_op`).
    pub server_pid: Option<u32>,
}

/// One run's result, printed as a table or as one JSON line.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub workload: String,
    pub clients: usize,
    pub ops: u64,
    pub seconds: f64,
    pub ops_per_s: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub errors: u64,
    /// Workload-specific figures (mass-expiry: free_after_ms, storm and baseline p99).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    #[error("setup failed: {0}")]
    Setup(String),
}

/// Latencies in microseconds, 1 µs to 60 s at 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds")
}

/// Shared counters the progress line reads, and the CPU marks `drive` takes at the start
/// and the end of the measured window.
#[derive(Default)]
pub struct Progress {
    pub ops: AtomicU64,
    pub errors: AtomicU64,
    pub cpu: std::sync::Mutex<Option<(cpu::CpuMark, cpu::CpuMark)>>,
}

/// What one client task measured.
pub struct Measured {
    pub latency: Histogram<u64>,
    pub ops: u64,
    pub errors: u64,
}

/// Runs one client per state in `states` for warm-up plus duration. `op` does one unit of
/// work with a client's state (its connection among it) and returns the state with the
/// latencies to record (or an error). With a rate, each client paces itself and the latency
/// counts from the intended start.
pub async fn drive<S, F, Fut>(
    opts: &Options,
    states: Vec<S>,
    op: F,
    progress: Arc<Progress>,
) -> Vec<Measured>
where
    S: Send + 'static,
    F: Fn(S) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = (S, Result<Vec<Duration>, ()>)> + Send,
{
    let per_client = opts.rate.map(|r| r / states.len().max(1) as f64);
    let start = Instant::now();
    let measure_from = start + opts.warmup;
    let end = measure_from + opts.duration;
    let server_pid = opts.server_pid;
    let marks = progress.clone();
    let marker = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        let from = cpu::CpuMark::now(server_pid);
        tokio::time::sleep_until(end.into()).await;
        let to = cpu::CpuMark::now(server_pid);
        *marks.cpu.lock().unwrap_or_else(|p| p.into_inner()) = Some((from, to));
    });
    let mut tasks = Vec::new();
    for state in states {
        let op = op.clone();
        let progress = progress.clone();
        tasks.push(tokio::spawn(async move {
            let mut state = state;
            let mut m = Measured {
                latency: histogram(),
                ops: 0,
                errors: 0,
            };
            let mut sent: u64 = 0;
            loop {
                let intended = match per_client {
                    Some(rate) => {
                        let at = start + Duration::from_secs_f64(sent as f64 / rate);
                        tokio::time::sleep_until(at.into()).await;
                        Some(at)
                    }
                    None => None,
                };
                if Instant::now() >= end {
                    break;
                }
                sent += 1;
                let began = Instant::now();
                let (next, result) = op(state).await;
                state = next;
                let measuring = began >= measure_from;
                match result {
                    Ok(latencies) => {
                        // Under a rate, the wait for a late send counts too.
                        let mut late =
                            intended.map_or(Duration::ZERO, |at| began.duration_since(at));
                        if measuring {
                            for latency in latencies {
                                let us = (latency + late).as_micros().max(1) as u64;
                                let _ = m.latency.record(us.min(60_000_000));
                                late = Duration::ZERO;
                            }
                            m.ops += 1;
                        }
                        progress.ops.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(()) => {
                        if measuring {
                            m.errors += 1;
                        }
                        progress.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            m
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        if let Ok(m) = t.await {
            out.push(m);
        }
    }
    let _ = marker.await;
    out
}

/// Prints `ops/s` once a second on stderr until `done` is set.
pub fn spawn_progress(
    label: String,
    progress: Arc<Progress>,
    done: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let started = Instant::now();
        let mut last = 0;
        while !done.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let ops = progress.ops.load(Ordering::Relaxed);
            let errors = progress.errors.load(Ordering::Relaxed);
            eprint!(
                "\r{label}: {:>5.1}s  {:>9} ops  {:>8} ops/s  {} errors   ",
                started.elapsed().as_secs_f64(),
                ops,
                ops - last,
                errors
            );
            last = ops;
        }
        eprintln!();
    })
}

/// Folds the clients' measurements into one report.
pub fn report(workload: &str, clients: usize, seconds: f64, measured: Vec<Measured>) -> Report {
    let mut all = histogram();
    let (mut ops, mut errors) = (0, 0);
    for m in measured {
        let _ = all.add(&m.latency);
        ops += m.ops;
        errors += m.errors;
    }
    Report {
        workload: workload.to_string(),
        clients,
        ops,
        seconds,
        ops_per_s: if seconds > 0.0 {
            ops as f64 / seconds
        } else {
            0.0
        },
        p50_us: all.value_at_quantile(0.50),
        p99_us: all.value_at_quantile(0.99),
        p999_us: all.value_at_quantile(0.999),
        errors,
        extra: serde_json::Map::new(),
    }
}

/// Runs one workload and returns its report.
pub async fn run(opts: Options) -> Result<Report, BenchError> {
    workloads::run(opts).await
}

impl Report {
    /// Adds the CPU per operation of the window `drive` measured.
    pub fn with_cpu(mut self, progress: &Progress) -> Report {
        let marks = *progress.cpu.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((from, to)) = marks {
            cpu::per_op(from, to, self.ops, &mut self.extra);
        }
        self
    }

    /// A human-readable table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "workload   {}\nclients    {}\nops        {}\nseconds    {:.2}\nops/s      {:.0}\np50        {} µs\np99        {} µs\np99.9      {} µs\nerrors     {}\n",
            self.workload,
            self.clients,
            self.ops,
            self.seconds,
            self.ops_per_s,
            self.p50_us,
            self.p99_us,
            self.p999_us,
            self.errors
        );
        for (k, v) in &self.extra {
            out.push_str(&format!("{k:<10} {v}\n"));
        }
        out
    }
}
