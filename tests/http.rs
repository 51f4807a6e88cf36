//! HTTP tests that are not part of the contract suite (`tests/contract`), each section
//! saying why: the HTTP server's own connection limits, which no backend takes part in, and
//! what only the embedded backend has — injected storage faults and fail-stop, expiry judged
//! by the node's own monotonic clock, and the writer's paced reaper passes.
mod common;

use std::time::{Duration, Instant};

use common::*;
use leasehold::client::segment;
use serde_json::json;
use tokio::net::TcpStream;

// ---------------------------------------------------------------------------------------------
// The HTTP server's connection limits: the same code in front of every backend, and no
// request here reaches one, so running them once is enough.
// ---------------------------------------------------------------------------------------------

/// Reads until the server closes the connection (end of stream or reset), for at most
/// `limit`. Returns what was read, or `None` when the connection was still open at the end.
async fn read_until_closed(stream: &TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            if stream.readable().await.is_err() {
                return;
            }
            match stream.try_read(&mut buf) {
                Ok(0) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(_) => return, // reset: closed too
            }
        }
    };
    match tokio::time::timeout(limit, read).await {
        Ok(()) => Some(got),
        Err(_) => None,
    }
}

/// Reads until what was read contains `needle`, for at most `limit`. `None` when it never
/// did (the connection stayed silent or closed first).
async fn read_until_contains(stream: &TcpStream, needle: &str, limit: Duration) -> Option<String> {
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            if String::from_utf8_lossy(&got).contains(needle) {
                return true;
            }
            if stream.readable().await.is_err() {
                return false;
            }
            match stream.try_read(&mut buf) {
                Ok(0) => return String::from_utf8_lossy(&got).contains(needle),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(_) => return false,
            }
        }
    };
    match tokio::time::timeout(limit, read).await {
        Ok(true) => Some(String::from_utf8_lossy(&got).into_owned()),
        _ => None,
    }
}

async fn write_all(stream: &TcpStream, mut data: &[u8]) {
    while !data.is_empty() {
        stream.writable().await.unwrap();
        match stream.try_write(data) {
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => panic!("write failed: {e}"),
        }
    }
}

#[tokio::test]
async fn header_read_timeout_closes_a_stalled_connection() {
    let s = TestServer::start_with(|c| c.header_read_timeout_ms = 300).await;
    // A complete request on a raw socket is answered (so the raw client itself works).
    let ok = TcpStream::connect(addr(&s)).await.unwrap();
    write_all(
        &ok,
        b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n",
    )
    .await;
    let answer = read_until_closed(&ok, Duration::from_secs(2))
        .await
        .expect("a complete request is answered and closed");
    assert!(
        String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );

    // A request whose headers never end is cut off after the header read timeout.
    let stalled = TcpStream::connect(addr(&s)).await.unwrap();
    let started = Instant::now();
    write_all(&stalled, b"GET /healthz HTTP/1.1\r\nHost: te").await;
    let got = read_until_closed(&stalled, Duration::from_secs(2)).await;
    let elapsed = started.elapsed();
    let got = got.expect("the server did not close a connection stalled in its headers");
    assert!(
        elapsed >= Duration::from_millis(250),
        "closed before the timeout: {elapsed:?}"
    );
    assert!(
        !String::from_utf8_lossy(&got).contains("200 OK"),
        "an unfinished request was answered: {}",
        String::from_utf8_lossy(&got)
    );
    // The server still serves.
    assert_eq!(s.get("/healthz").await.status, 200);
    s.stop().await;
}

#[tokio::test]
async fn idle_timeout_closes_an_idle_connection() {
    let s = TestServer::start_with(|c| c.idle_timeout_ms = 300).await;
    let conn = TcpStream::connect(addr(&s)).await.unwrap();
    write_all(&conn, b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n").await;
    let answer = read_until_contains(&conn, "\"ok\"", Duration::from_secs(2))
        .await
        .expect("the request is answered");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // Keep-alive, but nothing more is sent: the server closes it.
    let started = Instant::now();
    let rest = read_until_closed(&conn, Duration::from_secs(2)).await;
    let elapsed = started.elapsed();
    assert!(rest.is_some(), "an idle connection was kept open");
    assert!(
        elapsed >= Duration::from_millis(200),
        "closed early: {elapsed:?}"
    );
    s.stop().await;
}

#[tokio::test]
async fn connections_over_the_cap_wait_for_a_free_slot() {
    let s = TestServer::start_with(|c| c.max_connections = 2).await;
    let request = b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n";
    let mut held = Vec::new();
    for _ in 0..2 {
        let conn = TcpStream::connect(addr(&s)).await.unwrap();
        write_all(&conn, request).await;
        read_until_contains(&conn, "\"ok\"", Duration::from_secs(2))
            .await
            .expect("within the cap, connections are served");
        held.push(conn);
    }
    // A third connection is not served while both slots are taken (bounded check).
    let third = TcpStream::connect(addr(&s)).await.unwrap();
    write_all(&third, request).await;
    assert!(
        read_until_contains(&third, "\"ok\"", Duration::from_millis(300))
            .await
            .is_none(),
        "a connection over the cap was served"
    );
    // Freeing a slot lets it in.
    drop(held.pop());
    let answer = read_until_contains(&third, "\"ok\"", Duration::from_secs(2))
        .await
        .expect("the waiting connection is served once a slot is free");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(held);
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Fail-stop (embedded only): the faults are injected into the embedded store's file I/O, and
// what a failed commit leaves behind is the embedded writer's memory.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn storage_failure_is_503_and_fail_stop() {
    let (s, switch) = TestServer::start_faulty().await;
    let a = s.open("alice", 60_000).await;
    let t = take(&s, "k", &a).await;
    let events_before = all_events(&s).await;
    assert_eq!(events_before.len(), 2);

    switch.fail_writes();
    assert_error(&s.acquire("k2", &a).await, 503, "store_failed");
    let ready = s.get("/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.text);
    assert_eq!(ready.body["ready"], false);
    // Every later write is refused, even ones that would not touch the disk themselves.
    let open = s.post("/v1/sessions", json!({"owner": "bob"})).await;
    assert_error(&open, 503, "store_failed");
    assert_error(&s.acquire("k3", &a).await, 503, "store_failed");
    assert_error(&s.release("k", &a, t).await, 503, "store_failed");
    assert_error(&s.heartbeat(&a).await, 503, "store_failed");
    assert_error(&s.reap().await, 503, "store_failed");
    assert_error(
        &s.post(&format!("/v1/admin/sessions/{a}/end"), json!({}))
            .await,
        503,
        "store_failed",
    );
    assert_eq!(s.get("/readyz").await.status, 503, "it stays unready");
    assert_eq!(
        s.get("/healthz").await.status,
        200,
        "the process is still up"
    );
    assert_eq!(metric(&s, "leasehold_store_failed").await, Some(1.0));

    // Reads still work and show exactly what was committed.
    let h = holder(&s, "k").await;
    assert_eq!(h.status, 200, "{}", h.text);
    assert_eq!(h.body["session_id"], a.as_str());
    assert_eq!(h.body["token"], t);
    assert_error(&holder(&s, "k2").await, 404, "lock_free");
    let list = s.get("/v1/locks").await;
    assert_eq!(list.status, 200);
    assert_eq!(list.body["locks"].as_array().unwrap().len(), 1);
    assert_eq!(all_events(&s).await, events_before);
    // Liveness lives in memory, which a failed commit may have changed: not vouched for.
    assert_error(
        &s.get(&format!("/v1/sessions/{a}")).await,
        503,
        "store_failed",
    );
    assert_error(
        &s.post("/v1/admin/reap", json!({"dry_run": true})).await,
        503,
        "store_failed",
    );
    s.stop().await;
}

#[tokio::test]
async fn after_a_failed_commit_liveness_is_not_vouched_for() {
    // A refused close was applied in memory before its commit failed. Memory can no longer
    // say who is alive, so reads that depend on it answer 503 rather than guess; what the
    // store committed is still readable, and a restart shows exactly that.
    let (s, switch) = TestServer::start_faulty().await;
    let a = s.open("alice", 60_000).await;
    let t = take(&s, "k", &a).await;
    switch.fail_writes();
    assert_error(
        &s.delete(&format!("/v1/sessions/{a}")).await,
        503,
        "store_failed",
    );
    assert_error(
        &s.get(&format!("/v1/sessions/{a}")).await,
        503,
        "store_failed",
    );
    assert_error(
        &s.get(&format!("/v1/fence/k?token={t}")).await,
        503,
        "store_failed",
    );
    assert_error(&s.get("/v1/sessions").await, 503, "store_failed");
    // The lock table is read from the store: the committed holder.
    assert_eq!(holder(&s, "k").await.body["session_id"], a.as_str());
    s.stop().await;
}

#[tokio::test]
async fn a_waiter_is_refused_when_the_store_fails() {
    let (s, switch) = TestServer::start_faulty().await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta = take(&s, "k", &a).await;
    let wait_b = spawn_acquire(&s, "k", &b, 30_000);
    until_waiters(&s, 1).await;
    switch.fail_writes();
    assert_error(&s.release("k", &a, ta).await, 503, "store_failed");
    // Answered, not left hanging.
    assert_error(&answer(wait_b).await, 503, "store_failed");
    assert_eq!(
        holder(&s, "k").await.body["token"],
        ta,
        "the committed grant"
    );
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// The node's clocks (embedded only): the embedded backend judges expiry on the node's
// monotonic clock and stamps answers with the node's wall clock; on PostgreSQL the database
// clock does both, so a step of the node's wall clock has nothing to move there.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_wall_clock_step_expires_no_one() {
    let s = TestServer::start().await;
    let a = s.open("alice", 2_000).await;
    let t = take(&s, "k", &a).await;
    s.advance(1_500).await;

    s.clock().step_wall(-3_600_000);
    let hb = s.heartbeat(&a).await;
    assert_eq!(hb.status, 200, "{}", hb.text);
    // Deadlines shown follow the (stepped) wall clock, but liveness does not.
    assert_eq!(hb.body["expires_at"], BASE + 1_500 - 3_600_000 + 2_000);
    assert_eq!(s.reap().await.body["sessions_ended"], 0);

    s.advance(1_500).await;
    s.clock().step_wall(3_600_000);
    assert_eq!(s.heartbeat(&a).await.status, 200);
    let dry = s.post("/v1/admin/reap", json!({"dry_run": true})).await;
    assert_eq!(dry.body["sessions"], json!([]));
    assert_eq!(s.reap().await.body["sessions_ended"], 0);

    // A forward step far past the TTL expires no one either.
    s.clock().step_wall(10 * 3_600_000);
    assert_eq!(s.heartbeat(&a).await.status, 200);
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    assert_eq!(fence(&s, "k", t).await.body["current"], true);
    assert_eq!(holder(&s, "k").await.body["session_id"], a.as_str());
    assert_eq!(session(&s, &a).await.body["state"], "active");
    // The monotonic clock still rules: without heartbeats the session does end.
    s.advance(2_000).await;
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Paced reaper passes (embedded only): the embedded writer sizes each pass to
// `reaper_pass_ms` and reports it in `leasehold_reaper_batch_size`.
// ---------------------------------------------------------------------------------------------

/// A mass expiry left to the background reaper is worked off in several paced passes, not
/// one long one, and still ends every session, frees every lock and counts every one.
#[tokio::test]
async fn the_background_reaper_works_off_a_mass_expiry_in_paced_passes() {
    const N: usize = 600;
    let s = TestServer::start_with(|c| {
        c.reaper_enabled = true;
        c.reaper_interval_ms = 10;
        c.reaper_pass_ms = 1;
    })
    .await;
    let survivor = s.open("live", 600_000).await;
    let kept = take(&s, "live/k", &survivor).await;
    // Opened and locked concurrently, so that they share commits.
    let mut dying = tokio::task::JoinSet::new();
    for i in 0..N {
        let client = s.client.clone();
        dying.spawn(async move {
            let body = json!({"owner": "dying", "ttl_ms": 2_000});
            let opened = client.post("/v1/sessions", &body).await.unwrap();
            assert_eq!(opened.status, 201, "{}", opened.text);
            let id = opened.body["session_id"].as_str().unwrap().to_string();
            let path = format!("/v1/locks/{}/acquire", segment(&format!("mx/{i:04}")));
            let got = client
                .post(&path, &json!({"session_id": id}))
                .await
                .unwrap();
            assert_eq!(got.status, 200, "{}", got.text);
        });
    }
    while let Some(done) = dying.join_next().await {
        done.unwrap();
    }
    assert_eq!(
        metric(&s, "leasehold_locks_held").await,
        Some(N as f64 + 1.0)
    );

    s.advance(2_000).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&s, "leasehold_sessions_active").await != Some(1.0) {
        assert!(Instant::now() < deadline, "the reaper did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The first pass of a storm asks for a few hundred sessions at most, so 600 take at
    // least two; the passes together ended exactly the dying sessions.
    let passes = metric(&s, "leasehold_reaper_batch_size_count")
        .await
        .unwrap();
    assert!(passes >= 2.0, "{passes} passes");
    assert_eq!(
        metric(&s, "leasehold_reaper_batch_size_sum").await,
        Some(N as f64)
    );
    assert_eq!(
        metric(&s, "leasehold_locks_released_by_expiry_total").await,
        Some(N as f64)
    );
    let listed = s.get("/v1/locks?prefix=mx/&limit=10").await;
    assert_eq!(listed.status, 200, "{}", listed.text);
    assert_eq!(listed.body["locks"], json!([]), "{}", listed.text);
    assert_eq!(holder(&s, "live/k").await.body["token"], kept);
    let ev = all_events(&s).await;
    assert_eq!(of_kind(&ev, "session_expired").len(), N);
    s.stop().await;
}
