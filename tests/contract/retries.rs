//! Contract: safe retries with `request_id`. They guard against a client's retry after a
//! lost answer (a timeout) acting twice — a job enqueued twice, a lock taken again after it
//! was released, a release answered `not_holder` although it worked — against an id reused
//! for another call being answered with the first call's answer, and against concurrent
//! retries racing each other into two actions.

use leasehold::client::Reply;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::common::*;

fn lock_path(key: &str, verb: &str) -> String {
    format!("/v1/locks/{key}/{verb}")
}

fn spawn_post(s: &TestServer, path: String, body: Value) -> JoinHandle<Reply> {
    let c = s.client.clone();
    tokio::spawn(async move { c.post(&path, &body).await.unwrap() })
}

pub async fn a_repeated_enqueue_acts_once(s: &TestServer) {
    let body = json!({"payload": {"n": 1}, "kind": "build", "request_id": "enq-1"});
    let first = enqueue_with(s, "builds", body.clone()).await;
    assert_eq!(first.status, 201, "{}", first.text);
    s.advance(10).await;
    let again = enqueue_with(s, "builds", body).await;
    assert_eq!(again.status, 201, "{}", again.text);
    assert_eq!(again.body, first.body, "the retry gets the first answer");
    assert_eq!(counts(s, "builds").await, (1, 0, 0, 0));
    assert_eq!(of_kind(&all_events(s).await, "job_enqueued").len(), 1);
    // Without a request_id every call acts.
    let plain = json!({"payload": {"n": 1}, "kind": "build"});
    enqueue(s, "builds", plain.clone()).await;
    enqueue(s, "builds", plain).await;
    assert_eq!(counts(s, "builds").await, (3, 0, 0, 0));
}

pub async fn a_repeated_acquire_and_release_act_once(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let acquire = json!({"session_id": a, "request_id": "acq-1"});
    let got = s.post(&lock_path("k", "acquire"), acquire.clone()).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let t = got.body["token"].as_u64().unwrap();
    let release = json!({"session_id": a, "token": t, "request_id": "rel-1"});
    let rel = s.post(&lock_path("k", "release"), release.clone()).await;
    assert_eq!(rel.status, 200, "{}", rel.text);

    // The acquire's late retry does not take the released lock again.
    let again = s.post(&lock_path("k", "acquire"), acquire).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(again.body, got.body);
    assert_eq!(s.get("/v1/locks/k").await.body["error"], "lock_free");
    // The release's retry answers as the first did, not `not_holder`.
    let rel_again = s.post(&lock_path("k", "release"), release).await;
    assert_eq!(rel_again.status, 200, "{}", rel_again.text);
    assert_eq!(rel_again.body, rel.body);
    let events = all_events(s).await;
    assert_eq!(of_kind(&events, "lock_acquired").len(), 1);
    assert_eq!(of_kind(&events, "lock_released").len(), 1);

    // Another session takes the key; the first session's retried acquire still gets its
    // own first answer, and takes nothing from the new holder.
    let b = s.open("b", 60_000).await;
    let tb = take(s, "k", &b).await;
    let replay = s
        .post(
            &lock_path("k", "acquire"),
            json!({"session_id": a, "request_id": "acq-1", "wait_ms": 500}),
        )
        .await;
    assert_eq!(replay.status, 200, "{}", replay.text);
    assert_eq!(replay.body["token"], t);
    assert_eq!(holder(s, "k").await.body["token"], tb);
}

pub async fn a_failed_call_is_not_remembered(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let tb = take(s, "k", &b).await;
    let acquire = json!({"session_id": a, "request_id": "acq-1"});
    let held = s.post(&lock_path("k", "acquire"), acquire.clone()).await;
    assert_eq!(held.status, 409, "{}", held.text);
    assert_eq!(held.body["error"], "lock_held");
    assert_eq!(s.release("k", &b, tb).await.status, 200);
    // Nothing happened the first time, so the retry acts.
    let got = s.post(&lock_path("k", "acquire"), acquire).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(holder(s, "k").await.body["session_id"], a.as_str());

    let wrong = json!({"session_id": a, "token": 1, "request_id": "rel-1"});
    for _ in 0..2 {
        let r = s.post(&lock_path("k", "release"), wrong.clone()).await;
        assert_eq!(r.status, 409, "{}", r.text);
        assert_eq!(r.body["error"], "not_holder");
    }
}

pub async fn a_request_id_reused_for_another_call_is_refused(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let got = s
        .post(
            &lock_path("k", "acquire"),
            json!({"session_id": a, "request_id": "r-1"}),
        )
        .await;
    assert_eq!(got.status, 200, "{}", got.text);
    let t = got.body["token"].as_u64().unwrap();
    let reuses = [
        // another key
        (
            lock_path("other", "acquire"),
            json!({"session_id": a, "request_id": "r-1"}),
        ),
        // another route on the same key
        (
            lock_path("k", "release"),
            json!({"session_id": a, "token": t, "request_id": "r-1"}),
        ),
        // another kind of call
        (
            "/v1/queues/q/jobs".to_string(),
            json!({"payload": 1, "request_id": "r-1"}),
        ),
    ];
    for (path, body) in reuses {
        let r = s.post(&path, body).await;
        assert_eq!(r.status, 409, "{path}: {}", r.text);
        assert_eq!(r.body["error"], "request_id_reused", "{path}");
        assert_eq!(r.body["field"], "request_id", "{path}");
    }
    // Same route and queue, different body.
    assert_eq!(
        enqueue_with(s, "q", json!({"payload": 1, "request_id": "e-1"}))
            .await
            .status,
        201
    );
    let r = enqueue_with(s, "q", json!({"payload": 2, "request_id": "e-1"})).await;
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.body["error"], "request_id_reused");
    // Nothing of the refused calls happened.
    assert_eq!(holder(s, "k").await.body["token"], t);
    assert_eq!(s.get("/v1/locks/other").await.body["error"], "lock_free");
    assert_eq!(counts(s, "q").await, (1, 0, 0, 0));

    let long = "x".repeat(129);
    for bad in [json!(""), json!("a b"), json!("a/b"), json!(long), json!(7)] {
        let r = enqueue_with(s, "q", json!({"payload": 1, "request_id": bad})).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text);
        assert_eq!(r.body["field"], "request_id", "{bad}");
    }
    let ok = "x".repeat(128);
    assert_eq!(
        enqueue_with(s, "q", json!({"payload": 1, "request_id": ok}))
            .await
            .status,
        201
    );
}

pub async fn a_request_id_is_forgotten_after_its_retention(s: &TestServer) {
    let body = json!({"payload": "x", "request_id": "enq-1"});
    let first = enqueue_with(s, "q", body.clone()).await;
    assert_eq!(first.status, 201, "{}", first.text);
    s.advance(999).await;
    assert_eq!(enqueue_with(s, "q", body.clone()).await.body, first.body);
    assert_eq!(counts(s, "q").await, (1, 0, 0, 0));
    s.advance(1).await;
    let later = enqueue_with(s, "q", body.clone()).await;
    assert_eq!(later.status, 201, "{}", later.text);
    assert_ne!(later.body["job_id"], first.body["job_id"]);
    assert_eq!(counts(s, "q").await, (2, 0, 0, 0));
    // Once forgotten, the id may even name another call.
    let r = enqueue_with(s, "q", json!({"payload": "y", "request_id": "enq-1"})).await;
    assert_eq!(r.status, 409, "{}", r.text);
    s.advance(1_000).await;
    // The reaper's pass forgets expired ids; a new call with the id then acts.
    assert_eq!(s.reap().await.status, 200);
    let r = enqueue_with(s, "q", json!({"payload": "y", "request_id": "enq-1"})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(counts(s, "q").await, (3, 0, 0, 0));
}

pub async fn concurrent_retries_with_one_request_id_act_once(s: &TestServer) {
    let body = json!({"payload": "once", "request_id": "enq-c"});
    let tasks: Vec<_> = (0..8)
        .map(|_| spawn_post(s, "/v1/queues/q/jobs".into(), body.clone()))
        .collect();
    let mut ids = Vec::new();
    for t in tasks {
        let r = answer(t).await;
        assert_eq!(r.status, 201, "{}", r.text);
        ids.push(r.body["job_id"].clone());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one job for every retry: {ids:?}");
    assert_eq!(counts(s, "q").await, (1, 0, 0, 0));

    let a = s.open("a", 60_000).await;
    let acquire = json!({"session_id": a, "request_id": "acq-c", "wait_ms": 1_000});
    let tasks: Vec<_> = (0..8)
        .map(|_| spawn_post(s, lock_path("k", "acquire"), acquire.clone()))
        .collect();
    let mut tokens = Vec::new();
    for t in tasks {
        let r = answer(t).await;
        assert_eq!(r.status, 200, "{}", r.text);
        tokens.push(r.body["token"].as_u64().unwrap());
    }
    tokens.dedup();
    assert_eq!(tokens.len(), 1, "one grant for every retry: {tokens:?}");
    let release = json!({"session_id": a, "token": tokens[0], "request_id": "rel-c"});
    let tasks: Vec<_> = (0..8)
        .map(|_| spawn_post(s, lock_path("k", "release"), release.clone()))
        .collect();
    let mut revisions = Vec::new();
    for t in tasks {
        let r = answer(t).await;
        assert_eq!(r.status, 200, "{}", r.text);
        revisions.push(r.body["revision"].as_u64().unwrap());
    }
    revisions.dedup();
    assert_eq!(revisions.len(), 1, "{revisions:?}");
    let events = all_events(s).await;
    assert_eq!(of_kind(&events, "job_enqueued").len(), 1);
    assert_eq!(of_kind(&events, "lock_acquired").len(), 1);
    assert_eq!(of_kind(&events, "lock_released").len(), 1);
}

pub async fn a_request_id_survives_a_restart(s: &mut TestServer) {
    let body = json!({"payload": "x", "request_id": "enq-r"});
    let first = enqueue_with(s, "q", body.clone()).await;
    assert_eq!(first.status, 201, "{}", first.text);
    let a = s.open("a", 600_000).await;
    let got = s
        .post(
            &lock_path("k", "acquire"),
            json!({"session_id": a, "request_id": "acq-r"}),
        )
        .await;
    assert_eq!(got.status, 200, "{}", got.text);
    let t = got.body["token"].as_u64().unwrap();
    let release = json!({"session_id": a, "token": t, "request_id": "rel-r"});
    let rel = s.post(&lock_path("k", "release"), release.clone()).await;
    assert_eq!(rel.status, 200, "{}", rel.text);

    s.restart().await;
    assert_eq!(enqueue_with(s, "q", body).await.body, first.body);
    assert_eq!(counts(s, "q").await, (1, 0, 0, 0));
    assert_eq!(
        s.post(&lock_path("k", "release"), release).await.body,
        rel.body
    );
    let r = s
        .post(
            &lock_path("k", "acquire"),
            json!({"session_id": a, "request_id": "acq-r"}),
        )
        .await;
    assert_eq!(r.body, got.body);
    assert_eq!(s.get("/v1/locks/k").await.body["error"], "lock_free");
}

pub async fn retries_of_a_waiting_acquire_get_its_grant(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let tb = take(s, "k", &b).await;
    // The first attempt waits; its client gives up and retries, and the retry waits too.
    let body = json!({"session_id": a, "request_id": "acq-w", "wait_ms": 30_000});
    let first = spawn_post(s, lock_path("k", "acquire"), body.clone());
    until_waiters(s, 1).await;
    let retry = spawn_post(s, lock_path("k", "acquire"), body);
    until_waiters(s, 2).await;
    assert_eq!(s.release("k", &b, tb).await.status, 200);
    // Both are answered with the one grant, at once, not when their wait runs out.
    let (first, retry) = (answer(first).await, answer(retry).await);
    assert_eq!(first.status, 200, "{}", first.text);
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert_eq!(first.body, retry.body);
    assert_eq!(holder(s, "k").await.body["session_id"], a.as_str());
    assert_eq!(of_kind(&all_events(s).await, "lock_acquired").len(), 2);
}

pub async fn a_repeated_open_opens_one_session(s: &TestServer) {
    let body = json!({"owner": "w", "ttl_ms": 60_000, "metadata": {"host": "h1"},
        "request_id": "open-1"});
    let first = s.post("/v1/sessions", body.clone()).await;
    assert_eq!(first.status, 201, "{}", first.text);
    s.advance(10).await;
    // The retry gets the first session, deadline and all, and opens none.
    let again = s.post("/v1/sessions", body.clone()).await;
    assert_eq!(again.status, 201, "{}", again.text);
    assert_eq!(again.body, first.body);
    // Concurrent retries race into one session too.
    let tasks: Vec<_> = (0..8)
        .map(|_| spawn_post(s, "/v1/sessions".into(), body.clone()))
        .collect();
    for t in tasks {
        let r = answer(t).await;
        assert_eq!(r.status, 201, "{}", r.text);
        assert_eq!(r.body["session_id"], first.body["session_id"]);
    }
    assert_eq!(of_kind(&all_events(s).await, "session_opened").len(), 1);
    // Each of the nine retries was answered from the record, and counted as a replay.
    assert_eq!(
        metric(s, "leasehold_request_id_replays_total").await,
        Some(9.0)
    );
    // The session is the real one: it heartbeats.
    let id = first.body["session_id"].as_str().unwrap();
    let beat = s
        .post(&format!("/v1/sessions/{id}/heartbeat"), json!({}))
        .await;
    assert_eq!(beat.status, 200, "{}", beat.text);

    // Another owner, TTL or metadata under the id is another call.
    for other in [
        json!({"owner": "x", "ttl_ms": 60_000, "metadata": {"host": "h1"}, "request_id": "open-1"}),
        json!({"owner": "w", "ttl_ms": 30_000, "metadata": {"host": "h1"}, "request_id": "open-1"}),
        json!({"owner": "w", "ttl_ms": 60_000, "request_id": "open-1"}),
    ] {
        let r = s.post("/v1/sessions", other.clone()).await;
        assert_eq!(r.status, 409, "{other}: {}", r.text);
        assert_eq!(r.body["error"], "request_id_reused");
    }
    // A bad id is refused before anything opens; a refused open is not remembered.
    let r = s
        .post("/v1/sessions", json!({"owner": "w", "request_id": "a b"}))
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.body["field"], "request_id");
    let bad_ttl = json!({"owner": "w", "ttl_ms": 1, "request_id": "open-2"});
    assert_eq!(s.post("/v1/sessions", bad_ttl).await.status, 400);
    let fixed = s
        .post(
            "/v1/sessions",
            json!({"owner": "w", "request_id": "open-2"}),
        )
        .await;
    assert_eq!(fixed.status, 201, "{}", fixed.text);
    assert_ne!(fixed.body["session_id"], first.body["session_id"]);
    assert_eq!(of_kind(&all_events(s).await, "session_opened").len(), 2);
    // Without a request_id every open opens.
    s.open("w", 60_000).await;
    s.open("w", 60_000).await;
    assert_eq!(of_kind(&all_events(s).await, "session_opened").len(), 4);
}

pub async fn a_repeated_seat_acquire_and_release_act_once(s: &TestServer) {
    make_pool(s, "cad", 2).await;
    let a = s.open("a", 60_000).await;
    let body = json!({"session_id": a, "metadata": {"host": "h1"}, "request_id": "seat-1"});
    let got = acquire_seat(&s.client, "cad", body.clone()).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let t = got.body["seat_token"].as_u64().unwrap();
    let release = json!({"session_id": a, "seat_token": t, "request_id": "seat-rel-1"});
    let rel = s.post("/v1/pools/cad/release", release.clone()).await;
    assert_eq!(rel.status, 200, "{}", rel.text);

    // The acquire's late retry takes no seat again; the release's answers as the first did.
    let again = acquire_seat(&s.client, "cad", body).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(again.body, got.body);
    assert_eq!(pool(s, "cad").await.body["in_use"], 0);
    let rel_again = s.post("/v1/pools/cad/release", release).await;
    assert_eq!(rel_again.status, 200, "{}", rel_again.text);
    assert_eq!(rel_again.body, rel.body);
    let events = all_events(s).await;
    assert_eq!(of_kind(&events, "seat_acquired").len(), 1);
    assert_eq!(of_kind(&events, "seat_released").len(), 1);

    // Another pool, or other metadata, under the id is another call.
    make_pool(s, "cam", 1).await;
    for (pool_name, body) in [
        (
            "cam",
            json!({"session_id": a, "metadata": {"host": "h1"}, "request_id": "seat-1"}),
        ),
        ("cad", json!({"session_id": a, "request_id": "seat-1"})),
    ] {
        let r = acquire_seat(&s.client, pool_name, body).await;
        assert_eq!(r.status, 409, "{pool_name}: {}", r.text);
        assert_eq!(r.body["error"], "request_id_reused");
        assert_eq!(pool(s, pool_name).await.body["in_use"], 0);
    }
}

pub async fn a_repeated_claim_and_finish_act_once(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let j1 = enqueue(s, "q", json!({"payload": 1})).await;
    let j2 = enqueue(s, "q", json!({"payload": 2})).await;
    let body = json!({"session_id": w, "request_id": "claim-1"});
    let got = claim_with(&s.client, "q", body.clone()).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.body["job_id"], j1.as_str());
    let t = got.body["token"].as_u64().unwrap();
    let again = claim_with(&s.client, "q", body.clone()).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(
        again.body, got.body,
        "the retry gets the same job and token"
    );
    assert_eq!(counts(s, "q").await, (1, 1, 0, 0));

    let done = json!({"session_id": w, "token": t, "result": {"ok": 1}, "request_id": "done-1"});
    let first = finish(s, &j1, "complete", done.clone()).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let retry = finish(s, &j1, "complete", done).await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert_eq!(retry.body, first.body);
    // The claim's late retry takes no second job.
    assert_eq!(claim_with(&s.client, "q", body).await.body, got.body);
    assert_eq!(counts(s, "q").await, (1, 0, 1, 0));
    // The id of the complete, reused to fail the same job, is refused.
    let reuse = json!({"session_id": w, "token": t, "request_id": "done-1"});
    let r = finish(s, &j1, "fail", reuse).await;
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.body["error"], "request_id_reused");

    // A hand back and a fail, each repeated, act once.
    let (j, t2) = claim_job(s, "q", &w).await;
    assert_eq!(j, j2);
    let back = json!({"session_id": w, "token": t2, "request_id": "back-1"});
    let b1 = finish(s, &j2, "release", back.clone()).await;
    assert_eq!(b1.status, 200, "{}", b1.text);
    assert_eq!(finish(s, &j2, "release", back).await.body, b1.body);
    assert_eq!(counts(s, "q").await, (1, 0, 1, 0));
    let (_, t3) = claim_job(s, "q", &w).await;
    let fail = json!({"session_id": w, "token": t3, "reason": "bad", "request_id": "fail-1"});
    let f1 = finish(s, &j2, "fail", fail.clone()).await;
    assert_eq!(f1.status, 200, "{}", f1.text);
    assert_eq!(finish(s, &j2, "fail", fail).await.body, f1.body);
    assert_eq!(counts(s, "q").await, (0, 0, 1, 1));
    let events = all_events(s).await;
    assert_eq!(of_kind(&events, "job_claimed").len(), 3);
    assert_eq!(of_kind(&events, "job_completed").len(), 1);
    assert_eq!(of_kind(&events, "job_released").len(), 1);
    assert_eq!(of_kind(&events, "job_failed").len(), 1);

    // A claim that found no job changed nothing and is not remembered: its retry claims.
    let empty = json!({"session_id": w, "request_id": "claim-2"});
    let none = claim_with(&s.client, "q", empty.clone()).await;
    assert_eq!(none.status, 204, "{}", none.text);
    let j3 = enqueue(s, "q", json!({"payload": 3})).await;
    let later = claim_with(&s.client, "q", empty).await;
    assert_eq!(later.status, 200, "{}", later.text);
    assert_eq!(later.body["job_id"], j3.as_str());
}

pub async fn retries_of_a_waiting_claim_get_its_job(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let body = json!({"session_id": w, "request_id": "claim-w", "wait_ms": 30_000});
    let first = spawn_post(s, "/v1/queues/q/claim".into(), body.clone());
    until_waiters(s, 1).await;
    let retry = spawn_post(s, "/v1/queues/q/claim".into(), body);
    until_waiters(s, 2).await;
    let j = enqueue(s, "q", json!({"payload": 1})).await;
    let j_other = enqueue(s, "q", json!({"payload": 2})).await;
    // Both are answered with the one job, at once, and the other job stays queued.
    let (first, retry) = (answer(first).await, answer(retry).await);
    assert_eq!(first.status, 200, "{}", first.text);
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert_eq!(first.body, retry.body);
    assert_eq!(first.body["job_id"], j.as_str());
    assert_eq!(job(s, &j_other).await.body["state"], "queued");
    assert_eq!(of_kind(&all_events(s).await, "job_claimed").len(), 1);
}
