//! The one writer: drains the channel into a batch, applies it to the state, commits it in
//! one fsynced transaction, then answers. No reply leaves before its commit.
//!
//! The state mutex is held only while applying a batch in memory, never across the commit.
//! If the commit fails the store is fail-stopped and every request of the batch, and every
//! later one, is answered `StoreFailed`.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use tokio::sync::oneshot;

use super::waiters::{GrantReply, Waiters};
use super::{Closed, EngineError, Granted, OpenedSession, ReapOutcome, Shared};
use crate::domain::time::to_wall;
use crate::domain::{
    AcquireError, Change, EndReason, Ended, HeartbeatError, LockKey, Mono, SessionId, State, Token,
    UnixMs,
};
use crate::metrics::ReasonLabel;
use crate::store::Batch;

type Reply<T> = oneshot::Sender<Result<T, EngineError>>;

pub enum Command {
    Open {
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: String,
        reply: Reply<OpenedSession>,
    },
    Heartbeat {
        id: SessionId,
        ttl_ms: Option<u64>,
        reply: Reply<super::Beat>,
    },
    End {
        id: SessionId,
        reason: EndReason,
        reply: Reply<Option<Closed>>,
    },
    Acquire {
        id: SessionId,
        key: LockKey,
        /// Wait until this instant if the lock is held; `None` answers at once.
        deadline: Option<Mono>,
        reply: GrantReply,
    },
    Release {
        id: SessionId,
        key: LockKey,
        token: Token,
        reply: Reply<u64>,
    },
    Reap {
        limit: usize,
        reply: Reply<ReapOutcome>,
    },
    /// Finish what is queued before this, then exit.
    Stop,
}

/// An answer held back until the batch that produced it has committed.
enum Pending {
    Opened(Reply<OpenedSession>, Result<OpenedSession, EngineError>),
    Beat(Reply<super::Beat>, Result<super::Beat, EngineError>),
    Closed(Reply<Option<Closed>>, Option<Closed>),
    Granted(GrantReply, Result<Granted, EngineError>),
    Released(Reply<u64>, Result<u64, EngineError>),
    Reaped(Reply<ReapOutcome>, ReapOutcome),
}

impl Pending {
    fn send(self, failed: bool) {
        fn out<T>(tx: Reply<T>, r: Result<T, EngineError>, failed: bool) {
            let _ = tx.send(if failed {
                Err(EngineError::StoreFailed)
            } else {
                r
            });
        }
        match self {
            Pending::Opened(tx, r) => out(tx, r, failed),
            Pending::Beat(tx, r) => out(tx, r, failed),
            Pending::Closed(tx, r) => out(tx, Ok(r), failed),
            Pending::Granted(tx, r) => out(tx, r, failed),
            Pending::Released(tx, r) => out(tx, r, failed),
            Pending::Reaped(tx, r) => out(tx, Ok(r), failed),
        }
    }
}

/// Counts to add to the metrics once the batch has committed.
#[derive(Default)]
struct Tally {
    opened: u64,
    ended: [u64; 3],
    acquired: u64,
    released: u64,
    released_by_expiry: u64,
}

impl Tally {
    fn ended(&mut self, e: &Ended) {
        let i = match e.reason {
            EndReason::Closed => 0,
            EndReason::Expired => 1,
            EndReason::Admin => 2,
        };
        self.ended[i] += 1;
        if e.reason == EndReason::Expired {
            self.released_by_expiry += e.released.len() as u64;
        }
    }
}

struct Writer {
    shared: Arc<Shared>,
    waiters: Waiters,
    changes: Vec<Change>,
    pending: Vec<Pending>,
    tally: Tally,
    /// Keys freed in this batch whose waiters have not been served yet.
    freed: Vec<LockKey>,
    trim_events: bool,
}

pub fn spawn(shared: Arc<Shared>, rx: Receiver<Command>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("leasehold-writer".into())
        .spawn(move || {
            Writer {
                shared,
                waiters: Waiters::default(),
                changes: Vec::new(),
                pending: Vec::new(),
                tally: Tally::default(),
                freed: Vec::new(),
                trim_events: false,
            }
            .run(rx)
        })
}

impl Writer {
    fn run(mut self, rx: Receiver<Command>) {
        let mut batch = Vec::with_capacity(self.shared.config.max_batch);
        loop {
            // Sleep until a request arrives or the next waiter times out.
            let first = match self.waiters.next_deadline() {
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
                for w in self.waiters.drain() {
                    let _ = w.reply.send(Err(EngineError::ShuttingDown));
                }
                self.shared.metrics.waiters.set(0);
                return;
            }
        }
    }

    fn process(&mut self, batch: &mut Vec<Command>) {
        let started = Instant::now();
        let count = batch.len();
        if self.shared.store.failed() {
            for cmd in batch.drain(..) {
                refuse(cmd, EngineError::StoreFailed);
            }
            for w in self.waiters.drain() {
                let _ = w.reply.send(Err(EngineError::StoreFailed));
            }
            return;
        }
        let (revision, event_seq, sessions, locks) = {
            let shared = self.shared.clone();
            let mut state = shared.state.lock();
            let now = self.shared.clock.now();
            let wall = self.shared.clock.wall();
            for cmd in batch.drain(..) {
                self.apply(&mut state, cmd, now, wall);
                self.serve_freed(&mut state, now, wall);
            }
            for w in self.waiters.expire(now) {
                let r = if state.session(w.session, now).is_some() {
                    EngineError::LockHeld
                } else {
                    EngineError::SessionGone
                };
                let _ = w.reply.send(Err(r));
            }
            (
                state.revision(),
                state.event_seq(),
                state.session_count(),
                state.lock_count(),
            )
        };
        self.shared.metrics.waiters.set(self.waiters.len() as i64);

        let mut failed = false;
        let cutoff = UnixMs(
            self.shared
                .clock
                .wall()
                .0
                .saturating_sub(self.shared.config.event_retention_ms),
        );
        // Trimming is worth a commit only when the oldest event is past retention.
        if self.trim_events {
            self.trim_events =
                matches!(self.shared.store.oldest_event_at(), Ok(Some(at)) if at < cutoff);
        }
        if !self.changes.is_empty() || self.trim_events {
            let commit_started = Instant::now();
            let result = self.shared.store.commit(&Batch {
                changes: &self.changes,
                revision,
                event_seq,
                trim_events: self
                    .trim_events
                    .then_some((cutoff, self.shared.config.event_trim_batch)),
            });
            let m = &self.shared.metrics;
            m.commit_seconds
                .observe(commit_started.elapsed().as_secs_f64());
            m.commit_batch_size.observe(count as f64);
            match result {
                Ok(done) => {
                    m.events_trimmed.inc_by(done.events_trimmed as u64);
                }
                Err(e) => {
                    tracing::error!(error = %e, "commit failed; refusing writes from now on");
                    m.store_failed.set(1);
                    failed = true;
                }
            }
        }
        self.changes.clear();
        self.trim_events = false;
        if !failed {
            self.publish(sessions, locks);
        }
        for p in self.pending.drain(..) {
            p.send(failed);
        }
        if failed {
            for w in self.waiters.drain() {
                let _ = w.reply.send(Err(EngineError::StoreFailed));
            }
        }
        tracing::trace!(
            count,
            elapsed_us = started.elapsed().as_micros() as u64,
            "batch"
        );
    }

    fn publish(&mut self, sessions: usize, locks: usize) {
        let m = &self.shared.metrics;
        let t = std::mem::take(&mut self.tally);
        m.sessions_active.set(sessions as i64);
        m.locks_held.set(locks as i64);
        m.sessions_opened.inc_by(t.opened);
        for (i, reason) in [EndReason::Closed, EndReason::Expired, EndReason::Admin]
            .into_iter()
            .enumerate()
        {
            if t.ended[i] > 0 {
                m.sessions_ended
                    .get_or_create(&ReasonLabel {
                        reason: reason.as_str(),
                    })
                    .inc_by(t.ended[i]);
            }
        }
        m.locks_acquired.inc_by(t.acquired);
        m.locks_released.inc_by(t.released);
        m.locks_released_by_expiry.inc_by(t.released_by_expiry);
    }

    fn ended(&mut self, ended: Vec<Ended>) {
        for e in ended {
            self.tally.ended(&e);
            self.freed.extend(e.released.into_iter().map(|(k, _)| k));
        }
    }

    fn apply(&mut self, state: &mut State, cmd: Command, now: Mono, wall: UnixMs) {
        match cmd {
            Command::Open {
                id,
                owner,
                ttl_ms,
                metadata,
                reply,
            } => {
                let r = state
                    .open(id, owner, ttl_ms, metadata, now, wall, &mut self.changes)
                    .map(|o| {
                        self.tally.opened += 1;
                        OpenedSession {
                            id,
                            ttl_ms: o.ttl_ms,
                            expires_at: to_wall(o.deadline, now, wall),
                            revision: o.revision,
                        }
                    })
                    .map_err(EngineError::from);
                self.pending.push(Pending::Opened(reply, r));
            }
            Command::Heartbeat { id, ttl_ms, reply } => {
                let r = match state.heartbeat(id, ttl_ms, now, &mut self.changes) {
                    Ok(b) => {
                        self.shared.metrics.heartbeats.inc();
                        Ok(super::Beat {
                            expires_at: to_wall(b.deadline, now, wall),
                            ttl_ms: b.ttl_ms,
                        })
                    }
                    Err(HeartbeatError::Gone) => Err(EngineError::SessionGone),
                    Err(HeartbeatError::Invalid(e)) => Err(e.into()),
                };
                self.pending.push(Pending::Beat(reply, r));
            }
            Command::End { id, reason, reply } => {
                let closed = state
                    .end(id, reason, now, wall, &mut self.changes)
                    .map(|e| {
                        let c = Closed {
                            released: e.released.len(),
                            revision: e.revision,
                        };
                        self.ended(vec![e]);
                        c
                    });
                self.pending.push(Pending::Closed(reply, closed));
            }
            Command::Acquire {
                id,
                key,
                deadline,
                reply,
            } => {
                let mut ended = Vec::new();
                let r = state.acquire(id, &key, now, wall, &mut self.changes, &mut ended);
                self.ended(ended);
                match r {
                    Ok(a) => {
                        if a.fresh {
                            self.tally.acquired += 1;
                        }
                        self.pending.push(Pending::Granted(
                            reply,
                            Ok(Granted {
                                token: a.token,
                                revision: a.revision,
                            }),
                        ));
                    }
                    Err(AcquireError::Held { .. }) => match deadline {
                        Some(d) if d > now => self.waiters.push(key, id, d, reply),
                        _ => self
                            .pending
                            .push(Pending::Granted(reply, Err(EngineError::LockHeld))),
                    },
                    Err(e) => self
                        .pending
                        .push(Pending::Granted(reply, Err(acquire_error(e)))),
                }
            }
            Command::Release {
                id,
                key,
                token,
                reply,
            } => {
                let r = match state.release(id, &key, token, wall, &mut self.changes) {
                    Ok(rev) => {
                        self.tally.released += 1;
                        self.freed.push(key);
                        Ok(rev)
                    }
                    Err(_) => Err(EngineError::NotHolder),
                };
                self.pending.push(Pending::Released(reply, r));
            }
            Command::Reap { limit, reply } => {
                let ended = state.reap(now, wall, limit, &mut self.changes);
                let outcome = ReapOutcome {
                    sessions: ended.len(),
                    locks: ended.iter().map(|e| e.released.len()).sum(),
                };
                self.ended(ended);
                // Each reaper pass also trims old audit events, in the same bounded way.
                self.trim_events = true;
                self.pending.push(Pending::Reaped(reply, outcome));
            }
            Command::Stop => {}
        }
    }

    /// Hands every key freed so far to its first live waiter, in the order they were freed.
    /// A grant can end an expired session inline and free more keys; those are served too.
    fn serve_freed(&mut self, state: &mut State, now: Mono, wall: UnixMs) {
        while !self.freed.is_empty() {
            for key in std::mem::take(&mut self.freed) {
                self.serve_key(state, key, now, wall);
            }
        }
    }

    fn serve_key(&mut self, state: &mut State, key: LockKey, now: Mono, wall: UnixMs) {
        {
            while let Some(w) = self.waiters.pop(&key) {
                if w.reply.is_closed() {
                    continue; // the client gave up; the next in line is served
                }
                if w.deadline <= now {
                    let _ = w.reply.send(Err(EngineError::LockHeld));
                    continue;
                }
                let mut ended = Vec::new();
                let r = state.acquire(w.session, &key, now, wall, &mut self.changes, &mut ended);
                self.ended(ended);
                match r {
                    Ok(a) => {
                        self.tally.acquired += u64::from(a.fresh);
                        self.pending.push(Pending::Granted(
                            w.reply,
                            Ok(Granted {
                                token: a.token,
                                revision: a.revision,
                            }),
                        ));
                        break;
                    }
                    Err(AcquireError::Held { .. }) => {
                        // Cannot happen for a freed key; keep the waiter rather than drop it.
                        self.waiters
                            .push(key.clone(), w.session, w.deadline, w.reply);
                        break;
                    }
                    Err(e) => self
                        .pending
                        .push(Pending::Granted(w.reply, Err(acquire_error(e)))),
                }
            }
        }
    }
}

fn acquire_error(e: AcquireError) -> EngineError {
    match e {
        AcquireError::SessionGone => EngineError::SessionGone,
        AcquireError::Held { .. } => EngineError::LockHeld,
        AcquireError::TooManyLocks(n) => EngineError::TooManyLocks(n),
    }
}

fn refuse(cmd: Command, e: EngineError) {
    fn no<T>(tx: Reply<T>, e: EngineError) {
        let _ = tx.send(Err(e));
    }
    match cmd {
        Command::Open { reply, .. } => no(reply, e),
        Command::Heartbeat { reply, .. } => no(reply, e),
        Command::End { reply, .. } => no(reply, e),
        Command::Acquire { reply, .. } => no(reply, e),
        Command::Release { reply, .. } => no(reply, e),
        Command::Reap { reply, .. } => no(reply, e),
        Command::Stop => {}
    }
}
