//! The Rust client's sessions and guards: guards give back on drop and on panic; the local
//! deadline fires while the server still honours the session, under injected latency;
//! `session_gone` is terminal while transport errors and `503`s are retried.
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{TestServer, admin_end};
use leasehold::client::{Client, Error, Loss, NewJob, Session};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// A bound on how long a test waits for something that must happen; only a broken build
/// reaches it.
const PATIENCE: Duration = Duration::from_secs(30);

/// Polls `ready` until it holds, failing the test after [`PATIENCE`].
async fn eventually(mut ready: impl AsyncFnMut() -> bool) {
    let until = tokio::time::Instant::now() + PATIENCE;
    while !ready().await {
        assert!(tokio::time::Instant::now() < until, "gave up waiting");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn session(url: &str, ttl_ms: u64) -> Session {
    Session::builder(Client::new(url).unwrap(), "client-test")
        .ttl(Duration::from_millis(ttl_ms))
        .open()
        .await
        .unwrap()
}

async fn put_pool(s: &TestServer, pool: &str, capacity: u64) {
    let r = s
        .client
        .call(
            hyper::Method::PUT,
            &format!("/v1/pools/{pool}"),
            Some(&json!({"capacity": capacity})),
        )
        .await
        .unwrap();
    assert!(r.status.is_success(), "{}", r.text);
}

async fn enqueue(s: &TestServer, queue: &str) -> String {
    let r = s
        .post(
            &format!("/v1/queues/{queue}/jobs"),
            json!({"payload": {"n": 1}, "idempotent": true}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    r.body["job_id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guards_give_back_what_they_hold_when_dropped() {
    let s = TestServer::start().await;
    put_pool(&s, "cad", 1).await;
    let job = enqueue(&s, "builds").await;
    let session = session(&s.url(), 60_000).await;

    let lock = session.lock("db/migrate").await.unwrap();
    let seat = session.seat("cad").await.unwrap();
    let claimed = session
        .claim("builds", Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.id(), job);
    assert_eq!(claimed.payload(), &json!({"n": 1}));
    let held = s.get(&format!("/v1/sessions/{}", session.id())).await;
    assert_eq!(held.body["locks"][0]["token"], lock.token());
    assert_eq!(held.body["seats"][0]["seat_token"], seat.token());
    assert_eq!(held.body["jobs"][0], job);
    // A second session is refused while the guards live.
    let other = self::session(&s.url(), 60_000).await;
    assert_eq!(
        other.lock("db/migrate").await.err().unwrap().code(),
        Some("lock_held")
    );
    assert_eq!(
        other.seat("cad").await.err().unwrap().code(),
        Some("pool_exhausted")
    );

    drop((lock, seat, claimed));
    session.settle().await;
    assert_eq!(s.get("/v1/locks/db%2Fmigrate").await.status, 404);
    assert_eq!(s.get("/v1/pools/cad").await.body["in_use"], 0);
    let j = s.get(&format!("/v1/jobs/{job}")).await;
    assert_eq!(
        j.body["state"], "queued",
        "a dropped job goes back: {}",
        j.text
    );
    // What was given back is the other session's to take.
    other.lock("db/migrate").await.unwrap();
    other.seat("cad").await.unwrap();
    session.close().await.unwrap();
    other.close().await.unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guards_give_back_when_their_task_panics() {
    let s = TestServer::start().await;
    let session = Arc::new(session(&s.url(), 60_000).await);
    let url = s.url();
    let worker = {
        let session = session.clone();
        tokio::spawn(async move {
            let _lock = session.lock("report").await.unwrap();
            let plain = Client::new(&url).unwrap();
            assert_eq!(plain.get("/v1/locks/report").await.unwrap().status, 200);
            panic!("the work failed half way");
        })
    };
    assert!(worker.await.unwrap_err().is_panic());
    session.settle().await;
    assert_eq!(s.get("/v1/locks/report").await.status, 404);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_session_is_closed_and_gives_back_everything() {
    let s = TestServer::start().await;
    let session = session(&s.url(), 60_000).await;
    let id = session.id().to_string();
    let lock = session.lock("left-behind").await.unwrap();
    drop(session);
    // The guard outlived its session: dropping it now queues nothing that could fail loudly.
    drop(lock);
    let path = format!("/v1/sessions/{id}");
    eventually(async || s.get(&path).await.status == 404).await;
    assert_eq!(s.get("/v1/locks/left-behind").await.status, 404);
    let events = common::all_events(&s).await;
    let closed = common::of_kind(&events, "session_closed");
    assert_eq!(closed.len(), 1, "closed by the client, not expired");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_job_is_not_handed_back() {
    let s = TestServer::start().await;
    let done = enqueue(&s, "q").await;
    let failed = enqueue(&s, "q").await;
    let session = session(&s.url(), 60_000).await;
    let job = session.claim("q", Duration::ZERO).await.unwrap().unwrap();
    job.complete(json!({"ok": true})).await.unwrap();
    let job = session.claim("q", Duration::ZERO).await.unwrap().unwrap();
    job.fail("bad input").await.unwrap();
    session.settle().await;
    assert!(session.claim("q", Duration::ZERO).await.unwrap().is_none());
    assert_eq!(
        s.get(&format!("/v1/jobs/{done}")).await.body["state"],
        "done"
    );
    assert_eq!(
        s.get(&format!("/v1/jobs/{failed}")).await.body["state"],
        "failed"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_answers_say_how_long_the_session_is_safe() {
    let s = TestServer::start().await;
    let id = s.open("a", 30_000).await;
    let r = s.heartbeat(&id).await;
    let safe = r.body["safe_for_ms"].as_u64().unwrap();
    assert!(safe <= 30_000 && safe > 0, "{}", r.text);
    let r = s
        .post(
            &format!("/v1/sessions/{id}/heartbeat"),
            json!({"ttl_ms": 5000}),
        )
        .await;
    assert!(
        r.body["safe_for_ms"].as_u64().unwrap() <= 5000,
        "{}",
        r.text
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_ending_the_session_fires_the_signal_and_stops_every_call() {
    let s = TestServer::start().await;
    let session = self::session(&s.url(), 3_000).await;
    let lock = session.lock("k").await.unwrap();
    let signal = session.loss_signal();
    assert_eq!(signal.is_lost(), None);
    admin_end(&s, session.id()).await;
    let loss = tokio::time::timeout(PATIENCE, signal.lost()).await.unwrap();
    assert_eq!(loss, Loss::Gone);
    assert!(matches!(session.check(), Err(Error::Lost(Loss::Gone))));
    assert!(matches!(
        session.lock("other").await,
        Err(Error::Lost(Loss::Gone))
    ));
    drop(lock);
    s.stop().await;
}

/// With `watch(true)` the server's own report fires the loss signal: the heartbeat here is an
/// hour away and the TTL a minute, so neither could have told the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_session_learns_of_an_operator_end_from_the_server() {
    let s = TestServer::start().await;
    let session = Session::builder(Client::new(&s.url()).unwrap(), "client-test")
        .ttl(Duration::from_secs(60))
        .heartbeat_every(Duration::from_secs(3_600))
        .watch(true)
        .open()
        .await
        .unwrap();
    let signal = session.loss_signal();
    // The watch is open once the server counts it.
    eventually(async || common::metric(&s, "leasehold_watches_open").await == Some(1.0)).await;
    assert_eq!(signal.is_lost(), None);
    admin_end(&s, session.id()).await;
    let loss = tokio::time::timeout(PATIENCE, signal.lost()).await.unwrap();
    assert_eq!(loss, Loss::Gone);
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Injected latency: a proxy that holds every chunk for a settable time
// ---------------------------------------------------------------------------------------------

/// Forwards TCP connections to `upstream`, holding every chunk in either direction for the
/// current delay before passing it on.
async fn delaying_proxy(upstream: std::net::SocketAddr) -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let delay = Arc::new(AtomicU64::new(0));
    let d = delay.clone();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = TcpStream::connect(upstream).await else {
                continue;
            };
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            tokio::spawn(pipe(ri, wo, d.clone()));
            tokio::spawn(pipe(ro, wi, d.clone()));
        }
    });
    (url, delay)
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        tokio::time::sleep(Duration::from_millis(delay.load(Ordering::SeqCst))).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Forwards TCP connections to `upstream`, but for the first `drops` connections throws the
/// server's answer away and closes the connection once it comes: the call reached the server
/// and acted, and the client never learns it.
async fn answer_dropping_proxy(upstream: std::net::SocketAddr, drops: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let none = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        let mut accepted = 0;
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = TcpStream::connect(upstream).await else {
                continue;
            };
            accepted += 1;
            let (ri, wi) = inbound.into_split();
            let (mut ro, wo) = outbound.into_split();
            tokio::spawn(pipe(ri, wo, none.clone()));
            if accepted <= drops {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    let _ = ro.read(&mut buf).await;
                    // Dropping the write half (and with it the answer) closes the client's side.
                    drop(wi);
                });
            } else {
                tokio::spawn(pipe(ro, wi, none.clone()));
            }
        }
    });
    url
}

/// An open whose answer is lost is retried under its request_id: the client ends up with the
/// session the first attempt opened, and no second session is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_whose_answer_is_lost_opens_one_session() {
    let s = TestServer::start().await;
    let proxied = answer_dropping_proxy(common::addr(&s), 1).await;
    let session = Session::builder(Client::new(&proxied).unwrap(), "lossy-network")
        .ttl(Duration::from_millis(60_000))
        .open()
        .await
        .unwrap();
    let events = common::all_events(&s).await;
    let opened = common::of_kind(&events, "session_opened");
    assert_eq!(opened.len(), 1, "{events:?}");
    assert_eq!(opened[0]["session_id"], session.id());
    // The session is the live one: a lock under it works.
    drop(session.lock("after-a-lost-open").await.unwrap());
}

/// An enqueue whose answer is lost is retried under its request_id: one job, and the answer
/// names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_whose_answer_is_lost_enqueues_one_job() {
    let s = TestServer::start().await;
    let proxied = answer_dropping_proxy(common::addr(&s), 1).await;
    let job = NewJob {
        kind: Some("report".into()),
        ..NewJob::new(json!({"n": 1}))
    };
    let enqueued = Client::new(&proxied)
        .unwrap()
        .enqueue("reports", &job)
        .await
        .unwrap();
    assert_eq!(enqueued.queue, "reports");
    let events = common::all_events(&s).await;
    let made = common::of_kind(&events, "job_enqueued");
    assert_eq!(made.len(), 1, "{events:?}");
    assert_eq!(made[0]["job_id"], enqueued.job_id.as_str());
    let shown = common::job(&s, &enqueued.job_id).await;
    assert_eq!(shown.body["kind"], "report");
    // Without a lost answer, another enqueue is another job.
    let second = Client::new(&s.url())
        .unwrap()
        .enqueue("reports", &job)
        .await
        .unwrap();
    assert_ne!(second.job_id, enqueued.job_id);
    assert_eq!(common::counts(&s, "reports").await, (2, 0, 0, 0));
}

/// The failure this guards against: a client that counts its lease from when an answer
/// *arrived* believes it holds the lock after the server has ended the session and given the
/// lock to someone else. Here the network stalls; the client must give the session up while
/// the server still honours it — and the server must end it afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_deadline_passes_before_the_server_ends_the_session() {
    let s = TestServer::start_real(|c| {
        c.reaper_enabled = true;
        c.reaper_interval_ms = 20;
    })
    .await;
    let (proxied, delay) = delaying_proxy(common::addr(&s)).await;
    let session = Session::builder(Client::new(&proxied).unwrap(), "slow-network")
        .ttl(Duration::from_millis(2_000))
        .margin(Duration::from_millis(250))
        .open()
        .await
        .unwrap();
    let lock = session.lock("guarded").await.unwrap();
    let signal = session.loss_signal();
    // Slow heartbeats that still arrive in time keep the session. The round trip (600 ms) is
    // well over the margin: a deadline counted from when answers arrive would now lie past
    // the server's.
    delay.store(300, Ordering::SeqCst);
    for _ in 0..3 {
        let before = session.deadline();
        eventually(async || session.deadline() > before).await;
    }
    assert_eq!(signal.is_lost(), None);
    // Now the network stalls for longer than the TTL.
    delay.store(5_000, Ordering::SeqCst);
    let loss = tokio::time::timeout(PATIENCE, signal.lost()).await.unwrap();
    assert_eq!(loss, Loss::Deadline);
    // Asked directly, the server still honours the session and the token.
    let live = s.get(&format!("/v1/sessions/{}", session.id())).await;
    assert_eq!(
        live.status, 200,
        "the server ended the session first: {}",
        live.text
    );
    let fence = s
        .get(&format!("/v1/fence/guarded?token={}", lock.token()))
        .await;
    assert_eq!(fence.body["current"], true, "{}", fence.text);
    // And it ends it soon after.
    let path = format!("/v1/sessions/{}", session.id());
    eventually(async || s.get(&path).await.status == 404).await;
    assert!(matches!(session.check(), Err(Error::Lost(Loss::Deadline))));
    drop(lock);
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// A scripted server: what the client does with each kind of answer
// ---------------------------------------------------------------------------------------------

/// What the scripted server saw: requests per path, and the `Authorization` headers.
#[derive(Default)]
struct Seen {
    paths: BTreeMap<String, u32>,
    authorization: Vec<String>,
}

/// A minimal HTTP/1.1 server: opens sessions with TTL 1 s, answers the n-th heartbeat with
/// `heartbeats[n]` (the last entry for all after), and records what it was sent.
async fn scripted(heartbeats: Vec<(u16, Value)>) -> (String, Arc<Mutex<Seen>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let state = seen.clone();
    let script = Arc::new(heartbeats);
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let seen = state.clone();
            let script = script.clone();
            tokio::spawn(async move {
                let mut conn = BufReader::new(conn);
                loop {
                    let mut request = String::new();
                    if conn.read_line(&mut request).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let path = request.split(' ').nth(1).unwrap_or("").to_string();
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        conn.read_line(&mut line).await.unwrap();
                        let line = line.trim_end();
                        if line.is_empty() {
                            break;
                        }
                        let (name, value) = line.split_once(':').unwrap();
                        match name.to_ascii_lowercase().as_str() {
                            "content-length" => length = value.trim().parse().unwrap(),
                            "authorization" => {
                                seen.lock().authorization.push(value.trim().to_string())
                            }
                            _ => {}
                        }
                    }
                    let mut body = vec![0; length];
                    conn.read_exact(&mut body).await.unwrap();
                    let n = {
                        let mut seen = seen.lock();
                        let n = seen.paths.entry(path.clone()).or_default();
                        *n += 1;
                        *n as usize
                    };
                    let (status, answer) = if path == "/v1/sessions" {
                        (
                            201,
                            json!({"session_id": "s1", "ttl_ms": 1000, "expires_at": 0, "revision": 1}),
                        )
                    } else if path.ends_with("/heartbeat") {
                        script[(n - 1).min(script.len() - 1)].clone()
                    } else {
                        (200, json!({}))
                    };
                    let text = answer.to_string();
                    let head = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        text.len()
                    );
                    let conn = conn.get_mut();
                    if conn.write_all(head.as_bytes()).await.is_err()
                        || conn.write_all(text.as_bytes()).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (url, seen)
}

fn heartbeats(seen: &Mutex<Seen>) -> u32 {
    seen.lock()
        .paths
        .get("/v1/sessions/s1/heartbeat")
        .copied()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_trouble_is_retried_but_session_gone_is_final() {
    let overloaded = (503, json!({"error": "overloaded", "message": "busy"}));
    let gone = (404, json!({"error": "session_gone", "message": "gone"}));
    let (url, seen) = scripted(vec![overloaded.clone(), overloaded, gone]).await;
    let client = Client::new(&url)
        .unwrap()
        .with_token(Some("secret-token".into()))
        .unwrap();
    let session = Session::builder(client, "scripted")
        .ttl(Duration::from_millis(1_000))
        .heartbeat_every(Duration::from_millis(100))
        .open()
        .await
        .unwrap();
    let loss = tokio::time::timeout(PATIENCE, session.loss_signal().lost())
        .await
        .unwrap();
    assert_eq!(loss, Loss::Gone);
    // Two 503s were retried; the session_gone that followed was not.
    assert_eq!(heartbeats(&seen), 3);
    // Nothing is sent for this session any more: several heartbeat intervals pass quietly.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(heartbeats(&seen), 3);
    let auth = seen.lock().authorization.clone();
    assert!(
        !auth.is_empty() && auth.iter().all(|a| a == "Bearer secret-token"),
        "{auth:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_refused_for_good_is_a_loss_not_a_retry_loop() {
    let denied = (401, json!({"error": "unauthorized", "message": "no token"}));
    let (url, seen) = scripted(vec![denied]).await;
    let session = Session::builder(Client::new(&url).unwrap(), "scripted")
        .ttl(Duration::from_millis(1_000))
        .heartbeat_every(Duration::from_millis(50))
        .open()
        .await
        .unwrap();
    let loss = tokio::time::timeout(PATIENCE, session.loss_signal().lost())
        .await
        .unwrap();
    assert_eq!(
        loss,
        Loss::Refused {
            status: 401,
            code: "unauthorized".into()
        }
    );
    assert_eq!(heartbeats(&seen), 1);
}
