//! The harness the integration tests share: a real server on port 0, in this process, on the
//! backend a test asks for, driven by a manual clock.
//!
//! - Embedded: a fresh data directory.
//! - PostgreSQL (`LEASEHOLD_TEST_POSTGRES_URL`, default
//!   `postgres://postgres@127.0.0.1:5432/test`): a fresh namespace `t_<random hex>`, dropped
//!   when the server stops (best effort, also when a test panics). The backend takes all its
//!   time from `{namespace}.db_now()`; on a manual clock the harness pins that function to
//!   the manual clock's starting wall time plus everything advanced since, so that both
//!   backends read the same instants and a deadline is met exactly, not "about" — real time
//!   passing between two requests must not move the database clock.
//! - Redis (`LEASEHOLD_TEST_REDIS_URL`, default `redis://127.0.0.1:6379/0`): a fresh namespace
//!   `t_<random hex>` whose keys are deleted when the server stops (best effort, also when a
//!   test panics). The machine's Redis keeps nothing on disk, so these servers run with
//!   `redis_allow_volatile`. On a manual clock the harness pins the script clock through the
//!   test-only key `{namespace}:!clock`, set before the server starts and moved by `advance`.
#![allow(dead_code)]

pub mod calls;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use leasehold::app::App;
use leasehold::backend::embedded::store::Store;
use leasehold::backend::embedded::store::fault::FaultSwitch;
use leasehold::client::{Client, Reply, segment};
use leasehold::clock::{Clock, ManualClock, SystemClock};
pub use leasehold::config::BackendKind;
use leasehold::config::Config;
use leasehold::domain::UnixMs;
use serde_json::{Value, json};
use tempfile::TempDir;

#[allow(unused_imports)]
pub use calls::*;

/// The manual clock's wall time at start-up, in Unix milliseconds.
pub const BASE: u64 = 1_700_000_000_000;

/// The database the PostgreSQL variants run against.
pub fn postgres_url() -> String {
    std::env::var("LEASEHOLD_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

/// The Redis the Redis variants run against.
pub fn redis_url() -> String {
    std::env::var("LEASEHOLD_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379/0".to_string())
}

/// Which clock a test server runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockKind {
    /// Moves only when the test calls `advance`.
    Manual,
    /// The real clock, for waits measured in real time.
    Real,
}

pub struct TestServer {
    pub app: Option<App>,
    pub client: Client,
    pub kind: BackendKind,
    /// The manual clock, when the server runs on one.
    pub clock: Option<ManualClock>,
    pub config: Config,
    pub dir: TempDir,
    /// The PostgreSQL side, on that backend.
    db: Option<Database>,
    /// The Redis side, on that backend.
    pub keys: Option<Keyspace>,
}

/// A configuration for tests: port 0, a fresh directory, and no background reaper, so that
/// expiry happens only when a test advances the clock and asks for it.
pub fn test_config(dir: &TempDir) -> Config {
    Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.path().to_path_buf(),
        reaper_enabled: false,
        cache_size_bytes: 4 * 1024 * 1024,
        ..Config::default()
    }
}

/// A fresh namespace: `t_` and 16 random hex digits.
pub fn fresh_namespace() -> String {
    format!("t_{}", &uuid::Uuid::new_v4().simple().to_string()[..16])
}

impl TestServer {
    /// An embedded server on a manual clock.
    pub async fn start() -> TestServer {
        TestServer::start_with(|_| {}).await
    }

    /// An embedded server on a manual clock, with its configuration tweaked.
    pub async fn start_with(tweak: impl FnOnce(&mut Config)) -> TestServer {
        TestServer::start_on(BackendKind::Embedded, tweak).await
    }

    /// An embedded server on the real clock (for waits measured in real time).
    pub async fn start_real(tweak: impl FnOnce(&mut Config)) -> TestServer {
        TestServer::start_clocked(BackendKind::Embedded, ClockKind::Real, tweak).await
    }

    /// A server on `kind`, on a manual clock.
    pub async fn start_on(kind: BackendKind, tweak: impl FnOnce(&mut Config)) -> TestServer {
        TestServer::start_clocked(kind, ClockKind::Manual, tweak).await
    }

    /// A server on `kind` and on the given clock: on the real clock the database clock is
    /// left as the backend made it.
    pub async fn start_clocked(
        kind: BackendKind,
        clock: ClockKind,
        tweak: impl FnOnce(&mut Config),
    ) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(&dir);
        config.backend = kind;
        if kind == BackendKind::Postgres {
            config.postgres_url = Some(postgres_url());
            config.namespace = fresh_namespace();
        }
        if kind == BackendKind::Redis {
            config.redis_url = Some(redis_url());
            config.redis_allow_volatile = true;
            config.namespace = fresh_namespace();
        }
        tweak(&mut config);
        let keys = match kind {
            BackendKind::Redis => {
                let keys = Keyspace::connect(&config.namespace, clock == ClockKind::Manual).await;
                keys.pin_clock().await;
                Some(keys)
            }
            _ => None,
        };
        let manual = match clock {
            ClockKind::Manual => Some(ManualClock::new(UnixMs(BASE))),
            ClockKind::Real => None,
        };
        let as_clock: Arc<dyn Clock> = match &manual {
            Some(c) => Arc::new(c.clone()),
            None => Arc::new(SystemClock::new()),
        };
        let app = App::start(&config, as_clock)
            .await
            .unwrap_or_else(|e| panic!("the {kind:?} server did not start: {e}"));
        let db = match kind {
            BackendKind::Postgres => {
                let db = Database::connect(&config.namespace, manual.is_some()).await;
                db.pin_clock().await;
                Some(db)
            }
            BackendKind::Embedded | BackendKind::Redis => None,
        };
        let client = Client::new(&app.url()).unwrap();
        TestServer {
            app: Some(app),
            client,
            kind,
            clock: manual,
            config,
            dir,
            db,
            keys,
        }
    }

    /// An embedded server whose storage writes can be made to fail.
    pub async fn start_faulty() -> (TestServer, FaultSwitch) {
        let dir = tempfile::tempdir().unwrap();
        let config = test_config(&dir);
        let (store, switch) =
            Store::open_with_faults(&config.data_dir, config.cache_size_bytes).unwrap();
        let clock = ManualClock::new(UnixMs(BASE));
        let app = App::start_with_store(&config, Arc::new(clock.clone()), store)
            .await
            .unwrap();
        let client = Client::new(&app.url()).unwrap();
        let s = TestServer {
            app: Some(app),
            client,
            kind: BackendKind::Embedded,
            clock: Some(clock),
            config,
            dir,
            db: None,
            keys: None,
        };
        (s, switch)
    }

    pub fn url(&self) -> String {
        self.app.as_ref().unwrap().url()
    }

    pub fn clock(&self) -> &ManualClock {
        self.clock
            .as_ref()
            .expect("this server runs on a manual clock")
    }

    pub fn is_postgres(&self) -> bool {
        self.kind == BackendKind::Postgres
    }

    /// Moves time forward by `ms`: the manual clock, and on PostgreSQL the database clock,
    /// which moves first, so that the node never reads a time the database has not reached.
    pub async fn advance(&self, ms: u64) {
        let clock = self.clock();
        if let Some(db) = &self.db {
            db.advanced.fetch_add(ms, Ordering::SeqCst);
            db.pin_clock().await;
        }
        if let Some(keys) = &self.keys {
            keys.advanced.fetch_add(ms, Ordering::SeqCst);
            keys.pin_clock().await;
        }
        clock.advance(ms);
    }

    /// Stops the server and starts it again on the same data directory or namespace (and
    /// clock).
    pub async fn restart(&mut self) {
        self.app.take().unwrap().shutdown().await;
        let clock: Arc<dyn Clock> = match &self.clock {
            Some(c) => Arc::new(c.clone()),
            None => Arc::new(SystemClock::new()),
        };
        let app = App::start(&self.config, clock).await.unwrap();
        // A backend may define its clock function afresh as it starts.
        if let Some(db) = &self.db {
            db.pin_clock().await;
        }
        self.client = Client::new(&app.url()).unwrap();
        self.app = Some(app);
    }

    pub async fn stop(mut self) {
        if let Some(app) = self.app.take() {
            app.shutdown().await;
        }
        if let Some(db) = self.db.take() {
            db.drop_namespace().await;
        }
        if let Some(keys) = self.keys.take() {
            keys.delete_all().await;
        }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.client.get(path).await.unwrap()
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.client.post(path, &body).await.unwrap()
    }

    pub async fn delete(&self, path: &str) -> Reply {
        self.client.delete(path).await.unwrap()
    }

    /// Opens a session and returns its id.
    pub async fn open(&self, owner: &str, ttl_ms: u64) -> String {
        let r = self
            .post("/v1/sessions", json!({"owner": owner, "ttl_ms": ttl_ms}))
            .await;
        assert_eq!(r.status, 201, "{}", r.text);
        r.body["session_id"].as_str().unwrap().to_string()
    }

    pub async fn acquire(&self, key: &str, session: &str) -> Reply {
        self.post(
            &format!("/v1/locks/{}/acquire", segment(key)),
            json!({"session_id": session}),
        )
        .await
    }

    pub async fn release(&self, key: &str, session: &str, token: u64) -> Reply {
        self.post(
            &format!("/v1/locks/{}/release", segment(key)),
            json!({"session_id": session, "token": token}),
        )
        .await
    }

    pub async fn heartbeat(&self, session: &str) -> Reply {
        self.post(&format!("/v1/sessions/{session}/heartbeat"), json!({}))
            .await
    }

    pub async fn reap(&self) -> Reply {
        self.post("/v1/admin/reap", json!({"dry_run": false})).await
    }
}

impl Drop for TestServer {
    /// A test that panicked never reached `stop`: drop its namespace anyway, best effort.
    fn drop(&mut self) {
        if let Some(keys) = self.keys.take() {
            // A connection of its own: the test's runtime may be unwinding.
            let namespace = keys.namespace.clone();
            drop(keys);
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    Keyspace::connect(&namespace, false)
                        .await
                        .delete_all()
                        .await
                });
            })
            .join();
        }
        if let Some(db) = self.db.take() {
            let namespace = db.namespace.clone();
            drop(db);
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    if let Ok((client, conn)) =
                        tokio_postgres::connect(&postgres_url(), tokio_postgres::NoTls).await
                    {
                        tokio::spawn(conn);
                        let _ = client
                            .batch_execute(&format!(
                                "SET lock_timeout = '2s'; DROP SCHEMA IF EXISTS {namespace} CASCADE"
                            ))
                            .await;
                    }
                });
            })
            .join();
        }
    }
}

/// The test's own connection to the PostgreSQL database of a server.
struct Database {
    client: tokio_postgres::Client,
    namespace: String,
    /// Whether the database clock follows the manual clock.
    pinned: bool,
    /// Milliseconds advanced since the start.
    advanced: AtomicU64,
}

impl Database {
    async fn connect(namespace: &str, pinned: bool) -> Database {
        let (client, conn) = tokio_postgres::connect(&postgres_url(), tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {}: {e}", postgres_url()));
        tokio::spawn(conn);
        Database {
            client,
            namespace: namespace.to_string(),
            pinned,
            advanced: AtomicU64::new(0),
        }
    }

    /// Redefines `{namespace}.db_now()` to read `BASE` plus what was advanced, in the
    /// language and volatility the backend gave it; on the real clock, only checks that the
    /// backend made it (so that a server that is not on PostgreSQL fails every test).
    async fn pin_clock(&self) {
        let Some((language, volatility)) = self.clock_function().await else {
            panic!(
                "the PostgreSQL backend made no {}.db_now(): is the server running on PostgreSQL?",
                self.namespace
            );
        };
        if !self.pinned {
            return;
        }
        let at = BASE + self.advanced.load(Ordering::SeqCst);
        let instant = format!("timestamptz 'epoch' + interval '1 millisecond' * {at}");
        let body = match language.as_str() {
            "plpgsql" => format!("BEGIN RETURN {instant}; END"),
            _ => format!("SELECT {instant}"),
        };
        let ns = &self.namespace;
        self.client
            .batch_execute(&format!(
                "CREATE OR REPLACE FUNCTION {ns}.db_now() RETURNS timestamptz \
                 LANGUAGE {language} {volatility} AS $$ {body} $$"
            ))
            .await
            .unwrap_or_else(|e| panic!("cannot move the clock of {ns}: {e}"));
    }

    /// The language and volatility of `{namespace}.db_now()`, if the backend made it.
    async fn clock_function(&self) -> Option<(String, &'static str)> {
        let row = self
            .client
            .query_opt(
                "SELECT l.lanname::text, p.provolatile::text FROM pg_proc p \
                 JOIN pg_language l ON l.oid = p.prolang \
                 JOIN pg_namespace n ON n.oid = p.pronamespace \
                 WHERE n.nspname = $1 AND p.proname = 'db_now'",
                &[&self.namespace],
            )
            .await
            .unwrap()?;
        let language: String = row.get(0);
        let volatility = match row.get::<_, String>(1).as_str() {
            "i" => "IMMUTABLE",
            "s" => "STABLE",
            _ => "VOLATILE",
        };
        Some((language, volatility))
    }

    async fn drop_namespace(self) {
        let _ = self
            .client
            .batch_execute(&format!(
                "SET lock_timeout = '2s'; DROP SCHEMA IF EXISTS {} CASCADE",
                self.namespace
            ))
            .await;
    }
}

/// The test's own connection to the Redis of a server, and its namespace.
pub struct Keyspace {
    pub conn: redis::aio::MultiplexedConnection,
    pub namespace: String,
    /// Whether the script clock follows the manual clock.
    pinned: bool,
    /// Milliseconds advanced since the start.
    advanced: AtomicU64,
}

impl Keyspace {
    pub async fn connect(namespace: &str, pinned: bool) -> Keyspace {
        let client = redis::Client::open(redis_url()).unwrap();
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("cannot reach Redis at {}: {e}", redis_url()));
        Keyspace {
            conn,
            namespace: namespace.to_string(),
            pinned,
            advanced: AtomicU64::new(0),
        }
    }

    /// Sets the test-only clock key to `BASE` plus what was advanced (on the real clock,
    /// leaves the scripts on Redis's `TIME`).
    pub async fn pin_clock(&self) {
        if !self.pinned {
            return;
        }
        let at = BASE + self.advanced.load(Ordering::SeqCst);
        let _: () = redis::cmd("SET")
            .arg(format!("{}:!clock", self.namespace))
            .arg(at)
            .query_async(&mut self.conn.clone())
            .await
            .unwrap_or_else(|e| panic!("cannot move the clock of {}: {e}", self.namespace));
    }

    /// Every key of the namespace.
    pub async fn keys(&self) -> Vec<String> {
        let mut conn = self.conn.clone();
        let mut cursor = 0u64;
        let mut out = Vec::new();
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}:*", self.namespace))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .unwrap();
            out.extend(batch);
            if next == 0 {
                return out;
            }
            cursor = next;
        }
    }

    pub async fn delete_all(self) {
        let keys = self.keys().await;
        let mut conn = self.conn.clone();
        for chunk in keys.chunks(500) {
            let _: redis::RedisResult<()> =
                redis::cmd("DEL").arg(chunk).query_async(&mut conn).await;
        }
    }
}
