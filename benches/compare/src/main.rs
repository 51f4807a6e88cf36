//! The same workloads against Leasehold, Redis and PostgreSQL, measured by the same driver
//! (`leasehold::loadgen`), so that their figures can be compared side by side.
//!
//! `compare TARGET lock-churn|session-churn|heartbeat CLIENTS SECONDS` and
//! `compare TARGET mass-expiry CLIENTS SESSIONS TTL_MS` print one JSON line, like
//! `leasehold bench`. TARGET is `leasehold=URL`, `redis=URL`, `postgres=CONNINFO` or
//! `etcd=URL` (its JSON gateway; not for mass-expiry). See
//! `run.sh`, which starts the peers and writes the comparison.

mod etcd;
mod mass_expiry;

use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::loadgen::{self, Options, Progress, Workload, drive, report};
use redis::aio::MultiplexedConnection;
use tokio_postgres::Statement;

const KEYS: usize = 10_000;
const SESSIONS: usize = 100_000;
const TTL_MS: u64 = 600_000;

/// Lock acquire: the session must exist; a free key gets the next token.
const REDIS_ACQUIRE: &str = r"
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = redis.call('INCR', 'cmp:token')
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. t)
return t";
/// Lock release: compare-and-delete on holder and token.
const REDIS_RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0";

/// The session and lock tables of the PostgreSQL design: locks cascade with their session,
/// the heartbeat is one conditional UPDATE, tokens come from a sequence.
const PG_SCHEMA: &str = "
DROP TABLE IF EXISTS lock_entry;
DROP TABLE IF EXISTS lock_session;
DROP SEQUENCE IF EXISTS lock_token;
CREATE SEQUENCE lock_token;
CREATE TABLE lock_session (
    session_id uuid PRIMARY KEY,
    owner_id text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    CONSTRAINT lock_session_ttl_ck CHECK (expires_at > created_at)
);
CREATE TABLE lock_entry (
    lock_key text PRIMARY KEY,
    session_id uuid NOT NULL REFERENCES lock_session ON DELETE CASCADE,
    token bigint NOT NULL,
    acquired_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX lock_entry_session_idx ON lock_entry (session_id);
CREATE INDEX lock_session_expires_idx ON lock_session (expires_at);";

fn options(workload: Workload, clients: usize, seconds: f64, server: &str) -> Options {
    Options {
        server: server.to_string(),
        workload,
        clients,
        warmup: Duration::from_secs(2),
        duration: Duration::from_secs_f64(seconds),
        keys: KEYS,
        sessions: SESSIONS,
        rate: None,
        ttl_ms: 3_000,
        progress: false,
        // run.sh names the server process whose CPU each operation costs.
        server_pid: std::env::var("COMPARE_SERVER_PID")
            .ok()
            .and_then(|p| p.parse().ok()),
    }
}

const USAGE: &str = "usage: compare leasehold=URL|redis=URL|postgres=CONNINFO|etcd=URL WORKLOAD ...
    WORKLOAD ...: lock-churn|session-churn|heartbeat CLIENTS SECONDS, or mass-expiry CLIENTS SESSIONS TTL_MS
    COMPARE_SERVER_PID: the server process, for its CPU per operation";

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let workload = match args.get(2).map(String::as_str) {
        Some("lock-churn") if args.len() == 5 => Workload::LockChurn,
        Some("heartbeat") if args.len() == 5 => Workload::Heartbeat,
        Some("session-churn") if args.len() == 5 => Workload::SessionChurn,
        Some("mass-expiry") if args.len() == 6 => Workload::MassExpiry,
        _ => {
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    let (kind, target) = args[1].split_once('=').expect("TARGET is kind=address");
    let clients: usize = args[3].parse().expect("CLIENTS is a number");
    // The Leasehold and etcd runs connect to the target; the others' options name no server.
    let server = if kind == "leasehold" || kind == "etcd" {
        target
    } else {
        "http://127.0.0.1:9"
    };
    let opts = if workload == Workload::MassExpiry {
        let mut opts = options(workload, clients, 0.0, server);
        opts.sessions = args[4].parse().expect("SESSIONS is a number");
        opts.ttl_ms = args[5].parse().expect("TTL_MS is a number");
        opts
    } else {
        let seconds: f64 = args[4].parse().expect("SECONDS is a number");
        options(workload, clients, seconds, server)
    };
    let r = match (kind, workload) {
        ("leasehold", _) => loadgen::run(opts).await.expect("the Leasehold run"),
        ("redis", Workload::MassExpiry) => mass_expiry::redis(target, &opts).await,
        ("postgres", Workload::MassExpiry) => mass_expiry::postgres(target, &opts).await,
        ("etcd", Workload::MassExpiry) => {
            eprintln!("mass-expiry is not driven against etcd");
            std::process::exit(2);
        }
        ("etcd", _) => etcd::run(target, workload, opts).await,
        ("redis", _) => redis_run(target, workload, opts).await,
        ("postgres", _) => pg_run(target, workload, opts).await,
        (other, _) => panic!("unknown target {other}"),
    };
    let mut line = serde_json::to_value(&r).expect("a report serializes");
    line["target"] = serde_json::Value::String(args[1].clone());
    println!("{line}");
}

async fn redis_run(url: &str, workload: Workload, opts: Options) -> loadgen::Report {
    let client = redis::Client::open(url).expect("a Redis URL");
    let clients = opts.clients;
    let mut setup = client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis");
    let _: () = redis::cmd("FLUSHDB")
        .query_async(&mut setup)
        .await
        .expect("FLUSHDB");
    let sessions = match workload {
        Workload::Heartbeat => SESSIONS,
        _ => clients,
    };
    redis_open_sessions(&mut setup, sessions).await;
    let mut states = Vec::new();
    for c in 0..clients {
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("Redis");
        states.push((conn, c, 0usize));
    }
    let acquire = Arc::new(redis::Script::new(REDIS_ACQUIRE));
    let release = Arc::new(redis::Script::new(REDIS_RELEASE));
    let progress = Arc::new(Progress::default());
    let started = Instant::now();
    let measured = drive(
        &opts,
        states,
        move |(mut conn, c, mut i): (redis::aio::MultiplexedConnection, usize, usize)| {
            let (acquire, release) = (acquire.clone(), release.clone());
            async move {
                i += 1;
                let r = match workload {
                    Workload::Heartbeat => {
                        let id = (c + i * clients) % SESSIONS;
                        let t = Instant::now();
                        let ok: Result<i64, _> = redis::cmd("PEXPIRE")
                            .arg(format!("cmp:sess:{id}"))
                            .arg(TTL_MS)
                            .query_async(&mut conn)
                            .await;
                        match ok {
                            Ok(1) => Ok(vec![t.elapsed()]),
                            _ => Err(()),
                        }
                    }
                    Workload::SessionChurn => redis_session_cycle(&mut conn, c, i).await,
                    _ => redis_lock_pair(&mut conn, &acquire, &release, c, i)
                        .await
                        .map(|latency| vec![latency]),
                };
                ((conn, c, i), r)
            }
        },
        progress.clone(),
    )
    .await;
    let seconds = started.elapsed().saturating_sub(opts.warmup).as_secs_f64();
    report(workload.name(), clients, seconds, measured).with_cpu(&progress)
}

/// One session-churn unit against Redis, as Leasehold's: open (a session key with a TTL,
/// `SET … NX PX`), three heartbeats (`PEXPIRE`, which fails for a gone session) and close
/// (`DEL`). Latency: each request.
async fn redis_session_cycle(
    conn: &mut MultiplexedConnection,
    c: usize,
    i: usize,
) -> Result<Vec<Duration>, ()> {
    let key = format!("cmp:churn:{c}:{i}");
    let mut latencies = Vec::with_capacity(5);
    let t = Instant::now();
    let opened: Option<String> = redis::cmd("SET")
        .arg(&key)
        .arg(1)
        .arg("NX")
        .arg("PX")
        .arg(TTL_MS)
        .query_async(conn)
        .await
        .map_err(|_| ())?;
    latencies.push(t.elapsed());
    if opened.is_none() {
        return Err(());
    }
    for _ in 0..3 {
        let t = Instant::now();
        let beat: i64 = redis::cmd("PEXPIRE")
            .arg(&key)
            .arg(TTL_MS)
            .query_async(conn)
            .await
            .map_err(|_| ())?;
        latencies.push(t.elapsed());
        if beat != 1 {
            return Err(());
        }
    }
    let t = Instant::now();
    let closed: i64 = redis::cmd("DEL")
        .arg(&key)
        .query_async(conn)
        .await
        .map_err(|_| ())?;
    latencies.push(t.elapsed());
    if closed != 1 {
        return Err(());
    }
    Ok(latencies)
}

async fn pg_run(conninfo: &str, workload: Workload, opts: Options) -> loadgen::Report {
    let clients = opts.clients;
    let setup = pg_connect(conninfo).await;
    setup.batch_execute(PG_SCHEMA).await.expect("schema");
    let sessions = match workload {
        Workload::Heartbeat => SESSIONS,
        _ => clients,
    };
    let ids: Vec<uuid::Uuid> = (0..sessions).map(|_| uuid::Uuid::new_v4()).collect();
    for chunk in ids.chunks(5_000) {
        setup
            .execute(
                "INSERT INTO lock_session (session_id, owner_id, expires_at)
                 SELECT id, 'compare', now() + interval '10 minutes' FROM unnest($1::uuid[]) AS id",
                &[&chunk.to_vec()],
            )
            .await
            .expect("open sessions");
    }
    let ids = Arc::new(ids);
    let mut states = Vec::new();
    for c in 0..clients {
        let client = Arc::new(pg_connect(conninfo).await);
        let [acquire, release] = pg_prepare_churn(&client).await;
        let beat = client
            .prepare(
                "UPDATE lock_session SET expires_at = now() + interval '10 minutes'
                 WHERE session_id = $1 AND expires_at > now()",
            )
            .await
            .expect("prepare");
        let open = client
            .prepare(
                "INSERT INTO lock_session (session_id, owner_id, expires_at)
                 VALUES ($1, 'compare', now() + interval '10 minutes')",
            )
            .await
            .expect("prepare");
        let close = client
            .prepare("DELETE FROM lock_session WHERE session_id = $1")
            .await
            .expect("prepare");
        states.push((client, [acquire, release, beat, open, close], c, 0usize));
    }
    let progress = Arc::new(Progress::default());
    let started = Instant::now();
    let measured = drive(
        &opts,
        states,
        move |(client, st, c, mut i): (
            Arc<tokio_postgres::Client>,
            [Statement; 5],
            usize,
            usize,
        )| {
            let ids = ids.clone();
            async move {
                i += 1;
                let r = match workload {
                    Workload::Heartbeat => {
                        let id = ids[(c + i * clients) % ids.len()];
                        let t = Instant::now();
                        match client.execute(&st[2], &[&id]).await {
                            Ok(1) => Ok(vec![t.elapsed()]),
                            _ => Err(()),
                        }
                    }
                    Workload::SessionChurn => pg_session_cycle(&client, &st).await,
                    _ => pg_lock_pair(&client, &st, ids[c], c, i)
                        .await
                        .map(|latency| vec![latency]),
                };
                ((client, st, c, i), r)
            }
        },
        progress.clone(),
    )
    .await;
    let seconds = started.elapsed().saturating_sub(opts.warmup).as_secs_f64();
    report(workload.name(), clients, seconds, measured).with_cpu(&progress)
}

/// One session-churn unit against the PostgreSQL tables: `INSERT` the session, three
/// conditional heartbeat `UPDATE`s, `DELETE` it (its locks would go by the cascade). Each
/// statement is its own transaction, committed before the next, as Leasehold's requests.
async fn pg_session_cycle(
    client: &tokio_postgres::Client,
    st: &[Statement],
) -> Result<Vec<Duration>, ()> {
    let id = uuid::Uuid::new_v4();
    let mut latencies = Vec::with_capacity(5);
    for (statement, want) in [
        (&st[3], 1),
        (&st[2], 1),
        (&st[2], 1),
        (&st[2], 1),
        (&st[4], 1),
    ] {
        let t = Instant::now();
        let n = client.execute(statement, &[&id]).await.map_err(|_| ())?;
        latencies.push(t.elapsed());
        if n != want {
            return Err(());
        }
    }
    Ok(latencies)
}

/// One lock-churn unit against Redis: acquire a key, release it; the latency is the acquire's.
/// A key another client holds is skipped for the next, as a real contender (and Leasehold's
/// lock-churn) does. Client `c` holds session `cmp:sess:{c}`; `i` counts its units.
async fn redis_lock_pair(
    conn: &mut MultiplexedConnection,
    acquire: &redis::Script,
    release: &redis::Script,
    c: usize,
    i: usize,
) -> Result<Duration, ()> {
    let session = format!("cmp:sess:{c}");
    for attempt in 0..16 {
        let key = format!(
            "cmp:lock:{}",
            (c * 7919 + (i * 16 + attempt) * 104_729) % KEYS
        );
        let t = Instant::now();
        let token: Result<i64, _> = acquire
            .key(&key)
            .key(&session)
            .arg(&session)
            .invoke_async(conn)
            .await;
        let latency = t.elapsed();
        match token {
            Ok(0) => continue,
            Ok(t) if t > 0 => {
                let released: Result<i64, _> = release
                    .key(&key)
                    .arg(format!("{session}:{t}"))
                    .invoke_async(conn)
                    .await;
                return match released {
                    Ok(1) => Ok(latency),
                    _ => Err(()),
                };
            }
            _ => return Err(()),
        }
    }
    Err(())
}

/// Opens sessions `cmp:sess:0` … `cmp:sess:{n-1}` with the long TTL, 1 000 per pipeline.
async fn redis_open_sessions(conn: &mut redis::aio::MultiplexedConnection, n: usize) {
    let mut pipe = redis::pipe();
    for i in 0..n {
        pipe.cmd("SET")
            .arg(format!("cmp:sess:{i}"))
            .arg(1)
            .arg("PX")
            .arg(TTL_MS)
            .ignore();
        if i % 1_000 == 999 || i + 1 == n {
            let _: () = pipe.query_async(conn).await.expect("open sessions");
            pipe = redis::pipe();
        }
    }
}

async fn pg_connect(conninfo: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .expect("PostgreSQL");
    tokio::spawn(conn);
    client
}

/// The acquire and release statements `pg_lock_pair` takes.
async fn pg_prepare_churn(client: &tokio_postgres::Client) -> [Statement; 2] {
    let acquire = client
        .prepare(
            "INSERT INTO lock_entry (lock_key, session_id, token)
             VALUES ($1, $2, nextval('lock_token'))
             ON CONFLICT (lock_key) DO NOTHING RETURNING token",
        )
        .await
        .expect("prepare");
    let release = client
        .prepare("DELETE FROM lock_entry WHERE lock_key = $1 AND session_id = $2 AND token = $3")
        .await
        .expect("prepare");
    [acquire, release]
}

/// One lock-churn unit against PostgreSQL, as `redis_lock_pair`; `st` starts with the
/// statements of `pg_prepare_churn`.
async fn pg_lock_pair(
    client: &tokio_postgres::Client,
    st: &[Statement],
    session: uuid::Uuid,
    c: usize,
    i: usize,
) -> Result<Duration, ()> {
    for attempt in 0..16 {
        let key = format!(
            "cmp/lock/{}",
            (c * 7919 + (i * 16 + attempt) * 104_729) % KEYS
        );
        let t = Instant::now();
        match client.query_opt(&st[0], &[&key, &session]).await {
            Ok(Some(row)) => {
                let latency = t.elapsed();
                let token: i64 = row.get(0);
                return match client.execute(&st[1], &[&key, &session, &token]).await {
                    Ok(1) => Ok(latency),
                    _ => Err(()),
                };
            }
            Ok(None) => continue,
            Err(_) => return Err(()),
        }
    }
    Err(())
}
