//! The backend seam: the operations every backend implements, each atomic in its backend,
//! and the results and errors they share.
//!
//! Above the seam, for every backend: the HTTP API, the CLI, metrics and configuration. Below
//! it, each backend's own: the authority of state, durability, token allocation, and the
//! clock that judges expiry.
//!
//! - [`embedded`]: in-memory state owned by one writer thread, persisted to redb (fsync)
//!   before each answer; expiry on the node's monotonic clock; one node.
//! - [`postgres`]: the database is the authority, shared by several nodes; each operation
//!   one transaction; expiry on the database clock (`db_now()`); waiting node-local, woken
//!   by `LISTEN`/`NOTIFY`.
//! - [`redis`]: Redis is the authority, shared by several nodes; each operation one Lua
//!   script; expiry on Redis's `TIME`; waiting node-local, woken by pub/sub.
//!
//! # The failure contract
//!
//! Every operation either succeeds, with its effect durable in the backend before it returns,
//! or returns an error. [`BackendError::is_outcome_unknown`] says which errors leave the
//! outcome of a mutation unknown (the request may or may not have been applied: a timeout or
//! a lost connection to a shared database); every other error means nothing happened.
//! Reads never change state, with one exception written into the rules: a reader that finds
//! a session past its deadline may end it, durably, before it answers "gone".

pub mod batch;
pub mod embedded;
pub mod pacing;
pub mod postgres;
pub mod redis;
pub mod requests;
mod settings;
pub mod waiting;

use std::future::Future;
use std::sync::Arc;

use crate::domain::state::FloorRaised;
use crate::domain::{
    EndReason, Event, Finish, InvalidInput, JobId, JobOutcome, JobRecord, JobStatus, LockKey,
    LockRecord, NewJob, PoolName, PoolPut, QueueCounts, QueueName, SeatRecord, SessionId,
    SessionRecord, Token, UnixMs,
};
use crate::metrics::Metrics;
use embedded::store::StoreError;
use requests::{Answer, Mutation, Request};
pub use settings::EngineConfig;

pub type Result<T> = std::result::Result<T, BackendError>;

/// The operations of a backend. Each is atomic in its backend: it happens whole or not at all.
///
/// Waiting (`wait_ms` on acquire, seat and claim) is first come, first served among the
/// requests of one node; `wait_ms` is capped by `max_wait_ms`.
pub trait Backend: Clone + Send + Sync + 'static {
    /// The settings shared above the seam.
    fn config(&self) -> &EngineConfig;
    fn metrics(&self) -> &Arc<Metrics>;
    /// Whether the node should receive traffic: false after a storage failure, while the
    /// shared database is unreachable, and from the start of a shutdown.
    fn ready(&self) -> bool;

    /// A node-local signal that sessions ended: the backend calls `notify_one` after a
    /// commit that ended sessions here (the reaper, an inline reap, an end through this
    /// node) and, on the shared backends, when another node's commit is announced to this
    /// one. It may fire with no end behind it, and a signal can be lost (a broken
    /// subscription), so a consumer re-reads what it follows on its own schedule too. One
    /// consumer per node (the watch hub): a stored permit wakes one waiter.
    fn ends(&self) -> Arc<tokio::sync::Notify>;
    /// Starts a shutdown: readiness turns false, waiting requests are answered
    /// `shutting_down` at once, others are still served.
    fn begin_drain(&self);
    /// Stops the background tasks and releases the backend's resources. Blocking.
    fn shutdown(&self);
    /// The same backend, whose calls name the API token `actor` in the audit events they
    /// write of the kinds an operator's call names (`EventKind::names_actor`); `None` names
    /// nobody. The API takes one for each operator and admin action.
    fn acting_as(&self, actor: Option<Arc<str>>) -> Self;

    /// Opens a session. The id is new and never reused.
    fn open(
        &self,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> impl Future<Output = Result<OpenedSession>> + Send {
        self.open_as(SessionId::random(), owner, ttl_ms, metadata)
    }
    /// Opens a session under an id the caller drew: the API draws ids that carry which
    /// token opened them. The id must be as unguessable as a random one and never used
    /// before.
    fn open_as(
        &self,
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> impl Future<Output = Result<OpenedSession>> + Send;
    /// Extends a live session (and changes its TTL when one is given). `SessionGone` is
    /// terminal: once said for an id it is said forever, and the session's end is durable
    /// before it is said.
    fn heartbeat(
        &self,
        id: SessionId,
        ttl_ms: Option<u64>,
    ) -> impl Future<Output = Result<Beat>> + Send;
    /// Ends a session and releases everything it holds, in one transaction, with one audit
    /// event. `None` when it was unknown or already ended.
    fn end(
        &self,
        id: SessionId,
        reason: EndReason,
    ) -> impl Future<Output = Result<Option<Closed>>> + Send;
    /// A live session and what it holds. `None` when it is gone.
    fn session(&self, id: SessionId) -> impl Future<Output = Result<Option<SessionInfo>>> + Send;
    /// A page of live sessions in id order, and the cursor of the next page.
    fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> impl Future<Output = Result<SessionPage>> + Send;

    /// Takes `key` for session `id`, waiting up to `wait_ms`. A holder past its deadline is
    /// ended in the same transaction. The token is greater than every token acknowledged
    /// before this request arrived.
    fn acquire(
        &self,
        id: SessionId,
        key: LockKey,
        wait_ms: u64,
    ) -> impl Future<Output = Result<Granted>> + Send;
    /// Releases a lock the session holds with this token; returns the revision.
    fn release(
        &self,
        id: SessionId,
        key: LockKey,
        token: Token,
    ) -> impl Future<Output = Result<u64>> + Send;
    fn lock(&self, key: &LockKey) -> impl Future<Output = Result<Option<LockRecord>>> + Send;
    fn locks(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> impl Future<Output = Result<LockPage>> + Send;
    /// May a resource still accept `token` for `key`? Only while it is the token of the
    /// key's present holder and that holder's session is alive.
    fn fence(&self, key: &LockKey, token: Token) -> impl Future<Output = Result<Fence>> + Send;

    /// Creates a pool or changes its capacity (and metadata, when given), reading and writing
    /// in one operation.
    fn put_pool(
        &self,
        name: PoolName,
        capacity: u64,
        metadata: Option<String>,
    ) -> impl Future<Output = Result<PoolPut>> + Send;
    /// Deletes a pool with no seat in use; returns the revision.
    fn delete_pool(&self, name: PoolName) -> impl Future<Output = Result<u64>> + Send;
    fn pool(&self, name: &PoolName) -> impl Future<Output = Result<Option<PoolInfo>>> + Send;
    /// Every pool: name, capacity, seats in use.
    fn pools(&self) -> impl Future<Output = Result<Vec<(String, u32, usize)>>> + Send;
    /// Takes a seat (one per session per pool), waiting up to `wait_ms` when the pool is
    /// full. Asking again returns the seat the session already holds.
    fn acquire_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
    ) -> impl Future<Output = Result<Granted>> + Send;
    fn release_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        token: Token,
    ) -> impl Future<Output = Result<u64>> + Send;

    fn enqueue(&self, job: NewJob) -> impl Future<Output = Result<(JobId, u64)>> + Send;
    /// Claims the oldest queued job, waiting up to `wait_ms`; `None` when none came.
    fn claim(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
    ) -> impl Future<Output = Result<Option<Claimed>>> + Send;
    /// Completes, fails or hands back a claimed job; `StaleToken` for anyone but the current
    /// claim.
    fn finish_job(
        &self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
    ) -> impl Future<Output = Result<u64>> + Send;
    /// Runs `op` once for `request`: the first call acts and remembers its answer in the
    /// same transaction as its change, for `request_id_retention_ms`; a call with the same
    /// key and fingerprint within that window answers the remembered answer and changes
    /// nothing; one with the same key and another fingerprint is
    /// [`BackendError::RequestIdReused`]. Concurrent calls with one key act once. Failures are
    /// not remembered (they changed nothing). See [`requests`].
    fn once(&self, request: Request, op: Mutation) -> impl Future<Output = Result<Answer>> + Send;
    /// Puts a failed job back in its queue (an operator's action).
    fn requeue(&self, job: JobId) -> impl Future<Output = Result<u64>> + Send;
    /// Raises the token floor (an operator's action; `leasehold tokens raise-floor`). Once it
    /// returns `Ok`, every token this backend issues — on any node — is greater than `floor`
    /// and than every token issued before the call, and no token is ever issued twice.
    ///
    /// - The counter only ratchets up: a floor at or below it moves nothing back. The call
    ///   still succeeds and is audited; `FloorRaised::moved` says whether it moved.
    /// - The raise is one mutation: it draws its own revision (above the floor), writes one
    ///   `token_floor_raised` event whose `detail` is
    ///   [`floor_detail`](crate::domain::state::floor_detail), and is durable before
    ///   it returns, like every mutation.
    /// - It is atomic with respect to grants: a grant drawn concurrently either comes before
    ///   the raise (and may be at or below the floor) or after it (and is above it). A backend
    ///   whose counter is not written by one owner must serialise the raise with the draws
    ///   (PostgreSQL: a lock on the sequence; a store with server-side scripts: one script
    ///   that raises and draws).
    /// - A floor above [`MAX_TOKEN_FLOOR`](crate::domain::state::MAX_TOKEN_FLOOR) is [`BackendError::Invalid`] (field `floor`) and
    ///   changes nothing.
    fn raise_token_floor(&self, floor: u64) -> impl Future<Output = Result<FloorRaised>> + Send;
    /// A job and its payload.
    fn job(&self, id: JobId) -> impl Future<Output = Result<Option<(JobRecord, String)>>> + Send;
    fn queue(&self, name: &QueueName) -> impl Future<Output = Result<QueueInfo>> + Send;
    fn queue_jobs(
        &self,
        queue: &QueueName,
        state: &JobStatus,
        after: Option<JobId>,
        limit: usize,
    ) -> impl Future<Output = Result<JobPage>> + Send;

    /// A page of the audit log after sequence number `after`, and the cursor of the next.
    fn events(
        &self,
        after: u64,
        limit: usize,
    ) -> impl Future<Output = Result<(Vec<Event>, Option<u64>)>> + Send;
    /// Ends every session past its deadline now, in bounded batches, each audited once.
    fn reap_now(&self) -> impl Future<Output = Result<ReapOutcome>> + Send;
    /// What a reap now would end, changing nothing.
    fn reap_dry_run(&self, limit: usize) -> impl Future<Output = Result<Vec<DueSession>>> + Send;
    /// The current revision (what a read-only answer reports).
    fn revision(&self) -> impl Future<Output = Result<u64>> + Send;
    /// Checks every invariant of the stored state.
    fn check(&self) -> impl Future<Output = Result<CheckReport>> + Send;
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("the session is gone: it expired, was closed or never existed")]
    SessionGone,
    #[error("the lock is held by another session")]
    LockHeld,
    #[error("the session does not hold this lock or seat with this token")]
    NotHolder,
    #[error("no such pool")]
    PoolNotFound,
    #[error("every seat of the pool is taken ({in_use} in use of {capacity})")]
    PoolExhausted { capacity: u32, in_use: usize },
    #[error("the pool still has {0} seats in use")]
    PoolInUse(usize),
    #[error("no such job")]
    JobNotFound,
    #[error("the token is not the job's current claim")]
    StaleToken,
    #[error("only a failed job can be requeued")]
    JobNotFailed,
    #[error("the session already holds {0} locks, the most one session may hold")]
    TooManyLocks(usize),
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    #[error("this request_id was already used for a different call; use a new id for a new call")]
    RequestIdReused,
    #[error(
        "the store failed; writes, and reads of what lives in memory, are refused until the server restarts"
    )]
    StoreFailed,
    #[error("the server is overloaded: {0} requests are queued for the writer")]
    Overloaded(usize),
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The embedded store refused or failed an operation.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The backend does not do this; the message says what to use instead.
    #[error("{0}")]
    Unsupported(&'static str),
    /// A shared database could not be reached or did not answer in time. For a mutation the
    /// outcome is unknown: it may or may not have been applied.
    #[error("the backend is unavailable: {0}")]
    Unavailable(String),
}

impl BackendError {
    /// True when a mutation that failed this way may nevertheless have been applied.
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, BackendError::Unavailable(_) | BackendError::Store(_))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenedSession {
    pub id: SessionId,
    pub ttl_ms: u64,
    pub expires_at: UnixMs,
    pub revision: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    pub expires_at: UnixMs,
    pub ttl_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed {
    /// Locks released.
    pub released: usize,
    pub seats: usize,
    pub jobs: usize,
    pub revision: u64,
}

impl From<&crate::domain::Ended> for Closed {
    fn from(e: &crate::domain::Ended) -> Closed {
        Closed {
            released: e.released.len(),
            seats: e.seats.len(),
            jobs: e.jobs.len(),
            revision: e.revision,
        }
    }
}

impl Closed {
    /// The `session ended` line, written once the end is durable. The id is logged as its
    /// first eight hex digits, never whole: it is a capability, and 32 of its 122 random
    /// bits are enough to find it in the audit log and far too few to act with.
    pub fn log(&self, id: SessionId, reason: EndReason) {
        tracing::info!(
            session = %id.log_prefix(),
            reason = reason.as_str(),
            locks = self.released,
            seats = self.seats,
            jobs = self.jobs,
            "session ended"
        );
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    pub token: Token,
    pub revision: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReapOutcome {
    pub sessions: usize,
    pub locks: usize,
    pub seats: usize,
    pub jobs: usize,
}

impl std::ops::AddAssign for ReapOutcome {
    fn add_assign(&mut self, pass: ReapOutcome) {
        self.sessions += pass.sessions;
        self.locks += pass.locks;
        self.seats += pass.seats;
        self.jobs += pass.jobs;
    }
}

impl ReapOutcome {
    /// The `reaped expired sessions` line, when anyone was ended: what the reaper ended has
    /// no line a session, so that a storm does not write as many lines as it ends.
    pub fn log(&self) {
        if self.sessions > 0 {
            tracing::info!(
                sessions = self.sessions,
                locks = self.locks,
                seats = self.seats,
                jobs = self.jobs,
                "reaped expired sessions"
            );
        }
    }
}

/// A claimed job, as the claimant is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    pub job: JobId,
    pub token: Token,
    pub attempt: u32,
    pub recovery_count: u32,
    pub kind: String,
    pub revision: u64,
}

/// A seat holder as `GET /v1/pools/{pool}` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeatHolder {
    pub session_id: SessionId,
    pub owner: String,
    pub seat: SeatRecord,
    pub last_heartbeat_at: Option<UnixMs>,
    /// `None` when the holder is past its deadline and about to be reclaimed.
    pub grace: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolInfo {
    pub capacity: u32,
    pub in_use: usize,
    pub waiting: usize,
    pub metadata: String,
    pub created_at: UnixMs,
    pub holders: Vec<SeatHolder>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueInfo {
    pub counts: QueueCounts,
    pub waiting: usize,
}

/// A page of locks in key order, and the cursor of the next page.
pub type LockPage = (Vec<(String, LockRecord)>, Option<String>);

/// A page of jobs in id order, and the cursor of the next page.
pub type JobPage = (Vec<(JobId, JobRecord)>, Option<JobId>);

/// A page of sessions in id order, and the cursor of the next page.
pub type SessionPage = (Vec<SessionInfo>, Option<SessionId>);

/// A session as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub id: SessionId,
    pub record: SessionRecord,
    pub ttl_ms: u64,
    pub expires_at: UnixMs,
    pub last_heartbeat_at: UnixMs,
    pub grace: bool,
    pub locks: Vec<(String, Token)>,
    pub seats: Vec<(String, Token)>,
    pub jobs: Vec<JobId>,
}

/// A session past its deadline, as a dry run reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueSession {
    pub id: SessionId,
    pub expired_at: UnixMs,
    pub locks: Vec<(String, Token)>,
    pub seats: Vec<String>,
    /// Each claimed job and what ending the session would do to it.
    pub jobs: Vec<(JobId, JobOutcome)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub current: bool,
    pub latest: Option<Token>,
}

/// What an integrity check found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CheckReport {
    pub sessions: u64,
    pub locks: u64,
    pub events: u64,
    pub revision: u64,
    /// Every broken invariant, in words; empty when all hold.
    pub problems: Vec<String>,
    /// Where the embedded data file's space goes, a table a row, largest first; empty for
    /// the shared backends (their databases account for their own space).
    pub space: Vec<TableSpace>,
}

/// One table of the embedded data file as redb accounts for it: its pages hold what is
/// stored, the B-tree's own metadata, and free space (leaves split half full).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSpace {
    pub table: String,
    pub rows: u64,
    /// Every page of the table, in bytes: `stored + metadata + free`.
    pub bytes: u64,
    pub stored: u64,
    pub free: u64,
}
