//! The API against a hostile or careless client: one JSON error shape everywhere (also for
//! what the HTTP layer refuses), bodies that must be objects, the one rule for `null`, whole
//! floats, invalid UTF-8 and repeated parameters; and the limits against exhaustion — a
//! drip-fed body, a huge `Content-Length`, `Expect: 100-continue`, made-up methods, idle
//! keep-alive connections, connections per client address, and waiters per key — each
//! while a well-behaved client keeps getting answers.
//!
//! These run on the embedded backend only: everything here happens above the backend seam,
//! in the server and the API layer, before any backend is asked.
mod common;

use std::time::Duration;

use common::*;
use leasehold::client::segment;
use serde_json::{Value, json};
use tokio::net::{TcpSocket, TcpStream};

/// Reads until the server closes the connection or `limit` passes; returns what was read
/// and whether it closed.
async fn read_for(stream: &TcpStream, limit: Duration) -> (String, bool) {
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            if stream.readable().await.is_err() {
                return;
            }
            match stream.try_read(&mut buf) {
                Ok(0) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(_) => return,
            }
        }
    };
    let closed = tokio::time::timeout(limit, read).await.is_ok();
    (String::from_utf8_lossy(&got).into_owned(), closed)
}

/// Reads until `needle` was read (true) or `limit` passed or the stream closed (false).
async fn read_until(stream: &TcpStream, needle: &str, limit: Duration) -> (String, bool) {
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            if String::from_utf8_lossy(&got).contains(needle) {
                return true;
            }
            if stream.readable().await.is_err() {
                return false;
            }
            match stream.try_read(&mut buf) {
                Ok(0) => return false,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(_) => return false,
            }
        }
    };
    let found = tokio::time::timeout(limit, read).await.unwrap_or(false);
    (String::from_utf8_lossy(&got).into_owned(), found)
}

async fn send(stream: &TcpStream, mut data: &[u8]) {
    while !data.is_empty() {
        stream.writable().await.unwrap();
        match stream.try_write(data) {
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => panic!("write failed: {e}"),
        }
    }
}

/// The JSON body of a raw HTTP/1.1 answer.
fn json_of(answer: &str) -> Value {
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    serde_json::from_str(body).unwrap_or(Value::Null)
}

/// A connection from another loopback address, standing for another client host.
async fn connect_from(ip: &str, s: &TestServer) -> std::io::Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(format!("{ip}:0").parse().unwrap())?;
    sock.connect(addr(s)).await
}

/// A well-behaved client's round: the probe, and a session opened and closed.
async fn well_behaved(s: &TestServer) {
    assert_eq!(s.get("/healthz").await.status, 200);
    let id = s.open("good", 10_000).await;
    assert_eq!(close(s, &id).await.status, 200);
}

// ---------------------------------------------------------------------------------------------
// Bodies: objects only, null, whole floats
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_body_must_be_a_json_object() {
    let s = TestServer::start().await;
    // Read positionally, this would open a session past every field check.
    let r = raw(
        &s,
        hyper::Method::POST,
        "/v1/sessions",
        br#"["alice",10000,{"a":1}]"#.to_vec(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.body["error"], "invalid_request");
    assert_eq!(r.body["field"], "body");
    let id = s.open("a", 10_000).await;
    let r = raw(
        &s,
        hyper::Method::POST,
        &format!("/v1/sessions/{id}/heartbeat"),
        b"[5000]".to_vec(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.body["field"], "body");
    for bad in [
        &b"\"text\""[..],
        b"42",
        b"null",
        b"true",
        b"{\"owner\":\"a\"} x",
    ] {
        let r = raw(&s, hyper::Method::POST, "/v1/sessions", bad.to_vec()).await;
        assert_eq!(
            r.status,
            400,
            "{}: {}",
            String::from_utf8_lossy(bad),
            r.text
        );
        assert_eq!(r.body["field"], "body", "{}", r.text);
    }
    // Invalid UTF-8 inside a JSON string is a malformed body too.
    let r = raw(
        &s,
        hyper::Method::POST,
        "/v1/sessions",
        b"{\"owner\":\"\xff\xfe\"}".to_vec(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.body["field"].is_string(), "{}", r.text);
    // The session's TTL is untouched by the refused heartbeat.
    assert_eq!(session(&s, &id).await.body["ttl_ms"], 10_000);
    s.stop().await;
}

#[tokio::test]
async fn null_on_an_optional_field_is_absent_and_on_a_required_one_is_refused() {
    let s = TestServer::start().await;
    let r = open_with(&s, json!({"owner": "a", "ttl_ms": null, "metadata": null})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.body["session_id"].as_str().unwrap().to_string();
    assert_eq!(r.body["ttl_ms"], 15_000, "null ttl_ms takes the default");
    let r = s
        .post(
            &format!("/v1/sessions/{id}/heartbeat"),
            json!({"ttl_ms": null}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = s.post("/v1/admin/reap", json!({"dry_run": null})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["dry_run"], false);
    let r = s
        .post(
            &lock_path("k", "acquire"),
            json!({"session_id": id, "wait_ms": null}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    // Required fields: null is a wrong type, named.
    assert_invalid(&open_with(&s, json!({"owner": null})).await, "owner");
    assert_invalid(
        &s.post(&lock_path("k2", "acquire"), json!({"session_id": null}))
            .await,
        "session_id",
    );
    assert_invalid(
        &put_pool(&s, "p", json!({"capacity": null})).await,
        "capacity",
    );
    s.stop().await;
}

#[tokio::test]
async fn whole_number_floats_are_integers_and_fractions_are_refused() {
    let s = TestServer::start().await;
    let r = open_with(&s, json!({"owner": "a", "ttl_ms": 14454.0})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.body["ttl_ms"], 14_454);
    let id = r.body["session_id"].as_str().unwrap().to_string();
    let r = raw(
        &s,
        hyper::Method::POST,
        &format!("/v1/sessions/{id}/heartbeat"),
        br#"{"ttl_ms": 2e4}"#.to_vec(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["ttl_ms"], 20_000);
    assert_invalid(
        &open_with(&s, json!({"owner": "a", "ttl_ms": 1500.5})).await,
        "ttl_ms",
    );
    assert_invalid(
        &open_with(&s, json!({"owner": "a", "ttl_ms": -1})).await,
        "ttl_ms",
    );
    assert_invalid(
        &open_with(&s, json!({"owner": "a", "ttl_ms": -0.5})).await,
        "ttl_ms",
    );
    // Beyond 2^53 a float is not exact: refused, while the same value as an integer is
    // judged by the TTL rule (here: too long).
    assert_invalid(
        &open_with(&s, json!({"owner": "a", "ttl_ms": 1e17})).await,
        "ttl_ms",
    );
    // Unsigned 64-bit: the largest token is taken (and is no holder's), one more is not.
    let r = s
        .post(
            &lock_path("k", "release"),
            json!({"session_id": id, "token": u64::MAX}),
        )
        .await;
    assert_ne!(r.status, 400, "{}", r.text);
    let r = raw(
        &s,
        hyper::Method::POST,
        &lock_path("k", "release"),
        format!(r#"{{"session_id":"{id}","token":18446744073709551616}}"#).into_bytes(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.body["field"], "token");
    assert_invalid(
        &enqueue_with(
            &s,
            "q",
            json!({"payload": {}, "max_recoveries": 4294967296u64}),
        )
        .await,
        "max_recoveries",
    );
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Paths and queries: invalid UTF-8, repeated parameters
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn invalid_utf8_is_400_naming_the_parameter_in_paths_and_queries_alike() {
    let s = TestServer::start().await;
    for (path, field) in [
        ("/v1/sessions/%FF%FE", "session_id"),
        ("/v1/sessions/%FF/heartbeat", "session_id"),
        ("/v1/admin/sessions/%FF/end", "session_id"),
        ("/v1/jobs/%FF", "job_id"),
        ("/v1/admin/jobs/%FF/requeue", "job_id"),
        ("/v1/locks/%FF", "key"),
        ("/v1/pools/%FF", "pool"),
        ("/v1/queues/%FF", "queue"),
        ("/v1/sessions?owner=%FF", "owner"),
        ("/v1/locks?prefix=%FF%FE", "prefix"),
        ("/v1/locks?after=%C3", "after"),
        ("/v1/queues/q/jobs?state=%FF", "state"),
    ] {
        let method =
            if path.ends_with("/end") || path.ends_with("/requeue") || path.ends_with("/heartbeat")
            {
                hyper::Method::POST
            } else {
                hyper::Method::GET
            };
        let r = raw(&s, method, path, b"{}".to_vec()).await;
        assert_eq!(r.status, 400, "{path}: {}", r.text);
        assert_eq!(r.body["error"], "invalid_request", "{path}: {}", r.text);
        assert_eq!(r.body["field"], field, "{path}: {}", r.text);
    }
    s.stop().await;
}

#[tokio::test]
async fn a_repeated_query_parameter_is_named() {
    let s = TestServer::start().await;
    for (path, field) in [
        ("/v1/sessions?limit=1&limit=2", "limit"),
        ("/v1/sessions?owner=a&owner=b", "owner"),
        ("/v1/locks?prefix=a&prefix=b", "prefix"),
        ("/v1/events?after=1&after=2", "after"),
        ("/v1/fence/k?token=1&token=2", "token"),
    ] {
        let r = s.get(path).await;
        assert_invalid(&r, field);
    }
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// What the HTTP layer refuses has the JSON error shape too
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn http_layer_refusals_carry_the_json_error() {
    let s = TestServer::start().await;
    // Headers over the limit: 431.
    let c = TcpStream::connect(addr(&s)).await.unwrap();
    let big = "x".repeat(600 * 1024);
    send(
        &c,
        format!("GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: {big}\r\n\r\n").as_bytes(),
    )
    .await;
    let (answer, _) = read_for(&c, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:.200}");
    assert_eq!(json_of(&answer)["error"], "headers_too_large", "{answer}");
    // A malformed Content-Length: 400 with the error body.
    let c = TcpStream::connect(addr(&s)).await.unwrap();
    send(
        &c,
        b"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nContent-Length: 12x\r\n\r\n{}",
    )
    .await;
    let (answer, _) = read_for(&c, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(json_of(&answer)["error"], "invalid_request", "{answer}");
    assert!(
        answer.contains("content-type: application/json"),
        "{answer}"
    );
    // Unknown methods and paths were already JSON; they stay so.
    let r = raw(
        &s,
        hyper::Method::from_bytes(b"ZZZA").unwrap(),
        "/healthz",
        vec![],
    )
    .await;
    assert_eq!(r.status, 405);
    assert_eq!(r.body["error"], "method_not_allowed");
    well_behaved(&s).await;
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Exhaustion
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_drip_fed_body_gets_408_while_others_are_served() {
    let s = TestServer::start_real(|c| c.body_read_timeout_ms = 500).await;
    let c = TcpStream::connect(addr(&s)).await.unwrap();
    send(
        &c,
        b"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{",
    )
    .await;
    let drip = {
        let c = &c;
        async move {
            for _ in 0..30 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if c.try_write(b" ").is_err() {
                    return;
                }
            }
        }
    };
    let (answer, ()) = tokio::join!(
        async {
            let (a, _) = read_until(&c, "request_timeout", Duration::from_secs(20)).await;
            a
        },
        async {
            well_behaved(&s).await;
            drip.await
        }
    );
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert_eq!(json_of(&answer)["field"], "body", "{answer}");
    well_behaved(&s).await;
    s.stop().await;
}

#[tokio::test]
async fn a_huge_content_length_is_refused_before_its_body_and_without_100_continue() {
    let s = TestServer::start().await;
    let c = TcpStream::connect(addr(&s)).await.unwrap();
    // No byte of the body is ever sent: the answer must come from the declared length.
    send(
        &c,
        b"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000000000\r\n\r\n",
    )
    .await;
    let (answer, found) = read_until(&c, "payload_too_large", Duration::from_secs(10)).await;
    assert!(found, "no early 413: {answer}");
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");

    let c = TcpStream::connect(addr(&s)).await.unwrap();
    send(
        &c,
        b"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 1000000000000\r\n\r\n",
    )
    .await;
    let (answer, found) = read_until(&c, "payload_too_large", Duration::from_secs(10)).await;
    assert!(found, "{answer}");
    assert!(
        !answer.contains("100 Continue"),
        "a body that will be refused was invited: {answer}"
    );
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");

    // Within the limit, the invitation comes and the request is served.
    let c = TcpStream::connect(addr(&s)).await.unwrap();
    let body = br#"{"owner":"a"}"#;
    send(
        &c,
        format!(
            "POST /v1/sessions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    let (answer, found) = read_until(&c, "100 Continue", Duration::from_secs(10)).await;
    assert!(found, "{answer}");
    send(&c, body).await;
    let (answer, found) = read_until(&c, "session_id", Duration::from_secs(10)).await;
    assert!(found, "{answer}");
    assert!(answer.contains("HTTP/1.1 201"), "{answer}");
    well_behaved(&s).await;
    s.stop().await;
}

/// Series of the request counter in the exposition.
async fn request_series(s: &TestServer) -> usize {
    s.get("/metrics")
        .await
        .text
        .lines()
        .filter(|l| l.starts_with("leasehold_http_requests_total{"))
        .count()
}

#[tokio::test]
async fn made_up_methods_do_not_grow_the_metric_series() {
    let s = TestServer::start().await;
    well_behaved(&s).await;
    let before = request_series(&s).await;
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<hyper::body::Bytes>>();
    for i in 0..3_000u32 {
        let method = hyper::Method::from_bytes(format!("ZZ{i:X}").as_bytes()).unwrap();
        let req = hyper::Request::builder()
            .method(method)
            .uri(format!("{}/healthz", s.url()))
            .body(http_body_util::Full::new(hyper::body::Bytes::new()))
            .unwrap();
        let resp = http.request(req).await.unwrap();
        assert_eq!(resp.status(), 405);
    }
    well_behaved(&s).await;
    let after = request_series(&s).await;
    // The made-up methods share one label value: at most one new series, not 3 000.
    assert!(after <= before + 2, "series grew from {before} to {after}");
    let text = s.get("/metrics").await.text;
    assert!(text.contains("method=\"other\""), "{text:.2000}");
    s.stop().await;
}

#[tokio::test]
async fn an_idle_kept_alive_connection_lives_past_the_header_read_timeout() {
    let s = TestServer::start_with(|c| {
        c.header_read_timeout_ms = 200;
        c.idle_timeout_ms = 60_000;
    })
    .await;
    let c = TcpStream::connect(addr(&s)).await.unwrap();
    send(&c, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n").await;
    let (_, found) = read_until(&c, "\"ok\"", Duration::from_secs(5)).await;
    assert!(found);
    // Well past the header read timeout, the kept-alive connection is still open...
    let (_, closed) = read_for(&c, Duration::from_millis(1_500)).await;
    assert!(
        !closed,
        "an idle kept-alive connection was closed at the header timeout"
    );
    // ...and serves the next request on it.
    send(&c, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n").await;
    let (_, found) = read_until(&c, "\"ok\"", Duration::from_secs(5)).await;
    assert!(found, "the kept-alive connection no longer serves");
    // A request that starts and stalls in its headers is still cut off.
    send(&c, b"GET /healthz HTTP/1.1\r\nHo").await;
    let (_, closed) = read_for(&c, Duration::from_secs(10)).await;
    assert!(closed, "a stalled request was not cut off");
    s.stop().await;
}

#[tokio::test]
async fn ten_thousand_idle_connections_from_one_address_do_not_starve_a_client() {
    const CAP: usize = 64;
    let s = TestServer::start_with(|c| {
        c.max_connections = 1_000;
        c.max_connections_per_client = CAP;
        c.header_read_timeout_ms = 120_000;
    })
    .await;
    // Another host (127.0.0.3) opens 10 000 connections and sends nothing. The first CAP
    // are kept; every one after them is answered 503 and closed at once, so the flood
    // never holds more than CAP of the server's slots.
    let mut kept = Vec::new();
    let mut refused = 0;
    for i in 0..10_000 {
        let c = connect_from("127.0.0.3", &s).await.unwrap();
        if kept.len() < CAP {
            kept.push(c);
            continue;
        }
        let (answer, found) = read_until(&c, "too_many_connections", Duration::from_secs(10)).await;
        assert!(
            found,
            "connection {i} over the cap was not refused: {answer}"
        );
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        refused += 1;
        if i % 1_000 == 0 {
            well_behaved(&s).await;
        }
    }
    assert_eq!(refused, 10_000 - CAP);
    well_behaved(&s).await;
    // The connections within the cap were kept and still serve.
    send(&kept[0], b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n").await;
    let (_, found) = read_until(&kept[0], "\"ok\"", Duration::from_secs(5)).await;
    assert!(found);
    // Once they go, the address may connect again.
    drop(kept);
    let mut again = None;
    for _ in 0..100 {
        let c = connect_from("127.0.0.3", &s).await.unwrap();
        send(&c, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n").await;
        let (answer, _) = read_until(&c, "\r\n\r\n{", Duration::from_secs(5)).await;
        if answer.starts_with("HTTP/1.1 200") {
            again = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(again.is_some(), "the address was not let back in");
    s.stop().await;
}

#[tokio::test]
async fn a_flood_of_waiters_on_one_key_is_bounded() {
    let s = TestServer::start_with(|c| c.max_waiters_per_key = 5).await;
    let holder = s.open("holder", 60_000).await;
    assert_eq!(s.acquire("hot", &holder).await.status, 200);
    let mut waiting = Vec::new();
    for i in 0..5 {
        let id = s.open(&format!("w{i}"), 60_000).await;
        waiting.push(spawn_acquire(&s, "hot", &id, 30_000));
    }
    until_waiters(&s, 5).await;
    let extra = s.open("extra", 60_000).await;
    let r = acquire_wait(&s.client, "hot", &extra, 30_000).await;
    assert_error(&r, 429, "too_many_waiters");
    assert_eq!(r.body["field"], "wait_ms");
    // Not waiting is still answered at once, and another key is untouched.
    let r = acquire_wait(&s.client, "hot", &extra, 0).await;
    assert_error(&r, 409, "lock_held");
    assert_eq!(s.acquire("cold", &extra).await.status, 200);
    well_behaved(&s).await;
    // The holder leaves: the first waiter gets it, and a place in line is free again.
    assert_eq!(close(&s, &holder).await.status, 200);
    let first = answer(waiting.remove(0)).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let again = spawn_acquire(&s, "hot", &extra, 30_000);
    until_waiters(&s, 5).await;
    drop(again);
    drop(waiting);
    s.stop().await;
}

#[tokio::test]
async fn a_key_with_a_slash_is_scoped_by_its_decoded_name() {
    // The scope check sees the decoded key, as the lock itself does.
    let s = TestServer::start().await;
    let id = s.open("a", 10_000).await;
    let r = s
        .post(
            &format!("/v1/locks/{}/acquire", segment("db/migrate")),
            json!({"session_id": id}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["key"], "db/migrate");
    s.stop().await;
}
