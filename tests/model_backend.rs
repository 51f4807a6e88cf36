//! Model-based test of the backends through the seam: random sequences of operations run
//! through `Engine` (the handle the API calls) on a real server — the embedded backend with
//! its redb store, writer and waiters, the PostgreSQL backend with its SQL, and the Redis
//! backend with its Lua script — and against a
//! small reference model written here. After every step the harness compares the step's
//! result, the audit events it wrote, and everything a client can read: sessions and what
//! they hold, lock holders and fences, pools and seats, jobs and queue counts.
//!
//! It guards against a backend drifting from the rules: two holders of one key, a pool
//! granting past its capacity, a token or revision that does not grow, a heartbeat that
//! brings a session back, a session ending before its deadline or a grant outliving it, a
//! job lost, run twice or recovered past its cap, a stale token that finishes a job, an
//! ending without its audit event, and an error or event that differs from the other
//! backend's.
//!
//! Where the rules leave a choice open, the model follows the backend after checking that
//! the choice is allowed: a session past its deadline that nobody has ended yet (a "zombie")
//! may be ended by any operation that finds it (its `session_expired` event says so), and
//! must be ended by the operations that need what it holds (a contender for its key, a seat
//! in its full pool, a reap, its own late release or finish); jobs that go back to the head
//! of a queue together may come back in any order among themselves. A read may end a zombie
//! too (the seam allows it; the PostgreSQL backend's session read does): the harness reads
//! sessions last, and takes such endings in before the next step.
//!
//! Cases: `PROPTEST_CASES` for the embedded run (256 by default), of up to 60 steps; the
//! PostgreSQL run does 200 (`LEASEHOLD_MODEL_PG_CASES` to change it) of up to 45 steps, a
//! round trip to the database for every read, which keeps it within about two minutes on
//! this 2-core machine. The Redis run does 200 (`LEASEHOLD_MODEL_REDIS_CASES`) of up to 45.

mod common;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use common::{BASE, BackendKind, TestServer};
use leasehold::backend::{BackendError, Closed, Granted};
use leasehold::domain::{
    EndReason, Event, EventKind, Finish, JobId, JobOutcome, JobStatus, LockKey, NewJob,
    ReleasedLock, SessionId, Token, UnixMs,
};
use leasehold::engine::Engine;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, contextualize_config};
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use serde_json::Value;

const KEYS: [&str; 3] = ["a", "b", "c"];
/// Pools and queues spelled like a lock key and like each other: the namespaces must not mix.
const POOLS: [&str; 2] = ["a", "p"];
const QUEUES: [&str; 2] = ["a", "q"];
const TTLS: [u64; 4] = [1_000, 2_000, 5_000, 10_000];
const MAX_LOCKS: usize = 2;
const OWNER: &str = "model";
const RESULT: &str = r#"{"ok":true}"#;
const WORKER_REASON: &str = "worker gave up";

fn name(text: &str) -> LockKey {
    LockKey::parse("key", text).expect("test names are valid")
}

fn payload(index: usize) -> String {
    format!(r#"{{"job":{index}}}"#)
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

// ---------------------------------------------------------------------------------------------
// Transitions
// ---------------------------------------------------------------------------------------------

/// Which token a release or finish presents.
#[derive(Debug, Clone, Copy)]
enum Pick {
    /// The one the model says is current (whoever holds it).
    Current,
    /// One that is not: the current one minus one, or one never issued.
    Stale,
}

#[derive(Debug, Clone, Copy)]
enum How {
    Complete,
    Fail,
    Release,
}

/// Sessions and jobs are named by index into what was opened or enqueued so far; an index
/// past the end names one that never existed.
#[derive(Debug, Clone)]
enum Op {
    Open {
        ttl: u64,
    },
    Heartbeat {
        s: usize,
        ttl: Option<u64>,
    },
    End {
        s: usize,
        reason: EndReason,
    },
    Acquire {
        s: usize,
        key: usize,
    },
    Release {
        s: usize,
        key: usize,
        pick: Pick,
    },
    PutPool {
        pool: usize,
        capacity: u64,
    },
    DeletePool {
        pool: usize,
    },
    AcquireSeat {
        s: usize,
        pool: usize,
    },
    ReleaseSeat {
        s: usize,
        pool: usize,
        pick: Pick,
    },
    Enqueue {
        queue: usize,
        idempotent: bool,
        max_recoveries: Option<u32>,
    },
    Claim {
        s: usize,
        queue: usize,
    },
    Finish {
        s: usize,
        job: usize,
        pick: Pick,
        how: How,
    },
    Requeue {
        job: usize,
    },
    Advance {
        ms: u64,
    },
    Reap,
    DryRun,
}

/// What the generator needs to know: how many sessions were opened and jobs enqueued.
#[derive(Debug, Clone, Default)]
struct Counts {
    sessions: usize,
    jobs: usize,
}

struct Reference;

fn index(n: usize) -> BoxedStrategy<usize> {
    // Mostly one that exists, often one of the latest (more likely alive); now and then one
    // that never did.
    prop_oneof![4 => n.saturating_sub(2)..n.max(1), 5 => 0..n.max(1), 1 => Just(n)].boxed()
}

/// In a release or finish: whoever holds the lock, seat or claim at the time.
const HOLDER: usize = usize::MAX;

fn actor(n: usize) -> BoxedStrategy<usize> {
    prop_oneof![3 => Just(HOLDER), 2 => index(n)].boxed()
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![4 => Just(Pick::Current), 1 => Just(Pick::Stale)]
}

impl ReferenceStateMachine for Reference {
    type State = Counts;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Counts> {
        Just(Counts::default()).boxed()
    }

    fn transitions(c: &Counts) -> BoxedStrategy<Op> {
        let s = || index(c.sessions);
        let job = || index(c.jobs);
        let key = || 0..KEYS.len();
        let pool = || 0..POOLS.len();
        let queue = || 0..QUEUES.len();
        let ttl = || proptest::sample::select(&TTLS[..]);
        prop_oneof![
            3 => ttl().prop_map(|ttl| Op::Open { ttl }),
            5 => (s(), proptest::option::weighted(0.2, ttl()))
                .prop_map(|(s, ttl)| Op::Heartbeat { s, ttl }),
            1 => (s(), prop_oneof![Just(EndReason::Closed), Just(EndReason::Admin)])
                .prop_map(|(s, reason)| Op::End { s, reason }),
            4 => (s(), key()).prop_map(|(s, key)| Op::Acquire { s, key }),
            3 => (actor(c.sessions), key(), pick()).prop_map(|(s, key, pick)| Op::Release { s, key, pick }),
            2 => (pool(), 1..=3u64).prop_map(|(pool, capacity)| Op::PutPool { pool, capacity }),
            1 => pool().prop_map(|pool| Op::DeletePool { pool }),
            5 => (s(), pool()).prop_map(|(s, pool)| Op::AcquireSeat { s, pool }),
            3 => (actor(c.sessions), pool(), pick())
                .prop_map(|(s, pool, pick)| Op::ReleaseSeat { s, pool, pick }),
            3 => (queue(), any::<bool>(), proptest::option::of(0..=1u32)).prop_map(
                |(queue, idempotent, max_recoveries)| Op::Enqueue {
                    queue,
                    idempotent,
                    max_recoveries
                }
            ),
            3 => (s(), queue()).prop_map(|(s, queue)| Op::Claim { s, queue }),
            5 => (
                actor(c.sessions),
                job(),
                pick(),
                prop_oneof![Just(How::Complete), Just(How::Fail), Just(How::Release)]
            )
                .prop_map(|(s, job, pick, how)| Op::Finish { s, job, pick, how }),
            1 => job().prop_map(|job| Op::Requeue { job }),
            3 => proptest::sample::select(&[250u64, 500, 1_000, 3_000][..])
                .prop_map(|ms| Op::Advance { ms }),
            1 => Just(Op::Reap),
            1 => Just(Op::DryRun),
        ]
        .boxed()
    }

    fn apply(mut c: Counts, op: &Op) -> Counts {
        match op {
            Op::Open { .. } => c.sessions += 1,
            Op::Enqueue { .. } => c.jobs += 1,
            _ => {}
        }
        c
    }
}

// ---------------------------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct MSession {
    id: SessionId,
    ttl: u64,
    /// On the model's monotonic clock (ms since the start).
    deadline: u64,
    created: u64,
    ended: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MSeat {
    token: u64,
    at: u64,
}

#[derive(Debug, Clone)]
struct MPool {
    capacity: u32,
    created: u64,
    holders: BTreeMap<usize, MSeat>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum MState {
    Queued,
    Claimed { s: usize, token: u64, at: u64 },
    Done,
    Failed(String),
}

#[derive(Debug, Clone)]
struct MJob {
    id: JobId,
    queue: usize,
    idempotent: bool,
    max_recoveries: u32,
    recovery_count: u32,
    attempt: u32,
    state: MState,
    enqueued: u64,
    updated: u64,
}

#[derive(Debug, Default)]
struct Model {
    now: u64,
    sessions: Vec<MSession>,
    /// key index → (session slot, token, acquired at)
    locks: BTreeMap<usize, (usize, u64, u64)>,
    pools: BTreeMap<usize, MPool>,
    jobs: Vec<MJob>,
    /// Per queue, groups of job indices in serving order; within a group, any order.
    queues: BTreeMap<usize, VecDeque<BTreeSet<usize>>>,
    /// Events the current step should have written, `seq` 0.
    expected: Vec<Event>,
}

impl Model {
    fn wall(&self) -> UnixMs {
        UnixMs(BASE + self.now)
    }

    fn alive(&self, s: usize) -> bool {
        self.sessions
            .get(s)
            .is_some_and(|m| !m.ended && self.now < m.deadline)
    }

    fn zombie(&self, s: usize) -> bool {
        self.sessions
            .get(s)
            .is_some_and(|m| !m.ended && self.now >= m.deadline)
    }

    fn zombies(&self) -> BTreeSet<usize> {
        (0..self.sessions.len())
            .filter(|s| self.zombie(*s))
            .collect()
    }

    fn event(&mut self, kind: EventKind) -> &mut Event {
        self.expected.push(Event::new(0, self.wall(), kind));
        self.expected.last_mut().unwrap()
    }

    fn locks_of(&self, s: usize) -> Vec<(String, Token)> {
        self.locks
            .iter()
            .filter(|(_, l)| l.0 == s)
            .map(|(k, l)| (KEYS[*k].to_string(), Token(l.1)))
            .collect()
    }

    fn seats_of(&self, s: usize) -> Vec<(String, Token)> {
        self.pools
            .iter()
            .filter_map(|(p, pool)| {
                pool.holders
                    .get(&s)
                    .map(|seat| (POOLS[*p].to_string(), Token(seat.token)))
            })
            .collect()
    }

    fn jobs_of(&self, s: usize) -> Vec<usize> {
        (0..self.jobs.len())
            .filter(|j| matches!(self.jobs[*j].state, MState::Claimed { s: c, .. } if c == s))
            .collect()
    }

    fn outcome(job: &MJob) -> JobOutcome {
        if job.idempotent && job.recovery_count < job.max_recoveries {
            JobOutcome::Recovered {
                recovery_count: job.recovery_count + 1,
            }
        } else if job.idempotent {
            JobOutcome::Failed {
                reason: "max_recoveries_exceeded".into(),
            }
        } else {
            JobOutcome::Failed {
                reason: "not_idempotent".into(),
            }
        }
    }

    /// Ends session `s` and everything it holds, with its events. Jobs that recover are
    /// added to `heads` (per queue) for the caller to put back at the head together.
    fn end(
        &mut self,
        s: usize,
        reason: EndReason,
        heads: &mut BTreeMap<usize, BTreeSet<usize>>,
    ) -> Closed {
        let id = self.sessions[s].id;
        self.sessions[s].ended = true;
        let locks = self.locks_of(s);
        self.locks.retain(|_, l| l.0 != s);
        let seats = self.seats_of(s);
        let wall = self.wall();
        for (p, pool) in self.pools.iter_mut() {
            if let Some(seat) = pool.holders.remove(&s) {
                let mut e = Event::new(0, wall, EventKind::SeatReclaimed);
                e.session_id = Some(id);
                e.pool = Some(POOLS[*p].to_string());
                e.token = Some(Token(seat.token));
                e.reason = Some(reason);
                self.expected.push(e);
            }
        }
        let jobs = self.jobs_of(s);
        for &j in &jobs {
            let outcome = Model::outcome(&self.jobs[j]);
            let MState::Claimed { token, .. } = self.jobs[j].state else {
                unreachable!()
            };
            let queue = self.jobs[j].queue;
            let kind = match &outcome {
                JobOutcome::Recovered { .. } => EventKind::JobRecovered,
                JobOutcome::Failed { .. } => EventKind::JobFailed,
            };
            let job_id = self.jobs[j].id;
            let e = self.event(kind);
            e.job_id = Some(job_id);
            e.session_id = Some(id);
            e.queue = Some(QUEUES[queue].to_string());
            e.token = Some(Token(token));
            if let JobOutcome::Failed { reason } = &outcome {
                e.detail = Some(reason.clone());
            }
            let job = &mut self.jobs[j];
            job.updated = self.now;
            match outcome {
                JobOutcome::Recovered { recovery_count } => {
                    job.recovery_count = recovery_count;
                    job.state = MState::Queued;
                    heads.entry(queue).or_default().insert(j);
                }
                JobOutcome::Failed { reason } => job.state = MState::Failed(reason),
            }
        }
        let e = self.event(EventKind::for_end(reason));
        e.session_id = Some(id);
        e.reason = Some(reason);
        e.released = locks
            .iter()
            .map(|(k, t)| ReleasedLock {
                key: k.clone(),
                token: *t,
            })
            .collect();
        Closed {
            released: locks.len(),
            seats: seats.len(),
            jobs: jobs.len(),
            revision: 0,
        }
    }

    fn push_heads(&mut self, heads: BTreeMap<usize, BTreeSet<usize>>) {
        for (queue, group) in heads {
            self.queues.entry(queue).or_default().push_front(group);
        }
    }

    fn queued_count(&self, queue: usize) -> usize {
        self.queues
            .get(&queue)
            .map_or(0, |q| q.iter().map(BTreeSet::len).sum())
    }
}

// ---------------------------------------------------------------------------------------------
// The harness
// ---------------------------------------------------------------------------------------------

struct Harness {
    rt: tokio::runtime::Runtime,
    server: Option<TestServer>,
    engine: Engine,
    model: Model,
    /// The audit log read so far.
    cursor: u64,
    /// The highest token or revision any mutation answered.
    high: u64,
}

impl Harness {
    fn start(kind: BackendKind) -> Harness {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let server = rt.block_on(TestServer::start_on(kind, |c| {
            c.max_locks_per_session = MAX_LOCKS;
        }));
        let engine = server.app.as_ref().unwrap().engine.clone();
        Harness {
            rt,
            server: Some(server),
            engine,
            model: Model::default(),
            cursor: 0,
            high: 0,
        }
    }

    fn id(&self, s: usize) -> SessionId {
        match self.model.sessions.get(s) {
            Some(m) => m.id,
            // Never opened: even, while opened ids are random (v4).
            None => SessionId::from_u128(2 * (s as u128 + 1)),
        }
    }

    fn job_id(&self, j: usize) -> JobId {
        self.model
            .jobs
            .get(j)
            .map_or(JobId::from_u128(2), |job| job.id)
    }

    /// A fresh token or revision: strictly above every one answered before.
    fn fresh(&mut self, what: &str, n: u64) {
        assert!(n > self.high, "{what}: {n} is not above {}", self.high);
        self.high = n;
    }

    fn granted(&mut self, what: &str, g: &Granted) -> u64 {
        assert_eq!(
            g.revision, g.token.0,
            "{what}: a grant commits at its token"
        );
        self.fresh(what, g.token.0);
        g.token.0
    }

    fn new_events(&mut self) -> Vec<Event> {
        let (events, next) = self
            .rt
            .block_on(self.engine.events(self.cursor, 10_000))
            .unwrap();
        let mut last = self.cursor;
        for e in &events {
            assert!(e.seq > last, "event sequence numbers grow: {events:?}");
            last = e.seq;
        }
        if let Some(n) = next {
            assert_eq!(n, last);
            self.cursor = n;
        }
        events
    }

    /// Takes the step's events, checks that the sessions it ended were past their deadline
    /// and include those the rules require, and ends them in the model.
    fn settle(&mut self, must_end: &BTreeSet<usize>) -> (Vec<Event>, BTreeSet<usize>) {
        let events = self.new_events();
        let mut ended = BTreeSet::new();
        let mut heads = BTreeMap::new();
        for e in &events {
            if e.kind != EventKind::SessionExpired {
                continue;
            }
            let id = e.session_id.expect("an ending names its session");
            let s = (0..self.model.sessions.len())
                .find(|s| self.model.sessions[*s].id == id)
                .unwrap_or_else(|| panic!("an unknown session {id} expired"));
            assert!(
                self.model.zombie(s),
                "session {s} ended as expired before its deadline or twice: {:?} at {}",
                self.model.sessions[s],
                self.model.now
            );
            self.model.end(s, EndReason::Expired, &mut heads);
            ended.insert(s);
        }
        self.model.push_heads(heads);
        assert!(
            must_end.is_subset(&ended),
            "sessions {must_end:?} past their deadline had to be ended, ended: {ended:?}"
        );
        (events, ended)
    }

    fn step(&mut self, op: &Op) {
        self.model.expected.clear();
        // What the last reads ended.
        let (events, _) = self.settle(&BTreeSet::new());
        self.compare_events(events);
        let m = &self.model;
        match *op {
            Op::Open { ttl } => {
                let o = self
                    .rt
                    .block_on(self.engine.open(OWNER.into(), Some(ttl), None))
                    .unwrap();
                self.fresh("open", o.revision);
                assert_eq!(o.ttl_ms, ttl);
                assert_eq!(o.expires_at, UnixMs(BASE + self.model.now + ttl));
                assert!(
                    self.model.sessions.iter().all(|m| m.id != o.id),
                    "session ids are never reused"
                );
                let (events, _) = self.settle(&BTreeSet::new());
                let now = self.model.now;
                self.model.sessions.push(MSession {
                    id: o.id,
                    ttl,
                    deadline: now + ttl,
                    created: now,
                    ended: false,
                });
                let e = self.model.event(EventKind::SessionOpened);
                e.session_id = Some(o.id);
                e.owner = Some(OWNER.into());
                self.compare_events(events);
            }
            Op::Heartbeat { s, ttl } => {
                let id = self.id(s);
                let alive = m.alive(s);
                let r = self.rt.block_on(self.engine.heartbeat(id, ttl));
                let (events, _) = self.settle(&BTreeSet::new());
                if alive {
                    let beat = r.unwrap_or_else(|e| panic!("heartbeat of live {s}: {e}"));
                    let sess = &mut self.model.sessions[s];
                    if let Some(t) = ttl {
                        sess.ttl = t;
                    }
                    sess.deadline = self.model.now + sess.ttl;
                    assert_eq!(beat.ttl_ms, sess.ttl);
                    assert_eq!(beat.expires_at, UnixMs(BASE + sess.deadline));
                } else {
                    assert!(matches!(r, Err(BackendError::SessionGone)), "{s}: {r:?}");
                }
                self.compare_events(events);
            }
            Op::End { s, reason } => {
                let id = self.id(s);
                let alive = m.alive(s);
                let zombie = m.zombie(s);
                let counts = (m.locks_of(s).len(), m.seats_of(s).len(), m.jobs_of(s).len());
                // A client closing a session past its deadline is recorded as what happened
                // first, its expiry; an operator's end is recorded as the operator's.
                let as_expiry = zombie && reason == EndReason::Closed;
                let must: BTreeSet<usize> = as_expiry.then_some(s).into_iter().collect();
                let r = self.rt.block_on(self.engine.end(id, reason)).unwrap();
                let (events, _) = self.settle(&must);
                if alive || zombie {
                    let closed = r.unwrap_or_else(|| panic!("ending session {s} answered None"));
                    self.fresh("end", closed.revision);
                    if !as_expiry {
                        let mut heads = BTreeMap::new();
                        self.model.end(s, reason, &mut heads);
                        self.model.push_heads(heads);
                    }
                    assert_eq!((closed.released, closed.seats, closed.jobs), counts);
                } else {
                    assert_eq!(r, None, "ending a gone session");
                }
                self.compare_events(events);
            }
            Op::Acquire { s, key } => {
                let id = self.id(s);
                let alive = m.alive(s);
                let holder = m.locks.get(&key).copied();
                let mut must = BTreeSet::new();
                if alive && let Some((h, _, _)) = holder.filter(|h| m.zombie(h.0)) {
                    must.insert(h);
                }
                let r = self
                    .rt
                    .block_on(self.engine.acquire(id, name(KEYS[key]), 0));
                let (events, _) = self.settle(&must);
                let m = &self.model;
                if !alive {
                    assert!(matches!(r, Err(BackendError::SessionGone)), "{r:?}");
                } else {
                    match m.locks.get(&key).copied() {
                        Some((h, token, _)) if h == s => {
                            let g = r.unwrap_or_else(|e| panic!("re-acquire: {e}"));
                            assert_eq!(g.token.0, token, "a holder asking again keeps its token");
                        }
                        Some(_) => {
                            let too_many = m.locks_of(s).len() >= MAX_LOCKS;
                            assert!(
                                matches!(r, Err(BackendError::LockHeld))
                                    || too_many
                                        && matches!(r, Err(BackendError::TooManyLocks(MAX_LOCKS))),
                                "{r:?}"
                            );
                        }
                        None if m.locks_of(s).len() >= MAX_LOCKS => {
                            assert!(
                                matches!(r, Err(BackendError::TooManyLocks(MAX_LOCKS))),
                                "{r:?}"
                            );
                        }
                        None => {
                            let g = r.unwrap_or_else(|e| panic!("acquire of a free key: {e}"));
                            let token = self.granted("lock", &g);
                            let now = self.model.now;
                            self.model.locks.insert(key, (s, token, now));
                            let e = self.model.event(EventKind::LockAcquired);
                            e.session_id = Some(id);
                            e.key = Some(KEYS[key].into());
                            e.token = Some(Token(token));
                        }
                    }
                }
                self.compare_events(events);
            }
            Op::Release { s, key, pick } => {
                let s = match m.locks.get(&key) {
                    Some(l) if s == HOLDER => l.0,
                    _ => s.min(m.sessions.len()),
                };
                let id = self.id(s);
                let alive = m.alive(s);
                let holder = m.locks.get(&key).copied();
                let token = match (holder, pick) {
                    (Some((_, t, _)), Pick::Current) => t,
                    (Some((_, t, _)), Pick::Stale) => t - 1,
                    (None, _) => 1,
                };
                let r = self
                    .rt
                    .block_on(self.engine.release(id, name(KEYS[key]), Token(token)));
                let (events, _) = self.settle(&BTreeSet::new());
                if alive && holder.is_some_and(|h| h.0 == s && h.1 == token) {
                    let rev = r.unwrap_or_else(|e| panic!("release by the holder: {e}"));
                    self.fresh("release", rev);
                    self.model.locks.remove(&key);
                    let e = self.model.event(EventKind::LockReleased);
                    e.session_id = Some(id);
                    e.key = Some(KEYS[key].into());
                    e.token = Some(Token(token));
                } else {
                    assert!(matches!(r, Err(BackendError::NotHolder)), "{r:?}");
                }
                self.compare_events(events);
            }
            Op::PutPool { pool, capacity } => {
                let r = self
                    .rt
                    .block_on(self.engine.put_pool(name(POOLS[pool]), capacity, None))
                    .unwrap();
                let (events, _) = self.settle(&BTreeSet::new());
                self.fresh("put pool", r.revision);
                let now = self.model.now;
                let created = !self.model.pools.contains_key(&pool);
                assert_eq!(r.created, created);
                let entry = self.model.pools.entry(pool).or_insert(MPool {
                    capacity: 0,
                    created: now,
                    holders: BTreeMap::new(),
                });
                entry.capacity = capacity as u32;
                let e = self.model.event(EventKind::PoolPut);
                e.pool = Some(POOLS[pool].into());
                e.detail = Some(format!("capacity {capacity}"));
                self.compare_events(events);
            }
            Op::DeletePool { pool } => {
                let must: BTreeSet<usize> = m.pools.get(&pool).map_or(BTreeSet::new(), |p| {
                    p.holders.keys().copied().filter(|h| m.zombie(*h)).collect()
                });
                let r = self.rt.block_on(self.engine.delete_pool(name(POOLS[pool])));
                let (events, _) = self.settle(&must);
                match self.model.pools.get(&pool) {
                    None => assert!(matches!(r, Err(BackendError::PoolNotFound)), "{r:?}"),
                    Some(p) if !p.holders.is_empty() => {
                        let n = p.holders.len();
                        assert!(
                            matches!(r, Err(BackendError::PoolInUse(k)) if k == n),
                            "{r:?}"
                        );
                    }
                    Some(_) => {
                        let rev = r.unwrap_or_else(|e| panic!("delete an empty pool: {e}"));
                        self.fresh("delete pool", rev);
                        self.model.pools.remove(&pool);
                        self.model.event(EventKind::PoolDeleted).pool = Some(POOLS[pool].into());
                    }
                }
                self.compare_events(events);
            }
            Op::AcquireSeat { s, pool } => {
                let id = self.id(s);
                let alive = m.alive(s);
                let exists = m.pools.contains_key(&pool);
                let r = self
                    .rt
                    .block_on(self.engine.acquire_seat(id, name(POOLS[pool]), None, 0));
                let (events, ended) = self.settle(&BTreeSet::new());
                let m = &self.model;
                match m.pools.get(&pool) {
                    _ if !alive && !exists => assert!(
                        matches!(
                            r,
                            Err(BackendError::SessionGone | BackendError::PoolNotFound)
                        ),
                        "{r:?}"
                    ),
                    _ if !alive => assert!(matches!(r, Err(BackendError::SessionGone)), "{r:?}"),
                    None => assert!(matches!(r, Err(BackendError::PoolNotFound)), "{r:?}"),
                    Some(p) if p.holders.contains_key(&s) => {
                        let g = r.unwrap_or_else(|e| panic!("seat again: {e}"));
                        assert_eq!(g.token.0, p.holders[&s].token, "a holder keeps its seat");
                    }
                    Some(p) if p.holders.len() < p.capacity as usize => {
                        let g = r.unwrap_or_else(|e| {
                            panic!("seat in a pool with room {p:?} (ended {ended:?}): {e}")
                        });
                        let token = self.granted("seat", &g);
                        let now = self.model.now;
                        let p = self.model.pools.get_mut(&pool).unwrap();
                        p.holders.insert(s, MSeat { token, at: now });
                        let e = self.model.event(EventKind::SeatAcquired);
                        e.session_id = Some(id);
                        e.pool = Some(POOLS[pool].into());
                        e.token = Some(Token(token));
                    }
                    Some(p) => {
                        let zombies: Vec<usize> =
                            p.holders.keys().copied().filter(|h| m.zombie(*h)).collect();
                        assert!(
                            zombies.is_empty(),
                            "a full pool refused a seat while {zombies:?} held seats past \
                             their deadline: {r:?}"
                        );
                        let (cap, used) = (p.capacity, p.holders.len());
                        assert!(
                            matches!(r, Err(BackendError::PoolExhausted { capacity, in_use })
                                if capacity == cap && in_use == used),
                            "{r:?}"
                        );
                    }
                }
                self.compare_events(events);
            }
            Op::ReleaseSeat { s, pool, pick } => {
                let holder = m
                    .pools
                    .get(&pool)
                    .and_then(|p| p.holders.keys().next().copied());
                let s = match holder {
                    Some(h) if s == HOLDER => h,
                    _ => s.min(m.sessions.len()),
                };
                let id = self.id(s);
                let alive = m.alive(s);
                let exists = m.pools.contains_key(&pool);
                let seat = m.pools.get(&pool).and_then(|p| p.holders.get(&s).copied());
                let token = match (seat, pick) {
                    (Some(seat), Pick::Current) => seat.token,
                    (Some(seat), Pick::Stale) => seat.token - 1,
                    (None, _) => 1,
                };
                // A holder past its deadline cannot give its seat back: it is reclaimed.
                let must: BTreeSet<usize> = (seat.is_some() && m.zombie(s))
                    .then_some(s)
                    .into_iter()
                    .collect();
                let r = self.rt.block_on(self.engine.release_seat(
                    id,
                    name(POOLS[pool]),
                    Token(token),
                ));
                let (events, _) = self.settle(&must);
                if !exists {
                    assert!(
                        matches!(r, Err(BackendError::PoolNotFound))
                            || !alive && matches!(r, Err(BackendError::NotHolder)),
                        "{r:?}"
                    );
                } else if alive && seat.is_some_and(|seat| seat.token == token) {
                    let rev = r.unwrap_or_else(|e| panic!("seat release by its holder: {e}"));
                    self.fresh("seat release", rev);
                    self.model.pools.get_mut(&pool).unwrap().holders.remove(&s);
                    let e = self.model.event(EventKind::SeatReleased);
                    e.session_id = Some(id);
                    e.pool = Some(POOLS[pool].into());
                    e.token = Some(Token(token));
                } else {
                    assert!(matches!(r, Err(BackendError::NotHolder)), "{r:?}");
                }
                self.compare_events(events);
            }
            Op::Enqueue {
                queue,
                idempotent,
                max_recoveries,
            } => {
                let j = self.model.jobs.len();
                let job = NewJob {
                    queue: name(QUEUES[queue]),
                    payload: payload(j),
                    idempotent,
                    max_recoveries,
                    kind: None,
                };
                let (id, rev) = self.rt.block_on(self.engine.enqueue(job)).unwrap();
                self.fresh("enqueue", rev);
                let (events, _) = self.settle(&BTreeSet::new());
                let now = self.model.now;
                self.model.jobs.push(MJob {
                    id,
                    queue,
                    idempotent,
                    max_recoveries: max_recoveries.unwrap_or(3),
                    recovery_count: 0,
                    attempt: 0,
                    state: MState::Queued,
                    enqueued: now,
                    updated: now,
                });
                self.model
                    .queues
                    .entry(queue)
                    .or_default()
                    .push_back(BTreeSet::from([j]));
                let e = self.model.event(EventKind::JobEnqueued);
                e.job_id = Some(id);
                e.queue = Some(QUEUES[queue].into());
                self.compare_events(events);
            }
            Op::Claim { s, queue } => {
                let id = self.id(s);
                let alive = m.alive(s);
                let r = self
                    .rt
                    .block_on(self.engine.claim(id, name(QUEUES[queue]), 0));
                let (events, _) = self.settle(&BTreeSet::new());
                if !alive {
                    assert!(matches!(r, Err(BackendError::SessionGone)), "{r:?}");
                } else if self.model.queued_count(queue) == 0 {
                    assert!(matches!(r, Ok(None)), "an empty queue: {r:?}");
                } else {
                    let c = r
                        .unwrap_or_else(|e| panic!("claim: {e}"))
                        .unwrap_or_else(|| panic!("no claim from a queue with jobs"));
                    let q = self.model.queues.get_mut(&queue).unwrap();
                    let head = q.front_mut().unwrap();
                    let j = *head
                        .iter()
                        .find(|j| self.model.jobs[**j].id == c.job)
                        .unwrap_or_else(|| {
                            panic!("claimed {} out of turn: the head is {head:?}", c.job)
                        });
                    head.remove(&j);
                    if head.is_empty() {
                        q.pop_front();
                    }
                    assert_eq!(c.revision, c.token.0, "a claim commits at its token");
                    self.fresh("claim", c.token.0);
                    let now = self.model.now;
                    let job = &mut self.model.jobs[j];
                    job.attempt += 1;
                    job.state = MState::Claimed {
                        s,
                        token: c.token.0,
                        at: now,
                    };
                    job.updated = now;
                    assert_eq!(
                        (c.attempt, c.recovery_count, c.kind.as_str()),
                        (job.attempt, job.recovery_count, "")
                    );
                    let job_id = job.id;
                    let e = self.model.event(EventKind::JobClaimed);
                    e.session_id = Some(id);
                    e.job_id = Some(job_id);
                    e.queue = Some(QUEUES[queue].into());
                    e.token = Some(c.token);
                }
                self.compare_events(events);
            }
            Op::Finish { s, job, pick, how } => {
                let s = match m.jobs.get(job).map(|j| &j.state) {
                    Some(MState::Claimed { s: c, .. }) if s == HOLDER => *c,
                    _ => s.min(m.sessions.len()),
                };
                let id = self.id(s);
                let alive = m.alive(s);
                let job_id = self.job_id(job);
                let claim = m.jobs.get(job).and_then(|j| match j.state {
                    MState::Claimed { s, token, .. } => Some((s, token)),
                    _ => None,
                });
                let token = match (claim, pick) {
                    (Some((_, t)), Pick::Current) => t,
                    (Some((_, t)), Pick::Stale) => t - 1,
                    (None, _) => 1,
                };
                // A late worker cannot finish: its session ends and its job is settled.
                let must: BTreeSet<usize> = (claim.is_some_and(|c| c.0 == s) && m.zombie(s))
                    .then_some(s)
                    .into_iter()
                    .collect();
                let finish = match how {
                    How::Complete => Finish::Complete {
                        result: RESULT.into(),
                    },
                    How::Fail => Finish::Fail {
                        reason: WORKER_REASON.into(),
                    },
                    How::Release => Finish::Release,
                };
                let r = self
                    .rt
                    .block_on(self.engine.finish_job(id, job_id, Token(token), finish));
                let (events, _) = self.settle(&must);
                if job >= self.model.jobs.len() {
                    assert!(matches!(r, Err(BackendError::JobNotFound)), "{r:?}");
                } else if alive && claim == Some((s, token)) {
                    let rev = r.unwrap_or_else(|e| panic!("finish by the claimant: {e}"));
                    self.fresh("finish", rev);
                    let now = self.model.now;
                    let j = &mut self.model.jobs[job];
                    j.updated = now;
                    let queue = j.queue;
                    let kind = match how {
                        How::Complete => {
                            j.state = MState::Done;
                            EventKind::JobCompleted
                        }
                        How::Fail => {
                            j.state = MState::Failed(WORKER_REASON.into());
                            EventKind::JobFailed
                        }
                        How::Release => {
                            j.state = MState::Queued;
                            self.model
                                .queues
                                .entry(queue)
                                .or_default()
                                .push_front(BTreeSet::from([job]));
                            EventKind::JobReleased
                        }
                    };
                    let e = self.model.event(kind);
                    e.session_id = Some(id);
                    e.job_id = Some(job_id);
                    e.queue = Some(QUEUES[queue].into());
                    e.token = Some(Token(token));
                    if let How::Fail = how {
                        e.detail = Some(WORKER_REASON.into());
                    }
                } else {
                    assert!(matches!(r, Err(BackendError::StaleToken)), "{r:?}");
                }
                self.compare_events(events);
            }
            Op::Requeue { job } => {
                let job_id = self.job_id(job);
                let r = self.rt.block_on(self.engine.requeue(job_id));
                let (events, _) = self.settle(&BTreeSet::new());
                match self.model.jobs.get(job).map(|j| j.state.clone()) {
                    None => assert!(matches!(r, Err(BackendError::JobNotFound)), "{r:?}"),
                    Some(MState::Failed(_)) => {
                        let rev = r.unwrap_or_else(|e| panic!("requeue a failed job: {e}"));
                        self.fresh("requeue", rev);
                        let now = self.model.now;
                        let j = &mut self.model.jobs[job];
                        j.state = MState::Queued;
                        j.recovery_count = 0;
                        j.updated = now;
                        let queue = j.queue;
                        self.model
                            .queues
                            .entry(queue)
                            .or_default()
                            .push_back(BTreeSet::from([job]));
                        let e = self.model.event(EventKind::JobRequeued);
                        e.job_id = Some(job_id);
                        e.queue = Some(QUEUES[queue].into());
                    }
                    Some(_) => assert!(matches!(r, Err(BackendError::JobNotFailed)), "{r:?}"),
                }
                self.compare_events(events);
            }
            Op::Advance { ms } => {
                let server = self.server.as_ref().unwrap();
                self.rt.block_on(server.advance(ms));
                self.model.now += ms;
                let (events, _) = self.settle(&BTreeSet::new());
                self.compare_events(events);
            }
            Op::Reap => {
                let zombies = m.zombies();
                let want_locks: usize = zombies.iter().map(|z| m.locks_of(*z).len()).sum();
                let want_seats: usize = zombies.iter().map(|z| m.seats_of(*z).len()).sum();
                let want_jobs: usize = zombies.iter().map(|z| m.jobs_of(*z).len()).sum();
                let r = self.rt.block_on(self.engine.reap_now()).unwrap();
                let (events, ended) = self.settle(&zombies);
                assert_eq!(ended, zombies);
                assert_eq!(
                    (r.sessions, r.locks, r.seats, r.jobs),
                    (zombies.len(), want_locks, want_seats, want_jobs)
                );
                self.compare_events(events);
            }
            Op::DryRun => {
                let mut due = self.rt.block_on(self.engine.reap_dry_run(100)).unwrap();
                due.sort_by_key(|d| d.id);
                let mut want: Vec<_> = m
                    .zombies()
                    .into_iter()
                    .map(|z| {
                        let mut jobs: Vec<(JobId, JobOutcome)> = m
                            .jobs_of(z)
                            .into_iter()
                            .map(|j| (m.jobs[j].id, Model::outcome(&m.jobs[j])))
                            .collect();
                        jobs.sort_by_key(|j| j.0);
                        let seats: Vec<String> =
                            m.seats_of(z).into_iter().map(|(p, _)| p).collect();
                        (
                            m.sessions[z].id,
                            BASE + m.sessions[z].deadline,
                            m.locks_of(z),
                            seats,
                            jobs,
                        )
                    })
                    .collect();
                want.sort_by_key(|w| w.0);
                let got: Vec<_> = due
                    .into_iter()
                    .map(|mut d| {
                        d.locks.sort();
                        d.seats.sort();
                        d.jobs.sort_by_key(|j| j.0);
                        (d.id, d.expired_at.0, d.locks, d.seats, d.jobs)
                    })
                    .collect();
                assert_eq!(got, want, "the dry run");
                let events = self.new_events();
                assert!(events.is_empty(), "a dry run wrote {events:?}");
            }
        }
    }

    /// The step's events, in any order among themselves, against the model's; each stamped
    /// with the model's clock.
    fn compare_events(&mut self, got: Vec<Event>) {
        let norm = |mut e: Event| {
            e.seq = 0;
            e.released.sort_by(|a, b| a.key.cmp(&b.key));
            e
        };
        let mut got: Vec<Event> = got.into_iter().map(norm).collect();
        let mut want: Vec<Event> = self.model.expected.drain(..).map(norm).collect();
        let key = |e: &Event| format!("{e:?}");
        got.sort_by_key(key);
        want.sort_by_key(key);
        assert_eq!(got, want, "the step's audit events");
    }

    /// Everything a client can read, against the model.
    fn check(&self) {
        let m = &self.model;
        let rt = &self.rt;
        let e = &self.engine;
        let wall = |ms: u64| UnixMs(BASE + ms);
        // Locks and fences.
        let mut listed = Vec::new();
        for (k, key) in KEYS.iter().enumerate() {
            let got = rt.block_on(e.lock(&name(key))).unwrap();
            let held = m.locks.get(&k);
            match held {
                Some(&(s, token, at)) => {
                    let rec = got.unwrap_or_else(|| panic!("key {key} reads as free"));
                    assert_eq!(
                        (rec.session_id, rec.token, rec.acquired_at),
                        (m.sessions[s].id, Token(token), wall(at)),
                        "key {key}"
                    );
                    listed.push(key.to_string());
                    let f = rt.block_on(e.fence(&name(key), Token(token))).unwrap();
                    assert_eq!(
                        f.current,
                        m.alive(s),
                        "fence of {key}: its holder's liveness"
                    );
                    assert_eq!(f.latest, Some(Token(token)));
                    let f = rt.block_on(e.fence(&name(key), Token(token - 1))).unwrap();
                    assert!(!f.current, "a stale token is never current");
                }
                None => {
                    assert!(got.is_none(), "free key {key} reads {got:?}");
                    let f = rt.block_on(e.fence(&name(key), Token(1))).unwrap();
                    assert!(!f.current && f.latest.is_none(), "{key}: {f:?}");
                }
            }
        }
        let (locks, _) = rt.block_on(e.locks("", None, 100)).unwrap();
        assert_eq!(locks.into_iter().map(|l| l.0).collect::<Vec<_>>(), listed);
        // Pools and seats.
        let mut pools = Vec::new();
        for (p, pname) in POOLS.iter().enumerate() {
            let got = rt.block_on(e.pool(&name(pname))).unwrap();
            let Some(mp) = m.pools.get(&p) else {
                assert!(got.is_none(), "deleted pool {pname} reads {got:?}");
                continue;
            };
            pools.push((pname.to_string(), mp.capacity, mp.holders.len()));
            let info = got.unwrap_or_else(|| panic!("pool {pname} reads as missing"));
            assert_eq!(info.capacity, mp.capacity, "pool {pname}");
            assert_eq!(info.in_use, mp.holders.len(), "pool {pname}");
            assert_eq!(info.waiting, 0);
            assert_eq!(info.created_at, wall(mp.created));
            let mut holders: Vec<_> = info
                .holders
                .iter()
                .map(|h| {
                    (
                        h.session_id,
                        h.seat.token,
                        h.seat.acquired_at,
                        h.grace,
                        h.last_heartbeat_at,
                    )
                })
                .collect();
            holders.sort();
            let mut want: Vec<_> = mp
                .holders
                .iter()
                .map(|(s, seat)| {
                    let sess = &m.sessions[*s];
                    let last = sess.deadline - sess.ttl;
                    let (grace, beat) = if m.alive(*s) {
                        (Some(m.now - last > sess.ttl / 3), Some(wall(last)))
                    } else {
                        (None, None)
                    };
                    (sess.id, Token(seat.token), wall(seat.at), grace, beat)
                })
                .collect();
            want.sort();
            assert_eq!(holders, want, "holders of pool {pname}");
        }
        let mut got = rt.block_on(e.pools()).unwrap();
        got.sort();
        assert_eq!(got, pools, "the pool list");
        // Jobs and queues.
        for (j, job) in m.jobs.iter().enumerate() {
            let (rec, body) = rt
                .block_on(e.job(job.id))
                .unwrap()
                .unwrap_or_else(|| panic!("job {j} reads as missing"));
            assert_eq!(json(&body), json(&payload(j)), "payload of job {j}");
            assert_eq!(rec.queue, QUEUES[job.queue]);
            assert_eq!(rec.kind, "");
            assert_eq!(
                (
                    rec.idempotent,
                    rec.max_recoveries,
                    rec.recovery_count,
                    rec.attempt
                ),
                (
                    job.idempotent,
                    job.max_recoveries,
                    job.recovery_count,
                    job.attempt
                ),
                "job {j}"
            );
            assert_eq!(rec.enqueued_at, wall(job.enqueued), "job {j}");
            assert_eq!(rec.updated_at, wall(job.updated), "job {j}");
            match (&rec.status, &job.state) {
                (JobStatus::Queued, MState::Queued) => {}
                (
                    JobStatus::Claimed {
                        session_id,
                        token,
                        claimed_at,
                    },
                    MState::Claimed { s, token: t, at },
                ) => assert_eq!(
                    (*session_id, *token, *claimed_at),
                    (m.sessions[*s].id, Token(*t), wall(*at)),
                    "job {j}"
                ),
                (JobStatus::Done { result }, MState::Done) => {
                    assert_eq!(json(result), json(RESULT), "result of job {j}")
                }
                (JobStatus::Failed { reason }, MState::Failed(want)) => {
                    assert_eq!(reason, want, "job {j}")
                }
                (got, want) => panic!("job {j} is {got:?}, the model says {want:?}"),
            }
        }
        for (q, queue) in QUEUES.iter().enumerate() {
            let info = rt.block_on(e.queue(&name(queue))).unwrap();
            let count = |f: fn(&MState) -> bool| {
                m.jobs
                    .iter()
                    .filter(|j| j.queue == q && f(&j.state))
                    .count() as u64
            };
            let c = info.counts;
            assert_eq!(
                (c.queued, c.claimed, c.done, c.failed),
                (
                    count(|s| *s == MState::Queued),
                    count(|s| matches!(s, MState::Claimed { .. })),
                    count(|s| *s == MState::Done),
                    count(|s| matches!(s, MState::Failed(_))),
                ),
                "counts of queue {queue}"
            );
            assert_eq!(info.waiting, 0);
            assert_eq!(m.queued_count(q) as u64, c.queued);
        }
        // Sessions and what they hold, last: a read of a session past its deadline may end it.
        let mut live = Vec::new();
        for (s, sess) in m.sessions.iter().enumerate() {
            let got = rt.block_on(e.session(sess.id)).unwrap();
            if !m.alive(s) {
                assert!(got.is_none(), "session {s} is gone but reads {got:?}");
                continue;
            }
            live.push(sess.id);
            let info = got.unwrap_or_else(|| panic!("live session {s} reads as gone"));
            let last = sess.deadline - sess.ttl;
            assert_eq!(info.record.owner, OWNER);
            assert_eq!(info.record.created_at, wall(sess.created));
            assert_eq!(info.ttl_ms, sess.ttl, "session {s}");
            assert_eq!(info.expires_at, wall(sess.deadline), "session {s}");
            assert_eq!(info.last_heartbeat_at, wall(last), "session {s}");
            assert_eq!(info.grace, m.now - last > sess.ttl / 3, "session {s} grace");
            let mut locks = info.locks.clone();
            locks.sort();
            assert_eq!(locks, m.locks_of(s), "locks of session {s}");
            let mut seats = info.seats.clone();
            seats.sort();
            assert_eq!(seats, m.seats_of(s), "seats of session {s}");
            let mut jobs = info.jobs.clone();
            jobs.sort();
            let mut want: Vec<JobId> = m.jobs_of(s).into_iter().map(|j| m.jobs[j].id).collect();
            want.sort();
            assert_eq!(jobs, want, "jobs of session {s}");
        }
        live.sort();
        let (page, next) = rt.block_on(e.sessions(None, None, 100)).unwrap();
        assert_eq!(page.iter().map(|i| i.id).collect::<Vec<_>>(), live);
        assert_eq!(next, None);
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            self.rt.block_on(server.stop());
        }
    }
}

/// The run on the embedded backend.
struct OnEmbedded;
/// The run on the PostgreSQL backend.
struct OnPostgres;
/// The run on the Redis backend.
struct OnRedis;

macro_rules! run_on {
    ($run:ident, $kind:ident) => {
        impl StateMachineTest for $run {
            type SystemUnderTest = Harness;
            type Reference = Reference;

            fn init_test(_: &Counts) -> Harness {
                Harness::start(BackendKind::$kind)
            }

            fn apply(mut harness: Harness, _: &Counts, op: Op) -> Harness {
                harness.step(&op);
                harness.check();
                harness
            }
        }
    };
}

run_on!(OnEmbedded, Embedded);
run_on!(OnPostgres, Postgres);
run_on!(OnRedis, Redis);

/// Failures are kept next to this file, as `tests/model_backend.proptest-regressions`.
fn config(cases: Option<u32>) -> Config {
    let base = contextualize_config(Config {
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    });
    match cases {
        Some(cases) => Config { cases, ..base },
        None => base,
    }
}

fn postgres_cases() -> u32 {
    std::env::var("LEASEHOLD_MODEL_PG_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

fn redis_cases() -> u32 {
    std::env::var("LEASEHOLD_MODEL_REDIS_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

prop_state_machine! {
    #![proptest_config(config(None))]

    #[test]
    fn embedded_matches_the_model(sequential 1..60 => OnEmbedded);
}

prop_state_machine! {
    #![proptest_config(config(Some(postgres_cases())))]

    #[test]
    fn postgres_matches_the_model(sequential 1..45 => OnPostgres);
}

prop_state_machine! {
    #![proptest_config(config(Some(redis_cases())))]

    #[test]
    fn redis_matches_the_model(sequential 1..45 => OnRedis);
}
