//! A storm of expiries on the embedded backend, worked off by the background reaper's paced
//! passes while a live client keeps taking and releasing a lock: once in many small passes,
//! once in a few passes of thousands of sessions each (one commit per pass), as a storm runs
//! when a pass may take as long as the commit it rides.
//!
//! The failure this guards against: a reaper made faster by a new store layout (rows keyed
//! by creation order, grants indexed by row) that ends a session twice across two passes,
//! drops one between passes, leaves a grant index entry behind, or audits a lock release
//! that the lock table does not show. Time is a manual clock: the test moves it past every
//! deadline at once and waits for the reaper to say it is done, asserting only on what was
//! committed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use leasehold::backend::EngineConfig;
use leasehold::backend::embedded::Embedded;
use leasehold::backend::embedded::store::Store;
use leasehold::clock::{Clock, ManualClock};
use leasehold::domain::{EndReason, EventKind, LockKey, SessionId, Token, UnixMs};
use leasehold::engine::Engine;
use leasehold::metrics::Metrics;

const DYING: usize = 6_000;
const TTL_MS: u64 = 2_000;

fn key(text: &str) -> LockKey {
    LockKey::parse("key", text).unwrap()
}

/// How the reaper's passes are sized in a run.
#[derive(Clone, Copy)]
struct Pacing {
    pass_ms: u64,
    batch: usize,
}

/// Small passes, so the storm takes many of them with the live client's requests served
/// between.
const SMALL_PASSES: Pacing = Pacing {
    pass_ms: 1,
    batch: 10_000,
};

/// Passes as large as the batch allows, each ending thousands of sessions in one commit, as
/// a storm on a slow disk is worked off: a pass may take as long as the commit it rides.
const LARGE_PASSES: Pacing = Pacing {
    pass_ms: 10_000,
    batch: 2_500,
};

fn start(dir: &std::path::Path, clock: &ManualClock, pacing: Pacing) -> Engine {
    let store = Store::open(dir, 64 << 20).unwrap();
    let config = EngineConfig {
        reaper_enabled: true,
        reaper_interval_ms: 20,
        reaper_pass_ms: pacing.pass_ms,
        reaper_batch: pacing.batch,
        ..EngineConfig::default()
    };
    let clock: Arc<dyn Clock> = Arc::new(clock.clone());
    Embedded::start(config, store, clock, Arc::new(Metrics::new()))
        .unwrap()
        .into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_expiries_audits_every_session_once_and_frees_every_lock() {
    storm(SMALL_PASSES).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_in_large_passes_audits_every_session_once_and_frees_every_lock() {
    storm(LARGE_PASSES).await;
}

/// Lists every `storm/` lock, page by page, until `stop`; returns how many listings it made.
async fn list_until_stopped(
    engine: Engine,
    granted: HashMap<String, Token>,
    stop: Arc<AtomicBool>,
) -> usize {
    let mut before: Option<HashSet<String>> = None;
    let mut listings = 0;
    while !stop.load(Ordering::Relaxed) {
        let mut shown = HashSet::new();
        let mut after = None;
        loop {
            let (page, next) = engine.locks("storm/", after.as_deref(), 700).await.unwrap();
            for (k, lock) in page {
                assert_eq!(lock.token, granted[&k], "{k} is listed with another token");
                shown.insert(k);
            }
            match next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        if let Some(before) = &before {
            let back: Vec<_> = shown.difference(before).take(5).collect();
            assert!(
                back.is_empty(),
                "freed locks listed as held again: {back:?}"
            );
        }
        before = Some(shown);
        listings += 1;
        tokio::task::yield_now().await;
    }
    listings
}

async fn storm(pacing: Pacing) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(1_800_000_000_000));
    let engine = start(dir.path(), &clock, pacing);

    let live = engine
        .open("live".into(), Some(600_000), None)
        .await
        .unwrap()
        .id;
    let kept = engine.acquire(live, key("live/kept"), 0).await.unwrap();

    // Opened and locked concurrently, so that they share commits as in service.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..DYING {
        let engine = engine.clone();
        tasks.spawn(async move {
            let id = engine
                .open("dying".into(), Some(TTL_MS), None)
                .await
                .unwrap()
                .id;
            let k = key(&format!("storm/{i:05}"));
            let granted = engine.acquire(id, k.clone(), 0).await.unwrap();
            (id, k, granted.token)
        });
    }
    let mut dying: HashMap<SessionId, (LockKey, Token)> = HashMap::new();
    while let Some(done) = tasks.join_next().await {
        let (id, k, token) = done.unwrap();
        dying.insert(id, (k, token));
    }
    assert_eq!(dying.len(), DYING);

    // A reader lists the storm's locks over and over while they are reaped and their rows
    // deleted: nobody takes a storm key again, so each listing shows a subset of the one
    // before (a lock once shown free is never shown held again), each with its own token.
    let stop = Arc::new(AtomicBool::new(false));
    let lister = tokio::spawn(list_until_stopped(
        engine.clone(),
        dying
            .values()
            .map(|(k, t)| (k.as_str().to_string(), *t))
            .collect(),
        stop.clone(),
    ));

    clock.advance(TTL_MS);
    // The live client keeps working through the storm; each of its rounds must succeed.
    let metrics = engine.metrics().clone();
    let give_up = Instant::now() + Duration::from_secs(120);
    let mut rounds = 0u64;
    while metrics.sessions_active.get() != 1 {
        assert!(Instant::now() < give_up, "the reaper did not finish");
        engine.heartbeat(live, None).await.unwrap();
        let g = engine.acquire(live, key("live/churn"), 0).await.unwrap();
        engine
            .release(live, key("live/churn"), g.token)
            .await
            .unwrap();
        rounds += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(rounds > 0);
    // With no traffic but the reaper's own passes, the deferred deletes are all applied: a
    // pass that finds nothing due does not keep the storm on.
    let applied_by = Instant::now() + Duration::from_secs(30);
    while metrics.end_log_sessions.get() != 0 {
        assert!(
            Instant::now() < applied_by,
            "the end log was not applied: {} sessions pending",
            metrics.end_log_sessions.get()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let listings = lister.await.unwrap();
    assert!(listings > 1, "the storm was listed {listings} times");

    // Every dying session was audited exactly once, as expired, releasing exactly its lock
    // with the token it was granted.
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let (page, next) = engine.events(after, 10_000).await.unwrap();
        if page.is_empty() {
            break;
        }
        after = next.unwrap();
        events.extend(page);
    }
    let mut ended = HashSet::new();
    for e in &events {
        match e.kind {
            EventKind::SessionExpired => {
                let id = e.session_id.unwrap();
                assert!(ended.insert(id), "session {id} was audited twice");
                assert_eq!(e.reason, Some(EndReason::Expired));
                let (k, token) = &dying[&id];
                assert_eq!(e.released.len(), 1, "{e:?}");
                assert_eq!(e.released[0].key, k.as_str());
                assert_eq!(e.released[0].token, *token);
            }
            EventKind::SessionClosed | EventKind::SessionEndedByAdmin => {
                panic!("nothing was closed: {e:?}")
            }
            _ => {}
        }
    }
    assert_eq!(ended.len(), DYING);
    assert!(ended.iter().all(|id| dying.contains_key(id)));
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "sequence numbers increase"
    );

    // Every lock of the storm is free, in the committed table and to a newcomer; the live
    // client's lock is untouched.
    let (left, _) = engine.locks("storm/", None, 10).await.unwrap();
    assert!(left.is_empty(), "{left:?}");
    for (k, _) in dying.values().take(50) {
        assert_eq!(engine.lock(k).await.unwrap(), None);
        let g = engine.acquire(live, k.clone(), 0).await.unwrap();
        engine.release(live, k.clone(), g.token).await.unwrap();
    }
    let held = engine.lock(&key("live/kept")).await.unwrap().unwrap();
    assert_eq!(held.token, kept.token);
    assert_eq!(held.session_id, live);
    let report = engine.check().await.unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.sessions, 1);
    assert_eq!(report.locks, 1);
    let revision = report.revision;
    engine.shutdown();
    drop(engine);

    // What the storm committed is what a restart finds: no dying session comes back.
    let engine = start(dir.path(), &clock, pacing);
    let (sessions, _) = engine.sessions(None, None, 100).await.unwrap();
    assert_eq!(sessions.len(), 1);
    assert_eq!(sessions[0].id, live);
    let g = engine.acquire(live, key("after/restart"), 0).await.unwrap();
    assert!(g.token.0 > revision);
    engine.shutdown();
}
