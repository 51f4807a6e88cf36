//! The one writer: drains the channel into a batch, applies it to the state, commits it in
//! one fsynced transaction, then answers. No reply leaves before its commit.
//!
//! The state mutex is held only while applying a batch in memory, never across the commit.
//! If the commit fails the store is fail-stopped and every request of the batch, and every
//! later one, is answered `StoreFailed`.
//!
//! Applying a command is `apply`'s, serving the waiters of what it freed is `serve`'s, and
//! the metrics of what the batch did are `tallies`'.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use super::commands::{Command, Pending, refuse};
use super::requests::Requests;
use super::shared::Shared;
use super::store::{Batch, Ended};
use super::tallies::Tally;
use crate::backend::pacing::{PassCost, PassSizer};
use crate::backend::{BackendError, ReapOutcome};
use crate::domain::{At, Effects, UnixMs};

/// A paced pass in the batch being built: what it ended and what that cost before the
/// commit, so the sizer can learn its share of the batch.
pub struct PacedPass {
    pub sessions: usize,
    pub changes: usize,
    pub domain: Duration,
}

/// The writer thread's state between and during batches.
pub struct Writer {
    pub shared: Arc<Shared>,
    /// What the batch being applied asks the store to persist.
    pub fx: Effects,
    /// The batch's answers, sent once it has committed.
    pub pending: Vec<Pending>,
    pub tally: Tally,
    /// A reaper pass asked for old audit events to be trimmed in this batch's commit.
    pub trim_events: bool,
    pub sizer: PassSizer,
    pub paced: Option<PacedPass>,
    /// The reaper has found sessions due; the writer keeps reaping until none are.
    pub storm: bool,
    /// The remembered request ids.
    pub requests: Requests,
    /// The sessions this batch's reaper passes ended, whose rows go to the end log.
    pub ended: Ended,
    /// Sessions in end-log records not yet applied. Zero at start: opening the store
    /// applies every pending record.
    pub backlog: usize,
    /// Sizes the end-log applications that ride batches, like reaper passes.
    pub applier: PassSizer,
}

pub fn spawn(
    shared: Arc<Shared>,
    rx: Receiver<Command>,
    requests: Requests,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("leasehold-writer".into())
        .spawn(move || {
            let sizer = PassSizer::new(
                Duration::from_millis(shared.config.reaper_pass_ms),
                shared.config.reaper_batch,
            );
            Writer {
                applier: sizer.clone(),
                sizer,
                shared,
                fx: Effects::default(),
                pending: Vec::new(),
                tally: Tally::default(),
                trim_events: false,
                paced: None,
                storm: false,
                requests,
                ended: Ended::default(),
                backlog: 0,
            }
            .run(rx)
        })
}

impl Writer {
    fn run(mut self, rx: Receiver<Command>) {
        let mut batch = Vec::with_capacity(self.shared.config.max_batch);
        loop {
            // Sleep until a request arrives or the next waiter times out; with end-log
            // records to apply and no storm on, apply them now if nobody is waiting.
            let next_timeout = self.shared.waiters.lock().next_deadline();
            let first = match next_timeout {
                _ if self.applies_ends() => rx.try_recv().map_err(|e| match e {
                    TryRecvError::Empty => RecvTimeoutError::Timeout,
                    TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                }),
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(deadline) => {
                    let wait = deadline.since(self.shared.clock.now());
                    rx.recv_timeout(Duration::from_millis(wait))
                }
            };
            let mut stop = false;
            match first {
                Ok(Command::Stop) => stop = true,
                Ok(cmd) => batch.push(cmd),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => stop = true,
            }
            // Group commit: take whatever else is already queued, up to the cap, without
            // waiting for more.
            while !stop && batch.len() < self.shared.config.max_batch {
                match rx.try_recv() {
                    Ok(Command::Stop) => stop = true,
                    Ok(cmd) => batch.push(cmd),
                    Err(_) => break,
                }
            }
            self.process(&mut batch);
            if stop {
                let drained = self.shared.waiters.lock().drain();
                for w in drained {
                    w.want.fail(BackendError::ShuttingDown);
                }
                self.shared.metrics.waiters.set(0);
                return;
            }
        }
    }

    /// Whether the next batch applies end-log records: some are pending and no storm is
    /// being worked off (its passes come first).
    fn applies_ends(&self) -> bool {
        self.backlog > 0 && !self.storm
    }

    fn process(&mut self, batch: &mut Vec<Command>) {
        let count = batch.len();
        if self.shared.store.failed() {
            self.backlog = 0;
            for cmd in batch.drain(..) {
                refuse(cmd, BackendError::StoreFailed);
            }
            let drained = self.shared.waiters.lock().drain();
            for w in drained {
                w.want.fail(BackendError::StoreFailed);
            }
            return;
        }
        let shared = self.shared.clone();
        let (revision, event_seq) = {
            let mut state = shared.state.lock();
            let mut waiters = shared.waiters.lock();
            let at = At {
                now: shared.clock.now(),
                wall: shared.clock.wall(),
            };
            for cmd in batch.drain(..) {
                self.apply(&mut state, &mut waiters, cmd, at);
                self.settle(&mut state, &mut waiters, at);
            }
            self.carry_on_storm(&mut state, &mut waiters, at);
            self.time_out_waiters(&mut state, &mut waiters, at);
            self.shared.metrics.waiters.set(waiters.len() as i64);
            (state.revision(), state.event_seq())
        };

        let mut failed = false;
        let cutoff = UnixMs(
            shared
                .clock
                .wall()
                .0
                .saturating_sub(shared.config.event_retention_ms),
        );
        // Trimming is worth a commit only when the oldest event is past retention.
        if self.trim_events {
            self.trim_events =
                matches!(shared.store.oldest_event_at(), Ok(Some(at)) if at < cutoff);
        }
        let apply_ended = if self.applies_ends() && self.paced.is_none() {
            self.applier.next()
        } else {
            0
        };
        if !self.fx.changes.is_empty() || self.trim_events || apply_ended > 0 {
            let commit_started = Instant::now();
            let result = shared.store.commit(&Batch {
                changes: &self.fx.changes,
                revision,
                event_seq,
                trim_events: self
                    .trim_events
                    .then_some((cutoff, shared.config.event_trim_batch)),
                ended: Some(&self.ended),
                apply_ended,
            });
            let commit_took = commit_started.elapsed();
            let m = &shared.metrics;
            m.commit_seconds.observe(commit_took.as_secs_f64());
            m.commit_batch_size.observe(count as f64);
            match result {
                Ok(done) => {
                    m.events_trimmed.inc_by(done.events_trimmed as u64);
                    // The pass's share of what the batch's contents added to its commit,
                    // by its share of the changes; the commit a batch pays anyway is not
                    // its cost.
                    let pass = self.paced.take().map(|pass| PassCost {
                        sessions: pass.sessions,
                        domain: pass.domain,
                        share: pass.changes as f64 / self.fx.changes.len().max(1) as f64,
                    });
                    self.sizer.observe_commit(commit_took, pass);
                    self.learn_applying(commit_took, done.ends_applied);
                    self.backlog = if apply_ended > 0 && done.ends_applied == 0 {
                        // The log was found empty: nothing is pending, whatever was counted.
                        self.ended.sessions.len()
                    } else {
                        (self.backlog + self.ended.sessions.len()).saturating_sub(done.ends_applied)
                    };
                    m.end_log_sessions.set(self.backlog as i64);
                }
                Err(e) => {
                    tracing::error!(error = %e, "commit failed; refusing writes from now on");
                    m.store_failed.set(1);
                    failed = true;
                    // Nothing more is written, so nothing is applied: the next open does.
                    self.backlog = 0;
                }
            }
        }
        self.tally.touched(&self.fx.changes);
        self.fx.clear();
        self.ended.clear();
        self.trim_events = false;
        // A pass whose batch had nothing to commit (it ended no one) teaches nothing.
        self.paced = None;
        // A failed batch ended nobody durably: its lines are dropped with its tally.
        let mut ends = Vec::new();
        let mut reaped = ReapOutcome::default();
        let mut ended = false;
        if !failed {
            let mut tally = std::mem::take(&mut self.tally);
            ends = std::mem::take(&mut tally.ends);
            reaped = tally.reaped;
            ended = tally.any_end;
            tally.publish(&shared.metrics, &shared.state.lock());
        }
        for p in self.pending.drain(..) {
            p(failed);
        }
        // After the replies, so that writing the log never delays an answer.
        for line in &ends {
            line.log();
        }
        reaped.log();
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
    }
}

impl Writer {
    /// Teaches the applier what applying `sessions` deferred ends added to a commit that took
    /// `took`: a batch that applied none teaches the commit a batch pays anyway. Three deletes
    /// a session against one write a change of the batch's own.
    fn learn_applying(&mut self, took: Duration, sessions: usize) {
        let pass = (sessions > 0).then(|| {
            let deletes = 3.0 * sessions as f64;
            PassCost {
                sessions,
                domain: Duration::ZERO,
                share: deletes / (deletes + self.fx.changes.len() as f64),
            }
        });
        self.applier.observe_commit(took, pass);
    }
}
