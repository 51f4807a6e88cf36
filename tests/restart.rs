//! Restart tests: the server stops cleanly and starts again on the same data directory.
//!
//! They guard against a restart that forgets or bends what the API acknowledged: sessions,
//! locks or audit events that vanish, a fencing token counter that starts again from a
//! lower value (so a stale holder's token would look current), live sessions that expire at
//! once because their deadline is not refreshed (no restart grace) or never expire because it
//! is refreshed too generously, closed sessions and released locks that come back, and a data
//! file that `leasehold check` no longer accepts.
mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::TestServer;
use leasehold::client::{Reply, segment};
use serde_json::{Value, json};

/// The wall clock of the harness's manual clock at monotonic 0.
const WALL0: u64 = 1_700_000_000_000;

fn token_of(r: &Reply) -> u64 {
    assert_eq!(r.status, 200, "acquire: {}", r.text);
    r.body["token"]
        .as_u64()
        .unwrap_or_else(|| panic!("no token in {}", r.text))
}

async fn lock(s: &TestServer, key: &str) -> Reply {
    s.get(&format!("/v1/locks/{}", segment(key))).await
}

async fn session(s: &TestServer, id: &str) -> Reply {
    s.get(&format!("/v1/sessions/{id}")).await
}

/// The locks a session lists, as key → token.
fn held(r: &Reply) -> BTreeMap<String, u64> {
    assert_eq!(r.status, 200, "session: {}", r.text);
    r.body["locks"]
        .as_array()
        .unwrap_or_else(|| panic!("no locks in {}", r.text))
        .iter()
        .map(|l| {
            (
                l["key"].as_str().unwrap().to_string(),
                l["token"].as_u64().unwrap(),
            )
        })
        .collect()
}

async fn all_events(s: &TestServer) -> Vec<Value> {
    let r = s.get("/v1/events?after=0&limit=10000").await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.body["events"].as_array().unwrap().clone()
}

fn assert_gone(r: &Reply, what: &str) {
    assert_eq!(r.status, 404, "{what}: {}", r.text);
    assert_eq!(r.body["error"], "session_gone", "{what}: {}", r.text);
}

fn assert_free(r: &Reply, what: &str) {
    assert_eq!(r.status, 404, "{what}: {}", r.text);
    assert_eq!(r.body["error"], "lock_free", "{what}: {}", r.text);
}

/// Runs `leasehold check --data-dir DIR` and returns (exit code, stdout).
fn check(dir: &std::path::Path) -> (Option<i32>, String) {
    leasehold(&["check", "--data-dir"], dir)
}

/// Runs the binary with `args` and then `dir`; the exit code and everything it printed.
fn leasehold(args: &[&str], dir: &std::path::Path) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(args)
        .arg(dir)
        .env_remove("LEASEHOLD_DATA_DIR")
        .output()
        .expect("run leasehold");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    (out.status.code(), format!("{stdout}{stderr}"))
}

#[tokio::test]
async fn sessions_locks_and_events_survive_a_restart() {
    let mut s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let t_migrate = token_of(&s.acquire("db/migrate", &a).await);
    let t_job = token_of(&s.acquire("jobs/1", &a).await);
    let t_x = token_of(&s.acquire("x y", &b).await);
    let before_lock = lock(&s, "db/migrate").await;
    assert_eq!(before_lock.status, 200, "{}", before_lock.text);
    let before_session = session(&s, &a).await;
    let events_before = all_events(&s).await;
    // 2 opens and 3 acquires.
    assert_eq!(events_before.len(), 5, "{events_before:?}");

    s.restart().await;

    // The session and everything it holds.
    let sa = session(&s, &a).await;
    assert_eq!(
        held(&sa),
        BTreeMap::from([
            ("db/migrate".to_string(), t_migrate),
            ("jobs/1".into(), t_job)
        ])
    );
    assert_eq!(sa.body["owner"], "alice");
    assert_eq!(sa.body["ttl_ms"], 60_000);
    assert_eq!(sa.body["created_at"], before_session.body["created_at"]);
    assert_eq!(
        held(&session(&s, &b).await),
        BTreeMap::from([("x y".to_string(), t_x)])
    );

    // Each lock: holder, token and acquisition time.
    let l = lock(&s, "db/migrate").await;
    assert_eq!(l.status, 200, "{}", l.text);
    assert_eq!(l.body, before_lock.body);
    assert_eq!(l.body["session_id"], a.as_str());
    assert_eq!(l.body["token"], t_migrate);
    let l = lock(&s, "x y").await;
    assert_eq!(l.body["session_id"], b.as_str(), "{}", l.text);
    assert_eq!(l.body["token"], t_x);
    let fence = s
        .get(&format!("/v1/fence/{}?token={t_job}", segment("jobs/1")))
        .await;
    assert_eq!(fence.body["current"], true, "{}", fence.text);
    assert_eq!(fence.body["latest"], t_job);

    // Mutual exclusion still holds, and the holder asking again gets its own grant back.
    let contender = s.acquire("db/migrate", &b).await;
    assert_eq!(contender.status, 409, "{}", contender.text);
    assert_eq!(contender.body["error"], "lock_held");
    assert_eq!(token_of(&s.acquire("db/migrate", &a).await), t_migrate);

    // The audit log is unchanged, and the next event continues its sequence.
    let events_after = all_events(&s).await;
    assert_eq!(events_after, events_before);
    assert_eq!(s.release("jobs/1", &a, t_job).await.status, 200);
    let events = all_events(&s).await;
    assert_eq!(events.len(), 6, "{events:?}");
    let last = &events[5];
    assert_eq!(last["seq"], events_before[4]["seq"].as_u64().unwrap() + 1);
    assert_eq!(last["kind"], "lock_released", "{last}");
    assert_eq!(last["token"], t_job);
    s.stop().await;
}

#[tokio::test]
async fn tokens_keep_growing_across_restarts() {
    let mut s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let mut highest = 0;
    for round in 0..4 {
        // Grants, releases and a session open and close, so the counter moves in every way.
        let t1 = token_of(&s.acquire(&format!("r{round}/a"), &a).await);
        let t2 = token_of(&s.acquire(&format!("r{round}/b"), &a).await);
        assert!(
            t1 > highest && t2 > t1,
            "round {round}: {highest} {t1} {t2}"
        );
        assert_eq!(s.release(&format!("r{round}/a"), &a, t1).await.status, 200);
        let c = s.open("carol", 60_000).await;
        let t3 = token_of(&s.acquire(&format!("r{round}/c"), &c).await);
        assert!(t3 > t2, "round {round}: {t2} {t3}");
        assert_eq!(s.delete(&format!("/v1/sessions/{c}")).await.status, 200);
        highest = t3;

        s.restart().await;

        let fresh = token_of(&s.acquire(&format!("after{round}"), &a).await);
        assert!(
            fresh > highest,
            "round {round}: token {fresh} after restart is not above {highest}"
        );
        // A key freed before the restart gets a new, higher token too.
        let again = token_of(&s.acquire(&format!("r{round}/a"), &a).await);
        assert!(again > fresh, "round {round}: {again} <= {fresh}");
        highest = again;
    }
    s.stop().await;
}

/// Requests in flight while the server shuts down: whatever was answered 200 is kept, and
/// whatever was refused as `shutting_down` did not happen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_keeps_every_acknowledged_grant() {
    let mut s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let granted_so_far = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let client = s.client.clone();
        let a = a.clone();
        let granted_so_far = granted_so_far.clone();
        // Acquires one after another until the first one that is not granted.
        tasks.push(tokio::spawn(async move {
            let mut results = Vec::new();
            for i in 0..100_000 {
                let key = format!("inflight/{w}/{i}");
                let path = format!("/v1/locks/{}/acquire", segment(&key));
                let body = json!({"session_id": a});
                let r = tokio::time::timeout(Duration::from_secs(10), client.post(&path, &body))
                    .await
                    .expect("an acquire hung");
                let granted = matches!(&r, Ok(r) if r.status == 200);
                granted_so_far.fetch_add(usize::from(granted), Ordering::SeqCst);
                results.push((key, r));
                if !granted {
                    break;
                }
            }
            results
        }));
    }
    // Shut down under load, once some grants have gone through.
    let deadline = Instant::now() + Duration::from_secs(10);
    while granted_so_far.load(Ordering::SeqCst) < 16 {
        assert!(Instant::now() < deadline, "the load never got going");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    s.restart().await;
    let (mut acked, mut refused, mut cut) = (0, 0, 0);
    for task in tasks {
        for (key, answer) in task.await.unwrap() {
            let now = lock(&s, &key).await;
            match answer {
                Ok(r) if r.status == 200 => {
                    acked += 1;
                    assert_eq!(
                        now.status, 200,
                        "{key} was granted, then lost: {}",
                        now.text
                    );
                    assert_eq!(now.body["token"], r.body["token"], "{key}");
                    assert_eq!(now.body["session_id"], a.as_str(), "{key}");
                }
                Ok(r) if r.body["error"] == "shutting_down" => {
                    refused += 1;
                    assert_free(&now, &format!("{key} was refused, yet it is held"));
                }
                Ok(r) => panic!("{key}: unexpected answer {} {}", r.status, r.text),
                // The connection was cut or refused: either outcome is allowed.
                Err(_) => cut += 1,
            }
        }
    }
    eprintln!("around the shutdown: {acked} acquires granted, {refused} refused, {cut} cut off");
    assert!(acked > 0, "no acquire went through before the shutdown");
    let held = held(&session(&s, &a).await);
    assert!(held.len() >= acked, "{} held, {acked} granted", held.len());
    s.stop().await;
}

/// A restart gives every live session a fresh deadline of restart + TTL: heartbeats are not
/// persisted, so this is the only deadline that cannot expire a live client early.
#[tokio::test]
async fn live_sessions_get_the_restart_grace() {
    let mut s = TestServer::start().await;
    let a = s.open("alice", 5_000).await;
    let b = s.open("bob", 5_000).await;
    // A TTL changed by a heartbeat is persisted, so the grace uses the new one.
    let c = s.open("carol", 5_000).await;
    let r = s
        .post(
            &format!("/v1/sessions/{c}/heartbeat"),
            json!({"ttl_ms": 20_000}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let ta = token_of(&s.acquire("grace/a", &a).await);

    s.advance(4_000).await;
    s.restart().await; // at 4000

    // 8000 since the last heartbeat, but only 4000 since the restart.
    s.advance(4_000).await;
    let r = s.heartbeat(&a).await;
    assert_eq!(r.status, 200, "alice lost her restart grace: {}", r.text);
    assert_eq!(r.body["expires_at"], WALL0 + 8_000 + 5_000);
    // Reading does not extend: bob's deadline is still restart + TTL.
    let rb = session(&s, &b).await;
    assert_eq!(rb.status, 200, "bob lost his restart grace: {}", rb.text);
    assert_eq!(rb.body["expires_at"], WALL0 + 4_000 + 5_000);
    assert_eq!(rb.body["last_heartbeat_at"], WALL0 + 4_000);
    assert_eq!(rb.body["state"], "grace");
    let rc = session(&s, &c).await;
    assert_eq!(rc.status, 200, "{}", rc.text);
    assert_eq!(rc.body["ttl_ms"], 20_000);
    assert_eq!(rc.body["expires_at"], WALL0 + 4_000 + 20_000);
    let l = lock(&s, "grace/a").await;
    assert_eq!(l.body["token"], ta, "{}", l.text);

    // 5000 since the restart: bob, who never heartbeated, is gone; the grace is one TTL,
    // not more.
    s.advance(1_000).await;
    assert_gone(&s.heartbeat(&b).await, "bob, 5000 after the restart");
    assert_gone(&session(&s, &b).await, "bob, 5000 after the restart");
    assert_eq!(session(&s, &a).await.status, 200);

    // Alice's heartbeat at 8000 carries her to 13000, not further.
    s.advance(3_999).await;
    assert_eq!(s.heartbeat(&a).await.status, 200); // at 12999: now up to 17999
    s.advance(5_000).await;
    assert_gone(
        &s.heartbeat(&a).await,
        "alice, 5000 after her last heartbeat",
    );
    // Her lock goes to a contender, with a higher token.
    let d = s.open("dave", 60_000).await;
    let td = token_of(&s.acquire("grace/a", &d).await);
    assert!(td > ta, "{td} <= {ta}");
    // Carol's persisted TTL of 20000 still holds her: 4000 + 20000 = 24000 > 17999.
    assert_eq!(s.heartbeat(&c).await.status, 200);
    s.stop().await;
}

#[tokio::test]
async fn closed_sessions_and_released_locks_stay_gone() {
    let mut s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let ta = token_of(&s.acquire("closed/a", &a).await);
    let ta2 = token_of(&s.acquire("closed/a2", &a).await);
    let tb = token_of(&s.acquire("released/b", &b).await);
    let r = s.delete(&format!("/v1/sessions/{a}")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["released"], 2);
    assert_eq!(s.release("released/b", &b, tb).await.status, 200);

    s.restart().await;

    assert_gone(&s.heartbeat(&a).await, "closed session after restart");
    assert_gone(&session(&s, &a).await, "closed session after restart");
    assert_gone(
        &s.acquire("other", &a).await,
        "acquire by a closed session after restart",
    );
    for (key, token) in [("closed/a", ta), ("closed/a2", ta2), ("released/b", tb)] {
        assert_free(&lock(&s, key).await, key);
        let fence = s
            .get(&format!("/v1/fence/{}?token={token}", segment(key)))
            .await;
        assert_eq!(fence.body["current"], false, "{key}: {}", fence.text);
        assert_eq!(fence.body["latest"], Value::Null, "{key}: {}", fence.text);
    }
    // Closing again releases nothing; bob holds nothing now.
    let r = s.delete(&format!("/v1/sessions/{a}")).await;
    assert_eq!(r.body["released"], 0, "{}", r.text);
    assert!(held(&session(&s, &b).await).is_empty());
    // A second restart changes nothing.
    s.restart().await;
    assert_gone(&s.heartbeat(&a).await, "closed session after two restarts");
    assert_free(&lock(&s, "released/b").await, "released/b");
    s.stop().await;
}

/// A session that answered "gone" because its deadline passed must stay gone after a
/// restart (invariant 3), even when no reaper pass ended it before the restart. (At 643b599
/// the heartbeat said 404 from memory only, and the restart grace brought the session back.)
#[tokio::test]
async fn an_expired_session_stays_gone_after_a_restart() {
    let mut s = TestServer::start().await;
    let a = s.open("alice", 1_000).await;
    let ta = token_of(&s.acquire("expired/a", &a).await);
    s.advance(1_000).await;
    assert_gone(&s.heartbeat(&a).await, "alice at her deadline");
    let fence = s
        .get(&format!("/v1/fence/{}?token={ta}", segment("expired/a")))
        .await;
    assert_eq!(fence.body["current"], false, "{}", fence.text);

    s.restart().await;

    assert_gone(&s.heartbeat(&a).await, "alice after the restart");
    assert_gone(&session(&s, &a).await, "alice after the restart");
    let fence = s
        .get(&format!("/v1/fence/{}?token={ta}", segment("expired/a")))
        .await;
    assert_eq!(fence.body["current"], false, "{}", fence.text);
    s.stop().await;
}

#[tokio::test]
async fn check_accepts_the_data_directory_after_a_shutdown() {
    let mut s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let c = s.open("carol", 60_000).await;
    token_of(&s.acquire("k/1", &a).await);
    let t2 = token_of(&s.acquire("k/2", &a).await);
    token_of(&s.acquire("k/3", &b).await);
    token_of(&s.acquire("k/4", &c).await);
    assert_eq!(s.release("k/2", &a, t2).await.status, 200);
    assert_eq!(s.delete(&format!("/v1/sessions/{c}")).await.status, 200);
    s.restart().await;
    token_of(&s.acquire("k/5", &b).await);
    // Compacting is offline: a running server's directory is refused.
    let (code, out) = leasehold(&["compact", "--data-dir"], s.dir.path());
    assert_eq!(code, Some(2), "compact ran beside a server:\n{out}");
    assert!(out.contains("cannot open"), "{out}");

    // Stop the server but keep the directory (TestServer::stop would delete it).
    s.app.take().unwrap().shutdown().await;
    let (code, out) = check(s.dir.path());
    assert_eq!(code, Some(0), "leasehold check failed:\n{out}");
    assert!(out.contains("ok: every invariant holds"), "{out}");
    assert!(out.contains("sessions: 2\n"), "{out}");
    assert!(out.contains("locks: 3\n"), "{out}");
    // 3 opens, 5 acquires, 1 release, 1 close.
    assert!(out.contains("events: 10\n"), "{out}");
    // Where the file's space goes: a line a table with rows, its row count first.
    let rows_of = |table: &str| {
        out.lines()
            .find_map(|l| {
                let mut words = l.split_whitespace();
                (words.next() == Some(table)).then(|| words.next().unwrap().to_string())
            })
            .unwrap_or_else(|| panic!("no space line for {table}:\n{out}"))
    };
    assert_eq!(rows_of("lock_rows"), "3", "{out}");
    assert_eq!(rows_of("events"), "10", "{out}");
    assert_eq!(rows_of("session_rows"), "2", "{out}");
    assert!(out.contains("\nfile: "), "{out}");

    // Compacting, offline, keeps everything and checks the result.
    let (code, out) = leasehold(&["compact", "--data-dir"], s.dir.path());
    assert_eq!(code, Some(0), "leasehold compact failed:\n{out}");
    assert!(out.contains("compacted "), "{out}");
    assert!(out.contains("ok: every invariant holds"), "{out}");
    assert!(out.contains("sessions: 2\n"), "{out}");
    assert!(out.contains("locks: 3\n"), "{out}");

    // The check does say no when there is nothing to check.
    let empty = tempfile::tempdir().unwrap();
    let (code, out) = check(empty.path());
    assert_ne!(code, Some(0), "check passed an empty directory:\n{out}");
}

/// A shutdown used to wait out every long poll: a client waiting 30 s for a lock held the
/// drain until the grace period ran out and then lost its connection. Waiters are answered
/// `503 shutting_down` at once instead, and the drain finishes promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_waiters_at_once() {
    let s = TestServer::start_real(|c| c.shutdown_grace_ms = 20_000).await;
    let a = s.open("holder", 60_000).await;
    let b = s.open("waiter", 60_000).await;
    assert_eq!(s.acquire("k", &a).await.status, 200);
    let client = s.client.clone();
    let waiting = tokio::spawn(async move {
        client
            .post(
                "/v1/locks/k/acquire",
                &serde_json::json!({"session_id": b, "wait_ms": 30_000}),
            )
            .await
    });
    // Let the waiter reach the writer's queue.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    s.stop().await;
    let reply = waiting.await.unwrap().expect("the waiter gets an answer");
    assert_eq!(reply.status, 503, "{}", reply.text);
    assert_eq!(reply.body["error"], "shutting_down");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "the drain waited {:?}",
        started.elapsed()
    );
}
