//! The embedded backend: state in memory owned by one writer thread (group commit), persisted
//! to redb before each answer; the reaper; the lock, seat and job waiters.
//!
//! Mutations go to the writer thread through a bounded channel and are answered only after
//! the batch that applied them has been committed with fsync. Plain heartbeats touch only
//! memory (the deadline lives on the monotonic clock) and never wait for the writer. Reads
//! come from redb read transactions, so they see only what has been committed, plus the
//! in-memory deadlines for liveness.

mod reaper;
pub mod store;
mod waiters;
mod writer;

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Sender, TrySendError};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::backend::{
    Backend, BackendError, Beat, CheckReport, Claimed, Closed, DueSession, Fence, Granted, JobPage,
    LockPage, OpenedSession, PoolInfo, QueueInfo, ReapOutcome, SeatHolder, SessionInfo,
    SessionPage,
};
use crate::clock::Clock;
use crate::domain::time::to_wall;
use crate::domain::{
    At, EndReason, Event, Finish, JobId, JobRecord, JobStatus, LockKey, LockRecord, Mono, NewJob,
    PoolName, PoolPut, QueueName, RestoreError, SessionId, SessionRecord, SessionView, State,
    Token, UnixMs,
};
use crate::engine::EngineConfig;
use crate::metrics::Metrics;
use store::{Store, StoreError};
use waiters::{Resource, Waiters};
use writer::Command;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the data file is inconsistent ({0}); run `leasehold check` for a full report")]
    Inconsistent(#[from] RestoreError),
    #[error("cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// Keeps the first `limit` rows of a page fetched with one extra, and returns the last kept
/// row (the next cursor) only when the extra row showed there is more.
fn more<T>(rows: &mut Vec<T>, limit: usize) -> Option<&T> {
    if rows.len() > limit {
        rows.truncate(limit);
        rows.last()
    } else {
        None
    }
}

pub(crate) struct Shared {
    pub config: EngineConfig,
    pub state: Mutex<State>,
    /// Owned by the writer; readers only count waiters. Locked after `state`, never before.
    pub waiters: Mutex<Waiters>,
    pub draining: std::sync::atomic::AtomicBool,
    pub store: Store,
    pub clock: Arc<dyn Clock>,
    pub metrics: Arc<Metrics>,
}

struct Threads {
    writer: Option<JoinHandle<()>>,
    reaper: Option<reaper::ReaperHandle>,
}

/// The embedded backend's handle. Cheap to clone.
#[derive(Clone)]
pub struct Embedded {
    shared: Arc<Shared>,
    tx: Sender<Command>,
    threads: Arc<Mutex<Threads>>,
}

impl Embedded {
    /// Loads the state from `store`, gives every live session the restart grace, and starts
    /// the writer and the reaper.
    pub fn start(
        config: EngineConfig,
        store: Store,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Result<Embedded, StartError> {
        let restore = store.load()?;
        let state = State::restore(config.limits, restore, clock.now())?;
        metrics.sessions_active.set(state.session_count() as i64);
        metrics.locks_held.set(state.lock_count() as i64);
        for (pool, capacity, in_use) in state.pools() {
            metrics.set_pool(pool.as_str(), Some((capacity, in_use)));
        }
        for (queue, counts) in state.queues() {
            metrics.set_queue(queue.as_str(), counts);
        }
        let (tx, rx) = crossbeam_channel::bounded(config.queue_capacity);
        let shared = Arc::new(Shared {
            config,
            state: Mutex::new(state),
            waiters: Mutex::new(Waiters::default()),
            draining: std::sync::atomic::AtomicBool::new(false),
            store,
            clock,
            metrics,
        });
        let writer = writer::spawn(shared.clone(), rx)?;
        let reaper = if shared.config.reaper_enabled {
            Some(reaper::spawn(shared.clone(), tx.clone())?)
        } else {
            None
        };
        Ok(Embedded {
            shared,
            tx,
            threads: Arc::new(Mutex::new(Threads {
                writer: Some(writer),
                reaper,
            })),
        })
    }

    /// Stops the reaper, lets the writer finish what is queued, and joins both threads.
    pub fn shutdown(&self) {
        let (writer, reaper) = {
            let mut t = self.threads.lock();
            (t.writer.take(), t.reaper.take())
        };
        if let Some(reaper) = reaper {
            reaper.stop();
        }
        if let Some(writer) = writer {
            let _ = self.tx.send(Command::Stop);
            let _ = writer.join();
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// False once the store has failed (fail-stop), or from the start of a shutdown so that
    /// load balancers stop sending while in-flight requests drain.
    pub fn ready(&self) -> bool {
        !self.shared.store.failed()
            && !self
                .shared
                .draining
                .load(std::sync::atomic::Ordering::SeqCst)
            && self.threads.lock().writer.is_some()
    }

    /// Marks the start of a shutdown: readiness turns false and requests waiting for a lock,
    /// a seat or a job are answered `503 shutting_down` at once; others are still served.
    pub fn begin_drain(&self) {
        self.shared
            .draining
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = self.tx.try_send(Command::Drain);
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, BackendError>>) -> Command,
    ) -> Result<T, BackendError> {
        if self.shared.store.failed() {
            return Err(BackendError::StoreFailed);
        }
        let (reply, rx) = oneshot::channel();
        match self.tx.try_send(make(reply)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(BackendError::Overloaded(self.tx.len())),
            Err(TrySendError::Disconnected(_)) => return Err(BackendError::ShuttingDown),
        }
        rx.await.unwrap_or(Err(BackendError::ShuttingDown))
    }

    pub async fn open(
        &self,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession, BackendError> {
        let id = SessionId::random();
        self.call(|reply| Command::Open {
            id,
            owner,
            ttl_ms,
            metadata: metadata.unwrap_or_default(),
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
        let at = At {
            now: self.shared.clock.now(),
            wall: self.shared.clock.wall(),
        };
        let beat = {
            let mut state = self.shared.state.lock();
            // A live session's plain heartbeat changes nothing durable: answer it here. Any
            // other (unknown, or past its deadline and so to be ended durably) goes through
            // the writer, so that "gone" is only ever said once it is on disk.
            if state.is_live(id, at.now) {
                Some(state.heartbeat(id, None, at, &mut crate::domain::Effects::default()))
            } else {
                None
            }
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
            reply,
        })
        .await
    }

    /// Runs reaper passes now until no session is due.
    pub async fn reap_now(&self) -> Result<ReapOutcome, BackendError> {
        let mut total = ReapOutcome::default();
        loop {
            let limit = self.shared.config.reaper_batch;
            let pass = self
                .call(|reply| Command::Reap {
                    size: writer::PassSize::AtMost(limit),
                    reply,
                })
                .await?;
            total.sessions += pass.sessions;
            total.locks += pass.locks;
            total.seats += pass.seats;
            total.jobs += pass.jobs;
            if pass.sessions < limit {
                return Ok(total);
            }
        }
    }

    /// What a reap now would end, changing nothing.
    pub fn reap_dry_run(&self, limit: usize) -> Result<Vec<DueSession>, BackendError> {
        self.vouch_for_liveness()?;
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let state = self.shared.state.lock();
        Ok(state
            .due(now, limit)
            .into_iter()
            .map(|v| DueSession {
                id: v.id,
                expired_at: to_wall(v.deadline, now, wall),
                locks: v
                    .locks
                    .into_iter()
                    .map(|(k, t)| (k.to_string(), t))
                    .collect(),
                seats: v.seats.iter().map(|p| p.to_string()).collect(),
                jobs: v
                    .jobs
                    .iter()
                    .filter_map(|j| state.job_outcome_if_ended(*j).map(|o| (*j, o)))
                    .collect(),
            })
            .collect())
    }

    fn info(
        &self,
        view: SessionView,
        record: SessionRecord,
        now: Mono,
        wall: UnixMs,
    ) -> Result<SessionInfo, BackendError> {
        let store = &self.shared.store;
        let locks = store
            .session_locks(view.id)?
            .into_iter()
            .map(|(k, r)| (k, r.token))
            .collect();
        let seats = store.session_seats(view.id)?;
        let jobs = store.session_jobs(view.id)?;
        Ok(SessionInfo {
            id: view.id,
            ttl_ms: view.ttl_ms,
            expires_at: to_wall(view.deadline, now, wall),
            last_heartbeat_at: to_wall(view.last_heartbeat(), now, wall),
            grace: view.in_grace(now),
            record,
            locks,
            seats,
            jobs,
        })
    }

    /// Liveness lives in memory, and after a failed commit memory may hold changes that
    /// were never committed: from then on the server no longer vouches for who is alive.
    fn vouch_for_liveness(&self) -> Result<(), BackendError> {
        if self.shared.store.failed() {
            Err(BackendError::StoreFailed)
        } else {
            Ok(())
        }
    }

    /// A live session, as committed. `None` when it is gone.
    pub fn session(&self, id: SessionId) -> Result<Option<SessionInfo>, BackendError> {
        self.vouch_for_liveness()?;
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let Some(view) = self.shared.state.lock().session(id, now) else {
            return Ok(None);
        };
        let Some(record) = self.shared.store.session(id)? else {
            return Ok(None);
        };
        self.info(view, record, now, wall).map(Some)
    }

    /// A page of live sessions in id order, and the cursor of the next page.
    pub fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> Result<(Vec<SessionInfo>, Option<SessionId>), BackendError> {
        self.vouch_for_liveness()?;
        let mut rows = self.shared.store.sessions(owner, after, limit + 1)?;
        let next = more(&mut rows, limit).map(|(id, _)| *id);
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let views: Vec<_> = {
            let state = self.shared.state.lock();
            rows.into_iter()
                .filter_map(|(id, rec)| state.session(id, now).map(|v| (v, rec)))
                .collect()
        };
        let infos = views
            .into_iter()
            .map(|(v, rec)| self.info(v, rec, now, wall))
            .collect::<Result<_, _>>()?;
        Ok((infos, next))
    }

    pub fn lock(&self, key: &LockKey) -> Result<Option<LockRecord>, BackendError> {
        Ok(self.shared.store.lock(key.as_str())?)
    }

    pub fn locks(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, BackendError> {
        let mut rows = self.shared.store.locks(prefix, after, limit + 1)?;
        let next = more(&mut rows, limit).map(|(k, _)| k.clone());
        Ok((rows, next))
    }

    /// May a resource still accept `token` for `key`? Only while it is the token of the key's
    /// present holder and that holder's session is alive.
    pub fn fence(&self, key: &LockKey, token: Token) -> Result<Fence, BackendError> {
        self.vouch_for_liveness()?;
        let Some(lock) = self.shared.store.lock(key.as_str())? else {
            return Ok(Fence {
                current: false,
                latest: None,
            });
        };
        let live = self
            .shared
            .state
            .lock()
            .is_live(lock.session_id, self.shared.clock.now());
        Ok(Fence {
            current: live && lock.token == token,
            latest: Some(lock.token),
        })
    }

    pub fn events(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<Event>, Option<u64>), BackendError> {
        let events = self.shared.store.events(after, limit)?;
        let next = events.last().map(|e| e.seq);
        Ok((events, next))
    }

    /// Creates a pool or changes its capacity and metadata.
    pub async fn put_pool(
        &self,
        name: PoolName,
        capacity: u64,
        metadata: Option<String>,
    ) -> Result<PoolPut, BackendError> {
        // A resize keeps when the pool was created, and its metadata unless new is given.
        let existing = self.shared.store.pool(name.as_str())?;
        let created_at = existing.as_ref().map(|p| p.created_at);
        let metadata = metadata
            .or_else(|| existing.map(|p| p.metadata))
            .unwrap_or_default();
        self.call(|reply| Command::PutPool {
            name,
            capacity,
            metadata,
            created_at,
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
        let started = std::time::Instant::now();
        let deadline = self.wait_deadline(wait_ms);
        let r = self
            .call(|reply| Command::AcquireSeat {
                id,
                pool,
                metadata: metadata.unwrap_or_default(),
                deadline,
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
            reply,
        })
        .await
    }

    pub async fn enqueue(&self, job: NewJob) -> Result<(JobId, u64), BackendError> {
        let id = JobId::random();
        let revision = self
            .call(|reply| Command::Enqueue { id, job, reply })
            .await?;
        Ok((id, revision))
    }

    /// Claims the oldest queued job, waiting up to `wait_ms` for one; `None` when none came.
    pub async fn claim(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
    ) -> Result<Option<Claimed>, BackendError> {
        let started = std::time::Instant::now();
        let deadline = self.wait_deadline(wait_ms);
        let r = self
            .call(|reply| Command::Claim {
                id,
                queue,
                deadline,
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
            reply,
        })
        .await
    }

    pub async fn requeue(&self, job: JobId) -> Result<u64, BackendError> {
        self.call(|reply| Command::Requeue { job, reply }).await
    }

    fn wait_deadline(&self, wait_ms: u64) -> Option<Mono> {
        let wait = wait_ms.min(self.shared.config.max_wait_ms);
        (wait > 0).then(|| self.shared.clock.now().plus_ms(wait))
    }

    /// A pool with its holders as committed and their liveness.
    pub fn pool(&self, name: &PoolName) -> Result<Option<PoolInfo>, BackendError> {
        self.vouch_for_liveness()?;
        let Some(record) = self.shared.store.pool(name.as_str())? else {
            return Ok(None);
        };
        let seats = self.shared.store.seats(name.as_str())?;
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let state = self.shared.state.lock();
        let waiting = self
            .shared
            .waiters
            .lock()
            .waiting(&Resource::Pool(name.clone()));
        let holders = seats
            .into_iter()
            .map(|(sid, seat, session)| {
                let live = state.session(sid, now);
                SeatHolder {
                    session_id: sid,
                    owner: session.map(|s| s.owner).unwrap_or_default(),
                    seat,
                    last_heartbeat_at: live
                        .as_ref()
                        .map(|v| to_wall(v.last_heartbeat(), now, wall)),
                    grace: live.as_ref().map(|v| v.in_grace(now)),
                }
            })
            .collect::<Vec<_>>();
        Ok(Some(PoolInfo {
            capacity: record.capacity,
            in_use: holders.len(),
            waiting,
            metadata: record.metadata,
            created_at: record.created_at,
            holders,
        }))
    }

    /// Every pool: name, capacity, seats in use.
    pub fn pools(&self) -> Result<Vec<(String, u32, usize)>, BackendError> {
        self.vouch_for_liveness()?;
        Ok(self
            .shared
            .state
            .lock()
            .pools()
            .into_iter()
            .map(|(n, c, u)| (n.to_string(), c, u))
            .collect())
    }

    pub fn job(&self, id: JobId) -> Result<Option<(JobRecord, String)>, BackendError> {
        Ok(self.shared.store.job(id)?)
    }

    pub fn queue(&self, name: &QueueName) -> Result<QueueInfo, BackendError> {
        self.vouch_for_liveness()?;
        let counts = self.shared.state.lock().queue_counts(name);
        let waiting = self
            .shared
            .waiters
            .lock()
            .waiting(&Resource::Queue(name.clone()));
        Ok(QueueInfo { counts, waiting })
    }

    /// Jobs of a queue in one state, a page at a time, and the cursor of the next page.
    pub fn queue_jobs(
        &self,
        queue: &QueueName,
        state: &JobStatus,
        after: Option<JobId>,
        limit: usize,
    ) -> Result<JobPage, BackendError> {
        let mut rows =
            self.shared
                .store
                .jobs_in_state(queue.as_str(), state.code(), after, limit + 1)?;
        let next = more(&mut rows, limit).map(|(id, _)| *id);
        Ok((rows, next))
    }

    /// The current revision (what a read-only answer reports).
    pub fn revision(&self) -> u64 {
        self.shared.state.lock().revision()
    }
}

/// Reads come straight from memory and redb read transactions, so they never wait for the
/// writer; every mutation goes through the writer and is answered after its commit.
impl Backend for Embedded {
    fn config(&self) -> &EngineConfig {
        Embedded::config(self)
    }

    fn metrics(&self) -> &Arc<Metrics> {
        Embedded::metrics(self)
    }

    fn ready(&self) -> bool {
        Embedded::ready(self)
    }

    fn begin_drain(&self) {
        Embedded::begin_drain(self)
    }

    fn shutdown(&self) {
        Embedded::shutdown(self)
    }

    async fn open(
        &self,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession, BackendError> {
        Embedded::open(self, owner, ttl_ms, metadata).await
    }

    async fn heartbeat(&self, id: SessionId, ttl_ms: Option<u64>) -> Result<Beat, BackendError> {
        Embedded::heartbeat(self, id, ttl_ms).await
    }

    async fn end(&self, id: SessionId, reason: EndReason) -> Result<Option<Closed>, BackendError> {
        Embedded::end(self, id, reason).await
    }

    async fn session(&self, id: SessionId) -> Result<Option<SessionInfo>, BackendError> {
        Embedded::session(self, id)
    }

    async fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> Result<SessionPage, BackendError> {
        Embedded::sessions(self, owner, after, limit)
    }

    async fn acquire(
        &self,
        id: SessionId,
        key: LockKey,
        wait_ms: u64,
    ) -> Result<Granted, BackendError> {
        Embedded::acquire(self, id, key, wait_ms).await
    }

    async fn release(
        &self,
        id: SessionId,
        key: LockKey,
        token: Token,
    ) -> Result<u64, BackendError> {
        Embedded::release(self, id, key, token).await
    }

    async fn lock(&self, key: &LockKey) -> Result<Option<LockRecord>, BackendError> {
        Embedded::lock(self, key)
    }

    async fn locks(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, BackendError> {
        Embedded::locks(self, prefix, after, limit)
    }

    async fn fence(&self, key: &LockKey, token: Token) -> Result<Fence, BackendError> {
        Embedded::fence(self, key, token)
    }

    async fn put_pool(
        &self,
        name: PoolName,
        capacity: u64,
        metadata: Option<String>,
    ) -> Result<PoolPut, BackendError> {
        Embedded::put_pool(self, name, capacity, metadata).await
    }

    async fn delete_pool(&self, name: PoolName) -> Result<u64, BackendError> {
        Embedded::delete_pool(self, name).await
    }

    async fn pool(&self, name: &PoolName) -> Result<Option<PoolInfo>, BackendError> {
        Embedded::pool(self, name)
    }

    async fn pools(&self) -> Result<Vec<(String, u32, usize)>, BackendError> {
        Embedded::pools(self)
    }

    async fn acquire_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
    ) -> Result<Granted, BackendError> {
        Embedded::acquire_seat(self, id, pool, metadata, wait_ms).await
    }

    async fn release_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        token: Token,
    ) -> Result<u64, BackendError> {
        Embedded::release_seat(self, id, pool, token).await
    }

    async fn enqueue(&self, job: NewJob) -> Result<(JobId, u64), BackendError> {
        Embedded::enqueue(self, job).await
    }

    async fn claim(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
    ) -> Result<Option<Claimed>, BackendError> {
        Embedded::claim(self, id, queue, wait_ms).await
    }

    async fn finish_job(
        &self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
    ) -> Result<u64, BackendError> {
        Embedded::finish_job(self, id, job, token, finish).await
    }

    async fn requeue(&self, job: JobId) -> Result<u64, BackendError> {
        Embedded::requeue(self, job).await
    }

    async fn job(&self, id: JobId) -> Result<Option<(JobRecord, String)>, BackendError> {
        Embedded::job(self, id)
    }

    async fn queue(&self, name: &QueueName) -> Result<QueueInfo, BackendError> {
        Embedded::queue(self, name)
    }

    async fn queue_jobs(
        &self,
        queue: &QueueName,
        state: &JobStatus,
        after: Option<JobId>,
        limit: usize,
    ) -> Result<JobPage, BackendError> {
        Embedded::queue_jobs(self, queue, state, after, limit)
    }

    async fn events(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<Event>, Option<u64>), BackendError> {
        Embedded::events(self, after, limit)
    }

    async fn reap_now(&self) -> Result<ReapOutcome, BackendError> {
        Embedded::reap_now(self).await
    }

    async fn reap_dry_run(&self, limit: usize) -> Result<Vec<DueSession>, BackendError> {
        Embedded::reap_dry_run(self, limit)
    }

    async fn revision(&self) -> Result<u64, BackendError> {
        Ok(Embedded::revision(self))
    }

    async fn check(&self) -> Result<CheckReport, BackendError> {
        Ok(self.shared.store.check()?)
    }
}
