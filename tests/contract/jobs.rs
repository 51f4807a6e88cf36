//! Contract: job leases — enqueue, claim, complete, fail, release, requeue, recovery. They
//! guard against a job lost or run twice when its worker dies, a late worker finishing a job
//! someone else now holds, a recovery loop that never ends, and payloads mangled or unbounded.

use serde_json::{Value, json};

use crate::common::*;

pub async fn enqueue_claim_complete_round_trip(s: &TestServer) {
    let w = s.open("worker-1", 60_000).await;
    let enq = enqueue_with(
        s,
        "builds",
        json!({"payload": {"repo": "x"}, "kind": "build"}),
    )
    .await;
    assert_eq!(enq.status, 201, "{}", enq.text);
    assert_eq!(enq.body["queue"], "builds");
    let id = enq.body["job_id"].as_str().unwrap().to_string();
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
    let rev = enq.body["revision"].as_u64().unwrap();

    let queued = job(s, &id).await;
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
        queue_info(s, "builds").await.body,
        json!({"queue": "builds", "queued": 1, "claimed": 0, "done": 0, "failed": 0, "waiting": 0})
    );
    assert_eq!(
        metric(s, "leasehold_jobs{queue=\"builds\",state=\"queued\"}").await,
        Some(1.0)
    );

    s.advance(20).await;
    let c = claim(s, "builds", &w).await;
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
    let claimed = job(s, &id).await;
    assert_eq!(claimed.body["state"], "claimed");
    assert_eq!(claimed.body["claimed_by"], w.as_str());
    assert_eq!(claimed.body["token"], token);
    assert_eq!(claimed.body["claimed_at"], BASE + 20);
    assert_eq!(claimed.body["updated_at"], BASE + 20);
    assert_eq!(claimed.body["attempt"], 1);
    assert_eq!(session(s, &w).await.body["jobs"], json!([id]));
    assert_eq!(counts(s, "builds").await, (0, 1, 0, 0));
    assert_eq!(
        metric(s, "leasehold_claim_wait_seconds_count").await,
        Some(1.0)
    );

    s.advance(30).await;
    let done = finish(
        s,
        &id,
        "complete",
        json!({"session_id": w, "token": token, "result": {"artifacts": [1, 2]}}),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.text);
    assert_eq!(done.body["job_id"], id.as_str());
    assert_eq!(done.body["state"], "done");
    assert!(done.body["revision"].as_u64().unwrap() > token);
    let shown = job(s, &id).await;
    assert_eq!(shown.body["state"], "done");
    assert_eq!(shown.body["result"], json!({"artifacts": [1, 2]}));
    assert_eq!(shown.body["updated_at"], BASE + 50);
    assert!(shown.body.get("claimed_by").is_none(), "{}", shown.text);
    assert!(shown.body.get("token").is_none(), "{}", shown.text);
    assert_eq!(session(s, &w).await.body["jobs"], json!([]));
    assert_eq!(counts(s, "builds").await, (0, 0, 1, 0));
    assert_eq!(listed(s, "builds", "done").await, vec![id.clone()]);
    assert_eq!(
        metric(s, "leasehold_jobs{queue=\"builds\",state=\"done\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(s, "leasehold_jobs{queue=\"builds\",state=\"claimed\"}").await,
        Some(0.0)
    );
    // Done is final: the same claim cannot finish it again.
    assert_error(&complete(s, &id, &w, token).await, 409, "stale_token");

    let ev = all_events(s).await;
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
}

pub async fn a_complete_without_result_and_defaults(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let id = enqueue(s, "q", json!({"payload": null})).await;
    let c = claim(s, "q", &w).await;
    assert_eq!(c.body["kind"], Value::Null);
    assert_eq!(c.body["payload"], Value::Null);
    let token = c.body["token"].as_u64().unwrap();
    let done = complete(s, &id, &w, token).await;
    assert_eq!(done.status, 200, "{}", done.text);
    let shown = job(s, &id).await;
    assert_eq!(shown.body["state"], "done");
    assert_eq!(shown.body["result"], Value::Null);
    assert_eq!(shown.body["kind"], Value::Null);
}

pub async fn a_worker_fail_records_its_reason(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let j1 = enqueue(s, "q", json!({"payload": 1, "idempotent": true})).await;
    let j2 = enqueue(s, "q", json!({"payload": 2})).await;
    let (c1, t1) = claim_job(s, "q", &w).await;
    assert_eq!(c1, j1);
    let r = finish(
        s,
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
    let (c2, t2) = claim_job(s, "q", &w).await;
    assert_eq!(c2, j2);
    let r = finish(s, &j2, "fail", json!({"session_id": w, "token": t2})).await;
    assert_eq!(r.status, 200, "{}", r.text);

    let f1 = job(s, &j1).await;
    assert_eq!(f1.body["state"], "failed");
    assert_eq!(f1.body["failure_reason"], "disk full");
    // A worker's own failure is final even for an idempotent job: no recovery.
    assert_eq!(f1.body["recovery_count"], 0);
    assert_eq!(job(s, &j2).await.body["failure_reason"], "failed by worker");
    assert_eq!(counts(s, "q").await, (0, 0, 0, 2));
    let mut failed = listed(s, "q", "failed").await;
    failed.sort();
    assert_eq!(failed, sorted(&[&j1, &j2]));
    // No claim gets a failed job.
    assert_eq!(claim(s, "q", &w).await.status, 204);

    let ev = all_events(s).await;
    let fails = of_kind(&ev, "job_failed");
    assert_eq!(fails.len(), 2);
    assert_eq!(fails[0]["job_id"], j1.as_str());
    assert_eq!(fails[0]["reason"], "disk full");
    assert_eq!(fails[0]["session_id"], w.as_str());
    assert_eq!(fails[0]["token"], t1);
    assert_eq!(fails[1]["reason"], "failed by worker");
    assert_eq!(
        metric(s, "leasehold_jobs{queue=\"q\",state=\"failed\"}").await,
        Some(2.0)
    );
}

pub async fn a_worker_fail_is_counted_in_jobs_failed_total(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let j = enqueue(s, "q", json!({"payload": 1})).await;
    let (_, t) = claim_job(s, "q", &w).await;
    let r = finish(
        s,
        &j,
        "fail",
        json!({"session_id": w, "token": t, "reason": "disk full"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        metric(s, "leasehold_jobs_failed_total{reason=\"worker\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(s, "leasehold_jobs_failed_total{reason=\"not_idempotent\"}").await,
        Some(0.0),
        "every reason is exported from start-up, at zero"
    );
}

pub async fn job_errors(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let other = s.open("other", 60_000).await;
    let gone = s.open("gone", 60_000).await;
    close(s, &gone).await;
    let queued = enqueue(s, "q", json!({"payload": 0})).await;
    let id = enqueue(s, "q", json!({"payload": 1})).await;
    let (first, _) = claim_job(s, "q", &w).await;
    assert_eq!(first, queued, "first in, first out");
    let (second, token) = claim_job(s, "q", &w).await;
    assert_eq!(second, id);
    // Put the first back so one job is queued while the other is claimed.
    let back = finish(
        s,
        &queued,
        "release",
        json!({"session_id": w, "token": job(s, &queued).await.body["token"]}),
    )
    .await;
    assert_eq!(back.status, 200, "{}", back.text);

    let before_job = job(s, &id).await.body;
    let before_events = all_events(s).await;
    for action in ["complete", "fail", "release"] {
        // Unknown job.
        let r = finish(
            s,
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
            let r = finish(s, &id, action, json!({"session_id": who, "token": t})).await;
            assert_error(&r, 409, "stale_token");
        }
        // A job that is queued has no current claim at all.
        let r = finish(s, &queued, action, json!({"session_id": w, "token": token})).await;
        assert_error(&r, 409, "stale_token");
        // Bad job id in the path, bad session id or token in the body.
        assert_invalid(
            &finish(
                s,
                "not-a-job",
                action,
                json!({"session_id": w, "token": token}),
            )
            .await,
            "job_id",
        );
        assert_invalid(
            &finish(
                s,
                &id,
                action,
                json!({"session_id": "nope", "token": token}),
            )
            .await,
            "session_id",
        );
        assert_invalid(
            &finish(s, &id, action, json!({"session_id": w, "token": "x"})).await,
            "token",
        );
        assert_invalid_mentions(
            &finish(s, &id, action, json!({"session_id": w})).await,
            "token",
        );
    }
    // None of it changed anything.
    assert_eq!(job(s, &id).await.body, before_job);
    assert_eq!(all_events(s).await, before_events);
    assert_error(
        &s.get(&format!("/v1/jobs/{}", random_id())).await,
        404,
        "job_not_found",
    );
    assert_invalid(&s.get("/v1/jobs/123").await, "job_id");

    // Claims by a gone, unknown or malformed session.
    assert_error(&claim(s, "q", &gone).await, 404, "session_gone");
    assert_error(&claim(s, "q", &random_id()).await, 404, "session_gone");
    assert_invalid(&claim(s, "q", "nope").await, "session_id");
    assert_invalid(
        &claim_with(&s.client, "q", json!({"session_id": w, "wait_ms": "x"})).await,
        "wait_ms",
    );
    assert_eq!(counts(s, "q").await, (1, 1, 0, 0));

    // Requeue needs a failed job.
    assert_error(&requeue(s, &id).await, 409, "job_not_failed");
    assert_error(&requeue(s, &queued).await, 409, "job_not_failed");
    assert_error(&requeue(s, &random_id()).await, 404, "job_not_found");
    assert_invalid(&requeue(s, "zzz").await, "job_id");
    assert_eq!(all_events(s).await, before_events);
    // The right claim still finishes it.
    assert_eq!(complete(s, &id, &w, token).await.status, 200);
}

pub async fn claim_with_no_job_is_204(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let r = claim(s, "empty", &w).await;
    assert_eq!(r.status, 204, "{}", r.text);
    assert!(r.text.is_empty(), "{}", r.text);
    let r = claim_with(&s.client, "empty", json!({"session_id": w, "wait_ms": 0})).await;
    assert_eq!(r.status, 204, "{}", r.text);
    // A queue nobody used reads as empty.
    assert_eq!(
        queue_info(s, "empty").await.body,
        json!({"queue": "empty", "queued": 0, "claimed": 0, "done": 0, "failed": 0, "waiting": 0})
    );
    // All jobs taken: 204 again.
    enqueue(s, "q", json!({"payload": 1})).await;
    assert_eq!(claim(s, "q", &w).await.status, 200);
    assert_eq!(claim(s, "q", &w).await.status, 204);
    assert_eq!(
        metric(s, "leasehold_claim_wait_seconds_count").await,
        Some(1.0),
        "only claims that got a job are timed"
    );
}

pub async fn a_claim_waits_for_an_enqueue(s: &TestServer) {
    let w1 = s.open("w1", 60_000).await;
    let w2 = s.open("w2", 60_000).await;
    let wait1 = spawn_claim(s, "q", &w1, 30_000);
    until_queue_waiting(s, "q", 1).await;
    let wait2 = spawn_claim(s, "q", &w2, 30_000);
    until_queue_waiting(s, "q", 2).await;
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
    assert_eq!(job(s, &id).await.body["claimed_by"], w1.as_str());
    assert_eq!(queue_info(s, "q").await.body["waiting"], 1);
    assert!(!wait2.is_finished());

    // The second waiter gets the next one.
    let id2 = enqueue(s, "q", json!({"payload": 2})).await;
    let got2 = answer(wait2).await;
    assert_eq!(got2.body["job_id"], id2.as_str());
    assert_eq!(queue_info(s, "q").await.body["waiting"], 0);
    assert_eq!(counts(s, "q").await, (0, 2, 0, 0));
}

pub async fn a_claim_waiter_whose_session_ended_is_skipped(s: &TestServer) {
    let w1 = s.open("w1", 60_000).await;
    let w2 = s.open("w2", 60_000).await;
    let wait1 = spawn_claim(s, "q", &w1, 30_000);
    until_queue_waiting(s, "q", 1).await;
    let wait2 = spawn_claim(s, "q", &w2, 30_000);
    until_queue_waiting(s, "q", 2).await;
    close(s, &w1).await;
    let id = enqueue(s, "q", json!({"payload": 1})).await;
    assert_error(&answer(wait1).await, 404, "session_gone");
    let got = answer(wait2).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.body["job_id"], id.as_str());
    assert_eq!(job(s, &id).await.body["claimed_by"], w2.as_str());
    assert_eq!(counts(s, "q").await, (0, 1, 0, 0));
}

pub async fn concurrent_claims_hand_each_job_out_once(s: &TestServer) {
    let mut jobs = Vec::new();
    for i in 0..5 {
        jobs.push(enqueue(s, "q", json!({"payload": i})).await);
    }
    let mut workers = Vec::new();
    for i in 0..12 {
        workers.push(s.open(&format!("w{i}"), 60_000).await);
    }
    let tasks: Vec<_> = workers.iter().map(|w| spawn_claim(s, "q", w, 0)).collect();
    let mut got = Vec::new();
    let mut empty = 0;
    for (w, t) in workers.iter().zip(tasks) {
        let r = answer(t).await;
        match r.status.as_u16() {
            200 => {
                let id = r.body["job_id"].as_str().unwrap().to_string();
                assert_eq!(job(s, &id).await.body["claimed_by"], w.as_str());
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
    assert_eq!(counts(s, "q").await, (0, 5, 0, 0));
}

pub async fn a_waiting_claim_times_out_with_204(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let wait = spawn_claim(s, "q", &w, 2_000);
    until_queue_waiting(s, "q", 1).await;
    s.advance(1_999).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    until_queue_waiting(s, "q", 1).await;
    assert!(!wait.is_finished());
    s.advance(1).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
    let r = answer(wait).await;
    assert_eq!(r.status, 204, "{}", r.text);
    assert_eq!(queue_info(s, "q").await.body["waiting"], 0);
    // A job enqueued later stays queued for the next claim.
    let id = enqueue(s, "q", json!({"payload": 1})).await;
    assert_eq!(job(s, &id).await.body["state"], "queued");
}

pub async fn a_recovered_job_goes_to_its_new_claimant_and_the_old_worker_is_fenced_off(
    s: &TestServer,
) {
    let w1 = s.open("w1", 2_000).await;
    let w2 = s.open("w2", 60_000).await;
    let id = enqueue(s, "q", json!({"payload": {"scan": 7}, "idempotent": true})).await;
    let c1 = claim(s, "q", &w1).await;
    let t1 = c1.body["token"].as_u64().unwrap();
    assert_eq!(c1.body["attempt"], 1);
    // Nothing to take while it is claimed.
    assert_eq!(claim(s, "q", &w2).await.status, 204);

    // The worker dies: it stops heartbeating and is reaped.
    s.advance(2_000).await;
    let reaped = s.reap().await;
    assert_eq!(reaped.body["sessions_ended"], 1, "{}", reaped.text);
    let recovered = job(s, &id).await;
    assert_eq!(recovered.body["state"], "queued");
    assert_eq!(recovered.body["recovery_count"], 1);
    assert_eq!(recovered.body["attempt"], 1);
    assert!(recovered.body.get("claimed_by").is_none());
    assert_eq!(counts(s, "q").await, (1, 0, 0, 0));
    let ev = all_events(s).await;
    let rec = of_kind(&ev, "job_recovered");
    assert_eq!(rec.len(), 1);
    assert_eq!(rec[0]["job_id"], id.as_str());
    assert_eq!(rec[0]["session_id"], w1.as_str());
    assert_eq!(rec[0]["queue"], "q");
    assert_eq!(
        rec[0]["token"], t1,
        "the event names the claim that was lost"
    );
    assert_eq!(metric(s, "leasehold_jobs_recovered_total").await, Some(1.0));

    // The new claimant gets it with a higher token.
    let c2 = claim(s, "q", &w2).await;
    assert_eq!(c2.status, 200, "{}", c2.text);
    assert_eq!(c2.body["job_id"], id.as_str());
    assert_eq!(c2.body["attempt"], 2);
    assert_eq!(c2.body["recovery_count"], 1);
    assert_eq!(c2.body["payload"], json!({"scan": 7}));
    let t2 = c2.body["token"].as_u64().unwrap();
    assert!(t2 > t1);

    // The old worker comes back late: every finish is refused and changes nothing.
    let before = job(s, &id).await.body;
    assert_error(&complete(s, &id, &w1, t1).await, 409, "stale_token");
    assert_error(
        &finish(s, &id, "fail", json!({"session_id": w1, "token": t1})).await,
        409,
        "stale_token",
    );
    assert_error(
        &finish(s, &id, "release", json!({"session_id": w1, "token": t1})).await,
        409,
        "stale_token",
    );
    // Even with the new claimant's session id, the old token is stale.
    assert_error(&complete(s, &id, &w2, t1).await, 409, "stale_token");
    assert_eq!(job(s, &id).await.body, before);

    let done = finish(
        s,
        &id,
        "complete",
        json!({"session_id": w2, "token": t2, "result": "ok"}),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.text);
    let shown = job(s, &id).await;
    assert_eq!(shown.body["state"], "done");
    assert_eq!(shown.body["result"], "ok");
    assert_eq!(counts(s, "q").await, (0, 0, 1, 0));
    let completed = of_kind(&all_events(s).await, "job_completed")
        .into_iter()
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0]["session_id"], w2.as_str());
    assert_eq!(completed[0]["token"], t2);
}

pub async fn a_late_worker_past_its_deadline_cannot_finish_and_its_job_is_recovered(
    s: &TestServer,
) {
    let w = s.open("w", 1_000).await;
    let id = enqueue(s, "q", json!({"payload": 1, "idempotent": true})).await;
    let (_, t) = claim_job(s, "q", &w).await;
    s.advance(1_000).await;
    // No reap: the worker is past its deadline, so its claim is gone.
    assert_error(&complete(s, &id, &w, t).await, 409, "stale_token");
    let shown = job(s, &id).await;
    assert_eq!(shown.body["state"], "queued");
    assert_eq!(shown.body["recovery_count"], 1);
    assert_error(&session(s, &w).await, 404, "session_gone");
    assert_eq!(of_kind(&all_events(s).await, "job_recovered").len(), 1);
    assert_error(&claim(s, "q", &w).await, 404, "session_gone");
    assert_eq!(s.reap().await.body["sessions_ended"], 0);
}

pub async fn a_non_idempotent_job_fails_when_its_worker_dies(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let w2 = s.open("w2", 60_000).await;
    let id = enqueue(s, "q", json!({"payload": {"charge": 10}})).await;
    assert_eq!(job(s, &id).await.body["idempotent"], false);
    let (_, t) = claim_job(s, "q", &w).await;
    let closed = close(s, &w).await;
    assert_eq!(closed.body["jobs_settled"], 1);
    assert_eq!(closed.body["seats_released"], 0);
    assert_eq!(closed.body["released"], 0);
    assert!(closed.body["revision"].as_u64().unwrap() > t);
    let shown = job(s, &id).await;
    assert_eq!(shown.body["state"], "failed");
    assert_eq!(shown.body["failure_reason"], "not_idempotent");
    assert_eq!(shown.body["recovery_count"], 0);
    assert_eq!(counts(s, "q").await, (0, 0, 0, 1));
    assert_eq!(listed(s, "q", "failed").await, vec![id.clone()]);
    // It is not run again.
    assert_eq!(claim(s, "q", &w2).await.status, 204);
    let ev = all_events(s).await;
    let failed = of_kind(&ev, "job_failed");
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["job_id"], id.as_str());
    assert_eq!(failed[0]["reason"], "not_idempotent");
    assert_eq!(failed[0]["session_id"], w.as_str());
    assert_eq!(failed[0]["token"], t);
    assert!(of_kind(&ev, "job_recovered").is_empty());
    assert_eq!(
        metric(s, "leasehold_jobs_failed_total{reason=\"not_idempotent\"}").await,
        Some(1.0)
    );
    assert_eq!(metric(s, "leasehold_jobs_recovered_total").await, Some(0.0));
}

pub async fn the_recovery_cap_fails_a_job_and_an_admin_requeue_sends_it_back(s: &TestServer) {
    let id = enqueue(
        s,
        "q",
        json!({"payload": "p", "idempotent": true, "max_recoveries": 1}),
    )
    .await;
    assert_eq!(job(s, &id).await.body["max_recoveries"], 1);
    // First worker death (an operator ends its session): recovered.
    let w1 = s.open("w1", 60_000).await;
    let (_, t1) = claim_job(s, "q", &w1).await;
    let ended = admin_end(s, &w1).await;
    assert_eq!(ended.body["jobs_settled"], 1);
    let shown = job(s, &id).await;
    assert_eq!(shown.body["state"], "queued");
    assert_eq!(shown.body["recovery_count"], 1);
    // Second worker death (it closes without finishing): the cap is reached, it fails.
    let w2 = s.open("w2", 60_000).await;
    let c2 = claim(s, "q", &w2).await;
    assert_eq!(c2.body["recovery_count"], 1);
    assert_eq!(c2.body["attempt"], 2);
    let t2 = c2.body["token"].as_u64().unwrap();
    close(s, &w2).await;
    let shown = job(s, &id).await;
    assert_eq!(shown.body["state"], "failed");
    assert_eq!(shown.body["failure_reason"], "max_recoveries_exceeded");
    assert_eq!(shown.body["recovery_count"], 1);
    assert_eq!(counts(s, "q").await, (0, 0, 0, 1));

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

    let ev = all_events(s).await;
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
            s,
            "leasehold_jobs_failed_total{reason=\"max_recoveries_exceeded\"}"
        )
        .await,
        Some(1.0)
    );

    // An operator sends it back: queued, recovery count reset, and a claim gets it.
    let r = requeue(s, &id).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["job_id"], id.as_str());
    assert_eq!(r.body["state"], "queued");
    assert!(r.body["revision"].as_u64().unwrap() > t2);
    let shown = job(s, &id).await;
    assert_eq!(shown.body["state"], "queued");
    assert_eq!(shown.body["recovery_count"], 0);
    assert!(shown.body.get("failure_reason").is_none(), "{}", shown.text);
    assert_eq!(listed(s, "q", "failed").await, Vec::<String>::new());
    assert_eq!(listed(s, "q", "queued").await, vec![id.clone()]);
    let requeued = of_kind(&all_events(s).await, "job_requeued")
        .into_iter()
        .cloned()
        .collect::<Vec<_>>();
    assert_eq!(requeued.len(), 1);
    assert_eq!(requeued[0]["job_id"], id.as_str());
    assert_eq!(requeued[0]["queue"], "q");
    let w3 = s.open("w3", 60_000).await;
    let c3 = claim(s, "q", &w3).await;
    assert_eq!(c3.status, 200, "{}", c3.text);
    assert_eq!(c3.body["job_id"], id.as_str());
    assert_eq!(c3.body["attempt"], 3);
    assert_eq!(c3.body["recovery_count"], 0);
    // Requeued twice? Only a failed job can be.
    assert_error(&requeue(s, &id).await, 409, "job_not_failed");
    // Its recoveries start over: the next death recovers it again.
    admin_end(s, &w3).await;
    assert_eq!(job(s, &id).await.body["state"], "queued");
}

pub async fn a_requeued_job_goes_to_the_tail_of_its_queue(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let j1 = enqueue(s, "q", json!({"payload": 1})).await;
    let (_, t) = claim_job(s, "q", &w).await;
    let r = finish(s, &j1, "fail", json!({"session_id": w, "token": t})).await;
    assert_eq!(r.status, 200);
    let j2 = enqueue(s, "q", json!({"payload": 2})).await;
    assert_eq!(requeue(s, &j1).await.status, 200);
    assert_eq!(counts(s, "q").await, (2, 0, 0, 0));
    assert_eq!(claim_job(s, "q", &w).await.0, j2);
    let again = claim(s, "q", &w).await;
    assert_eq!(again.body["job_id"], j1.as_str());
    assert_eq!(again.body["attempt"], 2);
}

pub async fn a_recovered_job_goes_to_the_head_of_its_queue(s: &TestServer) {
    let j1 = enqueue(s, "q", json!({"payload": 1, "idempotent": true})).await;
    let j2 = enqueue(s, "q", json!({"payload": 2, "idempotent": true})).await;
    let w1 = s.open("w1", 1_000).await;
    let w2 = s.open("w2", 60_000).await;
    let (c, _) = claim_job(s, "q", &w1).await;
    assert_eq!(c, j1);
    s.advance(1_000).await;
    s.reap().await;
    assert_eq!(counts(s, "q").await, (2, 0, 0, 0));
    let j3 = enqueue(s, "q", json!({"payload": 3})).await;
    // j1 comes back before j2, which was enqueued before j1 was recovered.
    assert_eq!(claim_job(s, "q", &w2).await.0, j1);
    assert_eq!(claim_job(s, "q", &w2).await.0, j2);
    assert_eq!(claim_job(s, "q", &w2).await.0, j3);
    assert_eq!(claim(s, "q", &w2).await.status, 204);
}

pub async fn release_hands_a_job_back_without_counting_a_recovery(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let j1 = enqueue(
        s,
        "q",
        json!({"payload": 1, "idempotent": true, "max_recoveries": 0}),
    )
    .await;
    let j2 = enqueue(s, "q", json!({"payload": 2})).await;
    let (c, t) = claim_job(s, "q", &w).await;
    assert_eq!(c, j1);
    let r = finish(s, &j1, "release", json!({"session_id": w, "token": t})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["state"], "queued");
    assert_eq!(r.body["job_id"], j1.as_str());
    let shown = job(s, &j1).await;
    assert_eq!(shown.body["state"], "queued");
    assert_eq!(shown.body["recovery_count"], 0);
    assert_eq!(shown.body["attempt"], 1);
    assert!(shown.body.get("claimed_by").is_none());
    assert_eq!(session(s, &w).await.body["jobs"], json!([]));
    assert_eq!(counts(s, "q").await, (2, 0, 0, 0));
    // The released token is spent.
    assert_error(&complete(s, &j1, &w, t).await, 409, "stale_token");
    // Handed back to the head: the next claim gets it again, as a new attempt.
    let again = claim(s, "q", &w).await;
    assert_eq!(again.body["job_id"], j1.as_str());
    assert_eq!(again.body["attempt"], 2);
    assert_eq!(again.body["recovery_count"], 0);
    let t2 = again.body["token"].as_u64().unwrap();
    assert!(t2 > t);
    assert_eq!(complete(s, &j1, &w, t2).await.status, 200);
    assert_eq!(claim_job(s, "q", &w).await.0, j2);

    let ev = all_events(s).await;
    let rel = of_kind(&ev, "job_released");
    assert_eq!(rel.len(), 1);
    assert_eq!(rel[0]["job_id"], j1.as_str());
    assert_eq!(rel[0]["session_id"], w.as_str());
    assert_eq!(rel[0]["token"], t);
    assert!(of_kind(&ev, "job_recovered").is_empty());
    assert_eq!(metric(s, "leasehold_jobs_recovered_total").await, Some(0.0));
}

pub async fn payload_round_trips_and_its_size_is_limited(s: &TestServer) {
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
    let id = enqueue(s, "q", json!({"payload": payload, "kind": "ci/build"})).await;
    assert_eq!(job(s, &id).await.body["payload"], payload);
    let c = claim(s, "q", &w).await;
    assert_eq!(c.body["payload"], payload);
    assert_eq!(c.body["kind"], "ci/build");
    for scalar in [json!(42), json!("text"), json!([1, [2, [3]]])] {
        let id = enqueue(s, "scalars", json!({"payload": scalar})).await;
        assert_eq!(job(s, &id).await.body["payload"], scalar);
    }
    // A payload of 70 KiB: the job routes read it, and refuse it by its own rule.
    let r = enqueue_with(s, "q", json!({"payload": "x".repeat(70 * 1024)})).await;
    assert_invalid(&r, "payload");
    assert_eq!(counts(s, "q").await, (0, 1, 0, 0));
}

pub async fn a_payload_or_result_over_64_kib_is_refused(s: &TestServer) {
    assert_eq!(s.config.max_body_bytes, 64 * 1024);
    // A JSON string of n characters is n + 2 bytes of payload: exactly 64 KiB is accepted.
    let at_limit = "x".repeat(64 * 1024 - 2);
    let id = enqueue(s, "q", json!({"payload": at_limit})).await;
    assert_eq!(job(s, &id).await.body["payload"], at_limit.as_str());
    let w = s.open("w", 60_000).await;
    let c = claim(s, "q", &w).await;
    assert_eq!(c.body["payload"], at_limit.as_str());
    let t = c.body["token"].as_u64().unwrap();
    // One byte more is refused, naming the payload.
    let over = "x".repeat(64 * 1024 - 1);
    assert_invalid(
        &enqueue_with(s, "q", json!({"payload": over})).await,
        "payload",
    );
    // Far more is over the body limit: 413 before anything is parsed.
    let huge = "x".repeat(256 * 1024);
    let r = enqueue_with(s, "q", json!({"payload": huge})).await;
    assert_error(&r, 413, "payload_too_large");
    // The result has the same limit.
    let r = finish(
        s,
        &id,
        "complete",
        json!({"session_id": w, "token": t, "result": "y".repeat(64 * 1024)}),
    )
    .await;
    assert_invalid(&r, "result");
    assert_eq!(job(s, &id).await.body["state"], "claimed");
    // Routes without a payload keep the server's body limit.
    let r = put_pool(
        s,
        "p",
        json!({"capacity": 1, "metadata": {"k": "v".repeat(70 * 1024)}}),
    )
    .await;
    assert_error(&r, 413, "payload_too_large");
    assert_eq!(counts(s, "q").await, (0, 1, 0, 0));
    assert_eq!(of_kind(&all_events(s).await, "job_enqueued").len(), 1);
}

pub async fn job_bad_input_is_400_naming_the_field(s: &TestServer) {
    let enq = |body: Value| enqueue_with(s, "q", body);
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
    assert_eq!(counts(s, "q").await, (0, 0, 0, 0));
    assert!(all_events(s).await.is_empty());
    // The boundaries are accepted.
    let ok = enq(json!({"payload": 1, "max_recoveries": 1_000, "kind": "k".repeat(256)})).await;
    assert_eq!(ok.status, 201, "{}", ok.text);

    assert_invalid(&list_query(s, "state=bogus").await, "state");
    assert_invalid(&list_query(s, "limit=0").await, "limit");
    assert_invalid(&list_query(s, "limit=1001").await, "limit");
    assert_invalid(&list_query(s, "limit=x").await, "limit");
    assert_invalid(&list_query(s, "after=not-a-job").await, "after");
    assert_error(&list_query(s, "colour=red").await, 400, "invalid_request");
    assert_eq!(list_query(s, "state=queued&limit=1000").await.status, 200);
}

pub async fn job_lists_page_by_cursor(s: &TestServer) {
    let w = s.open("w", 60_000).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let id = enqueue(s, "q", json!({"payload": i})).await;
        let (c, t) = claim_job(s, "q", &w).await;
        assert_eq!(c, id);
        let r = finish(s, &id, "fail", json!({"session_id": w, "token": t})).await;
        assert_eq!(r.status, 200);
        ids.push(id);
    }
    // Another queue's failures are not listed.
    let other = enqueue(s, "other", json!({"payload": 0})).await;
    let (_, t) = claim_job(s, "other", &w).await;
    finish(s, &other, "fail", json!({"session_id": w, "token": t})).await;
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
    assert_eq!(listed(s, "q", "queued").await, Vec::<String>::new());
    assert_eq!(listed(s, "q", "claimed").await, Vec::<String>::new());
}

pub async fn finished_jobs_are_purged_after_their_retention(s: &TestServer) {
    let w = s.open("w", 600_000).await;
    let done = enqueue(s, "q", json!({"payload": "d"})).await;
    let failed = enqueue(s, "q", json!({"payload": "f"})).await;
    let (_, t) = claim_job(s, "q", &w).await;
    assert_eq!(complete(s, &done, &w, t).await.status, 200);
    let (_, t) = claim_job(s, "q", &w).await;
    let r = finish(s, &failed, "fail", json!({"session_id": w, "token": t})).await;
    assert_eq!(r.status, 200);
    let queued = enqueue(s, "q", json!({"payload": "q"})).await;
    s.advance(9_999).await;
    s.reap().await;
    assert_eq!(counts(s, "q").await, (1, 0, 1, 1), "not yet");
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
    assert_error(&requeue(s, &failed).await, 404, "job_not_found");
    assert_eq!(counts(s, "q").await, (1, 0, 0, 0));
    assert_eq!(listed(s, "q", "done").await, Vec::<String>::new());
    assert_eq!(listed(s, "q", "failed").await, Vec::<String>::new());
    // Unfinished jobs are kept, however old.
    assert_eq!(job(s, &queued).await.body["state"], "queued");
    assert_eq!(claim_job(s, "q", &w).await.0, queued);
}

pub async fn purged_jobs_leave_the_job_gauges(s: &TestServer) {
    let w = s.open("w", 600_000).await;
    let id = enqueue(s, "q", json!({"payload": 1})).await;
    let (_, t) = claim_job(s, "q", &w).await;
    assert_eq!(complete(s, &id, &w, t).await.status, 200);
    assert_eq!(
        metric(s, "leasehold_jobs{queue=\"q\",state=\"done\"}").await,
        Some(1.0)
    );
    s.advance(10_001).await;
    s.reap().await;
    assert_eq!(counts(s, "q").await, (0, 0, 0, 0));
    let gauge = metric(s, "leasehold_jobs{queue=\"q\",state=\"done\"}").await;
    assert!(gauge.is_none() || gauge == Some(0.0), "{gauge:?}");
}
