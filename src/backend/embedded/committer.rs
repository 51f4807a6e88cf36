//! The committer: the second stage of the writer's pipeline. It commits each sealed batch
//! in one fsynced transaction and only then answers it, while the writer already applies
//! the next batch in memory, so a batch's in-memory work overlaps the previous one's sync.
//!
//! Batches arrive one at a time and in order: the writer seals the next one only once this
//! thread has reported the previous one [`Done`]. So answers leave in the order the batches
//! were applied, and an answer never leaves before every batch applied ahead of it is
//! durable. A batch with nothing to write is still answered in its turn: its answers may
//! rest on the batch ahead (a session called gone whose end that batch commits).
//!
//! If a commit fails the store fail-stops: this batch is answered `StoreFailed`, and so is
//! every later one, which [`super::store::Store::commit`] refuses.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::commands::Pending;
use super::shared::Shared;
use super::store::{Batch, Committed, Ended};
use super::tallies::Tally;
use super::writer::PacedPass;
use crate::backend::BackendError;
use crate::domain::{Change, UnixMs};

/// A batch applied in memory, handed over to be committed and answered.
pub struct Sealed {
    /// Commands in the batch, for the batch-size metric.
    pub count: usize,
    pub changes: Vec<Change>,
    /// The counters as the batch left them.
    pub revision: u64,
    pub event_seq: u64,
    /// Trim audit events older than this, at most so many.
    pub trim: Option<(UnixMs, usize)>,
    /// Sessions its reaper passes ended, whose rows go to the end log.
    pub ended: Ended,
    /// Apply pending end-log records for at least this many sessions.
    pub apply_ended: usize,
    pub pending: Vec<Pending>,
    pub tally: Tally,
    pub paced: Option<PacedPass>,
}

impl Sealed {
    /// Whether committing the batch writes anything.
    fn writes(&self) -> bool {
        !self.changes.is_empty()
            || self.trim.is_some()
            || self.apply_ended > 0
            || !self.ended.is_empty()
    }
}

/// What became of a sealed batch, reported back to the writer, which sizes passes and the
/// end-log applications from it.
pub struct Done {
    pub outcome: Outcome,
    /// The returned buffers, emptied, so the next batches reuse their capacity.
    pub changes: Vec<Change>,
    pub ended: Ended,
}

pub enum Outcome {
    /// Nothing to write: no commit ran.
    Nothing,
    Committed {
        took: Duration,
        done: Committed,
        /// Changes the batch wrote and sessions it sent to the end log.
        changes: usize,
        ended: usize,
        apply_ended: usize,
        paced: Option<PacedPass>,
    },
    Failed,
}

pub fn spawn(
    shared: Arc<Shared>,
    rx: Receiver<Sealed>,
    done: Sender<Done>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("leasehold-commit".into())
        .spawn(move || {
            for sealed in rx {
                let reported = commit(&shared, sealed);
                if done.send(reported).is_err() {
                    return;
                }
            }
        })
}

/// Commits one batch, then publishes its metrics, answers it, logs its ends and wakes who
/// waits for ends, in that order.
fn commit(shared: &Shared, mut sealed: Sealed) -> Done {
    let m = &shared.metrics;
    let outcome = if sealed.writes() {
        let started = Instant::now();
        let result = shared.store.commit(&Batch {
            changes: &sealed.changes,
            revision: sealed.revision,
            event_seq: sealed.event_seq,
            trim_events: sealed.trim,
            ended: Some(&sealed.ended),
            apply_ended: sealed.apply_ended,
        });
        let took = started.elapsed();
        m.commit_seconds.observe(took.as_secs_f64());
        m.commit_batch_size.observe(sealed.count as f64);
        match result {
            Ok(done) => {
                m.events_trimmed.inc_by(done.events_trimmed as u64);
                Outcome::Committed {
                    took,
                    done,
                    changes: sealed.changes.len(),
                    ended: sealed.ended.sessions.len(),
                    apply_ended: sealed.apply_ended,
                    paced: sealed.paced.take(),
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "commit failed; refusing writes from now on");
                m.store_failed.set(1);
                Outcome::Failed
            }
        }
    } else if shared.store.failed() {
        // Its answers may rest on a batch whose commit failed.
        Outcome::Failed
    } else {
        Outcome::Nothing
    };
    let failed = matches!(outcome, Outcome::Failed);
    // A failed batch ended nobody durably: its lines are dropped with its tally.
    let mut tally = std::mem::take(&mut sealed.tally);
    let ends = if failed {
        Vec::new()
    } else {
        std::mem::take(&mut tally.ends)
    };
    let ended = !failed && tally.any_end;
    if !failed {
        tally.publish(m);
    }
    for p in sealed.pending.drain(..) {
        p(failed);
    }
    // After the answers, so that writing the log never delays one.
    for line in &ends {
        line.log();
    }
    // After the commit, so that whoever wakes reads the ends in the log.
    if ended {
        shared.ends.notify_one();
    }
    if failed {
        let drained = shared.waiters.lock().drain();
        for w in drained {
            w.want.fail(BackendError::StoreFailed);
        }
    }
    sealed.changes.clear();
    sealed.ended.clear();
    Done {
        outcome,
        changes: sealed.changes,
        ended: sealed.ended,
    }
}
