//! The benchmark binary: one criterion binary with four suites, run in test mode by CI.
//!
//! - `domain`: the pure `State`, no I/O — the floor the engine numbers are compared with;
//! - `store`: `Store::commit` of a batch of lock changes, fsync included; a page of the lock
//!   listing right after a reaper pass hid every lock under its prefix;
//! - `engine`: the `Engine` handle as the API calls it, on a real store with fsync: lock
//!   acquire + release, seat acquire + release, job enqueue + claim + complete, heartbeat,
//!   open + close;
//! - `reaper`: `Engine::reap_now` ending N expired sessions: each holding one lock; each
//!   holding a seat and a claimed job; all holding a seat in one pool (the reaper's work per
//!   licence key).
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
use leasehold::backend::EngineConfig;
use leasehold::backend::ReapOutcome;
use leasehold::backend::embedded::Embedded as Engine;
use leasehold::backend::embedded::store::{Batch, Ended, Store};
use leasehold::clock::{Clock, ManualClock, SystemClock};
use leasehold::domain::{
    At, Change, Effects, EndReason, Finish, JobId, Limits, LockKey, Mono, NewJob, PoolName,
    QueueName, SessionId, State, Token, UnixMs,
};
use leasehold::metrics::Metrics;
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
/// The in-memory reap also runs at a million: it needs no store to fill.
const DOMAIN_REAP_SIZES: [usize; 4] = [1_000, 10_000, 100_000, 1_000_000];
/// Sessions that each hold a seat and a claimed job.
const SEAT_AND_JOB_SIZES: [usize; 2] = [1_000, 10_000];
/// Expired holders of one pool: the reaper's work per licence key.
const POOL_HOLDER_SIZES: [usize; 3] = [5, 100, 10_000];
const COMMIT_SIZES: [usize; 4] = [1, 64, 1_024, 4_096];
const CLIENTS: usize = 64;
const HEARTBEAT_SESSIONS: usize = 10_000;
/// The pool and the queue of the seat and job benchmarks (one of each per engine or state).
const POOL: &str = "bench/pool";
const QUEUE: &str = "bench/queue";
/// Domain job cycles between two purges of the finished jobs (outside the timing), so that
/// the state stays the size it has in service instead of growing with the iterations.
const PURGE_EVERY: u64 = 1_024;

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

fn domain_put_pool(state: &mut State, pool: &PoolName, capacity: u64, fx: &mut Effects) {
    state
        .put_pool(pool, capacity, String::new(), None, at(Mono(0)), fx)
        .expect("put pool");
}

fn domain_acquire_seat(
    state: &mut State,
    id: SessionId,
    pool: &PoolName,
    now: Mono,
    fx: &mut Effects,
) -> Token {
    state
        .acquire_seat(id, pool, String::new(), at(now), fx)
        .expect("acquire seat")
        .token
}

fn domain_release_seat(
    state: &mut State,
    id: SessionId,
    pool: &PoolName,
    token: Token,
    now: Mono,
    fx: &mut Effects,
) {
    state
        .release_seat(id, pool, token, at(now), fx)
        .expect("release seat");
}

/// The job every job benchmark enqueues: an empty JSON payload, idempotent.
fn new_job(queue: &QueueName) -> NewJob {
    NewJob {
        queue: queue.clone(),
        payload: "{}".into(),
        idempotent: true,
        max_recoveries: None,
        kind: None,
    }
}

fn complete() -> Finish {
    Finish::Complete {
        result: "{}".into(),
    }
}

fn domain_enqueue(state: &mut State, queue: &QueueName, now: Mono, fx: &mut Effects) -> JobId {
    let id = JobId::random();
    state
        .enqueue(id, new_job(queue), at(now), fx)
        .expect("enqueue");
    id
}

/// Claims the first queued job of `queue`; the benchmarks only claim when there is one.
fn domain_claim(
    state: &mut State,
    id: SessionId,
    queue: &QueueName,
    now: Mono,
    fx: &mut Effects,
) -> (JobId, Token) {
    let claim = state
        .claim(id, queue, at(now), fx)
        .expect("claim")
        .expect("a queued job to claim");
    (claim.job, claim.token)
}

fn domain_complete(
    state: &mut State,
    id: SessionId,
    job: JobId,
    token: Token,
    now: Mono,
    fx: &mut Effects,
) {
    state
        .finish_job(id, job, token, complete(), at(now), fx)
        .expect("complete");
}

/// Purges every finished job (all finished at `WALL`, the domain benchmarks' only wall
/// time); returns how many went.
fn domain_purge_jobs(state: &mut State, fx: &mut Effects) -> usize {
    state.purge_jobs(UnixMs(WALL.0 + 1), usize::MAX, fx)
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
    group.bench_function("seat_acquire_release", |b| {
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        let id = domain_open(&mut state, LONG_TTL_MS, Mono(0), &mut fx);
        let pool = key(POOL);
        domain_put_pool(&mut state, &pool, CLIENTS as u64, &mut fx);
        b.iter(|| {
            fx.clear();
            let token = domain_acquire_seat(&mut state, id, black_box(&pool), Mono(1), &mut fx);
            domain_release_seat(&mut state, id, &pool, black_box(token), Mono(1), &mut fx);
        });
    });
    group.bench_function("job_cycle", |b| {
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        let id = domain_open(&mut state, LONG_TTL_MS, Mono(0), &mut fx);
        let queue = key(QUEUE);
        // Completed jobs stay in the state until purged (the reaper does it once they are
        // past retention); purging them every `PURGE_EVERY` cycles, untimed, keeps the
        // state from growing with the iteration count.
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let chunk = left.min(PURGE_EVERY);
                let start = Instant::now();
                for _ in 0..chunk {
                    fx.clear();
                    domain_enqueue(&mut state, black_box(&queue), Mono(1), &mut fx);
                    let (job, token) = domain_claim(&mut state, id, &queue, Mono(1), &mut fx);
                    domain_complete(&mut state, id, job, black_box(token), Mono(1), &mut fx);
                }
                timed += start.elapsed();
                fx.clear();
                assert_eq!(domain_purge_jobs(&mut state, &mut fx), chunk as usize);
                fx.clear();
                left -= chunk;
            }
            timed
        });
    });
    group.finish();

    let mut group = c.benchmark_group("domain/reap");
    for n in reaper_sizes(&DOMAIN_REAP_SIZES) {
        group.throughput(Throughput::Elements(n as u64));
        // Sized so that each size fits its samples in the time given (setup included).
        let (samples, secs) = if n <= 1_000 {
            (20, 3)
        } else if n <= 10_000 {
            (10, 3)
        } else if n <= 100_000 {
            (10, 6)
        } else {
            (10, 40)
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
    expired_holders(n, "reap/", Effects::clear)
}

/// `n` sessions opened at 0 with the short TTL, each holding the lock `{prefix}{i:06}`; the
/// effects of each open and acquire are handed to `taken`, which clears them.
fn expired_holders(n: usize, prefix: &str, mut taken: impl FnMut(&mut Effects)) -> State {
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    for i in 0..n {
        let id = domain_open(&mut state, SHORT_TTL_MS, Mono(0), &mut fx);
        domain_acquire(
            &mut state,
            id,
            &key(&format!("{prefix}{i:06}")),
            Mono(0),
            &mut fx,
        );
        taken(&mut fx);
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
            ..Batch::default()
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

/// Sessions whose locks a listing must step over in `store/list_hidden`.
fn hidden_sizes() -> Vec<usize> {
    if cfg!(debug_assertions) || std::env::args().any(|a| a == "--test") {
        vec![1_000]
    } else {
        vec![100_000, 1_000_000]
    }
}

/// `store/list_hidden/N`: one page of `GET /v1/locks?prefix=P&limit=1` right after a reaper
/// pass ended the N sessions holding every lock under `P`, while their rows wait in the end
/// log: what the mass-expiry driver's poll asks at the end of a storm. The page is empty,
/// and the read must step over every hidden lock to find that out.
fn list_hidden(c: &mut Criterion) {
    let mut group = c.benchmark_group("store/list_hidden");
    for n in hidden_sizes() {
        let dir = bench_dir();
        let store = Store::open(dir.path(), CACHE_BYTES).expect("open the store");
        let mut opened = Vec::new();
        let mut state = expired_holders(n, "hidden/", |fx| {
            opened.append(&mut fx.changes);
            fx.clear();
        });
        let commit = |changes: &[Change], state: &State, ended: Option<&Ended>| {
            store
                .commit(&Batch {
                    changes,
                    revision: state.revision(),
                    event_seq: state.event_seq(),
                    ended,
                    ..Batch::default()
                })
                .expect("commit")
        };
        commit(&opened, &state, None);
        let mut fx = Effects::default();
        let reaped = state.reap_leaving_rows(at(Mono(SHORT_TTL_MS)), n, &mut fx);
        assert_eq!(reaped.len(), n);
        let mut ended = Ended::default();
        ended.extend(&reaped);
        commit(&fx.changes, &state, Some(&ended));
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                let page = store.locks("hidden/", None, 1).expect("list");
                assert!(page.is_empty());
                black_box(page)
            })
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

/// What each session `open_sessions` opens takes once it is open.
#[derive(Debug, Clone, Copy, Default)]
struct Holds {
    /// The key `{prefix}/{i}`.
    lock_prefix: Option<&'static str>,
    /// A seat in this pool, which must exist with a seat for every session.
    seat_in: Option<&'static str>,
    /// A job claimed from this queue: the session enqueues one (idempotent), then claims
    /// the oldest queued job, so every claim finds one.
    job_from: Option<&'static str>,
}

/// Opens `n` sessions, each taking what `holds` says, with `SETUP_IN_FLIGHT` requests in
/// flight so that the writer commits them in full batches.
fn open_sessions(
    rt: &Runtime,
    engine: &Engine,
    n: usize,
    ttl_ms: u64,
    holds: Holds,
) -> Vec<SessionId> {
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
                        if let Some(prefix) = holds.lock_prefix {
                            let k = key(&format!("{prefix}/{i:06}"));
                            engine.acquire(s.id, k, 0).await.expect("acquire");
                        }
                        if let Some(pool) = holds.seat_in {
                            engine
                                .acquire_seat(s.id, key(pool), None, 0)
                                .await
                                .expect("acquire seat");
                        }
                        if let Some(queue) = holds.job_from {
                            let queue = key(queue);
                            engine.enqueue(new_job(&queue)).await.expect("enqueue");
                            engine
                                .claim(s.id, queue, 0)
                                .await
                                .expect("claim")
                                .expect("a queued job to claim");
                        }
                        opened.push(s.id);
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

/// One client round: take a seat of the pool, then give it back. Two commits.
async fn seat_acquire_release(engine: &Engine, id: SessionId, pool: &PoolName) {
    let granted = engine
        .acquire_seat(id, pool.clone(), None, 0)
        .await
        .expect("acquire seat");
    let revision = engine
        .release_seat(id, pool.clone(), granted.token)
        .await
        .expect("release seat");
    black_box(revision);
}

/// One client round: enqueue a job, claim the oldest queued job, complete it. Three
/// commits. With many clients on one queue a client may claim another's job; every claim
/// still finds one, since each follows its own client's enqueue.
async fn job_cycle(engine: &Engine, id: SessionId, queue: &QueueName) {
    engine.enqueue(new_job(queue)).await.expect("enqueue");
    let claimed = engine
        .claim(id, queue.clone(), 0)
        .await
        .expect("claim")
        .expect("a queued job to claim");
    let revision = engine
        .finish_job(id, claimed.job, claimed.token, complete())
        .await
        .expect("complete");
    black_box(revision);
}

async fn lock_rounds(engine: Engine, id: SessionId, key: LockKey, rounds: u64) {
    for _ in 0..rounds {
        acquire_release(&engine, id, &key).await;
    }
}

async fn seat_rounds(engine: Engine, id: SessionId, pool: PoolName, rounds: u64) {
    for _ in 0..rounds {
        seat_acquire_release(&engine, id, &pool).await;
    }
}

async fn job_rounds(engine: Engine, id: SessionId, queue: QueueName, rounds: u64) {
    for _ in 0..rounds {
        job_cycle(&engine, id, &queue).await;
    }
}

/// An engine on the real clock with `n` sessions, each with the resource it works on: its
/// own key, or the one pool or queue they share.
struct Clients {
    rig: EngineRig,
    sessions: Vec<(SessionId, LockKey)>,
}

impl Clients {
    fn start(rt: &Runtime, n: usize, resource: impl Fn(usize) -> LockKey) -> Clients {
        let rig = EngineRig::start(Arc::new(SystemClock::new()));
        let sessions = open_sessions(rt, &rig.engine, n, LONG_TTL_MS, Holds::default())
            .into_iter()
            .enumerate()
            .map(|(i, id)| (id, resource(i)))
            .collect();
        Clients { rig, sessions }
    }

    /// Each session with a key of its own (not yet held).
    fn with_keys(rt: &Runtime, n: usize) -> Clients {
        Clients::start(rt, n, |i| key(&format!("client/{i:03}")))
    }

    /// Every session on one pool with a seat for each.
    fn with_pool(rt: &Runtime, n: usize) -> Clients {
        let clients = Clients::start(rt, n, |_| key(POOL));
        let engine = clients.rig.engine.clone();
        run(rt, async move {
            engine
                .put_pool(key(POOL), n as u64, None)
                .await
                .expect("put pool")
        });
        clients
    }

    /// Every session on one queue (created by the first enqueue).
    fn with_queue(rt: &Runtime, n: usize) -> Clients {
        Clients::start(rt, n, |_| key(QUEUE))
    }

    /// Runs `rounds` for every session at once, each as its own task, and times them all.
    fn time<Fut>(&self, rt: &Runtime, iters: u64, rounds: RoundsFn<Fut>) -> Duration
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        let clients: Vec<Fut> = self
            .sessions
            .iter()
            .map(|(id, k)| rounds(self.rig.engine.clone(), *id, k.clone(), iters))
            .collect();
        run(rt, async move {
            let start = Instant::now();
            let tasks: Vec<_> = clients.into_iter().map(tokio::spawn).collect();
            for t in tasks {
                t.await.expect("client task panicked");
            }
            start.elapsed()
        })
    }
}

/// A client's loop: `iters` rounds by one session on its resource.
type RoundsFn<Fut> = fn(Engine, SessionId, LockKey, u64) -> Fut;

/// The group `name` with `1_client` and `{CLIENTS}_clients`, each on its own engine. One
/// iteration is one round of every client, all in flight at once: the throughput counts
/// rounds (pairs or cycles).
fn clients_group<Fut>(
    c: &mut Criterion,
    rt: &Runtime,
    name: &str,
    start: fn(&Runtime, usize) -> Clients,
    rounds: RoundsFn<Fut>,
) where
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut group = c.benchmark_group(name);
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    for (n, id) in [
        (1, "1_client".to_string()),
        (CLIENTS, format!("{CLIENTS}_clients")),
    ] {
        group.throughput(Throughput::Elements(n as u64));
        let mut clients = None;
        group.bench_function(id, |b| {
            let clients = clients.get_or_insert_with(|| start(rt, n));
            b.iter_custom(|iters| clients.time(rt, iters, rounds));
        });
        // Shut the engine down before the next one starts.
        drop(clients);
    }
    group.finish();
}

fn engine(c: &mut Criterion) {
    let rt = runtime();
    clients_group(
        c,
        &rt,
        "engine/acquire_release",
        Clients::with_keys,
        lock_rounds,
    );
    clients_group(
        c,
        &rt,
        "engine/seat_acquire_release",
        Clients::with_pool,
        seat_rounds,
    );
    clients_group(c, &rt, "engine/job_cycle", Clients::with_queue, job_rounds);

    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(1));
    let mut rig = None;
    let mut cursor = 0;
    group.bench_function("heartbeat", |b| {
        let (rig, ids) = rig.get_or_insert_with(|| {
            let rig = EngineRig::start(Arc::new(SystemClock::new()));
            let opened = open_sessions(
                &rt,
                &rig.engine,
                HEARTBEAT_SESSIONS,
                LONG_TTL_MS,
                Holds::default(),
            );
            let ids: Arc<[SessionId]> = opened.into();
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

/// A fresh engine on a manual clock with `n` sessions that each hold what `holds` says (the
/// pool, if any, created first with exactly `n` seats), the clock already moved past their
/// deadline. Only `reap_now` is left to do.
fn expired_engine(rt: &Runtime, n: usize, holds: Holds) -> EngineRig {
    let clock = ManualClock::new(WALL);
    let rig = EngineRig::start(Arc::new(clock.clone()));
    if let Some(pool) = holds.seat_in {
        let engine = rig.engine.clone();
        run(rt, async move {
            engine
                .put_pool(key(pool), n as u64, None)
                .await
                .expect("put pool")
        });
    }
    let opened = open_sessions(rt, &rig.engine, n, SHORT_TTL_MS, holds);
    assert_eq!(opened.len(), n);
    clock.advance(SHORT_TTL_MS);
    rig
}

/// The sizes a reaper benchmark runs, from its list in ascending order. An unoptimised
/// build — `cargo test --all-targets` runs every benchmark once, in the test profile —
/// leaves out the largest: there its setup and reap take the longest and check nothing the
/// smaller sizes do not.
fn reaper_sizes(all: &[usize]) -> Vec<usize> {
    let keep = if cfg!(debug_assertions) {
        all.len() - 1
    } else {
        all.len()
    };
    all[..keep].to_vec()
}

/// The group `name`: for each size N, `reap_now` ending N expired sessions set up as
/// `holds` says, checked against `expected(N)`. The time is per `reap_now`, the throughput
/// in sessions.
fn reaper_group(
    c: &mut Criterion,
    rt: &Runtime,
    name: &str,
    sizes: &[usize],
    holds: Holds,
    expected: fn(usize) -> ReapOutcome,
) {
    let mut group = c.benchmark_group(name);
    // Every iteration needs its own setup, which criterion counts in its estimate of the
    // iteration time; flat sampling then runs 10 samples of one iteration each for the
    // large sizes (criterion warns that it cannot fit 10 samples in the time: expected).
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .measurement_time(Duration::from_secs(3));
    for n in reaper_sizes(sizes) {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let rig = expired_engine(rt, n, holds);
                    let engine = rig.engine.clone();
                    let (elapsed, outcome) = run(rt, async move {
                        let start = Instant::now();
                        let outcome = engine.reap_now().await.expect("reap");
                        (start.elapsed(), outcome)
                    });
                    assert_eq!(outcome, expected(n));
                    timed += elapsed;
                }
                timed
            });
        });
    }
    group.finish();
}

fn reaper(c: &mut Criterion) {
    let rt = runtime();
    reaper_group(
        c,
        &rt,
        "reaper/expired_sessions",
        &REAP_SIZES,
        Holds {
            lock_prefix: Some("reap"),
            ..Holds::default()
        },
        |n| ReapOutcome {
            sessions: n,
            locks: n,
            seats: 0,
            jobs: 0,
        },
    );
    // Each session holds a seat of one pool with `n` seats and a claimed idempotent job,
    // which the reaper sends back to the head of its queue.
    reaper_group(
        c,
        &rt,
        "reaper/session_with_seat_and_job",
        &SEAT_AND_JOB_SIZES,
        Holds {
            seat_in: Some(POOL),
            job_from: Some(QUEUE),
            ..Holds::default()
        },
        |n| ReapOutcome {
            sessions: n,
            locks: 0,
            seats: n,
            jobs: n,
        },
    );
    // One pool (licence key) with `n` seats, every one held by an expired session: the
    // reaper's work to give the whole pool back.
    reaper_group(
        c,
        &rt,
        "reaper/pool_expired_holders",
        &POOL_HOLDER_SIZES,
        Holds {
            seat_in: Some(POOL),
            ..Holds::default()
        },
        |n| ReapOutcome {
            sessions: n,
            locks: 0,
            seats: n,
            jobs: 0,
        },
    );
}

// ---------------------------------------------------------------------------------------
// startup

/// `startup/N`: what a restart costs before the server can answer — opening the store and
/// rebuilding the in-memory state (sessions, locks, expiry index) of N live sessions that
/// each hold a lock. The store is filled once through the engine, outside the timing; each
/// iteration opens it anew, and shuts the engine down outside the timing.
fn startup_sizes() -> Vec<usize> {
    if cfg!(debug_assertions) {
        // The unoptimised test run only checks that the path works.
        vec![1_000]
    } else if std::env::args().any(|a| a == "--test") {
        // Criterion's test mode runs each once: filling a million would dominate it.
        vec![100_000]
    } else {
        vec![100_000, 1_000_000]
    }
}

fn startup(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("startup");
    group.sample_size(10).sampling_mode(SamplingMode::Flat);
    let config = EngineConfig {
        reaper_enabled: false,
        ..EngineConfig::default()
    };
    let start = |dir: &TempDir| {
        let store = Store::open(dir.path(), CACHE_BYTES).expect("open the store");
        Engine::start(
            config.clone(),
            store,
            Arc::new(SystemClock::new()),
            Arc::new(Metrics::new()),
        )
        .expect("start engine")
    };
    for n in startup_sizes() {
        let dir = bench_dir();
        let engine = start(&dir);
        let holds = Holds {
            lock_prefix: Some("startup"),
            ..Holds::default()
        };
        open_sessions(&rt, &engine, n, LONG_TTL_MS, holds);
        engine.shutdown();
        drop(engine);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let began = Instant::now();
                    let engine = black_box(start(&dir));
                    timed += began.elapsed();
                    engine.shutdown();
                }
                timed
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = suites;
    config = config();
    targets = domain, store, list_hidden, engine, reaper, startup
}
criterion_main!(suites);
