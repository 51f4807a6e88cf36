//! Serving waiters: when a lock, seats or jobs free up in a batch, the first waiters for
//! them are served in the same batch, before any later request can take them, so a newcomer
//! never overtakes a waiter; and waiters whose time ran out are answered.

use super::commands::{claimed, granted, pend};
use super::errors::{acquire_error, seat_error};
use super::waiters::{Resource, Waiter, Waiters, Want};
use super::writer::Writer;
use crate::backend::BackendError;
use crate::backend::requests::{Answer, Request, RequestCheck};
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
            let Some(want) = self.settled(want, at) else {
                continue;
            };
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
                            self.remember_served(waiters, &resource, request, &answer, at);
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
                (
                    Resource::Pool(pool),
                    Want::Seat {
                        metadata,
                        reply,
                        request,
                    },
                ) => match state.acquire_seat(session, pool, metadata.clone(), at, fx) {
                    Ok(g) => {
                        let g = granted(g.token, g.revision);
                        self.remember_served(waiters, &resource, request, &Answer::from(g), at);
                        pend(&mut self.pending, reply, Ok(g))
                    }
                    Err(SeatError::Exhausted { .. }) => {
                        let want = Want::Seat {
                            metadata,
                            reply,
                            request,
                        };
                        waiters.push_front(
                            resource.clone(),
                            Waiter {
                                id,
                                session,
                                deadline,
                                want,
                            },
                        );
                        return;
                    }
                    Err(e) => pend(&mut self.pending, reply, Err(seat_error(e))),
                },
                (Resource::Queue(queue), Want::Claim(reply, request)) => {
                    match state.claim(session, queue, at, fx) {
                        Ok(Some(c)) => {
                            let c = claimed(c);
                            self.remember_served(
                                waiters,
                                &resource,
                                request,
                                &Answer::from(&c),
                                at,
                            );
                            pend(&mut self.pending, reply, Ok(Some(c)))
                        }
                        Ok(None) => {
                            waiters.push_front(
                                resource.clone(),
                                Waiter {
                                    id,
                                    session,
                                    deadline,
                                    want: Want::Claim(reply, request),
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

    /// Remembers a served waiter's answer, then answers its retries waiting in the line.
    fn remember_served(
        &mut self,
        waiters: &mut Waiters,
        resource: &Resource,
        request: Option<Request>,
        answer: &Answer,
        at: At,
    ) {
        let key = request.as_ref().map(|r| r.key.clone());
        self.remember(request, answer, at);
        if let Some(key) = key {
            self.answer_retries(waiters, resource, &key, at);
        }
    }

    /// Retries of a waiting request (its request id, sent again while the first still
    /// waited) are answered with what served the first, the moment it is recorded, instead
    /// of waiting on behind it. Another call under the same id is refused as it would have
    /// been on arrival. The rest of the line keeps its order.
    fn answer_retries(&mut self, waiters: &mut Waiters, resource: &Resource, key: &str, at: At) {
        let mut keep = Vec::new();
        for w in waiters.take_all(resource) {
            if w.want.request().is_some_and(|r| r.key == key) {
                let Waiter {
                    id,
                    session,
                    deadline,
                    want,
                } = w;
                // Recorded just before: settled answers or refuses it.
                if let Some(want) = self.settled(want, at) {
                    keep.push(Waiter {
                        id,
                        session,
                        deadline,
                        want,
                    });
                }
            } else {
                keep.push(w);
            }
        }
        for w in keep.into_iter().rev() {
            waiters.push_front(resource.clone(), w);
        }
    }

    /// A waiter whose request id was recorded while it waited (a retry of the same call was
    /// served first, or another call took the id) is answered from the record, or refused,
    /// and `None` returned: acting again would claim a second job or answer a second grant.
    /// Otherwise the want is handed back to act on.
    fn settled(&mut self, want: Want, at: At) -> Option<Want> {
        let Some(request) = want.request() else {
            return Some(want);
        };
        let check = self.requests.check(request, at.wall);
        let answer = match check {
            RequestCheck::New => return Some(want),
            RequestCheck::Replay(a) => {
                self.tally.replays += 1;
                a
            }
            RequestCheck::Reused => {
                want.fail_later(&mut self.pending, BackendError::RequestIdReused);
                return None;
            }
        };
        let reused = || BackendError::RequestIdReused;
        match want {
            Want::Lock(reply, _) | Want::Seat { reply, .. } => pend(
                &mut self.pending,
                reply,
                answer.granted().ok_or_else(reused),
            ),
            Want::Claim(reply, _) => {
                let c = answer.claimed().map(Some).ok_or_else(reused);
                pend(&mut self.pending, reply, c)
            }
        }
        None
    }

    /// Answers a waiter whose time ran out: the lock is still held, the pool still full, the
    /// queue still empty — or its session is gone. A session that lapsed while it waited is
    /// ended here, so that "gone" is durable by the time it is said: like every answer of
    /// the batch, it leaves after the commit.
    fn time_out(&mut self, state: &mut State, resource: Resource, w: Waiter, at: At) {
        let Some(want) = self.settled(w.want, at) else {
            return;
        };
        let pending = &mut self.pending;
        if !state.live_or_end_expired(w.session, at, &mut self.fx) {
            want.fail_later(pending, BackendError::SessionGone);
            return;
        }
        match (resource, want) {
            (Resource::Pool(pool), want @ Want::Seat { .. }) => {
                let (capacity, in_use) = state
                    .pool(&pool)
                    .map_or((0, 0), |p| (p.capacity, p.holders.len()));
                self.tally.seats_refused += 1;
                want.fail_later(pending, BackendError::PoolExhausted { capacity, in_use });
            }
            (_, Want::Claim(reply, _)) => pend(pending, reply, Ok(None)),
            (_, want) => want.fail_later(pending, BackendError::LockHeld),
        }
    }
}
