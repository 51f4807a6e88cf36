//! HTTP end-to-end tests: every endpoint and every error of API v1, against the real server on
//! port 0 (see `common`), driven by a manual clock unless a test measures real waits.
//!
//! They guard against what a client would notice first: a waiter served out of turn, a lock
//! that stays pinned by a dead holder, a heartbeat that brings a session back, a fencing answer
//! that says "current" for a stale token, an audit log with a missing or misnamed ending, input
//! the server accepts although it breaks a rule, and a server that keeps acknowledging writes
//! after its storage failed.
mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{TestServer, all_events, assert_error, assert_invalid, of_kind, random_id, session};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use leasehold::client::{Client, Reply, segment};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// The manual clock's wall time at start-up (see `common::TestServer::start_with`).
const BASE: u64 = 1_700_000_000_000;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A response to a request made with arbitrary bytes and method.
struct Raw {
    status: u16,
    text: String,
    body: Value,
}

/// Sends `body` as is (not necessarily JSON) with `method` to `path`.
async fn raw(s: &TestServer, method: Method, path: &str, body: Vec<u8>) -> Raw {
    let http = HyperClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(method)
        .uri(format!("{}{}", s.url(), path))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Raw { status, text, body }
}

fn lock_path(key: &str, action: &str) -> String {
    format!("/v1/locks/{}/{action}", segment(key))
}

async fn open_with(s: &TestServer, body: Value) -> Reply {
    s.post("/v1/sessions", body).await
}

async fn acquire_wait(c: &Client, key: &str, session: &str, wait_ms: u64) -> Reply {
    c.post(
        &lock_path(key, "acquire"),
        &json!({"session_id": session, "wait_ms": wait_ms}),
    )
    .await
    .unwrap()
}

/// Starts an acquire that may wait, on its own task.
fn spawn_acquire(s: &TestServer, key: &str, session: &str, wait_ms: u64) -> JoinHandle<Reply> {
    let c = s.client.clone();
    let key = key.to_string();
    let session = session.to_string();
    tokio::spawn(async move { acquire_wait(&c, &key, &session, wait_ms).await })
}

/// The answer of a spawned acquire. Bounded, so that a waiter the server forgot fails the
/// test instead of hanging it.
async fn join(task: JoinHandle<Reply>) -> Reply {
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("a waiting acquire was never answered")
        .unwrap()
}

/// Acquires `key` for `session` and returns the token, failing the test otherwise.
async fn take(s: &TestServer, key: &str, session: &str) -> u64 {
    let r = s.acquire(key, session).await;
    assert_eq!(r.status, 200, "acquire {key}: {}", r.text);
    r.body["token"].as_u64().unwrap()
}

fn token(r: &Reply) -> u64 {
    r.body["token"]
        .as_u64()
        .unwrap_or_else(|| panic!("no token in {}", r.text))
}

/// The value of one series in `/metrics`, e.g. `leasehold_sessions_ended_total{reason="expired"}`.
async fn metric(s: &TestServer, series: &str) -> Option<f64> {
    let r = s.get("/metrics").await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.text.lines().find_map(|line| {
        line.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(|v| v.trim().parse::<f64>().unwrap())
    })
}

/// Polls the waiter gauge until `n` acquires are queued in the writer. Bounded: each poll is
/// one HTTP round trip, and the whole wait gives up after 5 s.
async fn until_waiters(s: &TestServer, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if metric(s, "leasehold_waiters").await == Some(n as f64) {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("the writer never had {n} waiters");
}

async fn holder(s: &TestServer, key: &str) -> Reply {
    s.get(&format!("/v1/locks/{}", segment(key))).await
}

async fn fence(s: &TestServer, key: &str, t: u64) -> Reply {
    let r = s
        .get(&format!("/v1/fence/{}?token={t}", segment(key)))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

fn addr(s: &TestServer) -> SocketAddr {
    s.app.as_ref().unwrap().addr
}

// ---------------------------------------------------------------------------------------------
// Probes and metrics
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn probes_answer_when_healthy() {
    let s = TestServer::start().await;
    let h = s.get("/healthz").await;
    assert_eq!(h.status, 200);
    assert_eq!(h.body["status"], "ok");
    let r = s.get("/readyz").await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["ready"], true);
    let m = s.get("/metrics").await;
    assert_eq!(m.status, 200);
    assert!(m.text.contains("leasehold_sessions_active"), "{}", m.text);
    s.stop().await;
}

#[tokio::test]
async fn metrics_exist_and_count() {
    let s = TestServer::start().await;
    assert_eq!(metric(&s, "leasehold_sessions_active").await, Some(0.0));
    assert_eq!(metric(&s, "leasehold_locks_held").await, Some(0.0));

    let a = s.open("alice", 2_000).await;
    let b = s.open("bob", 60_000).await;
    let c = s.open("carol", 60_000).await;
    take(&s, "a", &a).await;
    take(&s, "a2", &a).await;
    let tb = take(&s, "b", &b).await;
    assert_eq!(s.heartbeat(&b).await.status, 200);
    assert_eq!(metric(&s, "leasehold_sessions_active").await, Some(3.0));
    assert_eq!(metric(&s, "leasehold_locks_held").await, Some(3.0));
    assert_eq!(
        metric(&s, "leasehold_sessions_opened_total").await,
        Some(3.0)
    );
    assert_eq!(
        metric(&s, "leasehold_locks_acquired_total").await,
        Some(3.0)
    );
    assert_eq!(metric(&s, "leasehold_heartbeats_total").await, Some(1.0));

    assert_eq!(s.release("b", &b, tb).await.status, 200);
    assert_eq!(
        metric(&s, "leasehold_locks_released_total").await,
        Some(1.0)
    );
    assert_eq!(metric(&s, "leasehold_locks_held").await, Some(2.0));

    assert_eq!(s.delete(&format!("/v1/sessions/{c}")).await.status, 200);
    assert_eq!(
        metric(&s, "leasehold_sessions_ended_total{reason=\"closed\"}").await,
        Some(1.0)
    );
    assert_eq!(
        s.post(&format!("/v1/admin/sessions/{b}/end"), json!({}))
            .await
            .status,
        200
    );
    assert_eq!(
        metric(&s, "leasehold_sessions_ended_total{reason=\"admin\"}").await,
        Some(1.0)
    );

    // Nothing has expired yet.
    assert_eq!(
        metric(&s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        None
    );
    s.advance(2_000).await;
    let reaped = s.reap().await;
    assert_eq!(reaped.body["sessions_ended"], 1, "{}", reaped.text);
    assert_eq!(
        metric(&s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s, "leasehold_locks_released_by_expiry_total").await,
        Some(2.0)
    );
    assert_eq!(metric(&s, "leasehold_sessions_active").await, Some(0.0));
    assert_eq!(metric(&s, "leasehold_locks_held").await, Some(0.0));

    // Requests are counted by route template, method and status.
    assert_eq!(
        metric(
            &s,
            "leasehold_http_requests_total{route=\"/v1/sessions\",method=\"POST\",status=\"201\"}"
        )
        .await,
        Some(3.0)
    );
    assert_eq!(s.get("/v1/nothing-here").await.status, 404);
    assert_eq!(
        metric(
            &s,
            "leasehold_http_requests_total{route=\"unmatched\",method=\"GET\",status=\"404\"}"
        )
        .await,
        Some(1.0)
    );
    let text = s.get("/metrics").await.text;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(line.starts_with("leasehold_"), "unprefixed series: {line}");
    }
    assert!(text.contains("leasehold_http_request_duration_seconds_bucket"));
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Sessions
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn open_returns_201_with_id_ttl_deadline_and_revision() {
    let s = TestServer::start().await;
    let r = open_with(&s, json!({"owner": "alice"})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.body["session_id"].as_str().unwrap().to_string();
    let uuid = uuid::Uuid::parse_str(&id).expect("session ids are UUIDs");
    assert_eq!(uuid.get_version_num(), 4, "session ids are random (v4)");
    assert_eq!(r.body["ttl_ms"], 15_000, "the default TTL");
    assert_eq!(r.body["expires_at"], BASE + 15_000);
    let rev1 = r.body["revision"].as_u64().unwrap();
    assert!(rev1 >= 1);

    s.advance(100).await;
    let r2 = open_with(&s, json!({"owner": "alice", "ttl_ms": 2_000})).await;
    assert_eq!(r2.status, 201, "{}", r2.text);
    assert_eq!(r2.body["ttl_ms"], 2_000);
    assert_eq!(r2.body["expires_at"], BASE + 100 + 2_000);
    assert!(r2.body["revision"].as_u64().unwrap() > rev1);
    assert_ne!(r2.body["session_id"], id.as_str(), "ids are never reused");

    // TTL bounds are inclusive.
    for ttl in [1_000, 86_400_000] {
        let r = open_with(&s, json!({"owner": "x", "ttl_ms": ttl})).await;
        assert_eq!(r.status, 201, "ttl {ttl}: {}", r.text);
        assert_eq!(r.body["ttl_ms"], ttl);
    }
    s.stop().await;
}

#[tokio::test]
async fn show_session_round_trips_owner_metadata_and_locks() {
    let s = TestServer::start().await;
    let meta = json!({"host": "h1", "pid": 42, "tags": ["a", "b"], "nested": {"x": null}});
    let r = open_with(
        &s,
        json!({"owner": "alice@laptop", "ttl_ms": 9_000, "metadata": meta}),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.body["session_id"].as_str().unwrap().to_string();
    s.advance(500).await;
    let t2 = take(&s, "k/2", &id).await;
    let t1 = take(&s, "k/1", &id).await;

    let got = session(&s, &id).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let b = &got.body;
    assert_eq!(b["session_id"], id.as_str());
    assert_eq!(b["owner"], "alice@laptop");
    assert_eq!(b["ttl_ms"], 9_000);
    assert_eq!(b["created_at"], BASE);
    assert_eq!(b["expires_at"], BASE + 9_000);
    assert_eq!(b["last_heartbeat_at"], BASE);
    assert_eq!(b["state"], "active");
    assert_eq!(b["metadata"], meta);
    let mut locks = b["locks"].as_array().unwrap().clone();
    locks.sort_by_key(|l| l["key"].as_str().unwrap().to_string());
    assert_eq!(
        locks,
        vec![
            json!({"key": "k/1", "token": t1}),
            json!({"key": "k/2", "token": t2})
        ]
    );

    // No metadata, or an explicit null, reads back as null.
    for body in [
        json!({"owner": "bob"}),
        json!({"owner": "bob", "metadata": null}),
    ] {
        let r = open_with(&s, body).await;
        assert_eq!(r.status, 201, "{}", r.text);
        let got = session(&s, r.body["session_id"].as_str().unwrap()).await;
        assert_eq!(got.status, 200);
        assert_eq!(got.body["metadata"], Value::Null);
        assert_eq!(got.body["locks"], json!([]));
    }
    // An empty object is kept.
    let r = open_with(&s, json!({"owner": "bob", "metadata": {}})).await;
    let got = session(&s, r.body["session_id"].as_str().unwrap()).await;
    assert_eq!(got.body["metadata"], json!({}));
    s.stop().await;
}

#[tokio::test]
async fn open_rejects_bad_input_naming_the_field() {
    let s = TestServer::start().await;
    let big_meta = json!({"k": "v".repeat(4_100)});
    let cases: Vec<(Value, &str)> = vec![
        (json!({"owner": "a", "metadata": "text"}), "metadata"),
        (json!({"owner": "a", "metadata": [1, 2]}), "metadata"),
        (json!({"owner": "a", "metadata": 5}), "metadata"),
        (json!({"owner": "a", "metadata": true}), "metadata"),
        (json!({"owner": "a", "metadata": big_meta}), "metadata"),
        (json!({"owner": "a", "ttl_ms": 999}), "ttl_ms"),
        (json!({"owner": "a", "ttl_ms": 0}), "ttl_ms"),
        (json!({"owner": "a", "ttl_ms": 86_400_001u64}), "ttl_ms"),
        (json!({"owner": "a", "ttl_ms": -1}), "ttl_ms"),
        (json!({"owner": "a", "ttl_ms": "5000"}), "ttl_ms"),
        (json!({"owner": "a", "ttl_ms": 1.5}), "ttl_ms"),
        (json!({"owner": ""}), "owner"),
        (json!({"owner": "x".repeat(257)}), "owner"),
        // 129 two-byte characters: 258 bytes, although only 129 characters.
        (json!({"owner": "é".repeat(129)}), "owner"),
        (json!({"owner": "a\nb"}), "owner"),
        (json!({"owner": 7}), "owner"),
    ];
    let first = open_with(&s, json!({"owner": "first"})).await;
    let rev = first.body["revision"].as_u64().unwrap();
    for (body, field) in &cases {
        let r = open_with(&s, body.clone()).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        assert_invalid(&r, field);
    }
    // Exactly 256 bytes is fine.
    let r = open_with(&s, json!({"owner": "x".repeat(256)})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    // Nothing refused left a trace: no revision used, no event, no session.
    assert_eq!(r.body["revision"], rev + 1);
    let events = all_events(&s).await;
    assert_eq!(events.len(), 2, "{events:?}");
    let list = s.get("/v1/sessions").await;
    assert_eq!(list.body["sessions"].as_array().unwrap().len(), 2);
    s.stop().await;
}

#[tokio::test]
async fn open_rejects_missing_and_unknown_fields() {
    let s = TestServer::start().await;
    for body in [
        json!({}),
        json!({"ttl_ms": 2_000}),
        json!({"owner": "a", "ttl": 2_000}),
        json!({"owner": "a", "extra": 1}),
        json!([]),
        json!("owner"),
    ] {
        let r = open_with(&s, body.clone()).await;
        assert_error(&r, 400, "invalid_request");
    }
    // The message names what is wrong.
    let r = open_with(&s, json!({"ttl_ms": 2_000})).await;
    assert!(
        r.body["message"].as_str().unwrap().contains("owner"),
        "{}",
        r.text
    );
    let r = open_with(&s, json!({"owner": "a", "colour": "red"})).await;
    assert!(
        r.body["message"].as_str().unwrap().contains("colour"),
        "{}",
        r.text
    );
    assert!(all_events(&s).await.is_empty());
    s.stop().await;
}

#[tokio::test]

async fn missing_and_unknown_fields_are_named_in_field() {
    let s = TestServer::start().await;
    let r = open_with(&s, json!({"ttl_ms": 2_000})).await;
    assert_invalid(&r, "owner");
    let r = open_with(&s, json!({"owner": "a", "colour": "red"})).await;
    assert_invalid(&r, "colour");
    s.stop().await;
}

#[tokio::test]
async fn malformed_json_is_400() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let bodies: Vec<Vec<u8>> = vec![
        b"{not json".to_vec(),
        b"{\"owner\": \"a\"".to_vec(),
        b"\xff\xfe".to_vec(),
        b"null".to_vec(),
    ];
    for body in bodies {
        let r = raw(&s, Method::POST, "/v1/sessions", body.clone()).await;
        assert_eq!(r.status, 400, "{:?}: {}", body, r.text);
        assert_eq!(r.body["error"], "invalid_request", "{}", r.text);
        assert!(r.body["message"].is_string());
    }
    let r = raw(&s, Method::POST, &lock_path("k", "acquire"), b"{".to_vec()).await;
    assert_eq!(r.status, 400, "{}", r.text);
    let r = raw(
        &s,
        Method::POST,
        &format!("/v1/sessions/{a}/heartbeat"),
        b"[1]".to_vec(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text);
    // An empty body reads as {}: a heartbeat needs no fields.
    let r = raw(
        &s,
        Method::POST,
        &format!("/v1/sessions/{a}/heartbeat"),
        Vec::new(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(all_events(&s).await.len(), 1, "only the one open");
    s.stop().await;
}

#[tokio::test]

async fn trailing_bytes_after_the_json_body_are_400() {
    let s = TestServer::start().await;
    for body in [
        &b"{\"owner\": \"a\"} trailing"[..],
        &b"{\"owner\": \"a\"}{\"owner\": \"b\"}"[..],
        &b"{\"owner\": \"a\"} ]"[..],
    ] {
        let r = raw(&s, Method::POST, "/v1/sessions", body.to_vec()).await;
        assert_eq!(
            r.status,
            400,
            "{}: {}",
            String::from_utf8_lossy(body),
            r.text
        );
        assert_eq!(r.body["error"], "invalid_request", "{}", r.text);
    }
    assert!(all_events(&s).await.is_empty(), "no session was opened");
    s.stop().await;
}

#[tokio::test]
async fn body_over_max_body_bytes_is_413() {
    let s = TestServer::start().await;
    assert_eq!(s.config.max_body_bytes, 64 * 1024);
    // Exactly at the limit: accepted (JSON padded with whitespace).
    let mut at_limit = br#"{"owner":"big"}"#.to_vec();
    at_limit.resize(64 * 1024, b' ');
    let r = raw(&s, Method::POST, "/v1/sessions", at_limit).await;
    assert_eq!(r.status, 201, "{}", r.text);
    // One byte more: refused before it is parsed.
    let mut over = br#"{"owner":"big"}"#.to_vec();
    over.resize(64 * 1024 + 1, b' ');
    let r = raw(&s, Method::POST, "/v1/sessions", over).await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert_eq!(r.body["error"], "payload_too_large", "{}", r.text);
    // Far over, on another route.
    let r = raw(
        &s,
        Method::POST,
        &lock_path("k", "acquire"),
        vec![b' '; 1024 * 1024],
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert_eq!(all_events(&s).await.len(), 1);
    s.stop().await;
}

#[tokio::test]
async fn heartbeat_extends_and_gone_is_terminal() {
    let s = TestServer::start().await;
    let a = s.open("alice", 2_000).await;
    s.advance(1_500).await;
    let hb = s.heartbeat(&a).await;
    assert_eq!(hb.status, 200, "{}", hb.text);
    assert_eq!(hb.body["expires_at"], BASE + 1_500 + 2_000);
    assert_eq!(hb.body["ttl_ms"], 2_000);
    // The heartbeat moved the deadline: 1 999 ms later the session is still alive, although
    // that is past its first deadline.
    s.advance(1_999).await;
    assert_eq!(s.heartbeat(&a).await.status, 200);
    let got = session(&s, &a).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.body["last_heartbeat_at"], BASE + 3_499);
    // Exactly at the deadline it is gone, before any reap.
    s.advance(2_000).await;
    let gone = s.heartbeat(&a).await;
    assert_error(&gone, 404, "session_gone");
    assert_error(&session(&s, &a).await, 404, "session_gone");
    // And it stays gone: after a reap (which finds it ended, whether by that refused
    // heartbeat or by this reap), with a new TTL, and for acquire.
    s.reap().await;
    let ev = all_events(&s).await;
    let ends: Vec<_> = ev
        .iter()
        .filter(|e| e["session_id"] == a.as_str() && e["kind"] != "session_opened")
        .collect();
    assert_eq!(ends.len(), 1, "{ev:?}");
    assert_eq!(ends[0]["kind"], "session_expired");
    for _ in 0..3 {
        assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    }
    let with_ttl = s
        .post(
            &format!("/v1/sessions/{a}/heartbeat"),
            json!({"ttl_ms": 60_000}),
        )
        .await;
    assert_error(&with_ttl, 404, "session_gone");
    assert_error(&s.acquire("k", &a).await, 404, "session_gone");
    assert_error(&session(&s, &a).await, 404, "session_gone");
    // A session id nobody opened is gone too.
    assert_error(&s.heartbeat(&random_id()).await, 404, "session_gone");
    s.stop().await;
}

#[tokio::test]
async fn heartbeat_expired_but_unreaped_is_gone_and_not_revived() {
    let s = TestServer::start().await;
    let a = s.open("alice", 1_000).await;
    s.advance(5_000).await;
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    // Not listed, not revived by anything later, and it ends exactly once, as an expiry.
    let list = s.get("/v1/sessions").await;
    assert_eq!(list.body["sessions"], json!([]), "{}", list.text);
    s.reap().await;
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    s.reap().await;
    let ev = all_events(&s).await;
    let expired = of_kind(&ev, "session_expired");
    assert_eq!(expired.len(), 1, "{ev:?}");
    assert_eq!(expired[0]["session_id"], a.as_str());
    assert!(of_kind(&ev, "session_closed").is_empty());
    assert_eq!(metric(&s, "leasehold_sessions_active").await, Some(0.0));
    s.stop().await;
}

#[tokio::test]
async fn heartbeat_with_ttl_changes_the_ttl() {
    let s = TestServer::start().await;
    let a = s.open("alice", 2_000).await;
    s.advance(1_000).await;
    let hb = s
        .post(
            &format!("/v1/sessions/{a}/heartbeat"),
            json!({"ttl_ms": 10_000}),
        )
        .await;
    assert_eq!(hb.status, 200, "{}", hb.text);
    assert_eq!(hb.body["ttl_ms"], 10_000);
    assert_eq!(hb.body["expires_at"], BASE + 1_000 + 10_000);
    assert_eq!(session(&s, &a).await.body["ttl_ms"], 10_000);
    // The old TTL no longer applies.
    s.advance(9_999).await;
    assert_eq!(s.heartbeat(&a).await.status, 200);
    // Later plain heartbeats keep the new TTL.
    let hb = s.heartbeat(&a).await;
    assert_eq!(hb.body["ttl_ms"], 10_000);

    for (body, field) in [
        (json!({"ttl_ms": 10}), "ttl_ms"),
        (json!({"ttl_ms": 86_400_001u64}), "ttl_ms"),
        (json!({"ttl_ms": "long"}), "ttl_ms"),
    ] {
        let r = s.post(&format!("/v1/sessions/{a}/heartbeat"), body).await;
        assert_invalid(&r, field);
    }
    let r = s
        .post(&format!("/v1/sessions/{a}/heartbeat"), json!({"ttl": 5}))
        .await;
    assert_error(&r, 400, "invalid_request");
    // The refused heartbeats changed nothing.
    assert_eq!(session(&s, &a).await.body["ttl_ms"], 10_000);
    s.stop().await;
}

#[tokio::test]
async fn grace_state_after_a_third_of_the_ttl() {
    let s = TestServer::start().await;
    let a = s.open("alice", 3_000).await;
    assert_eq!(session(&s, &a).await.body["state"], "active");
    s.advance(1_000).await;
    assert_eq!(session(&s, &a).await.body["state"], "active");
    s.advance(1).await;
    let g = session(&s, &a).await;
    assert_eq!(g.body["state"], "grace", "{}", g.text);
    assert_eq!(g.body["last_heartbeat_at"], BASE);
    // Listed the same way.
    let list = s.get("/v1/sessions").await;
    assert_eq!(list.body["sessions"][0]["state"], "grace");
    assert_eq!(s.heartbeat(&a).await.status, 200);
    let back = session(&s, &a).await;
    assert_eq!(back.body["state"], "active");
    assert_eq!(back.body["last_heartbeat_at"], BASE + 1_001);
    assert_eq!(back.body["expires_at"], BASE + 1_001 + 3_000);
    s.stop().await;
}

#[tokio::test]
async fn close_releases_everything_and_is_idempotent() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let t1 = take(&s, "x", &a).await;
    let t2 = take(&s, "y/z", &a).await;
    let closed = s.delete(&format!("/v1/sessions/{a}")).await;
    assert_eq!(closed.status, 200, "{}", closed.text);
    assert_eq!(closed.body["released"], 2);
    let rev = closed.body["revision"].as_u64().unwrap();
    assert!(rev > t2, "the close committed after the grants");
    for key in ["x", "y/z"] {
        assert_error(&holder(&s, key).await, 404, "lock_free");
    }
    assert_error(&session(&s, &a).await, 404, "session_gone");
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");

    let again = s.delete(&format!("/v1/sessions/{a}")).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(again.body["released"], 0);
    let unknown = s.delete(&format!("/v1/sessions/{}", random_id())).await;
    assert_eq!(unknown.status, 200, "{}", unknown.text);
    assert_eq!(unknown.body["released"], 0);

    let ev = all_events(&s).await;
    let closes = of_kind(&ev, "session_closed");
    assert_eq!(closes.len(), 1, "a repeated close is not audited: {ev:?}");
    assert_eq!(closes[0]["session_id"], a.as_str());
    assert_eq!(closes[0]["reason"], "closed");
    let mut released = closes[0]["released"].as_array().unwrap().clone();
    released.sort_by_key(|l| l["token"].as_u64());
    assert_eq!(
        released,
        vec![
            json!({"key": "x", "token": t1}),
            json!({"key": "y/z", "token": t2})
        ]
    );
    s.stop().await;
}

#[tokio::test]
async fn invalid_session_id_in_path_is_400() {
    let s = TestServer::start().await;
    for bad in ["not-a-uuid", "1234", "zzzzzzzz-zzzz-zzzz-zzzz-zzzzzzzzzzzz"] {
        assert_invalid(&session(&s, bad).await, "session_id");
        assert_invalid(&s.heartbeat(bad).await, "session_id");
        assert_invalid(
            &s.delete(&format!("/v1/sessions/{bad}")).await,
            "session_id",
        );
        assert_invalid(
            &s.post(&format!("/v1/admin/sessions/{bad}/end"), json!({}))
                .await,
            "session_id",
        );
    }
    s.stop().await;
}

#[tokio::test]
async fn sessions_page_by_owner_and_cursor() {
    let s = TestServer::start().await;
    let mut alice = Vec::new();
    for _ in 0..5 {
        alice.push(s.open("alice", 60_000).await);
    }
    let mut bob = Vec::new();
    for _ in 0..3 {
        bob.push(s.open("bob", 60_000).await);
    }
    alice.sort();
    let mut everyone: Vec<String> = alice.iter().chain(&bob).cloned().collect();
    everyone.sort();

    // Owner filter, two at a time, following `next` until it is null.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let path = match &after {
            Some(a) => format!("/v1/sessions?owner=alice&limit=2&after={a}"),
            None => "/v1/sessions?owner=alice&limit=2".to_string(),
        };
        let r = s.get(&path).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let page = r.body["sessions"].as_array().unwrap();
        assert!(page.len() <= 2);
        for sess in page {
            assert_eq!(sess["owner"], "alice");
            seen.push(sess["session_id"].as_str().unwrap().to_string());
        }
        pages += 1;
        assert!(pages <= 4, "paging does not end");
        match r.body["next"].as_str() {
            Some(n) => {
                assert_eq!(Some(n), page.last().and_then(|p| p["session_id"].as_str()));
                after = Some(n.to_string());
            }
            None => {
                assert!(r.body["next"].is_null());
                break;
            }
        }
    }
    assert_eq!(seen, alice, "every alice session once, in id order");
    assert_eq!(pages, 3);

    // No filter: everyone in id order, on one page with no next.
    let r = s.get("/v1/sessions").await;
    let ids: Vec<String> = r.body["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["session_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, everyone);
    assert!(r.body["next"].is_null());

    // A cursor starts strictly after it.
    let r = s.get(&format!("/v1/sessions?after={}", everyone[3])).await;
    let ids: Vec<&str> = r.body["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["session_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        everyone[4..].iter().map(String::as_str).collect::<Vec<_>>()
    );

    let r = s.get("/v1/sessions?owner=nobody").await;
    assert_eq!(r.body["sessions"], json!([]));
    assert!(r.body["next"].is_null());

    // Closed and expired sessions are not listed.
    assert_eq!(
        s.delete(&format!("/v1/sessions/{}", bob[0])).await.status,
        200
    );
    let short = s.open("bob", 1_000).await;
    s.advance(1_000).await;
    let r = s.get("/v1/sessions?owner=bob").await;
    let ids: Vec<&str> = r.body["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["session_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 2, "{}", r.text);
    assert!(!ids.contains(&bob[0].as_str()));
    assert!(!ids.contains(&short.as_str()));
    s.stop().await;
}

#[tokio::test]
async fn sessions_list_rejects_bad_query() {
    let s = TestServer::start().await;
    s.open("alice", 60_000).await;
    assert_invalid(&s.get("/v1/sessions?limit=0").await, "limit");
    assert_invalid(&s.get("/v1/sessions?limit=1001").await, "limit");
    assert_invalid(&s.get("/v1/sessions?limit=abc").await, "limit");
    assert_invalid(&s.get("/v1/sessions?limit=-1").await, "limit");
    assert_invalid(&s.get("/v1/sessions?after=nope").await, "after");
    assert_error(
        &s.get("/v1/sessions?colour=red").await,
        400,
        "invalid_request",
    );
    let ok = s.get("/v1/sessions?limit=1000").await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    assert_eq!(ok.body["sessions"].as_array().unwrap().len(), 1);
    s.stop().await;
}

#[tokio::test]

async fn next_is_null_on_a_full_last_page() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    s.open("alice", 60_000).await;
    take(&s, "k1", &a).await;
    take(&s, "k2", &a).await;
    // Two sessions and two locks, pages of two: the first page is also the last.
    let r = s.get("/v1/sessions?limit=2").await;
    assert_eq!(r.body["sessions"].as_array().unwrap().len(), 2);
    assert!(r.body["next"].is_null(), "{}", r.text);
    let r = s.get("/v1/locks?limit=2").await;
    assert_eq!(r.body["locks"].as_array().unwrap().len(), 2);
    assert!(r.body["next"].is_null(), "{}", r.text);
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Locks
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn acquire_show_release() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    s.advance(250).await;
    let got = s.acquire("db/migrate", &a).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.body["key"], "db/migrate");
    assert_eq!(got.body["session_id"], a.as_str());
    let t1 = token(&got);
    assert_eq!(
        got.body["revision"], t1,
        "a grant commits at the revision that is its token"
    );

    let shown = holder(&s, "db/migrate").await;
    assert_eq!(shown.status, 200, "{}", shown.text);
    assert_eq!(
        shown.body,
        json!({"key": "db/migrate", "session_id": a, "token": t1, "acquired_at": BASE + 250})
    );

    let rel = s.release("db/migrate", &a, t1).await;
    assert_eq!(rel.status, 200, "{}", rel.text);
    assert_eq!(rel.body["released"], true);
    assert!(rel.body["revision"].as_u64().unwrap() > t1);
    assert_error(&holder(&s, "db/migrate").await, 404, "lock_free");
    assert_eq!(session(&s, &a).await.body["locks"], json!([]));

    let t2 = take(&s, "db/migrate", &a).await;
    assert!(
        t2 > rel.body["revision"].as_u64().unwrap(),
        "tokens only grow"
    );
    s.stop().await;
}

#[tokio::test]
async fn holder_reacquire_is_idempotent() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let first = s.acquire("k", &a).await;
    let t = token(&first);
    for _ in 0..3 {
        let again = s.acquire("k", &a).await;
        assert_eq!(again.status, 200, "{}", again.text);
        assert_eq!(token(&again), t);
        assert_eq!(again.body["revision"], first.body["revision"]);
    }
    // Waiting for a lock one already holds returns at once.
    let again = acquire_wait(&s.client, "k", &a, 30_000).await;
    assert_eq!(token(&again), t);
    let ev = all_events(&s).await;
    assert_eq!(of_kind(&ev, "lock_acquired").len(), 1);
    assert_eq!(
        metric(&s, "leasehold_locks_acquired_total").await,
        Some(1.0)
    );
    s.stop().await;
}

#[tokio::test]
async fn acquire_held_lock_without_wait_is_409() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let t = take(&s, "k", &a).await;
    assert_error(&s.acquire("k", &b).await, 409, "lock_held");
    let wait0 = acquire_wait(&s.client, "k", &b, 0).await;
    assert_error(&wait0, 409, "lock_held");
    let h = holder(&s, "k").await;
    assert_eq!(h.body["session_id"], a.as_str());
    assert_eq!(h.body["token"], t);
    s.stop().await;
}

#[tokio::test]
async fn one_winner_among_concurrent_contenders() {
    let s = TestServer::start().await;
    let mut ids = Vec::new();
    for i in 0..16 {
        ids.push(s.open(&format!("w{i}"), 60_000).await);
    }
    let tasks: Vec<_> = ids
        .iter()
        .map(|id| spawn_acquire(&s, "hot", id, 0))
        .collect();
    let mut winners = Vec::new();
    for (id, t) in ids.iter().zip(tasks) {
        let r = join(t).await;
        match r.status.as_u16() {
            200 => winners.push(id.clone()),
            409 => assert_eq!(r.body["error"], "lock_held"),
            other => panic!("unexpected {other}: {}", r.text),
        }
    }
    assert_eq!(winners.len(), 1, "mutual exclusion");
    assert_eq!(
        holder(&s, "hot").await.body["session_id"],
        winners[0].as_str()
    );
    s.stop().await;
}

#[tokio::test]
async fn acquire_for_unknown_or_gone_session_is_404() {
    let s = TestServer::start().await;
    assert_error(&s.acquire("k", &random_id()).await, 404, "session_gone");
    let closed = s.open("alice", 60_000).await;
    s.delete(&format!("/v1/sessions/{closed}")).await;
    assert_error(&s.acquire("k", &closed).await, 404, "session_gone");
    let expiring = s.open("bob", 1_000).await;
    s.advance(1_000).await;
    assert_error(&s.acquire("k", &expiring).await, 404, "session_gone");
    // Waiting does not help a gone session either.
    assert_error(
        &acquire_wait(&s.client, "k", &expiring, 5_000).await,
        404,
        "session_gone",
    );
    assert_error(&holder(&s, "k").await, 404, "lock_free");
    let list = s.get("/v1/locks").await;
    assert_eq!(list.body["locks"], json!([]));
    s.stop().await;
}

#[tokio::test]
async fn acquire_and_release_reject_bad_bodies() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let acq = lock_path("k", "acquire");
    assert_invalid(
        &s.post(&acq, json!({"session_id": "nope"})).await,
        "session_id",
    );
    assert_invalid(&s.post(&acq, json!({"session_id": 5})).await, "session_id");
    assert_invalid(
        &s.post(&acq, json!({"session_id": a, "wait_ms": -5})).await,
        "wait_ms",
    );
    assert_invalid(
        &s.post(&acq, json!({"session_id": a, "wait_ms": "soon"}))
            .await,
        "wait_ms",
    );
    assert_error(&s.post(&acq, json!({})).await, 400, "invalid_request");
    assert_error(
        &s.post(&acq, json!({"session_id": a, "token": 1})).await,
        400,
        "invalid_request",
    );
    assert_error(&holder(&s, "k").await, 404, "lock_free");

    let t = take(&s, "k", &a).await;
    let rel = lock_path("k", "release");
    assert_invalid(
        &s.post(&rel, json!({"session_id": "nope", "token": t}))
            .await,
        "session_id",
    );
    assert_invalid(
        &s.post(&rel, json!({"session_id": a, "token": -1})).await,
        "token",
    );
    assert_invalid(
        &s.post(&rel, json!({"session_id": a, "token": "1"})).await,
        "token",
    );
    assert_error(
        &s.post(&rel, json!({"session_id": a})).await,
        400,
        "invalid_request",
    );
    assert_error(
        &s.post(&rel, json!({"session_id": a, "token": t, "force": true}))
            .await,
        400,
        "invalid_request",
    );
    assert_eq!(holder(&s, "k").await.body["token"], t, "still held");
    s.stop().await;
}

#[tokio::test]
async fn release_with_wrong_token_or_session_is_409() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let t1 = take(&s, "k", &a).await;
    assert_eq!(s.release("k", &a, t1).await.status, 200);
    let t2 = take(&s, "k", &a).await;
    assert!(t2 > t1);
    // A stale token of the same holder.
    assert_error(&s.release("k", &a, t1).await, 409, "not_holder");
    // A token that was never issued.
    assert_error(&s.release("k", &a, t2 + 100).await, 409, "not_holder");
    // The right token from another session.
    assert_error(&s.release("k", &b, t2).await, 409, "not_holder");
    // A session that does not exist.
    assert_error(&s.release("k", &random_id(), t2).await, 409, "not_holder");
    // A free key.
    assert_error(&s.release("free", &a, t2).await, 409, "not_holder");
    let h = holder(&s, "k").await;
    assert_eq!(h.body["token"], t2, "nothing refused changed the lock");
    assert_eq!(h.body["session_id"], a.as_str());
    assert_eq!(s.release("k", &a, t2).await.status, 200);
    // Released twice: the second is refused.
    assert_error(&s.release("k", &a, t2).await, 409, "not_holder");
    // After the session closed, its old grant cannot be released either.
    let t3 = take(&s, "k", &a).await;
    s.delete(&format!("/v1/sessions/{a}")).await;
    assert_error(&s.release("k", &a, t3).await, 409, "not_holder");
    // Past its deadline a session holds nothing it can release: its token is stale.
    let late = s.open("late", 1_000).await;
    let tl = take(&s, "late-key", &late).await;
    s.advance(1_000).await;
    assert_eq!(fence(&s, "late-key", tl).await.body["current"], false);
    assert_error(&s.release("late-key", &late, tl).await, 409, "not_holder");
    assert_error(&s.heartbeat(&late).await, 404, "session_gone");
    let ev = all_events(&s).await;
    assert_eq!(of_kind(&ev, "lock_released").len(), 2);
    s.stop().await;
}

#[tokio::test]
async fn too_many_locks_is_409() {
    let s = TestServer::start_with(|c| c.max_locks_per_session = 2).await;
    let a = s.open("alice", 60_000).await;
    take(&s, "1", &a).await;
    take(&s, "2", &a).await;
    assert_error(&s.acquire("3", &a).await, 409, "too_many_locks");
    assert_eq!(s.acquire("1", &a).await.status, 200, "a re-acquire is fine");
    assert_error(&holder(&s, "3").await, 404, "lock_free");
    s.stop().await;
}

#[tokio::test]
async fn any_valid_key_works_percent_encoded() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let keys = [
        "a".to_string(),
        "db/migrate".to_string(),
        "/leading/and/trailing/".to_string(),
        "数据库/迁移".to_string(),
        "with space".to_string(),
        "q?x=1&y#frag%20".to_string(),
        "emoji 🔒".to_string(),
        "k".repeat(512),
        // 170 three-byte characters: 510 bytes.
        "数".repeat(170),
    ];
    let mut tokens = Vec::new();
    for key in &keys {
        let got = s.acquire(key, &a).await;
        assert_eq!(got.status, 200, "{key:?}: {}", got.text);
        assert_eq!(got.body["key"], key.as_str());
        let t = token(&got);
        tokens.push(t);
        let shown = holder(&s, key).await;
        assert_eq!(shown.status, 200, "{key:?}: {}", shown.text);
        assert_eq!(shown.body["key"], key.as_str());
        assert_eq!(shown.body["token"], t);
        let f = fence(&s, key, t).await;
        assert_eq!(f.body["current"], true, "{key:?}");
        assert_eq!(f.body["key"], key.as_str());
    }
    let list = s.get("/v1/locks").await;
    let mut listed: Vec<String> = list.body["locks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap().to_string())
        .collect();
    listed.sort();
    let mut expected = keys.to_vec();
    expected.sort();
    assert_eq!(listed, expected);
    // "a" and "a/..." style keys do not collide with route segments.
    assert_error(&holder(&s, "db").await, 404, "lock_free");
    for (key, t) in keys.iter().zip(tokens) {
        let r = s.release(key, &a, t).await;
        assert_eq!(r.status, 200, "{key:?}: {}", r.text);
    }
    assert_eq!(s.get("/v1/locks").await.body["locks"], json!([]));
    s.stop().await;
}

#[tokio::test]
async fn invalid_keys_are_400() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let too_long = segment(&"k".repeat(513));
    let too_long_utf8 = segment(&"数".repeat(171)); // 513 bytes
    let encoded = [
        too_long.as_str(),
        too_long_utf8.as_str(),
        "line%0Abreak",
        "tab%09here",
        "nul%00",
        "del%7F",
        "cr%0D",
    ];
    for enc in encoded {
        let r = s
            .post(
                &format!("/v1/locks/{enc}/acquire"),
                json!({"session_id": a}),
            )
            .await;
        assert_invalid(&r, "key");
        assert_invalid(&s.get(&format!("/v1/locks/{enc}")).await, "key");
        assert_invalid(
            &s.post(
                &format!("/v1/locks/{enc}/release"),
                json!({"session_id": a, "token": 1}),
            )
            .await,
            "key",
        );
        assert_invalid(&s.get(&format!("/v1/fence/{enc}?token=1")).await, "key");
    }
    // Not UTF-8 after decoding.
    let r = s
        .post("/v1/locks/%FF%FE/acquire", json!({"session_id": a}))
        .await;
    assert_error(&r, 400, "invalid_request");
    assert_eq!(s.get("/v1/locks").await.body["locks"], json!([]));
    assert!(of_kind(&all_events(&s).await, "lock_acquired").is_empty());
    s.stop().await;
}

#[tokio::test]
async fn locks_page_by_prefix_and_cursor() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let mut tokens = std::collections::BTreeMap::new();
    for (key, who) in [
        ("b/1", &b),
        ("a/2", &a),
        ("c", &a),
        ("a/1", &a),
        ("a/3", &b),
    ] {
        tokens.insert(key, take(&s, key, who).await);
    }
    let keys_of = |r: &Reply| -> Vec<String> {
        r.body["locks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["key"].as_str().unwrap().to_string())
            .collect()
    };

    let all = s.get("/v1/locks").await;
    assert_eq!(all.status, 200, "{}", all.text);
    assert_eq!(keys_of(&all), ["a/1", "a/2", "a/3", "b/1", "c"]);
    assert!(all.body["next"].is_null());
    for l in all.body["locks"].as_array().unwrap() {
        let key = l["key"].as_str().unwrap();
        assert_eq!(l["token"], tokens[key]);
        let who = if key == "b/1" || key == "a/3" { &b } else { &a };
        assert_eq!(l["session_id"], who.as_str());
        assert!(l["acquired_at"].as_u64().unwrap() >= BASE);
    }

    let p1 = s.get("/v1/locks?prefix=a%2F&limit=2").await;
    assert_eq!(keys_of(&p1), ["a/1", "a/2"]);
    assert_eq!(p1.body["next"], "a/2");
    let p2 = s.get("/v1/locks?prefix=a%2F&limit=2&after=a%2F2").await;
    assert_eq!(keys_of(&p2), ["a/3"]);
    assert!(p2.body["next"].is_null());

    let after = s.get("/v1/locks?after=a%2F3").await;
    assert_eq!(keys_of(&after), ["b/1", "c"]);
    // A cursor before the prefix starts at the prefix.
    let before = s.get("/v1/locks?prefix=b&after=a%2F1").await;
    assert_eq!(keys_of(&before), ["b/1"]);
    let none = s.get("/v1/locks?prefix=zz").await;
    assert_eq!(none.body["locks"], json!([]));
    assert!(none.body["next"].is_null());

    assert_invalid(&s.get("/v1/locks?limit=0").await, "limit");
    assert_invalid(&s.get("/v1/locks?limit=1001").await, "limit");
    assert_error(&s.get("/v1/locks?owner=x").await, 400, "invalid_request");
    assert_eq!(s.get("/v1/locks?limit=1000").await.status, 200);
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Waiters
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn waiters_are_served_first_come_first_served() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = take(&s, "k", &a).await;

    let wait_b = spawn_acquire(&s, "k", &b, 30_000);
    until_waiters(&s, 1).await;
    let wait_c = spawn_acquire(&s, "k", &c, 30_000);
    until_waiters(&s, 2).await;
    // A newcomer with no wait is refused while others queue.
    assert_error(
        &s.acquire("k", &s.open("d", 60_000).await).await,
        409,
        "lock_held",
    );

    assert_eq!(s.release("k", &a, ta).await.status, 200);
    let got_b = join(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    assert_eq!(got_b.body["session_id"], b.as_str());
    let tb = token(&got_b);
    assert!(tb > ta);
    assert_eq!(holder(&s, "k").await.body["session_id"], b.as_str());
    until_waiters(&s, 1).await;
    assert!(!wait_c.is_finished(), "C still waits while B holds");

    assert_eq!(s.release("k", &b, tb).await.status, 200);
    let got_c = join(wait_c).await;
    assert_eq!(got_c.status, 200, "{}", got_c.text);
    assert_eq!(got_c.body["session_id"], c.as_str());
    assert!(token(&got_c) > tb);
    assert_eq!(holder(&s, "k").await.body["session_id"], c.as_str());
    until_waiters(&s, 0).await;
    s.stop().await;
}

#[tokio::test]
async fn waiter_is_served_when_the_holder_closes_or_is_reaped() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta = take(&s, "k", &a).await;
    let wait_b = spawn_acquire(&s, "k", &b, 30_000);
    until_waiters(&s, 1).await;
    assert_eq!(
        s.delete(&format!("/v1/sessions/{a}")).await.body["released"],
        1
    );
    let got = join(wait_b).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert!(token(&got) > ta);

    // The holder expires; the reap that ends it hands the key to the waiter.
    let short = s.open("short", 2_000).await;
    let w = s.open("w", 60_000).await;
    let ts = take(&s, "k2", &short).await;
    let wait_w = spawn_acquire(&s, "k2", &w, 30_000);
    until_waiters(&s, 1).await;
    s.advance(2_000).await;
    let reaped = s.reap().await;
    assert_eq!(reaped.body["sessions_ended"], 1, "{}", reaped.text);
    let got = join(wait_w).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.body["session_id"], w.as_str());
    assert!(token(&got) > ts);
    s.stop().await;
}

#[tokio::test]
async fn a_waiter_whose_session_ended_is_skipped() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = take(&s, "k", &a).await;
    let wait_b = spawn_acquire(&s, "k", &b, 30_000);
    until_waiters(&s, 1).await;
    let wait_c = spawn_acquire(&s, "k", &c, 30_000);
    until_waiters(&s, 2).await;
    assert_eq!(s.delete(&format!("/v1/sessions/{b}")).await.status, 200);
    assert_eq!(s.release("k", &a, ta).await.status, 200);
    assert_error(&join(wait_b).await, 404, "session_gone");
    let got_c = join(wait_c).await;
    assert_eq!(got_c.status, 200, "{}", got_c.text);
    assert_eq!(holder(&s, "k").await.body["session_id"], c.as_str());
    s.stop().await;
}

#[tokio::test]
async fn wait_timeout_is_409_on_the_real_clock() {
    let s = TestServer::start_real(|_| {}).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta = take(&s, "k", &a).await;
    let started = Instant::now();
    let r = acquire_wait(&s.client, "k", &b, 200).await;
    let waited = started.elapsed();
    assert_error(&r, 409, "lock_held");
    assert!(
        waited >= Duration::from_millis(190),
        "gave up early: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "waited too long: {waited:?}"
    );
    let h = holder(&s, "k").await;
    assert_eq!(h.body["session_id"], a.as_str());
    assert_eq!(h.body["token"], ta);
    // The gauge is set just after the refusal is sent, so poll for it.
    until_waiters(&s, 0).await;
    s.stop().await;
}

#[tokio::test]
async fn wait_is_capped_by_max_wait_ms() {
    let s = TestServer::start_real(|c| c.max_wait_ms = 200).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    take(&s, "k", &a).await;
    let started = Instant::now();
    let r = acquire_wait(&s.client, "k", &b, 60_000).await;
    let waited = started.elapsed();
    assert_error(&r, 409, "lock_held");
    assert!(waited >= Duration::from_millis(190), "{waited:?}");
    assert!(
        waited < Duration::from_secs(5),
        "the cap was ignored: {waited:?}"
    );
    s.stop().await;
}

#[tokio::test]
async fn wait_timeout_is_409_on_the_manual_clock() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta = take(&s, "k", &a).await;
    let wait_b = spawn_acquire(&s, "k", &b, 5_000);
    until_waiters(&s, 1).await;
    s.advance(4_999).await;
    // Poke the writer: not yet due.
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    until_waiters(&s, 1).await;
    assert!(!wait_b.is_finished());
    s.advance(1).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    assert_error(&join(wait_b).await, 409, "lock_held");
    until_waiters(&s, 0).await;
    assert_eq!(holder(&s, "k").await.body["token"], ta);
    // The timed-out waiter is not served later.
    assert_eq!(s.release("k", &a, ta).await.status, 200);
    assert_error(&holder(&s, "k").await, 404, "lock_free");
    s.stop().await;
}

#[tokio::test]
async fn inline_reap_of_an_expired_holder() {
    let s = TestServer::start().await;
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let ta = take(&s, "job", &a).await;
    assert_error(&s.acquire("job", &b).await, 409, "lock_held");
    s.advance(2_000).await;
    // No reap call: the contender ends the expired holder itself.
    let got = s.acquire("job", &b).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let tb = token(&got);
    assert!(tb > ta);
    let h = holder(&s, "job").await;
    assert_eq!(h.body["session_id"], b.as_str());
    assert_eq!(h.body["token"], tb);
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    assert_eq!(fence(&s, "job", ta).await.body["current"], false);

    let ev = all_events(&s).await;
    let expired = of_kind(&ev, "session_expired");
    assert_eq!(expired.len(), 1, "{ev:?}");
    assert_eq!(expired[0]["session_id"], a.as_str());
    assert_eq!(expired[0]["reason"], "expired");
    assert_eq!(expired[0]["released"], json!([{"key": "job", "token": ta}]));
    assert_eq!(expired[0]["at"], BASE + 2_000);
    let granted = ev
        .iter()
        .find(|e| e["kind"] == "lock_acquired" && e["token"] == tb)
        .unwrap();
    assert!(
        expired[0]["seq"].as_u64() < granted["seq"].as_u64(),
        "the holder ended before the new grant"
    );
    assert_eq!(
        metric(&s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        Some(1.0)
    );
    // Nothing is left for the reaper.
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    s.stop().await;
}

/// At 643b599 an inline reap by a newcomer handed the freed key to the newcomer, then popped
/// the first waiter, found the key held and pushed it back at the end of the line: C was
/// served before B.
#[tokio::test]
async fn waiters_keep_their_order_when_a_newcomer_reaps_the_holder_inline() {
    let s = TestServer::start().await;
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let d = s.open("d", 60_000).await;
    take(&s, "k", &a).await;
    let wait_b = spawn_acquire(&s, "k", &b, 30_000);
    until_waiters(&s, 1).await;
    let wait_c = spawn_acquire(&s, "k", &c, 30_000);
    until_waiters(&s, 2).await;
    s.advance(2_000).await;
    // A newcomer asks for the key of the expired holder.
    let dr = s.acquire("k", &d).await;
    if dr.status == 200 {
        // Whether or not the newcomer may take the key, the line behind it keeps its order.
        assert_eq!(s.release("k", &d, token(&dr)).await.status, 200);
    }
    // Grants to waiters commit in the same batch as the release that freed the key, so the
    // next holder is visible as soon as the release (or the newcomer's acquire) is answered.
    let h = holder(&s, "k").await;
    assert_eq!(
        h.body["session_id"],
        b.as_str(),
        "B queued first: {}",
        h.text
    );
    let got_b = join(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    assert_eq!(s.release("k", &b, token(&got_b)).await.status, 200);
    assert_eq!(join(wait_c).await.status, 200);
    s.stop().await;
}

#[tokio::test]

async fn a_newcomer_does_not_overtake_a_waiter_when_the_holder_expires() {
    let s = TestServer::start().await;
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let d = s.open("d", 60_000).await;
    take(&s, "k", &a).await;
    let wait_b = spawn_acquire(&s, "k", &b, 30_000);
    until_waiters(&s, 1).await;
    s.advance(2_000).await;
    // B has been waiting for the key since before A expired; D only now asks, without waiting.
    let dr = s.acquire("k", &d).await;
    assert_error(&dr, 409, "lock_held");
    let got_b = join(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    assert_eq!(holder(&s, "k").await.body["session_id"], b.as_str());
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Fencing
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn fence_reports_current_and_latest() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 2_000).await;

    let f = fence(&s, "res", 1).await;
    assert_eq!(
        f.body,
        json!({"key": "res", "token": 1, "current": false, "latest": null})
    );

    let t1 = take(&s, "res", &a).await;
    let f = fence(&s, "res", t1).await;
    assert_eq!(f.body["current"], true);
    assert_eq!(f.body["latest"], t1);
    assert_eq!(f.body["token"], t1);
    for other in [t1 - 1, t1 + 1, 0] {
        let f = fence(&s, "res", other).await;
        assert_eq!(f.body["current"], false, "token {other}");
        assert_eq!(f.body["latest"], t1);
    }

    assert_eq!(s.release("res", &a, t1).await.status, 200);
    let f = fence(&s, "res", t1).await;
    assert_eq!(f.body["current"], false);
    assert_eq!(f.body["latest"], Value::Null, "released keys leave nothing");

    let t2 = take(&s, "res", &b).await;
    assert!(t2 > t1);
    assert_eq!(fence(&s, "res", t1).await.body["current"], false);
    assert_eq!(fence(&s, "res", t1).await.body["latest"], t2);
    assert_eq!(fence(&s, "res", t2).await.body["current"], true);

    // The holder's session passes its deadline: its token stops being current at once,
    // before any reap.
    s.advance(1_999).await;
    assert_eq!(fence(&s, "res", t2).await.body["current"], true);
    s.advance(1).await;
    assert_eq!(fence(&s, "res", t2).await.body["current"], false);
    assert_eq!(s.reap().await.body["sessions_ended"], 1);
    let f = fence(&s, "res", t2).await;
    assert_eq!(f.body["current"], false);
    assert_eq!(f.body["latest"], Value::Null);

    assert_error(&s.get("/v1/fence/res").await, 400, "invalid_request");
    assert_invalid(&s.get("/v1/fence/res?token=abc").await, "token");
    assert_invalid(&s.get("/v1/fence/res?token=-1").await, "token");
    assert_error(
        &s.get("/v1/fence/res?token=1&extra=2").await,
        400,
        "invalid_request",
    );
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn events_cover_every_kind_and_page_by_cursor() {
    let s = TestServer::start().await;
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let c = s.open("carol", 1_000).await;
    s.advance(10).await;
    let t1 = take(&s, "k1", &a).await;
    assert_eq!(s.release("k1", &a, t1).await.status, 200);
    let t2 = take(&s, "k2", &a).await;
    assert_eq!(s.delete(&format!("/v1/sessions/{a}")).await.status, 200);
    let t3 = take(&s, "k3", &b).await;
    assert_eq!(
        s.post(&format!("/v1/admin/sessions/{b}/end"), json!({}))
            .await
            .status,
        200
    );
    let t4 = take(&s, "k4", &c).await;
    s.advance(1_000).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 1);

    let ev = all_events(&s).await;
    let kinds: Vec<&str> = ev.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "session_opened",
            "session_opened",
            "session_opened",
            "lock_acquired",
            "lock_released",
            "lock_acquired",
            "session_closed",
            "lock_acquired",
            "session_ended_by_admin",
            "lock_acquired",
            "session_expired",
        ]
    );
    let seqs: Vec<u64> = ev.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] > w[0]), "{seqs:?}");

    assert_eq!(ev[0]["session_id"], a.as_str());
    assert_eq!(ev[0]["owner"], "alice");
    assert_eq!(ev[0]["at"], BASE);
    assert_eq!(ev[2]["owner"], "carol");
    assert_eq!(ev[3]["session_id"], a.as_str());
    assert_eq!(ev[3]["key"], "k1");
    assert_eq!(ev[3]["token"], t1);
    assert_eq!(ev[3]["at"], BASE + 10);
    assert_eq!(ev[4]["key"], "k1");
    assert_eq!(ev[4]["token"], t1);
    assert_eq!(ev[4]["session_id"], a.as_str());
    assert_eq!(ev[6]["session_id"], a.as_str());
    assert_eq!(ev[6]["reason"], "closed");
    assert_eq!(ev[6]["released"], json!([{"key": "k2", "token": t2}]));
    assert_eq!(ev[8]["session_id"], b.as_str());
    assert_eq!(ev[8]["reason"], "admin");
    assert_eq!(ev[8]["released"], json!([{"key": "k3", "token": t3}]));
    assert_eq!(ev[10]["session_id"], c.as_str());
    assert_eq!(ev[10]["reason"], "expired");
    assert_eq!(ev[10]["released"], json!([{"key": "k4", "token": t4}]));
    assert_eq!(ev[10]["at"], BASE + 1_010);

    // Three at a time, following `next`.
    let mut paged = Vec::new();
    let mut after = 0;
    let mut pages = 0;
    loop {
        let r = s.get(&format!("/v1/events?after={after}&limit=3")).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let page = r.body["events"].as_array().unwrap();
        assert!(page.len() <= 3);
        let next = r.body["next"].as_u64().unwrap();
        if page.is_empty() {
            assert_eq!(next, after, "with nothing new, next stays at after");
            break;
        }
        assert_eq!(Some(next), page.last().unwrap()["seq"].as_u64());
        paged.extend(page.iter().cloned());
        after = next;
        pages += 1;
        assert!(pages < 10);
    }
    assert_eq!(pages, 4);
    assert_eq!(paged, ev);
    // A cursor in the middle.
    let r = s.get(&format!("/v1/events?after={}", seqs[7])).await;
    let tail: Vec<u64> = r.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(tail, seqs[8..]);
    // The default page holds everything here.
    assert_eq!(
        s.get("/v1/events").await.body["events"]
            .as_array()
            .unwrap()
            .len(),
        11
    );
    s.stop().await;
}

#[tokio::test]
async fn events_reject_bad_query() {
    let s = TestServer::start().await;
    s.open("alice", 60_000).await;
    assert_invalid(&s.get("/v1/events?limit=0").await, "limit");
    assert_invalid(&s.get("/v1/events?limit=10001").await, "limit");
    assert_invalid(&s.get("/v1/events?after=abc").await, "after");
    assert_invalid(&s.get("/v1/events?after=-1").await, "after");
    assert_error(&s.get("/v1/events?since=1").await, 400, "invalid_request");
    let ok = s.get("/v1/events?limit=10000").await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    assert_eq!(ok.body["events"].as_array().unwrap().len(), 1);
    let ok = s.get("/v1/events?limit=1000&after=0").await;
    assert_eq!(ok.status, 200);
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Admin
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn dry_run_reap_changes_nothing_then_a_real_reap_ends_them() {
    let s = TestServer::start().await;
    let a = s.open("a", 1_000).await;
    let b = s.open("b", 60_000).await;
    let t1 = take(&s, "k1", &a).await;
    let t2 = take(&s, "k2", &a).await;
    let t3 = take(&s, "k3", &b).await;
    s.advance(1_500).await;

    let events_before = all_events(&s).await;
    let dry = s.post("/v1/admin/reap", json!({"dry_run": true})).await;
    assert_eq!(dry.status, 200, "{}", dry.text);
    assert_eq!(dry.body["dry_run"], true);
    let due = dry.body["sessions"].as_array().unwrap();
    assert_eq!(due.len(), 1, "{}", dry.text);
    assert_eq!(due[0]["session_id"], a.as_str());
    assert_eq!(due[0]["expired_at"], BASE + 1_000);
    let mut locks = due[0]["locks"].as_array().unwrap().clone();
    locks.sort_by_key(|l| l["token"].as_u64());
    assert_eq!(
        locks,
        vec![
            json!({"key": "k1", "token": t1}),
            json!({"key": "k2", "token": t2})
        ]
    );
    // Nothing changed: same answer again, no events, the locks still recorded, the gauges
    // unmoved.
    let dry2 = s.post("/v1/admin/reap", json!({"dry_run": true})).await;
    assert_eq!(dry2.body, dry.body);
    assert_eq!(all_events(&s).await, events_before);
    assert_eq!(holder(&s, "k1").await.body["session_id"], a.as_str());
    assert_eq!(metric(&s, "leasehold_sessions_active").await, Some(2.0));
    assert_eq!(metric(&s, "leasehold_locks_held").await, Some(3.0));

    let rev_before = t3;
    let real = s.post("/v1/admin/reap", json!({"dry_run": false})).await;
    assert_eq!(real.status, 200, "{}", real.text);
    assert_eq!(real.body["dry_run"], false);
    assert_eq!(real.body["sessions_ended"], 1);
    assert_eq!(real.body["locks_released"], 2);
    assert!(real.body["revision"].as_u64().unwrap() > rev_before);
    assert_error(&holder(&s, "k1").await, 404, "lock_free");
    assert_error(&holder(&s, "k2").await, 404, "lock_free");
    assert_eq!(holder(&s, "k3").await.body["token"], t3);
    let ev = all_events(&s).await;
    assert_eq!(ev.len(), events_before.len() + 1);
    assert_eq!(ev.last().unwrap()["kind"], "session_expired");
    assert_eq!(metric(&s, "leasehold_locks_held").await, Some(1.0));
    // Nothing more is due.
    let dry3 = s.post("/v1/admin/reap", json!({"dry_run": true})).await;
    assert_eq!(dry3.body["sessions"], json!([]));
    let again = s.reap().await;
    assert_eq!(again.body["sessions_ended"], 0);
    assert_eq!(again.body["locks_released"], 0);
    // An empty body is a real reap.
    let empty = s.post("/v1/admin/reap", json!({})).await;
    assert_eq!(empty.status, 200);
    assert_eq!(empty.body["dry_run"], false);

    assert_invalid(
        &s.post("/v1/admin/reap", json!({"dry_run": "yes"})).await,
        "dry_run",
    );
    assert_error(
        &s.post("/v1/admin/reap", json!({"dry_run": true, "all": true}))
            .await,
        400,
        "invalid_request",
    );
    s.stop().await;
}

#[tokio::test]
async fn admin_end_is_audited_and_releases() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    let t = take(&s, "k", &a).await;
    let r = s
        .post(&format!("/v1/admin/sessions/{a}/end"), json!({}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["released"], 1);
    assert!(r.body["revision"].as_u64().unwrap() > t);
    assert_error(&holder(&s, "k").await, 404, "lock_free");
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    let again = s
        .post(&format!("/v1/admin/sessions/{a}/end"), json!({}))
        .await;
    assert_eq!(again.status, 200);
    assert_eq!(again.body["released"], 0);
    let unknown = s
        .post(
            &format!("/v1/admin/sessions/{}/end", random_id()),
            json!({}),
        )
        .await;
    assert_eq!(unknown.body["released"], 0);

    let ev = all_events(&s).await;
    let ended = of_kind(&ev, "session_ended_by_admin");
    assert_eq!(ended.len(), 1, "{ev:?}");
    assert_eq!(ended[0]["session_id"], a.as_str());
    assert_eq!(ended[0]["reason"], "admin");
    assert_eq!(ended[0]["released"], json!([{"key": "k", "token": t}]));
    assert!(of_kind(&ev, "session_closed").is_empty());
    assert_eq!(
        metric(&s, "leasehold_sessions_ended_total{reason=\"admin\"}").await,
        Some(1.0)
    );
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn wrong_method_is_405() {
    let s = TestServer::start().await;
    let cases = [
        (Method::PUT, "/v1/sessions".to_string()),
        (Method::DELETE, "/v1/sessions".to_string()),
        (Method::PUT, format!("/v1/sessions/{}", random_id())),
        (
            Method::GET,
            format!("/v1/sessions/{}/heartbeat", random_id()),
        ),
        (Method::GET, "/v1/locks/k/acquire".to_string()),
        (Method::GET, "/v1/locks/k/release".to_string()),
        (Method::DELETE, "/v1/locks/k".to_string()),
        (Method::POST, "/v1/locks".to_string()),
        (Method::POST, "/v1/fence/k".to_string()),
        (Method::POST, "/v1/events".to_string()),
        (Method::GET, "/v1/admin/reap".to_string()),
        (
            Method::GET,
            format!("/v1/admin/sessions/{}/end", random_id()),
        ),
        (Method::POST, "/healthz".to_string()),
        (Method::DELETE, "/metrics".to_string()),
    ];
    for (method, path) in cases {
        let r = raw(&s, method.clone(), &path, Vec::new()).await;
        assert_eq!(r.status, 405, "{method} {path}: {}", r.text);
        assert_eq!(r.body["error"], "method_not_allowed", "{}", r.text);
    }
    s.stop().await;
}

#[tokio::test]
async fn unknown_path_is_404_not_found() {
    let s = TestServer::start().await;
    for (method, path) in [
        (Method::GET, "/"),
        (Method::GET, "/v1"),
        (Method::GET, "/v2/sessions"),
        (Method::GET, "/v1/nope"),
        (Method::POST, "/v1/locks/k/steal"),
        (Method::GET, "/v1/locks/k/acquire/extra"),
        (Method::GET, "/v1/leases"),
        (Method::POST, "/v1/admin/everything"),
    ] {
        let r = raw(&s, method.clone(), path, Vec::new()).await;
        assert_eq!(r.status, 404, "{method} {path}: {}", r.text);
        assert_eq!(r.body["error"], "not_found", "{}", r.text);
    }
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Fail-stop
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

// ---------------------------------------------------------------------------------------------
// Connection limits and clocks
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
    assert_error(&join(wait_b).await, 503, "store_failed");
    assert_eq!(
        holder(&s, "k").await.body["token"],
        ta,
        "the committed grant"
    );
    s.stop().await;
}

#[tokio::test]
async fn events_are_trimmed_by_retention_in_bounded_batches() {
    let s = TestServer::start_with(|c| {
        c.event_retention_ms = 1_000;
        c.event_trim_batch = 2;
    })
    .await;
    for i in 0..5 {
        s.open(&format!("o{i}"), 60_000).await;
    }
    assert_eq!(all_events(&s).await.len(), 5);
    // Not old enough yet: a reaper pass trims nothing.
    s.advance(1_000).await;
    s.reap().await;
    assert_eq!(all_events(&s).await.len(), 5);
    s.advance(1).await;
    let seqs = |ev: &[Value]| {
        ev.iter()
            .map(|e| e["seq"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    s.reap().await;
    assert_eq!(seqs(&all_events(&s).await), [3, 4, 5], "two per pass");
    assert_eq!(
        metric(&s, "leasehold_events_trimmed_total").await,
        Some(2.0)
    );
    s.reap().await;
    assert_eq!(seqs(&all_events(&s).await), [5]);
    s.reap().await;
    assert!(all_events(&s).await.is_empty());
    assert_eq!(
        metric(&s, "leasehold_events_trimmed_total").await,
        Some(5.0)
    );
    // Sequence numbers go on from where they were.
    s.open("later", 60_000).await;
    assert_eq!(seqs(&all_events(&s).await), [6]);
    let r = s.get("/v1/events?after=0").await;
    assert_eq!(r.body["next"], 6);
    s.stop().await;
}

#[tokio::test]
async fn closing_an_expired_session_is_recorded_as_its_expiry() {
    let s = TestServer::start().await;
    let a = s.open("a", 1_000).await;
    let t = take(&s, "k", &a).await;
    s.advance(1_000).await;
    let closed = s.delete(&format!("/v1/sessions/{a}")).await;
    assert_eq!(closed.status, 200, "{}", closed.text);
    let ev = all_events(&s).await;
    assert!(of_kind(&ev, "session_closed").is_empty(), "{ev:?}");
    let expired = of_kind(&ev, "session_expired");
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0]["released"], json!([{"key": "k", "token": t}]));
    assert_error(&holder(&s, "k").await, 404, "lock_free");
    assert_eq!(
        metric(&s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        Some(1.0)
    );
    s.stop().await;
}

#[tokio::test]
async fn a_plus_in_a_path_is_a_plus_not_a_space() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    let r = s
        .post("/v1/locks/a+b/acquire", json!({"session_id": a}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["key"], "a+b");
    assert_eq!(holder(&s, "a+b").await.body["token"], token(&r));
    assert_error(&holder(&s, "a b").await, 404, "lock_free");
    s.stop().await;
}

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
