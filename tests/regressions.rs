//! Regression tests: each guards one failure that the embedded backend once had, and opens
//! with the story of that failure.
//!
//! The HTTP ones run a real server on port 0 on a manual clock (the shared harness, with no
//! background reaper, so a session expires only when a test advances the clock); the store
//! ones drive the store directly. The ordering of the heartbeat fast path against readers is
//! tested beside that fast path, where the test can see the state lock.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{TestServer, assert_error, session};
use hyper::Method;
use leasehold::backend::embedded::store::{Batch, DATA_FILE, Store};
use leasehold::client::{Reply, segment};
use leasehold::domain::{Change, Event, EventKind, UnixMs};
use serde_json::{Value, json};

const CACHE: usize = 1 << 20;

async fn put_pool(s: &TestServer, pool: &str, body: Value) -> Reply {
    s.client
        .call(
            Method::PUT,
            &format!("/v1/pools/{}", segment(pool)),
            Some(&body),
        )
        .await
        .unwrap()
}

async fn lock(s: &TestServer, key: &str) -> Reply {
    s.get(&format!("/v1/locks/{}", segment(key))).await
}

fn token_of(r: &Reply) -> u64 {
    assert_eq!(r.status, 200, "{}", r.text);
    r.body["token"].as_u64().unwrap()
}

/// Waits (bounded, 5 s) until the writer holds `n` waiters, as the metrics report them.
async fn until_waiting(s: &TestServer, n: u64) {
    let want = format!("leasehold_waiters {n}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = s.get("/metrics").await;
        if metrics.text.lines().any(|l| l.trim() == want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never {n} waiters:\n{}",
            metrics.text
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Two concurrent resizes of one pool must come out as if one ran after the other.
///
/// The story: `PUT /v1/pools/{pool}` read the pool's record (its creation time and metadata)
/// from the store before sending the resize to the writer, and the writer wrote back what
/// had been read. A resize without metadata racing a resize that set new metadata could
/// read the old metadata first and be applied second, putting the old metadata back: an
/// update that the API had acknowledged was silently lost. Each round here races exactly
/// that pair; before the fix about half the rounds lost the new metadata.
#[tokio::test]
async fn concurrent_pool_puts_lose_no_update() {
    let s = TestServer::start().await;
    for round in 0..20 {
        let pool = format!("race/{round}");
        let made = put_pool(&s, &pool, json!({"capacity": 1, "metadata": {"v": 1}})).await;
        assert_eq!(made.status, 201, "{}", made.text);
        let created_at = s.get(&format!("/v1/pools/{}", segment(&pool))).await.body["created_at"]
            .as_u64()
            .unwrap();
        s.advance(1_000).await;
        let (new_metadata, resize) = tokio::join!(
            put_pool(&s, &pool, json!({"capacity": 2, "metadata": {"v": 2}})),
            put_pool(&s, &pool, json!({"capacity": 3})),
        );
        assert_eq!(new_metadata.status, 200, "{}", new_metadata.text);
        assert_eq!(resize.status, 200, "{}", resize.text);
        let r = s.get(&format!("/v1/pools/{}", segment(&pool))).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(
            r.body["metadata"],
            json!({"v": 2}),
            "round {round}: a resize without metadata put back what it had read: {}",
            r.text
        );
        assert_eq!(
            r.body["created_at"], created_at,
            "round {round}: {}",
            r.text
        );
        let capacity = r.body["capacity"].as_u64().unwrap();
        assert!(capacity == 2 || capacity == 3, "round {round}: {}", r.text);
    }
    s.stop().await;
}

/// A session that any answer called gone stays gone across a restart, and so do its grants.
///
/// The story: `GET /v1/sessions/{id}` of a session past its deadline answered
/// `404 session_gone` straight from memory. Nothing durable changed, so the restart grace
/// gave the session a fresh TTL at the next start: the client that had been told its
/// session was gone could see it alive again, still holding its lock. (The read still ends
/// nothing itself — that stays the reaper's or a contender's — but takes the restart grace
/// away first.)
#[tokio::test]
async fn a_session_read_as_gone_stays_gone_after_a_restart() {
    let mut s = TestServer::start().await;
    let id = s.open("reader", 1_000).await;
    let other = s.open("other", 60_000).await;
    token_of(&s.acquire("held/by-the-lapsed", &id).await);
    token_of(&s.acquire("taken/by-a-contender", &id).await);
    s.advance(1_500).await;
    assert_error(&session(&s, &id).await, 404, "session_gone");

    s.restart().await;
    assert_error(&session(&s, &id).await, 404, "session_gone");
    // Its grants are free: to a contender at once, and to everyone once the gone session
    // has been ended (here by its own late heartbeat).
    token_of(&s.acquire("taken/by-a-contender", &other).await);
    assert_error(&s.heartbeat(&id).await, 404, "session_gone");
    assert_error(&lock(&s, "held/by-the-lapsed").await, 404, "lock_free");
    assert_error(&session(&s, &id).await, 404, "session_gone");
    s.stop().await;
}

/// A waiter whose session lapsed while it waited is told gone only once that is durable.
///
/// The story: a lock request waiting behind a holder, whose own session passed its deadline
/// while it waited, was answered `404 session_gone` when its wait ran out — from memory, the
/// session never ended. After a restart the restart grace revived the session, with the
/// lock it already held, although its client had been told it was gone.
#[tokio::test]
async fn a_waiter_told_its_session_is_gone_stays_gone_after_a_restart() {
    let mut s = TestServer::start().await;
    let holder = s.open("holder", 60_000).await;
    let waiter = s.open("waiter", 1_000).await;
    token_of(&s.acquire("contended", &holder).await);
    token_of(&s.acquire("own", &waiter).await);
    let client = s.client.clone();
    let wait = {
        let body = json!({"session_id": waiter, "wait_ms": 5_000});
        tokio::spawn(async move { client.post("/v1/locks/contended/acquire", &body).await })
    };
    until_waiting(&s, 1).await;
    // Past the waiter's TTL and its wait; the next request through the writer times it out.
    s.advance(6_000).await;
    let other = s.open("wakes-the-writer", 60_000).await;
    let answer = wait.await.unwrap().unwrap();
    assert_error(&answer, 404, "session_gone");

    s.restart().await;
    assert_error(&session(&s, &waiter).await, 404, "session_gone");
    assert_error(&lock(&s, "own").await, 404, "lock_free");
    token_of(&s.acquire("own", &other).await);
    assert_eq!(session(&s, &holder).await.status, 200);
    s.stop().await;
}

fn event(seq: u64, kind: EventKind) -> Change {
    Change::Event(Event::new(seq, UnixMs(1_700_000_000_000 + seq), kind))
}

fn batch(changes: &[Change], revision: u64, event_seq: u64) -> Batch<'_> {
    Batch {
        changes,
        revision,
        event_seq,
        ..Batch::default()
    }
}

/// The audit counter only ratchets up.
///
/// The story: the store wrote `event_seq` as it was given, unconditionally, unlike the
/// revision. A commit carrying a lower counter was accepted; the next start handed out
/// sequence numbers that the audit log already held.
#[test]
fn the_event_counter_never_goes_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), CACHE).unwrap();
    store
        .commit(&batch(&[event(5, EventKind::PoolPut)], 1, 5))
        .unwrap();
    let lowered = store.commit(&batch(&[], 2, 3));
    let refused = lowered.expect_err("a commit that lowers the audit counter is refused");
    assert!(refused.to_string().contains("event"), "{refused}");
    // Refused like any failed write: the store is fail-stopped, the counter unchanged.
    assert!(store.failed());
    drop(store);
    let store = Store::open(dir.path(), CACHE).unwrap();
    assert_eq!(store.load().unwrap().event_seq, 5);
}

/// An audit event, once written, is never replaced.
///
/// The story: events were inserted by sequence number without looking, so an event given a
/// number the log already held silently replaced the event that was there — an audit
/// record, say of a session's expiry, lost without a trace.
#[test]
fn an_event_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), CACHE).unwrap();
    store
        .commit(&batch(
            &[
                event(1, EventKind::SessionOpened),
                event(2, EventKind::SessionExpired),
            ],
            2,
            2,
        ))
        .unwrap();
    let again = store.commit(&batch(&[event(2, EventKind::SessionOpened)], 3, 3));
    let refused = again.expect_err("a commit that reuses a sequence number is refused");
    assert!(refused.to_string().contains("event 2"), "{refused}");
    assert!(store.failed());
    drop(store);
    let store = Store::open(dir.path(), CACHE).unwrap();
    let kinds: Vec<_> = store
        .events(0, 10)
        .unwrap()
        .iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds, [EventKind::SessionOpened, EventKind::SessionExpired]);
}

/// Sets the stored audit counter behind the store's back, as a bug or a damaged file would.
fn lower_event_counter(dir: &Path, to: u64) {
    let db = redb::Database::open(dir.join(DATA_FILE)).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut meta = txn
            .open_table(redb::TableDefinition::<&str, u64>::new("meta"))
            .unwrap();
        meta.insert("event_seq", to).unwrap();
    }
    txn.commit().unwrap();
}

/// A start-up on an audit counter behind the log continues above the log.
///
/// The story: at start-up the counter was taken as stored. Had it fallen behind the last
/// event, every event of the new process would have been numbered over an existing one,
/// overwriting the log from there on.
#[test]
fn start_up_continues_above_the_last_event() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), CACHE).unwrap();
    let events: Vec<_> = (1..=3).map(|n| event(n, EventKind::PoolPut)).collect();
    store.commit(&batch(&events, 3, 3)).unwrap();
    drop(store);
    lower_event_counter(dir.path(), 1);

    let store = Store::open(dir.path(), CACHE).unwrap();
    let restore = store.load().unwrap();
    assert_eq!(
        restore.event_seq, 3,
        "the counter is repaired up to the log"
    );
    let next = restore.event_seq + 1;
    store
        .commit(&batch(&[event(next, EventKind::PoolDeleted)], 4, next))
        .unwrap();
    assert!(store.check().unwrap().problems.is_empty());
    assert_eq!(store.events(0, 10).unwrap().len(), 4);
}
