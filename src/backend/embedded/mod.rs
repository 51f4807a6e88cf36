//! The embedded backend: state in memory owned by one writer thread (group commit), persisted
//! to redb before each answer; the reaper; the lock, seat and job waiters.
//!
//! Mutations go to the writer thread through a bounded channel and are answered only after
//! the batch that applied them has been committed with fsync. Plain heartbeats touch only
//! memory (the deadline lives on the monotonic clock) and never wait for the writer. Reads
//! come from redb read transactions, so they see only what has been committed, plus the
//! in-memory deadlines for liveness; one about to say a session is gone asks the writer
//! first, so that no restart can revive what an answer called gone.
//!
//! - the handle [`Embedded`] (here), its write side (`mutate`) and read side (`read`);
//! - `commands`: what the writer is asked and how answers get back;
//! - `writer`: the batch loop and the commit; `apply`: one command applied to the state;
//!   `serve`: waiters served when resources free up; `tallies`: metrics after a commit;
//! - `waiters`, `reaper`, `shared`, `errors`, and [`store`], the redb file.

mod apply;
mod commands;
mod errors;
mod mutate;
mod read;
mod reaper;
mod requests;
mod serve;
mod shared;
pub mod store;
mod tallies;
mod waiters;
mod writer;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Sender, TrySendError};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::backend::EngineConfig;
use crate::backend::requests::{Answer, Mutation, Request};
use crate::backend::{
    Backend, BackendError, Beat, CheckReport, Claimed, Closed, DueSession, Fence, Granted, JobPage,
    LockPage, OpenedSession, PoolInfo, QueueInfo, ReapOutcome, SessionInfo, SessionPage,
};
use crate::clock::Clock;
use crate::domain::state::FloorRaised;
use crate::domain::{
    EndReason, Event, Finish, JobId, JobRecord, JobStatus, LockKey, LockRecord, NewJob, PoolName,
    PoolPut, QueueName, SessionId, State, Token,
};
use crate::metrics::Metrics;
use commands::Command;
pub use errors::StartError;
use shared::Shared;
use store::Store;
use waiters::Waiters;

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
    /// The token the calls of this handle act for (see [`Embedded::acting_as`]).
    actor: Option<Arc<str>>,
}

impl Embedded {
    /// Loads the state from `store`, gives every session the restart grace (a fresh TTL; a
    /// session that an answer called gone has none left and comes back due), and starts the
    /// writer and the reaper.
    pub fn start(
        config: EngineConfig,
        store: Store,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Result<Embedded, StartError> {
        let restore = store.load()?;
        let requests = requests::Requests::load(store.request_ids()?);
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
            draining: AtomicBool::new(false),
            store,
            clock,
            metrics,
            ends: Arc::new(tokio::sync::Notify::new()),
        });
        let writer = writer::spawn(shared.clone(), rx, requests)?;
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
            actor: None,
        })
    }

    /// The same backend, whose calls name `actor` in the audit events they write of the
    /// kinds an operator's call names (see `EventKind::names_actor`).
    pub fn acting_as(&self, actor: Option<Arc<str>>) -> Embedded {
        Embedded {
            actor,
            ..self.clone()
        }
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
            && !self.shared.draining.load(Ordering::SeqCst)
            && self.threads.lock().writer.is_some()
    }

    /// Marks the start of a shutdown: readiness turns false and requests waiting for a lock,
    /// a seat or a job are answered `503 shutting_down` at once; others are still served.
    pub fn begin_drain(&self) {
        self.shared.draining.store(true, Ordering::SeqCst);
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
        let cmd = match &self.actor {
            None => make(reply),
            Some(actor) => Command::As {
                actor: actor.clone(),
                cmd: Box::new(make(reply)),
            },
        };
        match self.tx.try_send(cmd) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(BackendError::Overloaded(self.tx.len())),
            Err(TrySendError::Disconnected(_)) => return Err(BackendError::ShuttingDown),
        }
        rx.await.unwrap_or(Err(BackendError::ShuttingDown))
    }
}

/// Reads come straight from memory and redb read transactions, so they never wait for the
/// writer; every mutation goes through the writer and is answered after its commit.
impl Backend for Embedded {
    fn config(&self) -> &EngineConfig {
        Embedded::config(self)
    }

    fn acting_as(&self, actor: Option<Arc<str>>) -> Embedded {
        Embedded::acting_as(self, actor)
    }

    fn metrics(&self) -> &Arc<Metrics> {
        Embedded::metrics(self)
    }

    fn ready(&self) -> bool {
        Embedded::ready(self)
    }

    fn ends(&self) -> Arc<tokio::sync::Notify> {
        self.shared.ends.clone()
    }

    fn begin_drain(&self) {
        Embedded::begin_drain(self)
    }

    fn shutdown(&self) {
        Embedded::shutdown(self)
    }

    async fn open_as(
        &self,
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession, BackendError> {
        Embedded::open_as(self, id, owner, ttl_ms, metadata).await
    }

    async fn heartbeat(&self, id: SessionId, ttl_ms: Option<u64>) -> Result<Beat, BackendError> {
        Embedded::heartbeat(self, id, ttl_ms).await
    }

    async fn end(&self, id: SessionId, reason: EndReason) -> Result<Option<Closed>, BackendError> {
        Embedded::end(self, id, reason).await
    }

    async fn session(&self, id: SessionId) -> Result<Option<SessionInfo>, BackendError> {
        Embedded::session(self, id).await
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

    async fn once(&self, request: Request, op: Mutation) -> Result<Answer, BackendError> {
        Embedded::once(self, request, op).await
    }

    async fn requeue(&self, job: JobId) -> Result<u64, BackendError> {
        Embedded::requeue(self, job).await
    }

    async fn raise_token_floor(&self, floor: u64) -> Result<FloorRaised, BackendError> {
        Embedded::raise_token_floor(self, floor).await
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
