//! The one writer: drains the channel into a batch, applies it to the state, commits it in
//! one fsynced transaction, then answers. No reply leaves before its commit.
//!
//! The state mutex is held only while applying a batch in memory, never across the commit.
//! If the commit fails the store is fail-stopped and every request of the batch, and every
//! later one, is answered `StoreFailed`.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::Shared;
use super::store::Batch;
use super::waiters::{Reply, Resource, Waiter, Waiters, Want};
use crate::backend::{BackendError, Beat, Claimed, Closed, Granted, OpenedSession, ReapOutcome};
use crate::domain::time::to_wall;
use crate::domain::{
    AcquireError, At, Change, Effects, EndReason, Ended, Finish, HeartbeatError, JobError, JobId,
    JobOutcome, LockKey, Mono, NewJob, PoolError, PoolName, PoolPut, QueueName, SeatError,
    SessionId, State, Token, UnixMs,
};
use crate::engine::pacing::PassSizer;
use crate::metrics::ReasonLabel;

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
        reply: Reply<Beat>,
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
        reply: Reply<Granted>,
    },
    Release {
        id: SessionId,
        key: LockKey,
        token: Token,
        reply: Reply<u64>,
    },
    PutPool {
        name: PoolName,
        capacity: u64,
        metadata: String,
        created_at: Option<UnixMs>,
        reply: Reply<PoolPut>,
    },
    DeletePool {
        name: PoolName,
        reply: Reply<u64>,
    },
    AcquireSeat {
        id: SessionId,
        pool: PoolName,
        metadata: String,
        deadline: Option<Mono>,
        reply: Reply<Granted>,
    },
    ReleaseSeat {
        id: SessionId,
        pool: PoolName,
        token: Token,
        reply: Reply<u64>,
    },
    Enqueue {
        id: JobId,
        job: NewJob,
        reply: Reply<u64>,
    },
    Claim {
        id: SessionId,
        queue: QueueName,
        deadline: Option<Mono>,
        reply: Reply<Option<Claimed>>,
    },
    FinishJob {
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
        reply: Reply<u64>,
    },
    Requeue {
        job: JobId,
        reply: Reply<u64>,
    },
    Reap {
        size: PassSize,
        reply: Reply<ReapOutcome>,
    },
    /// Answer every waiter `ShuttingDown` now, so a drain does not wait out long polls.
    Drain,
    /// Finish what is queued before this, then exit.
    Stop,
}

/// How many due sessions one reaper pass may end.
#[derive(Debug, Clone, Copy)]
pub enum PassSize {
    /// As many as the writer's [`PassSizer`] fits in the pass budget: the background reaper,
    /// whose passes share the writer with clients.
    Paced,
    /// Up to this many: an operator's reap, which asks for everything now.
    AtMost(usize),
}

/// A paced pass in the batch being built: what it ended and what that cost before the
/// commit, so the sizer can learn its share of the batch.
struct PacedPass {
    sessions: usize,
    changes: usize,
    domain: Duration,
}

/// An answer held back until the batch that produced it has committed.
type Pending = Box<dyn FnOnce(bool) + Send>;

fn pend<T: Send + 'static>(
    pending: &mut Vec<Pending>,
    reply: Reply<T>,
    result: Result<T, BackendError>,
) {
    pending.push(Box::new(move |failed| {
        let _ = reply.send(if failed {
            Err(BackendError::StoreFailed)
        } else {
            result
        });
    }));
}

/// Counts to add to the metrics once the batch has committed.
#[derive(Default)]
struct Tally {
    opened: u64,
    ended: [u64; 3],
    acquired: u64,
    released: u64,
    released_by_expiry: u64,
    seats_reclaimed: u64,
    seats_refused: u64,
    jobs_recovered: u64,
    jobs_failed: Vec<String>,
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
        self.seats_reclaimed += e.seats.len() as u64;
        for (_, outcome) in &e.jobs {
            match outcome {
                JobOutcome::Recovered { .. } => self.jobs_recovered += 1,
                JobOutcome::Failed { reason } => self.jobs_failed.push(reason.clone()),
            }
        }
    }
}

struct Writer {
    shared: Arc<Shared>,
    fx: Effects,
    pending: Vec<Pending>,
    tally: Tally,
    trim_events: bool,
    /// Pools and queues whose gauges need refreshing after the commit.
    touched_pools: BTreeSet<PoolName>,
    touched_queues: BTreeSet<QueueName>,
    sizer: PassSizer,
    paced: Option<PacedPass>,
    /// The reaper has found sessions due; the writer keeps reaping until none are.
    storm: bool,
}

pub fn spawn(shared: Arc<Shared>, rx: Receiver<Command>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("leasehold-writer".into())
        .spawn(move || {
            Writer {
                sizer: PassSizer::new(
                    Duration::from_millis(shared.config.reaper_pass_ms),
                    shared.config.reaper_batch,
                ),
                shared,
                fx: Effects::default(),
                pending: Vec::new(),
                tally: Tally::default(),
                trim_events: false,
                touched_pools: BTreeSet::new(),
                touched_queues: BTreeSet::new(),
                paced: None,
                storm: false,
            }
            .run(rx)
        })
}

impl Writer {
    fn run(mut self, rx: Receiver<Command>) {
        let mut batch = Vec::with_capacity(self.shared.config.max_batch);
        loop {
            // Sleep until a request arrives or the next waiter times out.
            let next_timeout = self.shared.waiters.lock().next_deadline();
            let first = match next_timeout {
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

    fn process(&mut self, batch: &mut Vec<Command>) {
        let count = batch.len();
        if self.shared.store.failed() {
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
        let (revision, event_seq, sessions, locks) = {
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
            // A storm the reaper started is carried on here: while sessions are due, every
            // batch takes one paced pass along. Left to the reaper alone, only every other
            // batch would, as its next request arrives after this batch's answer.
            if self.storm && self.paced.is_none() {
                if state.earliest_deadline().is_some_and(|d| d <= at.now) {
                    self.reap_pass(&mut state, at, PassSize::Paced);
                    self.settle(&mut state, &mut waiters, at);
                } else {
                    self.storm = false;
                }
            }
            for (resource, w) in waiters.expire(at.now) {
                self.tally.seats_refused += u64::from(time_out(&state, resource, w, at));
            }
            self.shared.metrics.waiters.set(waiters.len() as i64);
            (
                state.revision(),
                state.event_seq(),
                state.session_count(),
                state.lock_count(),
            )
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
        if !self.fx.changes.is_empty() || self.trim_events {
            let commit_started = Instant::now();
            let result = shared.store.commit(&Batch {
                changes: &self.fx.changes,
                revision,
                event_seq,
                trim_events: self
                    .trim_events
                    .then_some((cutoff, shared.config.event_trim_batch)),
            });
            let commit_took = commit_started.elapsed();
            let m = &shared.metrics;
            m.commit_seconds.observe(commit_took.as_secs_f64());
            m.commit_batch_size.observe(count as f64);
            match result {
                Ok(done) => {
                    m.events_trimmed.inc_by(done.events_trimmed as u64);
                    if let Some(pass) = self.paced.take() {
                        // The pass's share of the commit, by its share of the changes:
                        // writing the B-trees and the pages it dirtied, and the sync.
                        let total = self.fx.changes.len().max(1);
                        let share = commit_took.mul_f64(pass.changes as f64 / total as f64);
                        self.sizer.observe(pass.sessions, pass.domain + share);
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "commit failed; refusing writes from now on");
                    m.store_failed.set(1);
                    failed = true;
                }
            }
        }
        for change in &self.fx.changes {
            match change {
                Change::PutPool { name, .. }
                | Change::DeletePool { name }
                | Change::PutSeat { pool: name, .. }
                | Change::DeleteSeat { pool: name, .. } => {
                    self.touched_pools.insert(name.clone());
                }
                Change::PutJob { record, .. } => {
                    if let Ok(q) = QueueName::parse("queue", &record.queue) {
                        self.touched_queues.insert(q);
                    }
                }
                Change::DeleteJob { queue, .. } => {
                    self.touched_queues.insert(queue.clone());
                }
                _ => {}
            }
        }
        self.fx.clear();
        self.trim_events = false;
        // A pass whose batch had nothing to commit (it ended no one) teaches nothing.
        self.paced = None;
        if !failed {
            self.publish(sessions, locks);
        }
        for p in self.pending.drain(..) {
            p(failed);
        }
        if failed {
            let drained = shared.waiters.lock().drain();
            for w in drained {
                w.want.fail(BackendError::StoreFailed);
            }
        }
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
                        reason: reason.as_str().into(),
                    })
                    .inc_by(t.ended[i]);
            }
        }
        m.locks_acquired.inc_by(t.acquired);
        m.locks_released.inc_by(t.released);
        m.locks_released_by_expiry.inc_by(t.released_by_expiry);
        m.seats_reclaimed.inc_by(t.seats_reclaimed);
        m.seats_refused.inc_by(t.seats_refused);
        m.jobs_recovered.inc_by(t.jobs_recovered);
        for reason in t.jobs_failed {
            m.jobs_failed.get_or_create(&ReasonLabel { reason }).inc();
        }
        let pools = std::mem::take(&mut self.touched_pools);
        let queues = std::mem::take(&mut self.touched_queues);
        let state = self.shared.state.lock();
        for pool in pools {
            m.set_pool(
                pool.as_str(),
                state.pool(&pool).map(|p| (p.capacity, p.holders.len())),
            );
        }
        for queue in queues {
            m.set_queue(queue.as_str(), state.queue_counts(&queue));
        }
    }

    fn apply(&mut self, state: &mut State, waiters: &mut Waiters, cmd: Command, at: At) {
        // While draining for shutdown nobody starts to wait: requests are answered at once.
        let may_wait = |d: Option<Mono>| {
            d.filter(|_| {
                !self
                    .shared
                    .draining
                    .load(std::sync::atomic::Ordering::SeqCst)
            })
        };
        let fx = &mut self.fx;
        let pending = &mut self.pending;
        match cmd {
            Command::Open {
                id,
                owner,
                ttl_ms,
                metadata,
                reply,
            } => {
                let r = state
                    .open(id, owner, ttl_ms, metadata, at, fx)
                    .map(|o| {
                        self.tally.opened += 1;
                        OpenedSession {
                            id,
                            ttl_ms: o.ttl_ms,
                            expires_at: to_wall(o.deadline, at.now, at.wall),
                            revision: o.revision,
                        }
                    })
                    .map_err(BackendError::from);
                pend(pending, reply, r);
            }
            Command::Heartbeat { id, ttl_ms, reply } => {
                let r = match state.heartbeat(id, ttl_ms, at, fx) {
                    Ok(b) => {
                        self.shared.metrics.heartbeats.inc();
                        Ok(Beat {
                            expires_at: to_wall(b.deadline, at.now, at.wall),
                            ttl_ms: b.ttl_ms,
                        })
                    }
                    Err(HeartbeatError::Gone) => Err(BackendError::SessionGone),
                    Err(HeartbeatError::Invalid(e)) => Err(e.into()),
                };
                pend(pending, reply, r);
            }
            Command::End { id, reason, reply } => {
                let closed = state.end(id, reason, at, fx).map(|e| {
                    self.tally.ended(&e);
                    Closed {
                        released: e.released.len(),
                        seats: e.seats.len(),
                        jobs: e.jobs.len(),
                        revision: e.revision,
                    }
                });
                pend(pending, reply, Ok(closed));
            }
            Command::Acquire {
                id,
                key,
                deadline,
                reply,
            } => {
                let deadline = may_wait(deadline);
                self.acquire(state, waiters, (id, key), deadline, reply, at)
            }
            Command::Release {
                id,
                key,
                token,
                reply,
            } => {
                let r = state
                    .release(id, &key, token, at, fx)
                    .map_err(|_| BackendError::NotHolder);
                self.tally.released += u64::from(r.is_ok());
                pend(pending, reply, r);
            }
            Command::PutPool {
                name,
                capacity,
                metadata,
                created_at,
                reply,
            } => {
                let r = state
                    .put_pool(&name, capacity, metadata, created_at, at, fx)
                    .map_err(BackendError::from);
                pend(pending, reply, r);
            }
            Command::DeletePool { name, reply } => {
                let r = state.delete_pool(&name, at, fx).map_err(pool_error);
                if r.is_ok() {
                    for w in waiters.take_all(&Resource::Pool(name)) {
                        w.want.fail(BackendError::PoolNotFound);
                    }
                }
                pend(pending, reply, r);
            }
            Command::AcquireSeat {
                id,
                pool,
                metadata,
                deadline,
                reply,
            } => {
                let deadline = may_wait(deadline);
                self.acquire_seat(state, waiters, (id, pool, metadata), deadline, reply, at)
            }
            Command::ReleaseSeat {
                id,
                pool,
                token,
                reply,
            } => {
                let r = state
                    .release_seat(id, &pool, token, at, fx)
                    .map_err(pool_error);
                pend(pending, reply, r);
            }
            Command::Enqueue { id, job, reply } => {
                let r = state.enqueue(id, job, at, fx).map_err(BackendError::from);
                pend(pending, reply, r);
            }
            Command::Claim {
                id,
                queue,
                deadline,
                reply,
            } => match state.claim(id, &queue, at, fx) {
                Ok(Some(c)) => pend(pending, reply, Ok(Some(claimed(c)))),
                Ok(None) => match may_wait(deadline) {
                    Some(d) if d > at.now => {
                        waiters.push(Resource::Queue(queue), id, d, Want::Claim(reply))
                    }
                    _ => pend(pending, reply, Ok(None)),
                },
                Err(_) => pend(pending, reply, Err(BackendError::SessionGone)),
            },
            Command::FinishJob {
                id,
                job,
                token,
                finish,
                reply,
            } => {
                let failed_by_worker = matches!(finish, Finish::Fail { .. });
                let r = state
                    .finish_job(id, job, token, finish, at, fx)
                    .map_err(job_error);
                if failed_by_worker && r.is_ok() {
                    self.tally.jobs_failed.push("worker".into());
                }
                pend(pending, reply, r);
            }
            Command::Requeue { job, reply } => {
                let r = state.requeue(job, at, fx).map_err(job_error);
                pend(pending, reply, r);
            }
            Command::Reap { size, reply } => {
                if let PassSize::Paced = size {
                    self.storm = true;
                }
                let outcome = self.reap_pass(state, at, size);
                let fx = &mut self.fx;
                // Each reaper pass also purges finished jobs and trims old audit events,
                // in the same bounded way.
                let before = UnixMs(
                    at.wall
                        .0
                        .saturating_sub(self.shared.config.job_retention_ms),
                );
                state.purge_jobs(before, self.shared.config.reaper_batch, fx);
                self.trim_events = true;
                pend(&mut self.pending, reply, Ok(outcome));
            }
            Command::Drain => {
                for w in waiters.drain() {
                    w.want.fail(BackendError::ShuttingDown);
                }
            }
            Command::Stop => {}
        }
    }

    /// Ends up to `size` due sessions. A paced pass is remembered so that, once the batch
    /// has committed, the sizer learns what it cost.
    fn reap_pass(&mut self, state: &mut State, at: At, size: PassSize) -> ReapOutcome {
        let started = Instant::now();
        let changes_before = self.fx.changes.len();
        let limit = match size {
            PassSize::Paced => self.sizer.next(),
            PassSize::AtMost(n) => n,
        };
        let ended = state.reap(at, limit, &mut self.fx);
        if let PassSize::Paced = size {
            self.paced = Some(PacedPass {
                sessions: ended.len(),
                changes: self.fx.changes.len() - changes_before,
                domain: started.elapsed(),
            });
            if !ended.is_empty() {
                let m = &self.shared.metrics;
                m.reaper_batch_size.observe(ended.len() as f64);
            }
        }
        for e in &ended {
            self.tally.ended(e);
        }
        ReapOutcome {
            sessions: ended.len(),
            locks: ended.iter().map(|e| e.released.len()).sum(),
            seats: ended.iter().map(|e| e.seats.len()).sum(),
            jobs: ended.iter().map(|e| e.jobs.len()).sum(),
        }
    }

    /// A lock request. When others already wait for the key, a newcomer goes behind them:
    /// an expired holder is ended and the first waiters served before it is considered.
    fn acquire(
        &mut self,
        state: &mut State,
        waiters: &mut Waiters,
        (id, key): (SessionId, LockKey),
        deadline: Option<Mono>,
        reply: Reply<Granted>,
        at: At,
    ) {
        let line = Resource::Lock(key.clone());
        let queued_behind = |state: &State, waiters: &Waiters| {
            waiters.waiting(&line) > 0 && state.is_live(id, at.now) && !state.holds(id, &key)
        };
        if queued_behind(state, waiters) {
            state.end_expired_holder(&key, at, &mut self.fx);
            self.settle(state, waiters, at);
        }
        if queued_behind(state, waiters) {
            match deadline {
                Some(d) if d > at.now => waiters.push(line, id, d, Want::Lock(reply)),
                _ => pend(&mut self.pending, reply, Err(BackendError::LockHeld)),
            }
            return;
        }
        match state.acquire(id, &key, at, &mut self.fx) {
            Ok(a) => {
                self.tally.acquired += u64::from(a.fresh);
                pend(&mut self.pending, reply, Ok(granted(a.token, a.revision)));
            }
            Err(AcquireError::Held { .. }) => match deadline {
                Some(d) if d > at.now => waiters.push(line, id, d, Want::Lock(reply)),
                _ => pend(&mut self.pending, reply, Err(BackendError::LockHeld)),
            },
            Err(e) => pend(&mut self.pending, reply, Err(acquire_error(e))),
        }
    }

    /// A seat request, queued behind earlier waiters like a lock request.
    fn acquire_seat(
        &mut self,
        state: &mut State,
        waiters: &mut Waiters,
        (id, pool, metadata): (SessionId, PoolName, String),
        deadline: Option<Mono>,
        reply: Reply<Granted>,
        at: At,
    ) {
        let line = Resource::Pool(pool.clone());
        let queued_behind = |state: &State, waiters: &Waiters| {
            waiters.waiting(&line) > 0 && state.is_live(id, at.now) && !state.holds_seat(id, &pool)
        };
        if queued_behind(state, waiters) {
            state.end_expired_seat_holders(&pool, at, &mut self.fx);
            self.settle(state, waiters, at);
        }
        let result = if queued_behind(state, waiters) {
            let (capacity, in_use) = state
                .pool(&pool)
                .map_or((0, 0), |p| (p.capacity, p.holders.len()));
            Err(SeatError::Exhausted { capacity, in_use })
        } else {
            state.acquire_seat(id, &pool, metadata.clone(), at, &mut self.fx)
        };
        match result {
            Ok(g) => pend(&mut self.pending, reply, Ok(granted(g.token, g.revision))),
            Err(SeatError::Exhausted { capacity, in_use }) => match deadline {
                Some(d) if d > at.now => waiters.push(line, id, d, Want::Seat { metadata, reply }),
                _ => {
                    self.tally.seats_refused += 1;
                    pend(
                        &mut self.pending,
                        reply,
                        Err(BackendError::PoolExhausted { capacity, in_use }),
                    )
                }
            },
            Err(e) => pend(&mut self.pending, reply, Err(seat_error(e))),
        }
    }

    /// Tallies sessions ended inline and serves the waiters of every resource that freed up,
    /// until serving them frees nothing more.
    fn settle(&mut self, state: &mut State, waiters: &mut Waiters, at: At) {
        loop {
            for e in std::mem::take(&mut self.fx.ended) {
                self.tally.ended(&e);
            }
            let locks = std::mem::take(&mut self.fx.freed_locks);
            let pools = std::mem::take(&mut self.fx.freed_pools);
            let queues = std::mem::take(&mut self.fx.ready_queues);
            if locks.is_empty() && pools.is_empty() && queues.is_empty() {
                return;
            }
            for key in locks {
                self.serve(state, waiters, Resource::Lock(key), at);
            }
            for pool in pools {
                self.serve(state, waiters, Resource::Pool(pool), at);
            }
            for queue in queues {
                self.serve(state, waiters, Resource::Queue(queue), at);
            }
        }
    }

    /// Serves `resource`'s waiters in order while it has room: one for a lock, as many as
    /// there are free seats for a pool, as many as there are queued jobs for a queue.
    fn serve(&mut self, state: &mut State, waiters: &mut Waiters, resource: Resource, at: At) {
        loop {
            let available = match &resource {
                Resource::Lock(key) => state.lock(key).is_none(),
                Resource::Pool(pool) => state.pool_has_room(pool),
                Resource::Queue(queue) => state.queue_has_job(queue),
            };
            if !available {
                return;
            }
            let Some(w) = waiters.pop(&resource) else {
                return;
            };
            if w.want.abandoned() {
                continue; // the client gave up; the next in line is served
            }
            if w.deadline <= at.now {
                self.tally.seats_refused += u64::from(time_out(state, resource.clone(), w, at));
                continue;
            }
            let Waiter {
                id,
                session,
                deadline,
                want,
            } = w;
            let fx = &mut self.fx;
            match (&resource, want) {
                (Resource::Lock(key), Want::Lock(reply)) => {
                    match state.acquire(session, key, at, fx) {
                        Ok(a) => {
                            self.tally.acquired += u64::from(a.fresh);
                            pend(&mut self.pending, reply, Ok(granted(a.token, a.revision)));
                        }
                        Err(AcquireError::Held { .. }) => {
                            waiters.push_front(
                                resource.clone(),
                                Waiter {
                                    id,
                                    session,
                                    deadline,
                                    want: Want::Lock(reply),
                                },
                            );
                            return;
                        }
                        Err(e) => pend(&mut self.pending, reply, Err(acquire_error(e))),
                    }
                }
                (Resource::Pool(pool), Want::Seat { metadata, reply }) => {
                    match state.acquire_seat(session, pool, metadata.clone(), at, fx) {
                        Ok(g) => pend(&mut self.pending, reply, Ok(granted(g.token, g.revision))),
                        Err(SeatError::Exhausted { .. }) => {
                            waiters.push_front(
                                resource.clone(),
                                Waiter {
                                    id,
                                    session,
                                    deadline,
                                    want: Want::Seat { metadata, reply },
                                },
                            );
                            return;
                        }
                        Err(e) => pend(&mut self.pending, reply, Err(seat_error(e))),
                    }
                }
                (Resource::Queue(queue), Want::Claim(reply)) => {
                    match state.claim(session, queue, at, fx) {
                        Ok(Some(c)) => pend(&mut self.pending, reply, Ok(Some(claimed(c)))),
                        Ok(None) => {
                            waiters.push_front(
                                resource.clone(),
                                Waiter {
                                    id,
                                    session,
                                    deadline,
                                    want: Want::Claim(reply),
                                },
                            );
                            return;
                        }
                        Err(_) => pend(&mut self.pending, reply, Err(BackendError::SessionGone)),
                    }
                }
                (_, want) => want.fail(BackendError::ShuttingDown),
            }
        }
    }
}

/// Answers a waiter whose time ran out: the lock is still held, the pool still full, the
/// queue still empty — or its session is gone. True when a seat request was refused.
fn time_out(state: &State, resource: Resource, w: Waiter, at: At) -> bool {
    if !state.is_live(w.session, at.now) {
        w.want.fail(BackendError::SessionGone);
        return false;
    }
    match (resource, w.want) {
        (Resource::Pool(pool), want @ Want::Seat { .. }) => {
            let (capacity, in_use) = state
                .pool(&pool)
                .map_or((0, 0), |p| (p.capacity, p.holders.len()));
            want.fail(BackendError::PoolExhausted { capacity, in_use });
            true
        }
        (_, Want::Claim(reply)) => {
            let _ = reply.send(Ok(None));
            false
        }
        (_, want) => {
            want.fail(BackendError::LockHeld);
            false
        }
    }
}

fn granted(token: Token, revision: u64) -> Granted {
    Granted { token, revision }
}

fn claimed(c: crate::domain::Claim) -> Claimed {
    Claimed {
        job: c.job,
        token: c.token,
        attempt: c.attempt,
        recovery_count: c.recovery_count,
        kind: c.kind,
        revision: c.revision,
    }
}

fn acquire_error(e: AcquireError) -> BackendError {
    match e {
        AcquireError::SessionGone => BackendError::SessionGone,
        AcquireError::Held { .. } => BackendError::LockHeld,
        AcquireError::TooManyLocks(n) => BackendError::TooManyLocks(n),
    }
}

fn seat_error(e: SeatError) -> BackendError {
    match e {
        SeatError::SessionGone => BackendError::SessionGone,
        SeatError::PoolNotFound => BackendError::PoolNotFound,
        SeatError::Exhausted { capacity, in_use } => {
            BackendError::PoolExhausted { capacity, in_use }
        }
        SeatError::Invalid(i) => BackendError::Invalid(i),
    }
}

fn pool_error(e: PoolError) -> BackendError {
    match e {
        PoolError::NotFound => BackendError::PoolNotFound,
        PoolError::InUse(n) => BackendError::PoolInUse(n),
        PoolError::NotHolder => BackendError::NotHolder,
    }
}

fn job_error(e: JobError) -> BackendError {
    match e {
        JobError::NotFound => BackendError::JobNotFound,
        JobError::StaleToken => BackendError::StaleToken,
        JobError::NotFailed => BackendError::JobNotFailed,
        JobError::Invalid(i) => BackendError::Invalid(i),
    }
}

fn refuse(cmd: Command, e: BackendError) {
    fn no<T>(tx: Reply<T>, e: BackendError) {
        let _ = tx.send(Err(e));
    }
    match cmd {
        Command::Open { reply, .. } => no(reply, e),
        Command::Heartbeat { reply, .. } => no(reply, e),
        Command::End { reply, .. } => no(reply, e),
        Command::Acquire { reply, .. } | Command::AcquireSeat { reply, .. } => no(reply, e),
        Command::Release { reply, .. }
        | Command::DeletePool { reply, .. }
        | Command::ReleaseSeat { reply, .. }
        | Command::Enqueue { reply, .. }
        | Command::FinishJob { reply, .. }
        | Command::Requeue { reply, .. } => no(reply, e),
        Command::PutPool { reply, .. } => no(reply, e),
        Command::Claim { reply, .. } => no(reply, e),
        Command::Reap { reply, .. } => no(reply, e),
        Command::Drain | Command::Stop => {}
    }
}
