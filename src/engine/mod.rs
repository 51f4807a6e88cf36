//! The engine: the one writer (group commit), the reaper, lock waiters, and the handle the
//! API calls.
//!
//! Mutations go to the writer thread through a bounded channel and are answered only after
//! the batch that applied them has been committed with fsync. Plain heartbeats touch only
//! memory (the deadline lives on the monotonic clock) and never wait for the writer. Reads
//! come from redb read transactions, so they see only what has been committed, plus the
//! in-memory deadlines for liveness.

mod reaper;
mod waiters;
mod writer;

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Sender, TrySendError};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::domain::state::RestoreError;
use crate::domain::time::to_wall;
use crate::domain::{
    EndReason, Event, InvalidInput, Limits, LockKey, LockRecord, Mono, SessionId, SessionRecord,
    SessionView, State, Token, UnixMs,
};
use crate::metrics::Metrics;
use crate::store::{Store, StoreError};
use writer::Command;

/// The engine's settings, taken from the validated configuration.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub limits: Limits,
    pub max_wait_ms: u64,
    pub reaper_enabled: bool,
    pub reaper_interval_ms: u64,
    pub reaper_batch: usize,
    pub event_retention_ms: u64,
    pub event_trim_batch: usize,
    pub max_batch: usize,
    pub queue_capacity: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            limits: Limits::default(),
            max_wait_ms: 60_000,
            reaper_enabled: true,
            reaper_interval_ms: 1_000,
            reaper_batch: 10_000,
            event_retention_ms: 7 * 24 * 3_600_000,
            event_trim_batch: 10_000,
            max_batch: 4_096,
            queue_capacity: 65_536,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the session is gone: it expired, was closed or never existed")]
    SessionGone,
    #[error("the lock is held by another session")]
    LockHeld,
    #[error("the session does not hold this lock with this token")]
    NotHolder,
    #[error("the session already holds {0} locks, the most one session may hold")]
    TooManyLocks(usize),
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    #[error("the store failed; writes are refused until the server restarts")]
    StoreFailed,
    #[error("the server is overloaded: {0} requests are queued for the writer")]
    Overloaded(usize),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the data file is inconsistent ({0}); run `leasehold check` for a full report")]
    Inconsistent(#[from] RestoreError),
    #[error("cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
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
    pub released: usize,
    pub revision: u64,
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
}

/// A page of locks in key order, and the cursor of the next page.
pub type LockPage = (Vec<(String, LockRecord)>, Option<String>);

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
}

/// A session past its deadline, as a dry run reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueSession {
    pub id: SessionId,
    pub expired_at: UnixMs,
    pub locks: Vec<(String, Token)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub current: bool,
    pub latest: Option<Token>,
}

pub(crate) struct Shared {
    pub config: EngineConfig,
    pub state: Mutex<State>,
    pub store: Store,
    pub clock: Arc<dyn Clock>,
    pub metrics: Arc<Metrics>,
}

struct Threads {
    writer: Option<JoinHandle<()>>,
    reaper: Option<reaper::ReaperHandle>,
}

/// The handle the API calls. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
    tx: Sender<Command>,
    threads: Arc<Mutex<Threads>>,
}

impl Engine {
    /// Loads the state from `store`, gives every live session the restart grace, and starts
    /// the writer and the reaper.
    pub fn start(
        config: EngineConfig,
        store: Store,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Result<Engine, StartError> {
        let restore = store.load()?;
        let state = State::restore(config.limits, restore, clock.now())?;
        metrics.sessions_active.set(state.session_count() as i64);
        metrics.locks_held.set(state.lock_count() as i64);
        let (tx, rx) = crossbeam_channel::bounded(config.queue_capacity);
        let shared = Arc::new(Shared {
            config,
            state: Mutex::new(state),
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
        Ok(Engine {
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

    /// False once the store has failed (fail-stop) or the engine is stopping.
    pub fn ready(&self) -> bool {
        !self.shared.store.failed() && self.threads.lock().writer.is_some()
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, EngineError>>) -> Command,
    ) -> Result<T, EngineError> {
        if self.shared.store.failed() {
            return Err(EngineError::StoreFailed);
        }
        let (reply, rx) = oneshot::channel();
        match self.tx.try_send(make(reply)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(EngineError::Overloaded(self.tx.len())),
            Err(TrySendError::Disconnected(_)) => return Err(EngineError::ShuttingDown),
        }
        rx.await.unwrap_or(Err(EngineError::ShuttingDown))
    }

    pub async fn open(
        &self,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession, EngineError> {
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
    pub async fn heartbeat(&self, id: SessionId, ttl_ms: Option<u64>) -> Result<Beat, EngineError> {
        if ttl_ms.is_some() {
            return self
                .call(|reply| Command::Heartbeat { id, ttl_ms, reply })
                .await;
        }
        if self.shared.store.failed() {
            return Err(EngineError::StoreFailed);
        }
        let now = self.shared.clock.now();
        let beat = self
            .shared
            .state
            .lock()
            .heartbeat(id, None, now, &mut Vec::new());
        match beat {
            Ok(b) => {
                self.shared.metrics.heartbeats.inc();
                Ok(Beat {
                    expires_at: to_wall(b.deadline, now, self.shared.clock.wall()),
                    ttl_ms: b.ttl_ms,
                })
            }
            Err(_) => Err(EngineError::SessionGone),
        }
    }

    /// Ends a session and everything it holds. `None` when it was unknown or already ended.
    pub async fn end(
        &self,
        id: SessionId,
        reason: EndReason,
    ) -> Result<Option<Closed>, EngineError> {
        self.call(|reply| Command::End { id, reason, reply }).await
    }

    /// Takes `key` for session `id`, waiting up to `wait_ms` (capped by `max_wait_ms`) in
    /// first-come, first-served order behind other waiters.
    pub async fn acquire(
        &self,
        id: SessionId,
        key: LockKey,
        wait_ms: u64,
    ) -> Result<Granted, EngineError> {
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
    ) -> Result<u64, EngineError> {
        self.call(|reply| Command::Release {
            id,
            key,
            token,
            reply,
        })
        .await
    }

    /// Runs reaper passes now until no session is due.
    pub async fn reap_now(&self) -> Result<ReapOutcome, EngineError> {
        let mut total = ReapOutcome::default();
        loop {
            let limit = self.shared.config.reaper_batch;
            let pass = self.call(|reply| Command::Reap { limit, reply }).await?;
            total.sessions += pass.sessions;
            total.locks += pass.locks;
            if pass.sessions < limit {
                return Ok(total);
            }
        }
    }

    /// What a reap now would end, changing nothing.
    pub fn reap_dry_run(&self, limit: usize) -> Vec<DueSession> {
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let due = self.shared.state.lock().due(now, limit);
        due.into_iter()
            .map(|v| DueSession {
                id: v.id,
                expired_at: to_wall(v.deadline, now, wall),
                locks: v
                    .locks
                    .into_iter()
                    .map(|(k, t)| (k.to_string(), t))
                    .collect(),
            })
            .collect()
    }

    fn live(&self, id: SessionId, now: Mono) -> Option<SessionView> {
        self.shared.state.lock().session(id, now)
    }

    fn info(
        &self,
        view: SessionView,
        record: SessionRecord,
        now: Mono,
        wall: UnixMs,
    ) -> Result<SessionInfo, EngineError> {
        let locks = self
            .shared
            .store
            .session_locks(view.id)?
            .into_iter()
            .map(|(k, r)| (k, r.token))
            .collect();
        Ok(SessionInfo {
            id: view.id,
            ttl_ms: view.ttl_ms,
            expires_at: to_wall(view.deadline, now, wall),
            last_heartbeat_at: to_wall(view.last_heartbeat(), now, wall),
            grace: view.in_grace(now),
            record,
            locks,
        })
    }

    /// A live session, as committed. `None` when it is gone.
    pub fn session(&self, id: SessionId) -> Result<Option<SessionInfo>, EngineError> {
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let Some(view) = self.live(id, now) else {
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
    ) -> Result<(Vec<SessionInfo>, Option<SessionId>), EngineError> {
        let rows = self.shared.store.sessions(owner, after, limit)?;
        let next = (rows.len() == limit)
            .then(|| rows.last().map(|(id, _)| *id))
            .flatten();
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

    pub fn lock(&self, key: &LockKey) -> Result<Option<LockRecord>, EngineError> {
        Ok(self.shared.store.lock(key.as_str())?)
    }

    pub fn locks(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, EngineError> {
        let rows = self.shared.store.locks(prefix, after, limit)?;
        let next = (rows.len() == limit)
            .then(|| rows.last().map(|(k, _)| k.clone()))
            .flatten();
        Ok((rows, next))
    }

    /// May a resource still accept `token` for `key`? Only while it is the token of the key's
    /// present holder and that holder's session is alive.
    pub fn fence(&self, key: &LockKey, token: Token) -> Result<Fence, EngineError> {
        let Some(lock) = self.shared.store.lock(key.as_str())? else {
            return Ok(Fence {
                current: false,
                latest: None,
            });
        };
        let live = self
            .live(lock.session_id, self.shared.clock.now())
            .is_some();
        Ok(Fence {
            current: live && lock.token == token,
            latest: Some(lock.token),
        })
    }

    pub fn events(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<Event>, Option<u64>), EngineError> {
        let events = self.shared.store.events(after, limit)?;
        let next = events.last().map(|e| e.seq);
        Ok((events, next))
    }

    /// The current revision (what a read-only answer reports).
    pub fn revision(&self) -> u64 {
        self.shared.state.lock().revision()
    }
}
