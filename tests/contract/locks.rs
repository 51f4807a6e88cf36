//! Contract: locks and fencing — acquire, release, show, list, fence. They guard against two
//! holders of one key, a release by anyone but the holder, tokens that do not grow, keys
//! mangled on the way through the path, and a fence that says "current" for a stale token.

use leasehold::client::segment;
use serde_json::{Value, json};

use crate::common::*;

pub async fn acquire_show_release(s: &TestServer) {
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

    let shown = holder(s, "db/migrate").await;
    assert_eq!(shown.status, 200, "{}", shown.text);
    assert_eq!(
        shown.body,
        json!({"key": "db/migrate", "session_id": a, "token": t1, "acquired_at": BASE + 250})
    );

    let rel = s.release("db/migrate", &a, t1).await;
    assert_eq!(rel.status, 200, "{}", rel.text);
    assert_eq!(rel.body["released"], true);
    assert!(rel.body["revision"].as_u64().unwrap() > t1);
    assert_error(&holder(s, "db/migrate").await, 404, "lock_free");
    assert_eq!(session(s, &a).await.body["locks"], json!([]));

    let t2 = take(s, "db/migrate", &a).await;
    assert!(
        t2 > rel.body["revision"].as_u64().unwrap(),
        "tokens only grow"
    );
}

pub async fn holder_reacquire_is_idempotent(s: &TestServer) {
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
    let ev = all_events(s).await;
    assert_eq!(of_kind(&ev, "lock_acquired").len(), 1);
    assert_eq!(metric(s, "leasehold_locks_acquired_total").await, Some(1.0));
}

pub async fn acquire_held_lock_without_wait_is_409(s: &TestServer) {
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let t = take(s, "k", &a).await;
    assert_error(&s.acquire("k", &b).await, 409, "lock_held");
    let wait0 = acquire_wait(&s.client, "k", &b, 0).await;
    assert_error(&wait0, 409, "lock_held");
    let h = holder(s, "k").await;
    assert_eq!(h.body["session_id"], a.as_str());
    assert_eq!(h.body["token"], t);
}

pub async fn one_winner_among_concurrent_contenders(s: &TestServer) {
    let mut ids = Vec::new();
    for i in 0..16 {
        ids.push(s.open(&format!("w{i}"), 60_000).await);
    }
    let tasks: Vec<_> = ids
        .iter()
        .map(|id| spawn_acquire(s, "hot", id, 0))
        .collect();
    let mut winners = Vec::new();
    for (id, t) in ids.iter().zip(tasks) {
        let r = answer(t).await;
        match r.status.as_u16() {
            200 => winners.push(id.clone()),
            409 => assert_eq!(r.body["error"], "lock_held"),
            other => panic!("unexpected {other}: {}", r.text),
        }
    }
    assert_eq!(winners.len(), 1, "mutual exclusion");
    assert_eq!(
        holder(s, "hot").await.body["session_id"],
        winners[0].as_str()
    );
}

pub async fn acquire_for_unknown_or_gone_session_is_404(s: &TestServer) {
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
    assert_error(&holder(s, "k").await, 404, "lock_free");
    let list = s.get("/v1/locks").await;
    assert_eq!(list.body["locks"], json!([]));
}

pub async fn acquire_and_release_reject_bad_bodies(s: &TestServer) {
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
    assert_error(&holder(s, "k").await, 404, "lock_free");

    let t = take(s, "k", &a).await;
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
    assert_eq!(holder(s, "k").await.body["token"], t, "still held");
}

pub async fn release_with_wrong_token_or_session_is_409(s: &TestServer) {
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let t1 = take(s, "k", &a).await;
    assert_eq!(s.release("k", &a, t1).await.status, 200);
    let t2 = take(s, "k", &a).await;
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
    let h = holder(s, "k").await;
    assert_eq!(h.body["token"], t2, "nothing refused changed the lock");
    assert_eq!(h.body["session_id"], a.as_str());
    assert_eq!(s.release("k", &a, t2).await.status, 200);
    // Released twice: the second is refused.
    assert_error(&s.release("k", &a, t2).await, 409, "not_holder");
    // After the session closed, its old grant cannot be released either.
    let t3 = take(s, "k", &a).await;
    s.delete(&format!("/v1/sessions/{a}")).await;
    assert_error(&s.release("k", &a, t3).await, 409, "not_holder");
    // Past its deadline a session holds nothing it can release: its token is stale.
    let late = s.open("late", 1_000).await;
    let tl = take(s, "late-key", &late).await;
    s.advance(1_000).await;
    assert_eq!(fence(s, "late-key", tl).await.body["current"], false);
    assert_error(&s.release("late-key", &late, tl).await, 409, "not_holder");
    assert_error(&s.heartbeat(&late).await, 404, "session_gone");
    let ev = all_events(s).await;
    assert_eq!(of_kind(&ev, "lock_released").len(), 2);
}

pub async fn too_many_locks_is_409(s: &TestServer) {
    let a = s.open("alice", 60_000).await;
    take(s, "1", &a).await;
    take(s, "2", &a).await;
    assert_error(&s.acquire("3", &a).await, 409, "too_many_locks");
    assert_eq!(s.acquire("1", &a).await.status, 200, "a re-acquire is fine");
    assert_error(&holder(s, "3").await, 404, "lock_free");
}

pub async fn any_valid_key_works_percent_encoded(s: &TestServer) {
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
        let shown = holder(s, key).await;
        assert_eq!(shown.status, 200, "{key:?}: {}", shown.text);
        assert_eq!(shown.body["key"], key.as_str());
        assert_eq!(shown.body["token"], t);
        let f = fence(s, key, t).await;
        assert_eq!(f.body["current"], true, "{key:?}");
        assert_eq!(f.body["key"], key.as_str());
    }
    let list = s.get("/v1/locks").await;
    let mut listed = lock_keys(&list);
    listed.sort();
    let mut expected = keys.to_vec();
    expected.sort();
    assert_eq!(listed, expected);
    // "a" and "a/..." style keys do not collide with route segments.
    assert_error(&holder(s, "db").await, 404, "lock_free");
    for (key, t) in keys.iter().zip(tokens) {
        let r = s.release(key, &a, t).await;
        assert_eq!(r.status, 200, "{key:?}: {}", r.text);
    }
    assert_eq!(s.get("/v1/locks").await.body["locks"], json!([]));
}

pub async fn invalid_keys_are_400(s: &TestServer) {
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
    assert!(of_kind(&all_events(s).await, "lock_acquired").is_empty());
}

pub async fn a_plus_in_a_path_is_a_plus_not_a_space(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let r = s
        .post("/v1/locks/a+b/acquire", json!({"session_id": a}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["key"], "a+b");
    assert_eq!(holder(s, "a+b").await.body["token"], token(&r));
    assert_error(&holder(s, "a b").await, 404, "lock_free");
}

pub async fn locks_page_by_prefix_and_cursor(s: &TestServer) {
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
        tokens.insert(key, take(s, key, who).await);
    }

    let all = s.get("/v1/locks").await;
    assert_eq!(all.status, 200, "{}", all.text);
    assert_eq!(lock_keys(&all), ["a/1", "a/2", "a/3", "b/1", "c"]);
    assert!(all.body["next"].is_null());
    for l in all.body["locks"].as_array().unwrap() {
        let key = l["key"].as_str().unwrap();
        assert_eq!(l["token"], tokens[key]);
        let who = if key == "b/1" || key == "a/3" { &b } else { &a };
        assert_eq!(l["session_id"], who.as_str());
        assert!(l["acquired_at"].as_u64().unwrap() >= BASE);
    }

    let p1 = s.get("/v1/locks?prefix=a%2F&limit=2").await;
    assert_eq!(lock_keys(&p1), ["a/1", "a/2"]);
    assert_eq!(p1.body["next"], "a/2");
    let p2 = s.get("/v1/locks?prefix=a%2F&limit=2&after=a%2F2").await;
    assert_eq!(lock_keys(&p2), ["a/3"]);
    assert!(p2.body["next"].is_null());

    let after = s.get("/v1/locks?after=a%2F3").await;
    assert_eq!(lock_keys(&after), ["b/1", "c"]);
    // A cursor before the prefix starts at the prefix.
    let before = s.get("/v1/locks?prefix=b&after=a%2F1").await;
    assert_eq!(lock_keys(&before), ["b/1"]);
    let none = s.get("/v1/locks?prefix=zz").await;
    assert_eq!(none.body["locks"], json!([]));
    assert!(none.body["next"].is_null());

    assert_invalid(&s.get("/v1/locks?limit=0").await, "limit");
    assert_invalid(&s.get("/v1/locks?limit=1001").await, "limit");
    assert_error(&s.get("/v1/locks?owner=x").await, 400, "invalid_request");
    assert_eq!(s.get("/v1/locks?limit=1000").await.status, 200);
}

pub async fn fence_reports_current_and_latest(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 2_000).await;

    let f = fence(s, "res", 1).await;
    assert_eq!(
        f.body,
        json!({"key": "res", "token": 1, "current": false, "latest": null})
    );

    let t1 = take(s, "res", &a).await;
    let f = fence(s, "res", t1).await;
    assert_eq!(f.body["current"], true);
    assert_eq!(f.body["latest"], t1);
    assert_eq!(f.body["token"], t1);
    for other in [t1 - 1, t1 + 1, 0] {
        let f = fence(s, "res", other).await;
        assert_eq!(f.body["current"], false, "token {other}");
        assert_eq!(f.body["latest"], t1);
    }

    assert_eq!(s.release("res", &a, t1).await.status, 200);
    let f = fence(s, "res", t1).await;
    assert_eq!(f.body["current"], false);
    assert_eq!(f.body["latest"], Value::Null, "released keys leave nothing");

    let t2 = take(s, "res", &b).await;
    assert!(t2 > t1);
    assert_eq!(fence(s, "res", t1).await.body["current"], false);
    assert_eq!(fence(s, "res", t1).await.body["latest"], t2);
    assert_eq!(fence(s, "res", t2).await.body["current"], true);

    // The holder's session passes its deadline: its token stops being current at once,
    // before any reap.
    s.advance(1_999).await;
    assert_eq!(fence(s, "res", t2).await.body["current"], true);
    s.advance(1).await;
    assert_eq!(fence(s, "res", t2).await.body["current"], false);
    assert_eq!(s.reap().await.body["sessions_ended"], 1);
    let f = fence(s, "res", t2).await;
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
}
