//! Mass expiry against the peers, measured as `leasehold bench --workload mass-expiry` measures
//! Leasehold: SESSIONS sessions, each holding one lock, all reach their deadline at one instant
//! and nobody heartbeats them; the figure is the time from that deadline until every one of
//! those locks is observed free through the system's own client API, polled every 2 ms. Live
//! clients churn other locks meanwhile, and their acquire p99 before the deadline is set
//! against the one during the storm.
//!
//! Neither peer frees a lock by itself when its session dies, so each gets what a deployment
//! would run beside it: a cleaner task for Redis, a reaper task for PostgreSQL, both started
//! with the live clients (so their steady-state cost shows in the "before" figure too).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use leasehold::loadgen::cpu::{self, CpuMark};
use leasehold::loadgen::{self, Options, Report, Storm};
use redis::Script;
use redis::aio::MultiplexedConnection;
use serde_json::{Map, Value, json};
use tokio::task::JoinHandle;

use crate::{
    REDIS_ACQUIRE, REDIS_RELEASE, TTL_MS, pg_connect, pg_lock_pair, pg_prepare_churn,
    redis_lock_pair, redis_open_sessions,
};

/// Commands per pipeline and keys per multi-key command.
const REDIS_BATCH: usize = 1_000;
/// Rows per INSERT while filling the tables.
const PG_FILL_BATCH: usize = 10_000;
/// How long after the deadline the locks may stay held before the run gives up, as
/// `leasehold bench` does.
const GIVE_UP_MS: u64 = 120_000;
/// The PostgreSQL reaper's statement: at most 10 000 expired sessions per transaction, their
/// locks going with them through the cascading foreign key.
const PG_REAP: &str = "DELETE FROM lock_session WHERE session_id IN
    (SELECT session_id FROM lock_session WHERE expires_at < now() LIMIT 10000)";
/// How long a reaper or cleaner sleeps once a round found nothing to delete.
const IDLE_SLEEP: Duration = Duration::from_millis(50);
/// The Redis lock keys the cleaner scans: the live clients' and the dying sessions'.
const REDIS_LOCKS: &str = "cmp:lock:*";
/// The cleaner's delete: only if the lock still has the holder the cleaner read, and that
/// holder's session key is (still) gone.
const REDIS_CLEAN: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('EXISTS', KEYS[2]) == 0 then
    return redis.call('DEL', KEYS[1])
end
return 0";

/// Milliseconds since the Unix epoch: the clock both peers set and check deadlines on, as they
/// run on the same machine as the driver.
fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// What one live client saw: when each unit ended and its acquire latency in µs, or `None`
/// for a unit that failed.
type Samples = Vec<(u64, Option<u64>)>;

/// The live clients: each runs `unit` until told to stop.
struct Live {
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Samples>>,
}

impl Live {
    fn new() -> Live {
        Live {
            stop: Arc::new(AtomicBool::new(false)),
            tasks: Vec::new(),
        }
    }

    /// Starts one client; `unit(i)` runs its `i`th lock-churn unit.
    fn spawn<F, Fut>(&mut self, mut unit: F)
    where
        F: FnMut(usize) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<Duration, ()>> + Send,
    {
        let stop = self.stop.clone();
        self.tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let r = unit(i).await;
                samples.push((wall_ms(), r.ok().map(|l| l.as_micros() as u64)));
            }
            samples
        }));
    }

    async fn stop(self) -> Vec<Samples> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for t in self.tasks {
            all.push(t.await.expect("a live client"));
        }
        all
    }
}

/// Waits for the next poll: 2 ms on, and not before `deadline`. Gives up, as `leasehold
/// bench` does, when the locks are still held two minutes after it.
async fn next_poll(deadline: u64) {
    loop {
        tokio::time::sleep(Duration::from_millis(2)).await;
        let now = wall_ms();
        if now > deadline + GIVE_UP_MS {
            eprintln!("locks still held two minutes after their deadline");
            std::process::exit(1);
        }
        if now >= deadline {
            return;
        }
    }
}

/// The CPU from the first poll at the deadline (`began`) to all free (`ended`), per dying
/// session, as `leasehold bench` reports it. The driver's share includes whatever cleaner or
/// reaper task the peer's design runs inside the driver.
fn storm_cpu(
    began: Option<CpuMark>,
    ended: CpuMark,
    opts: &Options,
    extra: &mut Map<String, Value>,
) {
    if let Some(began) = began {
        cpu::per_op(began, ended, opts.sessions.max(1) as u64, extra);
    }
}

/// The report in the shape `leasehold bench --workload mass-expiry` gives, built by the same
/// code; here every deadline falls on one instant.
fn storm_report(
    opts: &Options,
    deadline: u64,
    free_at: u64,
    live: Vec<Samples>,
    extra: Map<String, Value>,
) -> Report {
    let storm = Storm {
        sessions: opts.sessions.max(1),
        clients: opts.clients.max(1),
        first_deadline: deadline,
        last_deadline: deadline,
        free_at,
        samples: live.into_iter().flatten().collect(),
    };
    loadgen::storm_report(storm, extra)
}

/// Redis: sessions are keys with a TTL, locks are keys holding `session:token` with none, so
/// a lock outlives its session until the cleaner deletes it.
pub async fn redis(url: &str, opts: &Options) -> Report {
    let n = opts.sessions.max(1);
    let clients = opts.clients.max(1);
    let client = redis::Client::open(url).expect("a Redis URL");
    let connect = || async {
        client
            .get_multiplexed_async_connection()
            .await
            .expect("Redis")
    };
    let mut setup = connect().await;
    let _: () = redis::cmd("FLUSHDB")
        .query_async(&mut setup)
        .await
        .expect("FLUSHDB");
    let acquire = Arc::new(Script::new(REDIS_ACQUIRE));
    let release = Arc::new(Script::new(REDIS_RELEASE));
    for script in [&*acquire, &*release, &Script::new(REDIS_CLEAN)] {
        script.load_async(&mut setup).await.expect("SCRIPT LOAD");
    }
    // 1. The dying sessions, each taking its lock through the acquire script, with a long TTL
    // for now; then the live clients' sessions.
    for start in (0..n).step_by(REDIS_BATCH) {
        let mut pipe = redis::pipe();
        for i in start..(start + REDIS_BATCH).min(n) {
            let session = format!("cmp:sess:mx:{i}");
            pipe.cmd("SET")
                .arg(&session)
                .arg(1)
                .arg("PX")
                .arg(TTL_MS)
                .ignore();
            pipe.invoke_script(
                acquire
                    .key(format!("cmp:lock:mx:{i}"))
                    .key(&session)
                    .arg(&session),
            );
        }
        let tokens: Vec<i64> = pipe
            .query_async(&mut setup)
            .await
            .expect("open and acquire");
        assert!(
            tokens.iter().all(|&t| t > 0),
            "a dying lock was not granted"
        );
    }
    redis_open_sessions(&mut setup, clients).await;
    // 2. One absolute deadline for every dying session.
    let deadline = wall_ms() + opts.ttl_ms.max(1_000);
    for start in (0..n).step_by(REDIS_BATCH) {
        let mut pipe = redis::pipe();
        for i in start..(start + REDIS_BATCH).min(n) {
            pipe.cmd("PEXPIREAT")
                .arg(format!("cmp:sess:mx:{i}"))
                .arg(deadline);
        }
        let set: Vec<i64> = pipe.query_async(&mut setup).await.expect("PEXPIREAT");
        assert!(
            set.iter().all(|&s| s == 1),
            "a dying session was gone early"
        );
    }
    assert!(
        wall_ms() < deadline,
        "setting the deadlines took longer than TTL_MS; raise it"
    );
    // 3. The cleaner and the live clients.
    let stop_cleaning = Arc::new(AtomicBool::new(false));
    let cleaner = tokio::spawn(redis_cleaner(connect().await, stop_cleaning.clone()));
    let mut live = Live::new();
    for c in 0..clients {
        let conn = connect().await;
        let (acquire, release) = (acquire.clone(), release.clone());
        live.spawn(move |i| {
            let (mut conn, acquire, release) = (conn.clone(), acquire.clone(), release.clone());
            async move { redis_lock_pair(&mut conn, &acquire, &release, c, i).await }
        });
    }
    // 4. Poll the dying lock keys with multi-key EXISTS, 1 000 keys a command, all in one
    // pipeline. No one takes those keys again, so a batch seen empty stays empty and is
    // dropped from later polls.
    let mut held: Vec<Vec<String>> = (0..n)
        .step_by(REDIS_BATCH)
        .map(|start| {
            (start..(start + REDIS_BATCH).min(n))
                .map(|i| format!("cmp:lock:mx:{i}"))
                .collect()
        })
        .collect();
    let mut poll = connect().await;
    let mut began = None;
    let (free_at, ended) = loop {
        next_poll(deadline).await;
        began.get_or_insert_with(|| CpuMark::now(opts.server_pid));
        let mut pipe = redis::pipe();
        for batch in &held {
            pipe.cmd("EXISTS").arg(batch);
        }
        let counts: Vec<u64> = pipe.query_async(&mut poll).await.expect("EXISTS");
        let mut counts = counts.into_iter();
        held.retain(|_| counts.next() != Some(0));
        if held.is_empty() {
            break (wall_ms(), CpuMark::now(opts.server_pid));
        }
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let samples = live.stop().await;
    stop_cleaning.store(true, Ordering::Relaxed);
    let cleaned = cleaner.await.expect("the cleaner");
    let mut extra = Map::new();
    storm_cpu(began, ended, opts, &mut extra);
    extra.insert("cleaner_passes".into(), json!(cleaned.passes));
    extra.insert("cleaner_deleted".into(), json!(cleaned.deleted));
    extra.insert(
        "cleaner_pass_ms".into(),
        json!(cleaned.busy.as_millis() as u64 / cleaned.passes.max(1)),
    );
    storm_report(opts, deadline, free_at, samples, extra)
}

struct Cleaned {
    passes: u64,
    deleted: u64,
    busy: Duration,
}

/// The Redis cleaner, in the role of a reaper process: a pass `SCAN`s the whole keyspace for
/// `cmp:lock:*` (COUNT 1 000); for each batch it reads the holders with one `MGET`, checks
/// each holder's session key with pipelined `EXISTS`, and deletes every lock whose session is
/// gone with the compare-and-delete script, pipelined. Passes follow one another while they
/// delete something; after a pass that deleted nothing it sleeps 50 ms.
async fn redis_cleaner(mut conn: MultiplexedConnection, stop: Arc<AtomicBool>) -> Cleaned {
    let clean = Script::new(REDIS_CLEAN);
    let mut done = Cleaned {
        passes: 0,
        deleted: 0,
        busy: Duration::ZERO,
    };
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let mut deleted = 0;
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(REDIS_LOCKS)
                .arg("COUNT")
                .arg(REDIS_BATCH)
                .query_async(&mut conn)
                .await
                .expect("SCAN");
            deleted += clean_batch(&mut conn, &clean, &keys).await;
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        done.passes += 1;
        done.deleted += deleted;
        done.busy += started.elapsed();
        if deleted == 0 {
            tokio::time::sleep(IDLE_SLEEP).await;
        }
    }
    done
}

/// One batch of the cleaner's pass: the locks among `keys` whose session key is gone are
/// deleted; returns how many.
async fn clean_batch(conn: &mut MultiplexedConnection, clean: &Script, keys: &[String]) -> u64 {
    if keys.is_empty() {
        return 0;
    }
    let holders: Vec<Option<String>> = redis::cmd("MGET")
        .arg(keys)
        .query_async(conn)
        .await
        .expect("MGET");
    // A lock's value is `session:token`.
    let held: Vec<(&String, String, String)> = keys
        .iter()
        .zip(holders)
        .filter_map(|(key, holder)| {
            let session = holder.as_ref()?.rsplit_once(':')?.0.to_string();
            Some((key, holder?, session))
        })
        .collect();
    if held.is_empty() {
        return 0;
    }
    let mut pipe = redis::pipe();
    for (_, _, session) in &held {
        pipe.cmd("EXISTS").arg(session);
    }
    let alive: Vec<bool> = pipe.query_async(conn).await.expect("EXISTS");
    let mut pipe = redis::pipe();
    let mut orphans = 0;
    for ((key, holder, session), alive) in held.iter().zip(alive) {
        if !alive {
            pipe.invoke_script(clean.key(*key).key(session).arg(holder));
            orphans += 1;
        }
    }
    if orphans == 0 {
        return 0;
    }
    let gone: Vec<u64> = pipe.query_async(conn).await.expect("clean");
    gone.iter().sum()
}

/// PostgreSQL: the session and lock tables of `PG_SCHEMA`, locks going with their session
/// through `ON DELETE CASCADE` once the reaper deletes it.
pub async fn postgres(conninfo: &str, opts: &Options) -> Report {
    let n = opts.sessions.max(1);
    let clients = opts.clients.max(1);
    let setup = pg_connect(conninfo).await;
    setup.batch_execute(crate::PG_SCHEMA).await.expect("schema");
    // 1. The dying sessions and their locks, many rows a statement; then the live sessions.
    let dying: Vec<uuid::Uuid> = (0..n).map(|_| uuid::Uuid::new_v4()).collect();
    for (b, ids) in dying.chunks(PG_FILL_BATCH).enumerate() {
        let keys: Vec<String> = (0..ids.len())
            .map(|j| format!("cmp/mx/{}", b * PG_FILL_BATCH + j))
            .collect();
        setup
            .execute(
                "INSERT INTO lock_session (session_id, owner_id, expires_at)
                 SELECT id, 'mass-expiry', now() + interval '10 minutes'
                 FROM unnest($1::uuid[]) AS id",
                &[&ids],
            )
            .await
            .expect("open sessions");
        setup
            .execute(
                "INSERT INTO lock_entry (lock_key, session_id, token)
                 SELECT k, id, nextval('lock_token') FROM unnest($1::text[], $2::uuid[]) AS t(k, id)",
                &[&keys, &ids],
            )
            .await
            .expect("acquire");
    }
    let live_ids: Vec<uuid::Uuid> = (0..clients).map(|_| uuid::Uuid::new_v4()).collect();
    setup
        .execute(
            "INSERT INTO lock_session (session_id, owner_id, expires_at)
             SELECT id, 'compare', now() + interval '10 minutes' FROM unnest($1::uuid[]) AS id",
            &[&live_ids],
        )
        .await
        .expect("open live sessions");
    // Statistics as a table of this size would have in service, so the planner sees it.
    setup
        .batch_execute("ANALYZE lock_session, lock_entry")
        .await
        .expect("ANALYZE");
    // 2. One deadline for every dying session.
    let deadline = wall_ms() + opts.ttl_ms.max(1_000);
    let set = setup
        .execute(
            "UPDATE lock_session SET expires_at = to_timestamp($1::float8 / 1000)
             WHERE owner_id = 'mass-expiry'",
            &[&(deadline as f64)],
        )
        .await
        .expect("set deadlines");
    assert_eq!(set, n as u64, "every dying session gets the deadline");
    assert!(
        wall_ms() < deadline,
        "setting the deadlines took longer than TTL_MS; raise it"
    );
    // 3. The reaper and the live clients.
    let stop_reaping = Arc::new(AtomicBool::new(false));
    let reaper = tokio::spawn(pg_reaper(pg_connect(conninfo).await, stop_reaping.clone()));
    let mut live = Live::new();
    for (c, &session) in live_ids.iter().enumerate() {
        let client = Arc::new(pg_connect(conninfo).await);
        let st = Arc::new(pg_prepare_churn(&client).await);
        live.spawn(move |i| {
            let (client, st) = (client.clone(), st.clone());
            async move { pg_lock_pair(&client, &st[..], session, c, i).await }
        });
    }
    // 4. Poll the count of the dying locks.
    let poll = pg_connect(conninfo).await;
    let mut began = None;
    let (free_at, ended) = loop {
        next_poll(deadline).await;
        began.get_or_insert_with(|| CpuMark::now(opts.server_pid));
        let row = poll
            .query_one(
                "SELECT count(*) FROM lock_entry WHERE lock_key LIKE 'cmp/mx/%'",
                &[],
            )
            .await
            .expect("count the locks");
        if row.get::<_, i64>(0) == 0 {
            break (wall_ms(), CpuMark::now(opts.server_pid));
        }
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let samples = live.stop().await;
    stop_reaping.store(true, Ordering::Relaxed);
    let (rounds, deleted) = reaper.await.expect("the reaper");
    let mut extra = Map::new();
    storm_cpu(began, ended, opts, &mut extra);
    extra.insert("reaper_rounds".into(), json!(rounds));
    extra.insert("reaper_deleted".into(), json!(deleted));
    storm_report(opts, deadline, free_at, samples, extra)
}

/// The PostgreSQL reaper, in the role of a reaper process: runs `PG_REAP` again and again
/// while it deletes something, then sleeps 50 ms. Returns the rounds that deleted something
/// and the sessions deleted.
async fn pg_reaper(client: tokio_postgres::Client, stop: Arc<AtomicBool>) -> (u64, u64) {
    let (mut rounds, mut deleted) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        match client.execute(PG_REAP, &[]).await.expect("reap") {
            0 => tokio::time::sleep(IDLE_SLEEP).await,
            k => {
                rounds += 1;
                deleted += k;
            }
        }
    }
    (rounds, deleted)
}
