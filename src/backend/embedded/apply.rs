//! Applying one command of a batch to the state: each request becomes a domain call whose
//! changes join the batch's commit and whose answer is held back until then; a request that
//! must wait joins the waiters; a reaper pass ends due sessions within its size.

use std::time::Instant;

use super::commands::{Command, PassSize, Reply, claimed, granted, pend};
use super::errors::{acquire_error, job_error, pool_error, seat_error};
use super::waiters::{Resource, Waiters, Want};
use super::writer::{PacedPass, Writer};
use crate::backend::requests::{Answer, Request, RequestCheck};
use crate::backend::{BackendError, Beat, Closed, Granted, OpenedSession, ReapOutcome};
use crate::domain::time::to_wall;
use crate::domain::{
    AcquireError, At, Change, Finish, HeartbeatError, LockKey, Mono, PoolName, PoolPut, PoolRecord,
    SeatError, SessionId, State, Token, UnixMs,
};

impl Writer {
    pub fn apply(&mut self, state: &mut State, waiters: &mut Waiters, cmd: Command, at: At) {
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
                request,
                reply,
            } => {
                let Some((request, reply)) = self.replay(request, reply, at, |a| match a {
                    Answer::Opened {
                        session,
                        ttl_ms,
                        expires_at,
                        revision,
                    } => Some(OpenedSession {
                        id: session,
                        ttl_ms,
                        expires_at: UnixMs(expires_at),
                        revision,
                    }),
                    _ => None,
                }) else {
                    return;
                };
                let r = state
                    .open(id, owner, ttl_ms, metadata, at, &mut self.fx)
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
                if let Ok(o) = &r {
                    let answer = Answer::Opened {
                        session: o.id,
                        ttl_ms: o.ttl_ms,
                        expires_at: o.expires_at.0,
                        revision: o.revision,
                    };
                    self.remember(request, &answer, at);
                }
                pend(&mut self.pending, reply, r);
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
                    Closed::from(&e)
                });
                pend(pending, reply, Ok(closed));
            }
            Command::Acquire {
                id,
                key,
                deadline,
                request,
                reply,
            } => {
                let deadline = may_wait(deadline);
                let Some((request, reply)) = self.replay(request, reply, at, |a| match a {
                    Answer::Granted { token, revision } => Some(granted(Token(token), revision)),
                    _ => None,
                }) else {
                    return;
                };
                self.acquire(state, waiters, (id, key), deadline, (reply, request), at)
            }
            Command::Release {
                id,
                key,
                token,
                request,
                reply,
            } => {
                let Some((request, reply)) = self.replay(request, reply, at, |a| match a {
                    Answer::Released { revision } => Some(revision),
                    _ => None,
                }) else {
                    return;
                };
                let r = state
                    .release(id, &key, token, at, &mut self.fx)
                    .map_err(|_| BackendError::NotHolder);
                self.tally.released += u64::from(r.is_ok());
                if let Ok(revision) = r {
                    self.remember(request, &Answer::Released { revision }, at);
                }
                pend(&mut self.pending, reply, r);
            }
            Command::ConfirmLive { id, reply } => {
                let live = state.confirm_live(id, at.now, fx);
                pend(pending, reply, Ok(live));
            }
            Command::PutPool {
                name,
                capacity,
                metadata,
                reply,
            } => {
                let r = self.put_pool(state, &name, capacity, metadata, at);
                pend(&mut self.pending, reply, r);
            }
            Command::DeletePool { name, reply } => {
                let r = state.delete_pool(&name, at, fx).map_err(pool_error);
                if r.is_ok() {
                    // Told once the deletion is committed, like the deleter.
                    for w in waiters.take_all(&Resource::Pool(name)) {
                        w.want.fail_later(pending, BackendError::PoolNotFound);
                    }
                }
                pend(pending, reply, r);
            }
            Command::AcquireSeat {
                id,
                pool,
                metadata,
                deadline,
                request,
                reply,
            } => {
                let deadline = may_wait(deadline);
                let Some((request, reply)) = self.replay(request, reply, at, Answer::granted)
                else {
                    return;
                };
                let seat = (id, pool, metadata);
                self.acquire_seat(state, waiters, seat, deadline, (reply, request), at)
            }
            Command::ReleaseSeat {
                id,
                pool,
                token,
                request,
                reply,
            } => {
                let Some((request, reply)) = self.replay(request, reply, at, |a| match a {
                    Answer::Released { revision } => Some(revision),
                    _ => None,
                }) else {
                    return;
                };
                let r = state
                    .release_seat(id, &pool, token, at, &mut self.fx)
                    .map_err(pool_error);
                if let Ok(revision) = r {
                    self.remember(request, &Answer::Released { revision }, at);
                }
                pend(&mut self.pending, reply, r);
            }
            Command::Enqueue {
                id,
                job,
                request,
                reply,
            } => {
                let Some((request, reply)) = self.replay(request, reply, at, |a| match a {
                    Answer::Enqueued { job, revision } => Some((job, revision)),
                    _ => None,
                }) else {
                    return;
                };
                let r = state
                    .enqueue(id, job, at, &mut self.fx)
                    .map(|revision| (id, revision))
                    .map_err(BackendError::from);
                if let Ok((job, revision)) = r {
                    self.remember(request, &Answer::Enqueued { job, revision }, at);
                }
                pend(&mut self.pending, reply, r);
            }
            Command::Claim {
                id,
                queue,
                deadline,
                request,
                reply,
            } => {
                let deadline = may_wait(deadline);
                let Some((request, reply)) =
                    self.replay(request, reply, at, |a| a.claimed().map(Some))
                else {
                    return;
                };
                match state.claim(id, &queue, at, &mut self.fx) {
                    Ok(Some(c)) => {
                        let c = claimed(c);
                        self.remember(request, &Answer::from(&c), at);
                        pend(&mut self.pending, reply, Ok(Some(c)))
                    }
                    Ok(None) => match deadline {
                        Some(d) if d > at.now => {
                            waiters.push(Resource::Queue(queue), id, d, Want::Claim(reply, request))
                        }
                        _ => pend(&mut self.pending, reply, Ok(None)),
                    },
                    Err(_) => pend(&mut self.pending, reply, Err(BackendError::SessionGone)),
                }
            }
            Command::FinishJob {
                id,
                job,
                token,
                finish,
                request,
                reply,
            } => {
                let Some((request, reply)) = self.replay(request, reply, at, |a| match a {
                    Answer::Finished { revision } => Some(revision),
                    _ => None,
                }) else {
                    return;
                };
                let failed_by_worker = matches!(finish, Finish::Fail { .. });
                let r = state
                    .finish_job(id, job, token, finish, at, &mut self.fx)
                    .map_err(job_error);
                if failed_by_worker && r.is_ok() {
                    self.tally.jobs_failed.push("worker".into());
                }
                if let Ok(revision) = r {
                    self.remember(request, &Answer::Finished { revision }, at);
                }
                pend(&mut self.pending, reply, r);
            }
            Command::Requeue { job, reply } => {
                let r = state.requeue(job, at, fx).map_err(job_error);
                pend(pending, reply, r);
            }
            Command::RaiseTokenFloor { floor, reply } => {
                let r = state
                    .raise_token_floor(floor, at, fx)
                    .map_err(BackendError::from);
                pend(pending, reply, r);
            }
            Command::Reap { size, reply } => {
                let outcome = self.reap_pass(state, at, size);
                if let PassSize::Paced = size {
                    // A storm is on from a pass that ended someone until one that ends no
                    // one with nothing due. Not merely because a pass ran: the reaper's pass
                    // every interval would keep a storm on with nothing due, and the end log
                    // would wait for other traffic to be applied. Nor only while sessions are
                    // due at this instant: a storm's deadlines spread over milliseconds, and
                    // applying the log between its passes slows it down tenfold.
                    self.storm = outcome.sessions > 0
                        || state.earliest_deadline().is_some_and(|d| d <= at.now);
                }
                let fx = &mut self.fx;
                // Each reaper pass also purges finished jobs and trims old audit events,
                // in the same bounded way.
                let before = UnixMs(
                    at.wall
                        .0
                        .saturating_sub(self.shared.config.job_retention_ms),
                );
                state.purge_jobs(before, self.shared.config.reaper_batch, fx);
                self.requests
                    .purge(at.wall, self.shared.config.reaper_batch, &mut fx.changes);
                self.trim_events = true;
                pend(&mut self.pending, reply, Ok(outcome));
            }
            Command::As { actor, cmd } => {
                // Only the events this command appends: the batch holds others' too.
                let from = self.fx.changes.len();
                self.apply(state, waiters, *cmd, at);
                for change in &mut self.fx.changes[from..] {
                    if let Change::Event(e) = change {
                        e.stamp(&actor);
                    }
                }
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
        // The rows of the sessions it ended are deleted after the storm (the end log).
        let ended = state.reap_leaving_rows(at, limit, &mut self.fx);
        self.ended.extend(&ended);
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
        self.tally.reaped(&ended)
    }

    /// For a call with a request id: answers a retry from its record, or refuses an id
    /// reused for another call, and returns `None`; otherwise hands the request and the
    /// reply back to act on. Answers wait for the batch's commit like any other, so a replay
    /// never leaves before the commit of what it replays.
    fn replay<T: Send + 'static>(
        &mut self,
        request: Option<Request>,
        reply: Reply<T>,
        at: At,
        answer: impl FnOnce(Answer) -> Option<T>,
    ) -> Option<(Option<Request>, Reply<T>)> {
        let Some(r) = request else {
            return Some((None, reply));
        };
        match self.requests.check(&r, at.wall) {
            RequestCheck::New => Some((Some(r), reply)),
            RequestCheck::Replay(a) => {
                self.tally.replays += 1;
                let result = answer(a).ok_or(BackendError::RequestIdReused);
                pend(&mut self.pending, reply, result);
                None
            }
            RequestCheck::Reused => {
                pend(&mut self.pending, reply, Err(BackendError::RequestIdReused));
                None
            }
        }
    }

    /// Remembers the answer of a call with a request id in this batch's commit.
    pub fn remember(&mut self, request: Option<Request>, answer: &Answer, at: At) {
        if let Some(r) = request {
            let retention = self.shared.config.request_id_retention_ms;
            self.requests
                .remember(r, answer, at.wall, retention, &mut self.fx.changes);
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
        (reply, request): (Reply<Granted>, Option<Request>),
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
                Some(d) if d > at.now => waiters.push(line, id, d, Want::Lock(reply, request)),
                _ => pend(&mut self.pending, reply, Err(BackendError::LockHeld)),
            }
            return;
        }
        match state.acquire(id, &key, at, &mut self.fx) {
            Ok(a) => {
                self.tally.acquired += u64::from(a.fresh);
                let answer = Answer::Granted {
                    token: a.token.0,
                    revision: a.revision,
                };
                self.remember(request, &answer, at);
                pend(&mut self.pending, reply, Ok(granted(a.token, a.revision)));
            }
            Err(AcquireError::Held { .. }) => match deadline {
                Some(d) if d > at.now => waiters.push(line, id, d, Want::Lock(reply, request)),
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
        (reply, request): (Reply<Granted>, Option<Request>),
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
            Ok(g) => {
                let g = granted(g.token, g.revision);
                self.remember(request, &Answer::from(g), at);
                pend(&mut self.pending, reply, Ok(g))
            }
            Err(SeatError::Exhausted { capacity, in_use }) => match deadline {
                Some(d) if d > at.now => {
                    let want = Want::Seat {
                        metadata,
                        reply,
                        request,
                    };
                    waiters.push(line, id, d, want)
                }
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

    /// Creates or resizes a pool, reading its record in the same step: a resize keeps when
    /// the pool was created, and its metadata unless new is given. The record is the one
    /// this batch last wrote, or else the committed one; only this thread writes, so nothing
    /// can change it between the read and the write.
    fn put_pool(
        &mut self,
        state: &mut State,
        name: &PoolName,
        capacity: u64,
        metadata: Option<String>,
        at: At,
    ) -> Result<PoolPut, BackendError> {
        let existing = match written_pool(&self.fx.changes, name) {
            Some(written) => written.cloned(),
            None => self.shared.store.pool(name.as_str())?,
        };
        let created_at = existing.as_ref().map(|p| p.created_at);
        let metadata = metadata
            .or_else(|| existing.map(|p| p.metadata))
            .unwrap_or_default();
        Ok(state.put_pool(name, capacity, metadata, created_at, at, &mut self.fx)?)
    }

    /// A storm the reaper started is carried on here: while sessions are due, every batch
    /// takes one paced pass along. Left to the reaper alone, only every other batch would,
    /// as its next request arrives after this batch's answer.
    pub fn carry_on_storm(&mut self, state: &mut State, waiters: &mut Waiters, at: At) {
        if self.storm && self.paced.is_none() {
            if state.earliest_deadline().is_some_and(|d| d <= at.now) {
                self.reap_pass(state, at, PassSize::Paced);
                self.settle(state, waiters, at);
            } else {
                self.storm = false;
            }
        }
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
