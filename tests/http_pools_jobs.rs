//! HTTP end-to-end tests for seat pools (floating licences) and job leases, against the real
//! server on port 0 (see `common`), driven by a manual clock.
//!
//! They guard against what a licence holder or a worker would notice first: a zombie seat
//! that keeps a full pool full, a waiter served out of turn, a shrink that takes a seat away,
//! a job lost or run twice when its worker dies, a late worker finishing a job someone else
//! now holds, a recovery loop that never ends, a dry run that changes something, and a
//! restart that forgets who holds what.
mod common;

use std::time::{Duration, Instant};

use common::{TestServer, all_events, assert_error, assert_invalid, of_kind, random_id, session};
use leasehold::client::{Reply, segment};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// The manual clock's wall time at start-up (see `common::TestServer::start_with`).
const BASE: u64 = 1_700_000_000_000;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A 400 `invalid_request` whose message mentions `word` (for serde's own errors).
fn assert_invalid_mentions(r: &Reply, word: &str) {
    assert_error(r, 400, "invalid_request");
    assert!(
        r.body["message"].as_str().unwrap().contains(word),
        "the message should name {word:?}: {}",
        r.text
    );
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect()
}

/// The value of one series in `/metrics`, e.g. `leasehold_seats_in_use{pool="p"}`.
async fn metric(s: &TestServer, series: &str) -> Option<f64> {
    let r = s.get("/metrics").await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.text.lines().find_map(|line| {
        line.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(|v| v.trim().parse::<f64>().unwrap())
    })
}

fn pool_path(pool: &str) -> String {
    format!("/v1/pools/{}", segment(pool))
}

async fn put_pool(s: &TestServer, pool: &str, body: Value) -> Reply {
    s.client
        .call(hyper::Method::PUT, &pool_path(pool), Some(&body))
        .await
        .unwrap()
}

/// Creates (or resizes) a pool and checks the answer.
async fn make_pool(s: &TestServer, pool: &str, capacity: u64) {
    let r = put_pool(s, pool, json!({"capacity": capacity})).await;
    assert!(r.status == 201 || r.status == 200, "{}", r.text);
}

async fn pool(s: &TestServer, name: &str) -> Reply {
    s.get(&pool_path(name)).await
}

async fn acquire_seat(c: &leasehold::client::Client, pool: &str, body: Value) -> Reply {
    c.post(&format!("{}/acquire", pool_path(pool)), &body)
        .await
        .unwrap()
}

/// Takes a seat for `session` at once and returns its token, failing the test otherwise.
async fn seat(s: &TestServer, pool: &str, session: &str) -> u64 {
    let r = acquire_seat(&s.client, pool, json!({"session_id": session})).await;
    assert_eq!(r.status, 200, "seat in {pool}: {}", r.text);
    r.body["seat_token"].as_u64().unwrap()
}

/// Starts a seat request that may wait, on its own task.
fn spawn_seat(s: &TestServer, pool: &str, session: &str, wait_ms: u64) -> JoinHandle<Reply> {
    let c = s.client.clone();
    let pool = pool.to_string();
    let body = json!({"session_id": session, "wait_ms": wait_ms});
    tokio::spawn(async move { acquire_seat(&c, &pool, body).await })
}

async fn release_seat(s: &TestServer, pool: &str, session: &str, token: u64) -> Reply {
    s.post(
        &format!("{}/release", pool_path(pool)),
        json!({"session_id": session, "seat_token": token}),
    )
    .await
}

/// Session ids holding a seat in `name`, sorted.
async fn holders(s: &TestServer, name: &str) -> Vec<String> {
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

fn sorted(ids: &[&String]) -> Vec<String> {
    let mut out: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    out.sort();
    out
}

/// Polls until `n` seat requests wait for `name`. Bounded: gives up after 5 s.
async fn until_pool_waiting(s: &TestServer, name: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if pool(s, name).await.body["waiting"] == n {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("pool {name} never had {n} waiters");
}

/// Polls until `n` claims wait for `queue`. Bounded: gives up after 5 s.
async fn until_queue_waiting(s: &TestServer, queue: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if queue_info(s, queue).await.body["waiting"] == n {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("queue {queue} never had {n} waiters");
}

/// Awaits a spawned request, at most 5 s.
async fn answer(h: JoinHandle<Reply>) -> Reply {
    tokio::time::timeout(Duration::from_secs(5), h)
        .await
        .expect("the waiting request was never answered")
        .unwrap()
}

async fn close(s: &TestServer, session: &str) -> Reply {
    let r = s.delete(&format!("/v1/sessions/{session}")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

async fn admin_end(s: &TestServer, session: &str) -> Reply {
    let r = s
        .post(&format!("/v1/admin/sessions/{session}/end"), json!({}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

async fn enqueue_with(s: &TestServer, queue: &str, body: Value) -> Reply {
    s.post(&format!("/v1/queues/{}/jobs", segment(queue)), body)
        .await
}

/// Enqueues a job and returns its id.
async fn enqueue(s: &TestServer, queue: &str, body: Value) -> String {
    let r = enqueue_with(s, queue, body).await;
    assert_eq!(r.status, 201, "{}", r.text);
    r.body["job_id"].as_str().unwrap().to_string()
}

async fn claim_with(c: &leasehold::client::Client, queue: &str, body: Value) -> Reply {
    c.post(&format!("/v1/queues/{}/claim", segment(queue)), &body)
        .await
        .unwrap()
}

async fn claim(s: &TestServer, queue: &str, session: &str) -> Reply {
    claim_with(&s.client, queue, json!({"session_id": session})).await
}

/// Claims a job at once and returns (job id, token), failing the test otherwise.
async fn claim_job(s: &TestServer, queue: &str, session: &str) -> (String, u64) {
    let r = claim(s, queue, session).await;
    assert_eq!(r.status, 200, "claim from {queue}: {}", r.text);
    (
        r.body["job_id"].as_str().unwrap().to_string(),
        r.body["token"].as_u64().unwrap(),
    )
}

fn spawn_claim(s: &TestServer, queue: &str, session: &str, wait_ms: u64) -> JoinHandle<Reply> {
    let c = s.client.clone();
    let queue = queue.to_string();
    let body = json!({"session_id": session, "wait_ms": wait_ms});
    tokio::spawn(async move { claim_with(&c, &queue, body).await })
}

/// `POST /v1/jobs/{job}/{action}` with `body`.
async fn finish(s: &TestServer, job: &str, action: &str, body: Value) -> Reply {
    s.post(&format!("/v1/jobs/{job}/{action}"), body).await
}

async fn complete(s: &TestServer, job: &str, session: &str, token: u64) -> Reply {
    finish(
        s,
        job,
        "complete",
        json!({"session_id": session, "token": token}),
    )
    .await
}

async fn job(s: &TestServer, id: &str) -> Reply {
    let r = s.get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

async fn queue_info(s: &TestServer, queue: &str) -> Reply {
    let r = s.get(&format!("/v1/queues/{}", segment(queue))).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r
}

/// (queued, claimed, done, failed) of a queue.
async fn counts(s: &TestServer, queue: &str) -> (u64, u64, u64, u64) {
    let b = queue_info(s, queue).await.body;
    let n = |k: &str| b[k].as_u64().unwrap();
    (n("queued"), n("claimed"), n("done"), n("failed"))
}

/// Job ids of a queue in one state (all pages).
async fn listed(s: &TestServer, queue: &str, state: &str) -> Vec<String> {
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

async fn list_query(s: &TestServer, query: &str) -> Reply {
    s.get(&format!("/v1/queues/q/jobs?{query}")).await
}

async fn requeue(s: &TestServer, job: &str) -> Reply {
    s.post(&format!("/v1/admin/jobs/{job}/requeue"), json!({}))
        .await
}

// ---------------------------------------------------------------------------------------------
// Pools: create, resize, show, list, delete
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn pool_create_resize_show_list_delete() {
    let s = TestServer::start().await;
    let created = put_pool(
        &s,
        "licences/cad",
        json!({"capacity": 5, "metadata": {"vendor": "acme"}}),
    )
    .await;
    assert_eq!(created.status, 201, "{}", created.text);
    assert_eq!(created.body["pool"], "licences/cad");
    assert_eq!(created.body["capacity"], 5);
    assert_eq!(created.body["created"], true);
    let rev1 = created.body["revision"].as_u64().unwrap();
    assert!(rev1 > 0);

    let shown = pool(&s, "licences/cad").await;
    assert_eq!(shown.status, 200, "{}", shown.text);
    assert_eq!(
        shown.body,
        json!({
            "pool": "licences/cad",
            "capacity": 5,
            "in_use": 0,
            "waiting": 0,
            "created_at": BASE,
            "metadata": {"vendor": "acme"},
            "holders": [],
        })
    );

    s.advance(10).await;
    let resized = put_pool(&s, "licences/cad", json!({"capacity": 2})).await;
    assert_eq!(resized.status, 200, "{}", resized.text);
    assert_eq!(resized.body["created"], false);
    assert_eq!(resized.body["capacity"], 2);
    assert!(resized.body["revision"].as_u64().unwrap() > rev1);
    assert_eq!(pool(&s, "licences/cad").await.body["capacity"], 2);

    make_pool(&s, "a-first", 1).await;
    let list = s.get("/v1/pools").await;
    assert_eq!(list.status, 200, "{}", list.text);
    assert_eq!(
        list.body,
        json!({"pools": [
            {"pool": "a-first", "capacity": 1, "in_use": 0},
            {"pool": "licences/cad", "capacity": 2, "in_use": 0},
        ]})
    );
    assert_eq!(
        metric(&s, "leasehold_seats_capacity{pool=\"licences/cad\"}").await,
        Some(2.0)
    );
    assert_eq!(
        metric(&s, "leasehold_seats_in_use{pool=\"licences/cad\"}").await,
        Some(0.0)
    );

    let deleted = s.delete(&pool_path("licences/cad")).await;
    assert_eq!(deleted.status, 200, "{}", deleted.text);
    assert_eq!(deleted.body["deleted"], true);
    assert!(
        deleted.body["revision"].as_u64().unwrap() > resized.body["revision"].as_u64().unwrap()
    );
    assert_error(&pool(&s, "licences/cad").await, 404, "pool_not_found");
    assert_error(
        &s.delete(&pool_path("licences/cad")).await,
        404,
        "pool_not_found",
    );
    assert_error(&pool(&s, "never-made").await, 404, "pool_not_found");
    assert_eq!(
        s.get("/v1/pools").await.body,
        json!({"pools": [{"pool": "a-first", "capacity": 1, "in_use": 0}]})
    );
    // A deleted pool's series are gone.
    assert_eq!(
        metric(&s, "leasehold_seats_capacity{pool=\"licences/cad\"}").await,
        None
    );

    let ev = all_events(&s).await;
    assert_eq!(
        kinds(&ev),
        ["pool_put", "pool_put", "pool_put", "pool_deleted"]
    );
    assert_eq!(ev[0]["pool"], "licences/cad");
    assert_eq!(ev[0]["detail"], "capacity 5");
    assert_eq!(ev[1]["detail"], "capacity 2");
    assert_eq!(ev[1]["at"], BASE + 10);
    assert_eq!(ev[2]["pool"], "a-first");
    assert_eq!(ev[3]["pool"], "licences/cad");
    // A deleted pool can be made again, afresh.
    let again = put_pool(&s, "licences/cad", json!({"capacity": 1})).await;
    assert_eq!(again.status, 201, "{}", again.text);
    assert_eq!(again.body["created"], true);
    s.stop().await;
}

#[tokio::test]
async fn resizing_a_pool_keeps_its_created_at() {
    let s = TestServer::start().await;
    let r = put_pool(&s, "p", json!({"capacity": 3, "metadata": {"v": 1}})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(pool(&s, "p").await.body["created_at"], BASE);
    s.advance(5_000).await;
    make_pool(&s, "p", 4).await;
    let shown = pool(&s, "p").await;
    assert_eq!(shown.body["capacity"], 4);
    assert_eq!(shown.body["created_at"], BASE, "{}", shown.text);
    // Without new metadata, a resize keeps the old; with some, it is replaced.
    assert_eq!(shown.body["metadata"], json!({"v": 1}), "{}", shown.text);
    let r = put_pool(&s, "p", json!({"capacity": 4, "metadata": {"v": 2}})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let shown = pool(&s, "p").await;
    assert_eq!(shown.body["metadata"], json!({"v": 2}));
    assert_eq!(shown.body["created_at"], BASE);
    s.stop().await;
}

#[tokio::test]
async fn pool_bad_input_is_400_naming_the_field() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    assert_invalid(&put_pool(&s, "p", json!({"capacity": 0})).await, "capacity");
    assert_invalid(
        &put_pool(&s, "p", json!({"capacity": 1_000_001})).await,
        "capacity",
    );
    assert_invalid(
        &put_pool(&s, "p", json!({"capacity": -1})).await,
        "capacity",
    );
    assert_invalid(
        &put_pool(&s, "p", json!({"capacity": "3"})).await,
        "capacity",
    );
    assert_invalid(
        &put_pool(&s, "p", json!({"capacity": 1.5})).await,
        "capacity",
    );
    assert_invalid(
        &put_pool(&s, "p", json!({"capacity": 2, "metadata": [1]})).await,
        "metadata",
    );
    assert_invalid(
        &put_pool(&s, "p", json!({"capacity": 2, "metadata": "x"})).await,
        "metadata",
    );
    assert_invalid(
        &put_pool(
            &s,
            "p",
            json!({"capacity": 2, "metadata": {"k": "v".repeat(5_000)}}),
        )
        .await,
        "metadata",
    );
    assert_invalid_mentions(&put_pool(&s, "p", json!({})).await, "capacity");
    // A pool name follows the key rules.
    assert_invalid(
        &put_pool(&s, "bad\nname", json!({"capacity": 2})).await,
        "pool",
    );
    // Nothing refused made a pool or an event.
    assert_eq!(s.get("/v1/pools").await.body, json!({"pools": []}));
    assert_eq!(all_events(&s).await.len(), 1, "only the session's open");

    // The largest capacity is accepted.
    let big = put_pool(&s, "p", json!({"capacity": 1_000_000, "metadata": null})).await;
    assert_eq!(big.status, 201, "{}", big.text);
    assert_eq!(pool(&s, "p").await.body["metadata"], Value::Null);

    let acquire = |body: Value| acquire_seat(&s.client, "p", body);
    let release = |body: Value| s.post("/v1/pools/p/release", body);
    assert_invalid(
        &acquire(json!({"session_id": a, "metadata": [1]})).await,
        "metadata",
    );
    assert_invalid(&acquire(json!({"session_id": "nope"})).await, "session_id");
    assert_invalid(
        &acquire(json!({"session_id": a, "wait_ms": -1})).await,
        "wait_ms",
    );
    assert_invalid_mentions(&acquire(json!({})).await, "session_id");
    assert_invalid(
        &acquire(json!({"session_id": a, "metadata": {"k": "v".repeat(5_000)}})).await,
        "metadata",
    );
    assert_invalid(
        &release(json!({"session_id": a, "seat_token": "x"})).await,
        "seat_token",
    );
    assert_invalid(
        &release(json!({"session_id": "nope", "seat_token": 1})).await,
        "session_id",
    );
    assert_invalid_mentions(&release(json!({"session_id": a})).await, "seat_token");
    assert_eq!(pool(&s, "p").await.body["in_use"], 0);
    s.stop().await;
}

#[tokio::test]
async fn missing_and_unknown_fields_are_named_in_field() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    make_pool(&s, "p", 1).await;
    // Missing.
    assert_invalid(&put_pool(&s, "p", json!({})).await, "capacity");
    assert_invalid(&acquire_seat(&s.client, "p", json!({})).await, "session_id");
    assert_invalid(
        &s.post("/v1/pools/p/release", json!({"session_id": a}))
            .await,
        "seat_token",
    );
    assert_invalid(
        &enqueue_with(&s, "q", json!({"kind": "k"})).await,
        "payload",
    );
    assert_invalid(&claim_with(&s.client, "q", json!({})).await, "session_id");
    // Unknown.
    assert_invalid(
        &put_pool(&s, "p", json!({"capacity": 2, "colour": "red"})).await,
        "colour",
    );
    assert_invalid(
        &acquire_seat(&s.client, "p", json!({"session_id": a, "seats": 2})).await,
        "seats",
    );
    assert_invalid(
        &s.post(
            "/v1/pools/p/release",
            json!({"session_id": a, "seat_token": 1, "force": true}),
        )
        .await,
        "force",
    );
    assert_invalid(
        &enqueue_with(&s, "q", json!({"payload": 1, "priority": 9})).await,
        "priority",
    );
    assert_invalid(
        &claim_with(&s.client, "q", json!({"session_id": a, "batch": 2})).await,
        "batch",
    );
    assert_eq!(pool(&s, "p").await.body["capacity"], 1);
    assert_eq!(counts(&s, "q").await, (0, 0, 0, 0));
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Seats
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn seat_acquire_show_release() {
    let s = TestServer::start().await;
    make_pool(&s, "cad", 2).await;
    let a = s.open("alice@laptop", 60_000).await;
    s.advance(100).await;
    let got = acquire_seat(
        &s.client,
        "cad",
        json!({"session_id": a, "metadata": {"host": "h1"}}),
    )
    .await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.body["pool"], "cad");
    assert_eq!(got.body["session_id"], a.as_str());
    let t = got.body["seat_token"].as_u64().unwrap();
    assert_eq!(
        got.body["revision"], t,
        "a seat token is the revision of its grant"
    );

    let shown = pool(&s, "cad").await;
    assert_eq!(shown.body["in_use"], 1);
    assert_eq!(shown.body["waiting"], 0);
    assert_eq!(
        shown.body["holders"],
        json!([{
            "session_id": a,
            "owner": "alice@laptop",
            "seat_token": t,
            "acquired_at": BASE + 100,
            "last_heartbeat_at": BASE,
            "state": "active",
            "metadata": {"host": "h1"},
        }])
    );
    assert_eq!(s.get("/v1/pools").await.body["pools"][0]["in_use"], 1);
    let sess = session(&s, &a).await;
    assert_eq!(
        sess.body["seats"],
        json!([{"pool": "cad", "seat_token": t}])
    );
    assert_eq!(
        metric(&s, "leasehold_seats_in_use{pool=\"cad\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s, "leasehold_seats_capacity{pool=\"cad\"}").await,
        Some(2.0)
    );
    assert_eq!(
        metric(&s, "leasehold_seat_wait_seconds_count").await,
        Some(1.0)
    );

    // A heartbeat shows in the holder's row.
    s.advance(50).await;
    assert_eq!(s.heartbeat(&a).await.status, 200);
    let h = &pool(&s, "cad").await.body["holders"][0];
    assert_eq!(h["last_heartbeat_at"], BASE + 150);

    let rel = release_seat(&s, "cad", &a, t).await;
    assert_eq!(rel.status, 200, "{}", rel.text);
    assert_eq!(rel.body["released"], true);
    assert!(rel.body["revision"].as_u64().unwrap() > t);
    let shown = pool(&s, "cad").await;
    assert_eq!(shown.body["in_use"], 0);
    assert_eq!(shown.body["holders"], json!([]));
    assert_eq!(session(&s, &a).await.body["seats"], json!([]));
    assert_eq!(
        metric(&s, "leasehold_seats_in_use{pool=\"cad\"}").await,
        Some(0.0)
    );
    // Released once is released: the token is no longer a seat.
    assert_error(&release_seat(&s, "cad", &a, t).await, 409, "not_holder");

    let ev = all_events(&s).await;
    let acquired = of_kind(&ev, "seat_acquired");
    assert_eq!(acquired.len(), 1);
    assert_eq!(acquired[0]["session_id"], a.as_str());
    assert_eq!(acquired[0]["pool"], "cad");
    assert_eq!(acquired[0]["token"], t);
    assert_eq!(acquired[0]["at"], BASE + 100);
    let released = of_kind(&ev, "seat_released");
    assert_eq!(released.len(), 1);
    assert_eq!(released[0]["session_id"], a.as_str());
    assert_eq!(released[0]["pool"], "cad");
    assert_eq!(released[0]["token"], t);
    assert!(of_kind(&ev, "seat_reclaimed").is_empty());
    s.stop().await;
}

#[tokio::test]
async fn seat_reacquire_is_idempotent() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let t = seat(&s, "p", &a).await;
    // The pool is full, but the holder asking again gets its own seat back, not a refusal,
    // and no second seat.
    for _ in 0..3 {
        let again = acquire_seat(&s.client, "p", json!({"session_id": a, "wait_ms": 1_000})).await;
        assert_eq!(again.status, 200, "{}", again.text);
        assert_eq!(again.body["seat_token"], t);
    }
    let shown = pool(&s, "p").await;
    assert_eq!(shown.body["in_use"], 1);
    assert_eq!(shown.body["holders"].as_array().unwrap().len(), 1);
    assert_eq!(shown.body["waiting"], 0);
    assert_eq!(of_kind(&all_events(&s).await, "seat_acquired").len(), 1);
    assert_eq!(
        metric(&s, "leasehold_seats_in_use{pool=\"p\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s, "leasehold_seat_acquisitions_refused_total").await,
        Some(0.0)
    );
    // One release gives it back.
    assert_eq!(release_seat(&s, "p", &a, t).await.status, 200);
    assert_eq!(pool(&s, "p").await.body["in_use"], 0);
    s.stop().await;
}

#[tokio::test]
async fn seat_errors() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let gone = s.open("gone", 60_000).await;
    close(&s, &gone).await;

    // Unknown pool.
    assert_error(
        &acquire_seat(&s.client, "nope", json!({"session_id": a})).await,
        404,
        "pool_not_found",
    );
    assert_error(
        &release_seat(&s, "nope", &a, 1).await,
        404,
        "pool_not_found",
    );
    // Gone or never-existing session.
    assert_error(
        &acquire_seat(&s.client, "p", json!({"session_id": gone})).await,
        404,
        "session_gone",
    );
    assert_error(
        &acquire_seat(&s.client, "p", json!({"session_id": random_id()})).await,
        404,
        "session_gone",
    );

    let ta = seat(&s, "p", &a).await;
    let events_before = all_events(&s).await;
    // Full: refused at once without wait_ms, with the pool's numbers.
    let full = acquire_seat(&s.client, "p", json!({"session_id": b})).await;
    assert_error(&full, 409, "pool_exhausted");
    assert_eq!(full.body["capacity"], 1);
    assert_eq!(full.body["in_use"], 1);
    let full0 = acquire_seat(&s.client, "p", json!({"session_id": b, "wait_ms": 0})).await;
    assert_error(&full0, 409, "pool_exhausted");
    assert_eq!(
        metric(&s, "leasehold_seat_acquisitions_refused_total").await,
        Some(2.0)
    );
    // Not the holder: another session, a wrong token, a gone session.
    assert_error(&release_seat(&s, "p", &b, ta).await, 409, "not_holder");
    assert_error(&release_seat(&s, "p", &a, ta + 1).await, 409, "not_holder");
    assert_error(&release_seat(&s, "p", &a, ta - 1).await, 409, "not_holder");
    assert_error(&release_seat(&s, "p", &gone, ta).await, 409, "not_holder");
    // None of that changed anything.
    assert_eq!(all_events(&s).await, events_before);
    let shown = pool(&s, "p").await;
    assert_eq!(shown.body["holders"][0]["session_id"], a.as_str());
    assert_eq!(shown.body["holders"][0]["seat_token"], ta);
    assert_eq!(shown.body["waiting"], 0);
    assert_eq!(release_seat(&s, "p", &a, ta).await.status, 200);
    s.stop().await;
}

#[tokio::test]
async fn seat_tokens_share_the_global_counter_with_lock_tokens() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 2).await;
    let a = s.open("a", 60_000).await;
    let l1 = s.acquire("k1", &a).await;
    assert_eq!(l1.status, 200, "{}", l1.text);
    let t1 = l1.body["token"].as_u64().unwrap();
    let t2 = seat(&s, "p", &a).await;
    let l3 = s.acquire("k2", &a).await;
    let t3 = l3.body["token"].as_u64().unwrap();
    assert!(t1 < t2 && t2 < t3, "{t1} < {t2} < {t3}");
    // The fence answers for locks only: a seat token under the pool's name is not current.
    let f = s.get(&format!("/v1/fence/p?token={t2}")).await;
    assert_eq!(f.status, 200, "{}", f.text);
    assert_eq!(f.body["current"], false, "{}", f.text);
    assert_eq!(f.body["latest"], Value::Null, "{}", f.text);
    s.stop().await;
}

#[tokio::test]
async fn seat_waiters_are_served_first_come_first_served() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = seat(&s, "p", &a).await;
    let wait_b = spawn_seat(&s, "p", &b, 30_000);
    until_pool_waiting(&s, "p", 1).await;
    let wait_c = spawn_seat(&s, "p", &c, 30_000);
    until_pool_waiting(&s, "p", 2).await;
    assert_eq!(pool(&s, "p").await.body["in_use"], 1);

    // A releases: the first waiter, B, gets the seat; C still waits.
    assert_eq!(release_seat(&s, "p", &a, ta).await.status, 200);
    let got_b = answer(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    let tb = got_b.body["seat_token"].as_u64().unwrap();
    assert!(tb > ta);
    assert_eq!(holders(&s, "p").await, vec![b.clone()]);
    assert_eq!(pool(&s, "p").await.body["waiting"], 1);
    assert!(!wait_c.is_finished());
    // A newcomer does not overtake C.
    let d = s.open("d", 60_000).await;
    assert_error(
        &acquire_seat(&s.client, "p", json!({"session_id": d})).await,
        409,
        "pool_exhausted",
    );

    // B's session is closed: its seat goes to C.
    let closed = close(&s, &b).await;
    assert_eq!(closed.body["seats_released"], 1);
    let got_c = answer(wait_c).await;
    assert_eq!(got_c.status, 200, "{}", got_c.text);
    let tc = got_c.body["seat_token"].as_u64().unwrap();
    assert!(tc > tb);
    assert_eq!(holders(&s, "p").await, vec![c.clone()]);
    assert_eq!(pool(&s, "p").await.body["waiting"], 0);

    let ev = all_events(&s).await;
    let grants: Vec<(&str, u64)> = of_kind(&ev, "seat_acquired")
        .iter()
        .map(|e| {
            (
                e["session_id"].as_str().unwrap(),
                e["token"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        grants,
        [(a.as_str(), ta), (b.as_str(), tb), (c.as_str(), tc)]
    );
    let reclaimed = of_kind(&ev, "seat_reclaimed");
    assert_eq!(reclaimed.len(), 1);
    assert_eq!(reclaimed[0]["session_id"], b.as_str());
    assert_eq!(reclaimed[0]["token"], tb);
    assert_eq!(reclaimed[0]["reason"], "closed");
    assert_eq!(reclaimed[0]["pool"], "p");
    s.stop().await;
}

#[tokio::test]
async fn a_seat_waiter_times_out_with_pool_exhausted() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta = seat(&s, "p", &a).await;
    let wait_b = spawn_seat(&s, "p", &b, 5_000);
    until_pool_waiting(&s, "p", 1).await;
    s.advance(4_999).await;
    // Poke the writer: not yet due.
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    until_pool_waiting(&s, "p", 1).await;
    assert!(!wait_b.is_finished());
    s.advance(1).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    let r = answer(wait_b).await;
    assert_error(&r, 409, "pool_exhausted");
    assert_eq!(r.body["capacity"], 1);
    assert_eq!(r.body["in_use"], 1);
    assert_eq!(pool(&s, "p").await.body["waiting"], 0);
    // The timed-out waiter is not served later.
    assert_eq!(release_seat(&s, "p", &a, ta).await.status, 200);
    assert_eq!(pool(&s, "p").await.body["in_use"], 0);
    assert_eq!(of_kind(&all_events(&s).await, "seat_acquired").len(), 1);
    s.stop().await;
}

#[tokio::test]
async fn a_timed_out_seat_waiter_counts_as_refused() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    seat(&s, "p", &a).await;
    let wait_b = spawn_seat(&s, "p", &b, 1_000);
    until_pool_waiting(&s, "p", 1).await;
    s.advance(1_000).await;
    s.reap().await;
    assert_error(&answer(wait_b).await, 409, "pool_exhausted");
    assert_eq!(
        metric(&s, "leasehold_seat_acquisitions_refused_total").await,
        Some(1.0)
    );
    s.stop().await;
}

#[tokio::test]
async fn a_seat_waiter_whose_session_ended_is_skipped() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 2_000).await;
    let d = s.open("d", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = seat(&s, "p", &a).await;
    let wait_b = spawn_seat(&s, "p", &b, 30_000);
    until_pool_waiting(&s, "p", 1).await;
    let wait_d = spawn_seat(&s, "p", &d, 30_000);
    until_pool_waiting(&s, "p", 2).await;
    let wait_c = spawn_seat(&s, "p", &c, 30_000);
    until_pool_waiting(&s, "p", 3).await;
    // B stops heartbeating and passes its deadline; D is closed while it waits.
    s.advance(2_000).await;
    close(&s, &d).await;
    assert!(!wait_b.is_finished() && !wait_d.is_finished());
    // When the seat frees, the two dead waiters are told they are gone and C gets it.
    assert_eq!(release_seat(&s, "p", &a, ta).await.status, 200);
    assert_error(&answer(wait_b).await, 404, "session_gone");
    assert_error(&answer(wait_d).await, 404, "session_gone");
    let got = answer(wait_c).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(holders(&s, "p").await, vec![c.clone()]);
    assert_eq!(pool(&s, "p").await.body["waiting"], 0);
    let ev = all_events(&s).await;
    assert_eq!(of_kind(&ev, "session_expired")[0]["session_id"], b.as_str());
    assert_eq!(of_kind(&ev, "seat_acquired").len(), 2);
    s.stop().await;
}

#[tokio::test]
async fn deleting_a_pool_answers_its_waiters_pool_not_found() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 1_000).await;
    let b = s.open("b", 60_000).await;
    seat(&s, "p", &a).await;
    let wait_b = spawn_seat(&s, "p", &b, 30_000);
    until_pool_waiting(&s, "p", 1).await;
    // The only holder is past its deadline, so the pool is not in use.
    s.advance(1_000).await;
    let r = s.delete(&pool_path("p")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_error(&answer(wait_b).await, 404, "pool_not_found");
    assert_error(&pool(&s, "p").await, 404, "pool_not_found");
    assert_eq!(session(&s, &b).await.body["seats"], json!([]));
    s.stop().await;
}

#[tokio::test]
async fn waits_are_capped_by_max_wait_ms() {
    let s = TestServer::start_with(|c| c.max_wait_ms = 1_000).await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    seat(&s, "p", &a).await;
    let wait_seat = spawn_seat(&s, "p", &b, 60_000);
    until_pool_waiting(&s, "p", 1).await;
    let wait_claim = spawn_claim(&s, "q", &b, 60_000);
    until_queue_waiting(&s, "q", 1).await;
    s.advance(1_000).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    assert_error(&answer(wait_seat).await, 409, "pool_exhausted");
    assert_eq!(answer(wait_claim).await.status, 204);
    s.stop().await;
}

#[tokio::test]
async fn heartbeats_keep_seats_and_claims_alive() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 600_000).await;
    let ta = seat(&s, "p", &a).await;
    let id = enqueue(&s, "q", json!({"payload": 1, "idempotent": true})).await;
    let (_, t) = claim_job(&s, "q", &a).await;
    // Ten TTLs go by, with a heartbeat well inside each: no false positive.
    for _ in 0..13 {
        s.advance(1_500).await;
        assert_eq!(s.heartbeat(&a).await.status, 200);
        assert_error(
            &acquire_seat(&s.client, "p", json!({"session_id": b})).await,
            409,
            "pool_exhausted",
        );
        assert_eq!(s.reap().await.body["sessions_ended"], 0);
        assert_eq!(pool(&s, "p").await.body["holders"][0]["state"], "active");
    }
    let shown = job(&s, &id).await;
    assert_eq!(shown.body["state"], "claimed");
    assert_eq!(shown.body["claimed_by"], a.as_str());
    assert_eq!(complete(&s, &id, &a, t).await.status, 200);
    assert_eq!(release_seat(&s, "p", &a, ta).await.status, 200);
    let ev = all_events(&s).await;
    assert!(of_kind(&ev, "seat_reclaimed").is_empty());
    assert!(of_kind(&ev, "job_recovered").is_empty());
    s.stop().await;
}

#[tokio::test]
async fn concurrent_seat_requests_never_exceed_capacity() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 3).await;
    let mut sessions = Vec::new();
    for i in 0..12 {
        sessions.push(s.open(&format!("s{i}"), 60_000).await);
    }
    let tasks: Vec<_> = sessions
        .iter()
        .map(|id| spawn_seat(&s, "p", id, 0))
        .collect();
    let mut granted = Vec::new();
    let mut refused = 0;
    for (id, t) in sessions.iter().zip(tasks) {
        let r = answer(t).await;
        match r.status.as_u16() {
            200 => granted.push((id.clone(), r.body["seat_token"].as_u64().unwrap())),
            409 => {
                assert_eq!(r.body["error"], "pool_exhausted", "{}", r.text);
                refused += 1;
            }
            other => panic!("unexpected {other}: {}", r.text),
        }
    }
    assert_eq!(granted.len(), 3, "{granted:?}");
    assert_eq!(refused, 9);
    let mut tokens: Vec<u64> = granted.iter().map(|g| g.1).collect();
    tokens.dedup();
    assert_eq!(tokens.len(), 3);
    let mut ids: Vec<String> = granted.into_iter().map(|g| g.0).collect();
    ids.sort();
    assert_eq!(holders(&s, "p").await, ids);
    assert_eq!(pool(&s, "p").await.body["in_use"], 3);
    s.stop().await;
}

#[tokio::test]
async fn growing_a_pool_serves_its_waiters_in_order() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let d = s.open("d", 60_000).await;
    seat(&s, "p", &a).await;
    let wait_b = spawn_seat(&s, "p", &b, 30_000);
    until_pool_waiting(&s, "p", 1).await;
    let wait_c = spawn_seat(&s, "p", &c, 30_000);
    until_pool_waiting(&s, "p", 2).await;
    let wait_d = spawn_seat(&s, "p", &d, 30_000);
    until_pool_waiting(&s, "p", 3).await;
    // Two more seats: the first two waiters get them, the third keeps waiting.
    let grown = put_pool(&s, "p", json!({"capacity": 3})).await;
    assert_eq!(grown.status, 200, "{}", grown.text);
    assert_eq!(answer(wait_b).await.status, 200);
    assert_eq!(answer(wait_c).await.status, 200);
    assert_eq!(holders(&s, "p").await, sorted(&[&a, &b, &c]));
    assert_eq!(pool(&s, "p").await.body["waiting"], 1);
    assert!(!wait_d.is_finished());
    make_pool(&s, "p", 4).await;
    assert_eq!(answer(wait_d).await.status, 200);
    assert_eq!(pool(&s, "p").await.body["in_use"], 4);
    s.stop().await;
}

#[tokio::test]
async fn shrinking_below_use_takes_no_seat_away() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 2).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = seat(&s, "p", &a).await;
    let tb = seat(&s, "p", &b).await;
    let shrunk = put_pool(&s, "p", json!({"capacity": 1})).await;
    assert_eq!(shrunk.status, 200, "{}", shrunk.text);
    // Both keep their seats, with their tokens.
    let shown = pool(&s, "p").await;
    assert_eq!(shown.body["capacity"], 1);
    assert_eq!(shown.body["in_use"], 2);
    let mut tokens: Vec<u64> = shown.body["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["seat_token"].as_u64().unwrap())
        .collect();
    tokens.sort();
    assert_eq!(tokens, [ta, tb]);
    assert!(of_kind(&all_events(&s).await, "seat_reclaimed").is_empty());
    assert_eq!(
        metric(&s, "leasehold_seats_in_use{pool=\"p\"}").await,
        Some(2.0)
    );
    assert_eq!(
        metric(&s, "leasehold_seats_capacity{pool=\"p\"}").await,
        Some(1.0)
    );
    // Holders asking again keep their seat.
    assert_eq!(seat(&s, "p", &a).await, ta);
    // A third is refused with the new numbers.
    let refused = acquire_seat(&s.client, "p", json!({"session_id": c})).await;
    assert_error(&refused, 409, "pool_exhausted");
    assert_eq!(refused.body["capacity"], 1);
    assert_eq!(refused.body["in_use"], 2);
    // ...and, waiting, is served only once use falls under the new capacity.
    let wait_c = spawn_seat(&s, "p", &c, 30_000);
    until_pool_waiting(&s, "p", 1).await;
    assert_eq!(release_seat(&s, "p", &a, ta).await.status, 200);
    assert_eq!(pool(&s, "p").await.body["in_use"], 1);
    assert_eq!(pool(&s, "p").await.body["waiting"], 1);
    assert!(!wait_c.is_finished());
    let d = s.open("d", 60_000).await;
    assert_error(
        &acquire_seat(&s.client, "p", json!({"session_id": d})).await,
        409,
        "pool_exhausted",
    );
    assert_eq!(release_seat(&s, "p", &b, tb).await.status, 200);
    let got = answer(wait_c).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(holders(&s, "p").await, vec![c.clone()]);
    assert_eq!(pool(&s, "p").await.body["in_use"], 1);
    s.stop().await;
}

#[tokio::test]
async fn a_zombie_seat_goes_at_once_to_a_contender() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 3_000).await;
    let b = s.open("b", 60_000).await;
    let ta = seat(&s, "p", &a).await;
    assert_error(
        &acquire_seat(&s.client, "p", json!({"session_id": b})).await,
        409,
        "pool_exhausted",
    );
    // A stops heartbeating: late first (grace), then past its deadline (expired) but still
    // counted until someone reclaims the seat.
    s.advance(1_001).await;
    assert_eq!(pool(&s, "p").await.body["holders"][0]["state"], "grace");
    s.advance(1_999).await;
    let shown = pool(&s, "p").await;
    assert_eq!(shown.body["in_use"], 1);
    assert_eq!(shown.body["holders"][0]["state"], "expired");
    assert_eq!(shown.body["holders"][0]["last_heartbeat_at"], Value::Null);
    assert_eq!(shown.body["holders"][0]["session_id"], a.as_str());

    // No reap: the contender is granted the zombie's seat at once.
    let got = acquire_seat(&s.client, "p", json!({"session_id": b})).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let tb = got.body["seat_token"].as_u64().unwrap();
    assert!(tb > ta);
    assert_eq!(holders(&s, "p").await, vec![b.clone()]);
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    assert_error(&release_seat(&s, "p", &a, ta).await, 409, "not_holder");

    let ev = all_events(&s).await;
    let reclaimed = of_kind(&ev, "seat_reclaimed");
    assert_eq!(reclaimed.len(), 1, "{ev:?}");
    assert_eq!(reclaimed[0]["session_id"], a.as_str());
    assert_eq!(reclaimed[0]["pool"], "p");
    assert_eq!(reclaimed[0]["token"], ta);
    assert_eq!(reclaimed[0]["reason"], "expired");
    assert_eq!(reclaimed[0]["at"], BASE + 3_000);
    let expired = of_kind(&ev, "session_expired");
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0]["session_id"], a.as_str());
    let granted = ev
        .iter()
        .find(|e| e["kind"] == "seat_acquired" && e["token"] == tb)
        .unwrap();
    assert!(reclaimed[0]["seq"].as_u64() < granted["seq"].as_u64());
    assert_eq!(
        metric(&s, "leasehold_seats_reclaimed_total").await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s, "leasehold_seats_in_use{pool=\"p\"}").await,
        Some(1.0)
    );
    // Nothing is left for the reaper.
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    s.stop().await;
}

#[tokio::test]
async fn a_zombie_seat_is_reclaimed_by_the_reaper_and_goes_to_the_first_waiter() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = seat(&s, "p", &a).await;
    let wait_b = spawn_seat(&s, "p", &b, 30_000);
    until_pool_waiting(&s, "p", 1).await;
    let wait_c = spawn_seat(&s, "p", &c, 30_000);
    until_pool_waiting(&s, "p", 2).await;
    s.advance(2_000).await;
    let reaped = s.reap().await;
    assert_eq!(reaped.status, 200, "{}", reaped.text);
    assert_eq!(reaped.body["sessions_ended"], 1);
    let got = answer(wait_b).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let tb = got.body["seat_token"].as_u64().unwrap();
    assert!(tb > ta);
    assert_eq!(holders(&s, "p").await, vec![b.clone()]);
    assert_eq!(pool(&s, "p").await.body["waiting"], 1);
    assert_error(&session(&s, &a).await, 404, "session_gone");
    let ev = all_events(&s).await;
    let reclaimed = of_kind(&ev, "seat_reclaimed");
    assert_eq!(reclaimed.len(), 1);
    assert_eq!(reclaimed[0]["reason"], "expired");
    assert_eq!(reclaimed[0]["token"], ta);
    assert_eq!(
        metric(&s, "leasehold_seats_reclaimed_total").await,
        Some(1.0)
    );
    // C is served when B closes.
    close(&s, &b).await;
    assert_eq!(answer(wait_c).await.status, 200);
    assert_eq!(
        metric(&s, "leasehold_seats_reclaimed_total").await,
        Some(2.0)
    );
    s.stop().await;
}

#[tokio::test]
async fn a_zombie_seat_goes_to_the_first_waiter_not_to_a_newcomer() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let d = s.open("d", 60_000).await;
    seat(&s, "p", &a).await;
    let wait_b = spawn_seat(&s, "p", &b, 30_000);
    until_pool_waiting(&s, "p", 1).await;
    let wait_c = spawn_seat(&s, "p", &c, 30_000);
    until_pool_waiting(&s, "p", 2).await;
    s.advance(2_000).await;
    // A newcomer asks for a seat of the full pool whose holder is a zombie. Whether or not
    // it is granted one, B (first in line) must get the zombie's seat before anyone else.
    let dr = acquire_seat(&s.client, "p", json!({"session_id": d})).await;
    if dr.status == 200 {
        let td = dr.body["seat_token"].as_u64().unwrap();
        assert_eq!(release_seat(&s, "p", &d, td).await.status, 200);
    } else {
        assert_error(&dr, 409, "pool_exhausted");
    }
    let got_b = answer(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    let ev = all_events(&s).await;
    let grants: Vec<&str> = of_kind(&ev, "seat_acquired")
        .iter()
        .map(|e| e["session_id"].as_str().unwrap())
        .collect();
    assert_eq!(grants, [a.as_str(), b.as_str()], "B queued first: {ev:?}");
    assert_eq!(holders(&s, "p").await, vec![b.clone()]);
    assert!(!wait_c.is_finished());
    close(&s, &b).await;
    assert_eq!(answer(wait_c).await.status, 200);
    s.stop().await;
}

#[tokio::test]
async fn zombie_seats_serve_the_waiters_first_and_then_a_newcomer() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 2).await;
    let z1 = s.open("z1", 1_000).await;
    let z2 = s.open("z2", 1_000).await;
    let b = s.open("b", 60_000).await;
    let n = s.open("n", 60_000).await;
    seat(&s, "p", &z1).await;
    seat(&s, "p", &z2).await;
    let wait_b = spawn_seat(&s, "p", &b, 30_000);
    until_pool_waiting(&s, "p", 1).await;
    s.advance(1_000).await;
    // Both holders are zombies: the waiter gets one seat, and the newcomer, asking without
    // waiting, the other. It must not be told the pool is exhausted while a seat is free.
    let got_n = acquire_seat(&s.client, "p", json!({"session_id": n})).await;
    assert_eq!(got_n.status, 200, "{}", got_n.text);
    let got_b = answer(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    assert!(
        got_b.body["seat_token"].as_u64() < got_n.body["seat_token"].as_u64(),
        "the waiter was served first"
    );
    assert_eq!(holders(&s, "p").await, sorted(&[&b, &n]));
    assert_eq!(
        metric(&s, "leasehold_seats_reclaimed_total").await,
        Some(2.0)
    );
    s.stop().await;
}

#[tokio::test]
async fn ending_a_session_reclaims_every_seat_with_its_reason() {
    let s = TestServer::start().await;
    make_pool(&s, "p1", 3).await;
    make_pool(&s, "p2", 3).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta1 = seat(&s, "p1", &a).await;
    let ta2 = seat(&s, "p2", &a).await;
    let tb = seat(&s, "p1", &b).await;
    let mut seats: Vec<Value> = session(&s, &a).await.body["seats"]
        .as_array()
        .unwrap()
        .clone();
    seats.sort_by_key(|v| v["seat_token"].as_u64());
    assert_eq!(
        seats,
        vec![
            json!({"pool": "p1", "seat_token": ta1}),
            json!({"pool": "p2", "seat_token": ta2})
        ]
    );

    let closed = close(&s, &a).await;
    assert_eq!(closed.body["seats_released"], 2);
    assert_eq!(closed.body["released"], 0);
    assert_eq!(closed.body["jobs_settled"], 0);
    assert_eq!(holders(&s, "p1").await, vec![b.clone()]);
    assert_eq!(pool(&s, "p2").await.body["in_use"], 0);
    // Closing again changes nothing.
    let again = close(&s, &a).await;
    assert_eq!(again.body["seats_released"], 0);

    let ended = admin_end(&s, &b).await;
    assert_eq!(ended.body["seats_released"], 1);
    assert_eq!(pool(&s, "p1").await.body["in_use"], 0);

    let ev = all_events(&s).await;
    let reclaimed: Vec<(&str, &str, u64, &str)> = of_kind(&ev, "seat_reclaimed")
        .iter()
        .map(|e| {
            (
                e["session_id"].as_str().unwrap(),
                e["pool"].as_str().unwrap(),
                e["token"].as_u64().unwrap(),
                e["reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(reclaimed.len(), 3, "{ev:?}");
    let mut first_two = reclaimed[..2].to_vec();
    first_two.sort_by_key(|r| r.2);
    assert_eq!(
        first_two,
        [
            (a.as_str(), "p1", ta1, "closed"),
            (a.as_str(), "p2", ta2, "closed")
        ]
    );
    assert_eq!(reclaimed[2], (b.as_str(), "p1", tb, "admin"));
    assert_eq!(
        metric(&s, "leasehold_seats_reclaimed_total").await,
        Some(3.0)
    );
    s.stop().await;
}

#[tokio::test]
async fn deleting_a_pool_in_use_is_409() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 2).await;
    let a = s.open("a", 60_000).await;
    let z = s.open("zombie", 1_000).await;
    let ta = seat(&s, "p", &a).await;
    seat(&s, "p", &z).await;
    let r = s.delete(&pool_path("p")).await;
    assert_error(&r, 409, "pool_in_use");
    assert!(
        r.body["message"].as_str().unwrap().contains('2'),
        "{}",
        r.text
    );
    assert_eq!(pool(&s, "p").await.body["in_use"], 2);
    assert_eq!(release_seat(&s, "p", &a, ta).await.status, 200);
    // A holder past its deadline does not keep the pool alive.
    s.advance(1_000).await;
    let r = s.delete(&pool_path("p")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["deleted"], true);
    assert_error(&pool(&s, "p").await, 404, "pool_not_found");
    let ev = all_events(&s).await;
    assert_eq!(of_kind(&ev, "pool_deleted").len(), 1);
    assert_eq!(of_kind(&ev, "seat_reclaimed")[0]["reason"], "expired");
    assert_error(&session(&s, &z).await, 404, "session_gone");
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Jobs
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn enqueue_claim_complete_round_trip() {
    let s = TestServer::start().await;
    let w = s.open("worker-1", 60_000).await;
    let enq = enqueue_with(
        &s,
        "builds",
        json!({"payload": {"repo": "x"}, "kind": "build"}),
    )
    .await;
    assert_eq!(enq.status, 201, "{}", enq.text);
    assert_eq!(enq.body["queue"], "builds");
    let id = enq.body["job_id"].as_str().unwrap().to_string();
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
    let rev = enq.body["revision"].as_u64().unwrap();

    let queued = job(&s, &id).await;
    assert_eq!(
        queued.body,
        json!({
            "job_id": id,
            "queue": "builds",
            "state": "queued",
            "kind": "build",
            "idempotent": false,
            "attempt": 0,
            "recovery_count": 0,
            "max_recoveries": 3,
            "enqueued_at": BASE,
            "updated_at": BASE,
            "payload": {"repo": "x"},
        })
    );
    assert_eq!(
        queue_info(&s, "builds").await.body,
        json!({"queue": "builds", "queued": 1, "claimed": 0, "done": 0, "failed": 0, "waiting": 0})
    );
    assert_eq!(
        metric(&s, "leasehold_jobs{queue=\"builds\",state=\"queued\"}").await,
        Some(1.0)
    );

    s.advance(20).await;
    let c = claim(&s, "builds", &w).await;
    assert_eq!(c.status, 200, "{}", c.text);
    let token = c.body["token"].as_u64().unwrap();
    assert!(token > rev);
    assert_eq!(
        c.body,
        json!({
            "job_id": id,
            "queue": "builds",
            "token": token,
            "payload": {"repo": "x"},
            "attempt": 1,
            "recovery_count": 0,
            "kind": "build",
            "revision": token,
        })
    );
    let claimed = job(&s, &id).await;
    assert_eq!(claimed.body["state"], "claimed");
    assert_eq!(claimed.body["claimed_by"], w.as_str());
    assert_eq!(claimed.body["token"], token);
    assert_eq!(claimed.body["claimed_at"], BASE + 20);
    assert_eq!(claimed.body["updated_at"], BASE + 20);
    assert_eq!(claimed.body["attempt"], 1);
    assert_eq!(session(&s, &w).await.body["jobs"], json!([id]));
    assert_eq!(counts(&s, "builds").await, (0, 1, 0, 0));
    assert_eq!(
        metric(&s, "leasehold_claim_wait_seconds_count").await,
        Some(1.0)
    );

    s.advance(30).await;
    let done = finish(
        &s,
        &id,
        "complete",
        json!({"session_id": w, "token": token, "result": {"artifacts": [1, 2]}}),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.text);
    assert_eq!(done.body["job_id"], id.as_str());
    assert_eq!(done.body["state"], "done");
    assert!(done.body["revision"].as_u64().unwrap() > token);
    let shown = job(&s, &id).await;
    assert_eq!(shown.body["state"], "done");
    assert_eq!(shown.body["result"], json!({"artifacts": [1, 2]}));
    assert_eq!(shown.body["updated_at"], BASE + 50);
    assert!(shown.body.get("claimed_by").is_none(), "{}", shown.text);
    assert!(shown.body.get("token").is_none(), "{}", shown.text);
    assert_eq!(session(&s, &w).await.body["jobs"], json!([]));
    assert_eq!(counts(&s, "builds").await, (0, 0, 1, 0));
    assert_eq!(listed(&s, "builds", "done").await, vec![id.clone()]);
    assert_eq!(
        metric(&s, "leasehold_jobs{queue=\"builds\",state=\"done\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s, "leasehold_jobs{queue=\"builds\",state=\"claimed\"}").await,
        Some(0.0)
    );
    // Done is final: the same claim cannot finish it again.
    assert_error(&complete(&s, &id, &w, token).await, 409, "stale_token");

    let ev = all_events(&s).await;
    assert_eq!(
        kinds(&ev),
        [
            "session_opened",
            "job_enqueued",
            "job_claimed",
            "job_completed"
        ]
    );
    assert_eq!(ev[1]["job_id"], id.as_str());
    assert_eq!(ev[1]["queue"], "builds");
    assert!(ev[1].get("token").is_none());
    assert_eq!(ev[2]["session_id"], w.as_str());
    assert_eq!(ev[2]["token"], token);
    assert_eq!(ev[2]["job_id"], id.as_str());
    assert_eq!(ev[3]["session_id"], w.as_str());
    assert_eq!(ev[3]["token"], token);
    assert_eq!(ev[3]["queue"], "builds");
    s.stop().await;
}

#[tokio::test]
async fn a_complete_without_result_and_defaults() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let id = enqueue(&s, "q", json!({"payload": null})).await;
    let c = claim(&s, "q", &w).await;
    assert_eq!(c.body["kind"], Value::Null);
    assert_eq!(c.body["payload"], Value::Null);
    let token = c.body["token"].as_u64().unwrap();
    let done = complete(&s, &id, &w, token).await;
    assert_eq!(done.status, 200, "{}", done.text);
    let shown = job(&s, &id).await;
    assert_eq!(shown.body["state"], "done");
    assert_eq!(shown.body["result"], Value::Null);
    assert_eq!(shown.body["kind"], Value::Null);
    s.stop().await;
}

#[tokio::test]
async fn a_worker_fail_records_its_reason() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let j1 = enqueue(&s, "q", json!({"payload": 1, "idempotent": true})).await;
    let j2 = enqueue(&s, "q", json!({"payload": 2})).await;
    let (c1, t1) = claim_job(&s, "q", &w).await;
    assert_eq!(c1, j1);
    let r = finish(
        &s,
        &j1,
        "fail",
        json!({"session_id": w, "token": t1, "reason": "disk full"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.body,
        json!({"job_id": j1, "state": "failed", "revision": r.body["revision"]})
    );
    let (c2, t2) = claim_job(&s, "q", &w).await;
    assert_eq!(c2, j2);
    let r = finish(&s, &j2, "fail", json!({"session_id": w, "token": t2})).await;
    assert_eq!(r.status, 200, "{}", r.text);

    let f1 = job(&s, &j1).await;
    assert_eq!(f1.body["state"], "failed");
    assert_eq!(f1.body["failure_reason"], "disk full");
    // A worker's own failure is final even for an idempotent job: no recovery.
    assert_eq!(f1.body["recovery_count"], 0);
    assert_eq!(
        job(&s, &j2).await.body["failure_reason"],
        "failed by worker"
    );
    assert_eq!(counts(&s, "q").await, (0, 0, 0, 2));
    let mut failed = listed(&s, "q", "failed").await;
    failed.sort();
    assert_eq!(failed, sorted(&[&j1, &j2]));
    // No claim gets a failed job.
    assert_eq!(claim(&s, "q", &w).await.status, 204);

    let ev = all_events(&s).await;
    let fails = of_kind(&ev, "job_failed");
    assert_eq!(fails.len(), 2);
    assert_eq!(fails[0]["job_id"], j1.as_str());
    assert_eq!(fails[0]["reason"], "disk full");
    assert_eq!(fails[0]["session_id"], w.as_str());
    assert_eq!(fails[0]["token"], t1);
    assert_eq!(fails[1]["reason"], "failed by worker");
    assert_eq!(
        metric(&s, "leasehold_jobs{queue=\"q\",state=\"failed\"}").await,
        Some(2.0)
    );
    s.stop().await;
}

#[tokio::test]
async fn a_worker_fail_is_counted_in_jobs_failed_total() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let j = enqueue(&s, "q", json!({"payload": 1})).await;
    let (_, t) = claim_job(&s, "q", &w).await;
    let r = finish(
        &s,
        &j,
        "fail",
        json!({"session_id": w, "token": t, "reason": "disk full"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        metric(&s, "leasehold_jobs_failed_total{reason=\"worker\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s, "leasehold_jobs_failed_total{reason=\"not_idempotent\"}").await,
        None
    );
    s.stop().await;
}

#[tokio::test]
async fn job_errors() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let other = s.open("other", 60_000).await;
    let gone = s.open("gone", 60_000).await;
    close(&s, &gone).await;
    let queued = enqueue(&s, "q", json!({"payload": 0})).await;
    let id = enqueue(&s, "q", json!({"payload": 1})).await;
    let (first, _) = claim_job(&s, "q", &w).await;
    assert_eq!(first, queued, "first in, first out");
    let (second, token) = claim_job(&s, "q", &w).await;
    assert_eq!(second, id);
    // Put the first back so one job is queued while the other is claimed.
    let back = finish(
        &s,
        &queued,
        "release",
        json!({"session_id": w, "token": job(&s, &queued).await.body["token"]}),
    )
    .await;
    assert_eq!(back.status, 200, "{}", back.text);

    let before_job = job(&s, &id).await.body;
    let before_events = all_events(&s).await;
    for action in ["complete", "fail", "release"] {
        // Unknown job.
        let r = finish(
            &s,
            &random_id(),
            action,
            json!({"session_id": w, "token": token}),
        )
        .await;
        assert_error(&r, 404, "job_not_found");
        // Not the current claim: a wrong token, another session, a gone session.
        for (who, t) in [
            (&w, token + 1),
            (&w, token - 1),
            (&other, token),
            (&gone, token),
        ] {
            let r = finish(&s, &id, action, json!({"session_id": who, "token": t})).await;
            assert_error(&r, 409, "stale_token");
        }
        // A job that is queued has no current claim at all.
        let r = finish(
            &s,
            &queued,
            action,
            json!({"session_id": w, "token": token}),
        )
        .await;
        assert_error(&r, 409, "stale_token");
        // Bad job id in the path, bad session id or token in the body.
        assert_invalid(
            &finish(
                &s,
                "not-a-job",
                action,
                json!({"session_id": w, "token": token}),
            )
            .await,
            "job_id",
        );
        assert_invalid(
            &finish(
                &s,
                &id,
                action,
                json!({"session_id": "nope", "token": token}),
            )
            .await,
            "session_id",
        );
        assert_invalid(
            &finish(&s, &id, action, json!({"session_id": w, "token": "x"})).await,
            "token",
        );
        assert_invalid_mentions(
            &finish(&s, &id, action, json!({"session_id": w})).await,
            "token",
        );
    }
    // None of it changed anything.
    assert_eq!(job(&s, &id).await.body, before_job);
    assert_eq!(all_events(&s).await, before_events);
    assert_error(
        &s.get(&format!("/v1/jobs/{}", random_id())).await,
        404,
        "job_not_found",
    );
    assert_invalid(&s.get("/v1/jobs/123").await, "job_id");

    // Claims by a gone, unknown or malformed session.
    assert_error(&claim(&s, "q", &gone).await, 404, "session_gone");
    assert_error(&claim(&s, "q", &random_id()).await, 404, "session_gone");
    assert_invalid(&claim(&s, "q", "nope").await, "session_id");
    assert_invalid(
        &claim_with(&s.client, "q", json!({"session_id": w, "wait_ms": "x"})).await,
        "wait_ms",
    );
    assert_eq!(counts(&s, "q").await, (1, 1, 0, 0));

    // Requeue needs a failed job.
    assert_error(&requeue(&s, &id).await, 409, "job_not_failed");
    assert_error(&requeue(&s, &queued).await, 409, "job_not_failed");
    assert_error(&requeue(&s, &random_id()).await, 404, "job_not_found");
    assert_invalid(&requeue(&s, "zzz").await, "job_id");
    assert_eq!(all_events(&s).await, before_events);
    // The right claim still finishes it.
    assert_eq!(complete(&s, &id, &w, token).await.status, 200);
    s.stop().await;
}

#[tokio::test]
async fn claim_with_no_job_is_204() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let r = claim(&s, "empty", &w).await;
    assert_eq!(r.status, 204, "{}", r.text);
    assert!(r.text.is_empty(), "{}", r.text);
    let r = claim_with(&s.client, "empty", json!({"session_id": w, "wait_ms": 0})).await;
    assert_eq!(r.status, 204, "{}", r.text);
    // A queue nobody used reads as empty.
    assert_eq!(
        queue_info(&s, "empty").await.body,
        json!({"queue": "empty", "queued": 0, "claimed": 0, "done": 0, "failed": 0, "waiting": 0})
    );
    // All jobs taken: 204 again.
    enqueue(&s, "q", json!({"payload": 1})).await;
    assert_eq!(claim(&s, "q", &w).await.status, 200);
    assert_eq!(claim(&s, "q", &w).await.status, 204);
    assert_eq!(
        metric(&s, "leasehold_claim_wait_seconds_count").await,
        Some(1.0),
        "only claims that got a job are timed"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_claim_waits_for_an_enqueue() {
    let s = TestServer::start().await;
    let w1 = s.open("w1", 60_000).await;
    let w2 = s.open("w2", 60_000).await;
    let wait1 = spawn_claim(&s, "q", &w1, 30_000);
    until_queue_waiting(&s, "q", 1).await;
    let wait2 = spawn_claim(&s, "q", &w2, 30_000);
    until_queue_waiting(&s, "q", 2).await;
    assert!(!wait1.is_finished());

    // Enqueued from another task while both wait: the first waiter gets it.
    let c = s.client.clone();
    let producer = tokio::spawn(async move {
        c.post("/v1/queues/q/jobs", &json!({"payload": {"n": 1}}))
            .await
            .unwrap()
    });
    let enq = answer(producer).await;
    assert_eq!(enq.status, 201, "{}", enq.text);
    let got = answer(wait1).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.body["job_id"], enq.body["job_id"]);
    assert_eq!(got.body["payload"], json!({"n": 1}));
    assert_eq!(got.body["attempt"], 1);
    let id = got.body["job_id"].as_str().unwrap().to_string();
    assert_eq!(job(&s, &id).await.body["claimed_by"], w1.as_str());
    assert_eq!(queue_info(&s, "q").await.body["waiting"], 1);
    assert!(!wait2.is_finished());

    // The second waiter gets the next one.
    let id2 = enqueue(&s, "q", json!({"payload": 2})).await;
    let got2 = answer(wait2).await;
    assert_eq!(got2.body["job_id"], id2.as_str());
    assert_eq!(queue_info(&s, "q").await.body["waiting"], 0);
    assert_eq!(counts(&s, "q").await, (0, 2, 0, 0));
    s.stop().await;
}

#[tokio::test]
async fn a_claim_waiter_whose_session_ended_is_skipped() {
    let s = TestServer::start().await;
    let w1 = s.open("w1", 60_000).await;
    let w2 = s.open("w2", 60_000).await;
    let wait1 = spawn_claim(&s, "q", &w1, 30_000);
    until_queue_waiting(&s, "q", 1).await;
    let wait2 = spawn_claim(&s, "q", &w2, 30_000);
    until_queue_waiting(&s, "q", 2).await;
    close(&s, &w1).await;
    let id = enqueue(&s, "q", json!({"payload": 1})).await;
    assert_error(&answer(wait1).await, 404, "session_gone");
    let got = answer(wait2).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.body["job_id"], id.as_str());
    assert_eq!(job(&s, &id).await.body["claimed_by"], w2.as_str());
    assert_eq!(counts(&s, "q").await, (0, 1, 0, 0));
    s.stop().await;
}

#[tokio::test]
async fn concurrent_claims_hand_each_job_out_once() {
    let s = TestServer::start().await;
    let mut jobs = Vec::new();
    for i in 0..5 {
        jobs.push(enqueue(&s, "q", json!({"payload": i})).await);
    }
    let mut workers = Vec::new();
    for i in 0..12 {
        workers.push(s.open(&format!("w{i}"), 60_000).await);
    }
    let tasks: Vec<_> = workers.iter().map(|w| spawn_claim(&s, "q", w, 0)).collect();
    let mut got = Vec::new();
    let mut empty = 0;
    for (w, t) in workers.iter().zip(tasks) {
        let r = answer(t).await;
        match r.status.as_u16() {
            200 => {
                let id = r.body["job_id"].as_str().unwrap().to_string();
                assert_eq!(job(&s, &id).await.body["claimed_by"], w.as_str());
                got.push(id);
            }
            204 => empty += 1,
            other => panic!("unexpected {other}: {}", r.text),
        }
    }
    got.sort();
    jobs.sort();
    assert_eq!(got, jobs, "every job exactly once");
    assert_eq!(empty, 7);
    assert_eq!(counts(&s, "q").await, (0, 5, 0, 0));
    s.stop().await;
}

#[tokio::test]
async fn a_waiting_claim_times_out_with_204() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let wait = spawn_claim(&s, "q", &w, 2_000);
    until_queue_waiting(&s, "q", 1).await;
    s.advance(1_999).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    until_queue_waiting(&s, "q", 1).await;
    assert!(!wait.is_finished());
    s.advance(1).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    let r = answer(wait).await;
    assert_eq!(r.status, 204, "{}", r.text);
    assert_eq!(queue_info(&s, "q").await.body["waiting"], 0);
    // A job enqueued later stays queued for the next claim.
    let id = enqueue(&s, "q", json!({"payload": 1})).await;
    assert_eq!(job(&s, &id).await.body["state"], "queued");
    s.stop().await;
}

#[tokio::test]
async fn a_recovered_job_goes_to_its_new_claimant_and_the_old_worker_is_fenced_off() {
    let s = TestServer::start().await;
    let w1 = s.open("w1", 2_000).await;
    let w2 = s.open("w2", 60_000).await;
    let id = enqueue(&s, "q", json!({"payload": {"scan": 7}, "idempotent": true})).await;
    let c1 = claim(&s, "q", &w1).await;
    let t1 = c1.body["token"].as_u64().unwrap();
    assert_eq!(c1.body["attempt"], 1);
    // Nothing to take while it is claimed.
    assert_eq!(claim(&s, "q", &w2).await.status, 204);

    // The worker dies: it stops heartbeating and is reaped.
    s.advance(2_000).await;
    let reaped = s.reap().await;
    assert_eq!(reaped.body["sessions_ended"], 1, "{}", reaped.text);
    let recovered = job(&s, &id).await;
    assert_eq!(recovered.body["state"], "queued");
    assert_eq!(recovered.body["recovery_count"], 1);
    assert_eq!(recovered.body["attempt"], 1);
    assert!(recovered.body.get("claimed_by").is_none());
    assert_eq!(counts(&s, "q").await, (1, 0, 0, 0));
    let ev = all_events(&s).await;
    let rec = of_kind(&ev, "job_recovered");
    assert_eq!(rec.len(), 1);
    assert_eq!(rec[0]["job_id"], id.as_str());
    assert_eq!(rec[0]["session_id"], w1.as_str());
    assert_eq!(rec[0]["queue"], "q");
    assert_eq!(
        rec[0]["token"], t1,
        "the event names the claim that was lost"
    );
    assert_eq!(
        metric(&s, "leasehold_jobs_recovered_total").await,
        Some(1.0)
    );

    // The new claimant gets it with a higher token.
    let c2 = claim(&s, "q", &w2).await;
    assert_eq!(c2.status, 200, "{}", c2.text);
    assert_eq!(c2.body["job_id"], id.as_str());
    assert_eq!(c2.body["attempt"], 2);
    assert_eq!(c2.body["recovery_count"], 1);
    assert_eq!(c2.body["payload"], json!({"scan": 7}));
    let t2 = c2.body["token"].as_u64().unwrap();
    assert!(t2 > t1);

    // The old worker comes back late: every finish is refused and changes nothing.
    let before = job(&s, &id).await.body;
    assert_error(&complete(&s, &id, &w1, t1).await, 409, "stale_token");
    assert_error(
        &finish(&s, &id, "fail", json!({"session_id": w1, "token": t1})).await,
        409,
        "stale_token",
    );
    assert_error(
        &finish(&s, &id, "release", json!({"session_id": w1, "token": t1})).await,
        409,
        "stale_token",
    );
    // Even with the new claimant's session id, the old token is stale.
    assert_error(&complete(&s, &id, &w2, t1).await, 409, "stale_token");
    assert_eq!(job(&s, &id).await.body, before);

    let done = finish(
        &s,
        &id,
        "complete",
        json!({"session_id": w2, "token": t2, "result": "ok"}),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.text);
    let shown = job(&s, &id).await;
    assert_eq!(shown.body["state"], "done");
    assert_eq!(shown.body["result"], "ok");
    assert_eq!(counts(&s, "q").await, (0, 0, 1, 0));
    let completed = of_kind(&all_events(&s).await, "job_completed")
        .into_iter()
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0]["session_id"], w2.as_str());
    assert_eq!(completed[0]["token"], t2);
    s.stop().await;
}

#[tokio::test]
async fn a_late_worker_past_its_deadline_cannot_finish_and_its_job_is_recovered() {
    let s = TestServer::start().await;
    let w = s.open("w", 1_000).await;
    let id = enqueue(&s, "q", json!({"payload": 1, "idempotent": true})).await;
    let (_, t) = claim_job(&s, "q", &w).await;
    s.advance(1_000).await;
    // No reap: the worker is past its deadline, so its claim is gone.
    assert_error(&complete(&s, &id, &w, t).await, 409, "stale_token");
    let shown = job(&s, &id).await;
    assert_eq!(shown.body["state"], "queued");
    assert_eq!(shown.body["recovery_count"], 1);
    assert_error(&session(&s, &w).await, 404, "session_gone");
    assert_eq!(of_kind(&all_events(&s).await, "job_recovered").len(), 1);
    assert_error(&claim(&s, "q", &w).await, 404, "session_gone");
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    s.stop().await;
}

#[tokio::test]
async fn a_non_idempotent_job_fails_when_its_worker_dies() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let w2 = s.open("w2", 60_000).await;
    let id = enqueue(&s, "q", json!({"payload": {"charge": 10}})).await;
    assert_eq!(job(&s, &id).await.body["idempotent"], false);
    let (_, t) = claim_job(&s, "q", &w).await;
    let closed = close(&s, &w).await;
    assert_eq!(closed.body["jobs_settled"], 1);
    assert_eq!(closed.body["seats_released"], 0);
    assert_eq!(closed.body["released"], 0);
    assert!(closed.body["revision"].as_u64().unwrap() > t);
    let shown = job(&s, &id).await;
    assert_eq!(shown.body["state"], "failed");
    assert_eq!(shown.body["failure_reason"], "not_idempotent");
    assert_eq!(shown.body["recovery_count"], 0);
    assert_eq!(counts(&s, "q").await, (0, 0, 0, 1));
    assert_eq!(listed(&s, "q", "failed").await, vec![id.clone()]);
    // It is not run again.
    assert_eq!(claim(&s, "q", &w2).await.status, 204);
    let ev = all_events(&s).await;
    let failed = of_kind(&ev, "job_failed");
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["job_id"], id.as_str());
    assert_eq!(failed[0]["reason"], "not_idempotent");
    assert_eq!(failed[0]["session_id"], w.as_str());
    assert_eq!(failed[0]["token"], t);
    assert!(of_kind(&ev, "job_recovered").is_empty());
    assert_eq!(
        metric(&s, "leasehold_jobs_failed_total{reason=\"not_idempotent\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s, "leasehold_jobs_recovered_total").await,
        Some(0.0)
    );
    s.stop().await;
}

#[tokio::test]
async fn the_recovery_cap_fails_a_job_and_an_admin_requeue_sends_it_back() {
    let s = TestServer::start().await;
    let id = enqueue(
        &s,
        "q",
        json!({"payload": "p", "idempotent": true, "max_recoveries": 1}),
    )
    .await;
    assert_eq!(job(&s, &id).await.body["max_recoveries"], 1);
    // First worker death (an operator ends its session): recovered.
    let w1 = s.open("w1", 60_000).await;
    let (_, t1) = claim_job(&s, "q", &w1).await;
    let ended = admin_end(&s, &w1).await;
    assert_eq!(ended.body["jobs_settled"], 1);
    let shown = job(&s, &id).await;
    assert_eq!(shown.body["state"], "queued");
    assert_eq!(shown.body["recovery_count"], 1);
    // Second worker death (it closes without finishing): the cap is reached, it fails.
    let w2 = s.open("w2", 60_000).await;
    let c2 = claim(&s, "q", &w2).await;
    assert_eq!(c2.body["recovery_count"], 1);
    assert_eq!(c2.body["attempt"], 2);
    let t2 = c2.body["token"].as_u64().unwrap();
    close(&s, &w2).await;
    let shown = job(&s, &id).await;
    assert_eq!(shown.body["state"], "failed");
    assert_eq!(shown.body["failure_reason"], "max_recoveries_exceeded");
    assert_eq!(shown.body["recovery_count"], 1);
    assert_eq!(counts(&s, "q").await, (0, 0, 0, 1));

    // It is a dead letter.
    let list = s.get("/v1/queues/q/jobs?state=failed").await;
    assert_eq!(list.status, 200, "{}", list.text);
    let jobs = list.body["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0]["job_id"], id.as_str());
    assert_eq!(jobs[0]["failure_reason"], "max_recoveries_exceeded");
    assert_eq!(list.body["next"], Value::Null);
    // Failed is the default state of the list.
    assert_eq!(s.get("/v1/queues/q/jobs").await.body, list.body);

    let ev = all_events(&s).await;
    let failed = of_kind(&ev, "job_failed");
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["reason"], "max_recoveries_exceeded");
    assert_eq!(failed[0]["session_id"], w2.as_str());
    assert_eq!(failed[0]["token"], t2);
    let recovered = of_kind(&ev, "job_recovered");
    assert_eq!(recovered.len(), 1);
    assert_eq!(recovered[0]["token"], t1);
    assert_eq!(
        metric(
            &s,
            "leasehold_jobs_failed_total{reason=\"max_recoveries_exceeded\"}"
        )
        .await,
        Some(1.0)
    );

    // An operator sends it back: queued, recovery count reset, and a claim gets it.
    let r = requeue(&s, &id).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["job_id"], id.as_str());
    assert_eq!(r.body["state"], "queued");
    assert!(r.body["revision"].as_u64().unwrap() > t2);
    let shown = job(&s, &id).await;
    assert_eq!(shown.body["state"], "queued");
    assert_eq!(shown.body["recovery_count"], 0);
    assert!(shown.body.get("failure_reason").is_none(), "{}", shown.text);
    assert_eq!(listed(&s, "q", "failed").await, Vec::<String>::new());
    assert_eq!(listed(&s, "q", "queued").await, vec![id.clone()]);
    let requeued = of_kind(&all_events(&s).await, "job_requeued")
        .into_iter()
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(requeued.len(), 1);
    assert_eq!(requeued[0]["job_id"], id.as_str());
    assert_eq!(requeued[0]["queue"], "q");
    let w3 = s.open("w3", 60_000).await;
    let c3 = claim(&s, "q", &w3).await;
    assert_eq!(c3.status, 200, "{}", c3.text);
    assert_eq!(c3.body["job_id"], id.as_str());
    assert_eq!(c3.body["attempt"], 3);
    assert_eq!(c3.body["recovery_count"], 0);
    // Requeued twice? Only a failed job can be.
    assert_error(&requeue(&s, &id).await, 409, "job_not_failed");
    // Its recoveries start over: the next death recovers it again.
    admin_end(&s, &w3).await;
    assert_eq!(job(&s, &id).await.body["state"], "queued");
    s.stop().await;
}

#[tokio::test]
async fn a_requeued_job_goes_to_the_tail_of_its_queue() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let j1 = enqueue(&s, "q", json!({"payload": 1})).await;
    let (_, t) = claim_job(&s, "q", &w).await;
    let r = finish(&s, &j1, "fail", json!({"session_id": w, "token": t})).await;
    assert_eq!(r.status, 200);
    let j2 = enqueue(&s, "q", json!({"payload": 2})).await;
    assert_eq!(requeue(&s, &j1).await.status, 200);
    assert_eq!(counts(&s, "q").await, (2, 0, 0, 0));
    assert_eq!(claim_job(&s, "q", &w).await.0, j2);
    let again = claim(&s, "q", &w).await;
    assert_eq!(again.body["job_id"], j1.as_str());
    assert_eq!(again.body["attempt"], 2);
    s.stop().await;
}

#[tokio::test]
async fn a_recovered_job_goes_to_the_head_of_its_queue() {
    let s = TestServer::start().await;
    let j1 = enqueue(&s, "q", json!({"payload": 1, "idempotent": true})).await;
    let j2 = enqueue(&s, "q", json!({"payload": 2, "idempotent": true})).await;
    let w1 = s.open("w1", 1_000).await;
    let w2 = s.open("w2", 60_000).await;
    let (c, _) = claim_job(&s, "q", &w1).await;
    assert_eq!(c, j1);
    s.advance(1_000).await;
    s.reap().await;
    assert_eq!(counts(&s, "q").await, (2, 0, 0, 0));
    let j3 = enqueue(&s, "q", json!({"payload": 3})).await;
    // j1 comes back before j2, which was enqueued before j1 was recovered.
    assert_eq!(claim_job(&s, "q", &w2).await.0, j1);
    assert_eq!(claim_job(&s, "q", &w2).await.0, j2);
    assert_eq!(claim_job(&s, "q", &w2).await.0, j3);
    assert_eq!(claim(&s, "q", &w2).await.status, 204);
    s.stop().await;
}

#[tokio::test]
async fn release_hands_a_job_back_without_counting_a_recovery() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let j1 = enqueue(
        &s,
        "q",
        json!({"payload": 1, "idempotent": true, "max_recoveries": 0}),
    )
    .await;
    let j2 = enqueue(&s, "q", json!({"payload": 2})).await;
    let (c, t) = claim_job(&s, "q", &w).await;
    assert_eq!(c, j1);
    let r = finish(&s, &j1, "release", json!({"session_id": w, "token": t})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["state"], "queued");
    assert_eq!(r.body["job_id"], j1.as_str());
    let shown = job(&s, &j1).await;
    assert_eq!(shown.body["state"], "queued");
    assert_eq!(shown.body["recovery_count"], 0);
    assert_eq!(shown.body["attempt"], 1);
    assert!(shown.body.get("claimed_by").is_none());
    assert_eq!(session(&s, &w).await.body["jobs"], json!([]));
    assert_eq!(counts(&s, "q").await, (2, 0, 0, 0));
    // The released token is spent.
    assert_error(&complete(&s, &j1, &w, t).await, 409, "stale_token");
    // Handed back to the head: the next claim gets it again, as a new attempt.
    let again = claim(&s, "q", &w).await;
    assert_eq!(again.body["job_id"], j1.as_str());
    assert_eq!(again.body["attempt"], 2);
    assert_eq!(again.body["recovery_count"], 0);
    let t2 = again.body["token"].as_u64().unwrap();
    assert!(t2 > t);
    assert_eq!(complete(&s, &j1, &w, t2).await.status, 200);
    assert_eq!(claim_job(&s, "q", &w).await.0, j2);

    let ev = all_events(&s).await;
    let rel = of_kind(&ev, "job_released");
    assert_eq!(rel.len(), 1);
    assert_eq!(rel[0]["job_id"], j1.as_str());
    assert_eq!(rel[0]["session_id"], w.as_str());
    assert_eq!(rel[0]["token"], t);
    assert!(of_kind(&ev, "job_recovered").is_empty());
    assert_eq!(
        metric(&s, "leasehold_jobs_recovered_total").await,
        Some(0.0)
    );
    s.stop().await;
}

#[tokio::test]
async fn payload_round_trips_and_its_size_is_limited() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let payload = json!({
        "repo": "git@example.com:x/y.git",
        "steps": [{"run": "make", "env": {"CC": "clang", "J": 8}}, {"run": "test"}],
        "flags": [true, false, null],
        "n": -12345678901234_i64,
        "ratio": 0.25,
        "unicode": "数据库 ✓ \"quoted\" \\ back",
        "empty": {},
    });
    let id = enqueue(&s, "q", json!({"payload": payload, "kind": "ci/build"})).await;
    assert_eq!(job(&s, &id).await.body["payload"], payload);
    let c = claim(&s, "q", &w).await;
    assert_eq!(c.body["payload"], payload);
    assert_eq!(c.body["kind"], "ci/build");
    for scalar in [json!(42), json!("text"), json!([1, [2, [3]]])] {
        let id = enqueue(&s, "scalars", json!({"payload": scalar})).await;
        assert_eq!(job(&s, &id).await.body["payload"], scalar);
    }
    // A payload of 70 KiB: the job routes read it, and refuse it by its own rule.
    let r = enqueue_with(&s, "q", json!({"payload": "x".repeat(70 * 1024)})).await;
    assert_invalid(&r, "payload");
    assert_eq!(counts(&s, "q").await, (0, 1, 0, 0));
    s.stop().await;
}

#[tokio::test]
async fn a_payload_or_result_over_64_kib_is_refused() {
    let s = TestServer::start().await;
    assert_eq!(s.config.max_body_bytes, 64 * 1024);
    // A JSON string of n characters is n + 2 bytes of payload: exactly 64 KiB is accepted.
    let at_limit = "x".repeat(64 * 1024 - 2);
    let id = enqueue(&s, "q", json!({"payload": at_limit})).await;
    assert_eq!(job(&s, &id).await.body["payload"], at_limit.as_str());
    let w = s.open("w", 60_000).await;
    let c = claim(&s, "q", &w).await;
    assert_eq!(c.body["payload"], at_limit.as_str());
    let t = c.body["token"].as_u64().unwrap();
    // One byte more is refused, naming the payload.
    let over = "x".repeat(64 * 1024 - 1);
    assert_invalid(
        &enqueue_with(&s, "q", json!({"payload": over})).await,
        "payload",
    );
    // Far more is over the body limit: 413 before anything is parsed.
    let huge = "x".repeat(256 * 1024);
    let r = enqueue_with(&s, "q", json!({"payload": huge})).await;
    assert_error(&r, 413, "payload_too_large");
    // The result has the same limit.
    let r = finish(
        &s,
        &id,
        "complete",
        json!({"session_id": w, "token": t, "result": "y".repeat(64 * 1024)}),
    )
    .await;
    assert_invalid(&r, "result");
    assert_eq!(job(&s, &id).await.body["state"], "claimed");
    // Routes without a payload keep the server's body limit.
    let r = put_pool(
        &s,
        "p",
        json!({"capacity": 1, "metadata": {"k": "v".repeat(70 * 1024)}}),
    )
    .await;
    assert_error(&r, 413, "payload_too_large");
    assert_eq!(counts(&s, "q").await, (0, 1, 0, 0));
    assert_eq!(of_kind(&all_events(&s).await, "job_enqueued").len(), 1);
    s.stop().await;
}

#[tokio::test]
async fn job_bad_input_is_400_naming_the_field() {
    let s = TestServer::start().await;
    let enq = |body: Value| enqueue_with(&s, "q", body);
    assert_invalid(
        &enq(json!({"payload": 1, "max_recoveries": 1_001})).await,
        "max_recoveries",
    );
    assert_invalid(
        &enq(json!({"payload": 1, "max_recoveries": -1})).await,
        "max_recoveries",
    );
    assert_invalid(
        &enq(json!({"payload": 1, "idempotent": "yes"})).await,
        "idempotent",
    );
    assert_invalid(
        &enq(json!({"payload": 1, "kind": "k".repeat(257)})).await,
        "kind",
    );
    assert_invalid(&enq(json!({"payload": 1, "kind": "a\nb"})).await, "kind");
    assert_invalid(&enq(json!({"payload": 1, "kind": 5})).await, "kind");
    assert_invalid_mentions(&enq(json!({})).await, "payload");
    assert_invalid(
        &s.post("/v1/queues/bad%0Aname/jobs", json!({"payload": 1}))
            .await,
        "queue",
    );
    assert_eq!(counts(&s, "q").await, (0, 0, 0, 0));
    assert!(all_events(&s).await.is_empty());
    // The boundaries are accepted.
    let ok = enq(json!({"payload": 1, "max_recoveries": 1_000, "kind": "k".repeat(256)})).await;
    assert_eq!(ok.status, 201, "{}", ok.text);

    assert_invalid(&list_query(&s, "state=bogus").await, "state");
    assert_invalid(&list_query(&s, "limit=0").await, "limit");
    assert_invalid(&list_query(&s, "limit=1001").await, "limit");
    assert_invalid(&list_query(&s, "limit=x").await, "limit");
    assert_invalid(&list_query(&s, "after=not-a-job").await, "after");
    assert_error(&list_query(&s, "colour=red").await, 400, "invalid_request");
    assert_eq!(list_query(&s, "state=queued&limit=1000").await.status, 200);
    s.stop().await;
}

#[tokio::test]
async fn job_lists_page_by_cursor() {
    let s = TestServer::start().await;
    let w = s.open("w", 60_000).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let id = enqueue(&s, "q", json!({"payload": i})).await;
        let (c, t) = claim_job(&s, "q", &w).await;
        assert_eq!(c, id);
        let r = finish(&s, &id, "fail", json!({"session_id": w, "token": t})).await;
        assert_eq!(r.status, 200);
        ids.push(id);
    }
    // Another queue's failures are not listed.
    let other = enqueue(&s, "other", json!({"payload": 0})).await;
    let (_, t) = claim_job(&s, "other", &w).await;
    finish(&s, &other, "fail", json!({"session_id": w, "token": t})).await;
    ids.sort();

    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let q = match &after {
            Some(a) => format!("/v1/queues/q/jobs?state=failed&limit=2&after={a}"),
            None => "/v1/queues/q/jobs?state=failed&limit=2".to_string(),
        };
        let r = s.get(&q).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let page: Vec<String> = r.body["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| {
                assert_eq!(j["state"], "failed");
                assert!(j.get("payload").is_none(), "lists carry no payload: {j}");
                j["job_id"].as_str().unwrap().to_string()
            })
            .collect();
        assert!(page.len() <= 2);
        seen.extend(page.clone());
        pages += 1;
        assert!(pages <= 5);
        match r.body["next"].as_str() {
            Some(n) => {
                assert_eq!(Some(n), page.last().map(String::as_str));
                after = Some(n.to_string());
            }
            None => break,
        }
    }
    assert_eq!(seen, ids, "every failed job once, in id order");
    assert_eq!(listed(&s, "q", "queued").await, Vec::<String>::new());
    assert_eq!(listed(&s, "q", "claimed").await, Vec::<String>::new());
    s.stop().await;
}

#[tokio::test]
async fn finished_jobs_are_purged_after_their_retention() {
    let s = TestServer::start_with(|c| c.job_retention_ms = 10_000).await;
    let w = s.open("w", 600_000).await;
    let done = enqueue(&s, "q", json!({"payload": "d"})).await;
    let failed = enqueue(&s, "q", json!({"payload": "f"})).await;
    let (_, t) = claim_job(&s, "q", &w).await;
    assert_eq!(complete(&s, &done, &w, t).await.status, 200);
    let (_, t) = claim_job(&s, "q", &w).await;
    let r = finish(&s, &failed, "fail", json!({"session_id": w, "token": t})).await;
    assert_eq!(r.status, 200);
    let queued = enqueue(&s, "q", json!({"payload": "q"})).await;
    s.advance(9_999).await;
    s.reap().await;
    assert_eq!(counts(&s, "q").await, (1, 0, 1, 1), "not yet");
    s.advance(2).await;
    s.reap().await;
    assert_error(
        &s.get(&format!("/v1/jobs/{done}")).await,
        404,
        "job_not_found",
    );
    assert_error(
        &s.get(&format!("/v1/jobs/{failed}")).await,
        404,
        "job_not_found",
    );
    assert_error(&requeue(&s, &failed).await, 404, "job_not_found");
    assert_eq!(counts(&s, "q").await, (1, 0, 0, 0));
    assert_eq!(listed(&s, "q", "done").await, Vec::<String>::new());
    assert_eq!(listed(&s, "q", "failed").await, Vec::<String>::new());
    // Unfinished jobs are kept, however old.
    assert_eq!(job(&s, &queued).await.body["state"], "queued");
    assert_eq!(claim_job(&s, "q", &w).await.0, queued);
    s.stop().await;
}

#[tokio::test]
async fn purged_jobs_leave_the_job_gauges() {
    let s = TestServer::start_with(|c| c.job_retention_ms = 10_000).await;
    let w = s.open("w", 600_000).await;
    let id = enqueue(&s, "q", json!({"payload": 1})).await;
    let (_, t) = claim_job(&s, "q", &w).await;
    assert_eq!(complete(&s, &id, &w, t).await.status, 200);
    assert_eq!(
        metric(&s, "leasehold_jobs{queue=\"q\",state=\"done\"}").await,
        Some(1.0)
    );
    s.advance(10_001).await;
    s.reap().await;
    assert_eq!(counts(&s, "q").await, (0, 0, 0, 0));
    let gauge = metric(&s, "leasehold_jobs{queue=\"q\",state=\"done\"}").await;
    assert!(gauge.is_none() || gauge == Some(0.0), "{gauge:?}");
    s.stop().await;
}

#[tokio::test]
async fn a_seat_holder_past_its_deadline_cannot_release_and_its_seat_is_reclaimed() {
    let s = TestServer::start().await;
    make_pool(&s, "p", 1).await;
    let a = s.open("a", 1_000).await;
    let ta = seat(&s, "p", &a).await;
    s.advance(1_000).await;
    assert_error(&release_seat(&s, "p", &a, ta).await, 409, "not_holder");
    assert_eq!(pool(&s, "p").await.body["in_use"], 0);
    let ev = all_events(&s).await;
    assert!(of_kind(&ev, "seat_released").is_empty());
    let reclaimed = of_kind(&ev, "seat_reclaimed");
    assert_eq!(reclaimed.len(), 1);
    assert_eq!(reclaimed[0]["reason"], "expired");
    assert_eq!(reclaimed[0]["token"], ta);
    // And it cannot take one again.
    assert_error(
        &acquire_seat(&s.client, "p", json!({"session_id": a})).await,
        404,
        "session_gone",
    );
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// The reaper's dry run
// ---------------------------------------------------------------------------------------------

/// Everything a client can read about the given pools, jobs, queues and sessions, and the log.
async fn snapshot(
    s: &TestServer,
    pools: &[&str],
    jobs: &[&str],
    queues: &[&str],
    sessions: &[&str],
) -> Vec<Value> {
    let mut out = vec![s.get("/v1/pools").await.body];
    for p in pools {
        out.push(pool(s, p).await.body);
    }
    for j in jobs {
        out.push(s.get(&format!("/v1/jobs/{j}")).await.body);
    }
    for q in queues {
        out.push(queue_info(s, q).await.body);
        for state in ["queued", "claimed", "done", "failed"] {
            out.push(
                s.get(&format!("/v1/queues/{q}/jobs?state={state}"))
                    .await
                    .body,
            );
        }
    }
    for id in sessions {
        let r = session(s, id).await;
        out.push(json!({"status": r.status.as_u16(), "body": r.body}));
    }
    out.push(Value::Array(all_events(s).await));
    out
}

#[tokio::test]
async fn the_dry_run_changes_nothing_and_lists_seats_and_job_actions() {
    let s = TestServer::start().await;
    make_pool(&s, "p1", 1).await;
    make_pool(&s, "p2", 5).await;
    let a = s.open("a", 1_000).await;
    let b = s.open("b", 60_000).await;
    seat(&s, "p1", &a).await;
    seat(&s, "p2", &a).await;
    let tb = seat(&s, "p2", &b).await;
    let recover = enqueue(&s, "q", json!({"payload": 1, "idempotent": true})).await;
    let not_idem = enqueue(&s, "q", json!({"payload": 2})).await;
    let capped = enqueue(
        &s,
        "q",
        json!({"payload": 3, "idempotent": true, "max_recoveries": 0}),
    )
    .await;
    let bs = enqueue(&s, "q", json!({"payload": 4})).await;
    for expected in [&recover, &not_idem, &capped] {
        assert_eq!(&claim_job(&s, "q", &a).await.0, expected);
    }
    assert_eq!(claim_job(&s, "q", &b).await.0, bs);
    s.advance(1_500).await;

    let jobs = [
        recover.as_str(),
        not_idem.as_str(),
        capped.as_str(),
        bs.as_str(),
    ];
    let before = snapshot(&s, &["p1", "p2"], &jobs, &["q"], &[a.as_str(), b.as_str()]).await;
    let metrics_before = (
        metric(&s, "leasehold_seats_in_use{pool=\"p1\"}").await,
        metric(&s, "leasehold_jobs{queue=\"q\",state=\"claimed\"}").await,
        metric(&s, "leasehold_seats_reclaimed_total").await,
    );
    let dry = s.post("/v1/admin/reap", json!({"dry_run": true})).await;
    assert_eq!(dry.status, 200, "{}", dry.text);
    assert_eq!(dry.body["dry_run"], true);
    let due = dry.body["sessions"].as_array().unwrap();
    assert_eq!(due.len(), 1, "{}", dry.text);
    assert_eq!(due[0]["session_id"], a.as_str());
    assert_eq!(due[0]["expired_at"], BASE + 1_000);
    assert_eq!(due[0]["locks"], json!([]));
    let mut seats: Vec<&str> = due[0]["seats"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    seats.sort();
    assert_eq!(seats, ["p1", "p2"]);
    let mut actions = due[0]["jobs"].as_array().unwrap().clone();
    actions.sort_by_key(|j| j["job_id"].as_str().unwrap().to_string());
    let mut expected = vec![
        json!({"job_id": recover, "action": "recover", "recovery_count": 1}),
        json!({"job_id": not_idem, "action": "fail", "reason": "not_idempotent"}),
        json!({"job_id": capped, "action": "fail", "reason": "max_recoveries_exceeded"}),
    ];
    expected.sort_by_key(|j| j["job_id"].as_str().unwrap().to_string());
    assert_eq!(actions, expected);

    // Nothing changed: the same reads, the same log, the same answer again.
    let dry2 = s.post("/v1/admin/reap", json!({"dry_run": true})).await;
    assert_eq!(dry2.body, dry.body);
    assert_eq!(
        snapshot(&s, &["p1", "p2"], &jobs, &["q"], &[a.as_str(), b.as_str()]).await,
        before
    );
    assert_eq!(
        (
            metric(&s, "leasehold_seats_in_use{pool=\"p1\"}").await,
            metric(&s, "leasehold_jobs{queue=\"q\",state=\"claimed\"}").await,
            metric(&s, "leasehold_seats_reclaimed_total").await,
        ),
        metrics_before
    );
    assert_eq!(pool(&s, "p1").await.body["holders"][0]["state"], "expired");

    // The real reap does what the dry run said.
    let real = s.reap().await;
    assert_eq!(real.status, 200, "{}", real.text);
    assert_eq!(real.body["sessions_ended"], 1);
    assert_eq!(pool(&s, "p1").await.body["in_use"], 0);
    assert_eq!(holders(&s, "p2").await, vec![b.clone()]);
    assert_eq!(pool(&s, "p2").await.body["holders"][0]["seat_token"], tb);
    let r = job(&s, &recover).await;
    assert_eq!(r.body["state"], "queued");
    assert_eq!(r.body["recovery_count"], 1);
    assert_eq!(
        job(&s, &not_idem).await.body["failure_reason"],
        "not_idempotent"
    );
    assert_eq!(
        job(&s, &capped).await.body["failure_reason"],
        "max_recoveries_exceeded"
    );
    assert_eq!(job(&s, &bs).await.body["claimed_by"], b.as_str());
    assert_eq!(counts(&s, "q").await, (1, 1, 0, 2));
    assert_eq!(
        metric(&s, "leasehold_seats_reclaimed_total").await,
        Some(2.0)
    );
    assert_eq!(
        metric(&s, "leasehold_jobs_recovered_total").await,
        Some(1.0)
    );
    assert_eq!(
        s.post("/v1/admin/reap", json!({"dry_run": true}))
            .await
            .body["sessions"],
        json!([])
    );
    s.stop().await;
}

#[tokio::test]
async fn a_real_reap_reports_the_seats_and_jobs_it_settled() {
    let s = TestServer::start().await;
    make_pool(&s, "p1", 1).await;
    make_pool(&s, "p2", 1).await;
    let a = s.open("a", 1_000).await;
    seat(&s, "p1", &a).await;
    seat(&s, "p2", &a).await;
    enqueue(&s, "q", json!({"payload": 1, "idempotent": true})).await;
    enqueue(&s, "q", json!({"payload": 2})).await;
    claim_job(&s, "q", &a).await;
    claim_job(&s, "q", &a).await;
    s.advance(1_000).await;
    let real = s.reap().await;
    assert_eq!(real.status, 200, "{}", real.text);
    assert_eq!(real.body["sessions_ended"], 1, "{}", real.text);
    assert_eq!(
        pool(&s, "p1").await.body["in_use"],
        0,
        "the seats were reclaimed"
    );
    assert_eq!(counts(&s, "q").await, (1, 0, 0, 1), "the jobs were settled");
    assert_eq!(real.body["seats_released"], 2, "{}", real.text);
    assert_eq!(real.body["jobs_settled"], 2, "{}", real.text);
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Restart
// ---------------------------------------------------------------------------------------------

/// What a pool's holders look like apart from liveness (which a restart resets).
async fn holder_rows(s: &TestServer, name: &str) -> Vec<Value> {
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

#[tokio::test]
async fn seats_and_jobs_survive_a_restart() {
    let mut s = TestServer::start().await;
    make_pool(&s, "lic", 3).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let w = s.open("w", 60_000).await;
    let ta = seat(&s, "lic", &a).await;
    let r = acquire_seat(
        &s.client,
        "lic",
        json!({"session_id": b, "metadata": {"host": "b1"}}),
    )
    .await;
    let tb = r.body["seat_token"].as_u64().unwrap();
    let jd = enqueue(&s, "q", json!({"payload": "done"})).await;
    let jf = enqueue(&s, "q", json!({"payload": "failed"})).await;
    let jc = enqueue(&s, "q", json!({"payload": {"claimed": [1]}, "kind": "k"})).await;
    let jr = enqueue(&s, "q", json!({"payload": "recovered", "idempotent": true})).await;
    let j1 = enqueue(&s, "q", json!({"payload": "one"})).await;
    let j2 = enqueue(&s, "q", json!({"payload": "two"})).await;
    let (c, t) = claim_job(&s, "q", &w).await;
    assert_eq!(c, jd);
    assert_eq!(complete(&s, &jd, &w, t).await.status, 200);
    let (c, t) = claim_job(&s, "q", &w).await;
    assert_eq!(c, jf);
    let r = finish(
        &s,
        &jf,
        "fail",
        json!({"session_id": w, "token": t, "reason": "boom"}),
    )
    .await;
    assert_eq!(r.status, 200);
    let (c, tc) = claim_job(&s, "q", &w).await;
    assert_eq!(c, jc);
    let d = s.open("dies", 60_000).await;
    assert_eq!(claim_job(&s, "q", &d).await.0, jr);
    admin_end(&s, &d).await;
    s.advance(5_000).await;

    let pools_before = s.get("/v1/pools").await.body;
    let holders_before = holder_rows(&s, "lic").await;
    let all = [&jd, &jf, &jc, &jr, &j1, &j2];
    let mut jobs_before = Vec::new();
    for id in all {
        jobs_before.push(job(&s, id).await.body);
    }
    let queue_before = queue_info(&s, "q").await.body;
    let events_before = all_events(&s).await;
    let w_before = session(&s, &w).await.body;

    s.restart().await;

    assert_eq!(s.get("/v1/pools").await.body, pools_before);
    assert_eq!(holder_rows(&s, "lic").await, holders_before);
    let mut jobs_after = Vec::new();
    for id in all {
        jobs_after.push(job(&s, id).await.body);
    }
    assert_eq!(jobs_after, jobs_before);
    assert_eq!(queue_info(&s, "q").await.body, queue_before);
    assert_eq!(counts(&s, "q").await, (3, 1, 1, 1));
    let after_events = all_events(&s).await;
    assert_eq!(after_events, events_before);
    let w_after = session(&s, &w).await;
    assert_eq!(w_after.status, 200, "the worker survived: {}", w_after.text);
    assert_eq!(w_after.body["jobs"], w_before["jobs"]);
    assert_eq!(w_after.body["jobs"], json!([jc]));
    assert_eq!(
        session(&s, &b).await.body["seats"],
        json!([{"pool": "lic", "seat_token": tb}])
    );

    // The claim still holds: its token finishes the job.
    let r = finish(
        &s,
        &jc,
        "complete",
        json!({"session_id": w, "token": tc, "result": 1}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    // Queue order survived: the recovered job first, then the rest in order.
    let x = s.open("x", 60_000).await;
    let got = claim(&s, "q", &x).await;
    assert_eq!(got.body["job_id"], jr.as_str());
    assert_eq!(got.body["recovery_count"], 1);
    assert_eq!(got.body["attempt"], 2);
    assert_eq!(claim_job(&s, "q", &x).await.0, j1);
    assert_eq!(claim_job(&s, "q", &x).await.0, j2);
    // Seats survived: one left, then full; tokens keep rising.
    let tx = seat(&s, "lic", &x).await;
    assert!(tx > got.body["token"].as_u64().unwrap());
    let y = s.open("y", 60_000).await;
    assert_error(
        &acquire_seat(&s.client, "lic", json!({"session_id": y})).await,
        409,
        "pool_exhausted",
    );
    assert_eq!(release_seat(&s, "lic", &a, ta).await.status, 200);
    assert!(seat(&s, "lic", &y).await > tx);
    s.stop().await;
}

#[tokio::test]
async fn pool_and_job_gauges_are_republished_after_a_restart() {
    let mut s = TestServer::start().await;
    make_pool(&s, "lic", 3).await;
    let a = s.open("a", 60_000).await;
    seat(&s, "lic", &a).await;
    enqueue(&s, "q", json!({"payload": 1})).await;
    assert_eq!(
        metric(&s, "leasehold_seats_in_use{pool=\"lic\"}").await,
        Some(1.0)
    );
    s.restart().await;
    assert_eq!(
        metric(&s, "leasehold_seats_capacity{pool=\"lic\"}").await,
        Some(3.0)
    );
    assert_eq!(
        metric(&s, "leasehold_seats_in_use{pool=\"lic\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s, "leasehold_jobs{queue=\"q\",state=\"queued\"}").await,
        Some(1.0)
    );
    s.stop().await;
}
