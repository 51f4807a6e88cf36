//! The benchmark binary: one criterion binary with four suites, run in test mode by CI.
//!
//! - `domain`: the pure `State`, no I/O — the floor the engine numbers are compared with;
//! - `store`: `Store::commit` of a batch of lock changes, fsync included;
//! - `engine`: the `Engine` handle as the API calls it, on a real store with fsync;
//! - `reaper`: `Engine::reap_now` ending N expired sessions that each hold one lock.
//!
//! Every store lives in a fresh directory under cargo's target tmp dir (the real disk, so
//! fsync is real). Setup — opening sessions, building states, creating stores — happens
//! outside the timed region: timed loops use `iter_custom` or `iter_batched`. Reusable rigs
//! are built once per benchmark, lazily, so a filtered-out benchmark costs nothing; the
//! reaper, which consumes its sessions, builds a fresh engine for every iteration.

use std::future::Future;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{
    BatchSize, BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use leasehold::clock::{Clock, ManualClock, SystemClock};
use leasehold::domain::{
    At, Effects, EndReason, Limits, LockKey, Mono, SessionId, State, Token, UnixMs,
};
use leasehold::engine::{Engine, EngineConfig};
use leasehold::metrics::Metrics;
use leasehold::store::{Batch, Store};
use tempfile::TempDir;
use tokio::runtime::Runtime;

/// The page cache of every store, as the default configuration has it.
const CACHE_BYTES: usize = 64 * 1024 * 1024;
const WALL: UnixMs = UnixMs(1_700_000_000_000);
/// Long enough that no session expires during a measurement on the real clock.
const LONG_TTL_MS: u64 = 3_600_000;
/// The shortest TTL the default limits accept; reaper setups expire sessions by advancing
/// a manual clock past it.
const SHORT_TTL_MS: u64 = 1_000;
/// Requests in flight during setup: the writer's default `max_batch`, and far below its
/// queue capacity, so setup is group-committed in full batches and never refused.
const SETUP_IN_FLIGHT: usize = 4_096;
/// Sizes of the session-count parameterised benchmarks.
const REAP_SIZES: [usize; 3] = [1_000, 10_000, 100_000];
const COMMIT_SIZES: [usize; 4] = [1, 64, 1_024, 4_096];
const CLIENTS: usize = 64;
const HEARTBEAT_SESSIONS: usize = 10_000;

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

fn key(text: &str) -> LockKey {
    LockKey::parse("key", text).expect("benchmark keys are valid")
}

/// A fresh directory on the same disk as the build, removed when dropped.
fn bench_dir() -> TempDir {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&base).expect("create the benchmark tmp dir");
    tempfile::Builder::new()
        .prefix("leasehold-bench-")
        .tempdir_in(base)
        .expect("create a benchmark data dir")
}

// ---------------------------------------------------------------------------------------
// The domain calls, in one place: the only code that knows the `State` method signatures.

fn at(now: Mono) -> At {
    At { now, wall: WALL }
}

fn domain_open(state: &mut State, ttl_ms: u64, now: Mono, fx: &mut Effects) -> SessionId {
    let id = SessionId::random();
    state
        .open(id, "bench".into(), Some(ttl_ms), String::new(), at(now), fx)
        .expect("open");
    id
}

fn domain_acquire(
    state: &mut State,
    id: SessionId,
    key: &LockKey,
    now: Mono,
    fx: &mut Effects,
) -> Token {
    state.acquire(id, key, at(now), fx).expect("acquire").token
}

fn domain_release(
    state: &mut State,
    id: SessionId,
    key: &LockKey,
    token: Token,
    now: Mono,
    fx: &mut Effects,
) {
    state.release(id, key, token, at(now), fx).expect("release");
}

/// Reaps up to `limit` due sessions; returns how many ended.
fn domain_reap(state: &mut State, now: Mono, limit: usize, fx: &mut Effects) -> usize {
    state.reap(at(now), limit, fx).len()
}

// ---------------------------------------------------------------------------------------
// domain

fn domain(c: &mut Criterion) {
    let mut group = c.benchmark_group("domain");
    group.throughput(Throughput::Elements(1));
    group.bench_function("acquire_release", |b| {
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        let id = domain_open(&mut state, LONG_TTL_MS, Mono(0), &mut fx);
        let k = key("bench/domain");
        b.iter(|| {
            fx.clear();
            let token = domain_acquire(&mut state, id, black_box(&k), Mono(1), &mut fx);
            domain_release(&mut state, id, &k, black_box(token), Mono(1), &mut fx);
        });
    });
    group.finish();

    let mut group = c.benchmark_group("domain/reap");
    for n in REAP_SIZES {
        group.throughput(Throughput::Elements(n as u64));
        // Sized so that each size fits its samples in the time given (setup included).
        let (samples, secs) = if n <= 1_000 {
            (20, 3)
        } else if n <= 10_000 {
            (10, 3)
        } else {
            (10, 6)
        };
        group
            .sample_size(samples)
            .measurement_time(Duration::from_secs(secs));
        let mut base = None;
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let base = base.get_or_insert_with(|| expired_state(n));
            b.iter_batched(
                // Each session ends with a DeleteLock, a DeleteSession and an Event; the
                // writer reuses its change buffer, so the capacity is there before timing.
                || {
                    let fx = Effects {
                        changes: Vec::with_capacity(3 * n),
                        ..Effects::default()
                    };
                    (base.clone(), fx)
                },
                |(mut state, mut fx)| {
                    let ended = domain_reap(&mut state, Mono(SHORT_TTL_MS), n, &mut fx);
                    assert_eq!(ended, n);
                    // Returned so that dropping them happens outside the timed region.
                    (state, fx)
                },
                BatchSize::PerIteration,
            );
        });
    }
    group.finish();
}

/// `n` sessions opened at 0 with the short TTL, each holding one lock: all due at the TTL.
fn expired_state(n: usize) -> State {
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    for i in 0..n {
        let id = domain_open(&mut state, SHORT_TTL_MS, Mono(0), &mut fx);
        domain_acquire(
            &mut state,
            id,
            &key(&format!("reap/{i:06}")),
            Mono(0),
            &mut fx,
        );
        fx.clear();
    }
    state
}

// ---------------------------------------------------------------------------------------
// store

/// A store and a state that produces its batches: every other batch grants `n` keys to one
/// session, the next releases them all, so the lock table stays small while the audit log
/// grows as it does in service. The changes are what the writer would commit: one
/// `PutLock`/`DeleteLock` and one `Event` per lock change.
struct CommitRig {
    store: Store,
    state: State,
    session: SessionId,
    keys: Vec<LockKey>,
    tokens: Vec<Token>,
    fx: Effects,
    _dir: TempDir,
}

impl CommitRig {
    fn new(n: usize) -> CommitRig {
        let dir = bench_dir();
        let store = Store::open(dir.path(), CACHE_BYTES).expect("open the store");
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        let session = domain_open(&mut state, LONG_TTL_MS, Mono(0), &mut fx);
        let rig = CommitRig {
            store,
            state,
            session,
            keys: (0..n).map(|i| key(&format!("commit/{i:06}"))).collect(),
            tokens: Vec::with_capacity(n),
            fx,
            _dir: dir,
        };
        rig.commit();
        rig
    }

    fn next_batch(&mut self) {
        self.fx.clear();
        let CommitRig {
            state,
            session,
            keys,
            tokens,
            fx,
            ..
        } = self;
        if tokens.is_empty() {
            for k in keys.iter() {
                tokens.push(domain_acquire(state, *session, k, Mono(1), fx));
            }
        } else {
            for (k, t) in keys.iter().zip(tokens.drain(..)) {
                domain_release(state, *session, k, t, Mono(1), fx);
            }
        }
    }

    fn commit(&self) -> Duration {
        let batch = Batch {
            changes: &self.fx.changes,
            revision: self.state.revision(),
            event_seq: self.state.event_seq(),
            trim_events: None,
        };
        let start = Instant::now();
        black_box(self.store.commit(&batch).expect("commit"));
        start.elapsed()
    }
}

fn store(c: &mut Criterion) {
    let mut group = c.benchmark_group("store/commit");
    for n in COMMIT_SIZES {
        group.throughput(Throughput::Elements(n as u64));
        group.sample_size(if n >= 4_096 { 10 } else { 20 });
        let mut rig = None;
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let rig = rig.get_or_insert_with(|| CommitRig::new(n));
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    rig.next_batch();
                    timed += rig.commit();
                }
                timed
            });
        });
    }
    group.finish();
}

// ---------------------------------------------------------------------------------------
// engine

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("build the tokio runtime")
}

/// Runs `f` as a task on the runtime's workers, as a request handler would run, and waits.
fn run<F>(rt: &Runtime, f: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    rt.block_on(rt.spawn(f)).expect("benchmark task panicked")
}

/// An engine on a fresh store, with the background reaper off so that only the benchmark
/// ends sessions. Shut down (writer joined) before its directory is removed.
struct EngineRig {
    engine: Engine,
    _dir: TempDir,
}

impl EngineRig {
    fn start(clock: Arc<dyn Clock>) -> EngineRig {
        let dir = bench_dir();
        let store = Store::open(dir.path(), CACHE_BYTES).expect("open the store");
        let config = EngineConfig {
            reaper_enabled: false,
            ..EngineConfig::default()
        };
        let engine =
            Engine::start(config, store, clock, Arc::new(Metrics::new())).expect("start engine");
        EngineRig { engine, _dir: dir }
    }
}

impl Drop for EngineRig {
    fn drop(&mut self) {
        self.engine.shutdown();
    }
}

/// Opens `n` sessions, each taking the key `{prefix}/{i}` when a prefix is given, with
/// `SETUP_IN_FLIGHT` requests in flight so that the writer commits them in full batches.
fn open_sessions(
    rt: &Runtime,
    engine: &Engine,
    n: usize,
    ttl_ms: u64,
    lock_prefix: Option<&'static str>,
) -> Vec<(SessionId, Option<LockKey>)> {
    let engine = engine.clone();
    run(rt, async move {
        let workers = n.min(SETUP_IN_FLIGHT);
        let tasks: Vec<_> = (0..workers)
            .map(|w| {
                let engine = engine.clone();
                tokio::spawn(async move {
                    let mut opened = Vec::with_capacity(n / workers + 1);
                    for i in (w..n).step_by(workers) {
                        let s = engine
                            .open("bench".into(), Some(ttl_ms), None)
                            .await
                            .expect("open");
                        let k = lock_prefix.map(|p| key(&format!("{p}/{i:06}")));
                        if let Some(k) = &k {
                            engine.acquire(s.id, k.clone(), 0).await.expect("acquire");
                        }
                        opened.push((s.id, k));
                    }
                    opened
                })
            })
            .collect();
        let mut all = Vec::with_capacity(n);
        for t in tasks {
            all.extend(t.await.expect("setup task panicked"));
        }
        all
    })
}

/// One client round: take the key, then give it back. Two commits, each with fsync.
async fn acquire_release(engine: &Engine, id: SessionId, key: &LockKey) {
    let granted = engine.acquire(id, key.clone(), 0).await.expect("acquire");
    let revision = engine
        .release(id, key.clone(), granted.token)
        .await
        .expect("release");
    black_box(revision);
}

/// An engine on the real clock with `n` sessions, each with its own key (not yet held).
struct Clients {
    rig: EngineRig,
    sessions: Vec<(SessionId, LockKey)>,
}

impl Clients {
    fn new(rt: &Runtime, n: usize) -> Clients {
        let rig = EngineRig::start(Arc::new(SystemClock::new()));
        let sessions = open_sessions(rt, &rig.engine, n, LONG_TTL_MS, None)
            .into_iter()
            .enumerate()
            .map(|(i, (id, _))| (id, key(&format!("client/{i:03}"))))
            .collect();
        Clients { rig, sessions }
    }
}

fn engine(c: &mut Criterion) {
    let rt = runtime();

    let mut group = c.benchmark_group("engine/acquire_release");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(1));
    let mut clients = None;
    group.bench_function("1_client", |b| {
        let clients = clients.get_or_insert_with(|| Clients::new(&rt, 1));
        b.iter_custom(|iters| {
            let engine = clients.rig.engine.clone();
            let (id, k) = clients.sessions[0].clone();
            run(&rt, async move {
                let start = Instant::now();
                for _ in 0..iters {
                    acquire_release(&engine, id, &k).await;
                }
                start.elapsed()
            })
        });
    });
    drop(clients);

    // One iteration is one round of every client: CLIENTS pairs, all in flight at once.
    group.throughput(Throughput::Elements(CLIENTS as u64));
    let mut clients = None;
    group.bench_function(format!("{CLIENTS}_clients"), |b| {
        let clients = clients.get_or_insert_with(|| Clients::new(&rt, CLIENTS));
        b.iter_custom(|iters| {
            let engine = clients.rig.engine.clone();
            let sessions = clients.sessions.clone();
            run(&rt, async move {
                let start = Instant::now();
                let tasks: Vec<_> = sessions
                    .into_iter()
                    .map(|(id, k)| {
                        let engine = engine.clone();
                        tokio::spawn(async move {
                            for _ in 0..iters {
                                acquire_release(&engine, id, &k).await;
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("client task panicked");
                }
                start.elapsed()
            })
        });
    });
    drop(clients);
    group.finish();

    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(1));
    let mut rig = None;
    let mut cursor = 0;
    group.bench_function("heartbeat", |b| {
        let (rig, ids) = rig.get_or_insert_with(|| {
            let rig = EngineRig::start(Arc::new(SystemClock::new()));
            let opened = open_sessions(&rt, &rig.engine, HEARTBEAT_SESSIONS, LONG_TTL_MS, None);
            let ids: Arc<[SessionId]> = opened.into_iter().map(|(id, _)| id).collect();
            (rig, ids)
        });
        b.iter_custom(|iters| {
            let engine = rig.engine.clone();
            let ids = ids.clone();
            let first = cursor;
            cursor = (cursor + iters as usize) % ids.len();
            run(&rt, async move {
                let start = Instant::now();
                for i in 0..iters as usize {
                    let id = ids[(first + i) % ids.len()];
                    black_box(engine.heartbeat(id, None).await.expect("heartbeat"));
                }
                start.elapsed()
            })
        });
    });
    drop(rig);

    let mut rig = None;
    group.bench_function("open_close", |b| {
        let rig = rig.get_or_insert_with(|| EngineRig::start(Arc::new(SystemClock::new())));
        b.iter_custom(|iters| {
            let engine = rig.engine.clone();
            run(&rt, async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let s = engine
                        .open("bench".into(), Some(LONG_TTL_MS), None)
                        .await
                        .expect("open");
                    let closed = engine.end(s.id, EndReason::Closed).await.expect("close");
                    black_box(closed);
                }
                start.elapsed()
            })
        });
    });
    drop(rig);
    group.finish();
}

// ---------------------------------------------------------------------------------------
// reaper

/// A fresh engine on a manual clock with `n` sessions that each hold one lock, the clock
/// already moved past their deadline. Only `reap_now` is left to do.
fn expired_engine(rt: &Runtime, n: usize) -> EngineRig {
    let clock = ManualClock::new(WALL);
    let rig = EngineRig::start(Arc::new(clock.clone()));
    let opened = open_sessions(rt, &rig.engine, n, SHORT_TTL_MS, Some("reap"));
    assert_eq!(opened.len(), n);
    clock.advance(SHORT_TTL_MS);
    rig
}

/// The sizes the reaper suite runs. An unoptimised build — `cargo test --all-targets` runs
/// every benchmark once, in the test profile — leaves out the largest: there its setup and
/// reap take most of a minute and check nothing the 10 000 run does not.
fn reaper_sizes() -> Vec<usize> {
    let sizes = REAP_SIZES.into_iter();
    if cfg!(debug_assertions) {
        sizes.filter(|&n| n < 100_000).collect()
    } else {
        sizes.collect()
    }
}

fn reaper(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("reaper/expired_sessions");
    // Every iteration needs its own setup, which criterion counts in its estimate of the
    // iteration time; flat sampling then runs 10 samples of one iteration each for the
    // large sizes (criterion warns that it cannot fit 10 samples in the time: expected).
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .measurement_time(Duration::from_secs(3));
    for n in reaper_sizes() {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let rig = expired_engine(&rt, n);
                    let engine = rig.engine.clone();
                    let (elapsed, outcome) = run(&rt, async move {
                        let start = Instant::now();
                        let outcome = engine.reap_now().await.expect("reap");
                        (start.elapsed(), outcome)
                    });
                    assert_eq!((outcome.sessions, outcome.locks), (n, n));
                    timed += elapsed;
                }
                timed
            });
        });
    }
    group.finish();
}

criterion_group! {
    name = domain_suite;
    config = config();
    targets = domain
}
criterion_group! {
    name = store_suite;
    config = config();
    targets = store
}
criterion_group! {
    name = engine_suite;
    config = config();
    targets = engine
}
criterion_group! {
    name = reaper_suite;
    config = config();
    targets = reaper
}
criterion_main!(domain_suite, store_suite, engine_suite, reaper_suite);
