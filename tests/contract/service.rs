//! Contract: the service around the operations — probes, metrics, routing, and requests
//! refused before they reach the backend (malformed or oversized bodies), which must leave no
//! trace in it.

use hyper::Method;
use serde_json::json;

use crate::common::*;

pub async fn probes_answer_when_healthy(s: &TestServer) {
    let h = s.get("/healthz").await;
    assert_eq!(h.status, 200);
    assert_eq!(h.body["status"], "ok");
    let r = s.get("/readyz").await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["ready"], true);
    let m = s.get("/metrics").await;
    assert_eq!(m.status, 200);
    assert!(m.text.contains("leasehold_sessions_active"), "{}", m.text);
}

pub async fn metrics_exist_and_count(s: &TestServer) {
    assert_eq!(metric(s, "leasehold_sessions_active").await, Some(0.0));
    assert_eq!(metric(s, "leasehold_locks_held").await, Some(0.0));

    let a = s.open("alice", 2_000).await;
    let b = s.open("bob", 60_000).await;
    let c = s.open("carol", 60_000).await;
    take(s, "a", &a).await;
    take(s, "a2", &a).await;
    let tb = take(s, "b", &b).await;
    assert_eq!(s.heartbeat(&b).await.status, 200);
    assert_eq!(metric(s, "leasehold_sessions_active").await, Some(3.0));
    assert_eq!(metric(s, "leasehold_locks_held").await, Some(3.0));
    assert_eq!(
        metric(s, "leasehold_sessions_opened_total").await,
        Some(3.0)
    );
    assert_eq!(metric(s, "leasehold_locks_acquired_total").await, Some(3.0));
    assert_eq!(metric(s, "leasehold_heartbeats_total").await, Some(1.0));

    assert_eq!(s.release("b", &b, tb).await.status, 200);
    assert_eq!(metric(s, "leasehold_locks_released_total").await, Some(1.0));
    assert_eq!(metric(s, "leasehold_locks_held").await, Some(2.0));

    assert_eq!(s.delete(&format!("/v1/sessions/{c}")).await.status, 200);
    assert_eq!(
        metric(s, "leasehold_sessions_ended_total{reason=\"closed\"}").await,
        Some(1.0)
    );
    assert_eq!(
        s.post(&format!("/v1/admin/sessions/{b}/end"), json!({}))
            .await
            .status,
        200
    );
    assert_eq!(
        metric(s, "leasehold_sessions_ended_total{reason=\"admin\"}").await,
        Some(1.0)
    );

    // Nothing has expired yet; every reason is exported from start-up, at zero.
    assert_eq!(
        metric(s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        Some(0.0)
    );
    s.advance(2_000).await;
    let reaped = s.reap().await;
    assert_eq!(reaped.body["sessions_ended"], 1, "{}", reaped.text);
    assert_eq!(
        metric(s, "leasehold_sessions_ended_total{reason=\"expired\"}").await,
        Some(1.0)
    );
    assert_eq!(
        metric(s, "leasehold_locks_released_by_expiry_total").await,
        Some(2.0)
    );
    assert_eq!(metric(s, "leasehold_sessions_active").await, Some(0.0));
    assert_eq!(metric(s, "leasehold_locks_held").await, Some(0.0));

    // Requests are counted by route template, method and status.
    assert_eq!(
        metric(
            s,
            "leasehold_http_requests_total{route=\"/v1/sessions\",method=\"POST\",status=\"201\"}"
        )
        .await,
        Some(3.0)
    );
    assert_eq!(s.get("/v1/nothing-here").await.status, 404);
    assert_eq!(
        metric(
            s,
            "leasehold_http_requests_total{route=\"unmatched\",method=\"GET\",status=\"404\"}"
        )
        .await,
        Some(1.0)
    );
    let text = s.get("/metrics").await.text;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(line.starts_with("leasehold_"), "unprefixed series: {line}");
    }
    assert!(text.contains("leasehold_http_request_duration_seconds_bucket"));
}

pub async fn malformed_json_is_400(s: &TestServer) {
    let a = s.open("alice", 60_000).await;
    let bodies: Vec<Vec<u8>> = vec![
        b"{not json".to_vec(),
        b"{\"owner\": \"a\"".to_vec(),
        b"\xff\xfe".to_vec(),
        b"null".to_vec(),
    ];
    for body in bodies {
        let r = raw(s, Method::POST, "/v1/sessions", body.clone()).await;
        assert_eq!(r.status, 400, "{:?}: {}", body, r.text);
        assert_eq!(r.body["error"], "invalid_request", "{}", r.text);
        assert!(r.body["message"].is_string());
    }
    let r = raw(s, Method::POST, &lock_path("k", "acquire"), b"{".to_vec()).await;
    assert_eq!(r.status, 400, "{}", r.text);
    let r = raw(
        s,
        Method::POST,
        &format!("/v1/sessions/{a}/heartbeat"),
        b"[1]".to_vec(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text);
    // An empty body reads as {}: a heartbeat needs no fields.
    let r = raw(
        s,
        Method::POST,
        &format!("/v1/sessions/{a}/heartbeat"),
        Vec::new(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(all_events(s).await.len(), 1, "only the one open");
}

pub async fn trailing_bytes_after_the_json_body_are_400(s: &TestServer) {
    for body in [
        &b"{\"owner\": \"a\"} trailing"[..],
        &b"{\"owner\": \"a\"}{\"owner\": \"b\"}"[..],
        &b"{\"owner\": \"a\"} ]"[..],
    ] {
        let r = raw(s, Method::POST, "/v1/sessions", body.to_vec()).await;
        assert_eq!(
            r.status,
            400,
            "{}: {}",
            String::from_utf8_lossy(body),
            r.text
        );
        assert_eq!(r.body["error"], "invalid_request", "{}", r.text);
    }
    assert!(all_events(s).await.is_empty(), "no session was opened");
}

pub async fn body_over_max_body_bytes_is_413(s: &TestServer) {
    assert_eq!(s.config.max_body_bytes, 64 * 1024);
    // Exactly at the limit: accepted (JSON padded with whitespace).
    let mut at_limit = br#"{"owner":"big"}"#.to_vec();
    at_limit.resize(64 * 1024, b' ');
    let r = raw(s, Method::POST, "/v1/sessions", at_limit).await;
    assert_eq!(r.status, 201, "{}", r.text);
    // One byte more: refused before it is parsed.
    let mut over = br#"{"owner":"big"}"#.to_vec();
    over.resize(64 * 1024 + 1, b' ');
    let r = raw(s, Method::POST, "/v1/sessions", over).await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert_eq!(r.body["error"], "payload_too_large", "{}", r.text);
    // Far over, on another route.
    let r = raw(
        s,
        Method::POST,
        &lock_path("k", "acquire"),
        vec![b' '; 1024 * 1024],
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert_eq!(all_events(s).await.len(), 1);
}

pub async fn wrong_method_is_405(s: &TestServer) {
    let cases = [
        (Method::PUT, "/v1/sessions".to_string()),
        (Method::DELETE, "/v1/sessions".to_string()),
        (Method::PUT, format!("/v1/sessions/{}", random_id())),
        (
            Method::GET,
            format!("/v1/sessions/{}/heartbeat", random_id()),
        ),
        (Method::GET, "/v1/locks/k/acquire".to_string()),
        (Method::GET, "/v1/locks/k/release".to_string()),
        (Method::DELETE, "/v1/locks/k".to_string()),
        (Method::POST, "/v1/locks".to_string()),
        (Method::POST, "/v1/fence/k".to_string()),
        (Method::POST, "/v1/events".to_string()),
        (Method::GET, "/v1/admin/reap".to_string()),
        (
            Method::GET,
            format!("/v1/admin/sessions/{}/end", random_id()),
        ),
        (Method::POST, "/healthz".to_string()),
        (Method::DELETE, "/metrics".to_string()),
    ];
    for (method, path) in cases {
        let r = raw(s, method.clone(), &path, Vec::new()).await;
        assert_eq!(r.status, 405, "{method} {path}: {}", r.text);
        assert_eq!(r.body["error"], "method_not_allowed", "{}", r.text);
    }
}

pub async fn unknown_path_is_404_not_found(s: &TestServer) {
    for (method, path) in [
        (Method::GET, "/"),
        (Method::GET, "/v1"),
        (Method::GET, "/v2/sessions"),
        (Method::GET, "/v1/nope"),
        (Method::POST, "/v1/locks/k/steal"),
        (Method::GET, "/v1/locks/k/acquire/extra"),
        (Method::GET, "/v1/leases"),
        (Method::POST, "/v1/admin/everything"),
    ] {
        let r = raw(s, method.clone(), path, Vec::new()).await;
        assert_eq!(r.status, 404, "{method} {path}: {}", r.text);
        assert_eq!(r.body["error"], "not_found", "{}", r.text);
    }
}
