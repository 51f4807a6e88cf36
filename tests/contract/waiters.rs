//! Contract: waiting for a lock — first come, first served within a node; a waiter whose
//! session ended is skipped; waits time out (on the injected clock) and are capped; an
//! expired holder is ended inline by a contender, and no newcomer overtakes a waiter.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::*;

pub async fn waiters_are_served_first_come_first_served(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = take(s, "k", &a).await;

    let wait_b = spawn_acquire(s, "k", &b, 30_000);
    until_waiters(s, 1).await;
    let wait_c = spawn_acquire(s, "k", &c, 30_000);
    until_waiters(s, 2).await;
    // A newcomer with no wait is refused while others queue.
    assert_error(
        &s.acquire("k", &s.open("d", 60_000).await).await,
        409,
        "lock_held",
    );

    assert_eq!(s.release("k", &a, ta).await.status, 200);
    let got_b = answer(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    assert_eq!(got_b.body["session_id"], b.as_str());
    let tb = token(&got_b);
    assert!(tb > ta);
    assert_eq!(holder(s, "k").await.body["session_id"], b.as_str());
    until_waiters(s, 1).await;
    assert!(!wait_c.is_finished(), "C still waits while B holds");

    assert_eq!(s.release("k", &b, tb).await.status, 200);
    let got_c = answer(wait_c).await;
    assert_eq!(got_c.status, 200, "{}", got_c.text);
    assert_eq!(got_c.body["session_id"], c.as_str());
    assert!(token(&got_c) > tb);
    assert_eq!(holder(s, "k").await.body["session_id"], c.as_str());
    until_waiters(s, 0).await;
}

pub async fn waiter_is_served_when_the_holder_closes_or_is_reaped(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta = take(s, "k", &a).await;
    let wait_b = spawn_acquire(s, "k", &b, 30_000);
    until_waiters(s, 1).await;
    assert_eq!(
        s.delete(&format!("/v1/sessions/{a}")).await.body["released"],
        1
    );
    let got = answer(wait_b).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert!(token(&got) > ta);

    // The holder expires; the reap that ends it hands the key to the waiter.
    let short = s.open("short", 2_000).await;
    let w = s.open("w", 60_000).await;
    let ts = take(s, "k2", &short).await;
    let wait_w = spawn_acquire(s, "k2", &w, 30_000);
    until_waiters(s, 1).await;
    s.advance(2_000).await;
    let reaped = s.reap().await;
    assert_eq!(reaped.body["sessions_ended"], 1, "{}", reaped.text);
    let got = answer(wait_w).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.body["session_id"], w.as_str());
    assert!(token(&got) > ts);
}

pub async fn a_waiter_whose_session_ended_is_skipped(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = take(s, "k", &a).await;
    let wait_b = spawn_acquire(s, "k", &b, 30_000);
    until_waiters(s, 1).await;
    let wait_c = spawn_acquire(s, "k", &c, 30_000);
    until_waiters(s, 2).await;
    assert_eq!(s.delete(&format!("/v1/sessions/{b}")).await.status, 200);
    assert_eq!(s.release("k", &a, ta).await.status, 200);
    assert_error(&answer(wait_b).await, 404, "session_gone");
    let got_c = answer(wait_c).await;
    assert_eq!(got_c.status, 200, "{}", got_c.text);
    assert_eq!(holder(s, "k").await.body["session_id"], c.as_str());
}

pub async fn wait_timeout_is_409_on_the_real_clock(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta = take(s, "k", &a).await;
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
    let h = holder(s, "k").await;
    assert_eq!(h.body["session_id"], a.as_str());
    assert_eq!(h.body["token"], ta);
    // The gauge is set just after the refusal is sent, so poll for it.
    until_waiters(s, 0).await;
}

pub async fn wait_is_capped_by_max_wait_ms(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    take(s, "k", &a).await;
    let started = Instant::now();
    let r = acquire_wait(&s.client, "k", &b, 60_000).await;
    let waited = started.elapsed();
    assert_error(&r, 409, "lock_held");
    assert!(waited >= Duration::from_millis(190), "{waited:?}");
    assert!(
        waited < Duration::from_secs(5),
        "the cap was ignored: {waited:?}"
    );
}

pub async fn wait_timeout_is_409_on_the_manual_clock(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta = take(s, "k", &a).await;
    let wait_b = spawn_acquire(s, "k", &b, 5_000);
    until_waiters(s, 1).await;
    s.advance(4_999).await;
    // Poke the writer: not yet due.
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    until_waiters(s, 1).await;
    assert!(!wait_b.is_finished());
    s.advance(1).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    assert_error(&answer(wait_b).await, 409, "lock_held");
    until_waiters(s, 0).await;
    assert_eq!(holder(s, "k").await.body["token"], ta);
    // The timed-out waiter is not served later.
    assert_eq!(s.release("k", &a, ta).await.status, 200);
    assert_error(&holder(s, "k").await, 404, "lock_free");
}

pub async fn inline_reap_of_an_expired_holder(s: &TestServer) {
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let ta = take(s, "job", &a).await;
    assert_error(&s.acquire("job", &b).await, 409, "lock_held");
    s.advance(2_000).await;
    // No reap call: the contender ends the expired holder itself.
    let got = s.acquire("job", &b).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let tb = token(&got);
    assert!(tb > ta);
    let h = holder(s, "job").await;
    assert_eq!(h.body["session_id"], b.as_str());
    assert_eq!(h.body["token"], tb);
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    assert_eq!(fence(s, "job", ta).await.body["current"], false);

    let ev = all_events(s).await;
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
        metric(s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        Some(1.0)
    );
    // Nothing is left for the reaper.
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
}

/// At 643b599 an inline reap by a newcomer handed the freed key to the newcomer, then popped
/// the first waiter, found the key held and pushed it back at the end of the line: C was
/// served before B.
pub async fn waiters_keep_their_order_when_a_newcomer_reaps_the_holder_inline(s: &TestServer) {
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let d = s.open("d", 60_000).await;
    take(s, "k", &a).await;
    let wait_b = spawn_acquire(s, "k", &b, 30_000);
    until_waiters(s, 1).await;
    let wait_c = spawn_acquire(s, "k", &c, 30_000);
    until_waiters(s, 2).await;
    s.advance(2_000).await;
    // A newcomer asks for the key of the expired holder.
    let dr = s.acquire("k", &d).await;
    if dr.status == 200 {
        // Whether or not the newcomer may take the key, the line behind it keeps its order.
        assert_eq!(s.release("k", &d, token(&dr)).await.status, 200);
    }
    // Where the backends differ: the embedded writer commits a waiter's grant in the same
    // batch as the release that freed the key, so the next holder is visible as soon as the
    // release (or the newcomer's acquire) is answered; on PostgreSQL and Redis the waiter takes
    // the key when it is woken, so the holder is read once B is answered.
    if s.kind == BackendKind::Embedded {
        let h = holder(s, "k").await;
        assert_eq!(
            h.body["session_id"],
            b.as_str(),
            "B queued first: {}",
            h.text
        );
    }
    let got_b = answer(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    let h = holder(s, "k").await;
    assert_eq!(
        h.body["session_id"],
        b.as_str(),
        "B queued first: {}",
        h.text
    );
    assert!(!wait_c.is_finished(), "C waits while B holds");
    assert_eq!(s.release("k", &b, token(&got_b)).await.status, 200);
    assert_eq!(answer(wait_c).await.status, 200);
}

pub async fn a_newcomer_does_not_overtake_a_waiter_when_the_holder_expires(s: &TestServer) {
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let d = s.open("d", 60_000).await;
    take(s, "k", &a).await;
    let wait_b = spawn_acquire(s, "k", &b, 30_000);
    until_waiters(s, 1).await;
    s.advance(2_000).await;
    // B has been waiting for the key since before A expired; D only now asks, without waiting.
    let dr = s.acquire("k", &d).await;
    assert_error(&dr, 409, "lock_held");
    let got_b = answer(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    assert_eq!(holder(s, "k").await.body["session_id"], b.as_str());
}
