//! The reaper: sleeps until the earliest deadline (at most one reaper interval), then asks
//! the writer for a bounded pass, and again at once while passes come back full, so a mass
//! expiry is worked off in batches with other requests served between them.
//!
//! A pass holds the writer, so every request queued behind it waits for it. Passes are
//! therefore sized by time, not by a fixed count: see [`crate::backend::pacing`].

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, bounded};
use tokio::sync::oneshot;

use super::commands::{Command, PassSize};
use super::shared::Shared;
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
                    // What the pass ended is logged by the writer, with the storm's
                    // passes that follow it; here it is only timed.
                    Ok(Ok(_)) => {
                        shared
                            .metrics
                            .reaper_pass_seconds
                            .observe(last_pass.elapsed().as_secs_f64());
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
}
