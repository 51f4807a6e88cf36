//! Tests against the real database (`LEASEHOLD_TEST_POSTGRES_URL`, by default the local
//! server), each in a fresh schema dropped at the end, even when the test fails.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio_postgres::error::SqlState;

use super::schema::{self, MigrateError};
use super::{PgSettings, Postgres, StartError};
use crate::backend::BackendError;
use crate::backend::EngineConfig;
use crate::clock::ManualClock;
use crate::domain::{
    EndReason, EventKind, Finish, JobStatus, LockKey, NewJob, SessionId, Token, UnixMs,
};
use crate::metrics::Metrics;

fn url() -> String {
    std::env::var("LEASEHOLD_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".into())
}

fn key(s: &str) -> LockKey {
    LockKey::parse("key", s).unwrap()
}

async fn connect() -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
        .await
        .expect("the tests need PostgreSQL at LEASEHOLD_TEST_POSTGRES_URL");
    tokio::spawn(conn);
    client
}

/// A fresh namespace, dropped with its schema when the value goes (a failed test too).
struct Schema(String);

impl Schema {
    fn new() -> Schema {
        Schema(format!("t_{:032x}", uuid::Uuid::new_v4().as_u128()))
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let ns = self.0.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok((c, conn)) = tokio_postgres::connect(&url(), tokio_postgres::NoTls).await
                {
                    tokio::spawn(conn);
                    // Bounded: a failed test may leave a transaction holding locks in the
                    // schema; the drop then gives up rather than hang the test run.
                    let _ = c
                        .batch_execute(&format!(
                            "SET lock_timeout = '20s'; DROP SCHEMA IF EXISTS \"{ns}\" CASCADE"
                        ))
                        .await;
                }
            });
        })
        .join();
    }
}

fn settings(ns: &str) -> PgSettings {
    PgSettings {
        url: url(),
        namespace: ns.to_string(),
        pool_size: 8,
        statement_timeout_ms: 5_000,
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        reaper_enabled: false,
        ..EngineConfig::default()
    }
}

struct Harness {
    pg: Postgres,
    clock: ManualClock,
    admin: tokio_postgres::Client,
    schema: Schema,
}

impl Harness {
    async fn start() -> Harness {
        Harness::with(config()).await
    }

    async fn with(config: EngineConfig) -> Harness {
        let schema = Schema::new();
        let clock = ManualClock::new(UnixMs(1_700_000_000_000));
        let pg = Postgres::start(
            config,
            settings(&schema.0),
            Arc::new(clock.clone()),
            Arc::new(Metrics::new()),
        )
        .await
        .unwrap();
        Harness {
            pg,
            clock,
            admin: connect().await,
            schema,
        }
    }

    /// A second node on the same schema.
    async fn node(&self, config: EngineConfig) -> Postgres {
        Postgres::start(
            config,
            settings(&self.schema.0),
            Arc::new(self.clock.clone()),
            Arc::new(Metrics::new()),
        )
        .await
        .unwrap()
    }

    /// Moves the database clock `ms` ahead of the real one.
    async fn shift(&self, ms: u64) {
        self.admin
            .batch_execute(&format!(
                "CREATE OR REPLACE FUNCTION \"{}\".db_now() RETURNS timestamptz
                 LANGUAGE sql STABLE AS $$ SELECT now() + interval '{ms} milliseconds' $$",
                self.schema.0
            ))
            .await
            .unwrap();
    }

    async fn count(&self, table: &str) -> i64 {
        self.admin
            .query_one(
                &format!("SELECT count(*) FROM \"{}\".{table}", self.schema.0),
                &[],
            )
            .await
            .unwrap()
            .get(0)
    }

    async fn open(&self, ttl: u64) -> SessionId {
        self.pg
            .open("test".into(), Some(ttl), None)
            .await
            .unwrap()
            .id
    }

    async fn events(&self) -> Vec<crate::domain::Event> {
        let mut out = Vec::new();
        let mut after = 0;
        loop {
            let (page, next) = self.pg.events(after, 1000).await.unwrap();
            if page.is_empty() {
                return out;
            }
            after = next.unwrap();
            out.extend(page);
        }
    }

    async fn assert_consistent(&self) {
        let report = self.pg.check().await.unwrap();
        assert!(report.problems.is_empty(), "{:?}", report.problems);
    }

    fn stop(self) {
        self.pg.shutdown();
    }
}

#[tokio::test]
async fn migrations_are_idempotent_and_safe_to_start_together() {
    let schema = Schema::new();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let ns = schema.0.clone();
        tasks.push(tokio::spawn(async move {
            let (mut c, conn) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            schema::migrate(&mut c, &ns).await.unwrap()
        }));
    }
    let mut found = Vec::new();
    for t in tasks {
        found.push(t.await.unwrap());
    }
    found.sort();
    // One node applied everything; the others waited and found it done.
    assert_eq!(
        found,
        vec![0, schema::VERSION, schema::VERSION, schema::VERSION]
    );
    let mut c = connect().await;
    assert_eq!(
        schema::migrate(&mut c, &schema.0).await.unwrap(),
        schema::VERSION
    );
    let rows: i64 = c
        .query_one(
            &format!("SELECT count(*) FROM \"{}\".schema_version", schema.0),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, i64::from(schema::VERSION));
}

#[tokio::test]
async fn a_node_refuses_a_schema_newer_than_it_knows() {
    let h = Harness::start().await;
    h.admin
        .batch_execute(&format!(
            "INSERT INTO \"{}\".schema_version VALUES (999, now())",
            h.schema.0
        ))
        .await
        .unwrap();
    let mut c = connect().await;
    let err = schema::migrate(&mut c, &h.schema.0).await.unwrap_err();
    assert!(
        matches!(err, MigrateError::TooNew { found: 999, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("newer"), "{err}");
    let started = Postgres::start(
        config(),
        settings(&h.schema.0),
        Arc::new(h.clock.clone()),
        Arc::new(Metrics::new()),
    )
    .await;
    assert!(matches!(
        started,
        Err(StartError::Migrate(MigrateError::TooNew { .. }))
    ));
    h.stop();
}

/// A heartbeat that upserted would resurrect a reaped session whose locks are gone. Gone is
/// terminal: said once the end is durable, said again forever, and no row is created.
#[tokio::test]
async fn heartbeat_gone_is_terminal_and_creates_no_row() {
    let h = Harness::start().await;
    let id = h.open(1_000).await;
    h.pg.acquire(id, key("k"), 0).await.unwrap();
    let beat = h.pg.heartbeat(id, None).await.unwrap();
    assert_eq!(beat.ttl_ms, 1_000);
    h.shift(1_500).await;
    assert!(matches!(
        h.pg.heartbeat(id, None).await,
        Err(BackendError::SessionGone)
    ));
    // The end was made durable before "gone" was said: the row and its lock are gone.
    assert_eq!(h.count("session").await, 0);
    assert_eq!(h.count("lock").await, 0);
    for ttl in [None, Some(5_000), Some(1)] {
        assert!(matches!(
            h.pg.heartbeat(id, ttl).await,
            Err(BackendError::SessionGone)
        ));
    }
    assert_eq!(h.count("session").await, 0);
    assert!(h.pg.heartbeat(SessionId::random(), None).await.is_err());
    assert_eq!(h.count("session").await, 0);
    let events = h.events().await;
    let ended: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::SessionExpired)
        .collect();
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].session_id, Some(id));
    assert_eq!(ended[0].released.len(), 1);
    h.assert_consistent().await;
    h.stop();
}

/// The clock is one SQL function; redefining it must reach statements already prepared
/// (and planned generically) on pooled connections, or tests of expiry would lie.
#[tokio::test]
async fn redefining_db_now_moves_expiry_for_prepared_statements() {
    let h = Harness::start().await;
    let id = h.open(10_000).await;
    for _ in 0..12 {
        h.pg.heartbeat(id, None).await.unwrap();
    }
    let other = h.open(60_000).await;
    let g = h.pg.acquire(id, key("k"), 0).await.unwrap();
    assert!(h.pg.fence(&key("k"), g.token).await.unwrap().current);
    h.shift(20_000).await;
    assert!(!h.pg.fence(&key("k"), g.token).await.unwrap().current);
    assert!(h.pg.session(id).await.unwrap().is_none());
    assert!(matches!(
        h.pg.heartbeat(id, None).await,
        Err(BackendError::SessionGone)
    ));
    assert!(h.pg.session(other).await.unwrap().is_some());
    h.stop();
}

#[tokio::test]
async fn closing_cascades_to_locks_and_seats_with_one_event() {
    let h = Harness::start().await;
    let a = h.open(10_000).await;
    let t1 = h.pg.acquire(a, key("x"), 0).await.unwrap().token;
    let t2 = h.pg.acquire(a, key("y"), 0).await.unwrap().token;
    h.pg.put_pool(key("p"), 2, None).await.unwrap();
    h.pg.acquire_seat(a, key("p"), None, 0).await.unwrap();
    let info = h.pg.session(a).await.unwrap().unwrap();
    assert_eq!(info.locks.len(), 2);
    assert_eq!(info.seats.len(), 1);
    let closed = h.pg.end(a, EndReason::Closed).await.unwrap().unwrap();
    assert_eq!((closed.released, closed.seats), (2, 1));
    assert_eq!(h.count("lock").await, 0);
    assert_eq!(h.count("seat").await, 0);
    assert!(h.pg.end(a, EndReason::Closed).await.unwrap().is_none());
    let events = h.events().await;
    let closes: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::SessionClosed)
        .collect();
    assert_eq!(closes.len(), 1);
    let released: Vec<_> = closes[0].released.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(released, vec!["x", "y"]);
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == EventKind::SeatReclaimed)
            .count(),
        1
    );
    // The keys are free again, and the next tokens are greater.
    let b = h.open(10_000).await;
    assert!(h.pg.acquire(b, key("x"), 0).await.unwrap().token > t1.max(t2));
    assert!(matches!(
        h.pg.acquire(a, key("z"), 0).await,
        Err(BackendError::SessionGone)
    ));
    h.assert_consistent().await;
    h.stop();
}

/// A connection of its own and its backend's process id, to watch it in `pg_stat_activity`.
async fn connect_watched() -> (tokio_postgres::Client, i32) {
    let c = connect().await;
    let pid = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    (c, pid)
}

/// Waits until the backend `pid`, running `statement`, waits for a row lock (or gives up after
/// ten seconds); fails if the statement finishes first, without having waited.
async fn until_waiting_for_a_lock<T>(
    admin: &tokio_postgres::Client,
    pid: i32,
    statement: &tokio::task::JoinHandle<T>,
) {
    for _ in 0..1_000 {
        assert!(
            !statement.is_finished(),
            "backend {pid}'s statement finished without waiting for the lock"
        );
        let waiting: Option<String> = admin
            .query_opt(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .unwrap()
            .and_then(|r| r.get(0));
        if waiting.as_deref() == Some("Lock") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("backend {pid} never waited for a lock");
}

/// The references of schema version 7, kept by the cascade trigger and the reference checks
/// as foreign keys kept them: a session row deleted by hand (no end statement) takes its locks
/// and seats with it, several at once; a delete of a session a job still names is refused
/// and changes nothing; a lock, seat or claim naming a session that does not exist is
/// refused.
#[tokio::test]
async fn the_triggers_keep_every_reference_a_foreign_key_kept() {
    let h = Harness::start().await;
    let ns = format!("\"{}\"", h.schema.0);
    h.pg.put_pool(key("p"), 5, None).await.unwrap();
    let mut holders = Vec::new();
    for i in 0..3 {
        let s = h.open(60_000).await;
        h.pg.acquire(s, key(&format!("x{i}")), 0).await.unwrap();
        h.pg.acquire(s, key(&format!("y{i}")), 0).await.unwrap();
        h.pg.acquire_seat(s, key("p"), None, 0).await.unwrap();
        holders.push(s.0);
    }
    let worker = h.open(60_000).await;
    h.pg.acquire(worker, key("w"), 0).await.unwrap();
    let queue = key("q");
    h.pg.enqueue(NewJob {
        queue: queue.clone(),
        payload: "{}".into(),
        idempotent: true,
        max_recoveries: None,
        kind: None,
    })
    .await
    .unwrap();
    h.pg.claim(worker, queue, 0).await.unwrap().unwrap();

    // One statement deletes three holders: their six locks and three seats go with them.
    let deleted = h
        .admin
        .execute(
            &format!("DELETE FROM {ns}.session WHERE id = ANY ($1)"),
            &[&holders],
        )
        .await
        .unwrap();
    assert_eq!(deleted, 3);
    assert_eq!(h.count("lock").await, 1, "only the worker's lock is left");
    assert_eq!(h.count("seat").await, 0);

    // The worker still claims a job: its delete is refused, and its lock stays.
    let refused = h
        .admin
        .execute(
            &format!("DELETE FROM {ns}.session WHERE id = $1"),
            &[&worker.0],
        )
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Some(&SqlState::FOREIGN_KEY_VIOLATION),
        "{refused}"
    );
    assert_eq!(h.count("session").await, 1);
    assert_eq!(h.count("lock").await, 1);

    // Grants for a session that does not exist.
    let missing = uuid::Uuid::new_v4();
    for sql in [
        format!("INSERT INTO {ns}.lock (key, session_id, token) VALUES ('z', $1, 1)"),
        format!("INSERT INTO {ns}.seat (pool, session_id, token) VALUES ('p', $1, 1)"),
        format!("UPDATE {ns}.job SET claim_session = $1"),
    ] {
        let refused = h.admin.execute(&sql, &[&missing]).await.unwrap_err();
        assert_eq!(
            refused.code(),
            Some(&SqlState::FOREIGN_KEY_VIOLATION),
            "{sql}: {refused}"
        );
    }
    assert_eq!(h.count("lock").await, 1);
    assert_eq!(h.count("seat").await, 0);
    h.assert_consistent().await;
    h.stop();
}

/// A grant and a delete of its session racing, as with a foreign key: a grant written first
/// holds the session row until its commit, so the delete waits and its cascade then removes
/// the grant; a grant written after the delete waits for it and is refused. Either way no
/// grant outlives its session. (Several worker threads: should an assertion fail while a
/// transaction is open, its connection is still driven, and closes as the client drops.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_racing_the_delete_of_its_session_never_outlives_it() {
    let h = Harness::start().await;
    let ns = format!("\"{}\"", h.schema.0);
    let grant = format!(
        "INSERT INTO {ns}.lock (key, session_id, token) VALUES ($1, $2, nextval('{ns}.revision'))"
    );
    let delete = format!("DELETE FROM {ns}.session WHERE id = $1");

    // The grant first: the delete waits for its commit, then removes it.
    let s = h.open(60_000).await;
    let granter = connect().await;
    granter.batch_execute("BEGIN").await.unwrap();
    granter.execute(&grant, &[&"first", &s.0]).await.unwrap();
    let (deleter, pid) = connect_watched().await;
    let waiting = {
        let delete = delete.clone();
        tokio::spawn(async move { deleter.execute(&delete, &[&s.0]).await })
    };
    until_waiting_for_a_lock(&h.admin, pid, &waiting).await;
    granter.batch_execute("COMMIT").await.unwrap();
    assert_eq!(waiting.await.unwrap().unwrap(), 1);
    assert_eq!(h.count("lock").await, 0);

    // The delete first: the grant waits for its commit, then is refused.
    let s = h.open(60_000).await;
    let deleter = connect().await;
    deleter.batch_execute("BEGIN").await.unwrap();
    assert_eq!(deleter.execute(&delete, &[&s.0]).await.unwrap(), 1);
    let (granter, pid) = connect_watched().await;
    let waiting = tokio::spawn(async move { granter.execute(&grant, &[&"second", &s.0]).await });
    until_waiting_for_a_lock(&h.admin, pid, &waiting).await;
    deleter.batch_execute("COMMIT").await.unwrap();
    let refused = waiting.await.unwrap().unwrap_err();
    assert_eq!(
        refused.code(),
        Some(&SqlState::FOREIGN_KEY_VIOLATION),
        "{refused}"
    );
    assert_eq!(h.count("lock").await, 0);
    h.assert_consistent().await;
    h.stop();
}

/// Many tasks on two nodes take and give back one key; in grant order the tokens must
/// strictly increase, and each must exceed every token acknowledged before its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_strictly_increase_under_concurrent_grants() {
    let h = Harness::start().await;
    let other = h.node(config()).await;
    let grants: Arc<Mutex<Vec<(u64, u64)>>> = Arc::new(Mutex::new(Vec::new()));
    let acked = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..12 {
        let pg = if i % 2 == 0 {
            h.pg.clone()
        } else {
            other.clone()
        };
        let (grants, acked) = (grants.clone(), acked.clone());
        tasks.push(tokio::spawn(async move {
            let id = pg.open("t".into(), Some(60_000), None).await.unwrap().id;
            for _ in 0..15 {
                let before = acked.load(std::sync::atomic::Ordering::SeqCst);
                let g = pg.acquire(id, key("hot"), 10_000).await.unwrap();
                // Only the holder gets here, so the list is in grant order.
                grants.lock().push((g.token.0, before));
                acked.fetch_max(g.token.0, std::sync::atomic::Ordering::SeqCst);
                pg.release(id, key("hot"), g.token).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let grants = grants.lock().clone();
    assert_eq!(grants.len(), 180);
    for pair in grants.windows(2) {
        assert!(pair[1].0 > pair[0].0, "tokens out of order: {pair:?}");
    }
    for (token, before) in &grants {
        assert!(token > before);
    }
    other.shutdown();
    h.assert_consistent().await;
    h.stop();
}

#[tokio::test]
async fn a_contender_ends_an_expired_holder_and_gets_the_key() {
    let h = Harness::start().await;
    let a = h.open(1_000).await;
    let b = h.open(60_000).await;
    let old = h.pg.acquire(a, key("k"), 0).await.unwrap().token;
    assert!(matches!(
        h.pg.acquire(b, key("k"), 0).await,
        Err(BackendError::LockHeld)
    ));
    h.shift(1_500).await;
    let got = h.pg.acquire(b, key("k"), 0).await.unwrap();
    assert!(got.token > old);
    assert_eq!(h.pg.lock(&key("k")).await.unwrap().unwrap().session_id, b);
    assert!(h.pg.session(a).await.unwrap().is_none());
    let events = h.events().await;
    let expired: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::SessionExpired)
        .collect();
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].session_id, Some(a));
    assert_eq!(expired[0].released[0].token, old);
    h.assert_consistent().await;
    h.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn capacity_holds_under_concurrent_seat_takers() {
    let h = Harness::start().await;
    let other = h.node(config()).await;
    h.pg.put_pool(key("licences"), 3, Some("{\"team\":\"a\"}".into()))
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..24 {
        let pg = if i % 2 == 0 {
            h.pg.clone()
        } else {
            other.clone()
        };
        tasks.push(tokio::spawn(async move {
            let id = pg.open("t".into(), Some(60_000), None).await.unwrap().id;
            (id, pg.acquire_seat(id, key("licences"), None, 0).await)
        }));
    }
    let mut holders = Vec::new();
    for t in tasks {
        let (id, r) = t.await.unwrap();
        match r {
            Ok(g) => holders.push((id, g.token)),
            Err(BackendError::PoolExhausted { capacity: 3, .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(holders.len(), 3);
    // Asking again returns the same seat.
    let (id, token) = holders[0];
    assert_eq!(
        h.pg.acquire_seat(id, key("licences"), None, 0)
            .await
            .unwrap()
            .token,
        token
    );
    let info = h.pg.pool(&key("licences")).await.unwrap().unwrap();
    assert_eq!((info.capacity, info.in_use), (3, 3));
    // A resize keeps created_at and metadata.
    h.pg.put_pool(key("licences"), 5, None).await.unwrap();
    let resized = h.pg.pool(&key("licences")).await.unwrap().unwrap();
    assert_eq!(resized.created_at, info.created_at);
    assert_eq!(resized.metadata, info.metadata);
    assert!(matches!(
        h.pg.delete_pool(key("licences")).await,
        Err(BackendError::PoolInUse(3))
    ));
    other.shutdown();
    h.assert_consistent().await;
    h.stop();
}

#[tokio::test]
async fn ending_a_session_recovers_or_fails_its_jobs() {
    let h = Harness::start().await;
    let queue = key("builds");
    let job = |idempotent| NewJob {
        queue: queue.clone(),
        payload: "{\"n\":1}".into(),
        idempotent,
        max_recoveries: Some(1),
        kind: None,
    };
    let (idem, _) = h.pg.enqueue(job(true)).await.unwrap();
    let (plain, _) = h.pg.enqueue(job(false)).await.unwrap();
    let (third, _) = h.pg.enqueue(job(true)).await.unwrap();
    let a = h.open(1_000).await;
    let c1 = h.pg.claim(a, queue.clone(), 0).await.unwrap().unwrap();
    let c2 = h.pg.claim(a, queue.clone(), 0).await.unwrap().unwrap();
    assert_eq!((c1.job, c2.job), (idem, plain));
    h.shift(1_500).await;
    let out = h.pg.reap_now().await.unwrap();
    assert_eq!((out.sessions, out.jobs), (1, 2));
    let (rec, payload) = h.pg.job(idem).await.unwrap().unwrap();
    assert!(matches!(rec.status, JobStatus::Queued));
    assert_eq!(rec.recovery_count, 1);
    assert_eq!(payload, "{\"n\":1}");
    let (rec, _) = h.pg.job(plain).await.unwrap().unwrap();
    assert_eq!(
        rec.status,
        JobStatus::Failed {
            reason: "not_idempotent".into()
        }
    );
    // The old claim is stale; the recovered job is at the head, before the third.
    assert!(matches!(
        h.pg.finish_job(a, idem, c1.token, Finish::Release).await,
        Err(BackendError::StaleToken)
    ));
    let b = h.open(60_000).await;
    let again = h.pg.claim(b, queue.clone(), 0).await.unwrap().unwrap();
    assert_eq!(again.job, idem);
    assert_eq!((again.attempt, again.recovery_count), (2, 1));
    // At the cap, the next ending fails it.
    h.pg.end(b, EndReason::Admin).await.unwrap().unwrap();
    let (rec, _) = h.pg.job(idem).await.unwrap().unwrap();
    assert_eq!(
        rec.status,
        JobStatus::Failed {
            reason: "max_recoveries_exceeded".into()
        }
    );
    h.pg.requeue(idem).await.unwrap();
    assert!(matches!(
        h.pg.requeue(third).await,
        Err(BackendError::JobNotFailed)
    ));
    let counts = h.pg.queue(&queue).await.unwrap().counts;
    assert_eq!((counts.queued, counts.failed), (2, 1));
    let c = h.open(60_000).await;
    let next = h.pg.claim(c, queue.clone(), 0).await.unwrap().unwrap();
    assert_eq!(next.job, third);
    h.pg.finish_job(
        c,
        third,
        next.token,
        Finish::Complete {
            result: "{}".into(),
        },
    )
    .await
    .unwrap();
    let events = h.events().await;
    let kinds = |k| events.iter().filter(|e| e.kind == k).count();
    assert_eq!(kinds(EventKind::JobRecovered), 1);
    assert_eq!(kinds(EventKind::JobFailed), 2);
    assert_eq!(kinds(EventKind::JobCompleted), 1);
    h.assert_consistent().await;
    h.stop();
}

/// A sequence number taken at insert commits out of order, and a cursor past a later one
/// never sees the earlier. Readers tail the log while many writers commit; every reader
/// must see every event, in one gapless order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_event_cursor_never_skips_under_concurrent_writers() {
    let h = Harness::start().await;
    let other = h.node(config()).await;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for i in 0..8 {
        let pg = if i % 2 == 0 {
            h.pg.clone()
        } else {
            other.clone()
        };
        writers.push(tokio::spawn(async move {
            for j in 0..25 {
                let id = pg
                    .open(format!("w{i}"), Some(60_000), None)
                    .await
                    .unwrap()
                    .id;
                let k = key(&format!("k{i}-{j}"));
                let g = pg.acquire(id, k.clone(), 0).await.unwrap();
                pg.release(id, k, g.token).await.unwrap();
                pg.end(id, EndReason::Closed).await.unwrap();
            }
        }));
    }
    let mut readers = Vec::new();
    for i in 0..2 {
        let pg = if i == 0 { h.pg.clone() } else { other.clone() };
        let done = done.clone();
        readers.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut after = 0;
            loop {
                let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                let (page, next) = pg.events(after, 7).await.unwrap();
                if let Some(n) = next {
                    after = n;
                }
                let empty = page.is_empty();
                seen.extend(page.into_iter().map(|e| e.seq));
                if finished && empty {
                    return seen;
                }
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let all: Vec<u64> = h.events().await.iter().map(|e| e.seq).collect();
    assert_eq!(all.len(), 8 * 25 * 4);
    assert_eq!(all, (1..=all.len() as u64).collect::<Vec<_>>());
    for r in readers {
        assert_eq!(r.await.unwrap(), all);
    }
    other.shutdown();
    h.stop();
}

/// Two nodes reaping one schema at once: every expired session is ended, and audited,
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_reapers_end_each_session_exactly_once() {
    let small = EngineConfig {
        reaper_batch: 50,
        ..config()
    };
    let h = Harness::with(small.clone()).await;
    let other = h.node(small.clone()).await;
    let mut ids = HashSet::new();
    for i in 0..300 {
        let id = h.open(1_000).await;
        h.pg.acquire(id, key(&format!("r{i}")), 0).await.unwrap();
        ids.insert(id);
    }
    h.shift(2_000).await;
    let (a, b) = tokio::join!(h.pg.reap_now(), other.reap_now());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.sessions + b.sessions, 300);
    assert_eq!(a.locks + b.locks, 300);
    let events = h.events().await;
    let mut ended: BTreeMap<SessionId, usize> = BTreeMap::new();
    for e in events
        .iter()
        .filter(|e| e.kind == EventKind::SessionExpired)
    {
        *ended.entry(e.session_id.unwrap()).or_default() += 1;
    }
    assert_eq!(ended.len(), 300);
    assert!(ended.values().all(|n| *n == 1));
    assert!(ended.keys().all(|id| ids.contains(id)));
    assert_eq!(h.count("lock").await, 0);
    // A background reaper on a node does the same without being asked.
    let bg = h
        .node(EngineConfig {
            reaper_enabled: true,
            reaper_interval_ms: 50,
            ..small
        })
        .await;
    let late = h.open(1_000).await;
    h.shift(4_000).await;
    // Expiry is judged on the pinned database clock; only the reaper's wake-ups run on real
    // time (every 50 ms). The bound says "it ran at all", so it is generous: a loaded
    // two-core machine once took longer than 5 s to schedule the pass.
    tokio::time::timeout(Duration::from_secs(60), async {
        while h.count("session").await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();
    assert!(h.pg.session(late).await.unwrap().is_none());
    bg.shutdown();
    other.shutdown();
    h.assert_consistent().await;
    h.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_served_in_order_across_nodes() {
    let h = Harness::start().await;
    let other = h.node(config()).await;
    let holder = h.open(60_000).await;
    let g = h.pg.acquire(holder, key("w"), 0).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..3 {
        let pg = other.clone();
        let order = order.clone();
        let id = h.open(60_000).await;
        tasks.push(tokio::spawn(async move {
            let got = pg.acquire(id, key("w"), 20_000).await.unwrap();
            order.lock().push(i);
            pg.release(id, key("w"), got.token).await.unwrap();
        }));
        while other
            .waiting()
            .waiting(&crate::backend::waiting::Resource::Lock(key("w")))
            < i + 1
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // Freed on one node, the notification wakes the other's first waiter.
    h.pg.release(holder, key("w"), g.token).await.unwrap();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(*order.lock(), vec![0, 1, 2]);
    // A wait runs out on the injected clock, and a drain answers waiters at once.
    let c = h.open(60_000).await;
    let d = h.open(60_000).await;
    h.pg.acquire(c, key("w"), 0).await.unwrap();
    let pg = other.clone();
    let waiter = tokio::spawn(async move { pg.acquire(d, key("w"), 5_000).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.clock.advance(5_000);
    assert!(matches!(
        tokio::time::timeout(Duration::from_secs(2), waiter)
            .await
            .unwrap()
            .unwrap(),
        Err(BackendError::LockHeld)
    ));
    let pg = other.clone();
    let waiter = tokio::spawn(async move { pg.acquire(d, key("w"), 50_000).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    other.begin_drain();
    assert!(matches!(
        tokio::time::timeout(Duration::from_secs(2), waiter)
            .await
            .unwrap()
            .unwrap(),
        Err(BackendError::ShuttingDown)
    ));
    assert!(!other.ready());
    other.shutdown();
    h.stop();
}

#[tokio::test]
async fn an_unreachable_database_leaves_the_node_unready_not_failed() {
    let schema = Schema::new();
    let pg = Postgres::start(
        config(),
        PgSettings {
            url: "postgres://leasehold:secret@127.0.0.1:1/none".into(),
            ..settings(&schema.0)
        },
        Arc::new(ManualClock::new(UnixMs(0))),
        Arc::new(Metrics::new()),
    )
    .await
    .unwrap();
    assert!(!pg.ready());
    match pg.open("a".into(), None, None).await {
        Err(BackendError::Unavailable(m)) => assert!(!m.contains("secret"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(pg.events(0, 10).await.unwrap_err().is_outcome_unknown());
    pg.shutdown();
}

#[tokio::test]
async fn reads_lists_and_dry_run_match_the_embedded_shapes() {
    let h = Harness::start().await;
    let a = h.open(3_000).await;
    let b =
        h.pg.open("bob".into(), Some(60_000), Some("{\"h\":1}".into()))
            .await
            .unwrap()
            .id;
    for k in ["app/a", "app/b", "app_c", "other"] {
        h.pg.acquire(a, key(k), 0).await.unwrap();
    }
    let (page, next) = h.pg.locks("app/", None, 1).await.unwrap();
    assert_eq!(page[0].0, "app/a");
    assert_eq!(next.as_deref(), Some("app/a"));
    let (page, next) = h.pg.locks("app/", Some("app/a"), 10).await.unwrap();
    assert_eq!(
        page.iter().map(|p| p.0.as_str()).collect::<Vec<_>>(),
        vec!["app/b"]
    );
    assert_eq!(next, None);
    let (sessions, _) = h.pg.sessions(Some("bob"), None, 10).await.unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].record.metadata, "{\"h\": 1}");
    assert_eq!(sessions[0].id, b);
    h.shift(1_100).await;
    assert!(h.pg.session(a).await.unwrap().unwrap().grace);
    h.shift(3_100).await;
    let due = h.pg.reap_dry_run(10).await.unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].locks.len(), 4);
    assert_eq!(h.count("session").await, 2);
    let f = h.pg.fence(&key("other"), Token(1)).await.unwrap();
    assert!(!f.current);
    assert!(h.pg.revision().await.unwrap() >= 6);
    h.stop();
}

/// Fills a fresh schema with `n` sessions already past their deadline, each holding one
/// lock, written in bulk.
async fn expired_sessions_with_locks(h: &Harness, n: i64) {
    h.admin
        .batch_execute(&format!(
            "INSERT INTO \"{ns}\".session (id, owner, ttl_ms, expires_at)
             SELECT gen_random_uuid(), 'bulk', 1000, \"{ns}\".db_now() + interval '1 second'
             FROM generate_series(1, {n});
             INSERT INTO \"{ns}\".lock (key, session_id, token)
             SELECT 'bulk/' || id, id, nextval('\"{ns}\".revision') FROM \"{ns}\".session;
             ANALYZE \"{ns}\".session, \"{ns}\".lock;",
            ns = h.schema.0
        ))
        .await
        .unwrap();
    h.shift(2_000).await;
}

/// The mass-expiry figure: `cargo test --release --lib reaper_keeps_up -- --ignored
/// --nocapture`. 100 000 expired sessions with one lock each, freed by the reaper (audit
/// events, job settling and all) against a plain batched DELETE of the same rows on the same
/// tables (whose cascade, since schema 7, is the schema's set-based trigger; the raw design
/// with a foreign key is `reaper_pass_profile`'s and `benches/compare`'s baseline); each
/// side's best of three, interleaved, so that load from elsewhere on the machine weighs on
/// both alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: about two minutes"]
async fn reaper_keeps_up_with_a_plain_cascading_delete() {
    const N: i64 = 100_000;
    let (mut plain, mut reaped) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        let baseline = Harness::start().await;
        expired_sessions_with_locks(&baseline, N).await;
        let started = std::time::Instant::now();
        loop {
            let n = baseline
                .admin
                .execute(
                    &format!(
                        "DELETE FROM \"{ns}\".session WHERE id IN (SELECT id FROM \"{ns}\".session
                         WHERE expires_at <= \"{ns}\".db_now() LIMIT 10000)",
                        ns = baseline.schema.0
                    ),
                    &[],
                )
                .await
                .unwrap();
            if n == 0 {
                break;
            }
        }
        plain = plain.min(started.elapsed());
        assert_eq!(baseline.count("lock").await, 0);
        baseline.stop();

        let h = Harness::start().await;
        expired_sessions_with_locks(&h, N).await;
        let started = std::time::Instant::now();
        let out = h.pg.reap_now().await.unwrap();
        reaped = reaped.min(started.elapsed());
        assert_eq!((out.sessions, out.locks), (N as usize, N as usize));
        assert_eq!(h.count("lock").await, 0);
        assert_eq!(h.count("event").await, N);
        h.stop();
    }
    let ratio = reaped.as_secs_f64() / plain.as_secs_f64();
    println!(
        "{N} expired sessions with a lock each, best of 3: plain cascading delete {:.0} ms, reaper {:.0} ms ({ratio:.2}x)",
        plain.as_secs_f64() * 1e3,
        reaped.as_secs_f64() * 1e3
    );
    assert!(ratio < 1.5, "the reaper took {ratio:.2}x the plain delete");
}

/// PostgreSQL restarting drops every connection: requests in flight fail as unavailable
/// (never a wrong answer), the pool reconnects, and the node serves again on its own.
#[tokio::test]
async fn lost_connections_are_unavailable_then_reconnected() {
    let h = Harness::start().await;
    let id = h.open(60_000).await;
    let g = h.pg.acquire(id, key("k"), 0).await.unwrap();
    h.admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("leasehold/{}", h.schema.0)],
        )
        .await
        .unwrap();
    // Every answer is either right or unavailable; within a few tries the pool has new
    // connections and the answers are right again.
    let mut served = false;
    for _ in 0..50 {
        match h.pg.fence(&key("k"), g.token).await {
            Ok(f) => {
                assert!(f.current);
                served = true;
                break;
            }
            Err(BackendError::Unavailable(_)) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(served);
    assert_eq!(
        h.pg.acquire(id, key("k"), 0).await.unwrap().token,
        g.token,
        "the grant survived"
    );
    tokio::time::timeout(Duration::from_secs(5), async {
        while !h.pg.ready() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap();
    h.stop();
}

/// A statement that waits past statement_timeout is cancelled by the server: the client is
/// told the backend is unavailable (the outcome of a mutation unknown), and nothing hangs.
#[tokio::test]
async fn a_statement_past_its_timeout_is_unavailable() {
    let schema = Schema::new();
    let clock = ManualClock::new(UnixMs(0));
    let pg = Postgres::start(
        config(),
        PgSettings {
            statement_timeout_ms: 300,
            ..settings(&schema.0)
        },
        Arc::new(clock),
        Arc::new(Metrics::new()),
    )
    .await
    .unwrap();
    let id = pg.open("a".into(), Some(60_000), None).await.unwrap().id;
    let mut admin = connect().await;
    let tx = admin.transaction().await.unwrap();
    tx.execute(
        &format!(
            "SELECT 1 FROM \"{}\".session WHERE id = $1 FOR UPDATE",
            schema.0
        ),
        &[&id.0],
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let r = pg.heartbeat(id, None).await;
    assert!(matches!(&r, Err(e) if e.is_outcome_unknown()), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    tx.rollback().await.unwrap();
    assert!(pg.heartbeat(id, None).await.is_ok());
    assert!(pg.ready());
    pg.shutdown();
}

/// Nodes creating one pool at once: exactly one creates it, the others resize it; a shrink
/// below the seats in use takes none away and grants no more until use falls below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_puts_race_safely_and_shrinking_takes_no_seat() {
    let h = Harness::start().await;
    let other = h.node(config()).await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let pg = if i % 2 == 0 {
            h.pg.clone()
        } else {
            other.clone()
        };
        tasks.push(tokio::spawn(async move {
            pg.put_pool(key("p"), 2, None).await.unwrap().created
        }));
    }
    let mut created = 0;
    for t in tasks {
        created += usize::from(t.await.unwrap());
    }
    assert_eq!(created, 1);
    let a = h.open(60_000).await;
    let b = h.open(1_000).await;
    let c = h.open(60_000).await;
    let ta = h.pg.acquire_seat(a, key("p"), None, 0).await.unwrap().token;
    h.pg.acquire_seat(b, key("p"), None, 0).await.unwrap();
    h.pg.put_pool(key("p"), 1, None).await.unwrap();
    assert_eq!(h.pg.pool(&key("p")).await.unwrap().unwrap().in_use, 2);
    assert!(matches!(
        h.pg.acquire_seat(c, key("p"), None, 0).await,
        Err(BackendError::PoolExhausted {
            capacity: 1,
            in_use: 2
        })
    ));
    // The expired holder does not keep the pool alive, but the live one does.
    h.shift(1_500).await;
    assert!(matches!(
        h.pg.delete_pool(key("p")).await,
        Err(BackendError::PoolInUse(1))
    ));
    h.pg.release_seat(a, key("p"), ta).await.unwrap();
    assert!(h.pg.acquire_seat(c, key("p"), None, 0).await.is_ok());
    assert!(matches!(
        h.pg.release_seat(a, key("p"), ta).await,
        Err(BackendError::NotHolder)
    ));
    assert!(matches!(
        h.pg.acquire_seat(a, key("nope"), None, 0).await,
        Err(BackendError::PoolNotFound)
    ));
    other.shutdown();
    h.assert_consistent().await;
    h.stop();
}

/// The audit log once showed a seat granted to the second waiter before the first: event ids
/// came from a per-connection cache of the id sequence, so a later transaction on one
/// connection drew a smaller id than an earlier one on another, and numbering by id put its
/// event first. Each open below commits before the next begins, on alternating connections.
#[tokio::test]
async fn events_are_numbered_in_causal_order_across_connections() {
    let h = Harness::start().await;
    let node = |pool_size| {
        Postgres::start(
            config(),
            PgSettings {
                pool_size,
                ..settings(&h.schema.0)
            },
            Arc::new(h.clock.clone()),
            Arc::new(Metrics::new()),
        )
    };
    let (a, b) = (node(1).await.unwrap(), node(1).await.unwrap());
    let mut opened = Vec::new();
    for i in 0..6 {
        let n = if i % 2 == 0 { &a } else { &b };
        opened.push(n.open("test".into(), Some(60_000), None).await.unwrap().id);
    }
    let logged: Vec<SessionId> = h
        .events()
        .await
        .into_iter()
        .filter(|e| e.kind == crate::domain::EventKind::SessionOpened)
        .filter_map(|e| e.session_id)
        .collect();
    assert_eq!(logged, opened);
    a.shutdown();
    b.shutdown();
    h.stop();
}

/// A namespace an older release created (schema version 1: the acquire as several
/// statements, jobs' claiming sessions under NO ACTION) is brought to the current version by
/// a node starting on it, and keeps its sessions, locks, claimed jobs, audit log and tokens:
/// the next grant's token is above the old ones, and the old job claim still settles when
/// its session ends.
#[tokio::test]
async fn a_namespace_at_version_1_migrates_and_keeps_its_data() {
    let schema = Schema::new();
    let mut c = connect().await;
    assert_eq!(schema::migrate_to(&mut c, &schema.0, 1).await.unwrap(), 0);
    assert_eq!(schema::current_version(&c, &schema.0).await.unwrap(), 1);
    let ns = format!("\"{}\"", schema.0);
    // The rows version 1's statements wrote: a session holding a lock and claiming a job,
    // with their events, numbered.
    c.batch_execute(&format!(
        "INSERT INTO {ns}.session (id, owner, ttl_ms, expires_at)
         VALUES ('00000000-0000-0000-0000-0000000000a1', 'old', 30000, {ns}.db_now() + interval '30 seconds');
         INSERT INTO {ns}.lock (key, session_id, token)
         VALUES ('old-key', '00000000-0000-0000-0000-0000000000a1', nextval('{ns}.revision'));
         INSERT INTO {ns}.job (id, queue, payload, idempotent, max_recoveries, ord, status,
                               claim_session, token, claimed_at, attempt)
         VALUES ('00000000-0000-0000-0000-0000000000b1', 'q', '{{}}', true, 3,
                 nextval('{ns}.job_tail'), 'claimed', '00000000-0000-0000-0000-0000000000a1',
                 nextval('{ns}.revision'), {ns}.db_now(), 1);
         INSERT INTO {ns}.event (kind, session_id, owner)
         VALUES ('session_opened', '00000000-0000-0000-0000-0000000000a1', 'old');
         INSERT INTO {ns}.event (kind, session_id, key, token)
         VALUES ('lock_acquired', '00000000-0000-0000-0000-0000000000a1', 'old-key', 1);
         SELECT {ns}.number_events(0, true, 100);"
    ))
    .await
    .unwrap();
    let old = SessionId(uuid::Uuid::from_u128(0xa1));

    let clock = ManualClock::new(UnixMs(1_700_000_000_000));
    let pg = Postgres::start(
        config(),
        settings(&schema.0),
        Arc::new(clock.clone()),
        Arc::new(Metrics::new()),
    )
    .await
    .unwrap();
    assert_eq!(
        schema::current_version(&c, &schema.0).await.unwrap(),
        schema::VERSION
    );
    let h = Harness {
        pg,
        clock,
        admin: c,
        schema,
    };
    h.assert_consistent().await;
    let rec = h.pg.lock(&key("old-key")).await.unwrap().unwrap();
    assert_eq!((rec.session_id, rec.token), (old, Token(1)));
    // The acquire of this version against the old rows: the holder is live, then past its
    // deadline and ended by the contender in its own transaction.
    let b = h.open(60_000).await;
    assert!(matches!(
        h.pg.acquire(b, key("old-key"), 0).await,
        Err(BackendError::LockHeld)
    ));
    let fresh = h.pg.acquire(b, key("new-key"), 0).await.unwrap();
    assert!(fresh.token.0 > 2);
    h.shift(31_000).await;
    let taken = h.pg.acquire(b, key("old-key"), 0).await.unwrap();
    assert!(taken.token > fresh.token);
    let (job, _) =
        h.pg.job(crate::domain::JobId(uuid::Uuid::from_u128(0xb1)))
            .await
            .unwrap()
            .unwrap();
    assert!(matches!(job.status, JobStatus::Queued));
    assert_eq!(job.recovery_count, 1);
    let events = h.events().await;
    let kinds: Vec<EventKind> = events.iter().map(|e| e.kind).collect();
    assert_eq!(
        &kinds[..2],
        &[EventKind::SessionOpened, EventKind::LockAcquired]
    );
    assert!(kinds.contains(&EventKind::JobRecovered));
    assert!(kinds.contains(&EventKind::SessionExpired));
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    h.assert_consistent().await;
    h.stop();
}

/// A namespace at schema version 2 (the release as a statement of the node's, with a row
/// lock on the session) is brought to the current version by a node starting on it, and
/// keeps its sessions, locks, tokens and audit log: the old holder releases its old grant
/// through this version's release, the revision goes on from where it was, and every event
/// is numbered once, in order.
#[tokio::test]
async fn a_namespace_at_version_2_migrates_and_keeps_its_data() {
    let schema = Schema::new();
    let mut c = connect().await;
    assert_eq!(schema::migrate_to(&mut c, &schema.0, 2).await.unwrap(), 0);
    assert_eq!(schema::current_version(&c, &schema.0).await.unwrap(), 2);
    let ns = format!("\"{}\"", schema.0);
    // What version 2 wrote: two sessions, each holding a lock granted by its acquire
    // function, their events numbered.
    c.batch_execute(&format!(
        "INSERT INTO {ns}.session (id, owner, ttl_ms, expires_at)
         VALUES ('00000000-0000-0000-0000-0000000000a1', 'old', 30000, {ns}.db_now() + interval '30 seconds'),
                ('00000000-0000-0000-0000-0000000000a2', 'old', 30000, {ns}.db_now() + interval '30 seconds');
         INSERT INTO {ns}.event (kind, session_id, owner)
         VALUES ('session_opened', '00000000-0000-0000-0000-0000000000a1', 'old'),
                ('session_opened', '00000000-0000-0000-0000-0000000000a2', 'old');
         SELECT answer FROM {ns}.acquire(0, 'old-a', '00000000-0000-0000-0000-0000000000a1', true, 100);
         SELECT answer FROM {ns}.acquire(0, 'old-b', '00000000-0000-0000-0000-0000000000a2', true, 100);
         SELECT {ns}.number_events(0, true, 100);"
    ))
    .await
    .unwrap();
    let (a, b) = (
        SessionId(uuid::Uuid::from_u128(0xa1)),
        SessionId(uuid::Uuid::from_u128(0xa2)),
    );

    let clock = ManualClock::new(UnixMs(1_700_000_000_000));
    let pg = Postgres::start(
        config(),
        settings(&schema.0),
        Arc::new(clock.clone()),
        Arc::new(Metrics::new()),
    )
    .await
    .unwrap();
    assert_eq!(
        schema::current_version(&c, &schema.0).await.unwrap(),
        schema::VERSION
    );
    let h = Harness {
        pg,
        clock,
        admin: c,
        schema,
    };
    h.assert_consistent().await;
    let held_a = h.pg.lock(&key("old-a")).await.unwrap().unwrap();
    let held_b = h.pg.lock(&key("old-b")).await.unwrap().unwrap();
    assert_eq!(held_a.session_id, a);
    assert_eq!(held_b.session_id, b);
    assert_eq!(h.pg.revision().await.unwrap(), 2);

    // The wrong token, or a session that does not hold the key, releases nothing.
    assert!(matches!(
        h.pg.release(a, key("old-a"), Token(held_a.token.0 + 7))
            .await,
        Err(BackendError::NotHolder)
    ));
    assert!(matches!(
        h.pg.release(b, key("old-a"), held_a.token).await,
        Err(BackendError::NotHolder)
    ));
    let revision = h.pg.release(a, key("old-a"), held_a.token).await.unwrap();
    assert_eq!(revision, 3);
    assert!(h.pg.lock(&key("old-a")).await.unwrap().is_none());
    let again = h.pg.acquire(b, key("old-a"), 0).await.unwrap();
    assert!(again.token.0 > revision);

    let events = h.events().await;
    let kinds: Vec<EventKind> = events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EventKind::SessionOpened,
            EventKind::SessionOpened,
            EventKind::LockAcquired,
            EventKind::LockAcquired,
            EventKind::LockReleased,
            EventKind::LockAcquired,
        ]
    );
    assert_eq!(events[4].key.as_deref(), Some("old-a"));
    assert_eq!(events[4].token, Some(held_a.token));
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    h.assert_consistent().await;
    h.stop();
}

/// A release's answers, each in the one statement: released (once: a second release of
/// the same grant is refused), not the holder, no such session; and a caller past its
/// deadline holds nothing any more, so it is refused and ended, durably, before the answer:
/// its lock is free and its end is audited once, naming the lock.
#[tokio::test]
async fn a_release_answers_in_one_statement_and_ends_a_caller_past_its_deadline() {
    let h = Harness::start().await;
    let a = h.open(1_000).await;
    let b = h.open(60_000).await;
    let t = h.pg.acquire(a, key("r1"), 0).await.unwrap().token;
    let rev = h.pg.release(a, key("r1"), t).await.unwrap();
    assert!(rev > t.0);
    assert!(matches!(
        h.pg.release(a, key("r1"), t).await,
        Err(BackendError::NotHolder)
    ));
    assert!(matches!(
        h.pg.release(SessionId::random(), key("r1"), t).await,
        Err(BackendError::NotHolder)
    ));
    let t2 = h.pg.acquire(a, key("r2"), 0).await.unwrap().token;
    assert!(matches!(
        h.pg.release(b, key("r2"), t2).await,
        Err(BackendError::NotHolder)
    ));
    h.shift(1_500).await;
    assert!(matches!(
        h.pg.release(a, key("r2"), t2).await,
        Err(BackendError::NotHolder)
    ));
    assert_eq!(h.count("session").await, 1);
    assert!(h.pg.lock(&key("r2")).await.unwrap().is_none());
    let events = h.events().await;
    let released: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::LockReleased)
        .collect();
    assert_eq!(released.len(), 1);
    assert_eq!(released[0].token, Some(t));
    let expired: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::SessionExpired)
        .collect();
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].session_id, Some(a));
    assert_eq!(expired[0].released.len(), 1);
    assert_eq!(expired[0].released[0].token, t2);
    h.assert_consistent().await;
    h.stop();
}

/// A reaper pass numbers its own events as it writes them. Story this guards: events
/// committed before the pass (opens, a release by a session the pass then ends) must come
/// before the pass's in the log, and the pass must number them first, not leave a hole or
/// reuse a number the background numbering then gives again.
#[tokio::test]
async fn a_reaper_pass_numbers_the_backlog_before_its_own_events() {
    let h = Harness::start().await;
    let a = h.open(1_000).await;
    let b = h.open(1_000).await;
    let t = h.pg.acquire(a, key("ka"), 0).await.unwrap().token;
    h.pg.acquire(b, key("kb"), 0).await.unwrap();
    h.pg.release(a, key("ka"), t).await.unwrap();
    // Numbered up to here by a read; then two more events stay unnumbered.
    let before = h.events().await.len();
    let c = h.open(60_000).await;
    h.pg.acquire(c, key("kc"), 0).await.unwrap();
    let unnumbered: i64 = h
        .admin
        .query_one(
            &format!(
                "SELECT count(*) FROM \"{}\".event WHERE seq IS NULL",
                h.schema.0
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // The background numbering may have got there first; the order holds either way.
    assert!(unnumbered <= 2);
    h.shift(1_500).await;
    let out = h.pg.reap_now().await.unwrap();
    assert_eq!((out.sessions, out.locks), (2, 1));
    let events = h.events().await;
    assert_eq!(events.len(), before + 4);
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    let kinds: Vec<EventKind> = events[before..].iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EventKind::SessionOpened,
            EventKind::LockAcquired,
            EventKind::SessionExpired,
            EventKind::SessionExpired
        ]
    );
    let ended: HashSet<_> = events[before + 2..]
        .iter()
        .map(|e| e.session_id.unwrap())
        .collect();
    assert_eq!(ended, HashSet::from([a, b]));
    let counter: i64 = h
        .admin
        .query_one(
            &format!("SELECT last FROM \"{}\".event_counter", h.schema.0),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(counter as usize, events.len());
    h.assert_consistent().await;
    h.stop();
}

/// Where a reaper pass's time goes: `cargo test --lib reaper_pass_profile -- --ignored
/// --nocapture` (the database does the work, so any build profile will do) prints `EXPLAIN (ANALYZE, BUFFERS)` of one pass's end statement over
/// 10 000 of 100 000 expired sessions with a lock each (rolled back), beside the same for a
/// batched cascading `DELETE` of 10 000 rows of the raw `lock_session`/`lock_entry` design of
/// `benches/compare` (one foreign key), filled alike.
#[tokio::test]
#[ignore = "a profile, printed; asserts nothing about time"]
async fn reaper_pass_profile() {
    const N: i64 = 100_000;
    let h = Harness::start().await;
    expired_sessions_with_locks(&h, N).await;
    let explain = |sql: String| async move {
        let c = connect().await;
        c.batch_execute("BEGIN; SET LOCAL jit = off").await.unwrap();
        let rows = c
            .query(&format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"), &[])
            .await
            .unwrap();
        c.batch_execute("ROLLBACK").await.unwrap();
        rows.iter()
            .map(|r| r.get::<_, String>(0))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let pass = super::sessions::END_DUE
        .replace("{ns}", &format!("\"{}\"", h.schema.0))
        .replace("$1", "10000")
        .replace("$2::text", "NULL::text");
    println!(
        "== one reaper pass, 10 000 of {N}:\n{}",
        explain(pass).await
    );
    let raw = format!("{}_raw", h.schema.0);
    let _dropped = Schema(raw.clone());
    h.admin
        .batch_execute(&format!(
            "CREATE SCHEMA {raw};
             CREATE TABLE {raw}.lock_session (session_id uuid PRIMARY KEY, owner_id text NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL);
             CREATE TABLE {raw}.lock_entry (lock_key text PRIMARY KEY,
                 session_id uuid NOT NULL REFERENCES {raw}.lock_session ON DELETE CASCADE,
                 token bigint NOT NULL, acquired_at timestamptz NOT NULL DEFAULT now());
             CREATE INDEX ON {raw}.lock_entry (session_id);
             CREATE INDEX ON {raw}.lock_session (expires_at);
             INSERT INTO {raw}.lock_session (session_id, owner_id, expires_at)
             SELECT gen_random_uuid(), 'bulk', now() - interval '1 second' FROM generate_series(1, {N});
             INSERT INTO {raw}.lock_entry (lock_key, session_id, token)
             SELECT 'bulk/' || session_id, session_id, 1 FROM {raw}.lock_session;
             ANALYZE {raw}.lock_session, {raw}.lock_entry;"
        ))
        .await
        .unwrap();
    let delete = format!(
        "DELETE FROM {raw}.lock_session WHERE session_id IN (SELECT session_id FROM
         {raw}.lock_session WHERE expires_at < now() LIMIT 10000)"
    );
    println!(
        "== the raw batched cascading DELETE, 10 000 of {N}:\n{}",
        explain(delete).await
    );
    h.stop();
}

/// Concurrent heartbeats, acquires and releases through one node go together in batches,
/// and each gets the answer it would get alone: live sessions extended, sessions past their
/// deadline ended before "gone" is said, tokens strictly increasing per key, nothing failed.
#[tokio::test]
async fn concurrent_calls_batched_through_one_node_each_get_their_own_answer() {
    let h = Harness::start().await;
    let mut live = Vec::new();
    for _ in 0..40 {
        live.push(h.open(60_000).await);
    }
    let mut lapsing = Vec::new();
    for _ in 0..20 {
        lapsing.push(h.open(1_000).await);
    }
    h.shift(1_500).await;

    let mut beats = Vec::new();
    for round in 0..3 {
        for (i, id) in live.iter().chain(&lapsing).enumerate() {
            let (pg, id) = (h.pg.clone(), *id);
            let ttl = (i % 2 == 0).then_some(30_000 + round);
            beats.push(tokio::spawn(async move {
                (id, ttl, pg.heartbeat(id, ttl).await)
            }));
        }
    }
    for t in beats {
        let (id, ttl, beat) = t.await.unwrap();
        if live.contains(&id) {
            let beat = beat.unwrap();
            if let Some(ttl) = ttl {
                assert_eq!(beat.ttl_ms, ttl);
            }
        } else {
            assert!(matches!(beat, Err(BackendError::SessionGone)), "{beat:?}");
        }
    }
    // "Gone" was said only once the end was durable: each lapsed session ended, once.
    assert_eq!(h.count("session").await, live.len() as i64);

    // Each live session takes and gives back its own key and a few shared ones, all at once.
    let grants: Arc<Mutex<BTreeMap<String, Vec<u64>>>> = Arc::default();
    let mut tasks = Vec::new();
    for (i, id) in live.iter().enumerate() {
        let (pg, id, grants) = (h.pg.clone(), *id, grants.clone());
        tasks.push(tokio::spawn(async move {
            for n in 0..10 {
                let name = if n % 2 == 0 {
                    format!("own/{i}")
                } else {
                    format!("shared/{}", (i + n) % 3)
                };
                let g = pg.acquire(id, key(&name), 10_000).await.unwrap();
                // Only the holder gets here, so each key's list is in grant order.
                grants
                    .lock()
                    .entry(name.clone())
                    .or_default()
                    .push(g.token.0);
                pg.release(id, key(&name), g.token).await.unwrap();
                assert!(matches!(
                    pg.release(id, key(&name), g.token).await,
                    Err(BackendError::NotHolder)
                ));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let grants = grants.lock().clone();
    assert_eq!(grants.values().map(Vec::len).sum::<usize>(), 400);
    for (name, tokens) in &grants {
        for pair in tokens.windows(2) {
            assert!(pair[1] > pair[0], "{name}: tokens out of order: {pair:?}");
        }
    }
    assert_eq!(h.count("lock").await, 0);
    // Every grant and release is in the audit log once, numbered without a gap, each release
    // after its grant, whether its batch numbered it or the numbering did.
    let events = h.events().await;
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    let mut at = std::collections::HashMap::new();
    for e in &events {
        if matches!(e.kind, EventKind::LockAcquired | EventKind::LockReleased) {
            let first = at.insert(
                (e.token.unwrap().0, e.kind == EventKind::LockAcquired),
                e.seq,
            );
            assert!(first.is_none(), "twice in the log: {e:?}");
        }
    }
    assert_eq!(at.len(), 800);
    for token in grants.values().flatten() {
        assert!(at[&(*token, true)] < at[&(*token, false)], "token {token}");
    }
    let largest = &h.pg.inner.batches.largest;
    for (kind, n) in ["heartbeats", "acquires", "releases"].iter().zip(largest) {
        let n = n.load(std::sync::atomic::Ordering::Relaxed);
        assert!(n > 1, "no two {kind} went together");
    }
    h.assert_consistent().await;
    h.stop();
}

/// An element of a batch never waits for a lock another transaction holds: it is answered
/// `busy` (and the node sends it alone), while the others are answered as alone.
#[tokio::test]
async fn a_batch_element_whose_lock_is_held_elsewhere_is_busy_not_waiting() {
    let h = Harness::start().await;
    let (a, b) = (h.open(60_000).await, h.open(60_000).await);
    let ns = &h.schema.0;
    let mut other = connect().await;
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "SELECT pg_advisory_xact_lock($1, hashtext('taken'))",
        &[&h.pg.class()],
    )
    .await
    .unwrap();
    let rows = h
        .admin
        .query(
            &format!(
                "SELECT answer, granted FROM \"{ns}\".acquire_many($1, $2::text[], $3::uuid[], 8)"
            ),
            &[
                &h.pg.class(),
                &vec!["free", "taken", "free", "other"],
                &vec![a.0, b.0, b.0, b.0],
            ],
        )
        .await
        .unwrap();
    let answers: Vec<&str> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(answers, ["granted", "busy", "held", "granted"]);
    tx.rollback().await.unwrap();
    let token: i64 = rows[0].get(1);

    // The lock row of `free` locked by another transaction: its release is busy; a release
    // of a key without a row, and one of a row nobody locks, are answered as alone.
    let tx = other.transaction().await.unwrap();
    tx.execute(
        &format!("SELECT 1 FROM \"{ns}\".lock WHERE key = 'free' FOR UPDATE"),
        &[],
    )
    .await
    .unwrap();
    let other_token: i64 = rows[3].get(1);
    let rows = h
        .admin
        .query(
            &format!(
                "SELECT answer FROM \"{ns}\".release_many($1::text[], $2::uuid[], $3::bigint[])"
            ),
            &[
                &vec!["free", "nothing", "other", "other"],
                &vec![a.0, a.0, b.0, b.0],
                &vec![token, 1, other_token, other_token],
            ],
        )
        .await
        .unwrap();
    let answers: Vec<&str> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(answers, ["busy", "not_holder", "released", "not_holder"]);
    tx.rollback().await.unwrap();
    assert_eq!(h.count("lock").await, 1);
    h.stop();
}

/// A batch whose keys and sessions are all distinct goes the set-based way (schema version
/// 9): every element is answered exactly as alone, whatever mix of outcomes it holds, and
/// only the grants and releases it made are audited.
#[tokio::test]
async fn a_batch_of_distinct_keys_and_sessions_answers_each_element_as_alone() {
    let h = Harness::start().await;
    let ns = &h.schema.0;
    let class = h.pg.class();
    let mut ids = Vec::new();
    for _ in 0..7 {
        ids.push(h.open(60_000).await);
    }
    let [a, b, c, d, e, f, g] = [ids[0], ids[1], ids[2], ids[3], ids[4], ids[5], ids[6]];
    let x = h.open(1_000).await;
    h.shift(1_500).await;
    let held = h.pg.acquire(d, key("held"), 0).await.unwrap().token.0 as i64;
    let own = h.pg.acquire(f, key("f-own"), 0).await.unwrap().token.0 as i64;
    let has = h.pg.acquire(e, key("e-has"), 0).await.unwrap().token.0 as i64;

    // Another transaction holds the advisory lock of `k-taken` and the row of session `c`.
    let mut other = connect().await;
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "SELECT pg_advisory_xact_lock($1, hashtext('k-taken'))",
        &[&class],
    )
    .await
    .unwrap();
    tx.execute(
        &format!("SELECT 1 FROM \"{ns}\".session WHERE id = $1 FOR UPDATE"),
        &[&c.0],
    )
    .await
    .unwrap();
    let gone = uuid::Uuid::new_v4();
    let rows = h
        .admin
        .query(
            &format!(
                "SELECT answer, granted, held FROM \"{ns}\".acquire_many($1, $2::text[], $3::uuid[], 1)"
            ),
            &[
                &class,
                &vec!["k-free", "k-taken", "k-rowlocked", "held", "f-own", "new-e", "k-x", "k-gone"],
                &vec![a.0, b.0, c.0, g.0, f.0, e.0, x.0, gone],
            ],
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let answers: Vec<&str> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(
        answers,
        [
            "granted", "busy", "busy", "held", "own", "too_many", "expired", "busy"
        ]
    );
    let granted: i64 = rows[0].get(1);
    assert!(granted > has, "a grant's token is the newest");
    assert_eq!(
        rows[0].get::<_, Option<i64>>(2),
        Some(0),
        "held before the grant"
    );
    assert_eq!(
        rows[4].get::<_, Option<i64>>(1),
        Some(own),
        "own answers its token"
    );
    assert_eq!(
        rows[5].get::<_, Option<i64>>(2),
        Some(1),
        "too_many counts the held"
    );
    assert_eq!(h.count("lock").await, 4);

    // The releases: one made, one of a wrong token, one of a row locked elsewhere, one of
    // a key without a row, one more made.
    let tx = other.transaction().await.unwrap();
    tx.execute(
        &format!("SELECT 1 FROM \"{ns}\".lock WHERE key = 'f-own' FOR UPDATE"),
        &[],
    )
    .await
    .unwrap();
    let rows = h
        .admin
        .query(
            &format!(
                "SELECT answer, revision FROM \"{ns}\".release_many($1, $2::text[], $3::uuid[], $4::bigint[])"
            ),
            &[
                &class,
                &vec!["k-free", "held", "f-own", "nothing", "e-has"],
                &vec![a.0, d.0, f.0, a.0, e.0],
                &vec![granted, held + 1000, own, 1, has],
            ],
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let answers: Vec<&str> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(
        answers,
        ["released", "not_holder", "busy", "not_holder", "released"]
    );
    let first: i64 = rows[0].get(1);
    let last: i64 = rows[4].get(1);
    assert!(first > granted && last > first, "revisions drawn in order");
    assert_eq!(h.count("lock").await, 2);

    // Audited: each grant and release once, nothing for the rest.
    let events = h.events().await;
    let of = |kind: EventKind, token: i64| {
        events
            .iter()
            .filter(|ev| ev.kind == kind && ev.token.map(|t| t.0 as i64) == Some(token))
            .count()
    };
    assert_eq!(of(EventKind::LockAcquired, granted), 1);
    assert_eq!(of(EventKind::LockReleased, granted), 1);
    assert_eq!(of(EventKind::LockReleased, has), 1);
    assert_eq!(of(EventKind::LockReleased, own), 0);
    let acquired = events
        .iter()
        .filter(|ev| ev.kind == EventKind::LockAcquired)
        .count();
    assert_eq!(acquired, 4, "three before the batch and its one grant");
    h.assert_consistent().await;
    h.stop();
}

/// The audit log as (seq, kind, key), numbered events first.
async fn event_log(
    c: &tokio_postgres::Client,
    ns: &str,
) -> Vec<(Option<i64>, String, Option<String>)> {
    let sql = format!("SELECT seq, kind, key FROM {ns}.event ORDER BY seq NULLS LAST, id");
    c.query(&sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// A batch writes its elements' events at its end: numbered in place, after the committed
/// backlog, when the numbering lock is free; unnumbered, without waiting, when another
/// transaction holds it, for the next numbering. The calls of older builds (`acquire` with
/// five arguments, `release` with three) still write their events. No node runs here, so
/// nothing numbers in the background.
#[tokio::test]
async fn a_batch_numbers_its_events_after_the_backlog_or_leaves_them_unnumbered() {
    let schema = Schema::new();
    let mut c = connect().await;
    schema::migrate(&mut c, &schema.0).await.unwrap();
    // A regression that waits for the numbering lock fails here rather than hangs.
    c.batch_execute("SET statement_timeout = '10s'")
        .await
        .unwrap();
    let ns = format!("\"{}\"", schema.0);
    let class = schema::lock_class(&schema.0);
    let (a, b) = (uuid::Uuid::from_u128(0xa), uuid::Uuid::from_u128(0xb));
    c.batch_execute(&format!(
        "INSERT INTO {ns}.session (id, owner, ttl_ms, expires_at)
         SELECT id, 'o', 60000, {ns}.db_now() + interval '60 seconds'
         FROM unnest(ARRAY['{a}', '{b}']::uuid[]) AS id;
         INSERT INTO {ns}.event (kind, session_id) VALUES ('session_opened', '{a}');"
    ))
    .await
    .unwrap();
    let ev = |seq: Option<i64>, kind: &str, key: Option<&str>| {
        (seq, kind.to_string(), key.map(str::to_string))
    };

    let rows = c
        .query(
            &format!(
                "SELECT answer, granted FROM {ns}.acquire_many($1, $2::text[], $3::uuid[], 8)"
            ),
            &[&class, &vec!["k1", "k2"], &vec![a, b]],
        )
        .await
        .unwrap();
    let answers: Vec<&str> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(answers, ["granted", "granted"]);
    let tokens: Vec<i64> = rows.iter().map(|r| r.get(1)).collect();
    assert_eq!(
        event_log(&c, &ns).await,
        [
            ev(Some(1), "session_opened", None),
            ev(Some(2), "lock_acquired", Some("k1")),
            ev(Some(3), "lock_acquired", Some("k2")),
        ]
    );

    // The numbering lock held elsewhere: the releases neither wait nor number.
    let mut other = connect().await;
    let tx = other.transaction().await.unwrap();
    tx.execute("SELECT pg_advisory_xact_lock($1, 3)", &[&class])
        .await
        .unwrap();
    let rows = c
        .query(
            &format!(
                "SELECT answer FROM {ns}.release_many($1, $2::text[], $3::uuid[], $4::bigint[])"
            ),
            &[&class, &vec!["k1", "k2"], &vec![a, b], &tokens],
        )
        .await
        .unwrap();
    let answers: Vec<&str> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(answers, ["released", "released"]);
    let events = event_log(&c, &ns).await;
    assert_eq!(
        events[3..],
        [
            ev(None, "lock_released", Some("k1")),
            ev(None, "lock_released", Some("k2")),
        ]
    );
    tx.rollback().await.unwrap();

    // An older build's calls, one element each, write their events unnumbered.
    let granted: i64 = c
        .query_one(
            &format!("SELECT granted FROM {ns}.acquire($1, 'k3', $2, true, 8)"),
            &[&class, &a],
        )
        .await
        .unwrap()
        .get(0);
    let answer: String = c
        .query_one(
            &format!("SELECT answer FROM {ns}.release('k3', $1, $2)"),
            &[&a, &granted],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(answer, "released");
    c.query_one(
        &format!("SELECT {ns}.number_events($1, true, 100)"),
        &[&class],
    )
    .await
    .unwrap();
    assert_eq!(
        event_log(&c, &ns).await[3..],
        [
            ev(Some(4), "lock_released", Some("k1")),
            ev(Some(5), "lock_released", Some("k2")),
            ev(Some(6), "lock_acquired", Some("k3")),
            ev(Some(7), "lock_released", Some("k3")),
        ]
    );
    let counter: i64 = c
        .query_one(&format!("SELECT last FROM {ns}.event_counter"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(counter, 7);
}
