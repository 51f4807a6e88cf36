//! Contract: session watches — `GET /v1/sessions/{id}/watch`. They guard against a watcher
//! that is not told its session entered grace or ended, that is told of the end without the
//! locks and seats it lost, that is told a wrong reason, and a watch of a gone session that
//! is answered with a stream instead of `404 session_gone`.
//!
//! The suite's servers run with a short `watch_recheck_ms`, so that a grace reached by
//! advancing the manual clock is seen soon; each read of the stream is bounded so that a
//! missing event fails the test rather than hanging it.

use std::time::Duration;

use leasehold::client::{Watch, WatchEvent};
use serde_json::json;

use crate::common::*;

/// A short re-check for the suite (see the module's comment).
pub fn quick(c: &mut leasehold::config::Config) {
    c.watch_recheck_ms = 20;
}

async fn watch(s: &TestServer, id: &str) -> Watch {
    match s.client.watch(id).await.unwrap() {
        Ok(w) => w,
        Err(r) => panic!("the watch was refused: {} {}", r.status, r.text),
    }
}

async fn next(w: &mut Watch) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(20), w.next())
        .await
        .expect("the watch sent no event")
        .unwrap()
        .expect("the stream ended early")
}

/// The events after the snapshot, up to and including the final one; the stream then ends.
async fn rest(w: &mut Watch) -> Vec<WatchEvent> {
    let mut out = Vec::new();
    loop {
        let e = next(w).await;
        let last = e.is_final();
        out.push(e);
        if last {
            break;
        }
    }
    let after = tokio::time::timeout(Duration::from_secs(20), w.next())
        .await
        .expect("the stream did not end after its final event")
        .unwrap();
    assert_eq!(after, None, "nothing follows the final event");
    out
}

fn names(events: &[WatchEvent]) -> Vec<&str> {
    events.iter().map(|e| e.event.as_str()).collect()
}

pub async fn a_watcher_sees_grace_then_the_expiry_with_each_lock_and_seat_lost(s: &TestServer) {
    make_pool(s, "p", 2).await;
    let a = s.open("alice", 3_000).await;
    let tx = take(s, "x", &a).await;
    let ty = take(s, "y/z", &a).await;
    let tp = seat(s, "p", &a).await;
    let mut w = watch(s, &a).await;

    let snap = next(&mut w).await;
    assert_eq!(snap.event, "snapshot");
    assert_eq!(snap.id, Some(1), "events are numbered from 1");
    assert_eq!(snap.data["session_id"], a.as_str());
    assert_eq!(snap.data["state"], "active");
    assert_eq!(snap.data["expires_at"], BASE + 3_000);
    assert_eq!(snap.data["locks"].as_array().unwrap().len(), 2);
    assert_eq!(snap.data["seats"], json!([{"pool": "p", "seat_token": tp}]));

    s.advance(1_001).await;
    let grace = next(&mut w).await;
    assert_eq!(grace.event, "grace", "{grace:?}");
    assert_eq!(grace.id, Some(2));
    assert_eq!(grace.data["last_heartbeat_at"], BASE);

    // A heartbeat brings it back.
    assert_eq!(s.heartbeat(&a).await.status, 200);
    let back = next(&mut w).await;
    assert_eq!(back.event, "active", "{back:?}");
    assert_eq!(back.data["expires_at"], BASE + 1_001 + 3_000);

    s.advance(1_001).await;
    assert_eq!(next(&mut w).await.event, "grace");
    s.advance(2_000).await;
    s.reap().await;
    let end = rest(&mut w).await;
    assert_eq!(
        names(&end),
        ["lock_lost", "lock_lost", "seat_lost", "expired"],
        "{end:?}"
    );
    assert_eq!(end[0].data, json!({"key": "x", "token": tx}));
    assert_eq!(end[1].data, json!({"key": "y/z", "token": ty}));
    assert_eq!(end[2].data, json!({"pool": "p", "seat_token": tp}));
    assert_eq!(end[3].data["session_id"], a.as_str());
    assert_eq!(end[3].data["released"], 2);
    assert_eq!(end[3].data["seats_released"], 1);
    let ids: Vec<Option<u64>> = end.iter().map(|e| e.id).collect();
    assert_eq!(ids, [Some(5), Some(6), Some(7), Some(8)]);
}

pub async fn a_watcher_sees_an_operator_end(s: &TestServer) {
    let a = s.open("alice", 60_000).await;
    let t = take(s, "k", &a).await;
    let mut w = watch(s, &a).await;
    assert_eq!(next(&mut w).await.event, "snapshot");
    assert_eq!(admin_end(s, &a).await.status, 200);
    let end = rest(&mut w).await;
    assert_eq!(names(&end), ["lock_lost", "ended_by_admin"], "{end:?}");
    assert_eq!(end[0].data, json!({"key": "k", "token": t}));
    assert!(end[1].is_loss());
}

pub async fn a_watcher_sees_its_client_close(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("alice", 60_000).await;
    let tp = seat(s, "p", &a).await;
    // Two watches of one session both hear the end.
    let mut w1 = watch(s, &a).await;
    let mut w2 = watch(s, &a).await;
    assert_eq!(next(&mut w1).await.event, "snapshot");
    assert_eq!(next(&mut w2).await.event, "snapshot");
    assert_eq!(metric(s, "leasehold_watches_open").await, Some(2.0));
    assert_eq!(close(s, &a).await.status, 200);
    for w in [&mut w1, &mut w2] {
        let end = rest(w).await;
        assert_eq!(names(&end), ["seat_lost", "closed"], "{end:?}");
        assert_eq!(end[0].data, json!({"pool": "p", "seat_token": tp}));
        assert_eq!(end[1].data["released"], 0);
    }
}

/// The background reaper ends the session, not this node's API: the backend's signal of ends
/// wakes the tail, since the suite's re-check is far longer than the read's bound.
pub async fn a_reaper_end_reaches_a_watcher_without_a_recheck(s: &TestServer) {
    let a = s.open("alice", 3_000).await;
    let t = take(s, "k", &a).await;
    let mut w = watch(s, &a).await;
    assert_eq!(next(&mut w).await.event, "snapshot");
    s.advance(60_000).await;
    let end = rest(&mut w).await;
    assert_eq!(names(&end), ["lock_lost", "expired"], "{end:?}");
    assert_eq!(end[0].data, json!({"key": "k", "token": t}));
    assert_eq!(end[1].data["session_id"], a.as_str());
}

pub async fn watching_a_gone_session_is_404(s: &TestServer) {
    let r = s.get(&format!("/v1/sessions/{}/watch", random_id())).await;
    assert_error(&r, 404, "session_gone");
    let a = s.open("alice", 60_000).await;
    close(s, &a).await;
    let r = s.get(&format!("/v1/sessions/{a}/watch")).await;
    assert_error(&r, 404, "session_gone");
    let r = s.get("/v1/sessions/not-an-id/watch").await;
    assert_invalid(&r, "session_id");
}

/// Regression: a watch of a session closed a moment before hung instead of answering 404.
/// The log's tail, woken by the watch, found the end, handed the session's end to that watch
/// (emptying the hub's list of ends awaited) and, seeing no end awaited, turned idle again
/// before the watch had seen it turn live: the watch waited for a tail that never came.
/// Each round is that watch arriving at an idle tail.
pub async fn watching_a_session_closed_a_moment_before_is_404_at_once(s: &TestServer) {
    for round in 0..10 {
        let a = s.open("alice", 60_000).await;
        close(s, &a).await;
        let r = tokio::time::timeout(
            Duration::from_secs(20),
            s.get(&format!("/v1/sessions/{a}/watch")),
        )
        .await
        .unwrap_or_else(|_| panic!("round {round}: the watch of a closed session hung"));
        assert_error(&r, 404, "session_gone");
        // Let the tail go idle before the next round.
        for _ in 0..200 {
            if metric(s, "leasehold_watches_open").await == Some(0.0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

pub async fn watches_over_the_cap_are_refused(s: &TestServer) {
    let a = s.open("alice", 60_000).await;
    let mut w = watch(s, &a).await;
    assert_eq!(next(&mut w).await.event, "snapshot");
    match s.client.watch(&a).await.unwrap() {
        Ok(_) => panic!("a second watch was let past max_watches = 1"),
        Err(r) => {
            assert_eq!(r.status, 503, "{}", r.text);
            assert_eq!(r.body["error"], "too_many_watches", "{}", r.text);
        }
    }
    drop(w);
    // The place is given back once the stream is gone.
    for _ in 0..200 {
        if metric(s, "leasehold_watches_open").await == Some(0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut again = watch(s, &a).await;
    assert_eq!(next(&mut again).await.event, "snapshot");
}

pub async fn a_shutdown_ends_every_watch_rather_than_waiting_on_it(s: &mut TestServer) {
    let a = s.open("alice", 60_000).await;
    let mut w = watch(s, &a).await;
    assert_eq!(next(&mut w).await.event, "snapshot");
    // The shutdown grace is far longer than the bound: only a stream that ends lets the
    // restart finish within it.
    tokio::time::timeout(Duration::from_secs(20), s.restart())
        .await
        .expect("the shutdown waited on the watch");
    let end = rest(&mut w).await;
    assert_eq!(names(&end), ["shutting_down"], "{end:?}");
    assert!(!end[0].is_loss(), "the session itself is not affected");
    // It is still there to be watched again.
    let mut again = watch(s, &a).await;
    assert_eq!(next(&mut again).await.data["state"], "active");
}
