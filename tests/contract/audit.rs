//! Contract: the audit log and the reaper — every ending explained by one event, cursors and
//! pages, retention trimmed in bounded batches, operator ends, and the dry run that changes
//! nothing and says exactly what the real reap then does.

use serde_json::{Value, json};

use crate::common::*;

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

pub async fn events_cover_every_kind_and_page_by_cursor(s: &TestServer) {
    let a = s.open("alice", 60_000).await;
    let b = s.open("bob", 60_000).await;
    let c = s.open("carol", 1_000).await;
    s.advance(10).await;
    let t1 = take(s, "k1", &a).await;
    assert_eq!(s.release("k1", &a, t1).await.status, 200);
    let t2 = take(s, "k2", &a).await;
    assert_eq!(s.delete(&format!("/v1/sessions/{a}")).await.status, 200);
    let t3 = take(s, "k3", &b).await;
    assert_eq!(
        s.post(&format!("/v1/admin/sessions/{b}/end"), json!({}))
            .await
            .status,
        200
    );
    let t4 = take(s, "k4", &c).await;
    s.advance(1_000).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 1);

    let ev = all_events(s).await;
    let kinds: Vec<&str> = ev.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "session_opened",
            "session_opened",
            "session_opened",
            "lock_acquired",
            "lock_released",
            "lock_acquired",
            "session_closed",
            "lock_acquired",
            "session_ended_by_admin",
            "lock_acquired",
            "session_expired",
        ]
    );
    let seqs: Vec<u64> = ev.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] > w[0]), "{seqs:?}");

    assert_eq!(ev[0]["session_id"], a.as_str());
    assert_eq!(ev[0]["owner"], "alice");
    assert_eq!(ev[0]["at"], BASE);
    assert_eq!(ev[2]["owner"], "carol");
    assert_eq!(ev[3]["session_id"], a.as_str());
    assert_eq!(ev[3]["key"], "k1");
    assert_eq!(ev[3]["token"], t1);
    assert_eq!(ev[3]["at"], BASE + 10);
    assert_eq!(ev[4]["key"], "k1");
    assert_eq!(ev[4]["token"], t1);
    assert_eq!(ev[4]["session_id"], a.as_str());
    assert_eq!(ev[6]["session_id"], a.as_str());
    assert_eq!(ev[6]["reason"], "closed");
    assert_eq!(ev[6]["released"], json!([{"key": "k2", "token": t2}]));
    assert_eq!(ev[8]["session_id"], b.as_str());
    assert_eq!(ev[8]["reason"], "admin");
    assert_eq!(ev[8]["released"], json!([{"key": "k3", "token": t3}]));
    assert_eq!(ev[10]["session_id"], c.as_str());
    assert_eq!(ev[10]["reason"], "expired");
    assert_eq!(ev[10]["released"], json!([{"key": "k4", "token": t4}]));
    assert_eq!(ev[10]["at"], BASE + 1_010);

    // Three at a time, following `next`.
    let mut paged = Vec::new();
    let mut after = 0;
    let mut pages = 0;
    loop {
        let r = s.get(&format!("/v1/events?after={after}&limit=3")).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let page = r.body["events"].as_array().unwrap();
        assert!(page.len() <= 3);
        let next = r.body["next"].as_u64().unwrap();
        if page.is_empty() {
            assert_eq!(next, after, "with nothing new, next stays at after");
            break;
        }
        assert_eq!(Some(next), page.last().unwrap()["seq"].as_u64());
        paged.extend(page.iter().cloned());
        after = next;
        pages += 1;
        assert!(pages < 10);
    }
    assert_eq!(pages, 4);
    assert_eq!(paged, ev);
    // A cursor in the middle.
    let r = s.get(&format!("/v1/events?after={}", seqs[7])).await;
    let tail: Vec<u64> = r.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(tail, seqs[8..]);
    // The default page holds everything here.
    assert_eq!(
        s.get("/v1/events").await.body["events"]
            .as_array()
            .unwrap()
            .len(),
        11
    );
}

pub async fn events_reject_bad_query(s: &TestServer) {
    s.open("alice", 60_000).await;
    assert_invalid(&s.get("/v1/events?limit=0").await, "limit");
    assert_invalid(&s.get("/v1/events?limit=10001").await, "limit");
    assert_invalid(&s.get("/v1/events?after=abc").await, "after");
    assert_invalid(&s.get("/v1/events?after=-1").await, "after");
    assert_error(&s.get("/v1/events?since=1").await, 400, "invalid_request");
    let ok = s.get("/v1/events?limit=10000").await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    assert_eq!(ok.body["events"].as_array().unwrap().len(), 1);
    let ok = s.get("/v1/events?limit=1000&after=0").await;
    assert_eq!(ok.status, 200);
}

pub async fn events_are_trimmed_by_retention_in_bounded_batches(s: &TestServer) {
    for i in 0..5 {
        s.open(&format!("o{i}"), 60_000).await;
    }
    assert_eq!(all_events(s).await.len(), 5);
    // Not old enough yet: a reaper pass trims nothing.
    s.advance(1_000).await;
    s.reap().await;
    assert_eq!(all_events(s).await.len(), 5);
    s.advance(1).await;
    let seqs = |ev: &[Value]| {
        ev.iter()
            .map(|e| e["seq"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    s.reap().await;
    assert_eq!(seqs(&all_events(s).await), [3, 4, 5], "two per pass");
    assert_eq!(metric(s, "leasehold_events_trimmed_total").await, Some(2.0));
    s.reap().await;
    assert_eq!(seqs(&all_events(s).await), [5]);
    s.reap().await;
    assert!(all_events(s).await.is_empty());
    assert_eq!(metric(s, "leasehold_events_trimmed_total").await, Some(5.0));
    // Sequence numbers go on from where they were.
    s.open("later", 60_000).await;
    assert_eq!(seqs(&all_events(s).await), [6]);
    let r = s.get("/v1/events?after=0").await;
    assert_eq!(r.body["next"], 6);
}

pub async fn admin_end_is_audited_and_releases(s: &TestServer) {
    let a = s.open("a", 60_000).await;
    let t = take(s, "k", &a).await;
    let r = s
        .post(&format!("/v1/admin/sessions/{a}/end"), json!({}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["released"], 1);
    assert!(r.body["revision"].as_u64().unwrap() > t);
    assert_error(&holder(s, "k").await, 404, "lock_free");
    assert_error(&s.heartbeat(&a).await, 404, "session_gone");
    let again = s
        .post(&format!("/v1/admin/sessions/{a}/end"), json!({}))
        .await;
    assert_eq!(again.status, 200);
    assert_eq!(again.body["released"], 0);
    let unknown = s
        .post(
            &format!("/v1/admin/sessions/{}/end", random_id()),
            json!({}),
        )
        .await;
    assert_eq!(unknown.body["released"], 0);

    let ev = all_events(s).await;
    let ended = of_kind(&ev, "session_ended_by_admin");
    assert_eq!(ended.len(), 1, "{ev:?}");
    assert_eq!(ended[0]["session_id"], a.as_str());
    assert_eq!(ended[0]["reason"], "admin");
    assert_eq!(ended[0]["released"], json!([{"key": "k", "token": t}]));
    assert!(of_kind(&ev, "session_closed").is_empty());
    assert_eq!(
        metric(s, "leasehold_sessions_ended_total{reason=\"admin\"}").await,
        Some(1.0)
    );
}

pub async fn dry_run_reap_changes_nothing_then_a_real_reap_ends_them(s: &TestServer) {
    let a = s.open("a", 1_000).await;
    let b = s.open("b", 60_000).await;
    let t1 = take(s, "k1", &a).await;
    let t2 = take(s, "k2", &a).await;
    let t3 = take(s, "k3", &b).await;
    s.advance(1_500).await;

    let events_before = all_events(s).await;
    let dry = s.post("/v1/admin/reap", json!({"dry_run": true})).await;
    assert_eq!(dry.status, 200, "{}", dry.text);
    assert_eq!(dry.body["dry_run"], true);
    let due = dry.body["sessions"].as_array().unwrap();
    assert_eq!(due.len(), 1, "{}", dry.text);
    assert_eq!(due[0]["session_id"], a.as_str());
    assert_eq!(due[0]["expired_at"], BASE + 1_000);
    let mut locks = due[0]["locks"].as_array().unwrap().clone();
    locks.sort_by_key(|l| l["token"].as_u64());
    assert_eq!(
        locks,
        vec![
            json!({"key": "k1", "token": t1}),
            json!({"key": "k2", "token": t2})
        ]
    );
    // Nothing changed: same answer again, no events, the locks still recorded, the gauges
    // unmoved.
    let dry2 = s.post("/v1/admin/reap", json!({"dry_run": true})).await;
    assert_eq!(dry2.body, dry.body);
    assert_eq!(all_events(s).await, events_before);
    assert_eq!(holder(s, "k1").await.body["session_id"], a.as_str());
    assert_eq!(metric(s, "leasehold_sessions_active").await, Some(2.0));
    assert_eq!(metric(s, "leasehold_locks_held").await, Some(3.0));

    let rev_before = t3;
    let real = s.post("/v1/admin/reap", json!({"dry_run": false})).await;
    assert_eq!(real.status, 200, "{}", real.text);
    assert_eq!(real.body["dry_run"], false);
    assert_eq!(real.body["sessions_ended"], 1);
    assert_eq!(real.body["locks_released"], 2);
    assert!(real.body["revision"].as_u64().unwrap() > rev_before);
    assert_error(&holder(s, "k1").await, 404, "lock_free");
    assert_error(&holder(s, "k2").await, 404, "lock_free");
    assert_eq!(holder(s, "k3").await.body["token"], t3);
    let ev = all_events(s).await;
    assert_eq!(ev.len(), events_before.len() + 1);
    assert_eq!(ev.last().unwrap()["kind"], "session_expired");
    assert_eq!(metric(s, "leasehold_locks_held").await, Some(1.0));
    // Nothing more is due.
    let dry3 = s.post("/v1/admin/reap", json!({"dry_run": true})).await;
    assert_eq!(dry3.body["sessions"], json!([]));
    let again = s.reap().await;
    assert_eq!(again.body["sessions_ended"], 0);
    assert_eq!(again.body["locks_released"], 0);
    // An empty body is a real reap.
    let empty = s.post("/v1/admin/reap", json!({})).await;
    assert_eq!(empty.status, 200);
    assert_eq!(empty.body["dry_run"], false);

    assert_invalid(
        &s.post("/v1/admin/reap", json!({"dry_run": "yes"})).await,
        "dry_run",
    );
    assert_error(
        &s.post("/v1/admin/reap", json!({"dry_run": true, "all": true}))
            .await,
        400,
        "invalid_request",
    );
}

pub async fn the_dry_run_changes_nothing_and_lists_seats_and_job_actions(s: &TestServer) {
    make_pool(s, "p1", 1).await;
    make_pool(s, "p2", 5).await;
    let a = s.open("a", 1_000).await;
    let b = s.open("b", 60_000).await;
    seat(s, "p1", &a).await;
    seat(s, "p2", &a).await;
    let tb = seat(s, "p2", &b).await;
    let recover = enqueue(s, "q", json!({"payload": 1, "idempotent": true})).await;
    let not_idem = enqueue(s, "q", json!({"payload": 2})).await;
    let capped = enqueue(
        s,
        "q",
        json!({"payload": 3, "idempotent": true, "max_recoveries": 0}),
    )
    .await;
    let bs = enqueue(s, "q", json!({"payload": 4})).await;
    for expected in [&recover, &not_idem, &capped] {
        assert_eq!(&claim_job(s, "q", &a).await.0, expected);
    }
    assert_eq!(claim_job(s, "q", &b).await.0, bs);
    s.advance(1_500).await;

    let jobs = [
        recover.as_str(),
        not_idem.as_str(),
        capped.as_str(),
        bs.as_str(),
    ];
    // The snapshot reads only the live session: a reader that finds a session past its
    // deadline may end it (the seam allows it, and the PostgreSQL backend's session read
    // does), which would leave the dry run nothing to report.
    let before = snapshot(s, &["p1", "p2"], &jobs, &["q"], &[b.as_str()]).await;
    let metrics_before = (
        metric(s, "leasehold_seats_in_use{pool=\"p1\"}").await,
        metric(s, "leasehold_jobs{queue=\"q\",state=\"claimed\"}").await,
        metric(s, "leasehold_seats_reclaimed_total").await,
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
        snapshot(s, &["p1", "p2"], &jobs, &["q"], &[b.as_str()]).await,
        before
    );
    assert_eq!(
        (
            metric(s, "leasehold_seats_in_use{pool=\"p1\"}").await,
            metric(s, "leasehold_jobs{queue=\"q\",state=\"claimed\"}").await,
            metric(s, "leasehold_seats_reclaimed_total").await,
        ),
        metrics_before
    );
    assert_eq!(pool(s, "p1").await.body["holders"][0]["state"], "expired");

    // The real reap does what the dry run said.
    let real = s.reap().await;
    assert_eq!(real.status, 200, "{}", real.text);
    assert_eq!(real.body["sessions_ended"], 1);
    assert_eq!(pool(s, "p1").await.body["in_use"], 0);
    assert_eq!(holders(s, "p2").await, vec![b.clone()]);
    assert_eq!(pool(s, "p2").await.body["holders"][0]["seat_token"], tb);
    let r = job(s, &recover).await;
    assert_eq!(r.body["state"], "queued");
    assert_eq!(r.body["recovery_count"], 1);
    assert_eq!(
        job(s, &not_idem).await.body["failure_reason"],
        "not_idempotent"
    );
    assert_eq!(
        job(s, &capped).await.body["failure_reason"],
        "max_recoveries_exceeded"
    );
    assert_eq!(job(s, &bs).await.body["claimed_by"], b.as_str());
    assert_eq!(counts(s, "q").await, (1, 1, 0, 2));
    assert_eq!(
        metric(s, "leasehold_seats_reclaimed_total").await,
        Some(2.0)
    );
    assert_eq!(metric(s, "leasehold_jobs_recovered_total").await, Some(1.0));
    assert_eq!(
        s.post("/v1/admin/reap", json!({"dry_run": true}))
            .await
            .body["sessions"],
        json!([])
    );
}

pub async fn a_real_reap_reports_the_seats_and_jobs_it_settled(s: &TestServer) {
    make_pool(s, "p1", 1).await;
    make_pool(s, "p2", 1).await;
    let a = s.open("a", 1_000).await;
    seat(s, "p1", &a).await;
    seat(s, "p2", &a).await;
    enqueue(s, "q", json!({"payload": 1, "idempotent": true})).await;
    enqueue(s, "q", json!({"payload": 2})).await;
    claim_job(s, "q", &a).await;
    claim_job(s, "q", &a).await;
    s.advance(1_000).await;
    let real = s.reap().await;
    assert_eq!(real.status, 200, "{}", real.text);
    assert_eq!(real.body["sessions_ended"], 1, "{}", real.text);
    assert_eq!(
        pool(s, "p1").await.body["in_use"],
        0,
        "the seats were reclaimed"
    );
    assert_eq!(counts(s, "q").await, (1, 0, 0, 1), "the jobs were settled");
    assert_eq!(real.body["seats_released"], 2, "{}", real.text);
    assert_eq!(real.body["jobs_settled"], 2, "{}", real.text);
}

/// The API tokens of [`operator_and_admin_actions_name_their_token`], by name and role.
const ACTORS: [(&str, leasehold::auth::Role, &str); 3] = [
    (
        "app",
        leasehold::auth::Role::Client,
        "lh_contract-client-secret",
    ),
    (
        "ops-on-call",
        leasehold::auth::Role::Operator,
        "lh_contract-operator-secret",
    ),
    (
        "root.admin",
        leasehold::auth::Role::Admin,
        "lh_contract-admin-secret",
    ),
];

/// Serves with the tokens of [`ACTORS`].
pub fn with_actor_tokens(c: &mut leasehold::config::Config) {
    use leasehold::auth::{self, TokenEntry, TokensFile};
    let mut file = TokensFile::default();
    for (name, role, secret) in ACTORS {
        file.token.push(TokenEntry {
            name: name.into(),
            role,
            hash: auth::hash_text(&auth::hash(secret)),
            keys: None,
            pools: None,
            queues: None,
            cert_subject: None,
            created_at: 0,
        });
    }
    let path = tempfile::tempdir().unwrap().keep().join("tokens.toml");
    file.write(&path).unwrap();
    c.tokens_file = Some(path);
}

/// Makes the server's client call with the token named `name`.
fn call_as(s: &mut TestServer, name: &str) {
    let secret = ACTORS.iter().find(|(n, _, _)| *n == name).unwrap().2;
    s.client = leasehold::client::Client::new(&s.url())
        .unwrap()
        .with_token(Some(secret.to_string()))
        .unwrap();
}

/// Every operator and admin action's audit event names the token that did it (its name,
/// never its secret): a forced end, a manual reap (the expiry, the seat reclaimed, the job
/// settled), a requeue, a pool's create, resize and delete, and a token-floor raise. What a
/// client does through its own session (open, take, close and what the close settles) names
/// nobody.
pub async fn operator_and_admin_actions_name_their_token(s: &mut TestServer) {
    call_as(s, "ops-on-call");
    make_pool(s, "licences", 1).await;
    make_pool(s, "licences", 2).await;

    call_as(s, "app");
    let a = s.open("alice", 60_000).await;
    take(s, "k1", &a).await;
    let b = s.open("bob", 1_000).await;
    seat(s, "licences", &b).await;
    let doomed = enqueue(s, "q", json!({"payload": "p", "idempotent": false})).await;
    let w = s.open("worker", 60_000).await;
    claim_job(s, "q", &w).await;
    // The worker's own close fails its non-idempotent job: a client action.
    close(s, &w).await;
    let recovered = enqueue(s, "r", json!({"payload": "p", "idempotent": true})).await;
    claim_job(s, "r", &b).await;

    call_as(s, "ops-on-call");
    admin_end(s, &a).await;
    s.advance(1_000).await;
    assert_eq!(s.reap().await.body["sessions_ended"], 1);
    assert_eq!(requeue(s, &doomed).await.status, 200);
    assert_eq!(s.delete(&pool_path("licences")).await.status, 200);

    call_as(s, "root.admin");
    let floor = s
        .post("/v1/admin/tokens/floor", json!({"floor": 1_000_000}))
        .await;
    assert_eq!(floor.status, 200, "{}", floor.text);

    let ev = all_events(s).await;
    let text = serde_json::to_string(&ev).unwrap();
    for (_, _, secret) in ACTORS {
        assert!(!text.contains(secret), "a secret is in the audit log");
    }
    let named: Vec<(String, Value)> = ev
        .iter()
        .map(|e| (e["kind"].as_str().unwrap().to_string(), e["actor"].clone()))
        .collect();
    let ops = json!("ops-on-call");
    let nobody = Value::Null;
    let want = [
        ("pool_put", &ops),
        ("pool_put", &ops),
        ("session_opened", &nobody),
        ("lock_acquired", &nobody),
        ("session_opened", &nobody),
        ("seat_acquired", &nobody),
        ("job_enqueued", &nobody),
        ("session_opened", &nobody),
        ("job_claimed", &nobody),
        ("job_failed", &nobody),
        ("session_closed", &nobody),
        ("job_enqueued", &nobody),
        ("job_claimed", &nobody),
        ("session_ended_by_admin", &ops),
        ("seat_reclaimed", &ops),
        ("job_recovered", &ops),
        ("session_expired", &ops),
        ("job_requeued", &ops),
        ("pool_deleted", &ops),
        ("token_floor_raised", &json!("root.admin")),
    ];
    let want: Vec<(String, Value)> = want
        .iter()
        .map(|(k, a)| (k.to_string(), (*a).clone()))
        .collect();
    assert_eq!(named, want, "{text}");
    assert_eq!(
        of_kind(&ev, "job_recovered")[0]["job_id"],
        recovered.as_str()
    );
}
