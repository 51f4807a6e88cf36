//! [`Engine`]: the one handle the API and the CLI call, which hands each operation to the
//! configured backend. It knows the backends; none of them knows it.

use std::sync::Arc;

use crate::backend::BackendError;
pub use crate::backend::EngineConfig;
use crate::backend::embedded::Embedded;
use crate::backend::embedded::store::backup::BackupFile;
use crate::backend::postgres::Postgres;
use crate::backend::redis::Redis;
use crate::backend::requests::{Answer, Mutation, Request};
use crate::backend::{
    Backend, Beat, CheckReport, Claimed, Closed, DueSession, Fence, Granted, JobPage, LockPage,
    OpenedSession, PoolInfo, QueueInfo, ReapOutcome, Result, SessionInfo, SessionPage,
};
use crate::domain::state::FloorRaised;
use crate::domain::{
    EndReason, Event, Finish, JobId, JobRecord, JobStatus, LockKey, LockRecord, NewJob, PoolName,
    PoolPut, QueueName, SessionId, Token,
};
use crate::metrics::Metrics;

/// The handle the API calls: the configured backend. Cheap to clone. An enum rather than a
/// trait object, so that a call on the embedded backend costs a branch, not an allocation
/// (the shared backends' calls box their futures: see `each_await!`).
#[derive(Clone)]
pub enum Engine {
    Embedded(Embedded),
    Postgres(Postgres),
    Redis(Redis),
}

/// Runs `$call` on whichever backend `$engine` holds.
macro_rules! each {
    ($engine:expr, $b:ident => $call:expr) => {
        match $engine {
            Engine::Embedded($b) => $call,
            Engine::Postgres($b) => $call,
            Engine::Redis($b) => $call,
        }
    };
}

/// Awaits `$call`'s future on whichever backend `$engine` holds. The shared backends'
/// futures are boxed: inline, every request's future, the embedded backend's included,
/// would be as large as the largest of theirs, and hyper copies it as each request starts;
/// a box costs them one allocation beside a network round trip.
macro_rules! each_await {
    ($engine:expr, $b:ident => $call:expr) => {
        match $engine {
            Engine::Embedded($b) => $call.await,
            Engine::Postgres($b) => Box::pin($call).await,
            Engine::Redis($b) => Box::pin($call).await,
        }
    };
}

impl From<Embedded> for Engine {
    fn from(b: Embedded) -> Engine {
        Engine::Embedded(b)
    }
}

impl From<Postgres> for Engine {
    fn from(b: Postgres) -> Engine {
        Engine::Postgres(b)
    }
}

impl From<Redis> for Engine {
    fn from(b: Redis) -> Engine {
        Engine::Redis(b)
    }
}

impl Engine {
    pub fn config(&self) -> &EngineConfig {
        each!(self, b => b.config())
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        each!(self, b => b.metrics())
    }

    pub fn ready(&self) -> bool {
        each!(self, b => b.ready())
    }

    /// The backend's signal that sessions ended (`Backend::ends`).
    pub fn ends(&self) -> Arc<tokio::sync::Notify> {
        each!(self, b => b.ends())
    }

    pub fn begin_drain(&self) {
        each!(self, b => b.begin_drain())
    }

    pub fn shutdown(&self) {
        each!(self, b => b.shutdown())
    }

    /// The same engine acting for the API token `actor`: the audit events its operator
    /// calls write name it (see `EventKind::names_actor`).
    pub fn acting_as(&self, actor: Option<Arc<str>>) -> Engine {
        each!(self, b => Backend::acting_as(b, actor).into())
    }

    pub async fn open(
        &self,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession> {
        each_await!(self, b => Backend::open(b, owner, ttl_ms, metadata))
    }

    /// Opens a session under an id the caller drew (see [`Backend::open_as`]).
    pub async fn open_as(
        &self,
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession> {
        each_await!(self, b => Backend::open_as(b, id, owner, ttl_ms, metadata))
    }

    pub async fn heartbeat(&self, id: SessionId, ttl_ms: Option<u64>) -> Result<Beat> {
        each_await!(self, b => Backend::heartbeat(b, id, ttl_ms))
    }

    pub async fn end(&self, id: SessionId, reason: EndReason) -> Result<Option<Closed>> {
        each_await!(self, b => Backend::end(b, id, reason))
    }

    pub async fn session(&self, id: SessionId) -> Result<Option<SessionInfo>> {
        each_await!(self, b => Backend::session(b, id))
    }

    pub async fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> Result<SessionPage> {
        each_await!(self, b => Backend::sessions(b, owner, after, limit))
    }

    pub async fn acquire(&self, id: SessionId, key: LockKey, wait_ms: u64) -> Result<Granted> {
        each_await!(self, b => Backend::acquire(b, id, key, wait_ms))
    }

    pub async fn release(&self, id: SessionId, key: LockKey, token: Token) -> Result<u64> {
        each_await!(self, b => Backend::release(b, id, key, token))
    }

    pub async fn lock(&self, key: &LockKey) -> Result<Option<LockRecord>> {
        each_await!(self, b => Backend::lock(b, key))
    }

    pub async fn locks(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LockPage> {
        each_await!(self, b => Backend::locks(b, prefix, after, limit))
    }

    pub async fn fence(&self, key: &LockKey, token: Token) -> Result<Fence> {
        each_await!(self, b => Backend::fence(b, key, token))
    }

    pub async fn put_pool(
        &self,
        name: PoolName,
        capacity: u64,
        metadata: Option<String>,
    ) -> Result<PoolPut> {
        each_await!(self, b => Backend::put_pool(b, name, capacity, metadata))
    }

    pub async fn delete_pool(&self, name: PoolName) -> Result<u64> {
        each_await!(self, b => Backend::delete_pool(b, name))
    }

    pub async fn pool(&self, name: &PoolName) -> Result<Option<PoolInfo>> {
        each_await!(self, b => Backend::pool(b, name))
    }

    pub async fn pools(&self) -> Result<Vec<(String, u32, usize)>> {
        each_await!(self, b => Backend::pools(b))
    }

    pub async fn acquire_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
    ) -> Result<Granted> {
        each_await!(self, b => Backend::acquire_seat(b, id, pool, metadata, wait_ms))
    }

    pub async fn release_seat(&self, id: SessionId, pool: PoolName, token: Token) -> Result<u64> {
        each_await!(self, b => Backend::release_seat(b, id, pool, token))
    }

    pub async fn enqueue(&self, job: NewJob) -> Result<(JobId, u64)> {
        each_await!(self, b => Backend::enqueue(b, job))
    }

    pub async fn claim(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
    ) -> Result<Option<Claimed>> {
        each_await!(self, b => Backend::claim(b, id, queue, wait_ms))
    }

    pub async fn finish_job(
        &self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
    ) -> Result<u64> {
        each_await!(self, b => Backend::finish_job(b, id, job, token, finish))
    }

    /// Runs a mutation once for its `request_id` (see [`Backend::once`]).
    pub async fn once(&self, request: Request, op: Mutation) -> Result<Answer> {
        each_await!(self, b => Backend::once(b, request, op))
    }

    pub async fn requeue(&self, job: JobId) -> Result<u64> {
        each_await!(self, b => Backend::requeue(b, job))
    }

    /// A backup of the embedded store; other backends are backed up by their database's own
    /// tools.
    pub async fn backup(&self) -> Result<BackupFile> {
        match self {
            Engine::Embedded(b) => b.backup().await,
            #[allow(unreachable_patterns)]
            _ => Err(BackendError::Unsupported(
                "leasehold backup is for the embedded backend; back up this backend's database \
                 with its own tools (PostgreSQL: pg_dump or a base backup with WAL archiving), \
                 and after restoring it raise the token floor with `leasehold tokens \
                 raise-floor` (see the operations guide)",
            )),
        }
    }

    pub async fn raise_token_floor(&self, floor: u64) -> Result<FloorRaised> {
        each_await!(self, b => Backend::raise_token_floor(b, floor))
    }

    pub async fn job(&self, id: JobId) -> Result<Option<(JobRecord, String)>> {
        each_await!(self, b => Backend::job(b, id))
    }

    pub async fn queue(&self, name: &QueueName) -> Result<QueueInfo> {
        each_await!(self, b => Backend::queue(b, name))
    }

    pub async fn queue_jobs(
        &self,
        queue: &QueueName,
        state: &JobStatus,
        after: Option<JobId>,
        limit: usize,
    ) -> Result<JobPage> {
        each_await!(self, b => Backend::queue_jobs(b, queue, state, after, limit))
    }

    pub async fn events(&self, after: u64, limit: usize) -> Result<(Vec<Event>, Option<u64>)> {
        each_await!(self, b => Backend::events(b, after, limit))
    }

    pub async fn reap_now(&self) -> Result<ReapOutcome> {
        each_await!(self, b => Backend::reap_now(b))
    }

    pub async fn reap_dry_run(&self, limit: usize) -> Result<Vec<DueSession>> {
        each_await!(self, b => Backend::reap_dry_run(b, limit))
    }

    pub async fn revision(&self) -> Result<u64> {
        each_await!(self, b => Backend::revision(b))
    }

    pub async fn check(&self) -> Result<CheckReport> {
        each_await!(self, b => Backend::check(b))
    }
}
