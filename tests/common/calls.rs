//! The HTTP calls and assertions the suites share, one helper per API call.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use leasehold::client::{Client, Reply, segment};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::TestServer;

// ---------------------------------------------------------------------------------------------
// Assertions
// ---------------------------------------------------------------------------------------------

pub fn assert_error(r: &Reply, status: u16, code: &str) {
    assert_eq!(r.status, status, "{}", r.text);
    assert_eq!(r.body["error"], code, "{}", r.text);
    assert!(
        r.body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "an error carries a message: {}",
        r.text
    );
}

/// A 400 `invalid_request` whose `field` names `field`.
pub fn assert_invalid(r: &Reply, field: &str) {
    assert_error(r, 400, "invalid_request");
    assert_eq!(r.body["field"], field, "{}", r.text);
}

/// A 400 `invalid_request` whose message mentions `word` (for serde's own errors).
pub fn assert_invalid_mentions(r: &Reply, word: &str) {
    assert_error(r, 400, "invalid_request");
    assert!(
        r.body["message"].as_str().unwrap().contains(word),
        "the message should name {word:?}: {}",
        r.text
    );
}

// ---------------------------------------------------------------------------------------------
// Raw requests, events, metrics
// ---------------------------------------------------------------------------------------------

/// A response to a request made with arbitrary bytes and method.
pub struct Raw {
    pub status: u16,
    pub text: String,
    pub body: Value,
}

/// Sends `body` as is (not necessarily JSON) with `method` to `path`.
pub async fn raw(s: &TestServer, method: Method, path: &str, body: Vec<u8>) -> Raw {
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

pub fn addr(s: &TestServer) -> SocketAddr {
    s.app.as_ref().unwrap().addr
}

/// Every audit event, read page by page.
pub async fn all_events(s: &TestServer) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let r = s.get(&format!("/v1/events?after={after}&limit=1000")).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let page = r.body["events"].as_array().unwrap().clone();
        if page.is_empty() {
            return out;
        }
        after = r.body["next"].as_u64().unwrap();
        out.extend(page);
    }
}

pub fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

pub fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect()
}

/// The value of one series in `/metrics`, e.g. `leasehold_sessions_ended_total{reason="expired"}`.
pub async fn metric(s: &TestServer, series: &str) -> Option<f64> {
    let r = s.get("/metrics").await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.text.lines().find_map(|line| {
        line.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(|v| v.trim().parse::<f64>().unwrap())
    })
}

pub fn random_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

pub fn sorted(ids: &[&String]) -> Vec<String> {
    let mut out: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    out.sort();
    out
}

/// Awaits a spawned request, at most 5 s: a waiter the server forgot fails the test instead
/// of hanging it.
pub async fn answer(h: JoinHandle<Reply>) -> Reply {
    tokio::time::timeout(Duration::from_secs(5), h)
        .await
        .expect("the waiting request was never answered")
        .unwrap()
}

/// Polls `done` until it holds, one HTTP round trip a poll; gives up after 5 s.
async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if done().await {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never: {what}");
}

// ---------------------------------------------------------------------------------------------
// Sessions
// ---------------------------------------------------------------------------------------------

pub async fn open_with(s: &TestServer, body: Value) -> Reply {
    s.post("/v1/sessions", body).await
}

pub async fn session(s: &TestServer, id: &str) -> Reply {
    s.get(&format!("/v1/sessions/{id}")).await
}

/// Closes a session, which must succeed.
pub async fn close(s: &TestServer, session: &str) -> Reply {
    let r = s.delete(&format!("/v1/sessions/{session}")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

/// Ends a session as an operator, which must succeed.
pub async fn admin_end(s: &TestServer, session: &str) -> Reply {
    let r = s
        .post(&format!("/v1/admin/sessions/{session}/end"), json!({}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

pub async fn dry_run(s: &TestServer) -> Reply {
    s.post("/v1/admin/reap", json!({"dry_run": true})).await
}

// ---------------------------------------------------------------------------------------------
// Locks
// ---------------------------------------------------------------------------------------------

pub fn lock_path(key: &str, action: &str) -> String {
    format!("/v1/locks/{}/{action}", segment(key))
}

pub async fn acquire_wait(c: &Client, key: &str, session: &str, wait_ms: u64) -> Reply {
    c.post(
        &lock_path(key, "acquire"),
        &json!({"session_id": session, "wait_ms": wait_ms}),
    )
    .await
    .unwrap()
}

/// Starts an acquire that may wait, on its own task.
pub fn spawn_acquire(s: &TestServer, key: &str, session: &str, wait_ms: u64) -> JoinHandle<Reply> {
    let c = s.client.clone();
    let key = key.to_string();
    let session = session.to_string();
    tokio::spawn(async move { acquire_wait(&c, &key, &session, wait_ms).await })
}

/// Acquires `key` for `session` and returns the token, failing the test otherwise.
pub async fn take(s: &TestServer, key: &str, session: &str) -> u64 {
    let r = s.acquire(key, session).await;
    assert_eq!(r.status, 200, "acquire {key}: {}", r.text);
    r.body["token"].as_u64().unwrap()
}

/// The `field` of each item of the list `list` in a page, in the page's order.
fn page_items(r: &Reply, list: &str, field: &str) -> Vec<String> {
    r.body[list]
        .as_array()
        .unwrap_or_else(|| panic!("no {list} in {}", r.text))
        .iter()
        .map(|item| item[field].as_str().unwrap().to_string())
        .collect()
}

/// The keys of a `GET /v1/locks` page, in its order.
pub fn lock_keys(r: &Reply) -> Vec<String> {
    page_items(r, "locks", "key")
}

/// The session ids of a `GET /v1/sessions` page, in its order.
pub fn session_ids(r: &Reply) -> Vec<String> {
    page_items(r, "sessions", "session_id")
}

pub fn token(r: &Reply) -> u64 {
    r.body["token"]
        .as_u64()
        .unwrap_or_else(|| panic!("no token in {}", r.text))
}

pub async fn holder(s: &TestServer, key: &str) -> Reply {
    s.get(&format!("/v1/locks/{}", segment(key))).await
}

pub async fn fence(s: &TestServer, key: &str, t: u64) -> Reply {
    let r = s
        .get(&format!("/v1/fence/{}?token={t}", segment(key)))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

/// Polls the waiter gauge until `n` acquires wait on this node.
pub async fn until_waiters(s: &TestServer, n: u64) {
    until(&format!("{n} lock waiters"), async || {
        metric(s, "leasehold_waiters").await == Some(n as f64)
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Pools and seats
// ---------------------------------------------------------------------------------------------

pub fn pool_path(pool: &str) -> String {
    format!("/v1/pools/{}", segment(pool))
}

pub async fn put_pool(s: &TestServer, pool: &str, body: Value) -> Reply {
    s.client
        .call(hyper::Method::PUT, &pool_path(pool), Some(&body))
        .await
        .unwrap()
}

/// Creates (or resizes) a pool and checks the answer.
pub async fn make_pool(s: &TestServer, pool: &str, capacity: u64) {
    let r = put_pool(s, pool, json!({"capacity": capacity})).await;
    assert!(r.status == 201 || r.status == 200, "{}", r.text);
}

pub async fn pool(s: &TestServer, name: &str) -> Reply {
    s.get(&pool_path(name)).await
}

pub async fn acquire_seat(c: &Client, pool: &str, body: Value) -> Reply {
    c.post(&format!("{}/acquire", pool_path(pool)), &body)
        .await
        .unwrap()
}

/// Takes a seat for `session` at once and returns its token, failing the test otherwise.
pub async fn seat(s: &TestServer, pool: &str, session: &str) -> u64 {
    let r = acquire_seat(&s.client, pool, json!({"session_id": session})).await;
    assert_eq!(r.status, 200, "seat in {pool}: {}", r.text);
    r.body["seat_token"].as_u64().unwrap()
}

/// Starts a seat request that may wait, on its own task.
pub fn spawn_seat(s: &TestServer, pool: &str, session: &str, wait_ms: u64) -> JoinHandle<Reply> {
    let c = s.client.clone();
    let pool = pool.to_string();
    let body = json!({"session_id": session, "wait_ms": wait_ms});
    tokio::spawn(async move { acquire_seat(&c, &pool, body).await })
}

pub async fn release_seat(s: &TestServer, pool: &str, session: &str, token: u64) -> Reply {
    s.post(
        &format!("{}/release", pool_path(pool)),
        json!({"session_id": session, "seat_token": token}),
    )
    .await
}

/// Session ids holding a seat in `name`, sorted.
pub async fn holders(s: &TestServer, name: &str) -> Vec<String> {
    let r = pool(s, name).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let mut ids: Vec<String> = r.body["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["session_id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

/// What a pool's holders look like apart from liveness (which a restart may reset).
pub async fn holder_rows(s: &TestServer, name: &str) -> Vec<Value> {
    let mut rows: Vec<Value> = pool(s, name).await.body["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            json!([
                h["session_id"],
                h["owner"],
                h["seat_token"],
                h["acquired_at"],
                h["metadata"]
            ])
        })
        .collect();
    rows.sort_by_key(|r| r[2].as_u64());
    rows
}

/// Polls until `n` seat requests wait for `name`.
pub async fn until_pool_waiting(s: &TestServer, name: &str, n: u64) {
    until(&format!("{n} waiters for pool {name}"), async || {
        pool(s, name).await.body["waiting"] == n
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Queues and jobs
// ---------------------------------------------------------------------------------------------

pub async fn enqueue_with(s: &TestServer, queue: &str, body: Value) -> Reply {
    s.post(&format!("/v1/queues/{}/jobs", segment(queue)), body)
        .await
}

/// Enqueues a job and returns its id.
pub async fn enqueue(s: &TestServer, queue: &str, body: Value) -> String {
    let r = enqueue_with(s, queue, body).await;
    assert_eq!(r.status, 201, "{}", r.text);
    r.body["job_id"].as_str().unwrap().to_string()
}

pub async fn claim_with(c: &Client, queue: &str, body: Value) -> Reply {
    c.post(&format!("/v1/queues/{}/claim", segment(queue)), &body)
        .await
        .unwrap()
}

pub async fn claim(s: &TestServer, queue: &str, session: &str) -> Reply {
    claim_with(&s.client, queue, json!({"session_id": session})).await
}

/// Claims a job at once and returns (job id, token), failing the test otherwise.
pub async fn claim_job(s: &TestServer, queue: &str, session: &str) -> (String, u64) {
    let r = claim(s, queue, session).await;
    assert_eq!(r.status, 200, "claim from {queue}: {}", r.text);
    (
        r.body["job_id"].as_str().unwrap().to_string(),
        r.body["token"].as_u64().unwrap(),
    )
}

/// Starts a claim that may wait, on its own task.
pub fn spawn_claim(s: &TestServer, queue: &str, session: &str, wait_ms: u64) -> JoinHandle<Reply> {
    let c = s.client.clone();
    let queue = queue.to_string();
    let body = json!({"session_id": session, "wait_ms": wait_ms});
    tokio::spawn(async move { claim_with(&c, &queue, body).await })
}

/// `POST /v1/jobs/{job}/{action}` with `body`.
pub async fn finish(s: &TestServer, job: &str, action: &str, body: Value) -> Reply {
    s.post(&format!("/v1/jobs/{job}/{action}"), body).await
}

pub async fn complete(s: &TestServer, job: &str, session: &str, token: u64) -> Reply {
    finish(
        s,
        job,
        "complete",
        json!({"session_id": session, "token": token}),
    )
    .await
}

/// A job, which must exist.
pub async fn job(s: &TestServer, id: &str) -> Reply {
    let r = s.get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

pub async fn queue_info(s: &TestServer, queue: &str) -> Reply {
    let r = s.get(&format!("/v1/queues/{}", segment(queue))).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

/// (queued, claimed, done, failed) of a queue.
pub async fn counts(s: &TestServer, queue: &str) -> (u64, u64, u64, u64) {
    let b = queue_info(s, queue).await.body;
    let n = |k: &str| b[k].as_u64().unwrap();
    (n("queued"), n("claimed"), n("done"), n("failed"))
}

/// Job ids of a queue in one state (one page of up to 1 000).
pub async fn listed(s: &TestServer, queue: &str, state: &str) -> Vec<String> {
    let r = s
        .get(&format!(
            "/v1/queues/{}/jobs?state={state}&limit=1000",
            segment(queue)
        ))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.body["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["job_id"].as_str().unwrap().to_string())
        .collect()
}

pub async fn list_query(s: &TestServer, query: &str) -> Reply {
    s.get(&format!("/v1/queues/q/jobs?{query}")).await
}

pub async fn requeue(s: &TestServer, job: &str) -> Reply {
    s.post(&format!("/v1/admin/jobs/{job}/requeue"), json!({}))
        .await
}

/// Polls until `n` claims wait for `queue`.
pub async fn until_queue_waiting(s: &TestServer, queue: &str, n: u64) {
    until(
        &format!("{n} claims waiting for queue {queue}"),
        async || queue_info(s, queue).await.body["waiting"] == n,
    )
    .await
}
