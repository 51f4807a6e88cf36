//! Contract: seat pools (floating licences) — create, resize, delete, take and give back
//! seats. They guard against a zombie seat that keeps a full pool full, more holders than
//! capacity, a waiter served out of turn, a shrink that takes a seat away, and a seat that
//! outlives its session.

use serde_json::{Value, json};

use crate::common::*;

pub async fn pool_create_resize_show_list_delete(s: &TestServer) {
    let created = put_pool(
        s,
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

    let shown = pool(s, "licences/cad").await;
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
    let resized = put_pool(s, "licences/cad", json!({"capacity": 2})).await;
    assert_eq!(resized.status, 200, "{}", resized.text);
    assert_eq!(resized.body["created"], false);
    assert_eq!(resized.body["capacity"], 2);
    assert!(resized.body["revision"].as_u64().unwrap() > rev1);
    assert_eq!(pool(s, "licences/cad").await.body["capacity"], 2);

    make_pool(s, "a-first", 1).await;
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
        metric(s, "leasehold_seats_capacity{pool=\"licences/cad\"}").await,
        Some(2.0)
    );
    assert_eq!(
        metric(s, "leasehold_seats_in_use{pool=\"licences/cad\"}").await,
        Some(0.0)
    );

    let deleted = s.delete(&pool_path("licences/cad")).await;
    assert_eq!(deleted.status, 200, "{}", deleted.text);
    assert_eq!(deleted.body["deleted"], true);
    assert!(
        deleted.body["revision"].as_u64().unwrap() > resized.body["revision"].as_u64().unwrap()
    );
    assert_error(&pool(s, "licences/cad").await, 404, "pool_not_found");
    assert_error(
        &s.delete(&pool_path("licences/cad")).await,
        404,
        "pool_not_found",
    );
    assert_error(&pool(s, "never-made").await, 404, "pool_not_found");
    assert_eq!(
        s.get("/v1/pools").await.body,
        json!({"pools": [{"pool": "a-first", "capacity": 1, "in_use": 0}]})
    );
    // A deleted pool's series are gone.
    assert_eq!(
        metric(s, "leasehold_seats_capacity{pool=\"licences/cad\"}").await,
        None
    );

    let ev = all_events(s).await;
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
    let again = put_pool(s, "licences/cad", json!({"capacity": 1})).await;
    assert_eq!(again.status, 201, "{}", again.text);
    assert_eq!(again.body["created"], true);
}

pub async fn resizing_a_pool_keeps_its_created_at(s: &TestServer) {
    let r = put_pool(s, "p", json!({"capacity": 3, "metadata": {"v": 1}})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(pool(s, "p").await.body["created_at"], BASE);
    s.advance(5_000).await;
    make_pool(s, "p", 4).await;
    let shown = pool(s, "p").await;
    assert_eq!(shown.body["capacity"], 4);
    assert_eq!(shown.body["created_at"], BASE, "{}", shown.text);
    // Without new metadata, a resize keeps the old; with some, it is replaced.
    assert_eq!(shown.body["metadata"], json!({"v": 1}), "{}", shown.text);
    let r = put_pool(s, "p", json!({"capacity": 4, "metadata": {"v": 2}})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let shown = pool(s, "p").await;
    assert_eq!(shown.body["metadata"], json!({"v": 2}));
    assert_eq!(shown.body["created_at"], BASE);
}

pub async fn pool_bad_input_is_400_naming_the_field(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    assert_invalid(&put_pool(s, "p", json!({"capacity": 0})).await, "capacity");
    assert_invalid(
        &put_pool(s, "p", json!({"capacity": 1_000_001})).await,
        "capacity",
    );
    assert_invalid(&put_pool(s, "p", json!({"capacity": -1})).await, "capacity");
    assert_invalid(
        &put_pool(s, "p", json!({"capacity": "3"})).await,
        "capacity",
    );
    assert_invalid(
        &put_pool(s, "p", json!({"capacity": 1.5})).await,
        "capacity",
    );
    assert_invalid(
        &put_pool(s, "p", json!({"capacity": 2, "metadata": [1]})).await,
        "metadata",
    );
    assert_invalid(
        &put_pool(s, "p", json!({"capacity": 2, "metadata": "x"})).await,
        "metadata",
    );
    assert_invalid(
        &put_pool(
            s,
            "p",
            json!({"capacity": 2, "metadata": {"k": "v".repeat(5_000)}}),
        )
        .await,
        "metadata",
    );
    assert_invalid_mentions(&put_pool(s, "p", json!({})).await, "capacity");
    // A pool name follows the key rules.
    assert_invalid(
        &put_pool(s, "bad\nname", json!({"capacity": 2})).await,
        "pool",
    );
    // Nothing refused made a pool or an event.
    assert_eq!(s.get("/v1/pools").await.body, json!({"pools": []}));
    assert_eq!(all_events(s).await.len(), 1, "only the session's open");

    // The largest capacity is accepted.
    let big = put_pool(s, "p", json!({"capacity": 1_000_000, "metadata": null})).await;
    assert_eq!(big.status, 201, "{}", big.text);
    assert_eq!(pool(s, "p").await.body["metadata"], Value::Null);

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
    assert_eq!(pool(s, "p").await.body["in_use"], 0);
}

pub async fn missing_and_unknown_fields_are_named_in_field(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    make_pool(s, "p", 1).await;
    // Missing.
    assert_invalid(&put_pool(s, "p", json!({})).await, "capacity");
    assert_invalid(&acquire_seat(&s.client, "p", json!({})).await, "session_id");
    assert_invalid(
        &s.post("/v1/pools/p/release", json!({"session_id": a}))
            .await,
        "seat_token",
    );
    assert_invalid(&enqueue_with(s, "q", json!({"kind": "k"})).await, "payload");
    assert_invalid(&claim_with(&s.client, "q", json!({})).await, "session_id");
    // Unknown.
    assert_invalid(
        &put_pool(s, "p", json!({"capacity": 2, "colour": "red"})).await,
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
        &enqueue_with(s, "q", json!({"payload": 1, "priority": 9})).await,
        "priority",
    );
    assert_invalid(
        &claim_with(&s.client, "q", json!({"session_id": a, "batch": 2})).await,
        "batch",
    );
    assert_eq!(pool(s, "p").await.body["capacity"], 1);
    assert_eq!(counts(s, "q").await, (0, 0, 0, 0));
}

pub async fn seat_acquire_show_release(s: &TestServer) {
    make_pool(s, "cad", 2).await;
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

    let shown = pool(s, "cad").await;
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
    let sess = session(s, &a).await;
    assert_eq!(
        sess.body["seats"],
        json!([{"pool": "cad", "seat_token": t}])
    );
    assert_eq!(
        metric(s, "leasehold_seats_in_use{pool=\"cad\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(s, "leasehold_seats_capacity{pool=\"cad\"}").await,
        Some(2.0)
    );
    assert_eq!(
        metric(s, "leasehold_seat_wait_seconds_count").await,
        Some(1.0)
    );

    // A heartbeat shows in the holder's row.
    s.advance(50).await;
    assert_eq!(s.heartbeat(&a).await.status, 200);
    let h = &pool(s, "cad").await.body["holders"][0];
    assert_eq!(h["last_heartbeat_at"], BASE + 150);

    let rel = release_seat(s, "cad", &a, t).await;
    assert_eq!(rel.status, 200, "{}", rel.text);
    assert_eq!(rel.body["released"], true);
    assert!(rel.body["revision"].as_u64().unwrap() > t);
    let shown = pool(s, "cad").await;
    assert_eq!(shown.body["in_use"], 0);
    assert_eq!(shown.body["holders"], json!([]));
    assert_eq!(session(s, &a).await.body["seats"], json!([]));
    assert_eq!(
        metric(s, "leasehold_seats_in_use{pool=\"cad\"}").await,
        Some(0.0)
    );
    // Released once is released: the token is no longer a seat.
    assert_error(&release_seat(s, "cad", &a, t).await, 409, "not_holder");

    let ev = all_events(s).await;
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
}

pub async fn seat_reacquire_is_idempotent(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let t = seat(s, "p", &a).await;
    // The pool is full, but the holder asking again gets its own seat back, not a refusal,
    // and no second seat.
    for _ in 0..3 {
        let again = acquire_seat(&s.client, "p", json!({"session_id": a, "wait_ms": 1_000})).await;
        assert_eq!(again.status, 200, "{}", again.text);
        assert_eq!(again.body["seat_token"], t);
    }
    let shown = pool(s, "p").await;
    assert_eq!(shown.body["in_use"], 1);
    assert_eq!(shown.body["holders"].as_array().unwrap().len(), 1);
    assert_eq!(shown.body["waiting"], 0);
    assert_eq!(of_kind(&all_events(s).await, "seat_acquired").len(), 1);
    assert_eq!(
        metric(s, "leasehold_seats_in_use{pool=\"p\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(s, "leasehold_seat_acquisitions_refused_total").await,
        Some(0.0)
    );
    // One release gives it back.
    assert_eq!(release_seat(s, "p", &a, t).await.status, 200);
    assert_eq!(pool(s, "p").await.body["in_use"], 0);
}

pub async fn seat_errors(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let gone = s.open("gone", 60_000).await;
    close(s, &gone).await;

    // Unknown pool.
    assert_error(
        &acquire_seat(&s.client, "nope", json!({"session_id": a})).await,
        404,
        "pool_not_found",
    );
    assert_error(&release_seat(s, "nope", &a, 1).await, 404, "pool_not_found");
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

    let ta = seat(s, "p", &a).await;
    let events_before = all_events(s).await;
    // Full: refused at once without wait_ms, with the pool's numbers.
    let full = acquire_seat(&s.client, "p", json!({"session_id": b})).await;
    assert_error(&full, 409, "pool_exhausted");
    assert_eq!(full.body["capacity"], 1);
    assert_eq!(full.body["in_use"], 1);
    let full0 = acquire_seat(&s.client, "p", json!({"session_id": b, "wait_ms": 0})).await;
    assert_error(&full0, 409, "pool_exhausted");
    assert_eq!(
        metric(s, "leasehold_seat_acquisitions_refused_total").await,
        Some(2.0)
    );
    // Not the holder: another session, a wrong token, a gone session.
    assert_error(&release_seat(s, "p", &b, ta).await, 409, "not_holder");
    assert_error(&release_seat(s, "p", &a, ta + 1).await, 409, "not_holder");
    assert_error(&release_seat(s, "p", &a, ta - 1).await, 409, "not_holder");
    assert_error(&release_seat(s, "p", &gone, ta).await, 409, "not_holder");
    // None of that changed anything.
    assert_eq!(all_events(s).await, events_before);
    let shown = pool(s, "p").await;
    assert_eq!(shown.body["holders"][0]["session_id"], a.as_str());
    assert_eq!(shown.body["holders"][0]["seat_token"], ta);
    assert_eq!(shown.body["waiting"], 0);
    assert_eq!(release_seat(s, "p", &a, ta).await.status, 200);
}

pub async fn seat_tokens_share_the_global_counter_with_lock_tokens(s: &TestServer) {
    make_pool(s, "p", 2).await;
    let a = s.open("a", 60_000).await;
    let l1 = s.acquire("k1", &a).await;
    assert_eq!(l1.status, 200, "{}", l1.text);
    let t1 = l1.body["token"].as_u64().unwrap();
    let t2 = seat(s, "p", &a).await;
    let l3 = s.acquire("k2", &a).await;
    let t3 = l3.body["token"].as_u64().unwrap();
    assert!(t1 < t2 && t2 < t3, "{t1} < {t2} < {t3}");
    // The fence answers for locks only: a seat token under the pool's name is not current.
    let f = s.get(&format!("/v1/fence/p?token={t2}")).await;
    assert_eq!(f.status, 200, "{}", f.text);
    assert_eq!(f.body["current"], false, "{}", f.text);
    assert_eq!(f.body["latest"], Value::Null, "{}", f.text);
}

pub async fn seat_waiters_are_served_first_come_first_served(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = seat(s, "p", &a).await;
    let wait_b = spawn_seat(s, "p", &b, 30_000);
    until_pool_waiting(s, "p", 1).await;
    let wait_c = spawn_seat(s, "p", &c, 30_000);
    until_pool_waiting(s, "p", 2).await;
    assert_eq!(pool(s, "p").await.body["in_use"], 1);

    // A releases: the first waiter, B, gets the seat; C still waits.
    assert_eq!(release_seat(s, "p", &a, ta).await.status, 200);
    let got_b = answer(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    let tb = got_b.body["seat_token"].as_u64().unwrap();
    assert!(tb > ta);
    assert_eq!(holders(s, "p").await, vec![b.clone()]);
    assert_eq!(pool(s, "p").await.body["waiting"], 1);
    assert!(!wait_c.is_finished());
    // A newcomer does not overtake C.
    let d = s.open("d", 60_000).await;
    assert_error(
        &acquire_seat(&s.client, "p", json!({"session_id": d})).await,
        409,
        "pool_exhausted",
    );

    // B's session is closed: its seat goes to C.
    let closed = close(s, &b).await;
    assert_eq!(closed.body["seats_released"], 1);
    let got_c = answer(wait_c).await;
    assert_eq!(got_c.status, 200, "{}", got_c.text);
    let tc = got_c.body["seat_token"].as_u64().unwrap();
    assert!(tc > tb);
    assert_eq!(holders(s, "p").await, vec![c.clone()]);
    assert_eq!(pool(s, "p").await.body["waiting"], 0);

    let ev = all_events(s).await;
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
}

pub async fn a_seat_waiter_times_out_with_pool_exhausted(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta = seat(s, "p", &a).await;
    let wait_b = spawn_seat(s, "p", &b, 5_000);
    until_pool_waiting(s, "p", 1).await;
    s.advance(4_999).await;
    // Poke the writer: not yet due.
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    until_pool_waiting(s, "p", 1).await;
    assert!(!wait_b.is_finished());
    s.advance(1).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    let r = answer(wait_b).await;
    assert_error(&r, 409, "pool_exhausted");
    assert_eq!(r.body["capacity"], 1);
    assert_eq!(r.body["in_use"], 1);
    assert_eq!(pool(s, "p").await.body["waiting"], 0);
    // The timed-out waiter is not served later.
    assert_eq!(release_seat(s, "p", &a, ta).await.status, 200);
    assert_eq!(pool(s, "p").await.body["in_use"], 0);
    assert_eq!(of_kind(&all_events(s).await, "seat_acquired").len(), 1);
}

pub async fn a_timed_out_seat_waiter_counts_as_refused(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    seat(s, "p", &a).await;
    let wait_b = spawn_seat(s, "p", &b, 1_000);
    until_pool_waiting(s, "p", 1).await;
    s.advance(1_000).await;
    s.reap().await;
    assert_error(&answer(wait_b).await, 409, "pool_exhausted");
    assert_eq!(
        metric(s, "leasehold_seat_acquisitions_refused_total").await,
        Some(1.0)
    );
}

pub async fn a_seat_waiter_whose_session_ended_is_skipped(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 2_000).await;
    let d = s.open("d", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = seat(s, "p", &a).await;
    let wait_b = spawn_seat(s, "p", &b, 30_000);
    until_pool_waiting(s, "p", 1).await;
    let wait_d = spawn_seat(s, "p", &d, 30_000);
    until_pool_waiting(s, "p", 2).await;
    let wait_c = spawn_seat(s, "p", &c, 30_000);
    until_pool_waiting(s, "p", 3).await;
    // B stops heartbeating and passes its deadline; D is closed while it waits.
    s.advance(2_000).await;
    close(s, &d).await;
    assert!(!wait_b.is_finished() && !wait_d.is_finished());
    // When the seat frees, the two dead waiters are told they are gone and C gets it.
    assert_eq!(release_seat(s, "p", &a, ta).await.status, 200);
    assert_error(&answer(wait_b).await, 404, "session_gone");
    assert_error(&answer(wait_d).await, 404, "session_gone");
    let got = answer(wait_c).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(holders(s, "p").await, vec![c.clone()]);
    assert_eq!(pool(s, "p").await.body["waiting"], 0);
    let ev = all_events(s).await;
    assert_eq!(of_kind(&ev, "session_expired")[0]["session_id"], b.as_str());
    assert_eq!(of_kind(&ev, "seat_acquired").len(), 2);
}

pub async fn deleting_a_pool_answers_its_waiters_pool_not_found(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 1_000).await;
    let b = s.open("b", 60_000).await;
    seat(s, "p", &a).await;
    let wait_b = spawn_seat(s, "p", &b, 30_000);
    until_pool_waiting(s, "p", 1).await;
    // The only holder is past its deadline, so the pool is not in use.
    s.advance(1_000).await;
    let r = s.delete(&pool_path("p")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_error(&answer(wait_b).await, 404, "pool_not_found");
    assert_error(&pool(s, "p").await, 404, "pool_not_found");
    assert_eq!(session(s, &b).await.body["seats"], json!([]));
}

pub async fn waits_are_capped_by_max_wait_ms(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    seat(s, "p", &a).await;
    let wait_seat = spawn_seat(s, "p", &b, 60_000);
    until_pool_waiting(s, "p", 1).await;
    let wait_claim = spawn_claim(s, "q", &b, 60_000);
    until_queue_waiting(s, "q", 1).await;
    s.advance(1_000).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    assert_error(&answer(wait_seat).await, 409, "pool_exhausted");
    assert_eq!(answer(wait_claim).await.status, 204);
}

pub async fn heartbeats_keep_seats_and_claims_alive(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 600_000).await;
    let ta = seat(s, "p", &a).await;
    let id = enqueue(s, "q", json!({"payload": 1, "idempotent": true})).await;
    let (_, t) = claim_job(s, "q", &a).await;
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
        assert_eq!(pool(s, "p").await.body["holders"][0]["state"], "active");
    }
    let shown = job(s, &id).await;
    assert_eq!(shown.body["state"], "claimed");
    assert_eq!(shown.body["claimed_by"], a.as_str());
    assert_eq!(complete(s, &id, &a, t).await.status, 200);
    assert_eq!(release_seat(s, "p", &a, ta).await.status, 200);
    let ev = all_events(s).await;
    assert!(of_kind(&ev, "seat_reclaimed").is_empty());
    assert!(of_kind(&ev, "job_recovered").is_empty());
}

pub async fn concurrent_seat_requests_never_exceed_capacity(s: &TestServer) {
    make_pool(s, "p", 3).await;
    let mut sessions = Vec::new();
    for i in 0..12 {
        sessions.push(s.open(&format!("s{i}"), 60_000).await);
    }
    let tasks: Vec<_> = sessions
        .iter()
        .map(|id| spawn_seat(s, "p", id, 0))
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
    assert_eq!(holders(s, "p").await, ids);
    assert_eq!(pool(s, "p").await.body["in_use"], 3);
}

pub async fn growing_a_pool_serves_its_waiters_in_order(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let d = s.open("d", 60_000).await;
    seat(s, "p", &a).await;
    let wait_b = spawn_seat(s, "p", &b, 30_000);
    until_pool_waiting(s, "p", 1).await;
    let wait_c = spawn_seat(s, "p", &c, 30_000);
    until_pool_waiting(s, "p", 2).await;
    let wait_d = spawn_seat(s, "p", &d, 30_000);
    until_pool_waiting(s, "p", 3).await;
    // Two more seats: the first two waiters get them, the third keeps waiting.
    let grown = put_pool(s, "p", json!({"capacity": 3})).await;
    assert_eq!(grown.status, 200, "{}", grown.text);
    assert_eq!(answer(wait_b).await.status, 200);
    assert_eq!(answer(wait_c).await.status, 200);
    assert_eq!(holders(s, "p").await, sorted(&[&a, &b, &c]));
    assert_eq!(pool(s, "p").await.body["waiting"], 1);
    assert!(!wait_d.is_finished());
    make_pool(s, "p", 4).await;
    assert_eq!(answer(wait_d).await.status, 200);
    assert_eq!(pool(s, "p").await.body["in_use"], 4);
}

pub async fn shrinking_below_use_takes_no_seat_away(s: &TestServer) {
    make_pool(s, "p", 2).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = seat(s, "p", &a).await;
    let tb = seat(s, "p", &b).await;
    let shrunk = put_pool(s, "p", json!({"capacity": 1})).await;
    assert_eq!(shrunk.status, 200, "{}", shrunk.text);
    // Both keep their seats, with their tokens.
    let shown = pool(s, "p").await;
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
    assert!(of_kind(&all_events(s).await, "seat_reclaimed").is_empty());
    assert_eq!(
        metric(s, "leasehold_seats_in_use{pool=\"p\"}").await,
        Some(2.0)
    );
    assert_eq!(
        metric(s, "leasehold_seats_capacity{pool=\"p\"}").await,
        Some(1.0)
    );
    // Holders asking again keep their seat.
    assert_eq!(seat(s, "p", &a).await, ta);
    // A third is refused with the new numbers.
    let refused = acquire_seat(&s.client, "p", json!({"session_id": c})).await;
    assert_error(&refused, 409, "pool_exhausted");
    assert_eq!(refused.body["capacity"], 1);
    assert_eq!(refused.body["in_use"], 2);
    // ...and, waiting, is served only once use falls under the new capacity.
    let wait_c = spawn_seat(s, "p", &c, 30_000);
    until_pool_waiting(s, "p", 1).await;
    assert_eq!(release_seat(s, "p", &a, ta).await.status, 200);
    assert_eq!(pool(s, "p").await.body["in_use"], 1);
    assert_eq!(pool(s, "p").await.body["waiting"], 1);
    assert!(!wait_c.is_finished());
    let d = s.open("d", 60_000).await;
    assert_error(
        &acquire_seat(&s.client, "p", json!({"session_id": d})).await,
        409,
        "pool_exhausted",
    );
    assert_eq!(release_seat(s, "p", &b, tb).await.status, 200);
    let got = answer(wait_c).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(holders(s, "p").await, vec![c.clone()]);
    assert_eq!(pool(s, "p").await.body["in_use"], 1);
}

pub async fn a_zombie_seat_goes_at_once_to_a_contender(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 3_000).await;
    let b = s.open("b", 60_000).await;
    let ta = seat(s, "p", &a).await;
    assert_error(
        &acquire_seat(&s.client, "p", json!({"session_id": b})).await,
        409,
        "pool_exhausted",
    );
    // A stops heartbeating: late first (grace), then past its deadline (expired) but still
    // counted until someone reclaims the seat.
    s.advance(1_001).await;
    assert_eq!(pool(s, "p").await.body["holders"][0]["state"], "grace");
    s.advance(1_999).await;
    let shown = pool(s, "p").await;
    assert_eq!(shown.body["in_use"], 1);
    assert_eq!(shown.body["holders"][0]["state"], "expired");
    assert_eq!(shown.body["holders"][0]["last_heartbeat_at"], Value::Null);
    assert_eq!(shown.body["holders"][0]["session_id"], a.as_str());

    // No reap: the contender is granted the zombie's seat at once.
    let got = acquire_seat(&s.client, "p", json!({"session_id": b})).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let tb = got.body["seat_token"].as_u64().unwrap();
    assert!(tb > ta);
    assert_eq!(holders(s, "p").await, vec![b.clone()]);
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    assert_error(&release_seat(s, "p", &a, ta).await, 409, "not_holder");

    let ev = all_events(s).await;
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
        metric(s, "leasehold_seats_reclaimed_total").await,
        Some(1.0)
    );
    assert_eq!(
        metric(s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(s, "leasehold_seats_in_use{pool=\"p\"}").await,
        Some(1.0)
    );
    // Nothing is left for the reaper.
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
}

pub async fn a_zombie_seat_is_reclaimed_by_the_reaper_and_goes_to_the_first_waiter(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let ta = seat(s, "p", &a).await;
    let wait_b = spawn_seat(s, "p", &b, 30_000);
    until_pool_waiting(s, "p", 1).await;
    let wait_c = spawn_seat(s, "p", &c, 30_000);
    until_pool_waiting(s, "p", 2).await;
    s.advance(2_000).await;
    let reaped = s.reap().await;
    assert_eq!(reaped.status, 200, "{}", reaped.text);
    assert_eq!(reaped.body["sessions_ended"], 1);
    let got = answer(wait_b).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let tb = got.body["seat_token"].as_u64().unwrap();
    assert!(tb > ta);
    assert_eq!(holders(s, "p").await, vec![b.clone()]);
    assert_eq!(pool(s, "p").await.body["waiting"], 1);
    assert_error(&session(s, &a).await, 404, "session_gone");
    let ev = all_events(s).await;
    let reclaimed = of_kind(&ev, "seat_reclaimed");
    assert_eq!(reclaimed.len(), 1);
    assert_eq!(reclaimed[0]["reason"], "expired");
    assert_eq!(reclaimed[0]["token"], ta);
    assert_eq!(
        metric(s, "leasehold_seats_reclaimed_total").await,
        Some(1.0)
    );
    // C is served when B closes.
    close(s, &b).await;
    assert_eq!(answer(wait_c).await.status, 200);
    assert_eq!(
        metric(s, "leasehold_seats_reclaimed_total").await,
        Some(2.0)
    );
}

pub async fn a_zombie_seat_goes_to_the_first_waiter_not_to_a_newcomer(s: &TestServer) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 2_000).await;
    let b = s.open("b", 60_000).await;
    let c = s.open("c", 60_000).await;
    let d = s.open("d", 60_000).await;
    seat(s, "p", &a).await;
    let wait_b = spawn_seat(s, "p", &b, 30_000);
    until_pool_waiting(s, "p", 1).await;
    let wait_c = spawn_seat(s, "p", &c, 30_000);
    until_pool_waiting(s, "p", 2).await;
    s.advance(2_000).await;
    // A newcomer asks for a seat of the full pool whose holder is a zombie. Whether or not
    // it is granted one, B (first in line) must get the zombie's seat before anyone else.
    let dr = acquire_seat(&s.client, "p", json!({"session_id": d})).await;
    if dr.status == 200 {
        let td = dr.body["seat_token"].as_u64().unwrap();
        assert_eq!(release_seat(s, "p", &d, td).await.status, 200);
    } else {
        assert_error(&dr, 409, "pool_exhausted");
    }
    let got_b = answer(wait_b).await;
    assert_eq!(got_b.status, 200, "{}", got_b.text);
    let ev = all_events(s).await;
    let grants: Vec<&str> = of_kind(&ev, "seat_acquired")
        .iter()
        .map(|e| e["session_id"].as_str().unwrap())
        .collect();
    assert_eq!(grants, [a.as_str(), b.as_str()], "B queued first: {ev:?}");
    assert_eq!(holders(s, "p").await, vec![b.clone()]);
    assert!(!wait_c.is_finished());
    close(s, &b).await;
    assert_eq!(answer(wait_c).await.status, 200);
}

pub async fn zombie_seats_serve_the_waiters_first_and_then_a_newcomer(s: &TestServer) {
    make_pool(s, "p", 2).await;
    let z1 = s.open("z1", 1_000).await;
    let z2 = s.open("z2", 1_000).await;
    let b = s.open("b", 60_000).await;
    let n = s.open("n", 60_000).await;
    seat(s, "p", &z1).await;
    seat(s, "p", &z2).await;
    let wait_b = spawn_seat(s, "p", &b, 30_000);
    until_pool_waiting(s, "p", 1).await;
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
    assert_eq!(holders(s, "p").await, sorted(&[&b, &n]));
    assert_eq!(
        metric(s, "leasehold_seats_reclaimed_total").await,
        Some(2.0)
    );
}

pub async fn ending_a_session_reclaims_every_seat_with_its_reason(s: &TestServer) {
    make_pool(s, "p1", 3).await;
    make_pool(s, "p2", 3).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let ta1 = seat(s, "p1", &a).await;
    let ta2 = seat(s, "p2", &a).await;
    let tb = seat(s, "p1", &b).await;
    let mut seats: Vec<Value> = session(s, &a).await.body["seats"]
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

    let closed = close(s, &a).await;
    assert_eq!(closed.body["seats_released"], 2);
    assert_eq!(closed.body["released"], 0);
    assert_eq!(closed.body["jobs_settled"], 0);
    assert_eq!(holders(s, "p1").await, vec![b.clone()]);
    assert_eq!(pool(s, "p2").await.body["in_use"], 0);
    // Closing again changes nothing.
    let again = close(s, &a).await;
    assert_eq!(again.body["seats_released"], 0);

    let ended = admin_end(s, &b).await;
    assert_eq!(ended.body["seats_released"], 1);
    assert_eq!(pool(s, "p1").await.body["in_use"], 0);

    let ev = all_events(s).await;
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
        metric(s, "leasehold_seats_reclaimed_total").await,
        Some(3.0)
    );
}

pub async fn deleting_a_pool_in_use_is_409(s: &TestServer) {
    make_pool(s, "p", 2).await;
    let a = s.open("a", 60_000).await;
    let z = s.open("zombie", 1_000).await;
    let ta = seat(s, "p", &a).await;
    seat(s, "p", &z).await;
    let r = s.delete(&pool_path("p")).await;
    assert_error(&r, 409, "pool_in_use");
    assert!(
        r.body["message"].as_str().unwrap().contains('2'),
        "{}",
        r.text
    );
    assert_eq!(pool(s, "p").await.body["in_use"], 2);
    assert_eq!(release_seat(s, "p", &a, ta).await.status, 200);
    // A holder past its deadline does not keep the pool alive.
    s.advance(1_000).await;
    let r = s.delete(&pool_path("p")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["deleted"], true);
    assert_error(&pool(s, "p").await, 404, "pool_not_found");
    let ev = all_events(s).await;
    assert_eq!(of_kind(&ev, "pool_deleted").len(), 1);
    assert_eq!(of_kind(&ev, "seat_reclaimed")[0]["reason"], "expired");
    assert_error(&session(s, &z).await, 404, "session_gone");
}

pub async fn a_seat_holder_past_its_deadline_cannot_release_and_its_seat_is_reclaimed(
    s: &TestServer,
) {
    make_pool(s, "p", 1).await;
    let a = s.open("a", 1_000).await;
    let ta = seat(s, "p", &a).await;
    s.advance(1_000).await;
    assert_error(&release_seat(s, "p", &a, ta).await, 409, "not_holder");
    assert_eq!(pool(s, "p").await.body["in_use"], 0);
    let ev = all_events(s).await;
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
}
