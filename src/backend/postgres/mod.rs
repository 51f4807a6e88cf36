//! The PostgreSQL backend: several Leasehold nodes share one database, and the database is
//! the authority. Every operation is one transaction (often one statement); nothing about
//! sessions, grants or jobs is kept in a node's memory except who waits here.
//!
//! # Rules every statement follows
//!
//! - **One clock.** All time comes from the SQL function `{namespace}.db_now()` (created by
//!   the first migration as `SELECT now()`); no statement calls `now()` itself. Expiry is
//!   judged on it, timestamps are stamped with it, and tests move the database clock by
//!   redefining it. The node's own [`Clock`] judges only how long a request waits.
//! - **No upsert, no resurrection.** A session row is created by exactly one `INSERT` at
//!   open. A heartbeat is one conditional `UPDATE … WHERE expires_at > db_now()`; when it
//!   touches no row the session is gone, and if the row is still there (past its deadline)
//!   it is ended durably before "gone" is said.
//! - **The cascade is the database's.** Ending a session (close, expiry, operator, or a
//!   contender finding it past its deadline) is one statement that settles its jobs, writes
//!   the audit events and deletes the session row; the schema's cascade trigger on `session`
//!   (version 7; set-based, where a foreign key acts row by row) removes its locks and seats
//!   in the same statement. No code deletes lock or seat rows on a session's behalf.
//! - **Token order.** Every mutation draws its revision from the `revision` sequence, and a
//!   grant's token is its revision. The token is drawn only once the transaction holds the
//!   lock that serialises grants of that resource: the key's advisory lock for a lock (a
//!   free key has no row to lock), the pool row for a seat, the job row for a claim. The
//!   previous grant of the same resource drew its token while holding that lock and held it
//!   to its commit, so per resource tokens strictly increase; and a token acknowledged before
//!   a request arrived was drawn before that request's transaction began, and `nextval` never
//!   goes back (the sequence has no per-connection cache), so every grant's token is greater
//!   than every token acknowledged before its request arrived. A token drawn *before*
//!   waiting for the lock could be smaller than one granted and committed meanwhile.
//! - **Audit order.** Events are inserted unnumbered; `number_events` (serialised by an
//!   advisory lock) gives committed events their sequence numbers, so a reader following
//!   the cursor never skips an event that commits late. See `events`.
//! - **Waking waiters.** After every commit that frees a key or a seat or makes a job
//!   claimable, the node sends `pg_notify('{namespace}_free', 'lock:KEY' | 'pool:NAME' |
//!   'queue:NAME')` (or `*` when it freed many); each node listens and wakes its own waiters.
//!   Not inside the transaction that frees: a transaction that notifies holds one lock of the
//!   whole database from its notification to the end of its commit, its WAL flush included,
//!   so notifying writes commit one at a time and a release costs a flush of its own. They
//!   are sent from the node's `LISTEN` connection, all that have gathered in one statement
//!   (see `notify`); one lost in a crash only delays a waiter to its next re-check.

mod batched;
mod errors;
mod events;
mod floor;
mod jobs;
mod locks;
mod notify;
mod pools;
mod reaper;
mod requests;
pub mod schema;
mod sessions;

#[cfg(test)]
mod tests;

use crate::backend::requests::{Answer, Mutation, Request};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::NoTls;
use tokio_postgres::types::ToSql;

use crate::backend::EngineConfig;
use crate::backend::waiting::{Resource, Waiting};
use crate::backend::{
    Backend, BackendError, Beat, CheckReport, Claimed, Closed, DueSession, Fence, Granted, JobPage,
    LockPage, OpenedSession, PoolInfo, QueueInfo, ReapOutcome, Result, SessionInfo, SessionPage,
};
use crate::clock::Clock;
use crate::domain::state::FloorRaised;
use crate::domain::{
    EndReason, Event, Finish, JobId, JobRecord, JobStatus, LockKey, LockRecord, Mono, NewJob,
    PoolName, PoolPut, QueueName, SessionId, Token,
};
use crate::metrics::{EndCounts, Metrics, PoolLabel, QueueStateLabels};
pub use errors::{PgError, chain, redact};
pub use schema::MigrateError;
use sessions::Ended;

/// How to reach the database, and under which schema.
#[derive(Debug, Clone)]
pub struct PgSettings {
    pub url: String,
    pub namespace: String,
    pub pool_size: usize,
    pub statement_timeout_ms: u64,
}

impl PgSettings {
    /// The connection settings, with `statement_timeout` set on every connection and a
    /// bounded connect time.
    pub fn pg_config(&self) -> std::result::Result<tokio_postgres::Config, StartError> {
        let mut pg: tokio_postgres::Config = self
            .url
            .parse()
            .map_err(|e| StartError::BadUrl(redact(&self.url), format!("{e}")))?;
        let idle_in_tx = (self.statement_timeout_ms * 2).max(10_000);
        // No JIT: the end statement's estimated cost passes the JIT threshold, and compiling
        // it took longer than running it (0.7 s of a 1.1 s pass of 10 000 sessions).
        pg.options(format!(
            "-c statement_timeout={} -c idle_in_transaction_session_timeout={idle_in_tx} -c jit=off",
            self.statement_timeout_ms
        ));
        // Names the namespace, so an operator can tell which service a connection serves.
        pg.application_name(format!("leasehold/{}", self.namespace));
        if pg.get_connect_timeout().is_none() {
            pg.connect_timeout(Duration::from_secs(3));
        }
        Ok(pg)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("postgres_url {0} is not a valid connection URL: {1}")]
    BadUrl(String, String),
    #[error(transparent)]
    Migrate(#[from] MigrateError),
    #[error("cannot build the PostgreSQL connection pool: {0}")]
    Pool(String),
}

/// The most notifications one statement sends one by one; past it, one `*` wakes every
/// waiter of every node instead (a mass expiry frees thousands of keys at once).
const NOTIFY_EACH_MAX: usize = 64;
/// How often the head of a line asks again when no notification came.
const RECHECK: Duration = Duration::from_secs(1);
/// How often the background numbers events, probes the database when it is down, and
/// (every fifth time) refreshes the gauges.
const HOUSEKEEPING: Duration = Duration::from_secs(1);

pub(crate) struct Inner {
    config: EngineConfig,
    metrics: Arc<Metrics>,
    clock: Arc<dyn Clock>,
    namespace: String,
    /// The quoted schema name that replaces `{ns}` in statements.
    ns: String,
    /// The advisory lock class of the namespace.
    class: i32,
    channel: String,
    url: String,
    pg_config: tokio_postgres::Config,
    pool: Pool,
    statement_timeout_ms: u64,
    statements: Mutex<HashMap<(usize, usize), Arc<str>>>,
    waiting: Waiting,
    /// Migrations have been applied (or found applied) by this node.
    schema_ready: AtomicBool,
    /// The last contact with the database succeeded.
    db_ok: AtomicBool,
    draining: AtomicBool,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Pools and queues the gauges last showed, to remove the series of deleted ones.
    gauge_pools: Mutex<Vec<String>>,
    gauge_queues: Mutex<Vec<String>>,
    /// Sessions were ended in numbers too large to move the gauges one by one.
    gauges_stale: AtomicBool,
    /// Notifications committed here and not yet sent, and the signal that some wait.
    outbox: Mutex<Outbox>,
    outbox_ready: tokio::sync::Notify,
    /// `Backend::ends`: fired after this node's reaper ended sessions and on every
    /// notification received (another node's commit may have ended sessions).
    ends: Arc<tokio::sync::Notify>,
    /// Concurrent heartbeats, acquires and releases sent together (see `batched`).
    batches: batched::Batches,
}

/// What this node freed since notifications were last sent: names, or everything.
#[derive(Default)]
pub(crate) struct Outbox {
    payloads: std::collections::BTreeSet<String>,
    everything: bool,
}

/// The PostgreSQL backend's handle. Cheap to clone.
#[derive(Clone)]
pub struct Postgres {
    inner: Arc<Inner>,
    /// The token this handle's calls act for (see `Backend::acting_as`): written into the
    /// `actor` column of the operator events they insert.
    actor: Option<Arc<str>>,
}

/// Why a transaction body stopped: an answer for the client (nothing committed), or a
/// database failure.
pub(crate) enum Fail {
    Answer(BackendError),
    Pg(PgError),
}

impl From<PgError> for Fail {
    fn from(e: PgError) -> Fail {
        Fail::Pg(e)
    }
}

impl From<tokio_postgres::Error> for Fail {
    fn from(e: tokio_postgres::Error) -> Fail {
        Fail::Pg(PgError::Db(e))
    }
}

impl From<deadpool_postgres::PoolError> for Fail {
    fn from(e: deadpool_postgres::PoolError) -> Fail {
        Fail::Pg(PgError::Pool(e))
    }
}

/// What a committed transaction leaves to do: wake local waiters of what it freed, count
/// the sessions it ended.
#[derive(Default)]
pub(crate) struct After {
    pub freed: Vec<Resource>,
    /// Too much was freed to name: every waiter is woken.
    pub everything: bool,
    pub ended: Vec<Ended>,
}

impl After {
    pub fn ended(&mut self, ended: Ended) {
        self.freed.extend(ended.freed());
        self.everything |= ended.listed.is_none();
        self.ended.push(ended);
    }
}

/// Runs `$body` in a transaction on a pooled connection and commits it, after sending the
/// notifications for what it freed. The body yields its value or stops with a [`Fail`]
/// (`?` works; `return` must not be used). A deadlock or serialization failure (the server
/// rolled everything back) runs it again from the start; any other database failure is
/// `Unavailable`.
macro_rules! transact {
    ($pg:expr, |$tx:ident, $after:ident| $body:block) => {{
        let pg: &$crate::backend::postgres::Postgres = $pg;
        let mut tries = 0u32;
        loop {
            #[allow(unused_mut)]
            let mut $after = $crate::backend::postgres::After::default();
            let result: std::result::Result<_, $crate::backend::postgres::Fail> = async {
                pg.ensure_ready()
                    .map_err($crate::backend::postgres::Fail::Answer)?;
                let mut client = pg.client().await?;
                #[allow(unused_mut)]
                let mut $tx = client.transaction().await?;
                let value = $body;
                $tx.commit().await?;
                Ok(value)
            }
            .await;
            match result {
                Ok(value) => {
                    pg.committed($after);
                    break Ok(value);
                }
                Err($crate::backend::postgres::Fail::Answer(e)) => break Err(e),
                Err($crate::backend::postgres::Fail::Pg(e)) if e.is_retryable() && tries < 8 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(u64::from(tries) * 3))
                        .await;
                }
                Err($crate::backend::postgres::Fail::Pg(e)) => break Err(pg.failed(e)),
            }
        }
    }};
}
pub(crate) use transact;

impl Postgres {
    /// The `statement_timeout` every connection runs with, in milliseconds.
    pub(crate) fn statement_timeout_ms(&self) -> u64 {
        self.inner.statement_timeout_ms
    }
}

impl Postgres {
    /// Connects, applies the migrations and starts the background tasks. A database that
    /// cannot be reached is not an error: the node starts unready and keeps trying; a
    /// schema newer than this build knows is.
    pub async fn start(
        config: EngineConfig,
        settings: PgSettings,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> std::result::Result<Postgres, StartError> {
        let pg_config = settings.pg_config()?;
        let manager = Manager::from_config(
            pg_config.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let timeout = Duration::from_millis(settings.statement_timeout_ms.max(100));
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(Duration::from_secs(3)))
            .recycle_timeout(Some(Duration::from_secs(3)))
            .build()
            .map_err(|e| StartError::Pool(e.to_string()))?;
        let waiting = Waiting::new(clock.clone(), RECHECK, metrics.waiters.clone());
        let pg = Postgres {
            inner: Arc::new_cyclic(|node| Inner {
                ns: schema::quoted(&settings.namespace),
                class: schema::lock_class(&settings.namespace),
                channel: format!("{}_free", settings.namespace),
                namespace: settings.namespace.clone(),
                url: redact(&settings.url),
                pg_config,
                pool,
                statement_timeout_ms: settings.statement_timeout_ms,
                config,
                metrics,
                clock,
                statements: Mutex::new(HashMap::new()),
                waiting,
                schema_ready: AtomicBool::new(false),
                db_ok: AtomicBool::new(false),
                draining: AtomicBool::new(false),
                stop: watch::channel(false).0,
                tasks: Mutex::new(Vec::new()),
                gauge_pools: Mutex::new(Vec::new()),
                gauge_queues: Mutex::new(Vec::new()),
                gauges_stale: AtomicBool::new(false),
                outbox: Mutex::new(Outbox::default()),
                outbox_ready: tokio::sync::Notify::new(),
                ends: Arc::new(tokio::sync::Notify::new()),
                batches: batched::Batches::start(node),
            }),
            actor: None,
        };
        match pg.bootstrap().await {
            Ok(()) => {
                if let Err(e) = pg.refresh_gauges().await {
                    tracing::debug!(error = %e, "cannot refresh the gauges");
                }
                pg.start_tasks();
            }
            Err(MigrateError::Db(e)) => {
                tracing::warn!(
                    url = %pg.inner.url,
                    error = %e,
                    "cannot reach PostgreSQL; not ready, retrying in the background"
                );
                let again = pg.clone();
                let task = tokio::spawn(async move { again.bootstrap_until_ready().await });
                pg.inner.tasks.lock().push(task);
            }
            Err(e) => return Err(e.into()),
        }
        Ok(pg)
    }

    /// Applies the migrations over a connection of its own.
    async fn bootstrap(&self) -> std::result::Result<(), MigrateError> {
        let (mut client, connection) = self
            .inner
            .pg_config
            .connect(NoTls)
            .await
            .map_err(PgError::from)?;
        let driver = tokio::spawn(connection);
        let r = schema::migrate(&mut client, &self.inner.namespace).await;
        drop(client);
        let _ = driver.await;
        r?;
        self.inner.schema_ready.store(true, Ordering::SeqCst);
        self.inner.db_ok.store(true, Ordering::SeqCst);
        tracing::info!(
            url = %self.inner.url,
            namespace = %self.inner.namespace,
            "PostgreSQL schema is ready"
        );
        Ok(())
    }

    async fn bootstrap_until_ready(self) {
        let mut stop = self.inner.stop.subscribe();
        let mut backoff = Duration::from_millis(250);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.changed() => return,
            }
            match self.bootstrap().await {
                Ok(()) => {
                    self.start_tasks();
                    return;
                }
                Err(MigrateError::Db(e)) => {
                    tracing::warn!(url = %self.inner.url, error = %e, "PostgreSQL still unreachable");
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    // Stays unready: this node must not serve against a schema it does not know.
                    tracing::error!(error = %e, "refusing to serve");
                    return;
                }
            }
        }
    }

    fn start_tasks(&self) {
        let mut tasks = Vec::new();
        if self.inner.config.reaper_enabled {
            tasks.push(tokio::spawn(reaper::run(self.clone())));
        }
        tasks.push(tokio::spawn(notify::listen(self.clone())));
        tasks.push(tokio::spawn(self.clone().housekeeping()));
        self.inner.tasks.lock().extend(tasks);
    }

    /// Numbers committed events, probes the database while it is down, and refreshes the
    /// gauges from it.
    async fn housekeeping(self) {
        let mut stop = self.inner.stop.subscribe();
        let mut round = 0u64;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(HOUSEKEEPING) => {}
                _ = stop.changed() => return,
            }
            match self.number_events(false).await {
                Ok(_) => self.inner.db_ok.store(true, Ordering::SeqCst),
                Err(e) => {
                    tracing::debug!(error = %e, "housekeeping could not reach PostgreSQL");
                    continue;
                }
            }
            if (round.is_multiple_of(5) || self.inner.gauges_stale.load(Ordering::SeqCst))
                && let Err(e) = self.refresh_gauges().await
            {
                tracing::debug!(error = %e, "cannot refresh the gauges");
            }
            round += 1;
        }
    }

    /// The statement text of `template` for this namespace, built once.
    pub(crate) fn sql(&self, template: &'static str) -> Arc<str> {
        let key = (template.as_ptr() as usize, template.len());
        let mut cache = self.inner.statements.lock();
        cache
            .entry(key)
            .or_insert_with(|| Arc::from(template.replace("{ns}", &self.inner.ns)))
            .clone()
    }

    pub(crate) fn ensure_ready(&self) -> Result<()> {
        if !self.inner.schema_ready.load(Ordering::SeqCst) {
            return Err(BackendError::Unavailable(format!(
                "PostgreSQL at {} has not been reached yet, or its schema is not ready",
                self.inner.url
            )));
        }
        Ok(())
    }

    pub(crate) async fn client(&self) -> std::result::Result<Object, PgError> {
        Ok(self.inner.pool.get().await?)
    }

    /// The token this handle's calls act for, for the `actor` column of operator events.
    pub(crate) fn actor(&self) -> Option<&str> {
        self.actor.as_deref()
    }

    /// Records a failure: a lost database makes the node unready until a probe gets through.
    pub(crate) fn failed(&self, e: PgError) -> BackendError {
        if e.is_connection() && self.inner.db_ok.swap(false, Ordering::SeqCst) {
            tracing::warn!(url = %self.inner.url, error = %e, "lost PostgreSQL; not ready");
        }
        e.into()
    }

    /// Runs one statement outside a transaction. Reads (`idempotent`) are tried again when
    /// the connection broke; a mutation never is, since it may have been applied.
    pub(crate) async fn query(
        &self,
        template: &'static str,
        params: &[&(dyn ToSql + Sync)],
        idempotent: bool,
    ) -> Result<Vec<tokio_postgres::Row>> {
        self.ensure_ready()?;
        let sql = self.sql(template);
        let mut tries = 0u32;
        loop {
            match self.send_once(&sql, params).await {
                Ok(rows) => return Ok(rows),
                Err(e) if tries < 3 && (e.is_retryable() || (idempotent && e.is_connection())) => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(u64::from(tries) * 50)).await;
                }
                Err(e) => return Err(self.failed(e)),
            }
        }
    }

    /// Sends one statement (its own transaction) on a pooled connection, prepared once per
    /// connection.
    pub(crate) async fn send_once(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> std::result::Result<Vec<tokio_postgres::Row>, PgError> {
        let client = self.client().await?;
        let st = client.prepare_cached(sql).await?;
        Ok(client.query(&st, params).await?)
    }

    pub(crate) async fn query_opt(
        &self,
        template: &'static str,
        params: &[&(dyn ToSql + Sync)],
        idempotent: bool,
    ) -> Result<Option<tokio_postgres::Row>> {
        Ok(self
            .query(template, params, idempotent)
            .await?
            .into_iter()
            .next())
    }

    /// After a commit: queues the notifications that tell other nodes what it freed
    /// (`everything`: too much to name). The `LISTEN` task sends them.
    pub(crate) fn announce(&self, freed: &[Resource], everything: bool) {
        if freed.is_empty() && !everything {
            return;
        }
        {
            let mut outbox = self.inner.outbox.lock();
            outbox.everything |= everything;
            if !outbox.everything {
                outbox
                    .payloads
                    .extend(freed.iter().map(Resource::to_payload));
            }
            if outbox.payloads.len() > NOTIFY_EACH_MAX {
                outbox.everything = true;
            }
            if outbox.everything {
                outbox.payloads.clear();
            }
        }
        self.inner.outbox_ready.notify_one();
    }

    /// The notifications gathered since the last call, as payloads: by name, or one `*`.
    pub(crate) fn take_outbox(&self) -> Vec<String> {
        let outbox = std::mem::take(&mut *self.inner.outbox.lock());
        if outbox.everything {
            vec!["*".into()]
        } else {
            outbox.payloads.into_iter().collect()
        }
    }

    /// After a commit: announce what was freed to other nodes, wake this node's waiters of
    /// it, count the sessions ended.
    pub(crate) fn committed(&self, after: After) {
        self.inner.db_ok.store(true, Ordering::SeqCst);
        self.announce(&after.freed, after.everything);
        if after.everything {
            self.inner.waiting.wake_all();
        }
        for r in &after.freed {
            self.inner.waiting.wake(r);
        }
        self.tally(&after.ended);
        if after.everything {
            // What was not named cannot move the gauges one by one: the next housekeeping
            // round (or the end of the reap) refreshes them from the database.
            self.inner.gauges_stale.store(true, Ordering::SeqCst);
        }
    }

    /// Moves this node's gauges by what it changed itself; the periodic refresh brings in
    /// what other nodes changed.
    pub(crate) fn gauge_queue(&self, queue: &str, state: &'static str, delta: i64) {
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

    pub(crate) fn gauge_seats(&self, pool: &str, delta: i64) {
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

    pub(crate) fn tally(&self, ended: &[Ended]) {
        for e in ended {
            self.inner.metrics.count_ends(EndCounts {
                by_reason: e.by_reason,
                locks: e.locks as u64,
                seats: e.seats as u64,
                recovered: e.recovered as u64,
                failed: &e.failed,
            });
            if let Some(freed) = &e.listed {
                for pool in &freed.pools {
                    self.gauge_seats(pool, -1);
                }
                for queue in &freed.recovered {
                    self.gauge_queue(queue, "claimed", -1);
                    self.gauge_queue(queue, "queued", 1);
                }
                for queue in &freed.failed {
                    self.gauge_queue(queue, "claimed", -1);
                    self.gauge_queue(queue, "failed", 1);
                }
            }
        }
    }

    pub(crate) fn wait_deadline(&self, wait_ms: u64) -> Option<Mono> {
        let wait = wait_ms.min(self.inner.config.max_wait_ms);
        (wait > 0).then(|| self.inner.clock.now().plus_ms(wait))
    }

    pub(crate) fn waiting(&self) -> &Waiting {
        &self.inner.waiting
    }

    pub(crate) fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    pub(crate) fn class(&self) -> i32 {
        self.inner.class
    }

    pub(crate) fn channel(&self) -> &str {
        &self.inner.channel
    }

    /// The current revision (what a read-only answer reports).
    pub async fn revision(&self) -> Result<u64> {
        let row = self
            .query_opt(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {ns}.revision",
                &[],
                true,
            )
            .await?;
        Ok(row.map_or(0, |r| r.get::<_, i64>(0) as u64))
    }

    /// Refreshes the gauges from the database: other nodes change what they count.
    pub(crate) async fn refresh_gauges(&self) -> Result<()> {
        self.inner.gauges_stale.store(false, Ordering::SeqCst);
        let m = &self.inner.metrics;
        if let Some(row) = self
            .query_opt(
                "SELECT (SELECT count(*) FROM {ns}.session), (SELECT count(*) FROM {ns}.lock)",
                &[],
                true,
            )
            .await?
        {
            m.sessions_active.set(row.get(0));
            m.locks_held.set(row.get(1));
        }
        let pools = self.pools().await?;
        let names: Vec<String> = pools.iter().map(|p| p.0.clone()).collect();
        for (name, capacity, in_use) in &pools {
            m.set_pool(name, Some((*capacity, *in_use)));
        }
        let old = std::mem::replace(&mut *self.inner.gauge_pools.lock(), names.clone());
        for gone in old.iter().filter(|p| !names.contains(p)) {
            m.set_pool(gone, None);
        }
        let queues = self.all_queue_counts().await?;
        let names: Vec<String> = queues.iter().map(|q| q.0.clone()).collect();
        for (queue, counts) in queues {
            m.set_queue(&queue, counts);
        }
        let old = std::mem::replace(&mut *self.inner.gauge_queues.lock(), names.clone());
        for gone in old.iter().filter(|q| !names.contains(q)) {
            m.set_queue(gone, crate::domain::QueueCounts::default());
        }
        Ok(())
    }

    pub fn ready(&self) -> bool {
        let i = &self.inner;
        i.schema_ready.load(Ordering::SeqCst)
            && i.db_ok.load(Ordering::SeqCst)
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
        self.inner.pool.close();
    }

    pub async fn check(&self) -> Result<CheckReport> {
        self.ensure_ready()?;
        let client = self.client().await.map_err(|e| self.failed(e))?;
        check(&client, &self.inner.namespace)
            .await
            .map_err(|e| self.failed(e))
    }
}

/// Checks every invariant of the stored state of `namespace`; used by the backend and by
/// `leasehold check --backend postgres`.
pub async fn check(
    client: &tokio_postgres::Client,
    namespace: &str,
) -> std::result::Result<CheckReport, PgError> {
    let ns = schema::quoted(namespace);
    let q = |s: &str| s.replace("{ns}", &ns);
    let mut report = CheckReport::default();
    let version = schema::current_version(client, namespace).await?;
    if version != schema::VERSION {
        report.problems.push(format!(
            "schema {namespace:?} is at version {version}, this build knows {}",
            schema::VERSION
        ));
        if version == 0 {
            return Ok(report);
        }
    }
    let row = client
        .query_one(
            &q(
                "SELECT (SELECT count(*) FROM {ns}.session), (SELECT count(*) FROM {ns}.lock),
                       (SELECT count(*) FROM {ns}.event),
                       (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {ns}.revision)",
            ),
            &[],
        )
        .await?;
    report.sessions = row.get::<_, i64>(0) as u64;
    report.locks = row.get::<_, i64>(1) as u64;
    report.events = row.get::<_, i64>(2) as u64;
    report.revision = row.get::<_, i64>(3) as u64;
    let checks: &[&str] = &[
        "SELECT 'lock ' || l.key || ' is held by session ' || l.session_id || ' which does not exist'
         FROM {ns}.lock l LEFT JOIN {ns}.session s ON s.id = l.session_id WHERE s.id IS NULL LIMIT 100",
        "SELECT 'seat in ' || st.pool || ' is held by session ' || st.session_id || ' which does not exist'
         FROM {ns}.seat st LEFT JOIN {ns}.session s ON s.id = st.session_id WHERE s.id IS NULL LIMIT 100",
        "SELECT 'seat of ' || st.session_id || ' is in pool ' || st.pool || ' which does not exist'
         FROM {ns}.seat st LEFT JOIN {ns}.pool p ON p.name = st.pool WHERE p.name IS NULL LIMIT 100",
        "SELECT 'job ' || j.id || ' is claimed by session ' || coalesce(j.claim_session::text, 'none') || ' which does not exist'
         FROM {ns}.job j LEFT JOIN {ns}.session s ON s.id = j.claim_session
         WHERE j.status = 'claimed' AND s.id IS NULL LIMIT 100",
        "SELECT 'job ' || id || ' is ' || status || ' but names a claiming session'
         FROM {ns}.job WHERE status <> 'claimed' AND claim_session IS NOT NULL LIMIT 100",
        "SELECT 'job ' || id || ' was recovered more often than its cap'
         FROM {ns}.job WHERE recovery_count > max_recoveries LIMIT 100",
        "SELECT 'pool ' || p.name || ' granted ' || count(*) || ' seats since its capacity was set to ' || p.capacity
         FROM {ns}.pool p JOIN {ns}.seat st ON st.pool = p.name AND st.token > p.revision
         GROUP BY p.name, p.capacity HAVING count(*) > p.capacity",
        "SELECT t.what || ' has token ' || t.token || ' above the revision sequence ' || r.v
         FROM (SELECT 'lock ' || key AS what, token FROM {ns}.lock
               UNION ALL SELECT 'seat in ' || pool || ' of ' || session_id, token FROM {ns}.seat
               UNION ALL SELECT 'job ' || id, token FROM {ns}.job WHERE token IS NOT NULL) t,
              (SELECT CASE WHEN is_called THEN last_value ELSE 0 END AS v FROM {ns}.revision) r
         WHERE t.token > r.v LIMIT 100",
        "SELECT 'session ' || id || ' expires before it was created'
         FROM {ns}.session WHERE expires_at <= created_at LIMIT 100",
        "SELECT 'event ' || e.seq || ' is numbered above the event counter ' || c.last
         FROM {ns}.event e, {ns}.event_counter c WHERE e.seq > c.last LIMIT 100",
        "SELECT 'the event counter has ' || count(*) || ' rows, not one'
         FROM {ns}.event_counter HAVING count(*) <> 1",
    ];
    for sql in checks {
        for row in client.query(&q(sql), &[]).await? {
            report.problems.push(row.get(0));
        }
    }
    Ok(report)
}

/// Each operation is one transaction in the shared database; waiting is node-local, in
/// [`crate::backend::waiting`].
impl Backend for Postgres {
    fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    fn acting_as(&self, actor: Option<Arc<str>>) -> Postgres {
        Postgres {
            inner: self.inner.clone(),
            actor,
        }
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    fn ready(&self) -> bool {
        Postgres::ready(self)
    }

    fn ends(&self) -> Arc<tokio::sync::Notify> {
        self.inner.ends.clone()
    }

    fn begin_drain(&self) {
        Postgres::begin_drain(self)
    }

    fn shutdown(&self) {
        Postgres::shutdown(self)
    }

    async fn open_as(
        &self,
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession> {
        Postgres::open_as(self, id, owner, ttl_ms, metadata).await
    }

    async fn heartbeat(&self, id: SessionId, ttl_ms: Option<u64>) -> Result<Beat> {
        Postgres::heartbeat(self, id, ttl_ms).await
    }

    async fn end(&self, id: SessionId, reason: EndReason) -> Result<Option<Closed>> {
        Postgres::end(self, id, reason).await
    }

    async fn session(&self, id: SessionId) -> Result<Option<SessionInfo>> {
        Postgres::session(self, id).await
    }

    async fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> Result<SessionPage> {
        Postgres::sessions(self, owner, after, limit).await
    }

    async fn acquire(&self, id: SessionId, key: LockKey, wait_ms: u64) -> Result<Granted> {
        Postgres::acquire(self, id, key, wait_ms).await
    }

    async fn release(&self, id: SessionId, key: LockKey, token: Token) -> Result<u64> {
        Postgres::release(self, id, key, token).await
    }

    async fn lock(&self, key: &LockKey) -> Result<Option<LockRecord>> {
        Postgres::lock(self, key).await
    }

    async fn locks(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LockPage> {
        Postgres::locks(self, prefix, after, limit).await
    }

    async fn fence(&self, key: &LockKey, token: Token) -> Result<Fence> {
        Postgres::fence(self, key, token).await
    }

    async fn put_pool(
        &self,
        name: PoolName,
        capacity: u64,
        metadata: Option<String>,
    ) -> Result<PoolPut> {
        Postgres::put_pool(self, name, capacity, metadata).await
    }

    async fn delete_pool(&self, name: PoolName) -> Result<u64> {
        Postgres::delete_pool(self, name).await
    }

    async fn pool(&self, name: &PoolName) -> Result<Option<PoolInfo>> {
        Postgres::pool(self, name).await
    }

    async fn pools(&self) -> Result<Vec<(String, u32, usize)>> {
        Postgres::pools(self).await
    }

    async fn acquire_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
    ) -> Result<Granted> {
        Postgres::acquire_seat(self, id, pool, metadata, wait_ms).await
    }

    async fn release_seat(&self, id: SessionId, pool: PoolName, token: Token) -> Result<u64> {
        Postgres::release_seat(self, id, pool, token).await
    }

    async fn enqueue(&self, job: NewJob) -> Result<(JobId, u64)> {
        Postgres::enqueue(self, job).await
    }

    async fn claim(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
    ) -> Result<Option<Claimed>> {
        Postgres::claim(self, id, queue, wait_ms).await
    }

    async fn finish_job(
        &self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
    ) -> Result<u64> {
        Postgres::finish_job(self, id, job, token, finish).await
    }

    async fn once(&self, request: Request, op: Mutation) -> Result<Answer> {
        Postgres::once(self, request, op).await
    }

    async fn requeue(&self, job: JobId) -> Result<u64> {
        Postgres::requeue(self, job).await
    }

    async fn raise_token_floor(&self, floor: u64) -> Result<FloorRaised> {
        Postgres::raise_token_floor(self, floor).await
    }

    async fn job(&self, id: JobId) -> Result<Option<(JobRecord, String)>> {
        Postgres::job(self, id).await
    }

    async fn queue(&self, name: &QueueName) -> Result<QueueInfo> {
        Postgres::queue(self, name).await
    }

    async fn queue_jobs(
        &self,
        queue: &QueueName,
        state: &JobStatus,
        after: Option<JobId>,
        limit: usize,
    ) -> Result<JobPage> {
        Postgres::queue_jobs(self, queue, state, after, limit).await
    }

    async fn events(&self, after: u64, limit: usize) -> Result<(Vec<Event>, Option<u64>)> {
        Postgres::events(self, after, limit).await
    }

    async fn reap_now(&self) -> Result<ReapOutcome> {
        Postgres::reap_now(self).await
    }

    async fn reap_dry_run(&self, limit: usize) -> Result<Vec<DueSession>> {
        Postgres::reap_dry_run(self, limit).await
    }

    async fn revision(&self) -> Result<u64> {
        Postgres::revision(self).await
    }

    async fn check(&self) -> Result<CheckReport> {
        Postgres::check(self).await
    }
}

impl Postgres {
    /// Runs one statement of a transaction, prepared once per connection.
    pub(crate) async fn q(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        template: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> std::result::Result<Vec<tokio_postgres::Row>, PgError> {
        let st = tx.prepare_cached(&self.sql(template)).await?;
        Ok(tx.query(&st, params).await?)
    }

    pub(crate) async fn q_one(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        template: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> std::result::Result<Option<tokio_postgres::Row>, PgError> {
        Ok(self.q(tx, template, params).await?.into_iter().next())
    }
}
