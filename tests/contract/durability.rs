//! Contract: what survives a restart of the node — pools, seats, jobs, claims and queue order,
//! and the gauges republished from them. (The embedded backend's restart grace, which gives
//! every live session a fresh TTL, is embedded-only: see `tests/restart.rs`.)

use serde_json::json;

use crate::common::*;

pub async fn seats_and_jobs_survive_a_restart(s: &mut TestServer) {
    make_pool(s, "lic", 3).await;
    let a = s.open("a", 60_000).await;
    let b = s.open("b", 60_000).await;
    let w = s.open("w", 60_000).await;
    let ta = seat(s, "lic", &a).await;
    let r = acquire_seat(
        &s.client,
        "lic",
        json!({"session_id": b, "metadata": {"host": "b1"}}),
    )
    .await;
    let tb = r.body["seat_token"].as_u64().unwrap();
    let jd = enqueue(s, "q", json!({"payload": "done"})).await;
    let jf = enqueue(s, "q", json!({"payload": "failed"})).await;
    let jc = enqueue(s, "q", json!({"payload": {"claimed": [1]}, "kind": "k"})).await;
    let jr = enqueue(s, "q", json!({"payload": "recovered", "idempotent": true})).await;
    let j1 = enqueue(s, "q", json!({"payload": "one"})).await;
    let j2 = enqueue(s, "q", json!({"payload": "two"})).await;
    let (c, t) = claim_job(s, "q", &w).await;
    assert_eq!(c, jd);
    assert_eq!(complete(s, &jd, &w, t).await.status, 200);
    let (c, t) = claim_job(s, "q", &w).await;
    assert_eq!(c, jf);
    let r = finish(
        s,
        &jf,
        "fail",
        json!({"session_id": w, "token": t, "reason": "boom"}),
    )
    .await;
    assert_eq!(r.status, 200);
    let (c, tc) = claim_job(s, "q", &w).await;
    assert_eq!(c, jc);
    let d = s.open("dies", 60_000).await;
    assert_eq!(claim_job(s, "q", &d).await.0, jr);
    admin_end(s, &d).await;
    s.advance(5_000).await;

    let pools_before = s.get("/v1/pools").await.body;
    let holders_before = holder_rows(s, "lic").await;
    let all = [&jd, &jf, &jc, &jr, &j1, &j2];
    let mut jobs_before = Vec::new();
    for id in all {
        jobs_before.push(job(s, id).await.body);
    }
    let queue_before = queue_info(s, "q").await.body;
    let events_before = all_events(s).await;
    let w_before = session(s, &w).await.body;

    s.restart().await;

    assert_eq!(s.get("/v1/pools").await.body, pools_before);
    assert_eq!(holder_rows(s, "lic").await, holders_before);
    let mut jobs_after = Vec::new();
    for id in all {
        jobs_after.push(job(s, id).await.body);
    }
    assert_eq!(jobs_after, jobs_before);
    assert_eq!(queue_info(s, "q").await.body, queue_before);
    assert_eq!(counts(s, "q").await, (3, 1, 1, 1));
    let after_events = all_events(s).await;
    assert_eq!(after_events, events_before);
    let w_after = session(s, &w).await;
    assert_eq!(w_after.status, 200, "the worker survived: {}", w_after.text);
    assert_eq!(w_after.body["jobs"], w_before["jobs"]);
    assert_eq!(w_after.body["jobs"], json!([jc]));
    assert_eq!(
        session(s, &b).await.body["seats"],
        json!([{"pool": "lic", "seat_token": tb}])
    );

    // The claim still holds: its token finishes the job.
    let r = finish(
        s,
        &jc,
        "complete",
        json!({"session_id": w, "token": tc, "result": 1}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    // Queue order survived: the recovered job first, then the rest in order.
    let x = s.open("x", 60_000).await;
    let got = claim(s, "q", &x).await;
    assert_eq!(got.body["job_id"], jr.as_str());
    assert_eq!(got.body["recovery_count"], 1);
    assert_eq!(got.body["attempt"], 2);
    assert_eq!(claim_job(s, "q", &x).await.0, j1);
    assert_eq!(claim_job(s, "q", &x).await.0, j2);
    // Seats survived: one left, then full; tokens keep rising.
    let tx = seat(s, "lic", &x).await;
    assert!(tx > got.body["token"].as_u64().unwrap());
    let y = s.open("y", 60_000).await;
    assert_error(
        &acquire_seat(&s.client, "lic", json!({"session_id": y})).await,
        409,
        "pool_exhausted",
    );
    assert_eq!(release_seat(s, "lic", &a, ta).await.status, 200);
    assert!(seat(s, "lic", &y).await > tx);
}

pub async fn pool_and_job_gauges_are_republished_after_a_restart(s: &mut TestServer) {
    make_pool(s, "lic", 3).await;
    let a = s.open("a", 60_000).await;
    seat(s, "lic", &a).await;
    enqueue(s, "q", json!({"payload": 1})).await;
    assert_eq!(
        metric(s, "leasehold_seats_in_use{pool=\"lic\"}").await,
        Some(1.0)
    );
    s.restart().await;
    assert_eq!(
        metric(s, "leasehold_seats_capacity{pool=\"lic\"}").await,
        Some(3.0)
    );
    assert_eq!(
        metric(s, "leasehold_seats_in_use{pool=\"lic\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(s, "leasehold_jobs{queue=\"q\",state=\"queued\"}").await,
        Some(1.0)
    );
}
