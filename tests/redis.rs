//! What only the Redis backend has: the seed's seat layout kept in step, the functions loaded
//! again after Redis forgets them, the durability check at start, and a crash-durable Redis
//! killed with `kill -9` under concurrent grants and started again on its own directory.
//!
//! The layout and flush tests use the machine's Redis under a fresh namespace (see
//! `common`); the durability tests start their own `redis-server` on a free port with a data
//! directory of their own.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use leasehold::app::App;
use leasehold::client::Client;
use leasehold::clock::SystemClock;
use leasehold::config::Config;
use serde_json::{Value, json};

async fn smembers(keys: &Keyspace, key: &str) -> Vec<String> {
    let mut members: Vec<String> = redis::cmd("SMEMBERS")
        .arg(key)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    members.sort();
    members
}

async fn hget(keys: &Keyspace, key: &str, field: &str) -> Option<String> {
    redis::cmd("HGET")
        .arg(key)
        .arg(field)
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seat_layout_shows_a_taken_seat_and_nothing_after_release_or_reclaim() {
    // Guards against the `{pool}:active_sessions` / `{pool}:session_metadata` layout that
    // existing dashboards read drifting from the seats: a holder missing, or one left behind
    // after its seat was given back or reclaimed.
    let s = TestServer::start_on(BackendKind::Redis, |_| {}).await;
    let keys = s.keys.as_ref().unwrap();
    let ns = &keys.namespace;
    let active = format!("{ns}:LIC-TEST-001:active_sessions");
    let meta = format!("{ns}:LIC-TEST-001:session_metadata");
    make_pool(&s, "LIC-TEST-001", 5).await;

    let a = s.open("alice", 6_000).await;
    let r = acquire_seat(
        &s.client,
        "LIC-TEST-001",
        json!({"session_id": a, "metadata": {"user_email": "alice@example.com"}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let token = r.body["seat_token"].as_u64().unwrap();
    assert_eq!(smembers(keys, &active).await, vec![a.clone()]);
    let entry: Value = serde_json::from_str(&hget(keys, &meta, &a).await.unwrap()).unwrap();
    assert_eq!(entry["acquired_at"], BASE / 1000, "{entry}");
    assert_eq!(entry["last_heartbeat"], BASE / 1000, "{entry}");
    assert_eq!(entry["user_email"], "alice@example.com", "{entry}");
    assert_eq!(entry["token"], token, "{entry}");

    // A heartbeat moves last_heartbeat, and only that.
    s.advance(3_000).await;
    assert_eq!(s.heartbeat(&a).await.status, 200);
    let entry: Value = serde_json::from_str(&hget(keys, &meta, &a).await.unwrap()).unwrap();
    assert_eq!(entry["acquired_at"], BASE / 1000, "{entry}");
    assert_eq!(entry["last_heartbeat"], (BASE + 3_000) / 1000, "{entry}");

    // Released: gone from both.
    assert_eq!(
        release_seat(&s, "LIC-TEST-001", &a, token).await.status,
        200
    );
    assert!(smembers(keys, &active).await.is_empty());
    assert_eq!(hget(keys, &meta, &a).await, None);

    // Reclaimed by expiry: gone from both once the reaper ends the session.
    let b = s.open("bob", 2_000).await;
    seat(&s, "LIC-TEST-001", &b).await;
    assert_eq!(smembers(keys, &active).await, vec![b.clone()]);
    assert!(hget(keys, &meta, &b).await.is_some());
    s.advance(2_000).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 1);
    assert!(smembers(keys, &active).await.is_empty());
    assert_eq!(hget(keys, &meta, &b).await, None);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_expiries_in_big_passes_audits_each_once_and_frees_everything() {
    // Guards against ends batched over a whole reaper pass (variadic deletions, several
    // events to a stream entry) losing or doubling an event, or leaving a lock, a seat, a
    // layout entry, a claimed job or a session key behind; the log is read in pages that
    // split the entries.
    const N: usize = 300;
    let s = TestServer::start_on(BackendKind::Redis, |c| c.reaper_batch = 1_000).await;
    let keys = s.keys.as_ref().unwrap();
    let ns = &keys.namespace;
    make_pool(&s, "LIC-STORM", N as u64).await;
    let mut ids = Vec::new();
    let mut seated = Vec::new();
    let mut claimers = Vec::new();
    for i in 0..N {
        let id = s.open("storm", 1_000).await;
        take(&s, &format!("k{i}"), &id).await;
        if i % 3 == 0 {
            seat(&s, "LIC-STORM", &id).await;
            seated.push(id.clone());
        }
        if i % 10 == 0 {
            enqueue(&s, "q", json!({"payload": i, "idempotent": true})).await;
            claim_job(&s, "q", &id).await;
            claimers.push(id.clone());
        }
        ids.push(id);
    }
    let before = all_events(&s).await.len();
    s.advance(1_000).await;
    let r = s.reap().await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["sessions_ended"], N, "{}", r.text);

    let mut paged = Vec::new();
    let mut after = 0;
    loop {
        let r = s.get(&format!("/v1/events?after={after}&limit=7")).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let page = r.body["events"].as_array().unwrap().clone();
        assert!(page.len() <= 7);
        if page.is_empty() {
            break;
        }
        after = r.body["next"].as_u64().unwrap();
        paged.extend(page);
    }
    assert_eq!(paged, all_events(&s).await);
    let seqs: Vec<u64> = paged.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<u64>>());
    let storm = &paged[before..];
    let sorted = |events: Vec<&Value>| {
        let mut ids: Vec<String> = events
            .iter()
            .map(|e| e["session_id"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    };
    let mut all = ids.clone();
    all.sort();
    seated.sort();
    claimers.sort();
    assert_eq!(sorted(of_kind(storm, "session_expired")), all);
    assert_eq!(sorted(of_kind(storm, "seat_reclaimed")), seated);
    assert_eq!(sorted(of_kind(storm, "job_recovered")), claimers);
    assert_eq!(storm.len(), N + seated.len() + claimers.len());

    let locks = s.get("/v1/locks?limit=1000").await;
    assert_eq!(locks.body["locks"], json!([]), "{}", locks.text);
    assert!(holders(&s, "LIC-STORM").await.is_empty());
    assert!(
        smembers(keys, &format!("{ns}:LIC-STORM:active_sessions"))
            .await
            .is_empty()
    );
    let layout: u64 = redis::cmd("HLEN")
        .arg(format!("{ns}:LIC-STORM:session_metadata"))
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert_eq!(layout, 0);
    assert_eq!(counts(&s, "q").await, (claimers.len() as u64, 0, 0, 0));
    let left: Vec<String> = keys
        .keys()
        .await
        .into_iter()
        .filter(|k| k.starts_with(&format!("{ns}:!s:")))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["check", "--backend", "redis", "--redis-url", &redis_url()])
        .args(["--namespace", &s.config.namespace])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("sessions: 0\nlocks: 0\nevents: {}\n", paged.len())),
        "{text}"
    );

    // The ended sessions' and released locks' listing entries are left to the background
    // sweep. Meanwhile the listings skip them, and a page is never cut short by them: the
    // storm's keys `k…` sort before a live session's `z…`.
    let live = s.open("live", 600_000).await;
    for k in ["z1", "z2", "z3"] {
        take(&s, k, &live).await;
    }
    let p1 = s.get("/v1/locks?limit=2").await;
    assert_eq!(lock_keys(&p1), ["z1", "z2"], "{}", p1.text);
    assert_eq!(p1.body["next"], "z2");
    let p2 = s.get("/v1/locks?limit=2&after=z2").await;
    assert_eq!(lock_keys(&p2), ["z3"], "{}", p2.text);
    let listed = s.get("/v1/sessions?limit=1").await;
    assert_eq!(listed.status, 200, "{}", listed.text);
    let page = listed.body["sessions"].as_array().unwrap();
    assert_eq!(page.len(), 1, "{}", listed.text);
    assert_eq!(page[0]["session_id"], live.as_str());
    assert!(listed.body["next"].is_null(), "{}", listed.text);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_sessions_leave_the_listing_indexes_to_the_background_sweep() {
    // Guards against the sweep that ends leave their listing entries to: a live entry taken
    // off (a listing missing a session or a lock), an ended one left for good, or a page cut
    // short by ended entries before the sweep.
    let s = TestServer::start_on(BackendKind::Redis, |c| {
        c.reaper_enabled = true;
        c.reaper_interval_ms = 50;
    })
    .await;
    let keys = s.keys.as_ref().unwrap();
    let ns = &keys.namespace;
    let mut live = Vec::new();
    for i in 0..20 {
        let id = s.open("sweep", 600_000).await;
        take(&s, &format!("k{i:02}"), &id).await;
        if i % 4 == 0 {
            live.push((format!("k{i:02}"), id));
        } else {
            close(&s, &id).await;
        }
    }
    let zcard = |key: String| {
        let mut conn = keys.conn.clone();
        async move {
            redis::cmd("ZCARD")
                .arg(key)
                .query_async::<u64>(&mut conn)
                .await
                .unwrap()
        }
    };
    let swept = Instant::now();
    while zcard(format!("{ns}:!sessions")).await != 5 || zcard(format!("{ns}:!lockidx")).await != 5
    {
        assert!(
            swept.elapsed() < Duration::from_secs(30),
            "the sweep never took the ended entries off"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lists: u64 = redis::cmd("EXISTS")
        .arg(format!("{ns}:!stale:sessions"))
        .arg(format!("{ns}:!stale:locks"))
        .query_async(&mut keys.conn.clone())
        .await
        .unwrap();
    assert_eq!(lists, 0, "the sweep's lists are emptied");
    // What is left listed is exactly the live sessions and their locks.
    let locks = s.get("/v1/locks").await;
    let want: Vec<&str> = live.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(lock_keys(&locks), want, "{}", locks.text);
    let sessions = s.get("/v1/sessions?owner=sweep").await;
    let mut listed = session_ids(&sessions);
    listed.sort();
    let mut want: Vec<&str> = live.iter().map(|(_, id)| id.as_str()).collect();
    want.sort();
    assert_eq!(listed, want, "{}", sessions.text);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_survive_redis_forgetting_the_functions() {
    // Guards against a node that loads its functions once and then fails every call with
    // "Function not found" after Redis forgets them (FUNCTION FLUSH, a restart without
    // persistence, a fail-over to a replica that never had them), and against one that
    // still depends on the script cache (SCRIPT FLUSH).
    let s = TestServer::start_on(BackendKind::Redis, |_| {}).await;
    let a = s.open("alice", 60_000).await;
    let t1 = take(&s, "before", &a).await;
    let mut conn = s.keys.as_ref().unwrap().conn.clone();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let t2 = take(&s, "after-script-flush", &a).await;
    assert!(t2 > t1, "{t2} after {t1}");
    let _: () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let t3 = take(&s, "after-function-flush", &a).await;
    assert!(t3 > t2, "{t3} after {t2}");
    assert_eq!(s.release("before", &a, t1).await.status, 200);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_publishes_what_it_freed_in_one_message() {
    // Guards against the wake-up messages other nodes read drifting from what was freed: an
    // end that frees two keys must name both in its one message (a line each), and a call
    // that frees one key must publish exactly `lock:K`, the form every version reads.
    use futures_util::StreamExt;
    let s = TestServer::start_on(BackendKind::Redis, |_| {}).await;
    let ns = &s.keys.as_ref().unwrap().namespace;
    let client = redis::Client::open(redis_url()).unwrap();
    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub.subscribe(format!("{ns}:!free")).await.unwrap();
    let mut messages = Box::pin(pubsub.into_on_message());
    let mut next = async || -> String {
        let m = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("a message within 10 s")
            .expect("the subscription open");
        m.get_payload().unwrap()
    };

    let a = s.open("alice", 60_000).await;
    take(&s, "one", &a).await;
    take(&s, "two", &a).await;
    let t = take(&s, "three", &a).await;
    assert_eq!(s.release("three", &a, t).await.status, 200);
    assert_eq!(next().await, "lock:three");
    assert_eq!(close(&s, &a).await.status, 200);
    let payload = next().await;
    let mut names: Vec<&str> = payload.split('\n').collect();
    names.sort();
    assert_eq!(names, ["lock:one", "lock:two"], "{payload:?}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_through_another_node_gets_the_first_answer() {
    // Guards against request ids remembered per node: the record lives in Redis, written by
    // the script that acted, so a retry through another node on the namespace replays it.
    let s = TestServer::start_on(BackendKind::Redis, |_| {}).await;
    let other = App::start(&s.config, Arc::new(SystemClock::new()))
        .await
        .unwrap();
    let b = Client::new(&other.url()).unwrap();
    let enqueue = json!({"payload": [1], "request_id": "enq-x"});
    let first = enqueue_with(&s, "q", enqueue.clone()).await;
    assert_eq!(first.status, 201, "{}", first.text);
    let retry = b.post("/v1/queues/q/jobs", &enqueue).await.unwrap();
    assert_eq!(retry.body, first.body, "{}", retry.text);
    assert_eq!(counts(&s, "q").await, (1, 0, 0, 0));

    let a = s.open("a", 60_000).await;
    let acquire = json!({"session_id": a, "request_id": "acq-x"});
    let got = s.post("/v1/locks/k/acquire", acquire.clone()).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let release = json!({"session_id": a, "token": got.body["token"], "request_id": "rel-x"});
    let rel = s.post("/v1/locks/k/release", release.clone()).await;
    assert_eq!(rel.status, 200, "{}", rel.text);
    let r = b.post("/v1/locks/k/release", &release).await.unwrap();
    assert_eq!(r.body, rel.body, "{}", r.text);
    let r = b.post("/v1/locks/k/acquire", &acquire).await.unwrap();
    assert_eq!(r.body, got.body, "{}", r.text);
    assert_eq!(s.get("/v1/locks/k").await.body["error"], "lock_free");
    other.shutdown().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leasehold_check_on_redis_reports_the_namespace_and_finds_a_broken_invariant() {
    // Guards against a check that cannot fail: a seat whose holder is deleted behind the
    // backend's back must be named.
    let s = TestServer::start_on(BackendKind::Redis, |_| {}).await;
    let a = s.open("alice", 60_000).await;
    take(&s, "k", &a).await;
    make_pool(&s, "p", 2).await;
    seat(&s, "p", &a).await;
    let check = || {
        Command::new(env!("CARGO_BIN_EXE_leasehold"))
            .args(["check", "--backend", "redis", "--redis-url", &redis_url()])
            .args(["--namespace", &s.config.namespace])
            .output()
            .unwrap()
    };
    let out = check();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("sessions: 1\nlocks: 1"), "{text}");
    assert!(text.contains("ok: every invariant holds"), "{text}");

    let _: () = redis::cmd("DEL")
        .arg(format!("{}:!s:{a}", s.config.namespace))
        .query_async(&mut s.keys.as_ref().unwrap().conn.clone())
        .await
        .unwrap();
    let out = check();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "lock k is held by session {a} which does not exist"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "seat in p is held by session {a} which does not exist"
        )),
        "{text}"
    );
    s.stop().await;
}

/// A `redis-server` of the test's own: a free port, a data directory, killed on drop.
struct PrivateRedis {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    args: Vec<String>,
}

impl PrivateRedis {
    fn start(args: &[&str]) -> PrivateRedis {
        let mut r = PrivateRedis {
            port: 0,
            dir: tempfile::tempdir().unwrap(),
            child: None,
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        for _ in 0..20 {
            r.port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            if r.launch() {
                return r;
            }
        }
        panic!("could not start redis-server on a free port");
    }

    /// Starts the server on the port and directory; false if it did not come up.
    fn launch(&mut self) -> bool {
        let log = std::fs::File::create(self.dir.path().join("redis.log")).unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--save", "", "--daemonize", "no"])
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("redis-server must be installed");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut()
                && c.try_wait().unwrap().is_some()
            {
                return false;
            }
            let ok = Command::new("redis-cli")
                .args(["-p", &self.port.to_string(), "PING"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG");
            if ok {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// SIGKILL: no chance to flush anything.
    fn kill_9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn restart(&mut self) {
        assert!(
            self.launch(),
            "redis-server did not come back on its directory:\n{}",
            log(self.dir.path())
        );
    }
}

fn log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("redis.log")).unwrap_or_default()
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill_9();
    }
}

fn config_on(url: &str, dir: &tempfile::TempDir) -> Config {
    Config {
        backend: BackendKind::Redis,
        redis_url: Some(url.to_string()),
        namespace: fresh_namespace(),
        redis_timeout_ms: 1_000,
        ..test_config(dir)
    }
}

async fn until_ready(client: &Client, want: bool, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let ready = matches!(client.get("/readyz").await, Ok(r) if r.status == 200);
        if ready == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "readiness did not become {want} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_crash_durable_redis_loses_no_acknowledged_grant_and_no_token_goes_back() {
    // Guards against a backend that answers before Redis has made a grant durable, or a
    // token counter that restarts lower: with appendfsync always every acknowledged grant
    // must be there after Redis is killed and started again, and the next token above all.
    // Also: while Redis is down the node is unready and answers 503 backend_unavailable, and
    // it reconnects by itself.
    let mut redis = PrivateRedis::start(&["--appendonly", "yes", "--appendfsync", "always"]);
    let dir = tempfile::tempdir().unwrap();
    let config = config_on(&redis.url(), &dir);
    let app = App::start(&config, Arc::new(SystemClock::new()))
        .await
        .unwrap_or_else(|e| panic!("a crash-durable Redis must be accepted: {e}"));
    let client = Client::new(&app.url()).unwrap();
    let m = client.get("/metrics").await.unwrap().text;
    assert!(
        m.contains("leasehold_backend_durability{class=\"crash_durable\"} 1"),
        "{m}"
    );

    // Concurrent grants until Redis is killed under them; each task records what it was
    // told.
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let client = client.clone();
            tokio::spawn(async move {
                let r = client
                    .post(
                        "/v1/sessions",
                        &json!({"owner": format!("w{w}"), "ttl_ms": 120_000}),
                    )
                    .await
                    .unwrap();
                let sid = r.body["session_id"].as_str().unwrap().to_string();
                let mut acked = Vec::new();
                for i in 0.. {
                    let key = format!("w{w}/k{i}");
                    match client
                        .post(&lock_path(&key, "acquire"), &json!({"session_id": sid}))
                        .await
                    {
                        Ok(r) if r.status == 200 => {
                            acked.push((key, r.body["token"].as_u64().unwrap()))
                        }
                        // Redis is gone: what was not acknowledged may or may not be there.
                        _ => break,
                    }
                }
                (sid, acked)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(700)).await;
    redis.kill_9();
    let mut acked = Vec::new();
    for w in workers {
        let (sid, grants) = w.await.unwrap();
        acked.extend(grants.into_iter().map(|(k, t)| (sid.clone(), k, t)));
    }
    assert!(
        acked.len() >= 8,
        "too few grants to mean anything: {}",
        acked.len()
    );

    // Down: unready, and an operation is 503 backend_unavailable.
    until_ready(&client, false, Duration::from_secs(10)).await;
    let r = client
        .post("/v1/sessions", &json!({"owner": "x", "ttl_ms": 60_000}))
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.body["error"], "backend_unavailable", "{}", r.text);

    // Back on the same directory: the node reconnects by itself.
    redis.restart();
    until_ready(&client, true, Duration::from_secs(15)).await;
    let mut high = 0;
    for (sid, key, token) in &acked {
        let r = client
            .get(&format!("/v1/locks/{}", leasehold::client::segment(key)))
            .await
            .unwrap();
        assert_eq!(
            r.status, 200,
            "acknowledged grant {key} was lost: {}",
            r.text
        );
        assert_eq!(r.body["session_id"], sid.as_str(), "{}", r.text);
        assert_eq!(r.body["token"], *token, "{}", r.text);
        high = high.max(*token);
    }
    let sid = acked[0].0.clone();
    let r = client
        .post("/v1/locks/after/acquire", &json!({"session_id": sid}))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    let next = r.body["token"].as_u64().unwrap();
    assert!(next > high, "token {next} after a restart, {high} before");
    eprintln!(
        "{} acknowledged grants kept through kill -9; next token {next} > {high}",
        acked.len()
    );
    app.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volatile_redis_is_refused_without_the_opt_in_and_named_in_the_metric_with_it() {
    // Guards against a node that silently runs where a Redis crash loses acknowledged grants.
    let redis = PrivateRedis::start(&["--appendonly", "no"]);
    let dir = tempfile::tempdir().unwrap();
    let config = config_on(&redis.url(), &dir);
    let err = match App::start(&config, Arc::new(SystemClock::new())).await {
        Ok(_) => panic!("a Redis without append-only persistence was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("is not crash-durable"), "{err}");
    assert!(err.contains("appendonly is no"), "{err}");
    assert!(err.contains("tokens can go backwards"), "{err}");
    assert!(err.contains("redis_allow_volatile = true"), "{err}");

    let app = App::start(
        &Config {
            redis_allow_volatile: true,
            ..config
        },
        Arc::new(SystemClock::new()),
    )
    .await
    .unwrap();
    let client = Client::new(&app.url()).unwrap();
    let m = client.get("/metrics").await.unwrap().text;
    assert!(
        m.contains("leasehold_backend_durability{class=\"no_aof\"} 1"),
        "{m}"
    );
    assert_eq!(client.get("/readyz").await.unwrap().status, 200);
    app.shutdown().await;
}
