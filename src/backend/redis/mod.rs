//! The Redis backend: several Leasehold nodes share one Redis, and Redis is the authority.
//! Every operation is one call of one Lua function (`leasehold.lua`, a library of Redis
//! Functions loaded with `FUNCTION LOAD` and called with `FCALL`, loaded again whenever Redis
//! says it is missing), so each is atomic; nothing about
//! sessions, grants or jobs is kept in a node's memory except who waits here. Requests that
//! arrive while Redis is busy with this node's earlier ones go to it together, one `FCALL`
//! for many operations, each still run whole and alone (`calls`).
//!
//! # Rules
//!
//! - **One clock.** Expiry is judged, and every time stamped, on Redis's `TIME` read inside
//!   the script, so every node agrees. The node's own [`Clock`] judges only how long a
//!   request waits. Tests pin the script's clock with the key `{namespace}:!clock` (see the
//!   script); nothing but a test harness may set it.
//! - **No resurrection.** A session is written whole only by `open`; a heartbeat of a
//!   session past its deadline ends it and says `session_gone`.
//! - **The end is one script.** Close, expiry, an operator, or a contender finding a holder
//!   past its deadline: the session's holdings (a hash of locks, one of seats, a set of
//!   jobs) are released and settled, its events written and its keys deleted in the script
//!   of the operation that ends it.
//! - **Tokens.** The revision counter is one `INCR` key; a grant's token is the revision its
//!   script drew. Scripts run one at a time, so tokens follow the order grants happen in.
//! - **Durability is Redis's.** A node reads `appendonly` and `appendfsync` at start and
//!   refuses a Redis that is not crash-durable unless `redis_allow_volatile` is set (see
//!   [`Durability`]).
//! - **Waking waiters.** Scripts that free a key, a seat or a job publish on
//!   `{namespace}:!free`, one message a call naming all it freed; each node subscribes and
//!   wakes its own waiters, and the head of a line asks again at least every second should a
//!   message be lost.
//!
//! Standalone Redis (or one primary with replicas) only: the script reads keys it learns
//! as it runs, which Redis Cluster does not allow.

mod calls;
mod durability;

use crate::backend::requests::{Answer, Mutation, Request};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::backend::pacing::PassSizer;
use crate::backend::waiting::{Resource, Step, Waiting};
use crate::backend::{
    Backend, BackendError, Beat, CheckReport, Claimed, Closed, DueSession, EngineConfig, Fence,
    Granted, JobPage, LockPage, OpenedSession, PoolInfo, QueueInfo, ReapOutcome, Result,
    SeatHolder, SessionInfo, SessionPage,
};
use crate::clock::Clock;

/// The highest floor the Redis backend takes (see `raise_token_floor`).
const REDIS_MAX_TOKEN_FLOOR: u64 = 10_000_000_000_000;
use crate::domain::jobs::{REASON_MAX_RECOVERIES, REASON_NOT_IDEMPOTENT};
use crate::domain::pools::MAX_CAPACITY;
use crate::domain::state::{FloorRaised, validate_token_floor};
use crate::domain::{
    EndReason, Event, EventKind, Finish, InvalidInput, JobId, JobOutcome, JobRecord, JobStatus,
    LockKey, LockRecord, Mono, NewJob, PoolName, PoolPut, QueueCounts, QueueName, ReleasedLock,
    SeatRecord, SessionId, SessionRecord, Token, UnixMs,
};
use crate::metrics::{EndCounts, Metrics, PoolLabel, QueueStateLabels, ReasonLabel};
use calls::{Calls, LIBRARY};
pub use durability::Durability;

/// How often the head of a line asks again when no message came.
const RECHECK: Duration = Duration::from_secs(1);
/// How often the background probes Redis and (every fifth time) refreshes the gauges.
const HOUSEKEEPING: Duration = Duration::from_secs(1);

/// How to reach Redis, and under which key prefix.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    pub url: String,
    pub namespace: String,
    /// Start against a Redis that is not crash-durable (with a warning and a metric).
    pub allow_volatile: bool,
    /// Longest one call may take before it is answered `backend_unavailable`.
    pub timeout_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("redis_url {0} is not a valid Redis URL: {1}")]
    BadUrl(String, String),
    #[error(
        "Redis at {url} is not crash-durable: {found}. Acknowledged grants can be lost when Redis crashes{tokens}. \
         Configure Redis with `appendonly yes` and `appendfsync always`, or set redis_allow_volatile = true to run anyway"
    )]
    Volatile {
        url: String,
        found: String,
        tokens: &'static str,
    },
}

/// A Redis URL with its password, if any, replaced by `***`.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme + 3 => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

struct Inner {
    config: EngineConfig,
    metrics: Arc<Metrics>,
    clock: Arc<dyn Clock>,
    namespace: String,
    url: String,
    client: ::redis::Client,
    conn: ConnectionManager,
    /// Every operation's way to Redis, over `conn`.
    calls: Calls,
    /// Names this node as the holder of the reaper lock.
    node: String,
    waiting: Waiting,
    /// `Backend::ends`: fired after this node's reaper ended sessions and on every message
    /// of the subscription (another node's commit may have ended sessions).
    ends: Arc<tokio::sync::Notify>,
    /// The durability check has passed (or was waived) against the Redis reached.
    checked: AtomicBool,
    /// The last call reached Redis.
    ok: AtomicBool,
    draining: AtomicBool,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    gauge_pools: Mutex<Vec<String>>,
    gauge_queues: Mutex<Vec<String>>,
    /// Sessions were ended in numbers too large to move the gauges one by one.
    gauges_stale: AtomicBool,
}

/// The Redis backend's handle. Cheap to clone.
#[derive(Clone)]
pub struct Redis {
    inner: Arc<Inner>,
    /// The token this handle's calls act for (see `Backend::acting_as`), handed to the script
    /// with the operation.
    actor: Option<Arc<str>>,
}

/// An empty Lua table is encoded as `{}`: read it as an empty list.
fn list<'de, D, T>(d: D) -> std::result::Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either<T> {
        List(Vec<T>),
        Empty {},
    }
    Ok(match Option::<Either<T>>::deserialize(d)? {
        Some(Either::List(v)) => v,
        _ => Vec::new(),
    })
}

/// What one script's end of sessions ended and freed.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct Ended {
    /// Sessions ended: closed, expired, by an operator.
    by: [u64; 3],
    revision: u64,
    locks: usize,
    seats: usize,
    recovered: usize,
    #[serde(deserialize_with = "list")]
    failed: Vec<String>,
    /// Whether what was freed is listed; false when too much was freed to list.
    listed: bool,
    #[serde(deserialize_with = "list")]
    keys: Vec<String>,
    #[serde(deserialize_with = "list")]
    pools: Vec<String>,
    #[serde(deserialize_with = "list")]
    recovered_q: Vec<String>,
    #[serde(deserialize_with = "list")]
    failed_q: Vec<String>,
}

impl Ended {
    fn sessions(&self) -> usize {
        self.by.iter().sum::<u64>() as usize
    }

    fn closed(&self) -> Option<Closed> {
        (self.sessions() > 0).then(|| Closed {
            released: self.locks,
            seats: self.seats,
            jobs: self.recovered + self.failed.len(),
            revision: self.revision,
        })
    }
}

/// The common part of every answer: an error code, and what the script ended on the way.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Base {
    err: Option<String>,
    n: Option<usize>,
    ended: Option<Ended>,
}

#[derive(Debug, Deserialize)]
struct SessionOut {
    id: String,
    owner: String,
    metadata: String,
    ttl: u64,
    created_at: u64,
    expires_at: u64,
    last_heartbeat_at: u64,
    live: bool,
    grace: bool,
    #[serde(deserialize_with = "list")]
    locks: Vec<(String, u64)>,
    #[serde(deserialize_with = "list")]
    seats: Vec<(String, u64)>,
    #[serde(deserialize_with = "list")]
    jobs: Vec<String>,
}

impl SessionOut {
    fn info(self) -> Result<(bool, SessionInfo)> {
        Ok((
            self.live,
            SessionInfo {
                id: session_id(&self.id)?,
                record: SessionRecord {
                    owner: self.owner,
                    ttl_ms: self.ttl,
                    created_at: UnixMs(self.created_at),
                    metadata: self.metadata,
                },
                ttl_ms: self.ttl,
                expires_at: UnixMs(self.expires_at),
                last_heartbeat_at: UnixMs(self.last_heartbeat_at),
                grace: self.grace,
                locks: self.locks.into_iter().map(|(k, t)| (k, Token(t))).collect(),
                seats: self.seats.into_iter().map(|(p, t)| (p, Token(t))).collect(),
                jobs: self.jobs.iter().map(|j| job_id(j)).collect::<Result<_>>()?,
            },
        ))
    }
}

#[derive(Debug, Deserialize)]
struct LockOut {
    sid: String,
    token: u64,
    at: u64,
    #[serde(default)]
    key: String,
}

impl LockOut {
    fn record(&self) -> Result<LockRecord> {
        Ok(LockRecord {
            session_id: session_id(&self.sid)?,
            token: Token(self.token),
            acquired_at: UnixMs(self.at),
        })
    }
}

#[derive(Debug, Deserialize)]
struct JobOut {
    id: String,
    queue: String,
    kind: String,
    idem: bool,
    maxr: u32,
    rc: u32,
    att: u32,
    ord: i64,
    st: String,
    #[serde(default)]
    res: String,
    #[serde(default)]
    rsn: String,
    enq: u64,
    upd: u64,
    cs: Option<String>,
    tok: Option<u64>,
    ca: Option<u64>,
    payload: Option<String>,
}

impl JobOut {
    fn record(&self) -> Result<(JobId, JobRecord)> {
        let status = match self.st.as_str() {
            "queued" => JobStatus::Queued,
            "claimed" => JobStatus::Claimed {
                session_id: session_id(self.cs.as_deref().unwrap_or_default())?,
                token: Token(self.tok.unwrap_or_default()),
                claimed_at: UnixMs(self.ca.unwrap_or_default()),
            },
            "done" => JobStatus::Done {
                result: self.res.clone(),
            },
            _ => JobStatus::Failed {
                reason: self.rsn.clone(),
            },
        };
        Ok((
            job_id(&self.id)?,
            JobRecord {
                queue: self.queue.clone(),
                kind: self.kind.clone(),
                idempotent: self.idem,
                max_recoveries: self.maxr,
                recovery_count: self.rc,
                attempt: self.att,
                order: self.ord,
                status,
                enqueued_at: UnixMs(self.enq),
                updated_at: UnixMs(self.upd),
            },
        ))
    }
}

/// One audit event as the script stores it.
#[derive(Debug, Deserialize)]
struct EventOut {
    seq: u64,
    at: u64,
    kind: String,
    sid: Option<String>,
    key: Option<String>,
    token: Option<u64>,
    reason: Option<String>,
    owner: Option<String>,
    #[serde(default, deserialize_with = "list")]
    rk: Vec<String>,
    #[serde(default, deserialize_with = "list")]
    rt: Vec<u64>,
    pool: Option<String>,
    queue: Option<String>,
    job: Option<String>,
    detail: Option<String>,
    actor: Option<String>,
}

fn session_id(text: &str) -> Result<SessionId> {
    SessionId::parse("session_id", text).map_err(|_| {
        BackendError::Unavailable(format!("Redis holds a malformed session id {text:?}"))
    })
}

fn job_id(text: &str) -> Result<JobId> {
    JobId::parse("job_id", text)
        .map_err(|_| BackendError::Unavailable(format!("Redis holds a malformed job id {text:?}")))
}

impl EventOut {
    fn event(self) -> Option<Event> {
        let Some(kind) = EventKind::from_name(&self.kind) else {
            tracing::warn!(kind = %self.kind, "skipping an event of unknown kind");
            return None;
        };
        let mut e = Event::new(self.seq, UnixMs(self.at), kind);
        e.session_id = self
            .sid
            .as_deref()
            .and_then(|s| SessionId::parse("session_id", s).ok());
        e.key = self.key;
        e.token = self.token.map(Token);
        e.reason = self.reason.as_deref().and_then(EndReason::from_name);
        e.owner = self.owner;
        e.released = self
            .rk
            .into_iter()
            .zip(self.rt)
            .map(|(key, t)| ReleasedLock {
                key,
                token: Token(t),
            })
            .collect();
        e.pool = self.pool;
        e.queue = self.queue;
        e.job_id = self
            .job
            .as_deref()
            .and_then(|j| JobId::parse("job_id", j).ok());
        e.detail = self.detail;
        e.actor = self.actor;
        Some(e)
    }
}

/// Arguments of one script call after the namespace and the operation.
type Args = Vec<String>;

macro_rules! args {
    ($($a:expr),* $(,)?) => { vec![$($a.to_string()),*] };
}

impl Redis {
    /// Connects, checks Redis's durability and starts the background tasks. A Redis that
    /// cannot be reached is not an error: the node starts unready and keeps trying, and
    /// checks durability once it is reached. A Redis reached and found volatile, without
    /// `allow_volatile`, is.
    pub async fn start(
        config: EngineConfig,
        settings: RedisSettings,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> std::result::Result<Redis, StartError> {
        let url = redact(&settings.url);
        let client = ::redis::Client::open(settings.url.as_str())
            .map_err(|e| StartError::BadUrl(url.clone(), e.to_string()))?;
        let timeout = Duration::from_millis(settings.timeout_ms.max(100));
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1).min(timeout)))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), manager)
            .map_err(|e| StartError::BadUrl(url.clone(), e.to_string()))?;
        let waiting = Waiting::new(clock.clone(), RECHECK, metrics.waiters.clone());
        let r = Redis {
            inner: Arc::new(Inner {
                config,
                metrics,
                clock,
                namespace: settings.namespace.clone(),
                url,
                client,
                calls: Calls::start(conn.clone(), settings.namespace.clone()),
                conn,
                node: uuid::Uuid::new_v4().simple().to_string(),
                waiting,
                ends: Arc::new(tokio::sync::Notify::new()),
                checked: AtomicBool::new(false),
                ok: AtomicBool::new(false),
                draining: AtomicBool::new(false),
                stop: watch::channel(false).0,
                tasks: Mutex::new(Vec::new()),
                gauge_pools: Mutex::new(Vec::new()),
                gauge_queues: Mutex::new(Vec::new()),
                gauges_stale: AtomicBool::new(false),
            }),
            actor: None,
        };
        match r.bootstrap(settings.allow_volatile).await {
            Ok(()) => {}
            Err(Bootstrap::Refused(e)) => return Err(e),
            Err(Bootstrap::Unreachable(e)) => {
                tracing::warn!(
                    url = %r.inner.url,
                    error = %e,
                    "cannot reach Redis; not ready, retrying in the background"
                );
                let again = r.clone();
                let allow = settings.allow_volatile;
                let task = tokio::spawn(async move { again.bootstrap_until_ready(allow).await });
                r.inner.tasks.lock().push(task);
            }
        }
        Ok(r)
    }

    /// Checks durability and loads the script; on success the node is ready and its tasks
    /// run.
    async fn bootstrap(&self, allow_volatile: bool) -> std::result::Result<(), Bootstrap> {
        let mut conn = self.inner.conn.clone();
        let found = Durability::read(&mut conn)
            .await
            .map_err(|e| Bootstrap::Unreachable(e.to_string()))?;
        self.inner.metrics.set_backend_durability(found.class());
        if !found.crash_durable() {
            if !allow_volatile {
                return Err(Bootstrap::Refused(StartError::Volatile {
                    url: self.inner.url.clone(),
                    found: found.describe(),
                    tokens: if found.append_only() {
                        ""
                    } else {
                        ", and without append-only persistence tokens can go backwards after a Redis restart"
                    },
                }));
            }
            tracing::warn!(
                url = %self.inner.url,
                durability = found.class(),
                "Redis is not crash-durable ({}); running because redis_allow_volatile = true: \
                 acknowledged grants can be lost when Redis crashes",
                found.describe()
            );
        }
        LIBRARY
            .load(&mut conn)
            .await
            .map_err(|e| Bootstrap::Unreachable(e.to_string()))?;
        self.inner.checked.store(true, Ordering::SeqCst);
        self.inner.ok.store(true, Ordering::SeqCst);
        tracing::info!(
            url = %self.inner.url,
            namespace = %self.inner.namespace,
            durability = found.class(),
            "Redis is ready"
        );
        if let Err(e) = self.refresh_gauges().await {
            tracing::debug!(error = %e, "cannot refresh the gauges");
        }
        self.start_tasks();
        Ok(())
    }

    async fn bootstrap_until_ready(self, allow_volatile: bool) {
        let mut stop = self.inner.stop.subscribe();
        let mut backoff = Duration::from_millis(250);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.changed() => return,
            }
            match self.bootstrap(allow_volatile).await {
                Ok(()) => return,
                Err(Bootstrap::Unreachable(e)) => {
                    tracing::warn!(url = %self.inner.url, error = %e, "Redis still unreachable");
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(Bootstrap::Refused(e)) => {
                    // Stays unready: this node must not serve against a Redis that can lose
                    // what it acknowledges, unless told it may.
                    tracing::error!(error = %e, "refusing to serve");
                    return;
                }
            }
        }
    }

    fn start_tasks(&self) {
        let mut tasks = Vec::new();
        if self.inner.config.reaper_enabled {
            tasks.push(tokio::spawn(self.clone().reaper()));
        }
        tasks.push(tokio::spawn(self.clone().listen()));
        tasks.push(tokio::spawn(self.clone().housekeeping()));
        self.inner.tasks.lock().extend(tasks);
    }

    /// Runs one operation of the script and decodes its answer. Never retried: a mutation
    /// that failed in transit may have been applied (`Unavailable` says so).
    async fn call<T: DeserializeOwned>(&self, op: &str, args: Args) -> Result<T> {
        if !self.inner.checked.load(Ordering::SeqCst) {
            return Err(BackendError::Unavailable(format!(
                "Redis at {} has not been reached yet, or its durability was refused",
                self.inner.url
            )));
        }
        // The operation, and after a space the acting token's name (token names have no
        // spaces): the script names it in the operator events it writes.
        let op = match &self.actor {
            None => std::borrow::Cow::Borrowed(op),
            Some(actor) => std::borrow::Cow::Owned(format!("{op} {actor}")),
        };
        let text = match self.inner.calls.call(&op, args).await {
            Ok(t) => t,
            Err(e) => return Err(self.failed(e)),
        };
        self.inner.ok.store(true, Ordering::SeqCst);
        serde_json::from_str(&text).map_err(|e| {
            BackendError::Unavailable(format!("cannot read the answer of {op} from Redis: {e}"))
        })
    }

    /// The script operation and arguments of a call that may carry a request id: with one,
    /// `{op}!rid` and four arguments more (see the dispatch at the end of the script);
    /// `acted` lists the answer fields that say the operation acted, so is remembered.
    fn with_request(
        &self,
        op: &str,
        mut args: Args,
        request: Option<&Request>,
        acted: &str,
    ) -> (String, Args) {
        match request {
            None => (op.to_string(), args),
            Some(r) => {
                args.push(r.key.clone());
                args.push(r.fingerprint.clone());
                args.push(self.inner.config.request_id_retention_ms.to_string());
                args.push(acted.to_string());
                (format!("{op}!rid"), args)
            }
        }
    }

    /// Records a failure: a lost Redis makes the node unready until a probe gets through.
    fn failed(&self, e: ::redis::RedisError) -> BackendError {
        let lost = e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_timeout()
            || e.is_unrecoverable_error();
        if lost && self.inner.ok.swap(false, Ordering::SeqCst) {
            tracing::warn!(url = %self.inner.url, error = %e, "lost Redis; not ready");
        }
        BackendError::Unavailable(format!("Redis at {}: {e}", self.inner.url))
    }

    /// After a script: wake this node's waiters of what it freed (the published message
    /// wakes other nodes'), and count what it ended.
    fn after(&self, ended: Option<&Ended>, freed: &[Resource]) {
        for r in freed {
            self.inner.waiting.wake(r);
        }
        if let Some(e) = ended
            && e.sessions() > 0
        {
            if e.listed {
                let named = |t: &String| LockKey::parse("key", t).ok();
                for k in e.keys.iter().filter_map(named) {
                    self.inner.waiting.wake(&Resource::Lock(k));
                }
                for p in e.pools.iter().filter_map(named) {
                    self.inner.waiting.wake(&Resource::Pool(p));
                }
                for q in e.recovered_q.iter().filter_map(named) {
                    self.inner.waiting.wake(&Resource::Queue(q));
                }
            } else {
                self.inner.waiting.wake_all();
                self.inner.gauges_stale.store(true, Ordering::SeqCst);
            }
            self.tally(e);
        }
    }

    fn tally(&self, e: &Ended) {
        self.inner.metrics.count_ends(EndCounts {
            by_reason: e.by,
            locks: e.locks as u64,
            seats: e.seats as u64,
            recovered: e.recovered as u64,
            failed: &e.failed,
        });
        if e.listed {
            for pool in &e.pools {
                self.gauge_seats(pool, -1);
            }
            for queue in &e.recovered_q {
                self.gauge_queue(queue, "claimed", -1);
                self.gauge_queue(queue, "queued", 1);
            }
            for queue in &e.failed_q {
                self.gauge_queue(queue, "claimed", -1);
                self.gauge_queue(queue, "failed", 1);
            }
        }
    }

    fn gauge_queue(&self, queue: &str, state: &'static str, delta: i64) {
        {
            let mut shown = self.inner.gauge_queues.lock();
            if !shown.iter().any(|q| q == queue) {
                shown.push(queue.to_string());
            }
        }
        self.inner
            .metrics
            .jobs
            .get_or_create(&QueueStateLabels {
                queue: queue.into(),
                state,
            })
            .inc_by(delta);
    }

    fn gauge_seats(&self, pool: &str, delta: i64) {
        {
            let mut shown = self.inner.gauge_pools.lock();
            if !shown.iter().any(|p| p == pool) {
                shown.push(pool.to_string());
            }
        }
        self.inner
            .metrics
            .seats_in_use
            .get_or_create(&PoolLabel { pool: pool.into() })
            .inc_by(delta);
    }

    /// Sets the gauges from Redis: other nodes change what they count.
    async fn refresh_gauges(&self) -> Result<()> {
        #[derive(Deserialize)]
        struct Stats {
            sessions: i64,
            locks: i64,
            #[serde(deserialize_with = "list")]
            pools: Vec<(String, u32, usize)>,
            #[serde(deserialize_with = "list")]
            queues: Vec<(String, [u64; 4])>,
        }
        self.inner.gauges_stale.store(false, Ordering::SeqCst);
        let s: Stats = self.call("stats", args![]).await?;
        let m = &self.inner.metrics;
        m.sessions_active.set(s.sessions);
        m.locks_held.set(s.locks);
        let names: Vec<String> = s.pools.iter().map(|p| p.0.clone()).collect();
        for (name, capacity, in_use) in &s.pools {
            m.set_pool(name, Some((*capacity, *in_use)));
        }
        let old = std::mem::replace(&mut *self.inner.gauge_pools.lock(), names.clone());
        for gone in old.iter().filter(|p| !names.contains(p)) {
            m.set_pool(gone, None);
        }
        let names: Vec<String> = s.queues.iter().map(|q| q.0.clone()).collect();
        for (queue, c) in &s.queues {
            m.set_queue(queue, counts(*c));
        }
        let old = std::mem::replace(&mut *self.inner.gauge_queues.lock(), names.clone());
        for gone in old.iter().filter(|q| !names.contains(q)) {
            m.set_queue(gone, QueueCounts::default());
        }
        Ok(())
    }

    /// Probes Redis (readiness follows), and refreshes the gauges.
    async fn housekeeping(self) {
        let mut stop = self.inner.stop.subscribe();
        let mut round = 0u64;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(HOUSEKEEPING) => {}
                _ = stop.changed() => return,
            }
            if let Err(e) = self.call::<serde_json::Value>("revision", args![]).await {
                tracing::debug!(error = %e, "housekeeping could not reach Redis");
                continue;
            }
            if (round.is_multiple_of(5) || self.inner.gauges_stale.load(Ordering::SeqCst))
                && let Err(e) = self.refresh_gauges().await
            {
                tracing::debug!(error = %e, "cannot refresh the gauges");
            }
            round += 1;
        }
    }

    /// Wakes the waiters on what one message names: `*` (everything), or names one a line
    /// (a call publishes everything it freed in one message).
    fn woken_by(&self, payload: &str) {
        if payload == "*" {
            self.inner.waiting.wake_all();
            return;
        }
        for r in payload.split('\n').filter_map(Resource::from_payload) {
            self.inner.waiting.wake(&r);
        }
    }

    /// Wakes this node's waiters on what other nodes free: a subscription of its own,
    /// opened again whenever it breaks; every waiter is woken after a reconnect, since
    /// messages sent meanwhile are lost.
    async fn listen(self) {
        use futures_util::StreamExt;
        let mut stop = self.inner.stop.subscribe();
        let channel = format!("{}:!free", self.inner.namespace);
        loop {
            let opened = tokio::time::timeout(Duration::from_secs(2), async {
                let mut pubsub = self.inner.client.get_async_pubsub().await?;
                pubsub.subscribe(&channel).await?;
                Ok::<_, ::redis::RedisError>(pubsub)
            })
            .await;
            match opened {
                Ok(Ok(pubsub)) => {
                    self.inner.waiting.wake_all();
                    let mut messages = pubsub.into_on_message();
                    loop {
                        tokio::select! {
                            m = messages.next() => match m {
                                Some(m) => {
                                    let payload: String = m.get_payload().unwrap_or_default();
                                    self.inner.ends.notify_one();
                                    self.woken_by(&payload);
                                }
                                None => break,
                            },
                            _ = stop.changed() => return,
                        }
                    }
                    tracing::debug!("the Redis subscription broke; opening it again");
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "cannot subscribe on Redis"),
                Err(_) => tracing::debug!("subscribing on Redis timed out"),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                _ = stop.changed() => return,
            }
        }
    }

    /// The background reaper: one node at a time (the reaper lock key, held with a TTL and
    /// renewed by each pass), bounded batches earliest deadline first, passes one after
    /// another while they come back full; otherwise it sleeps until the earliest deadline,
    /// at most one reaper interval.
    async fn reaper(self) {
        let mut stop = self.inner.stop.subscribe();
        let interval = Duration::from_millis(self.inner.config.reaper_interval_ms.max(1));
        // Long enough to outlive the pause between passes, short enough that another node
        // takes over soon after this one dies.
        let lock_ms = (interval.as_millis() as u64 * 3).max(2_000);
        let batch = self.inner.config.reaper_batch.max(1);
        // Each pass holds Redis (which serves every other call meanwhile) for about
        // `reaper_pass_ms` as measured by the script itself, or for what every call takes
        // beyond its script (the append-only file's sync) when that is longer: a storm of
        // expiries is ended in many short passes, one after another, not in a few that stall
        // every client, nor in so many that it pays one sync per few dozen sessions.
        let budget = Duration::from_millis(self.inner.config.reaper_pass_ms.max(1));
        let mut sizer = PassSizer::new(budget, batch);
        // The listing indexes' sweep (see `sweep`), paced the same way.
        let mut sweeper = PassSizer::new(budget, batch);
        let mut wait = interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.changed() => return,
            }
            wait = interval;
            if !self.ready() {
                continue;
            }
            self.work_off(&mut sizer, &mut sweeper, lock_ms).await;
            if let Err(e) = self.retention().await {
                tracing::debug!(error = %e, "retention pass failed");
            }
            if self.inner.gauges_stale.load(Ordering::SeqCst)
                && let Err(e) = self.refresh_gauges().await
            {
                tracing::debug!(error = %e, "cannot refresh the gauges");
            }
            #[derive(Deserialize)]
            struct Due {
                ms: i64,
            }
            if let Ok(Due { ms }) = self.call::<Due>("next_due", args![]).await
                && ms >= 0
            {
                wait = interval.min(Duration::from_millis(ms.max(1) as u64));
            }
        }
    }

    /// Paced passes while they come back full; then, once nothing more is due, the listing
    /// indexes' sweep in bounded calls while entries wait (any node's ends add to them),
    /// back to passes as soon as a call says a session is due again. Nothing at all while
    /// another node holds the reaper lock.
    async fn work_off(&self, sizer: &mut PassSizer, sweeper: &mut PassSizer, lock_ms: u64) {
        loop {
            match self.paced_pass(sizer, lock_ms).await {
                Some(true) => continue,
                Some(false) => {}
                None => return,
            }
            loop {
                let started = Instant::now();
                match self.sweep(sweeper.next()).await {
                    Ok(s) => {
                        let held = Duration::from_micros(s.us);
                        sweeper.observe_call(s.swept, held, started.elapsed());
                        if s.swept == 0 || s.left == 0 {
                            return;
                        }
                        if s.due {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "sweep failed");
                        return;
                    }
                }
            }
        }
    }

    /// One background pass sized by `sizer`, observed in the metrics: `Some(full)`, whether
    /// it ended as many as it asked for (more may be due), or `None` when another node holds
    /// the reaper lock or the pass failed.
    async fn paced_pass(&self, sizer: &mut PassSizer, lock_ms: u64) -> Option<bool> {
        let started = Instant::now();
        let size = sizer.next();
        let (outcome, held) = match self.pass(size, Some(lock_ms)).await {
            Ok(Some(done)) => done,
            // Another node holds the reaper lock: its turn.
            Ok(None) => return None,
            Err(e) => {
                tracing::debug!(error = %e, "reaper pass failed");
                return None;
            }
        };
        sizer.observe_call(outcome.sessions, held, started.elapsed());
        let m = &self.inner.metrics;
        m.reaper_pass_seconds
            .observe(started.elapsed().as_secs_f64());
        if outcome.sessions > 0 {
            self.inner.ends.notify_one();
            m.reaper_batch_size.observe(outcome.sessions as f64);
            outcome.log();
        }
        Some(outcome.sessions == size)
    }

    /// One pass: ends up to `batch` due sessions, and says how long it held Redis. With
    /// `lock_ms`, only while this node holds the reaper lock (`None` when another does).
    async fn pass(
        &self,
        batch: usize,
        lock_ms: Option<u64>,
    ) -> Result<Option<(ReapOutcome, Duration)>> {
        #[derive(Deserialize)]
        struct Pass {
            #[serde(default)]
            skipped: bool,
            ended: Option<Ended>,
            #[serde(default)]
            us: u64,
        }
        let p: Pass = self
            .call(
                "reap",
                args![
                    batch,
                    self.inner.node,
                    if lock_ms.is_some() { "1" } else { "0" },
                    lock_ms.unwrap_or(0)
                ],
            )
            .await?;
        if p.skipped {
            return Ok(None);
        }
        let e = p.ended.unwrap_or_default();
        self.after(Some(&e), &[]);
        let outcome = ReapOutcome {
            sessions: e.sessions(),
            locks: e.locks,
            seats: e.seats,
            jobs: e.recovered + e.failed.len(),
        };
        Ok(Some((outcome, Duration::from_micros(p.us))))
    }

    /// Takes up to `batch` ended sessions and released locks off the listing indexes, which
    /// ends leave to this sweep: it says how many it took, how many wait, and how long it
    /// held Redis.
    async fn sweep(&self, batch: usize) -> Result<Swept> {
        self.call("sweep", args![batch]).await
    }

    async fn retention(&self) -> Result<()> {
        #[derive(Deserialize)]
        struct Kept {
            purged: u64,
            trimmed: u64,
        }
        let c = &self.inner.config;
        let k: Kept = self
            .call(
                "retention",
                args![
                    c.job_retention_ms,
                    c.reaper_batch.max(1),
                    c.event_retention_ms,
                    c.event_trim_batch.max(1)
                ],
            )
            .await?;
        self.inner.metrics.events_trimmed.inc_by(k.trimmed);
        if k.purged > 0 {
            self.inner.gauges_stale.store(true, Ordering::SeqCst);
        }
        Ok(())
    }

    fn wait_deadline(&self, wait_ms: u64) -> Option<Mono> {
        let wait = wait_ms.min(self.inner.config.max_wait_ms);
        (wait > 0).then(|| self.inner.clock.now().plus_ms(wait))
    }

    /// Whether `id` is live; a session past its deadline is ended on the way.
    async fn live_or_end(&self, id: SessionId) -> Result<bool> {
        #[derive(Deserialize)]
        struct Live {
            live: bool,
            ended: Option<Ended>,
        }
        let l: Live = self.call("live", args![id.0]).await?;
        self.after(l.ended.as_ref(), &[]);
        Ok(l.live)
    }

    pub fn ready(&self) -> bool {
        let i = &self.inner;
        i.checked.load(Ordering::SeqCst)
            && i.ok.load(Ordering::SeqCst)
            && !i.draining.load(Ordering::SeqCst)
            && !*i.stop.borrow()
    }

    pub fn begin_drain(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
        self.inner.waiting.drain();
    }

    pub fn shutdown(&self) {
        self.begin_drain();
        self.inner.stop.send_replace(true);
        for task in self.inner.tasks.lock().drain(..) {
            task.abort();
        }
    }
}

/// What a sweep call did: entries taken off the lists, entries still waiting, whether a
/// session is due, and how long it held Redis.
#[derive(Deserialize)]
struct Swept {
    swept: usize,
    left: u64,
    due: bool,
    us: u64,
}

enum Bootstrap {
    /// Redis could not be reached; try again.
    Unreachable(String),
    Refused(StartError),
}

fn counts(c: [u64; 4]) -> QueueCounts {
    QueueCounts {
        queued: c[0],
        claimed: c[1],
        done: c[2],
        failed: c[3],
    }
}

/// Checks every invariant of the stored state of `namespace` over a connection of its own;
/// used by `leasehold check --backend redis`.
pub async fn check(url: &str, namespace: &str) -> std::result::Result<CheckReport, String> {
    let client = ::redis::Client::open(url).map_err(|e| format!("{}: {e}", redact(url)))?;
    let mut conn = tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    .map_err(|_| format!("{}: connecting timed out", redact(url)))?
    .map_err(|e| format!("{}: {e}", redact(url)))?;
    let text = LIBRARY
        .call(&mut conn, namespace, "check", &[])
        .await
        .map_err(|e| format!("{}: {e}", redact(url)))?;
    report(&text).map_err(|e| format!("cannot read the check's answer: {e}"))
}

fn report(text: &str) -> std::result::Result<CheckReport, serde_json::Error> {
    #[derive(Deserialize)]
    struct Report {
        sessions: u64,
        locks: u64,
        events: u64,
        revision: u64,
        #[serde(deserialize_with = "list")]
        problems: Vec<String>,
    }
    let r: Report = serde_json::from_str(text)?;
    Ok(CheckReport {
        sessions: r.sessions,
        locks: r.locks,
        events: r.events,
        revision: r.revision,
        problems: r.problems,
        space: Vec::new(),
    })
}

fn gone_or(e: &Base) -> BackendError {
    match e.err.as_deref() {
        Some("gone") => BackendError::SessionGone,
        Some("not_holder") => BackendError::NotHolder,
        Some("no_pool") => BackendError::PoolNotFound,
        Some("in_use") => BackendError::PoolInUse(e.n.unwrap_or_default()),
        Some("no_job") => BackendError::JobNotFound,
        Some("stale") => BackendError::StaleToken,
        Some("not_failed") => BackendError::JobNotFailed,
        Some("too_many") => BackendError::TooManyLocks(e.n.unwrap_or_default()),
        Some("request_id_reused") => BackendError::RequestIdReused,
        other => BackendError::Unavailable(format!("the script answered {other:?}")),
    }
}

/// Each operation is one script call; waiting is node-local, in [`crate::backend::waiting`].
impl Backend for Redis {
    fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    fn acting_as(&self, actor: Option<Arc<str>>) -> Redis {
        Redis {
            inner: self.inner.clone(),
            actor,
        }
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    fn ready(&self) -> bool {
        Redis::ready(self)
    }

    fn ends(&self) -> Arc<tokio::sync::Notify> {
        self.inner.ends.clone()
    }

    fn begin_drain(&self) {
        Redis::begin_drain(self)
    }

    fn shutdown(&self) {
        Redis::shutdown(self)
    }

    async fn open_as(
        &self,
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession> {
        let limits = &self.inner.config.limits;
        limits.owner(&owner)?;
        let ttl_ms = limits.ttl(ttl_ms)?;
        let metadata = metadata.filter(|m| !m.is_empty()).unwrap_or_default();
        if !metadata.is_empty() {
            limits.metadata(&metadata)?;
        }
        #[derive(Deserialize)]
        struct Opened {
            err: Option<String>,
            revision: Option<u64>,
            expires_at: Option<u64>,
        }
        let o: Opened = self
            .call("open", args![id.0, owner, metadata, ttl_ms])
            .await?;
        if let Some(e) = o.err {
            return Err(BackendError::Unavailable(format!("open answered {e}")));
        }
        self.inner.metrics.sessions_opened.inc();
        self.inner.metrics.sessions_active.inc();
        Ok(OpenedSession {
            id,
            ttl_ms,
            expires_at: UnixMs(o.expires_at.unwrap_or_default()),
            revision: o.revision.unwrap_or_default(),
        })
    }

    async fn heartbeat(&self, id: SessionId, ttl_ms: Option<u64>) -> Result<Beat> {
        let ttl = match ttl_ms.map(|t| self.inner.config.limits.ttl(Some(t))) {
            None => String::new(),
            Some(Ok(t)) => t.to_string(),
            // A gone session with a bad TTL is still just gone.
            Some(Err(e)) => {
                return if self.live_or_end(id).await? {
                    Err(e.into())
                } else {
                    Err(BackendError::SessionGone)
                };
            }
        };
        #[derive(Deserialize)]
        struct Beaten {
            #[serde(flatten)]
            base: Base,
            expires_at: Option<u64>,
            ttl: Option<u64>,
        }
        let b: Beaten = self.call("heartbeat", args![id.0, ttl]).await?;
        self.after(b.base.ended.as_ref(), &[]);
        if b.base.err.is_some() {
            return Err(gone_or(&b.base));
        }
        self.inner.metrics.heartbeats.inc();
        Ok(Beat {
            expires_at: UnixMs(b.expires_at.unwrap_or_default()),
            ttl_ms: b.ttl.unwrap_or_default(),
        })
    }

    async fn end(&self, id: SessionId, reason: EndReason) -> Result<Option<Closed>> {
        let b: Base = self.call("end", args![id.0, reason.as_str()]).await?;
        let e = b.ended.unwrap_or_default();
        self.after(Some(&e), &[]);
        let closed = e.closed();
        if let Some(c) = &closed {
            c.log(id, reason);
        }
        Ok(closed)
    }

    async fn session(&self, id: SessionId) -> Result<Option<SessionInfo>> {
        #[derive(Deserialize)]
        struct One {
            session: Option<SessionOut>,
            ended: Option<Ended>,
        }
        let o: One = self.call("session", args![id.0]).await?;
        self.after(o.ended.as_ref(), &[]);
        match o.session {
            Some(s) => Ok(Some(s.info()?.1)),
            None => Ok(None),
        }
    }

    async fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> Result<SessionPage> {
        #[derive(Deserialize)]
        struct Page {
            #[serde(deserialize_with = "list")]
            page: Vec<SessionOut>,
        }
        let after = after.map(|a| a.0.to_string()).unwrap_or_default();
        let p: Page = self
            .call("sessions", args![after, limit, owner.unwrap_or("")])
            .await?;
        let mut page: Vec<(bool, SessionInfo)> = p
            .page
            .into_iter()
            .map(SessionOut::info)
            .collect::<Result<_>>()?;
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|(_, s)| s.id)
        } else {
            None
        };
        Ok((
            page.into_iter()
                .filter(|(l, _)| *l)
                .map(|(_, s)| s)
                .collect(),
            next,
        ))
    }

    async fn acquire(&self, id: SessionId, key: LockKey, wait_ms: u64) -> Result<Granted> {
        let deadline = self.wait_deadline(wait_ms);
        self.inner
            .waiting
            .lock(key.clone(), deadline, |may_take| {
                self.try_acquire(id, &key, may_take, None)
            })
            .await
    }

    async fn release(&self, id: SessionId, key: LockKey, token: Token) -> Result<u64> {
        #[derive(Deserialize)]
        struct Released {
            #[serde(flatten)]
            base: Base,
            revision: Option<u64>,
        }
        let r: Released = self
            .call("release", args![id.0, key.as_str(), token.0])
            .await?;
        self.after(r.base.ended.as_ref(), &[]);
        match r.revision {
            Some(rev) => {
                self.inner.metrics.locks_released.inc();
                self.inner.metrics.locks_held.dec();
                self.after(None, &[Resource::Lock(key)]);
                Ok(rev)
            }
            None => Err(gone_or(&r.base)),
        }
    }

    async fn lock(&self, key: &LockKey) -> Result<Option<LockRecord>> {
        #[derive(Deserialize)]
        struct One {
            lock: Option<LockOut>,
        }
        let o: One = self.call("lock", args![key.as_str()]).await?;
        o.lock.map(|l| l.record()).transpose()
    }

    async fn locks(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LockPage> {
        #[derive(Deserialize)]
        struct Page {
            #[serde(deserialize_with = "list")]
            page: Vec<LockOut>,
        }
        let p: Page = self
            .call("locks", args![prefix, after.unwrap_or(""), limit])
            .await?;
        let mut page: Vec<(String, LockRecord)> = p
            .page
            .iter()
            .map(|l| Ok((l.key.clone(), l.record()?)))
            .collect::<Result<_>>()?;
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|(k, _)| k.clone())
        } else {
            None
        };
        Ok((page, next))
    }

    async fn fence(&self, key: &LockKey, token: Token) -> Result<Fence> {
        #[derive(Deserialize)]
        struct F {
            current: bool,
            latest: Option<u64>,
        }
        let f: F = self.call("fence", args![key.as_str(), token.0]).await?;
        Ok(Fence {
            current: f.current,
            latest: f.latest.map(Token),
        })
    }

    async fn put_pool(
        &self,
        name: PoolName,
        capacity: u64,
        metadata: Option<String>,
    ) -> Result<PoolPut> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(InvalidInput::new(
                "capacity",
                format!("must be between 1 and {MAX_CAPACITY} seats"),
            )
            .into());
        }
        let metadata = metadata.filter(|m| !m.is_empty());
        if let Some(m) = &metadata {
            self.inner.config.limits.metadata(m)?;
        }
        #[derive(Deserialize)]
        struct Put {
            revision: u64,
            created: bool,
        }
        let given = if metadata.is_some() { "1" } else { "0" };
        let p: Put = self
            .call(
                "put_pool",
                args![name.as_str(), capacity, metadata.unwrap_or_default(), given],
            )
            .await?;
        // The script published the pool when it grew; wake this node's waiters at once.
        self.after(None, &[Resource::Pool(name.clone())]);
        self.inner
            .metrics
            .seats_capacity
            .get_or_create(&PoolLabel {
                pool: name.to_string(),
            })
            .set(capacity as i64);
        self.gauge_seats(name.as_str(), 0);
        Ok(PoolPut {
            revision: p.revision,
            created: p.created,
        })
    }

    async fn delete_pool(&self, name: PoolName) -> Result<u64> {
        #[derive(Deserialize)]
        struct Deleted {
            #[serde(flatten)]
            base: Base,
            revision: Option<u64>,
        }
        let d: Deleted = self.call("delete_pool", args![name.as_str()]).await?;
        self.after(d.base.ended.as_ref(), &[]);
        match d.revision {
            Some(rev) => {
                self.after(None, &[Resource::Pool(name.clone())]);
                self.inner.metrics.set_pool(name.as_str(), None);
                Ok(rev)
            }
            None => Err(gone_or(&d.base)),
        }
    }

    async fn pool(&self, name: &PoolName) -> Result<Option<PoolInfo>> {
        #[derive(Deserialize)]
        struct Holder {
            sid: String,
            owner: String,
            token: u64,
            at: u64,
            meta: String,
            hb: Option<u64>,
            grace: Option<bool>,
        }
        #[derive(Deserialize)]
        struct PoolOut {
            cap: u32,
            meta: String,
            created: u64,
            #[serde(deserialize_with = "list")]
            holders: Vec<Holder>,
        }
        #[derive(Deserialize)]
        struct One {
            pool: Option<PoolOut>,
        }
        let o: One = self.call("pool", args![name.as_str()]).await?;
        let Some(p) = o.pool else { return Ok(None) };
        let holders: Vec<SeatHolder> = p
            .holders
            .into_iter()
            .map(|h| {
                Ok(SeatHolder {
                    session_id: session_id(&h.sid)?,
                    owner: h.owner,
                    seat: SeatRecord {
                        token: Token(h.token),
                        acquired_at: UnixMs(h.at),
                        metadata: h.meta,
                    },
                    last_heartbeat_at: h.hb.map(UnixMs),
                    grace: h.grace,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Some(PoolInfo {
            capacity: p.cap,
            in_use: holders.len(),
            waiting: self.inner.waiting.waiting(&Resource::Pool(name.clone())),
            metadata: p.meta,
            created_at: UnixMs(p.created),
            holders,
        }))
    }

    async fn pools(&self) -> Result<Vec<(String, u32, usize)>> {
        #[derive(Deserialize)]
        struct All {
            #[serde(deserialize_with = "list")]
            pools: Vec<(String, u32, usize)>,
        }
        let mut a: All = self.call("pools", args![]).await?;
        a.pools.sort_by(|x, y| x.0.cmp(&y.0));
        Ok(a.pools)
    }

    async fn acquire_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
    ) -> Result<Granted> {
        self.seat_once(id, pool, metadata, wait_ms, None).await
    }

    async fn release_seat(&self, id: SessionId, pool: PoolName, token: Token) -> Result<u64> {
        self.release_seat_once(id, pool, token, None).await
    }

    async fn enqueue(&self, job: NewJob) -> Result<(JobId, u64)> {
        let (max_recoveries, kind) = job.checked()?;
        let id = JobId::random();
        #[derive(Deserialize)]
        struct Enqueued {
            revision: u64,
        }
        let e: Enqueued = self
            .call(
                "enqueue",
                args![
                    id.0,
                    job.queue.as_str(),
                    kind,
                    job.payload,
                    if job.idempotent { "1" } else { "0" },
                    max_recoveries
                ],
            )
            .await?;
        self.gauge_queue(job.queue.as_str(), "queued", 1);
        self.after(None, &[Resource::Queue(job.queue)]);
        Ok((id, e.revision))
    }

    async fn claim(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
    ) -> Result<Option<Claimed>> {
        self.claim_once(id, queue, wait_ms, None).await
    }

    async fn finish_job(
        &self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
    ) -> Result<u64> {
        self.finish_once(id, job, token, finish, None).await
    }

    async fn once(&self, request: Request, op: Mutation) -> Result<Answer> {
        match op {
            Mutation::Acquire { id, key, wait_ms } => {
                let deadline = self.wait_deadline(wait_ms);
                let g = self
                    .inner
                    .waiting
                    .lock(key.clone(), deadline, |may_take| {
                        self.try_acquire(id, &key, may_take, Some(&request))
                    })
                    .await?;
                Ok(Answer::Granted {
                    token: g.token.0,
                    revision: g.revision,
                })
            }
            Mutation::Release { id, key, token } => {
                #[derive(Deserialize)]
                struct Released {
                    #[serde(flatten)]
                    base: Base,
                    revision: Option<u64>,
                    #[serde(default)]
                    replayed: bool,
                }
                let (op, args) = self.with_request(
                    "release",
                    args![id.0, key.as_str(), token.0],
                    Some(&request),
                    "revision",
                );
                let r: Released = self.call(&op, args).await?;
                self.after(r.base.ended.as_ref(), &[]);
                match r.revision {
                    Some(revision) => {
                        if !r.replayed {
                            self.inner.metrics.locks_released.inc();
                            self.inner.metrics.locks_held.dec();
                            self.after(None, &[Resource::Lock(key)]);
                        } else {
                            self.inner.metrics.request_id_replays.inc();
                        }
                        Ok(Answer::Released { revision })
                    }
                    None => Err(gone_or(&r.base)),
                }
            }
            Mutation::Enqueue(job) => {
                let (max_recoveries, kind) = job.checked()?;
                #[derive(Deserialize)]
                struct Enqueued {
                    #[serde(flatten)]
                    base: Base,
                    revision: Option<u64>,
                    job: Option<String>,
                    #[serde(default)]
                    replayed: bool,
                }
                let (op, args) = self.with_request(
                    "enqueue",
                    args![
                        JobId::random().0,
                        job.queue.as_str(),
                        kind,
                        job.payload,
                        if job.idempotent { "1" } else { "0" },
                        max_recoveries
                    ],
                    Some(&request),
                    "revision",
                );
                let e: Enqueued = self.call(&op, args).await?;
                let (Some(revision), Some(id)) = (e.revision, e.job) else {
                    return Err(gone_or(&e.base));
                };
                let id = uuid::Uuid::parse_str(&id).map_err(|_| {
                    BackendError::Unavailable(format!("the enqueue answered job id {id:?}"))
                })?;
                if !e.replayed {
                    self.gauge_queue(job.queue.as_str(), "queued", 1);
                    self.after(None, &[Resource::Queue(job.queue)]);
                } else {
                    self.inner.metrics.request_id_replays.inc();
                }
                Ok(Answer::Enqueued {
                    job: JobId(id),
                    revision,
                })
            }
            Mutation::Open {
                id,
                owner,
                ttl_ms,
                metadata,
            } => {
                let limits = &self.inner.config.limits;
                limits.owner(&owner)?;
                let ttl_ms = limits.ttl(ttl_ms)?;
                let metadata = metadata.filter(|m| !m.is_empty()).unwrap_or_default();
                if !metadata.is_empty() {
                    limits.metadata(&metadata)?;
                }
                #[derive(Deserialize)]
                struct Opened {
                    err: Option<String>,
                    revision: Option<u64>,
                    expires_at: Option<u64>,
                    session: Option<String>,
                    #[serde(default)]
                    replayed: bool,
                }
                let (op, args) = self.with_request(
                    "open",
                    args![id.0, owner, metadata, ttl_ms],
                    Some(&request),
                    "revision",
                );
                let o: Opened = self.call(&op, args).await?;
                match o.err.as_deref() {
                    Some("request_id_reused") => return Err(BackendError::RequestIdReused),
                    Some(e) => return Err(BackendError::Unavailable(format!("open answered {e}"))),
                    None => {}
                }
                let (Some(revision), Some(expires_at), Some(session)) =
                    (o.revision, o.expires_at, o.session)
                else {
                    return Err(BackendError::Unavailable("open answered nothing".into()));
                };
                let session = uuid::Uuid::parse_str(&session).map_err(|_| {
                    BackendError::Unavailable(format!("open answered session id {session:?}"))
                })?;
                if !o.replayed {
                    self.inner.metrics.sessions_opened.inc();
                    self.inner.metrics.sessions_active.inc();
                } else {
                    self.inner.metrics.request_id_replays.inc();
                }
                Ok(Answer::Opened {
                    session: SessionId(session),
                    ttl_ms,
                    expires_at,
                    revision,
                })
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
                let r = Some(&request);
                let revision = self.release_seat_once(id, pool, token, r).await?;
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

    async fn requeue(&self, job: JobId) -> Result<u64> {
        #[derive(Deserialize)]
        struct Requeued {
            #[serde(flatten)]
            base: Base,
            revision: Option<u64>,
            queue: Option<String>,
        }
        let r: Requeued = self.call("requeue", args![job.0]).await?;
        let Some(revision) = r.revision else {
            return Err(gone_or(&r.base));
        };
        let queue = r.queue.unwrap_or_default();
        self.gauge_queue(&queue, "failed", -1);
        self.gauge_queue(&queue, "queued", 1);
        if let Ok(q) = QueueName::parse("queue", &queue) {
            self.after(None, &[Resource::Queue(q)]);
        }
        Ok(revision)
    }

    async fn raise_token_floor(&self, floor: u64) -> Result<FloorRaised> {
        validate_token_floor(floor)?;
        // Tokens pass through the scripts as Lua numbers and cjson writes numbers with 14
        // significant digits, so counters on this backend stay below 10^14.
        if floor > REDIS_MAX_TOKEN_FLOOR {
            return Err(InvalidInput::new(
                "floor",
                format!(
                    "must be at most {REDIS_MAX_TOKEN_FLOOR} (10^13) on the Redis backend, whose scripts carry tokens as 14-digit numbers"
                ),
            )
            .into());
        }
        #[derive(Deserialize)]
        struct Raised {
            previous: u64,
            revision: u64,
        }
        let r: Raised = self.call("raise_floor", args![floor]).await?;
        let raised = FloorRaised {
            floor,
            previous: r.previous,
            revision: r.revision,
        };
        tracing::info!(
            floor,
            previous = raised.previous,
            revision = raised.revision,
            "raised the token floor"
        );
        Ok(raised)
    }

    async fn job(&self, id: JobId) -> Result<Option<(JobRecord, String)>> {
        #[derive(Deserialize)]
        struct One {
            job: Option<JobOut>,
        }
        let o: One = self.call("job", args![id.0]).await?;
        match o.job {
            None => Ok(None),
            Some(j) => {
                let payload = j.payload.clone().unwrap_or_default();
                Ok(Some((j.record()?.1, payload)))
            }
        }
    }

    async fn queue(&self, name: &QueueName) -> Result<QueueInfo> {
        #[derive(Deserialize)]
        struct Q {
            counts: [u64; 4],
        }
        let q: Q = self.call("queue", args![name.as_str()]).await?;
        Ok(QueueInfo {
            counts: counts(q.counts),
            waiting: self.inner.waiting.waiting(&Resource::Queue(name.clone())),
        })
    }

    async fn queue_jobs(
        &self,
        queue: &QueueName,
        state: &JobStatus,
        after: Option<JobId>,
        limit: usize,
    ) -> Result<JobPage> {
        #[derive(Deserialize)]
        struct Page {
            #[serde(deserialize_with = "list")]
            page: Vec<JobOut>,
        }
        let after = after.map(|a| a.0.to_string()).unwrap_or_default();
        let p: Page = self
            .call(
                "queue_jobs",
                args![queue.as_str(), state.name(), after, limit],
            )
            .await?;
        let mut page: Vec<(JobId, JobRecord)> =
            p.page.iter().map(JobOut::record).collect::<Result<_>>()?;
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|(id, _)| *id)
        } else {
            None
        };
        Ok((page, next))
    }

    async fn events(&self, after: u64, limit: usize) -> Result<(Vec<Event>, Option<u64>)> {
        #[derive(Deserialize)]
        struct Page {
            #[serde(deserialize_with = "list")]
            events: Vec<String>,
        }
        let p: Page = self.call("events", args![after, limit]).await?;
        let mut next = None;
        let mut events = Vec::with_capacity(p.events.len());
        for text in &p.events {
            let e: EventOut = serde_json::from_str(text).map_err(|e| {
                BackendError::Unavailable(format!("Redis holds an unreadable event: {e}"))
            })?;
            next = Some(e.seq);
            if let Some(e) = e.event() {
                events.push(e);
            }
        }
        Ok((events, next))
    }

    async fn reap_now(&self) -> Result<ReapOutcome> {
        let batch = self.inner.config.reaper_batch.max(1);
        let mut total = ReapOutcome::default();
        loop {
            // Scripts run one at a time, so a pass needs no lock against another node's.
            let pass = self.pass(batch, None).await?.unwrap_or_default().0;
            total += pass;
            if pass.sessions < batch {
                break;
            }
        }
        self.retention().await?;
        self.refresh_gauges().await?;
        Ok(total)
    }

    async fn reap_dry_run(&self, limit: usize) -> Result<Vec<DueSession>> {
        #[derive(Deserialize)]
        struct DueOut {
            id: String,
            x: u64,
            #[serde(deserialize_with = "list")]
            locks: Vec<(String, u64)>,
            #[serde(deserialize_with = "list")]
            seats: Vec<String>,
            #[serde(deserialize_with = "list")]
            jobs: Vec<(String, bool, u32, u32)>,
        }
        #[derive(Deserialize)]
        struct All {
            #[serde(deserialize_with = "list")]
            due: Vec<DueOut>,
        }
        let a: All = self.call("dry_run", args![limit]).await?;
        a.due
            .into_iter()
            .map(|d| {
                Ok(DueSession {
                    id: session_id(&d.id)?,
                    expired_at: UnixMs(d.x),
                    locks: d.locks.into_iter().map(|(k, t)| (k, Token(t))).collect(),
                    seats: d.seats,
                    jobs: d
                        .jobs
                        .iter()
                        .map(|(j, idem, rc, maxr)| {
                            let outcome = if *idem && rc < maxr {
                                JobOutcome::Recovered {
                                    recovery_count: rc + 1,
                                }
                            } else {
                                JobOutcome::Failed {
                                    reason: if *idem {
                                        REASON_MAX_RECOVERIES
                                    } else {
                                        REASON_NOT_IDEMPOTENT
                                    }
                                    .to_string(),
                                }
                            };
                            Ok((job_id(j)?, outcome))
                        })
                        .collect::<Result<_>>()?,
                })
            })
            .collect()
    }

    async fn revision(&self) -> Result<u64> {
        #[derive(Deserialize)]
        struct R {
            revision: u64,
        }
        let r: R = self.call("revision", args![]).await?;
        Ok(r.revision)
    }

    async fn check(&self) -> Result<CheckReport> {
        let v: serde_json::Value = self.call("check", args![]).await?;
        report(&v.to_string())
            .map_err(|e| BackendError::Unavailable(format!("cannot read the check's answer: {e}")))
    }
}

/// The seat, claim and finish calls, with or without a request id (see `with_request`): a
/// replayed answer says so, and what it did is not counted again.
impl Redis {
    async fn seat_once(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
        request: Option<&Request>,
    ) -> Result<Granted> {
        let metadata = metadata.filter(|m| !m.is_empty());
        if let Some(m) = &metadata {
            self.inner.config.limits.metadata(m)?;
        }
        let metadata = metadata.unwrap_or_default();
        let deadline = self.wait_deadline(wait_ms);
        self.inner
            .waiting
            .seat(pool.clone(), deadline, &self.inner.metrics, |may_take| {
                self.try_seat(id, &pool, &metadata, may_take, request)
            })
            .await
    }

    async fn release_seat_once(
        &self,
        id: SessionId,
        pool: PoolName,
        token: Token,
        request: Option<&Request>,
    ) -> Result<u64> {
        #[derive(Deserialize)]
        struct Released {
            #[serde(flatten)]
            base: Base,
            revision: Option<u64>,
            #[serde(default)]
            replayed: bool,
        }
        let (op, args) = self.with_request(
            "release_seat",
            args![id.0, pool.as_str(), token.0],
            request,
            "revision",
        );
        let r: Released = self.call(&op, args).await?;
        self.after(r.base.ended.as_ref(), &[]);
        match r.revision {
            Some(rev) if r.replayed => {
                self.inner.metrics.request_id_replays.inc();
                Ok(rev)
            }
            Some(rev) => {
                self.gauge_seats(pool.as_str(), -1);
                self.after(None, &[Resource::Pool(pool)]);
                Ok(rev)
            }
            None => Err(gone_or(&r.base)),
        }
    }

    async fn claim_once(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
        request: Option<&Request>,
    ) -> Result<Option<Claimed>> {
        let deadline = self.wait_deadline(wait_ms);
        let claimed = self
            .inner
            .waiting
            .claim(queue.clone(), deadline, &self.inner.metrics, |may_take| {
                self.try_claim(id, &queue, may_take, request)
            })
            .await?;
        Ok(match claimed {
            Some((c, false)) => {
                self.gauge_queue(queue.as_str(), "queued", -1);
                self.gauge_queue(queue.as_str(), "claimed", 1);
                Some(c)
            }
            Some((c, true)) => Some(c),
            None => None,
        })
    }

    async fn finish_once(
        &self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
        request: Option<&Request>,
    ) -> Result<u64> {
        finish.check()?;
        let (status, result, reason, kind) = match &finish {
            Finish::Complete { result } => ("done", result.as_str(), "", "job_completed"),
            Finish::Fail { reason } => ("failed", "", reason.as_str(), "job_failed"),
            Finish::Release => ("queued", "", "", "job_released"),
        };
        #[derive(Deserialize)]
        struct Finished {
            #[serde(flatten)]
            base: Base,
            revision: Option<u64>,
            queue: Option<String>,
            #[serde(default)]
            replayed: bool,
        }
        let (op, args) = self.with_request(
            "finish",
            args![id.0, job.0, token.0, status, result, reason, kind],
            request,
            "revision",
        );
        let f: Finished = self.call(&op, args).await?;
        self.after(f.base.ended.as_ref(), &[]);
        let Some(revision) = f.revision else {
            return Err(gone_or(&f.base));
        };
        if f.replayed {
            self.inner.metrics.request_id_replays.inc();
            return Ok(revision);
        }
        let queue = f.queue.unwrap_or_default();
        self.gauge_queue(&queue, "claimed", -1);
        self.gauge_queue(&queue, status, 1);
        if status == "failed" {
            self.inner
                .metrics
                .jobs_failed
                .get_or_create(&ReasonLabel {
                    reason: "worker".into(),
                })
                .inc();
        }
        if status == "queued"
            && let Ok(q) = QueueName::parse("queue", &queue)
        {
            self.after(None, &[Resource::Queue(q)]);
        }
        Ok(revision)
    }
}

/// One attempt of each waiting operation.
impl Redis {
    async fn try_acquire(
        &self,
        id: SessionId,
        key: &LockKey,
        may_take: bool,
        request: Option<&Request>,
    ) -> Result<Step<Granted, ()>> {
        #[derive(Deserialize)]
        struct Try {
            #[serde(flatten)]
            base: Base,
            own: Option<u64>,
            revision: Option<u64>,
            #[serde(default)]
            held: bool,
            #[serde(default)]
            behind: bool,
            granted: Option<u64>,
            #[serde(default)]
            replayed: bool,
        }
        let max = self.inner.config.limits.max_locks_per_session;
        let (op, args) = self.with_request(
            "acquire",
            args![id.0, key.as_str(), if may_take { "1" } else { "0" }, max],
            request,
            "granted,own",
        );
        let t: Try = self.call(&op, args).await?;
        self.after(t.base.ended.as_ref(), &[]);
        if t.base.err.is_some() {
            return Err(gone_or(&t.base));
        }
        Ok(if let Some(token) = t.granted {
            if !t.replayed {
                self.inner.metrics.locks_acquired.inc();
                self.inner.metrics.locks_held.inc();
            } else {
                self.inner.metrics.request_id_replays.inc();
            }
            Step::Done(Granted {
                token: Token(token),
                revision: token,
            })
        } else if let Some(token) = t.own {
            Step::Done(Granted {
                token: Token(token),
                revision: t.revision.unwrap_or_default(),
            })
        } else if t.held {
            Step::Busy(())
        } else if t.behind {
            Step::Room(())
        } else {
            return Err(BackendError::Unavailable("acquire answered nothing".into()));
        })
    }

    async fn try_seat(
        &self,
        id: SessionId,
        pool: &PoolName,
        metadata: &str,
        may_take: bool,
        request: Option<&Request>,
    ) -> Result<Step<Granted, (u32, usize)>> {
        #[derive(Deserialize)]
        struct Try {
            #[serde(flatten)]
            base: Base,
            own: Option<u64>,
            revision: Option<u64>,
            #[serde(default)]
            full: bool,
            #[serde(default)]
            behind: bool,
            cap: Option<u32>,
            granted: Option<u64>,
            #[serde(default)]
            replayed: bool,
        }
        let (op, args) = self.with_request(
            "seat",
            args![
                id.0,
                pool.as_str(),
                metadata,
                if may_take { "1" } else { "0" }
            ],
            request,
            "granted,own",
        );
        let t: Try = self.call(&op, args).await?;
        self.after(t.base.ended.as_ref(), &[]);
        if t.base.err.is_some() {
            return Err(gone_or(&t.base));
        }
        let busy = (t.cap.unwrap_or_default(), t.base.n.unwrap_or_default());
        Ok(if let Some(token) = t.granted {
            if t.replayed {
                self.inner.metrics.request_id_replays.inc();
            } else {
                self.gauge_seats(pool.as_str(), 1);
            }
            Step::Done(Granted {
                token: Token(token),
                revision: token,
            })
        } else if let Some(token) = t.own {
            Step::Done(Granted {
                token: Token(token),
                revision: t.revision.unwrap_or_default(),
            })
        } else if t.full {
            Step::Busy(busy)
        } else if t.behind {
            Step::Room(busy)
        } else {
            return Err(BackendError::Unavailable("seat answered nothing".into()));
        })
    }

    async fn try_claim(
        &self,
        id: SessionId,
        queue: &QueueName,
        may_take: bool,
        request: Option<&Request>,
    ) -> Result<Step<(Claimed, bool), ()>> {
        #[derive(Deserialize)]
        struct Try {
            #[serde(flatten)]
            base: Base,
            #[serde(default)]
            none: bool,
            #[serde(default)]
            behind: bool,
            job: Option<String>,
            token: Option<u64>,
            attempt: Option<u32>,
            rc: Option<u32>,
            kind: Option<String>,
            #[serde(default)]
            replayed: bool,
        }
        let (op, args) = self.with_request(
            "claim",
            args![id.0, queue.as_str(), if may_take { "1" } else { "0" }],
            request,
            "job",
        );
        let t: Try = self.call(&op, args).await?;
        if t.replayed {
            self.inner.metrics.request_id_replays.inc();
        }
        self.after(t.base.ended.as_ref(), &[]);
        if t.base.err.is_some() {
            return Err(gone_or(&t.base));
        }
        Ok(match (t.job, t.token) {
            (Some(job), Some(token)) => {
                let c = Claimed {
                    job: job_id(&job)?,
                    token: Token(token),
                    attempt: t.attempt.unwrap_or_default(),
                    recovery_count: t.rc.unwrap_or_default(),
                    kind: t.kind.unwrap_or_default(),
                    revision: token,
                };
                Step::Done((c, t.replayed))
            }
            // Jobs are there, but others wait ahead of the caller.
            _ if t.behind => Step::Room(()),
            _ if t.none => Step::Busy(()),
            _ => return Err(BackendError::Unavailable("claim answered nothing".into())),
        })
    }
}
