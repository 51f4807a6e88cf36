//! Contract: sessions — open, show, list, heartbeat, close. They guard against a heartbeat
//! that brings a session back (gone is terminal), a session that ends before its deadline or
//! lives past it, a close that leaves a grant behind, and input accepted although it breaks
//! a rule.

use serde_json::{Value, json};

use crate::common::*;

pub async fn open_returns_201_with_id_ttl_deadline_and_revision(s: &TestServer) {
    let r = open_with(s, json!({"owner": "alice"})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.body["session_id"].as_str().unwrap().to_string();
    let uuid = uuid::Uuid::parse_str(&id).expect("session ids are UUIDs");
    assert_eq!(uuid.get_version_num(), 4, "session ids are random (v4)");
    assert_eq!(r.body["ttl_ms"], 15_000, "the default TTL");
    assert_eq!(r.body["expires_at"], BASE + 15_000);
    let rev1 = r.body["revision"].as_u64().unwrap();
    assert!(rev1 >= 1);

    s.advance(100).await;
    let r2 = open_with(s, json!({"owner": "alice", "ttl_ms": 2_000})).await;
    assert_eq!(r2.status, 201, "{}", r2.text);
    assert_eq!(r2.body["ttl_ms"], 2_000);
    assert_eq!(r2.body["expires_at"], BASE + 100 + 2_000);
    assert!(r2.body["revision"].as_u64().unwrap() > rev1);
    assert_ne!(r2.body["session_id"], id.as_str(), "ids are never reused");

    // TTL bounds are inclusive.
    for ttl in [1_000, 86_400_000] {
        let r = open_with(s, json!({"owner": "x", "ttl_ms": ttl})).await;
        assert_eq!(r.status, 201, "ttl {ttl}: {}", r.text);
        assert_eq!(r.body["ttl_ms"], ttl);
    }
}

pub async fn show_session_round_trips_owner_metadata_and_locks(s: &TestServer) {
    let meta = json!({"host": "h1", "pid": 42, "tags": ["a", "b"], "nested": {"x": null}});
    let r = open_with(
        s,
        json!({"owner": "alice@laptop", "ttl_ms": 9_000, "metadata": meta}),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.body["session_id"].as_str().unwrap().to_string();
    s.advance(500).await;
    let t2 = take(s, "k/2", &id).await;
    let t1 = take(s, "k/1", &id).await;

    let got = session(s, &id).await;
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
        let r = open_with(s, body).await;
        assert_eq!(r.status, 201, "{}", r.text);
        let got = session(s, r.body["session_id"].as_str().unwrap()).await;
        assert_eq!(got.status, 200);
        assert_eq!(got.body["metadata"], Value::Null);
        assert_eq!(got.body["locks"], json!([]));
    }
    // An empty object is kept.
    let r = open_with(s, json!({"owner": "bob", "metadata": {}})).await;
    let got = session(s, r.body["session_id"].as_str().unwrap()).await;
    assert_eq!(got.body["metadata"], json!({}));
}

pub async fn open_rejects_bad_input_naming_the_field(s: &TestServer) {
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
    let first = open_with(s, json!({"owner": "first"})).await;
    let rev = first.body["revision"].as_u64().unwrap();
    for (body, field) in &cases {
        let r = open_with(s, body.clone()).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        assert_invalid(&r, field);
    }
    // Exactly 256 bytes is fine.
    let r = open_with(s, json!({"owner": "x".repeat(256)})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    // Nothing refused left a trace: no revision used, no event, no session.
    assert_eq!(r.body["revision"], rev + 1);
    let events = all_events(s).await;
    assert_eq!(events.len(), 2, "{events:?}");
    let list = s.get("/v1/sessions").await;
    assert_eq!(list.body["sessions"].as_array().unwrap().len(), 2);
}

pub async fn open_rejects_missing_and_unknown_fields(s: &TestServer) {
    for body in [
        json!({}),
        json!({"ttl_ms": 2_000}),
        json!({"owner": "a", "ttl": 2_000}),
        json!({"owner": "a", "extra": 1}),
        json!([]),
        json!("owner"),
    ] {
        let r = open_with(s, body.clone()).await;
        assert_error(&r, 400, "invalid_request");
    }
    // The message names what is wrong.
    let r = open_with(s, json!({"ttl_ms": 2_000})).await;
    assert!(
        r.body["message"].as_str().unwrap().contains("owner"),
        "{}",
        r.text
    );
    let r = open_with(s, json!({"owner": "a", "colour": "red"})).await;
    assert!(
        r.body["message"].as_str().unwrap().contains("colour"),
        "{}",
        r.text
    );
    assert!(all_events(s).await.is_empty());
}

pub async fn missing_and_unknown_fields_are_named_in_field(s: &TestServer) {
    let r = open_with(s, json!({"ttl_ms": 2_000})).await;
    assert_invalid(&r, "owner");
    let r = open_with(s, json!({"owner": "a", "colour": "red"})).await;
    assert_invalid(&r, "colour");
}

pub async fn heartbeat_extends_and_gone_is_terminal(s: &TestServer) {
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
    let got = session(s, &a).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.body["last_heartbeat_at"], BASE + 3_499);
    // Exactly at the deadline it is gone, before any reap.
    s.advance(2_000).await;
    let gone = s.heartbeat(&a).await;
    assert_error(&gone, 404, "session_gone");
    assert_error(&session(s, &a).await, 404, "session_gone");
    // And it stays gone: after a reap (which finds it ended, whether by that refused
    // heartbeat or by this reap), with a new TTL, and for acquire.
    s.reap().await;
    let ev = all_events(s).await;
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
    assert_error(&session(s, &a).await, 404, "session_gone");
    // A session id nobody opened is gone too.
    assert_error(&s.heartbeat(&random_id()).await, 404, "session_gone");
}

pub async fn heartbeat_expired_but_unreaped_is_gone_and_not_revived(s: &TestServer) {
    let a = s.open("alice", 1_000).await;
    s.advance(5_000).await;
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    // Not listed, not revived by anything later, and it ends exactly once, as an expiry.
    let list = s.get("/v1/sessions").await;
    assert_eq!(list.body["sessions"], json!([]), "{}", list.text);
    s.reap().await;
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    s.reap().await;
    let ev = all_events(s).await;
    let expired = of_kind(&ev, "session_expired");
    assert_eq!(expired.len(), 1, "{ev:?}");
    assert_eq!(expired[0]["session_id"], a.as_str());
    assert!(of_kind(&ev, "session_closed").is_empty());
    assert_eq!(metric(s, "leasehold_sessions_active").await, Some(0.0));
}

pub async fn heartbeat_with_ttl_changes_the_ttl(s: &TestServer) {
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
    assert_eq!(session(s, &a).await.body["ttl_ms"], 10_000);
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
    assert_eq!(session(s, &a).await.body["ttl_ms"], 10_000);
}

pub async fn grace_state_after_a_third_of_the_ttl(s: &TestServer) {
    let a = s.open("alice", 3_000).await;
    assert_eq!(session(s, &a).await.body["state"], "active");
    s.advance(1_000).await;
    assert_eq!(session(s, &a).await.body["state"], "active");
    s.advance(1).await;
    let g = session(s, &a).await;
    assert_eq!(g.body["state"], "grace", "{}", g.text);
    assert_eq!(g.body["last_heartbeat_at"], BASE);
    // Listed the same way.
    let list = s.get("/v1/sessions").await;
    assert_eq!(list.body["sessions"][0]["state"], "grace");
    assert_eq!(s.heartbeat(&a).await.status, 200);
    let back = session(s, &a).await;
    assert_eq!(back.body["state"], "active");
    assert_eq!(back.body["last_heartbeat_at"], BASE + 1_001);
    assert_eq!(back.body["expires_at"], BASE + 1_001 + 3_000);
}

pub async fn close_releases_everything_and_is_idempotent(s: &TestServer) {
    let a = s.open("alice", 60_000).await;
    let t1 = take(s, "x", &a).await;
    let t2 = take(s, "y/z", &a).await;
    let closed = s.delete(&format!("/v1/sessions/{a}")).await;
    assert_eq!(closed.status, 200, "{}", closed.text);
    assert_eq!(closed.body["released"], 2);
    let rev = closed.body["revision"].as_u64().unwrap();
    assert!(rev > t2, "the close committed after the grants");
    for key in ["x", "y/z"] {
        assert_error(&holder(s, key).await, 404, "lock_free");
    }
    assert_error(&session(s, &a).await, 404, "session_gone");
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");

    let again = s.delete(&format!("/v1/sessions/{a}")).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(again.body["released"], 0);
    let unknown = s.delete(&format!("/v1/sessions/{}", random_id())).await;
    assert_eq!(unknown.status, 200, "{}", unknown.text);
    assert_eq!(unknown.body["released"], 0);

    let ev = all_events(s).await;
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
}

pub async fn closing_an_expired_session_is_recorded_as_its_expiry(s: &TestServer) {
    let a = s.open("a", 1_000).await;
    let t = take(s, "k", &a).await;
    s.advance(1_000).await;
    let closed = s.delete(&format!("/v1/sessions/{a}")).await;
    assert_eq!(closed.status, 200, "{}", closed.text);
    let ev = all_events(s).await;
    assert!(of_kind(&ev, "session_closed").is_empty(), "{ev:?}");
    let expired = of_kind(&ev, "session_expired");
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0]["released"], json!([{"key": "k", "token": t}]));
    assert_error(&holder(s, "k").await, 404, "lock_free");
    assert_eq!(
        metric(s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        Some(1.0)
    );
}

pub async fn invalid_session_id_in_path_is_400(s: &TestServer) {
    for bad in ["not-a-uuid", "1234", "zzzzzzzz-zzzz-zzzz-zzzz-zzzzzzzzzzzz"] {
        assert_invalid(&session(s, bad).await, "session_id");
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
}

pub async fn sessions_page_by_owner_and_cursor(s: &TestServer) {
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
    let ids = session_ids(&r);
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
    let ids = session_ids(&r);
    assert_eq!(ids.len(), 2, "{}", r.text);
    assert!(!ids.contains(&bob[0]));
    assert!(!ids.contains(&short));
}

pub async fn sessions_list_rejects_bad_query(s: &TestServer) {
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
}

pub async fn next_is_null_on_a_full_last_page(s: &TestServer) {
    let a = s.open("alice", 60_000).await;
    s.open("alice", 60_000).await;
    take(s, "k1", &a).await;
    take(s, "k2", &a).await;
    // Two sessions and two locks, pages of two: the first page is also the last.
    let r = s.get("/v1/sessions?limit=2").await;
    assert_eq!(r.body["sessions"].as_array().unwrap().len(), 2);
    assert!(r.body["next"].is_null(), "{}", r.text);
    let r = s.get("/v1/locks?limit=2").await;
    assert_eq!(r.body["locks"].as_array().unwrap().len(), 2);
    assert!(r.body["next"].is_null(), "{}", r.text);
}
