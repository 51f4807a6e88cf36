//! Safe retries on PostgreSQL (see `crate::backend::requests`): a call with a request id
//! runs as one transaction of several statements that claims the id's row first, acts, and
//! writes its answer into that row before the commit, so the record and the change commit
//! together or not at all.
//!
//! The claim is an `INSERT … ON CONFLICT` on the id's primary key: a concurrent call with the
//! same id waits on that key until the first commits (and then finds its answer) or rolls
//! back (and then claims it itself), on any node. An expired row is taken over in the same
//! statement. Expiry is judged on the database clock, like sessions.

use super::jobs::ENQUEUE;
use super::locks::{RELEASE_IN_TX, Try};
use super::sessions::OPEN;
use super::{Fail, Postgres, transact};
use crate::backend::requests::{Answer, Mutation, Request, RequestCheck};
use crate::backend::waiting::{Resource, Step};
use crate::backend::{BackendError, Granted, Result};
use crate::domain::{JobId, LockKey, SessionId, Token, UnixMs};

/// Claims $1 (fingerprint $2, kept $3 ms) unless a live row has it; a row back means claimed.
const CLAIM: &str = "
INSERT INTO {ns}.request_id (key, fingerprint, answer, expires_at)
VALUES ($1, $2, '', {ns}.db_now() + $3 * interval '1 millisecond')
ON CONFLICT (key) DO UPDATE
    SET fingerprint = EXCLUDED.fingerprint, answer = '', expires_at = EXCLUDED.expires_at
    WHERE {ns}.request_id.expires_at <= {ns}.db_now()
RETURNING key";

/// The live row that kept the claim from succeeding.
const RECORD: &str =
    "SELECT fingerprint, answer, {ns}.ms(expires_at) FROM {ns}.request_id WHERE key = $1";

const ANSWER: &str = "UPDATE {ns}.request_id SET answer = $2 WHERE key = $1";

/// A claim given back by an attempt that did not act (a held lock): nothing to remember.
const UNCLAIM: &str = "DELETE FROM {ns}.request_id WHERE key = $1";

/// Forgets up to $1 request ids past their retention, oldest first.
pub(super) const PURGE: &str = "
DELETE FROM {ns}.request_id WHERE key IN (
    SELECT key FROM {ns}.request_id WHERE expires_at <= {ns}.db_now()
    ORDER BY expires_at LIMIT $1
)";

/// What the claim found.
enum Claim {
    /// This transaction holds the id: act, then write the answer.
    Mine,
    Replay(Answer),
}

/// A claimed attempt at a lock that decided not to act (others hold it, or wait ahead).
enum Attempt {
    Decided(Try),
    Replay(Answer),
}

impl Postgres {
    /// Claims the request's id in `tx`, or finds why it cannot.
    async fn claim_request(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        request: &Request,
    ) -> std::result::Result<Claim, Fail> {
        let retention = self.config().request_id_retention_ms as f64;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&request.key, &request.fingerprint, &retention];
        if !self.q(tx, CLAIM, &params).await?.is_empty() {
            return Ok(Claim::Mine);
        }
        let row = self
            .q_one(tx, RECORD, &[&request.key])
            .await?
            .ok_or(Fail::Answer(BackendError::Unavailable(
                "the request id's row vanished under its claim".into(),
            )))?;
        let fingerprint: String = row.get(0);
        let answer: String = row.get(1);
        let expires_at = UnixMs(row.get::<_, i64>(2) as u64);
        // The row is live (else the claim took it over): judged at its own expiry's eve.
        let now = UnixMs(expires_at.0.saturating_sub(1));
        match RequestCheck::of(request, Some((&fingerprint, &answer, expires_at)), now) {
            RequestCheck::Replay(a) => Ok(Claim::Replay(a)),
            _ => Err(Fail::Answer(BackendError::RequestIdReused)),
        }
    }

    async fn answer_request(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        request: &Request,
        answer: &Answer,
    ) -> std::result::Result<(), Fail> {
        self.q(tx, ANSWER, &[&request.key, &answer.to_json()])
            .await?;
        Ok(())
    }

    /// For a call that may carry a request id: claims it in `tx` and returns the answer
    /// to replay, if any. `None` means act, then [`Postgres::settle_request`].
    pub(super) async fn begin_request(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        request: Option<&Request>,
    ) -> std::result::Result<Option<Answer>, Fail> {
        Ok(match request {
            Some(r) => match self.claim_request(tx, r).await? {
                Claim::Replay(a) => Some(a),
                Claim::Mine => None,
            },
            None => None,
        })
    }

    /// Ends what [`Postgres::begin_request`] began: writes `answer` into the claimed row,
    /// or, when the attempt did not act (`None`), gives the claim back.
    pub(super) async fn settle_request(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        request: Option<&Request>,
        answer: Option<&Answer>,
    ) -> std::result::Result<(), Fail> {
        match (request, answer) {
            (None, _) => {}
            (Some(r), Some(a)) => self.answer_request(tx, r, a).await?,
            (Some(r), None) => {
                self.q(tx, UNCLAIM, &[&r.key]).await?;
            }
        }
        Ok(())
    }

    pub async fn once(&self, request: Request, op: Mutation) -> Result<Answer> {
        match op {
            Mutation::Acquire { id, key, wait_ms } => {
                let deadline = self.wait_deadline(wait_ms);
                let g = self
                    .waiting()
                    .lock(key.clone(), deadline, |may_take| {
                        self.try_acquire_once(id, &key, may_take, &request)
                    })
                    .await?;
                Ok(Answer::Granted {
                    token: g.token.0,
                    revision: g.revision,
                })
            }
            Mutation::Release { id, key, token } => {
                let done = transact!(self, |tx, after| {
                    match self.claim_request(&tx, &request).await? {
                        Claim::Replay(a) => (a, false),
                        Claim::Mine => {
                            let row = self
                                .q_one(
                                    &tx,
                                    RELEASE_IN_TX,
                                    &[&key.as_str(), &id.0, &(token.0 as i64)],
                                )
                                .await?
                                .ok_or(Fail::Answer(BackendError::NotHolder))?;
                            let revision = row.get::<_, i64>(0) as u64;
                            let a = Answer::Released { revision };
                            self.answer_request(&tx, &request, &a).await?;
                            after.freed.push(Resource::Lock(key.clone()));
                            (a, true)
                        }
                    }
                });
                match done {
                    Ok((a, acted)) => {
                        // Counted once committed, and only by the call that acted.
                        if acted {
                            self.inner.metrics.locks_released.inc();
                            self.inner.metrics.locks_held.dec();
                        } else {
                            self.inner.metrics.request_id_replays.inc();
                        }
                        Ok(a)
                    }
                    Err(BackendError::NotHolder) => {
                        // A caller past its deadline holds nothing any more: it is ended.
                        self.live_or_end(id).await?;
                        Err(BackendError::NotHolder)
                    }
                    Err(e) => Err(e),
                }
            }
            Mutation::Enqueue(job) => {
                let (max_recoveries, kind) = job.checked()?;
                let queue = job.queue.clone();
                let (answer, acted) = transact!(self, |tx, after| {
                    match self.claim_request(&tx, &request).await? {
                        Claim::Replay(a) => (a, false),
                        Claim::Mine => {
                            let id = JobId::random();
                            let row = self
                                .q_one(
                                    &tx,
                                    ENQUEUE,
                                    &[
                                        &id.0,
                                        &job.queue.as_str(),
                                        &kind,
                                        &job.payload,
                                        &job.idempotent,
                                        &(max_recoveries as i32),
                                    ],
                                )
                                .await?
                                .ok_or(Fail::Answer(BackendError::Unavailable(
                                    "the enqueue returned nothing".into(),
                                )))?;
                            let a = Answer::Enqueued {
                                job: id,
                                revision: row.get::<_, i64>(0) as u64,
                            };
                            self.answer_request(&tx, &request, &a).await?;
                            after.freed.push(Resource::Queue(queue.clone()));
                            (a, true)
                        }
                    }
                })?;
                if acted {
                    self.gauge_queue(queue.as_str(), "queued", 1);
                } else {
                    self.inner.metrics.request_id_replays.inc();
                }
                Ok(answer)
            }
            Mutation::Open {
                id,
                owner,
                ttl_ms,
                metadata,
            } => {
                let limits = &self.config().limits;
                limits.owner(&owner)?;
                let ttl_ms = limits.ttl(ttl_ms)?;
                let metadata = metadata.filter(|m| !m.is_empty());
                if let Some(m) = &metadata {
                    limits.metadata(m)?;
                }
                let (answer, acted) = transact!(self, |tx, _after| {
                    match self.claim_request(&tx, &request).await? {
                        Claim::Replay(a) => (a, false),
                        Claim::Mine => {
                            let row = self
                                .q_one(&tx, OPEN, &[&id.0, &owner, &metadata, &(ttl_ms as i64)])
                                .await?
                                .ok_or(Fail::Answer(BackendError::Unavailable(
                                    "the session insert returned nothing".into(),
                                )))?;
                            let a = Answer::Opened {
                                session: id,
                                ttl_ms,
                                expires_at: row.get::<_, i64>(1) as u64,
                                revision: row.get::<_, i64>(0) as u64,
                            };
                            self.answer_request(&tx, &request, &a).await?;
                            (a, true)
                        }
                    }
                })?;
                if acted {
                    self.inner.metrics.sessions_opened.inc();
                    self.inner.metrics.sessions_active.inc();
                } else {
                    self.inner.metrics.request_id_replays.inc();
                }
                Ok(answer)
            }
            Mutation::Claim { id, queue, wait_ms } => {
                let claimed = self.claim_once(id, queue, wait_ms, Some(&request)).await?;
                Ok(Answer::from(claimed.as_ref()))
            }
            Mutation::AcquireSeat {
                id,
                pool,
                metadata,
                wait_ms,
            } => {
                let r = Some(&request);
                Ok(Answer::from(
                    self.seat_once(id, pool, metadata, wait_ms, r).await?,
                ))
            }
            Mutation::ReleaseSeat { id, pool, token } => {
                let revision = self.release_seat_once(id, pool, token, &request).await?;
                Ok(Answer::Released { revision })
            }
            Mutation::Finish {
                id,
                job,
                token,
                finish,
            } => {
                let r = Some(&request);
                let revision = self.finish_once(id, job, token, finish, r).await?;
                Ok(Answer::Finished { revision })
            }
        }
    }

    /// One attempt at a lock with a request id, in one transaction: claim the id, decide
    /// under the key's lock as the multi-statement path does, and keep the claim only when
    /// the attempt granted (or found the caller already holding). What it ended on the way
    /// (an expired holder or caller) commits either way.
    async fn try_acquire_once(
        &self,
        id: SessionId,
        key: &LockKey,
        may_take: bool,
        request: &Request,
    ) -> Result<Step<Granted, ()>> {
        let attempt = transact!(self, |tx, after| {
            match self.claim_request(&tx, request).await? {
                Claim::Replay(a) => Attempt::Replay(a),
                Claim::Mine => {
                    let decided = self.decide_in(&tx, &mut after, id, key, may_take).await?;
                    match &decided {
                        Try::Granted(token) => {
                            let a = Answer::Granted {
                                token: token.0,
                                revision: token.0,
                            };
                            self.answer_request(&tx, request, &a).await?;
                        }
                        Try::Own(token, revision) => {
                            let a = Answer::Granted {
                                token: token.0,
                                revision: *revision,
                            };
                            self.answer_request(&tx, request, &a).await?;
                        }
                        _ => {
                            self.q(&tx, UNCLAIM, &[&request.key]).await?;
                        }
                    }
                    Attempt::Decided(decided)
                }
            }
        })?;
        match attempt {
            Attempt::Decided(t) => self.step(t),
            Attempt::Replay(Answer::Granted { token, revision }) => {
                // Counted once committed (a retried transaction does not count twice).
                self.inner.metrics.request_id_replays.inc();
                Ok(Step::Done(Granted {
                    token: Token(token),
                    revision,
                }))
            }
            Attempt::Replay(_) => Err(BackendError::RequestIdReused),
        }
    }
}
