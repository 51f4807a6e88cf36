//! The reaper: sleeps until the earliest deadline (at most one reaper interval), then asks
//! the writer for a bounded pass, and again at once while passes come back full, so a mass
//! expiry is worked off in batches with other requests served between them.
//!
//! A pass holds the writer, so every request queued behind it waits for it. Passes are
//! therefore sized by time, not by a fixed count: the writer's [`PassSizer`] learns what a
//! session costs from the passes so far and ends as many as fit in `reaper_pass_ms`.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, bounded};
use tokio::sync::oneshot;

use super::Shared;
use super::writer::{Command, PassSize};
use crate::domain::Mono;

pub struct ReaperHandle {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl ReaperHandle {
    pub fn stop(self) {
        drop(self.stop);
        let _ = self.thread.join();
    }
}

/// How long to sleep before the next look: until the earliest deadline, but never longer
/// than `interval_ms`, so a session opened meanwhile with an earlier deadline is still
/// ended within one interval of it.
pub fn next_wait_ms(earliest: Option<Mono>, now: Mono, interval_ms: u64) -> u64 {
    match earliest {
        Some(d) => d.since(now).min(interval_ms),
        None => interval_ms,
    }
}

/// Sizes reaper passes so that one holds the writer for about `budget`.
///
/// A pass's time is a fixed part (the commit's fsync, queueing) plus a part per session;
/// dividing it by the sessions ended gives a cost per session that includes a share of the
/// fixed part, so the size this converges on makes the whole pass, fsync included, take
/// about the budget. The cost is smoothed so one slow pass (a busy disk) shrinks the next
/// without collapsing it, and the size stays within `[MIN_PASS, max]`: a pass always makes
/// progress, and never ends more than the configured batch.
#[derive(Debug, Clone)]
pub struct PassSizer {
    budget: Duration,
    max: usize,
    /// Smoothed cost of ending one session, in nanoseconds; `None` before the first pass.
    per_session_ns: Option<f64>,
}

/// The fewest sessions a pass asks for, however slow the last ones were.
pub const MIN_PASS: usize = 64;

impl PassSizer {
    pub fn new(budget: Duration, max: usize) -> PassSizer {
        PassSizer {
            budget,
            max: max.max(1),
            per_session_ns: None,
        }
    }

    /// How many sessions the next pass asks for. The first pass is modest, so that a
    /// storm's first pass does not hold the writer for the whole of a large batch.
    pub fn next(&self) -> usize {
        let want = match self.per_session_ns {
            None => MIN_PASS * 4,
            Some(ns) => (self.budget.as_nanos() as f64 / ns.max(1.0)) as usize,
        };
        want.clamp(MIN_PASS.min(self.max), self.max)
    }

    /// Learns from a pass that ended `sessions` in `took`. Passes that ended none say
    /// nothing about the cost per session.
    pub fn observe(&mut self, sessions: usize, took: Duration) {
        if sessions == 0 {
            return;
        }
        let sample = took.as_nanos() as f64 / sessions as f64;
        self.per_session_ns = Some(match self.per_session_ns {
            None => sample,
            Some(old) => 0.5 * old + 0.5 * sample,
        });
    }
}

pub fn spawn(shared: Arc<Shared>, writer: Sender<Command>) -> std::io::Result<ReaperHandle> {
    let (stop, stopped) = bounded::<()>(0);
    let thread = std::thread::Builder::new()
        .name("leasehold-reaper".into())
        .spawn(move || {
            let interval = shared.config.reaper_interval_ms;
            let mut last_pass = Instant::now();
            loop {
                let now = shared.clock.now();
                let earliest = shared.state.lock().earliest_deadline();
                let wait = next_wait_ms(earliest, now, interval);
                // A pass is due when a deadline has come, and at least once an interval
                // anyway so that audit events are trimmed.
                let due = wait == 0 || last_pass.elapsed() >= Duration::from_millis(interval);
                if !due {
                    match stopped.recv_timeout(Duration::from_millis(wait.max(1))) {
                        Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
                        _ => return,
                    }
                }
                last_pass = Instant::now();
                let (reply, rx) = oneshot::channel();
                let pass = Command::Reap {
                    size: PassSize::Paced,
                    reply,
                };
                if writer.send(pass).is_err() {
                    return;
                }
                match rx.blocking_recv() {
                    Ok(Ok(outcome)) => {
                        let m = &shared.metrics;
                        m.reaper_pass_seconds
                            .observe(last_pass.elapsed().as_secs_f64());
                        if outcome.sessions > 0 {
                            // Per pass, and a storm takes many: the metrics count them.
                            tracing::debug!(
                                sessions = outcome.sessions,
                                locks = outcome.locks,
                                "reaped expired sessions"
                            );
                        }
                    }
                    // The store failed or the writer stopped: nothing more to do.
                    Ok(Err(_)) | Err(_) => {
                        if stopped.recv().is_err() {
                            return;
                        }
                    }
                }
                // Re-evaluate at once, unless stopping: while sessions are still due, the
                // next pass follows straight away.
                if let Err(crossbeam_channel::TryRecvError::Disconnected) = stopped.try_recv() {
                    return;
                }
            }
        })?;
    Ok(ReaperHandle { stop, thread })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleeps_until_earliest_deadline_capped_by_interval() {
        assert_eq!(next_wait_ms(None, Mono(0), 1_000), 1_000);
        assert_eq!(next_wait_ms(Some(Mono(300)), Mono(100), 1_000), 200);
        assert_eq!(next_wait_ms(Some(Mono(5_000)), Mono(100), 1_000), 1_000);
        assert_eq!(next_wait_ms(Some(Mono(50)), Mono(100), 1_000), 0);
    }

    #[test]
    fn passes_are_sized_to_the_time_budget() {
        let mut s = PassSizer::new(Duration::from_millis(2), 10_000);
        assert_eq!(s.next(), MIN_PASS * 4, "modest before anything is known");
        // 256 sessions in 1 ms: 3.9 µs each, so 2 ms fits 512.
        s.observe(256, Duration::from_millis(1));
        assert_eq!(s.next(), 512);
        // Sessions that cost nothing still never exceed the configured batch.
        for _ in 0..40 {
            s.observe(10_000, Duration::from_micros(1));
        }
        assert_eq!(s.next(), 10_000);
        // A disk stall shrinks the next passes, but never below the floor.
        for _ in 0..40 {
            s.observe(MIN_PASS, Duration::from_secs(1));
        }
        assert_eq!(s.next(), MIN_PASS);
        // An empty pass teaches nothing.
        let before = s.next();
        s.observe(0, Duration::from_secs(5));
        assert_eq!(s.next(), before);
    }

    #[test]
    fn a_small_configured_batch_is_the_ceiling_and_the_floor() {
        let s = PassSizer::new(Duration::from_millis(2), 10);
        assert_eq!(s.next(), 10);
    }
}
