//! Several `leasehold serve --backend postgres` processes on one schema, the way a team runs
//! them: real binaries, real PostgreSQL, `kill -9`, and a database that goes away and comes
//! back.
//!
//! The shared server (127.0.0.1:5432, database `test`) holds one fresh schema per test,
//! dropped afterwards; the test that restarts PostgreSQL runs its own cluster (initdb in a
//! temporary directory). The tests run one at a time: they measure waits in real time on a
//! small machine.

mod pgnodes;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::client::segment;
use pgnodes::ledger::{self, InFlight, Ledger};
use pgnodes::{Cluster, Node, NodeSpec, PrivateCluster, Rng, Schema, all_events, seed};
use serde_json::{Value, json};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn lock_path(key: &str, op: &str) -> String {
    format!("/v1/locks/{}/{op}", segment(key))
}

fn sid(r: &Value) -> String {
    r["session_id"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_through_one_node_is_refused_and_fenced_through_the_other() {
    // Guards against nodes that keep lock state of their own: B granting a key A holds, or
    // B's fence check not knowing A's token.
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(2, None).await;
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    let key = "shared/one";
    let sa = a.open("holder@a", 30_000).await;
    let r = a
        .post(&lock_path(key, "acquire"), json!({"session_id": sa}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let token = r.body["token"].as_u64().unwrap();

    let sb = b.open("contender@b", 30_000).await;
    let r = b
        .post(&lock_path(key, "acquire"), json!({"session_id": sb}))
        .await;
    assert_eq!(r.status, 409, "B must refuse a key A holds: {}", r.text);
    assert_eq!(r.body["error"], "lock_held", "{}", r.text);

    let r = b
        .get(&format!("/v1/fence/{}?token={token}", segment(key)))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.body["current"], true,
        "B's fence check on A's token: {}",
        r.text
    );
    assert_eq!(r.body["latest"], token, "{}", r.text);
    let r = b
        .get(&format!("/v1/fence/{}?token={}", segment(key), token + 1))
        .await;
    assert_eq!(
        r.body["current"], false,
        "a token never issued is not current: {}",
        r.text
    );

    let r = b.get(&format!("/v1/locks/{}", segment(key))).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(sid(&r.body), sa, "{}", r.text);
    assert_eq!(r.body["token"], token, "{}", r.text);

    // Released through A, the key is B's, with a greater token, and A's token is stale.
    let r = a
        .post(
            &lock_path(key, "release"),
            json!({"session_id": sa, "token": token}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = b
        .post(&lock_path(key, "acquire"), json!({"session_id": sb}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let token_b = r.body["token"].as_u64().unwrap();
    assert!(token_b > token, "B's token {token_b} after A's {token}");
    let r = a
        .get(&format!("/v1/fence/{}?token={token}", segment(key)))
        .await;
    assert_eq!(r.body["current"], false, "{}", r.text);
    assert_eq!(r.body["latest"], token_b, "{}", r.text);
}

/// A key held through `a`, a waiter through `b` (wait_ms 5000) that has waited 300 ms, then a
/// release through `a`: how long after the release's answer the waiter was granted. Panics
/// unless the waiter is granted, with a greater token, within its wait.
async fn wake_lag(a: &Node, b: &Node, key: &str) -> Duration {
    let sa = a.open("holder", 30_000).await;
    let r = a
        .post(&lock_path(key, "acquire"), json!({"session_id": sa}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let token = r.body["token"].as_u64().unwrap();

    let sb = b.open("waiter", 30_000).await;
    let client = b.client.clone();
    let path = lock_path(key, "acquire");
    let waiter = tokio::spawn(async move {
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            client.post(&path, &json!({"session_id": sb, "wait_ms": 5000})),
        )
        .await;
        (Instant::now(), r)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "{key}: the waiter must still be waiting"
    );
    let r = a
        .post(
            &lock_path(key, "release"),
            json!({"session_id": sa, "token": token}),
        )
        .await;
    let released = Instant::now();
    assert_eq!(r.status, 200, "{}", r.text);
    let (granted, r) = waiter.await.unwrap();
    let r = r.expect("the waiter hung").expect("the waiter's request");
    assert_eq!(r.status, 200, "{key}: {}", r.text);
    let t = r.body["token"].as_u64().unwrap();
    assert!(t > token, "{key}: waiter's token {t} after {token}");
    let r = a.delete(&format!("/v1/sessions/{sa}")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    granted.saturating_duration_since(released)
}

/// A wake-up pushed by the releasing node arrives within this; a waiter that only re-checks
/// on its own (every second) answers about 700 ms after a release made 300 ms into its wait.
const PUSHED_WAKE: Duration = Duration::from_millis(400);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_on_one_node_is_granted_promptly_when_the_other_node_releases() {
    // Guards against waiters that only hear of releases made on their own node: a waiter on
    // B left waiting until its wait_ms runs out, or until it happens to ask again, after A
    // released.
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(2, None).await;
    let mut lags = Vec::new();
    for round in 0..5 {
        let (a, b) = (&c.nodes[round % 2], &c.nodes[1 - round % 2]);
        let lag = wake_lag(a, b, &format!("wait/{round}")).await;
        assert!(
            lag <= Duration::from_secs(1),
            "round {round}: the waiter on {} was answered {lag:?} after the release on {}{}",
            b.name(),
            a.name(),
            c.logs()
        );
        lags.push(lag);
    }
    lags.sort();
    eprintln!("cross-node wake-ups: {lags:?}");
    assert!(
        lags[lags.len() / 2] <= PUSHED_WAKE,
        "cross-node wake-ups took {lags:?}: the waiters were not woken by the release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_interleaved_across_nodes_get_strictly_increasing_tokens() {
    // Guards against per-node token counters (or a sequence cached per connection): grants
    // made through different nodes must be ordered as they happened — per key, and for any
    // grant acknowledged before another's request was sent.
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(2, None).await;
    const KEYS: usize = 3;
    const TASKS: usize = 6;
    const ROUNDS: usize = 40;
    #[derive(Debug, Clone)]
    struct Grant {
        key: usize,
        token: u64,
        node: usize,
        sent: Instant,
        acked: Instant,
        release_sent: Instant,
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let node = task % 2;
        let client = c.nodes[node].client.clone();
        let session = c.nodes[node].open(&format!("task-{task}"), 60_000).await;
        tasks.push(tokio::spawn(async move {
            let mut grants = Vec::new();
            let mut refused = 0;
            for round in 0..ROUNDS {
                let key = (task + round) % KEYS;
                let path = lock_path(&format!("inter/{key}"), "acquire");
                let sent = Instant::now();
                let r = tokio::time::timeout(
                    Duration::from_secs(10),
                    client.post(&path, &json!({"session_id": session, "wait_ms": 3000})),
                )
                .await
                .expect("acquire hung")
                .expect("acquire");
                let acked = Instant::now();
                if r.status == 409 && r.body["error"] == "lock_held" {
                    refused += 1;
                    continue;
                }
                assert_eq!(r.status, 200, "{}", r.text);
                let token = r.body["token"].as_u64().unwrap();
                tokio::time::sleep(Duration::from_millis(round as u64 % 3)).await;
                let release_sent = Instant::now();
                let path = lock_path(&format!("inter/{key}"), "release");
                let r = tokio::time::timeout(
                    Duration::from_secs(10),
                    client.post(&path, &json!({"session_id": session, "token": token})),
                )
                .await
                .expect("release hung")
                .expect("release");
                assert_eq!(r.status, 200, "{}", r.text);
                grants.push(Grant {
                    key,
                    token,
                    node,
                    sent,
                    acked,
                    release_sent,
                });
            }
            (grants, refused)
        }));
    }
    let mut grants: Vec<Grant> = Vec::new();
    let mut refused = 0;
    for t in tasks {
        let (g, r) = tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("a task did not finish")
            .unwrap();
        grants.extend(g);
        refused += r;
    }
    eprintln!(
        "{} grants ({refused} waits ran out) in {:?}",
        grants.len(),
        started.elapsed()
    );
    let tokens: BTreeSet<u64> = grants.iter().map(|g| g.token).collect();
    assert_eq!(tokens.len(), grants.len(), "a token was issued twice");
    for node in 0..2 {
        let n = grants.iter().filter(|g| g.node == node).count();
        assert!(
            n >= TASKS * ROUNDS / 8,
            "node {node} made only {n} of {} grants: too little interleaving to test",
            grants.len()
        );
    }
    // Per key, in token order, each holder released before the next was granted.
    for key in 0..KEYS {
        let mut g: Vec<&Grant> = grants.iter().filter(|g| g.key == key).collect();
        g.sort_by_key(|g| g.token);
        for w in g.windows(2) {
            assert!(
                w[0].release_sent < w[1].acked,
                "key {key}: token {} (node {}) was granted before token {} (node {}) was \
                 released: the token order disagrees with the order of holders",
                w[1].token,
                w[1].node,
                w[0].token,
                w[0].node
            );
        }
    }
    // A grant acknowledged before another's request was sent has the smaller token.
    for g in &grants {
        for h in &grants {
            if g.acked < h.sent {
                assert!(
                    g.token < h.token,
                    "token {} (node {}) was acknowledged before the request of token {} (node \
                     {}) was sent",
                    g.token,
                    g.node,
                    h.token,
                    h.node
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_left_to_expire_are_ended_exactly_once_with_two_reapers() {
    // Guards against two nodes' reapers (and contenders reaping inline) ending the same
    // session twice — two session_expired events, a double cascade — or missing one.
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(2, Some(100)).await;
    const SESSIONS: usize = 40;
    const TTL_MS: u64 = 1000;
    let r = c.nodes[0]
        .put("/v1/pools/expiry", json!({"capacity": SESSIONS}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let mut ids = Vec::new();
    // Opened with a long TTL so that a slow machine cannot expire one before it holds its
    // lock and seat; then each is cut to TTL_MS by a heartbeat and left alone.
    for i in 0..SESSIONS {
        let node = &c.nodes[i % 2];
        let s = node.open(&format!("doomed-{i}"), 60_000).await;
        let r = node
            .post(
                &lock_path(&format!("doomed/{i}"), "acquire"),
                json!({"session_id": s}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let r = node
            .post("/v1/pools/expiry/acquire", json!({"session_id": s}))
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        ids.push(s);
    }
    let mut opened_last = Instant::now();
    for (i, s) in ids.iter().enumerate() {
        let r = c.nodes[1 - i % 2]
            .post(
                &format!("/v1/sessions/{s}/heartbeat"),
                json!({"ttl_ms": TTL_MS}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        opened_last = Instant::now();
    }
    let wanted: BTreeSet<String> = ids.iter().cloned().collect();

    // Once every deadline has passed, a contender on each node asks for every key: each key
    // goes to exactly one of them, whoever ended its holder.
    let lapse = opened_last + Duration::from_millis(TTL_MS + 50);
    tokio::time::sleep_until(lapse.into()).await;
    let contenders = [
        c.nodes[0].open("contender@a", 60_000).await,
        c.nodes[1].open("contender@b", 60_000).await,
    ];
    let mut tasks = Vec::new();
    for (n, s) in contenders.iter().enumerate() {
        let client = c.nodes[n].client.clone();
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut won = Vec::new();
            for i in 0..SESSIONS {
                let path = lock_path(&format!("doomed/{i}"), "acquire");
                let r = tokio::time::timeout(
                    Duration::from_secs(10),
                    client.post(&path, &json!({"session_id": s})),
                )
                .await
                .expect("acquire hung")
                .expect("acquire");
                match r.status.as_u16() {
                    200 => won.push(i),
                    409 if r.body["error"] == "lock_held" => {}
                    _ => panic!("contender acquire doomed/{i}: {} {}", r.status, r.text),
                }
            }
            won
        }));
    }
    let mut winners: HashMap<usize, usize> = HashMap::new();
    for (n, t) in tasks.into_iter().enumerate() {
        for i in t.await.unwrap() {
            assert!(
                winners.insert(i, n).is_none(),
                "doomed/{i} was granted to both contenders"
            );
        }
    }
    assert_eq!(
        winners.len(),
        SESSIONS,
        "every expired holder's key went to a contender"
    );
    eprintln!(
        "contenders done {:?} after the last deadline",
        lapse.elapsed()
    );

    // The audit log, read to its end in small pages, ends each session exactly once.
    let deadline = Instant::now() + Duration::from_secs(10);
    let ended = |events: &[Value]| -> BTreeMap<String, Vec<String>> {
        let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for e in events {
            let kind = e["kind"].as_str().unwrap_or_default();
            if kind.starts_with("session_") && kind != "session_opened" {
                let s = sid(e);
                if wanted.contains(&s) {
                    m.entry(s).or_default().push(kind.to_string());
                }
            }
        }
        m
    };
    loop {
        let m = ended(&all_events(&c.nodes[1], 37).await);
        if m.len() == SESSIONS || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "{} of {SESSIONS} sessions ended in the audit log {:?} after the last deadline",
        ended(&all_events(&c.nodes[1], 1000).await).len(),
        lapse.elapsed()
    );
    // Two more reaper intervals for a late duplicate to show.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let events = all_events(&c.nodes[0], 37).await;
    let m = ended(&events);
    let missing: Vec<&String> = wanted.iter().filter(|s| !m.contains_key(*s)).collect();
    assert!(missing.is_empty(), "sessions never ended: {missing:?}");
    for (s, kinds) in &m {
        assert_eq!(
            kinds,
            &vec!["session_expired".to_string()],
            "session {s} ended {} times",
            kinds.len()
        );
    }
    // The cascade ran once per session: one reclaimed seat each, the pool empty, and every
    // later heartbeat answers "gone".
    for s in &wanted {
        let n = events
            .iter()
            .filter(|e| e["kind"] == "seat_reclaimed" && sid(e) == *s)
            .count();
        assert_eq!(n, 1, "seat of {s} reclaimed {n} times");
        let hb = c.nodes[0]
            .post(&format!("/v1/sessions/{s}/heartbeat"), json!({}))
            .await;
        assert_eq!(hb.status, 404, "heartbeat of an ended session: {}", hb.text);
    }
    for node in &c.nodes {
        let r = node.get("/v1/pools/expiry").await;
        assert_eq!(r.body["in_use"], 0, "{}", r.text);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_heartbeated_through_either_node_are_never_reaped() {
    // Guards against a reaper (or a contender) on one node judging a session by a deadline
    // the other node has already moved on: a live client reaped while its heartbeats arrive
    // within its TTL, through whichever node.
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(2, Some(100)).await;
    const SESSIONS: usize = 8;
    const TTL_MS: u64 = 1000;
    let mut ids = Vec::new();
    for i in 0..SESSIONS {
        let s = c.nodes[i % 2].open(&format!("alive-{i}"), TTL_MS).await;
        let r = c.nodes[i % 2]
            .post(
                &lock_path(&format!("alive/{i}"), "acquire"),
                json!({"session_id": s}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        ids.push(s);
    }
    let contender = c.nodes[1].open("contender", 30_000).await;
    // Each session heartbeats every 200 ms, alternating nodes, for 3.5 s (three and a half
    // TTLs), while a contender on each node keeps asking for the keys.
    let started = Instant::now();
    let until = started + Duration::from_millis(3500);
    let mut beaters = Vec::new();
    for (i, s) in ids.iter().enumerate() {
        let clients = [c.nodes[0].client.clone(), c.nodes[1].client.clone()];
        let s = s.clone();
        beaters.push(tokio::spawn(async move {
            // The longest time from one heartbeat's request to the next one's answer.
            let mut widest = Duration::ZERO;
            let mut last_sent = Instant::now();
            for round in 0..100usize {
                if Instant::now() > until {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                let sent = Instant::now();
                let r = tokio::time::timeout(
                    Duration::from_secs(10),
                    clients[(i + round) % 2]
                        .post(&format!("/v1/sessions/{s}/heartbeat"), &json!({})),
                )
                .await
                .expect("heartbeat hung")
                .expect("heartbeat");
                widest = widest.max(sent.elapsed().max(Instant::now() - last_sent));
                last_sent = sent;
                assert_eq!(
                    r.status,
                    200,
                    "heartbeat {round} of live session {i} (node {}; widest gap between its \
                     heartbeats {widest:?}): {}",
                    (i + round) % 2,
                    r.text
                );
            }
            widest
        }));
    }
    let mut asks = 0;
    while Instant::now() < until {
        for i in 0..SESSIONS {
            let r = c.nodes[(i + asks) % 2]
                .post(
                    &lock_path(&format!("alive/{i}"), "acquire"),
                    json!({"session_id": contender}),
                )
                .await;
            assert_eq!(r.status, 409, "a live holder's key was granted: {}", r.text);
        }
        asks += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for t in beaters {
        let widest = t.await.unwrap();
        assert!(
            widest < Duration::from_millis(TTL_MS - 200),
            "the test could not keep its heartbeats within the TTL (a gap of {widest:?})"
        );
    }
    let events = all_events(&c.nodes[0], 1000).await;
    let ended: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "session_expired")
        .collect();
    assert!(ended.is_empty(), "live sessions were reaped: {ended:?}");
    for (i, s) in ids.iter().enumerate() {
        let r = c.nodes[i % 2].get(&format!("/v1/sessions/{s}")).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(
            r.body["locks"].as_array().map(Vec::len),
            Some(1),
            "{}",
            r.text
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_takers_across_two_nodes_get_exactly_the_pool_capacity() {
    // Guards against a seat count checked and then written in separate steps (read
    // committed): takers on two nodes at once overfilling a pool.
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(2, None).await;
    const CAPACITY: usize = 3;
    const TAKERS: usize = 10;
    for round in 0..5 {
        let pool = format!("seats-{round}");
        let r = c.nodes[round % 2]
            .put(&format!("/v1/pools/{pool}"), json!({"capacity": CAPACITY}))
            .await;
        assert_eq!(r.status, 201, "{}", r.text);
        let mut sessions = Vec::new();
        for i in 0..TAKERS {
            sessions.push(c.nodes[i % 2].open(&format!("taker-{i}"), 60_000).await);
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(TAKERS));
        let mut tasks = Vec::new();
        for (i, s) in sessions.iter().enumerate() {
            let client = c.nodes[i % 2].client.clone();
            let (s, pool, barrier) = (s.clone(), pool.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let r = tokio::time::timeout(
                    Duration::from_secs(10),
                    client.post(
                        &format!("/v1/pools/{pool}/acquire"),
                        &json!({"session_id": s}),
                    ),
                )
                .await
                .expect("seat acquire hung")
                .expect("seat acquire");
                (s, r)
            }));
        }
        let mut winners = BTreeMap::new();
        for t in tasks {
            let (s, r) = t.await.unwrap();
            match r.status.as_u16() {
                200 => {
                    winners.insert(s, r.body["seat_token"].as_u64().unwrap());
                }
                409 => assert_eq!(r.body["error"], "pool_exhausted", "{}", r.text),
                _ => panic!("seat acquire: {} {}", r.status, r.text),
            }
        }
        assert_eq!(
            winners.len(),
            CAPACITY,
            "round {round}: {} of {TAKERS} takers got a seat of {CAPACITY}: {winners:?}",
            winners.len()
        );
        let tokens: BTreeSet<u64> = winners.values().copied().collect();
        assert_eq!(tokens.len(), CAPACITY, "seat tokens are distinct");
        for node in &c.nodes {
            let r = node.get(&format!("/v1/pools/{pool}")).await;
            assert_eq!(r.body["in_use"], CAPACITY, "{}", r.text);
            let holders: BTreeSet<String> = r.body["holders"]
                .as_array()
                .unwrap()
                .iter()
                .map(sid)
                .collect();
            let expected: BTreeSet<String> = winners.keys().cloned().collect();
            assert_eq!(holders, expected, "round {round}: the pool's holders");
        }
        // A seat given back through one node goes to a loser on the other.
        let (w, t) = winners.iter().next().unwrap();
        let wi = sessions.iter().position(|s| s == w).unwrap();
        let r = c.nodes[wi % 2]
            .post(
                &format!("/v1/pools/{pool}/release"),
                json!({"session_id": w, "seat_token": t}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let (li, loser) = sessions
            .iter()
            .enumerate()
            .find(|(i, s)| i % 2 != wi % 2 && !winners.contains_key(*s))
            .unwrap();
        let r = c.nodes[li % 2]
            .post(
                &format!("/v1/pools/{pool}/acquire"),
                json!({"session_id": loser}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let r = c.nodes[wi % 2]
            .post(
                &format!("/v1/pools/{pool}/acquire"),
                json!({"session_id": w}),
            )
            .await;
        assert_eq!(r.status, 409, "the pool is full again: {}", r.text);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_of_a_dead_worker_on_one_node_is_recovered_and_claimed_on_the_other() {
    // Guards against a job lost with its worker's session across nodes, run by two workers at
    // once, or still completable with the dead worker's token.
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(2, Some(100)).await;
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    let r = a
        .post(
            "/v1/queues/work/jobs",
            json!({"payload": {"n": 1}, "idempotent": true, "max_recoveries": 3}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let job = r.body["job_id"].as_str().unwrap().to_string();

    let opened = Instant::now();
    let w = b.open("worker@b", 1000).await;
    let r = b
        .post("/v1/queues/work/claim", json!({"session_id": w}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["job_id"], job.as_str());
    let t1 = r.body["token"].as_u64().unwrap();
    assert_eq!(r.body["attempt"], 1);

    // W stops heartbeating. V, on A, waits for work.
    let v = a.open("worker@a", 30_000).await;
    let r = a.get(&format!("/v1/jobs/{job}")).await;
    assert_eq!(r.body["state"], "claimed", "{}", r.text);
    assert_eq!(r.body["claimed_by"], w.as_str(), "{}", r.text);
    let r = a
        .post(
            "/v1/queues/work/claim",
            json!({"session_id": v, "wait_ms": 5000}),
        )
        .await;
    let claimed = Instant::now();
    assert_eq!(
        r.status, 200,
        "the recovered job reached the waiting worker: {}",
        r.text
    );
    assert_eq!(r.body["job_id"], job.as_str(), "{}", r.text);
    let t2 = r.body["token"].as_u64().unwrap();
    assert!(t2 > t1, "the new claim's token {t2} after {t1}");
    assert_eq!(r.body["attempt"], 2, "{}", r.text);
    assert_eq!(r.body["recovery_count"], 1, "{}", r.text);
    assert!(
        claimed >= opened + Duration::from_millis(1000),
        "the job was taken from W {:?} after W opened, within its TTL",
        claimed - opened
    );

    // The dead worker's token is refused on both nodes.
    for node in [b, a] {
        let r = node
            .post(
                &format!("/v1/jobs/{job}/complete"),
                json!({"session_id": w, "token": t1}),
            )
            .await;
        let refused = (r.status == 409 && r.body["error"] == "stale_token")
            || (r.status == 404 && r.body["error"] == "session_gone");
        assert!(
            refused,
            "the dead worker completed through {}: {}",
            node.name(),
            r.text
        );
    }
    let r = b
        .post(&format!("/v1/sessions/{w}/heartbeat"), json!({}))
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
    let r = a
        .post(
            &format!("/v1/jobs/{job}/complete"),
            json!({"session_id": v, "token": t2, "result": {"ok": true}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = b.get(&format!("/v1/jobs/{job}")).await;
    assert_eq!(r.body["state"], "done", "{}", r.text);
    assert_eq!(r.body["recovery_count"], 1, "{}", r.text);

    let events = all_events(a, 100).await;
    let recovered: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "job_recovered" && e["job_id"] == job.as_str())
        .collect();
    assert_eq!(recovered.len(), 1, "job_recovered events: {recovered:?}");
    assert_eq!(recovered[0]["token"], t1, "{}", recovered[0]);
    let ends = events
        .iter()
        .filter(|e| sid(e) == w && e["kind"] == "session_expired")
        .count();
    assert_eq!(ends, 1, "W ended once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill_9_of_one_node_the_other_serves_its_grants_until_their_ttl() {
    // Guards against a node's grants living in that node: lost when it dies, released at
    // once instead of at the holder's deadline, or pinned after it — for its lock, its seat
    // and its claimed job alike.
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start(2, Some(100)).await;
    const TTL_MS: u64 = 2000;
    let key = "crashy/one";
    let a = &c.nodes[0];
    let sa = a.open("holder@a", TTL_MS).await;
    let r = a
        .post(&lock_path(key, "acquire"), json!({"session_id": sa}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let token = r.body["token"].as_u64().unwrap();
    let r = a.put("/v1/pools/crashy", json!({"capacity": 1})).await;
    assert_eq!(r.status, 201, "{}", r.text);
    let r = a
        .post("/v1/pools/crashy/acquire", json!({"session_id": sa}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let seat = r.body["seat_token"].as_u64().unwrap();
    let r = a
        .post(
            "/v1/queues/crashy/jobs",
            json!({"payload": 1, "idempotent": true}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let job = r.body["job_id"].as_str().unwrap().to_string();
    let r = a
        .post("/v1/queues/crashy/claim", json!({"session_id": sa}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let claim = r.body["token"].as_u64().unwrap();
    let mut last_beat = Instant::now();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        last_beat = Instant::now();
        let r = a
            .post(&format!("/v1/sessions/{sa}/heartbeat"), json!({}))
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    c.nodes[0].kill();
    let killed = Instant::now();

    let b = &c.nodes[1];
    let r = b.get("/readyz").await;
    assert_eq!(r.status, 200, "B is ready after A died: {}", r.text);
    let sb = b.open("contender@b", 30_000).await;
    let r = b.get(&format!("/v1/locks/{}", segment(key))).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(sid(&r.body), sa, "A's grant, through B: {}", r.text);
    assert_eq!(r.body["token"], token, "{}", r.text);
    let r = b.get(&format!("/v1/sessions/{sa}")).await;
    assert_eq!(r.status, 200, "A's session, through B: {}", r.text);
    assert_eq!(r.body["seats"][0]["seat_token"], seat, "{}", r.text);
    assert_eq!(r.body["jobs"][0], job.as_str(), "{}", r.text);
    let fence = b
        .get(&format!("/v1/fence/{}?token={token}", segment(key)))
        .await;
    let lock_now = b
        .post(&lock_path(key, "acquire"), json!({"session_id": sb}))
        .await;
    let seat_now = b
        .post("/v1/pools/crashy/acquire", json!({"session_id": sb}))
        .await;
    let checked = Instant::now();
    assert!(
        checked < last_beat + Duration::from_millis(TTL_MS),
        "the checks took too long ({:?} after the kill) to be made within the TTL",
        checked - killed
    );
    assert_eq!(
        fence.body["current"], true,
        "A's token is current until its TTL: {}",
        fence.text
    );
    assert_eq!(
        lock_now.status, 409,
        "the key is A's until its TTL: {}",
        lock_now.text
    );
    assert_eq!(
        seat_now.status, 409,
        "the seat is A's until its TTL: {}",
        seat_now.text
    );

    // B's contender waits for all three at once and gets each once A's session has lapsed —
    // not before.
    let (lock, seat_r, claim_r) = tokio::join!(
        async {
            let r = b
                .post(
                    &lock_path(key, "acquire"),
                    json!({"session_id": sb, "wait_ms": 5000}),
                )
                .await;
            (r, Instant::now())
        },
        async {
            let r = b
                .post(
                    "/v1/pools/crashy/acquire",
                    json!({"session_id": sb, "wait_ms": 5000}),
                )
                .await;
            (r, Instant::now())
        },
        async {
            let r = b
                .post(
                    "/v1/queues/crashy/claim",
                    json!({"session_id": sb, "wait_ms": 5000}),
                )
                .await;
            (r, Instant::now())
        },
    );
    let lapse = last_beat + Duration::from_millis(TTL_MS);
    for (what, (r, at), field, before) in [
        ("lock", &lock, "token", token),
        ("seat", &seat_r, "seat_token", seat),
        ("job", &claim_r, "token", claim),
    ] {
        assert_eq!(
            r.status, 200,
            "B's contender for the {what} after A's TTL: {}",
            r.text
        );
        let t = r.body[field].as_u64().unwrap();
        assert!(t > before, "{what}: token {t} after A's {before}");
        assert!(
            *at >= lapse,
            "{what} granted {:?} after A's last heartbeat was sent, within its TTL",
            *at - last_beat
        );
        assert!(
            *at <= lapse + Duration::from_millis(1500),
            "{what} granted only {:?} after A's last heartbeat",
            *at - last_beat
        );
    }
    assert_eq!(claim_r.0.body["job_id"], job.as_str(), "{}", claim_r.0.text);
    assert_eq!(claim_r.0.body["recovery_count"], 1, "{}", claim_r.0.text);
    let r = b
        .post(&format!("/v1/sessions/{sa}/heartbeat"), json!({}))
        .await;
    assert_eq!(r.status, 404, "A's session is gone: {}", r.text);
    let events = all_events(b, 100).await;
    for kind in ["session_expired", "seat_reclaimed", "job_recovered"] {
        let n = events
            .iter()
            .filter(|e| e["kind"] == kind && sid(e) == sa)
            .count();
        assert_eq!(n, 1, "{kind} events for A's session: {n}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_load_loses_no_acknowledged_grant_and_no_token_goes_back() {
    // Guards against a node that answers before the database committed (a lost grant after
    // kill -9), a restart on the same schema that resets or reuses the token sequence, and a
    // dead node's sessions or locks disappearing or coming back.
    let _serial = SERIAL.lock().await;
    let seed = seed();
    eprintln!("kill -9 under load, seed {seed} (rerun with PG_NODES_SEED={seed})");
    let mut rng = Rng::new(seed);
    let mut c = Cluster::start(2, None).await;
    const CYCLES: usize = 6;
    const KEYS: usize = 12;
    const WORKERS: usize = 8;
    const TTL_MS: u64 = 120_000;
    let ledger = Arc::new(Mutex::new(Ledger::new(KEYS)));
    let mut slots: Vec<Option<String>> = vec![None; WORKERS];
    let mut kills_in_flight = 0;
    let started = Instant::now();
    for cycle in 0..CYCLES {
        let victim = cycle % 2;
        let stop = Arc::new(AtomicBool::new(false));
        let in_flight: Vec<Arc<InFlight>> = (0..2).map(|_| Arc::default()).collect();
        let clients: Vec<_> = (0..2)
            .map(|n| (c.nodes[n].client.clone(), n == victim, in_flight[n].clone()))
            .collect();
        // Slots rotate over the nodes, so sessions opened through one are used through the
        // other.
        slots.rotate_left(1);
        let tasks = ledger::spawn_workers(
            &mut slots,
            &clients,
            &ledger,
            &stop,
            &mut rng,
            TTL_MS,
            Duration::from_secs(20),
        );
        tokio::time::sleep(Duration::from_millis(rng.between(150, 500))).await;
        assert!(c.nodes[victim].running(), "node {victim} exited by itself");
        let pending = in_flight[victim].now();
        c.nodes[victim].kill();
        kills_in_flight += usize::from(pending > 0);
        // The survivor's clients go on for a while, then everyone stops.
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.store(true, Ordering::SeqCst);
        let doubts = ledger::join_workers(tasks, &mut slots, Duration::from_secs(30)).await;
        let spec: NodeSpec = c.nodes[victim].spec.clone();
        c.nodes[victim] = Node::start(&spec).await;

        let mut l = std::mem::replace(&mut *ledger.lock().unwrap(), Ledger::new(KEYS));
        let what = format!("cycle {cycle} (seed {seed})");
        ledger::verify(&c.nodes[victim], &mut l, &what).await;
        ledger::verify(&c.nodes[1 - victim], &mut l, &what).await;
        for n in 0..2 {
            ledger::probe(&c.nodes[n], &mut l, &format!("probe/{cycle}/{n}"), &what).await;
        }
        assert!(
            l.violations.is_empty(),
            "{what}: {pending} requests in flight at the kill, {doubts} workers in doubt:\n- {}",
            l.violations.join("\n- ")
        );
        ledger::settle_slots(&mut slots, &l);
        *ledger.lock().unwrap() = l;
    }
    let l = ledger.lock().unwrap();
    eprintln!(
        "{CYCLES} kills in {:?}, {kills_in_flight} with requests in flight: {:?}",
        started.elapsed(),
        l.stats
    );
    assert!(
        kills_in_flight * 2 >= CYCLES,
        "only {kills_in_flight} of {CYCLES} kills landed with requests in flight"
    );
    assert!(
        l.stats.acquired >= 5 * CYCLES as u64
            && l.stats.released >= 2 * CYCLES as u64
            && l.stats.closed >= 1
            && l.stats.in_doubt >= 1,
        "too little load to test anything: {:?}",
        l.stats
    );
}

/// With the database down: `/readyz` turns 503 within 10 s (polled alone, so a node without
/// traffic must notice by itself), then every call answers `503 backend_unavailable`.
async fn assert_unavailable(node: &Node, session: Option<&str>, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = node.get("/readyz").await;
        if r.status == 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: /readyz of {} still {} {} 10 s into the outage\n{}",
            node.name(),
            r.status,
            r.text,
            pgnodes::tail(&node.spec.log)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut calls = vec![
        (
            "POST",
            "/v1/sessions".to_string(),
            Some(json!({"owner": "probe"})),
        ),
        (
            "GET",
            format!("/v1/locks/{}", segment(&ledger::key_name(0))),
            None,
        ),
        ("GET", "/v1/events?after=0&limit=10".to_string(), None),
    ];
    if let Some(s) = session {
        calls.push(("GET", format!("/v1/sessions/{s}"), None));
        calls.push((
            "POST",
            format!("/v1/sessions/{s}/heartbeat"),
            Some(json!({})),
        ));
        calls.push((
            "POST",
            lock_path(&ledger::key_name(1), "acquire"),
            Some(json!({"session_id": s})),
        ));
    }
    for (method, path, body) in &calls {
        let r = match *method {
            "GET" => node.get(path).await,
            _ => node.post(path, body.clone().unwrap()).await,
        };
        assert!(
            r.status == 503 && r.body["error"] == "backend_unavailable",
            "{what}: {method} {path} on {} with the database down: {} {}\n{}",
            node.name(),
            r.status,
            r.text,
            pgnodes::tail(&node.spec.log)
        );
    }
    let r = node.get("/readyz").await;
    assert_eq!(
        r.status, 503,
        "{what}: /readyz during the outage: {}",
        r.text
    );
}

/// After the database came back: ready within 20 s, and then the very next calls succeed.
async fn assert_recovered(node: &Node, what: &str) {
    let back = Instant::now();
    loop {
        let r = node.get("/readyz").await;
        if r.status == 200 {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(20),
            "{what}: {} not ready 20 s after the database came back: {} {}\n{}",
            node.name(),
            r.status,
            r.text,
            pgnodes::tail(&node.spec.log)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "{what}: {} ready {:?} after the restart",
        node.name(),
        back.elapsed()
    );
    // Ready means serving, on every pooled connection.
    for i in 0..10 {
        let r = node
            .post("/v1/sessions", json!({"owner": "after", "ttl_ms": 5000}))
            .await;
        assert_eq!(
            r.status,
            201,
            "{what}: call {i} through {} after it said ready: {}\n{}",
            node.name(),
            r.text,
            pgnodes::tail(&node.spec.log)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_ride_out_a_postgres_restart_under_load() {
    // Guards against a node that stays wedged after its database restarts (dead pooled
    // connections, readiness stuck false, a notification listener never reconnected, a node
    // started during the outage that never finishes starting), that says ready or answers
    // anything but 503 while the database is down (a false "session gone", a 500), or that
    // loses acknowledged state over it.
    let _serial = SERIAL.lock().await;
    let seed = seed();
    eprintln!("postgres restart under load, seed {seed} (rerun with PG_NODES_SEED={seed})");
    let mut rng = Rng::new(seed);
    let pg = PrivateCluster::new();
    pg.start();
    let schema = Schema::new(&pg.url());
    let logs = tempfile::tempdir().unwrap();
    // A carries the load; B stays idle through the outages.
    let a = Node::start(&NodeSpec::new("A", &schema, logs.path())).await;
    let b = Node::start(&NodeSpec::new("B", &schema, logs.path()).reaper(100)).await;
    const OUTAGES: usize = 2;
    const KEYS: usize = 10;
    const WORKERS: usize = 6;
    const TTL_MS: u64 = 120_000;
    let ledger = Arc::new(Mutex::new(Ledger::new(KEYS)));
    let mut slots: Vec<Option<String>> = vec![None; WORKERS];
    let mut stops_in_flight = 0;
    let mut late: Option<Node> = None;
    for outage in 0..OUTAGES {
        let what = format!("outage {outage} (seed {seed})");
        let stop = Arc::new(AtomicBool::new(false));
        let in_flight: Arc<InFlight> = Arc::default();
        let clients = vec![(a.client.clone(), true, in_flight.clone())];
        let tasks = ledger::spawn_workers(
            &mut slots,
            &clients,
            &ledger,
            &stop,
            &mut rng,
            TTL_MS,
            Duration::from_secs(20),
        );
        tokio::time::sleep(Duration::from_millis(rng.between(200, 500))).await;
        let pending = in_flight.now();
        pg.stop_fast();
        stops_in_flight += usize::from(pending > 0);
        let doubts = ledger::join_workers(tasks, &mut slots, Duration::from_secs(30)).await;

        let s = slots.iter().flatten().next().cloned();
        assert_unavailable(&b, None, &what).await;
        assert_unavailable(&a, s.as_deref(), &what).await;
        // In the last outage a third node starts with the database down: it must come up
        // unready, and serve once the database is back.
        if outage == OUTAGES - 1 {
            let c = Node::start_serving(&NodeSpec::new("C", &schema, logs.path())).await;
            assert_unavailable(&c, s.as_deref(), &what).await;
            late = Some(c);
        }

        pg.start();
        assert_recovered(&a, &what).await;
        assert_recovered(&b, &what).await;
        let mut l = std::mem::replace(&mut *ledger.lock().unwrap(), Ledger::new(KEYS));
        if let Some(c) = &late {
            assert_recovered(c, &what).await;
            ledger::verify(c, &mut l, &what).await;
        }
        ledger::verify(&a, &mut l, &what).await;
        ledger::verify(&b, &mut l, &what).await;
        ledger::probe(&a, &mut l, &format!("probe/{outage}/a"), &what).await;
        ledger::probe(&b, &mut l, &format!("probe/{outage}/b"), &what).await;
        assert!(
            l.violations.is_empty(),
            "{what}: {pending} requests in flight at the stop, {doubts} workers in doubt:\n- \
             {}\n{}",
            l.violations.join("\n- "),
            pgnodes::tail(&a.spec.log)
        );
        ledger::settle_slots(&mut slots, &l);
        *ledger.lock().unwrap() = l;

        // Wake-ups across nodes come back too: within 12 s (the notification connection
        // reconnects with a backoff of at most 5 s), a release on A wakes B's waiter at once.
        let since = Instant::now();
        for attempt in 0.. {
            let lag = wake_lag(&a, &b, &format!("wake/{outage}/{attempt}")).await;
            assert!(
                lag <= Duration::from_secs(1),
                "{what}: B's waiter answered {lag:?} after A's release"
            );
            if lag <= PUSHED_WAKE {
                eprintln!(
                    "{what}: cross-node wake-ups back {:?} after recovery",
                    since.elapsed()
                );
                break;
            }
            assert!(
                since.elapsed() < Duration::from_secs(12),
                "{what}: 12 s after recovery B's waiters are still not woken by A's \
                 releases (last lag {lag:?})\n{}",
                pgnodes::tail(&b.spec.log)
            );
        }
    }
    // Load after the last recovery, with no failure allowed.
    let stop = Arc::new(AtomicBool::new(false));
    let clients = vec![
        (a.client.clone(), false, Arc::default()),
        (b.client.clone(), false, Arc::default()),
    ];
    let tasks = ledger::spawn_workers(
        &mut slots,
        &clients,
        &ledger,
        &stop,
        &mut rng,
        TTL_MS,
        Duration::from_secs(20),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    ledger::join_workers(tasks, &mut slots, Duration::from_secs(30)).await;
    let mut l = std::mem::replace(&mut *ledger.lock().unwrap(), Ledger::new(KEYS));
    ledger::verify(&b, &mut l, "after the outages").await;
    assert!(
        l.violations.is_empty(),
        "after the outages:\n- {}\n{}",
        l.violations.join("\n- "),
        pgnodes::tail(&a.spec.log)
    );
    eprintln!(
        "{OUTAGES} outages, {stops_in_flight} with requests in flight: {:?}",
        l.stats
    );
    assert!(
        stops_in_flight >= 1 && l.stats.acquired >= 10 && l.stats.unavailable >= 1,
        "too little load to test anything: {stops_in_flight} stops in flight, {:?}",
        l.stats
    );
    assert!(
        late.is_some(),
        "the node started during the outage was checked"
    );
    drop((a, b, late));
    drop(schema);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_through_the_other_node_gets_the_first_answer() {
    // Guards against request ids remembered per node: a client whose answer from A was lost
    // retries through B (a load balancer sends it there), and must not enqueue twice, take a
    // lock back that it released, or be told `not_holder` for a release that worked.
    let _serial = SERIAL.lock().await;
    let c = Cluster::start(2, None).await;
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    let enqueue = json!({"payload": {"n": 1}, "request_id": "enq-x"});
    let first = a.post("/v1/queues/xq/jobs", enqueue.clone()).await;
    assert_eq!(first.status, 201, "{}", first.text);
    let retry = b.post("/v1/queues/xq/jobs", enqueue).await;
    assert_eq!(retry.body, first.body, "{}", retry.text);
    let r = b.get("/v1/queues/xq").await;
    assert_eq!(r.body["queued"], 1, "{}", r.text);

    let s = a.open("retrier", 30_000).await;
    let acquire = json!({"session_id": s, "request_id": "acq-x"});
    let got = a.post(&lock_path("xk", "acquire"), acquire.clone()).await;
    assert_eq!(got.status, 200, "{}", got.text);
    let release = json!({"session_id": s, "token": got.body["token"], "request_id": "rel-x"});
    let rel = a.post(&lock_path("xk", "release"), release.clone()).await;
    assert_eq!(rel.status, 200, "{}", rel.text);
    let r = b.post(&lock_path("xk", "release"), release).await;
    assert_eq!(r.body, rel.body, "{}", r.text);
    let r = b.post(&lock_path("xk", "acquire"), acquire).await;
    assert_eq!(r.body, got.body, "{}", r.text);
    let r = b.get("/v1/locks/xk").await;
    assert_eq!(
        r.status, 404,
        "the retried acquire took nothing: {}",
        r.text
    );

    // Concurrent retries through both nodes act once.
    let body = json!({"payload": "both", "request_id": "enq-both"});
    let (ra, rb) = tokio::join!(
        a.post("/v1/queues/bq/jobs", body.clone()),
        b.post("/v1/queues/bq/jobs", body)
    );
    assert_eq!(ra.status, 201, "{}", ra.text);
    assert_eq!(ra.body, rb.body, "{}", rb.text);
    assert_eq!(a.get("/v1/queues/bq").await.body["queued"], 1);
}
