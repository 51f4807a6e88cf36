//! The one writer: drains the channel into a batch and applies it to the state in memory,
//! then seals it and hands it to the committer (`committer`), which commits it in one
//! fsynced transaction and only then answers it. No reply leaves before its commit.
//!
//! The two form a pipeline of depth one: while the committer syncs batch N, the writer
//! applies batch N+1 in memory — a storm's next reaper pass, or the requests that arrive —
//! and seals it only once N is done. So commits and answers keep the order of the batches,
//! and a reader that finds memory ahead of the store waits, as it always did, for the batch
//! that brings the store level (see `ConfirmLive`).
//!
//! The state mutex is held only while applying in memory, never across a commit. If a
//! commit fails the store is fail-stopped and every request of that batch, and every later
//! one, is answered `StoreFailed`.
//!
//! Applying a command is `apply`'s, serving the waiters of what it freed is `serve`'s, and
//! the metrics of what the batch did are `tallies`'.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Select, Sender};

use super::commands::{Command, Pending, refuse};
use super::committer::{self, Done, Outcome, Sealed};
use super::requests::Requests;
use super::shared::Shared;
use super::store::Ended;
use super::tallies::Tally;
use crate::backend::BackendError;
use crate::backend::pacing::{PassCost, PassSizer};
use crate::domain::{At, Change, Effects, PoolName, PoolRecord, UnixMs};

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
    pipeline: Pipeline,
}

/// The writer's end of the pipeline to the committer.
struct Pipeline {
    seal: Option<Sender<Sealed>>,
    done: Receiver<Done>,
    committer: Option<JoinHandle<()>>,
    /// A sealed batch is with the committer and has not been reported done.
    in_flight: bool,
    /// The pools the batch with the committer writes, last write of each last: what a pool's
    /// record is until that batch is in the store.
    flight_pools: Vec<(PoolName, Option<PoolRecord>)>,
    /// Buffers returned by the committer, reused by the next batch sealed.
    spare_changes: Vec<Change>,
    spare_ended: Ended,
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
            let (seal, sealed) = crossbeam_channel::bounded(1);
            let (done_tx, done) = crossbeam_channel::bounded(1);
            let committer = match committer::spawn(shared.clone(), sealed, done_tx) {
                Ok(handle) => handle,
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the committer thread");
                    return;
                }
            };
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
                pipeline: Pipeline {
                    seal: Some(seal),
                    done,
                    committer: Some(committer),
                    in_flight: false,
                    flight_pools: Vec::new(),
                    spare_changes: Vec::new(),
                    spare_ended: Ended::default(),
                },
            }
            .run(rx)
        })
}

impl Writer {
    fn run(mut self, rx: Receiver<Command>) {
        let max = self.shared.config.max_batch;
        let mut batch = Vec::with_capacity(max);
        loop {
            let mut stop = false;
            match self.first(&rx) {
                Ok(Command::Stop) => stop = true,
                Ok(cmd) => batch.push(cmd),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => stop = true,
            }
            // Group commit: take whatever else is already queued, up to the cap, without
            // waiting for more.
            if !stop {
                stop = take_queued(&rx, &mut batch, max);
            }
            let count = batch.len();
            let refused = self.process(&mut batch);
            // While the batch ahead syncs, what arrives joins this one.
            let mut absorbed = 0;
            while self.pipeline.in_flight {
                let room = !stop && !refused && count + absorbed < max;
                match self.absorb(&rx, room) {
                    Absorbed::Done(done) => self.learn(done),
                    Absorbed::Command(Command::Stop) => stop = true,
                    Absorbed::Command(cmd) => {
                        batch.push(cmd);
                        stop = take_queued(&rx, &mut batch, max - count - absorbed - 1);
                        absorbed += batch.len();
                        self.process(&mut batch);
                    }
                    Absorbed::Disconnected => stop = true,
                }
            }
            if !refused {
                self.seal(count + absorbed);
            }
            if stop {
                self.finish();
                return;
            }
        }
    }

    /// Waits for the first command of the next batch: until a request arrives or the next
    /// waiter times out, or not at all with end-log records to apply and no storm on, which
    /// are applied now if nobody is waiting. A commit that finishes meanwhile is learned from
    /// at once, so an idle writer still applies the end log a storm's last batch filled.
    fn first(&mut self, rx: &Receiver<Command>) -> Result<Command, RecvTimeoutError> {
        loop {
            let wait = if self.applies_ends() {
                Some(Duration::ZERO)
            } else {
                let next_timeout = self.shared.waiters.lock().next_deadline();
                next_timeout
                    .map(|deadline| Duration::from_millis(deadline.since(self.shared.clock.now())))
            };
            let done = {
                let mut sel = Select::new();
                let command = sel.recv(rx);
                if self.pipeline.in_flight {
                    sel.recv(&self.pipeline.done);
                }
                let op = match wait {
                    Some(wait) => sel
                        .select_timeout(wait)
                        .map_err(|_| RecvTimeoutError::Timeout)?,
                    None => sel.select(),
                };
                if op.index() == command {
                    return op.recv(rx).map_err(|_| RecvTimeoutError::Disconnected);
                }
                op.recv(&self.pipeline.done)
            };
            match done {
                Ok(done) => self.learn(done),
                Err(_) => return Err(RecvTimeoutError::Disconnected),
            }
        }
    }

    /// Waits for the batch with the committer to be done, or, while `room`, for a command to
    /// add to the batch being built.
    fn absorb(&self, rx: &Receiver<Command>, room: bool) -> Absorbed {
        let mut sel = Select::new();
        let done = sel.recv(&self.pipeline.done);
        if room {
            sel.recv(rx);
        }
        let op = sel.select();
        if op.index() == done {
            return match op.recv(&self.pipeline.done) {
                Ok(d) => Absorbed::Done(d),
                // The committer is gone: nothing in flight will be reported.
                Err(_) => Absorbed::Disconnected,
            };
        }
        match op.recv(rx) {
            Ok(cmd) => Absorbed::Command(cmd),
            Err(_) => Absorbed::Disconnected,
        }
    }

    /// Whether the next batch applies end-log records: some are pending and no storm is
    /// being worked off (its passes come first).
    fn applies_ends(&self) -> bool {
        self.backlog > 0 && !self.storm
    }

    /// Applies `batch` to the state in memory, or refuses it when the store has failed;
    /// returns whether it refused.
    fn process(&mut self, batch: &mut Vec<Command>) -> bool {
        if self.shared.store.failed() {
            self.backlog = 0;
            for cmd in batch.drain(..) {
                refuse(cmd, BackendError::StoreFailed);
            }
            let drained = self.shared.waiters.lock().drain();
            for w in drained {
                w.want.fail(BackendError::StoreFailed);
            }
            return true;
        }
        let shared = self.shared.clone();
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
        false
    }

    /// Seals the batch built in memory and hands it to the committer. The batch ahead has
    /// been reported done, so the committer takes it at once.
    fn seal(&mut self, count: usize) {
        debug_assert!(!self.pipeline.in_flight);
        let shared = self.shared.clone();
        let (revision, event_seq) = {
            let state = shared.state.lock();
            self.shared
                .metrics
                .waiters
                .set(shared.waiters.lock().len() as i64);
            self.tally.touched(&self.fx.changes);
            self.tally.seal(&state);
            (state.revision(), state.event_seq())
        };
        let cutoff = UnixMs(
            shared
                .clock
                .wall()
                .0
                .saturating_sub(shared.config.event_retention_ms),
        );
        // Trimming is worth a commit only when the oldest event is past retention.
        let trim = self.trim_events
            && matches!(shared.store.oldest_event_at(), Ok(Some(at)) if at < cutoff);
        self.trim_events = false;
        let apply_ended = if self.applies_ends() && self.paced.is_none() {
            self.applier.next()
        } else {
            0
        };
        let p = &mut self.pipeline;
        let changes = std::mem::replace(&mut self.fx.changes, std::mem::take(&mut p.spare_changes));
        self.fx.clear();
        p.flight_pools.clear();
        for change in &changes {
            match change {
                Change::PutPool { name, record } => {
                    p.flight_pools.push((name.clone(), Some(record.clone())))
                }
                Change::DeletePool { name } => p.flight_pools.push((name.clone(), None)),
                _ => {}
            }
        }
        let sealed = Sealed {
            count,
            changes,
            revision,
            event_seq,
            trim: trim.then_some((cutoff, shared.config.event_trim_batch)),
            ended: std::mem::replace(&mut self.ended, std::mem::take(&mut p.spare_ended)),
            apply_ended,
            pending: std::mem::take(&mut self.pending),
            tally: std::mem::take(&mut self.tally),
            // A pass whose batch has nothing to commit (it ended no one) teaches nothing.
            paced: self.paced.take(),
        };
        let Some(tx) = p.seal.as_ref() else {
            return answer_failed(sealed);
        };
        match tx.send(sealed) {
            Ok(()) => p.in_flight = true,
            // The committer is gone (it could not start): nobody can answer durably.
            Err(e) => answer_failed(e.into_inner()),
        }
    }

    /// The pool's record as the batches not yet in the store leave it: `Some(None)` when
    /// they delete it, `None` when they do not touch it.
    pub fn unstored_pool(&self, pool: &PoolName) -> Option<Option<PoolRecord>> {
        written_pool(&self.fx.changes, pool)
            .map(|r| r.cloned())
            .or_else(|| {
                let flight = &self.pipeline.flight_pools;
                flight
                    .iter()
                    .rev()
                    .find(|(name, _)| name == pool)
                    .map(|(_, r)| r.clone())
            })
    }

    /// Learns from a batch the committer is done with: what the commit cost teaches the
    /// pass sizers, and what it applied and appended moves the end-log backlog.
    fn learn(&mut self, done: Done) {
        let p = &mut self.pipeline;
        p.in_flight = false;
        p.flight_pools.clear();
        p.spare_changes = done.changes;
        p.spare_ended = done.ended;
        match done.outcome {
            Outcome::Nothing => {}
            Outcome::Committed {
                took,
                done,
                changes,
                ended,
                apply_ended,
                paced,
            } => {
                // The pass's share of what the batch's contents added to its commit, by its
                // share of the changes; the commit a batch pays anyway is not its cost.
                let pass = paced.map(|pass| PassCost {
                    sessions: pass.sessions,
                    domain: pass.domain,
                    share: pass.changes as f64 / changes.max(1) as f64,
                });
                self.sizer.observe_commit(took, pass);
                self.learn_applying(took, done.ends_applied, changes);
                self.backlog = if apply_ended > 0 && done.ends_applied == 0 {
                    // The log was found empty: nothing is pending, whatever was counted.
                    ended
                } else {
                    (self.backlog + ended).saturating_sub(done.ends_applied)
                };
                self.shared
                    .metrics
                    .end_log_sessions
                    .set(self.backlog as i64);
            }
            // Nothing more is written, so nothing is applied: the next open does.
            Outcome::Failed => self.backlog = 0,
        }
    }

    /// Stops: waits for the batch in flight, answers every waiter, and stops the committer.
    fn finish(mut self) {
        if self.pipeline.in_flight
            && let Ok(done) = self.pipeline.done.recv()
        {
            self.learn(done);
        }
        let failed = self.shared.store.failed();
        let drained = self.shared.waiters.lock().drain();
        for w in drained {
            w.want.fail(if failed {
                BackendError::StoreFailed
            } else {
                BackendError::ShuttingDown
            });
        }
        self.shared.metrics.waiters.set(0);
        drop(self.pipeline.seal.take());
        if let Some(committer) = self.pipeline.committer.take() {
            let _ = committer.join();
        }
    }
}

enum Absorbed {
    Done(Done),
    Command(Command),
    Disconnected,
}

/// Moves up to `room` queued commands into `batch` without waiting; returns whether a
/// `Stop` was among them (it is not added, and nothing after it is taken).
fn take_queued(rx: &Receiver<Command>, batch: &mut Vec<Command>, room: usize) -> bool {
    for _ in 0..room {
        match rx.try_recv() {
            Ok(Command::Stop) => return true,
            Ok(cmd) => batch.push(cmd),
            Err(_) => break,
        }
    }
    false
}

/// Answers a sealed batch that no committer will take: `StoreFailed`, as a failed commit.
fn answer_failed(sealed: Sealed) {
    for p in sealed.pending {
        p(true);
    }
}

/// The record `changes` leave `pool` with, the last of them first: `Some(None)` when they
/// delete it, `None` when they do not touch it.
fn written_pool<'a>(changes: &'a [Change], pool: &PoolName) -> Option<Option<&'a PoolRecord>> {
    changes.iter().rev().find_map(|c| match c {
        Change::PutPool { name, record } if name == pool => Some(Some(record)),
        Change::DeletePool { name } if name == pool => Some(None),
        _ => None,
    })
}

impl Writer {
    /// Teaches the applier what applying `sessions` deferred ends added to a commit that took
    /// `took`: a batch that applied none teaches the commit a batch pays anyway. Three deletes
    /// a session against one write a change of the batch's own `changes`.
    fn learn_applying(&mut self, took: Duration, sessions: usize, changes: usize) {
        let pass = (sessions > 0).then(|| {
            let deletes = 3.0 * sessions as f64;
            PassCost {
                sessions,
                domain: Duration::ZERO,
                share: deletes / (deletes + changes as f64),
            }
        });
        self.applier.observe_commit(took, pass);
    }
}
