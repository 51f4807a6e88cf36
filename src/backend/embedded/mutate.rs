//! The write side of the handle: every mutation is a command to the writer, answered after
//! the commit that made it durable. A plain heartbeat of a live session is the one exception:
//! it changes nothing durable, so it is answered from memory.

use super::Embedded;
use super::commands::{Command, PassSize};
use super::store::backup::BackupFile;
use crate::backend::requests::{Answer, Mutation, Request};
use crate::backend::{BackendError, Beat, Claimed, Closed, Granted, OpenedSession, ReapOutcome};
use crate::domain::state::FloorRaised;
use crate::domain::time::to_wall;
use crate::domain::{
    At, Effects, EndReason, Finish, JobId, LockKey, Mono, NewJob, PoolName, PoolPut, QueueName,
    SessionId, Token,
};

impl Embedded {
    pub async fn open(
        &self,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession, BackendError> {
        self.open_as(SessionId::random(), owner, ttl_ms, metadata)
            .await
    }

    pub async fn open_as(
        &self,
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession, BackendError> {
        self.call(|reply| Command::Open {
            id,
            owner,
            ttl_ms,
            metadata: metadata.unwrap_or_default(),
            request: None,
            reply,
        })
        .await
    }

    /// Extends a session. Without a new TTL this touches memory only; with one, the TTL is
    /// persisted first so the restart grace uses it.
    pub async fn heartbeat(
        &self,
        id: SessionId,
        ttl_ms: Option<u64>,
    ) -> Result<Beat, BackendError> {
        if ttl_ms.is_some() {
            return self
                .call(|reply| Command::Heartbeat { id, ttl_ms, reply })
                .await;
        }
        if self.shared.store.failed() {
            return Err(BackendError::StoreFailed);
        }
        let (beat, at) = {
            let mut state = self.shared.state.lock();
            // The clock is read under the lock, as the writer reads it: a reading taken
            // before the lock could be older than that of a reader who meanwhile found the
            // session past its deadline, and would extend what that reader saw expire.
            let at = At {
                now: self.shared.clock.now(),
                wall: self.shared.clock.wall(),
            };
            // A live session's plain heartbeat changes nothing durable: answer it here. Any
            // other (unknown, or past its deadline and so to be ended durably) goes through
            // the writer, so that "gone" is only ever said once it is on disk.
            let beat = state
                .is_live(id, at.now)
                .then(|| state.heartbeat(id, None, at, &mut Effects::default()));
            (beat, at)
        };
        match beat {
            Some(Ok(b)) => {
                self.shared.metrics.heartbeats.inc();
                Ok(Beat {
                    expires_at: to_wall(b.deadline, at.now, at.wall),
                    ttl_ms: b.ttl_ms,
                })
            }
            Some(Err(_)) => Err(BackendError::SessionGone),
            None => {
                self.call(|reply| Command::Heartbeat { id, ttl_ms, reply })
                    .await
            }
        }
    }

    /// Ends a session and everything it holds. `None` when it was unknown or already ended.
    pub async fn end(
        &self,
        id: SessionId,
        reason: EndReason,
    ) -> Result<Option<Closed>, BackendError> {
        self.call(|reply| Command::End { id, reason, reply }).await
    }

    /// Takes `key` for session `id`, waiting up to `wait_ms` (capped by `max_wait_ms`) in
    /// first-come, first-served order behind other waiters.
    pub async fn acquire(
        &self,
        id: SessionId,
        key: LockKey,
        wait_ms: u64,
    ) -> Result<Granted, BackendError> {
        let wait = wait_ms.min(self.shared.config.max_wait_ms);
        let deadline = (wait > 0).then(|| self.shared.clock.now().plus_ms(wait));
        self.call(|reply| Command::Acquire {
            id,
            key,
            deadline,
            request: None,
            reply,
        })
        .await
    }

    pub async fn release(
        &self,
        id: SessionId,
        key: LockKey,
        token: Token,
    ) -> Result<u64, BackendError> {
        self.call(|reply| Command::Release {
            id,
            key,
            token,
            request: None,
            reply,
        })
        .await
    }

    /// Runs a mutation once for its request id: the check, the change and the record are
    /// in one batch of the writer, so in one commit.
    pub async fn once(&self, request: Request, op: Mutation) -> Result<Answer, BackendError> {
        let request = Some(request);
        Ok(match op {
            Mutation::Acquire { id, key, wait_ms } => {
                let wait = wait_ms.min(self.shared.config.max_wait_ms);
                let deadline = (wait > 0).then(|| self.shared.clock.now().plus_ms(wait));
                let g = self
                    .call(|reply| Command::Acquire {
                        id,
                        key,
                        deadline,
                        request,
                        reply,
                    })
                    .await?;
                Answer::Granted {
                    token: g.token.0,
                    revision: g.revision,
                }
            }
            Mutation::Release { id, key, token } => {
                let revision = self
                    .call(|reply| Command::Release {
                        id,
                        key,
                        token,
                        request,
                        reply,
                    })
                    .await?;
                Answer::Released { revision }
            }
            Mutation::Enqueue(job) => {
                let (job, revision) = self
                    .call(|reply| Command::Enqueue {
                        id: JobId::random(),
                        job,
                        request,
                        reply,
                    })
                    .await?;
                Answer::Enqueued { job, revision }
            }
            Mutation::Open {
                id,
                owner,
                ttl_ms,
                metadata,
            } => {
                let o = self
                    .call(|reply| Command::Open {
                        id,
                        owner,
                        ttl_ms,
                        metadata: metadata.unwrap_or_default(),
                        request,
                        reply,
                    })
                    .await?;
                Answer::Opened {
                    session: o.id,
                    ttl_ms: o.ttl_ms,
                    expires_at: o.expires_at.0,
                    revision: o.revision,
                }
            }
            Mutation::Claim { id, queue, wait_ms } => {
                Answer::from(self.claim_once(id, queue, wait_ms, request).await?.as_ref())
            }
            Mutation::AcquireSeat {
                id,
                pool,
                metadata,
                wait_ms,
            } => Answer::from(self.seat_once(id, pool, metadata, wait_ms, request).await?),
            Mutation::ReleaseSeat { id, pool, token } => {
                let revision = self
                    .call(|reply| Command::ReleaseSeat {
                        id,
                        pool,
                        token,
                        request,
                        reply,
                    })
                    .await?;
                Answer::Released { revision }
            }
            Mutation::Finish {
                id,
                job,
                token,
                finish,
            } => {
                let revision = self
                    .call(|reply| Command::FinishJob {
                        id,
                        job,
                        token,
                        finish,
                        request,
                        reply,
                    })
                    .await?;
                Answer::Finished { revision }
            }
        })
    }

    /// Runs reaper passes now until no session is due.
    pub async fn reap_now(&self) -> Result<ReapOutcome, BackendError> {
        let mut total = ReapOutcome::default();
        loop {
            let limit = self.shared.config.reaper_batch;
            let pass = self
                .call(|reply| Command::Reap {
                    size: PassSize::AtMost(limit),
                    reply,
                })
                .await?;
            total += pass;
            if pass.sessions < limit {
                return Ok(total);
            }
        }
    }

    /// Creates a pool or changes its capacity and metadata.
    pub async fn put_pool(
        &self,
        name: PoolName,
        capacity: u64,
        metadata: Option<String>,
    ) -> Result<PoolPut, BackendError> {
        self.call(|reply| Command::PutPool {
            name,
            capacity,
            metadata,
            reply,
        })
        .await
    }

    pub async fn delete_pool(&self, name: PoolName) -> Result<u64, BackendError> {
        self.call(|reply| Command::DeletePool { name, reply }).await
    }

    /// Takes a seat (one per session per pool), waiting up to `wait_ms` in first-come,
    /// first-served order when the pool is full.
    pub async fn acquire_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
    ) -> Result<Granted, BackendError> {
        self.seat_once(id, pool, metadata, wait_ms, None).await
    }

    async fn seat_once(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
        request: Option<Request>,
    ) -> Result<Granted, BackendError> {
        let started = std::time::Instant::now();
        let deadline = self.wait_deadline(wait_ms);
        let r = self
            .call(|reply| Command::AcquireSeat {
                id,
                pool,
                metadata: metadata.unwrap_or_default(),
                deadline,
                request,
                reply,
            })
            .await;
        if r.is_ok() {
            self.shared
                .metrics
                .seat_wait_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        r
    }

    pub async fn release_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        token: Token,
    ) -> Result<u64, BackendError> {
        self.call(|reply| Command::ReleaseSeat {
            id,
            pool,
            token,
            request: None,
            reply,
        })
        .await
    }

    pub async fn enqueue(&self, job: NewJob) -> Result<(JobId, u64), BackendError> {
        self.call(|reply| Command::Enqueue {
            id: JobId::random(),
            job,
            request: None,
            reply,
        })
        .await
    }

    /// Claims the oldest queued job, waiting up to `wait_ms` for one; `None` when none came.
    pub async fn claim(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
    ) -> Result<Option<Claimed>, BackendError> {
        self.claim_once(id, queue, wait_ms, None).await
    }

    async fn claim_once(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
        request: Option<Request>,
    ) -> Result<Option<Claimed>, BackendError> {
        let started = std::time::Instant::now();
        let deadline = self.wait_deadline(wait_ms);
        let r = self
            .call(|reply| Command::Claim {
                id,
                queue,
                deadline,
                request,
                reply,
            })
            .await;
        if let Ok(Some(_)) = r {
            self.shared
                .metrics
                .claim_wait_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        r
    }

    pub async fn finish_job(
        &self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
    ) -> Result<u64, BackendError> {
        self.call(|reply| Command::FinishJob {
            id,
            job,
            token,
            finish,
            request: None,
            reply,
        })
        .await
    }

    pub async fn requeue(&self, job: JobId) -> Result<u64, BackendError> {
        self.call(|reply| Command::Requeue { job, reply }).await
    }

    /// Raises the token floor through the writer: the raise and its event commit in one
    /// batch like any mutation, so no grant of an earlier batch can come out above it and no
    /// grant of a later one below it.
    pub async fn raise_token_floor(&self, floor: u64) -> Result<FloorRaised, BackendError> {
        self.call(|reply| Command::RaiseTokenFloor { floor, reply })
            .await
    }

    /// A backup of one consistent snapshot, built off the async workers. It reads through
    /// its own redb read transaction and never goes through the writer, so writers go on
    /// committing while it is built.
    pub async fn backup(&self) -> Result<BackupFile, BackendError> {
        if self.shared.store.failed() {
            return Err(BackendError::StoreFailed);
        }
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || shared.store.backup_file(shared.clock.wall()))
            .await
            .map_err(|_| BackendError::Unavailable("the backup task panicked".into()))?
            .map_err(BackendError::from)
    }

    fn wait_deadline(&self, wait_ms: u64) -> Option<Mono> {
        let wait = wait_ms.min(self.shared.config.max_wait_ms);
        (wait > 0).then(|| self.shared.clock.now().plus_ms(wait))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, OnceLock, Weak};

    use super::*;
    use crate::backend::EngineConfig;
    use crate::backend::embedded::shared::Shared;
    use crate::backend::embedded::store::Store;
    use crate::clock::{Clock, ManualClock};
    use crate::domain::UnixMs;
    use crate::metrics::Metrics;

    /// A clock that, the one time it is armed, lets time jump past a session's deadline
    /// right after it has been read, and has a reader look at the session then — if the
    /// state lock is free. That is the interleaving of a heartbeat descheduled between
    /// reading the clock and taking the lock while a reader runs.
    struct LateReader {
        clock: ManualClock,
        shared: OnceLock<Weak<Shared>>,
        session: OnceLock<SessionId>,
        armed: AtomicBool,
        saw_expired: AtomicBool,
    }

    impl Clock for LateReader {
        fn now(&self) -> Mono {
            let read = self.clock.now();
            if self.armed.swap(false, Ordering::SeqCst) {
                self.clock.advance(200);
                let shared = self.shared.get().and_then(Weak::upgrade).unwrap();
                if let Some(state) = shared.state.try_lock() {
                    let id = *self.session.get().unwrap();
                    let expired = !state.is_live(id, self.clock.now());
                    self.saw_expired.store(expired, Ordering::SeqCst);
                }
            }
            read
        }

        fn wall(&self) -> UnixMs {
            self.clock.wall()
        }
    }

    /// A heartbeat must never extend a session that a reader has already seen past its
    /// deadline (expiry is judged once, and is terminal).
    ///
    /// The story: the fast path read the clock, then took the state lock. Descheduled in
    /// between, it carried a reading from before the deadline into the lock, after a reader
    /// had found the session expired, and extended it: a session reported expired at 1 100
    /// ms was alive again at 1 100 ms. Here the clock is read at 900 ms of a 1 000 ms TTL and
    /// the reader looks at 1 100 ms; with the reading taken under the lock, the reader
    /// cannot look in between, and sees the heartbeat's extension when it does.
    #[tokio::test]
    async fn a_heartbeat_reads_the_clock_under_the_state_lock() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20).unwrap();
        let clock = Arc::new(LateReader {
            clock: ManualClock::new(UnixMs(1_700_000_000_000)),
            shared: OnceLock::new(),
            session: OnceLock::new(),
            armed: AtomicBool::new(false),
            saw_expired: AtomicBool::new(false),
        });
        let config = EngineConfig {
            reaper_enabled: false,
            ..EngineConfig::default()
        };
        let embedded =
            Embedded::start(config, store, clock.clone(), Arc::new(Metrics::new())).unwrap();
        clock.shared.set(Arc::downgrade(&embedded.shared)).unwrap();
        let opened = embedded
            .open("late".into(), Some(1_000), None)
            .await
            .unwrap();
        clock.session.set(opened.id).unwrap();
        clock.clock.advance(900);

        clock.armed.store(true, Ordering::SeqCst);
        let beat = embedded.heartbeat(opened.id, None).await;
        assert!(
            !clock.armed.load(Ordering::SeqCst),
            "the heartbeat read the clock"
        );
        assert!(
            !(clock.saw_expired.load(Ordering::SeqCst) && beat.is_ok()),
            "a reader saw the session expired, and then the heartbeat extended it: {beat:?}"
        );
        embedded.shutdown();
    }
}
