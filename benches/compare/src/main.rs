//! The same workloads against Leasehold, Redis and PostgreSQL, measured by the same driver
//! (`leasehold::loadgen`), so that their figures can be compared side by side.
//!
//! `compare TARGET WORKLOAD CLIENTS SECONDS` prints one JSON line, like `leasehold bench`.
//! TARGET is `leasehold=URL`, `redis=URL` or `postgres=CONNINFO`; WORKLOAD is `lock-churn`
//! or `heartbeat`. See `run.sh`, which starts the peers and writes the comparison.

use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::loadgen::{self, Options, Progress, Workload, drive, report};

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
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!(
            "usage: compare leasehold=URL|redis=URL|postgres=CONNINFO lock-churn|heartbeat CLIENTS SECONDS"
        );
        std::process::exit(2);
    }
    let (kind, target) = args[1].split_once('=').expect("TARGET is kind=address");
    let workload = match args[2].as_str() {
        "lock-churn" => Workload::LockChurn,
        "heartbeat" => Workload::Heartbeat,
        other => panic!("unknown workload {other}"),
    };
    let clients: usize = args[3].parse().expect("CLIENTS is a number");
    let seconds: f64 = args[4].parse().expect("SECONDS is a number");
    // The driver hands each task a Leasehold client; the peers' tasks ignore it.
    let dummy = "http://127.0.0.1:9";
    let r = match kind {
        "leasehold" => loadgen::run(options(workload, clients, seconds, target))
            .await
            .expect("the Leasehold run"),
        "redis" => redis_run(target, workload, options(workload, clients, seconds, dummy)).await,
        "postgres" => pg_run(target, workload, options(workload, clients, seconds, dummy)).await,
        other => panic!("unknown target {other}"),
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
    let mut pipe = redis::pipe();
    for i in 0..sessions {
        pipe.cmd("SET")
            .arg(format!("cmp:sess:{i}"))
            .arg(1)
            .arg("PX")
            .arg(TTL_MS)
            .ignore();
        if i % 1_000 == 999 || i + 1 == sessions {
            let _: () = pipe.query_async(&mut setup).await.expect("open sessions");
            pipe = redis::pipe();
        }
    }
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
    let started = Instant::now();
    let measured = drive(
        &opts,
        states,
        move |_, (mut conn, c, mut i): (redis::aio::MultiplexedConnection, usize, usize)| {
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
                    _ => {
                        // A key another client holds is skipped for the next, as a real
                        // contender (and Leasehold's lock-churn) does.
                        let session = format!("cmp:sess:{c}");
                        let mut result = Err(());
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
                                .invoke_async(&mut conn)
                                .await;
                            let latency = t.elapsed();
                            match token {
                                Ok(0) => continue,
                                Ok(t) if t > 0 => {
                                    let released: Result<i64, _> = release
                                        .key(&key)
                                        .arg(format!("{session}:{t}"))
                                        .invoke_async(&mut conn)
                                        .await;
                                    if let Ok(1) = released {
                                        result = Ok(vec![latency]);
                                    }
                                    break;
                                }
                                _ => break,
                            }
                        }
                        result
                    }
                };
                ((conn, c, i), r)
            }
        },
        Arc::new(Progress::default()),
    )
    .await;
    let seconds = started.elapsed().saturating_sub(opts.warmup).as_secs_f64();
    report(workload.name(), clients, seconds, measured)
}

async fn pg_run(conninfo: &str, workload: Workload, opts: Options) -> loadgen::Report {
    let clients = opts.clients;
    let connect = || async {
        let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
            .await
            .expect("PostgreSQL");
        tokio::spawn(conn);
        client
    };
    let setup = connect().await;
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
        let client = Arc::new(connect().await);
        let acquire = client
            .prepare(
                "INSERT INTO lock_entry (lock_key, session_id, token)
                 VALUES ($1, $2, nextval('lock_token'))
                 ON CONFLICT (lock_key) DO NOTHING RETURNING token",
            )
            .await
            .expect("prepare");
        let release = client
            .prepare(
                "DELETE FROM lock_entry WHERE lock_key = $1 AND session_id = $2 AND token = $3",
            )
            .await
            .expect("prepare");
        let beat = client
            .prepare(
                "UPDATE lock_session SET expires_at = now() + interval '10 minutes'
                 WHERE session_id = $1 AND expires_at > now()",
            )
            .await
            .expect("prepare");
        states.push((client, [acquire, release, beat], c, 0usize));
    }
    let started = Instant::now();
    let measured = drive(
        &opts,
        states,
        move |_,
              (client, st, c, mut i): (
            Arc<tokio_postgres::Client>,
            [tokio_postgres::Statement; 3],
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
                    _ => {
                        let session = ids[c];
                        let mut result = Err(());
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
                                    if let Ok(1) =
                                        client.execute(&st[1], &[&key, &session, &token]).await
                                    {
                                        result = Ok(vec![latency]);
                                    }
                                    break;
                                }
                                Ok(None) => continue,
                                Err(_) => break,
                            }
                        }
                        result
                    }
                };
                ((client, st, c, i), r)
            }
        },
        Arc::new(Progress::default()),
    )
    .await;
    let seconds = started.elapsed().saturating_sub(opts.warmup).as_secs_f64();
    report(workload.name(), clients, seconds, measured)
}
