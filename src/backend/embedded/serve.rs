//! Serving waiters: when a lock, seats or jobs free up in a batch, the first waiters for
//! them are served in the same batch, before any later request can take them, so a newcomer
//! never overtakes a waiter; and waiters whose time ran out are answered.

use super::commands::{claimed, granted, pend};
use super::errors::{acquire_error, seat_error};
use super::waiters::{Resource, Waiter, Waiters, Want};
use super::writer::Writer;
use crate::backend::requests::{Answer, Request};
use crate::backend::{BackendError, Granted};
use crate::domain::{AcquireError, At, SeatError, State};

impl Writer {
    /// Tallies sessions ended inline and serves the waiters of every resource that freed up,
    /// until serving them frees nothing more.
    pub fn settle(&mut self, state: &mut State, waiters: &mut Waiters, at: At) {
        loop {
            for e in std::mem::take(&mut self.fx.ended) {
                self.tally.ended(&e);
            }
            // With no one waiting there is no one to serve: a storm's freed keys are dropped
            // here rather than each looked up in the state and the lines.
            if waiters.len() == 0 {
                self.fx.freed_locks.clear();
                self.fx.freed_pools.clear();
                self.fx.ready_queues.clear();
                return;
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
    pub fn serve(&mut self, state: &mut State, waiters: &mut Waiters, resource: Resource, at: At) {
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
                self.time_out(state, resource.clone(), w, at);
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
                (Resource::Lock(key), Want::Lock(reply, request)) => {
                    match state.acquire(session, key, at, fx) {
                        Ok(a) => {
                            self.tally.acquired += u64::from(a.fresh);
                            let answer = Answer::Granted {
                                token: a.token.0,
                                revision: a.revision,
                            };
                            let g = granted(a.token, a.revision);
                            if let Some(r) = &request {
                                self.answer_retries(waiters, &resource, r, g);
                            }
                            self.remember(request, &answer, at);
                            pend(&mut self.pending, reply, Ok(g));
                        }
                        Err(AcquireError::Held { .. }) => {
                            waiters.push_front(
                                resource.clone(),
                                Waiter {
                                    id,
                                    session,
                                    deadline,
                                    want: Want::Lock(reply, request),
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

    /// Answers every waiter whose deadline has passed, then serves whatever the sessions
    /// ended meanwhile freed.
    pub fn time_out_waiters(&mut self, state: &mut State, waiters: &mut Waiters, at: At) {
        for (resource, w) in waiters.expire(at.now) {
            self.time_out(state, resource, w, at);
        }
        self.settle(state, waiters, at);
    }

    /// Retries of a waiting lock request (its request id, sent again while the first still
    /// waited) are answered with the grant that served the first, instead of waiting on
    /// behind it for a lock their session now holds. Another call under the same id is
    /// refused as it would have been on arrival. The rest of the line keeps its order.
    fn answer_retries(
        &mut self,
        waiters: &mut Waiters,
        resource: &Resource,
        request: &Request,
        g: Granted,
    ) {
        let mut keep = Vec::new();
        for w in waiters.take_all(resource) {
            let Waiter {
                id,
                session,
                deadline,
                want,
            } = w;
            match want {
                Want::Lock(reply, Some(r)) if r.key == request.key => {
                    let answer = if r.fingerprint == request.fingerprint {
                        self.tally.replays += 1;
                        Ok(g)
                    } else {
                        Err(BackendError::RequestIdReused)
                    };
                    pend(&mut self.pending, reply, answer);
                }
                want => keep.push(Waiter {
                    id,
                    session,
                    deadline,
                    want,
                }),
            }
        }
        for w in keep.into_iter().rev() {
            waiters.push_front(resource.clone(), w);
        }
    }

    /// Answers a waiter whose time ran out: the lock is still held, the pool still full, the
    /// queue still empty — or its session is gone. A session that lapsed while it waited is
    /// ended here, so that "gone" is durable by the time it is said: like every answer of
    /// the batch, it leaves after the commit.
    fn time_out(&mut self, state: &mut State, resource: Resource, w: Waiter, at: At) {
        let pending = &mut self.pending;
        if !state.live_or_end_expired(w.session, at, &mut self.fx) {
            w.want.fail_later(pending, BackendError::SessionGone);
            return;
        }
        match (resource, w.want) {
            (Resource::Pool(pool), want @ Want::Seat { .. }) => {
                let (capacity, in_use) = state
                    .pool(&pool)
                    .map_or((0, 0), |p| (p.capacity, p.holders.len()));
                self.tally.seats_refused += 1;
                want.fail_later(pending, BackendError::PoolExhausted { capacity, in_use });
            }
            (_, Want::Claim(reply)) => pend(pending, reply, Ok(None)),
            (_, want) => want.fail_later(pending, BackendError::LockHeld),
        }
    }
}
