//! Model-based test of the domain state machine, `leasehold::domain::State`.
//!
//! It guards against the lease rules drifting from what clients rely on: two holders of one
//! key, more seats in use than a pool allowed when it granted them, two seats for one session
//! in one pool, a job claimed by two sessions, lost, or recovered past its cap, a stale token
//! that still finishes a job, a fencing token that does not grow, a session that ends (or is
//! reported gone) before its deadline or comes back after it is gone, grants that outlive
//! their session, a reaper that overruns its batch or skips the earliest deadline, a resource
//! freed without its waiters being told, and change sets that the store could not replay into
//! the same state. Random sequences of operations run against `State` and against a
//! deliberately naive model written here, and every result and the whole observable state are
//! compared after every step.
//!
//! Where the rules leave an order open (which of several expired holders a full pool or a
//! pool deletion ends first, which of equally due sessions or equally old jobs a bounded reap
//! or purge takes, in what order an ending session's jobs go back to the head of their
//! queue), the harness checks that the state's choice is one the rules allow and has its
//! model follow it. The model never asks the state what the result should be.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use leasehold::domain::{
    AcquireError, Acquired, At, Beat, Change, Claim, ClaimGone, Effects, EndReason, Ended, Event,
    EventKind, Finish, HeartbeatError, InvalidInput, JobError, JobId, JobOutcome, JobRecord,
    JobStatus, Limits, LockKey, LockRecord, LockView, Mono, NewJob, NotHolder, Opened, PoolError,
    PoolName, PoolPut, PoolRecord, PoolView, QueueCounts, QueueName, ReleasedLock, Restore, Seat,
    SeatError, SeatGrant, SeatRecord, SessionId, SessionView, State, Token, UnixMs,
};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::strategy::Union;
use proptest::test_runner::{Config, FileFailurePersistence, contextualize_config};
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

/// Each case picks its own `max_locks_per_session`, from these: always below the number of
/// keys, so that a greedy session runs into it, and at 1 any holder is at its limit.
const MAX_LOCKS: [usize; 3] = [1, 2, 3];
const LIMITS: Limits = Limits {
    min_ttl_ms: 1_000,
    max_ttl_ms: 86_400_000,
    default_ttl_ms: 15_000,
    max_locks_per_session: MAX_LOCKS[0],
};

fn limits(max_locks: usize) -> Limits {
    Limits {
        max_locks_per_session: max_locks,
        ..LIMITS
    }
}
/// Session slots: each holds the session last opened in it, ended or not.
const SLOTS: usize = 4;
const KEYS: [&str; 4] = ["a", "b", "c", "d"];
/// Pools and queues spelled like a lock key and like each other: the namespaces must not mix.
const POOLS: [&str; 2] = ["a", "p"];
const QUEUES: [&str; 2] = ["a", "q"];
/// Multiples of 500 ms, so that clock steps of 250 ms often land exactly on a deadline.
const TTLS: [u64; 5] = [1_000, 1_500, 2_500, 5_000, 10_000];
const WALL0: u64 = 1_700_000_000_000;
const OWNER: &str = "model";
/// The rules for pools and jobs, spelled out again here.
const MAX_CAPACITY: u64 = 1_000_000;
const DEFAULT_MAX_RECOVERIES: u32 = 3;
const MAX_RECOVERIES: u32 = 1_000;
const REASON_MAX_RECOVERIES: &str = "max_recoveries_exceeded";
const REASON_NOT_IDEMPOTENT: &str = "not_idempotent";
/// What a worker says when it fails a job: never one of the reasons above.
const WORKER_REASON: &str = "worker gave up";
const RESULT: &str = r#"{"ok":true}"#;

fn key(name: &str) -> LockKey {
    LockKey::parse("key", name).expect("test keys are valid")
}

/// The id of the `serial`-th open: scrambled so that id order differs from opening order, and
/// even, so that it never equals a random id (always odd).
fn opened_id(serial: u64) -> SessionId {
    let high = (serial + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    SessionId::from_u128(u128::from(high) << 64)
}

/// The id of the `serial`-th enqueue, made like `opened_id`.
fn job_id(serial: u64) -> JobId {
    let high = (serial + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    JobId::from_u128(u128::from(high) << 64)
}

/// The session that reads a queue's order on a copy of the state: even, and not an opened id.
fn probe() -> SessionId {
    SessionId::from_u128(2)
}

fn payload(job: JobId) -> String {
    format!(r#"{{"job":"{job}"}}"#)
}

/// An input error's field only: the wording of the rule is not the model's business.
fn field_only(e: InvalidInput) -> InvalidInput {
    InvalidInput::new(e.field, "")
}

/// `released` and `seats` in name order: the state lists a session's grants in no particular
/// order. `jobs` keep theirs: the model follows the state's.
fn sorted(mut ended: Ended) -> Ended {
    ended.released.sort();
    ended.seats.sort();
    ended
}

/// What the state keeps in memory of a job's status: a result is written once, not kept.
fn in_memory(status: &JobStatus) -> JobStatus {
    match status {
        JobStatus::Done { .. } => JobStatus::Done {
            result: String::new(),
        },
        other => other.clone(),
    }
}

#[derive(Clone, Debug)]
enum Transition {
    Open {
        slot: usize,
        id: SessionId,
        ttl_ms: Option<u64>,
    },
    Heartbeat {
        id: SessionId,
        ttl_ms: Option<u64>,
    },
    End {
        id: SessionId,
        reason: EndReason,
    },
    Acquire {
        id: SessionId,
        key: LockKey,
    },
    Release {
        id: SessionId,
        key: LockKey,
        token: Token,
    },
    Advance {
        ms: u64,
    },
    Reap {
        limit: usize,
    },
    PutPool {
        pool: PoolName,
        capacity: u64,
        created_at: Option<UnixMs>,
    },
    DeletePool {
        pool: PoolName,
    },
    AcquireSeat {
        id: SessionId,
        pool: PoolName,
        metadata: String,
    },
    ReleaseSeat {
        id: SessionId,
        pool: PoolName,
        token: Token,
    },
    Enqueue {
        job: JobId,
        queue: QueueName,
        idempotent: bool,
        max_recoveries: Option<u32>,
        kind: Option<String>,
    },
    Claim {
        id: SessionId,
        queue: QueueName,
    },
    FinishJob {
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
    },
    Requeue {
        job: JobId,
    },
    Purge {
        age_ms: u64,
        limit: usize,
    },
}

#[derive(Clone, Debug)]
struct MSession {
    ttl_ms: u64,
    deadline: u64,
    /// The jobs it holds, in the order it claimed them.
    claims: Vec<JobId>,
}

#[derive(Clone, Debug)]
struct MLock {
    session: SessionId,
    token: u64,
    acquired_at: u64,
}

#[derive(Clone, Debug)]
struct MSeat {
    token: u64,
    acquired_at: u64,
    metadata: String,
}

#[derive(Clone, Debug)]
struct MPool {
    capacity: u32,
    created_at: u64,
    holders: BTreeMap<SessionId, MSeat>,
}

impl MPool {
    fn has_room(&self) -> bool {
        self.holders.len() < self.capacity as usize
    }
}

#[derive(Clone, Debug)]
struct MJob {
    queue: QueueName,
    kind: String,
    idempotent: bool,
    max_recoveries: u32,
    recovery_count: u32,
    attempt: u32,
    status: JobStatus,
    enqueued_at: u64,
    updated_at: u64,
}

impl MJob {
    fn recovers(&self) -> bool {
        self.idempotent && self.recovery_count < self.max_recoveries
    }

    fn finished(&self) -> bool {
        matches!(
            self.status,
            JobStatus::Done { .. } | JobStatus::Failed { .. }
        )
    }
}

/// The state's choices where the rules leave the order open, taken from what it reported.
#[derive(Clone, Debug, Default)]
struct Follow {
    sessions: Vec<SessionId>,
    jobs: BTreeMap<SessionId, Vec<JobId>>,
}

impl Follow {
    fn of(ended: &[Ended]) -> Follow {
        Follow {
            sessions: ended.iter().map(|e| e.id).collect(),
            jobs: ended
                .iter()
                .map(|e| (e.id, e.jobs.iter().map(|(j, _)| *j).collect()))
                .collect(),
        }
    }

    /// `items` in the order of `order`; those it does not name last, in their own order.
    fn arrange<T: PartialEq>(order: &[T], mut items: Vec<T>) -> Vec<T> {
        items.sort_by_key(|item| order.iter().position(|o| o == item).unwrap_or(usize::MAX));
        items
    }

    fn sessions(&self, ids: Vec<SessionId>) -> Vec<SessionId> {
        Follow::arrange(&self.sessions, ids)
    }

    fn jobs(&self, id: SessionId, jobs: Vec<JobId>) -> Vec<JobId> {
        Follow::arrange(self.jobs.get(&id).map_or(&[][..], Vec::as_slice), jobs)
    }
}

/// The reference model: plain maps and the rules spelled out once more, naively.
#[derive(Clone, Debug, Default)]
struct Model {
    /// This case's `max_locks_per_session`.
    max_locks: usize,
    now: u64,
    revision: u64,
    event_seq: u64,
    /// Every session not yet ended, including those past their deadline.
    sessions: BTreeMap<SessionId, MSession>,
    locks: BTreeMap<LockKey, MLock>,
    pools: BTreeMap<PoolName, MPool>,
    /// Every job not yet purged.
    jobs: BTreeMap<JobId, MJob>,
    /// Each queue's queued jobs, the next one to be claimed first.
    queued: BTreeMap<QueueName, VecDeque<JobId>>,
    /// Every session ever ended, in order.
    ended: Vec<SessionId>,
    /// Sessions the current operation ended as a side effect (`Effects::ended`).
    inline: Vec<Ended>,
    /// Where the rules leave an order open, the state's choice (the harness sets it).
    follow: Follow,
    // What the generator picks from.
    slots: [Option<SessionId>; SLOTS],
    grants: Vec<(LockKey, SessionId, Token)>,
    seat_grants: Vec<(PoolName, SessionId, Token)>,
    claims: Vec<(JobId, SessionId, Token)>,
    opens: u64,
    enqueues: u64,
    /// Every job ever enqueued, purged or not.
    made: Vec<JobId>,
}

impl Model {
    fn wall(&self) -> UnixMs {
        UnixMs(WALL0 + self.now)
    }

    /// Alive: not ended and strictly before its deadline.
    fn alive(&self, id: SessionId) -> bool {
        self.sessions
            .get(&id)
            .is_some_and(|s| self.now < s.deadline)
    }

    fn next_revision(&mut self) -> u64 {
        self.revision += 1;
        self.revision
    }

    fn events(&mut self, n: usize) {
        self.event_seq += n as u64;
    }

    /// Most mutations take one revision and write one audit event.
    fn mutation(&mut self) -> u64 {
        self.events(1);
        self.next_revision()
    }

    /// Sessions at or past their deadline, as `(deadline, id)` in ascending order.
    fn due(&self) -> Vec<(u64, SessionId)> {
        let mut due: Vec<_> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.deadline <= self.now)
            .map(|(id, s)| (s.deadline, *id))
            .collect();
        due.sort();
        due
    }

    fn locks_of(&self, id: SessionId) -> Vec<(LockKey, Token)> {
        let held = self.locks.iter().filter(|(_, l)| l.session == id);
        held.map(|(k, l)| (k.clone(), Token(l.token))).collect()
    }

    fn seats_of(&self, id: SessionId) -> Vec<PoolName> {
        let held = self
            .pools
            .iter()
            .filter(|(_, p)| p.holders.contains_key(&id));
        held.map(|(name, _)| name.clone()).collect()
    }

    fn claimant(job: &MJob) -> Option<(SessionId, Token)> {
        match job.status {
            JobStatus::Claimed {
                session_id, token, ..
            } => Some((session_id, token)),
            _ => None,
        }
    }

    fn claims_of(&self, id: SessionId) -> Vec<JobId> {
        let held = self.jobs.iter();
        let held = held.filter(|(_, j)| Model::claimant(j).is_some_and(|(s, _)| s == id));
        held.map(|(job, _)| *job).collect()
    }

    /// Puts a job back at the head of its queue.
    fn push_head(&mut self, job: JobId) {
        let queue = self.jobs[&job].queue.clone();
        self.queued.entry(queue).or_default().push_front(job);
    }

    /// What ending the claimant of `job` would do to it.
    fn outcome(job: &MJob) -> JobOutcome {
        if job.recovers() {
            JobOutcome::Recovered {
                recovery_count: job.recovery_count + 1,
            }
        } else if job.idempotent {
            JobOutcome::Failed {
                reason: REASON_MAX_RECOVERIES.into(),
            }
        } else {
            JobOutcome::Failed {
                reason: REASON_NOT_IDEMPOTENT.into(),
            }
        }
    }

    /// Ends a present session and everything it holds, in one change set: its locks are
    /// released, its seats reclaimed and its jobs recovered or failed.
    fn finish(&mut self, id: SessionId, reason: EndReason) -> Ended {
        let session = self
            .sessions
            .remove(&id)
            .expect("the model only finishes present sessions");
        let revision = self.next_revision();
        let released = self.locks_of(id);
        self.locks.retain(|_, l| l.session != id);
        let mut seats = Vec::new();
        for (name, pool) in &mut self.pools {
            if let Some(seat) = pool.holders.remove(&id) {
                seats.push((name.clone(), Token(seat.token)));
            }
        }
        let wall = self.wall().0;
        let mut jobs = Vec::new();
        for job_id in self.follow.jobs(id, session.claims) {
            let job = self.jobs.get_mut(&job_id).expect("claimed jobs exist");
            let outcome = Model::outcome(job);
            job.updated_at = wall;
            match &outcome {
                JobOutcome::Recovered { recovery_count } => {
                    job.recovery_count = *recovery_count;
                    job.status = JobStatus::Queued;
                    self.push_head(job_id);
                }
                JobOutcome::Failed { reason } => {
                    job.status = JobStatus::Failed {
                        reason: reason.clone(),
                    };
                }
            }
            jobs.push((job_id, outcome));
        }
        // One event per seat and per job, then the end's own.
        self.events(seats.len() + jobs.len() + 1);
        self.ended.push(id);
        Ended {
            id,
            reason,
            released: released.into(),
            seats,
            jobs,
            revision,
        }
    }

    /// Ends a session found past its deadline, as a side effect of another operation.
    fn end_inline(&mut self, id: SessionId) {
        let ended = self.finish(id, EndReason::Expired);
        self.inline.push(ended);
    }

    /// Whether the caller is alive; one that is present but past its deadline is ended.
    fn caller(&mut self, id: SessionId) -> bool {
        match self.sessions.get(&id) {
            None => false,
            Some(s) if self.now >= s.deadline => {
                self.end_inline(id);
                false
            }
            Some(_) => true,
        }
    }

    /// Ends, in the state's order, every holder of `pool` past its deadline.
    fn end_expired_holders(&mut self, pool: &PoolName) {
        let holders = self.pools[pool].holders.keys();
        let expired: Vec<SessionId> = holders.filter(|h| !self.alive(**h)).copied().collect();
        for holder in self.follow.sessions(expired) {
            self.end_inline(holder);
        }
    }

    fn open(
        &mut self,
        slot: usize,
        id: SessionId,
        ttl_ms: Option<u64>,
    ) -> Result<Opened, &'static str> {
        self.opens += 1;
        let ttl_ms = ttl_ms.unwrap_or(LIMITS.default_ttl_ms);
        if !(LIMITS.min_ttl_ms..=LIMITS.max_ttl_ms).contains(&ttl_ms) {
            return Err("ttl_ms");
        }
        let revision = self.mutation();
        let deadline = self.now + ttl_ms;
        let session = MSession {
            ttl_ms,
            deadline,
            claims: Vec::new(),
        };
        self.sessions.insert(id, session);
        self.slots[slot] = Some(id);
        Ok(Opened {
            revision,
            deadline: Mono(deadline),
            ttl_ms,
        })
    }

    /// The beat, and whether the TTL changed (and so must be persisted). A session past its
    /// deadline is gone, whatever the TTL asked for.
    fn heartbeat(
        &mut self,
        id: SessionId,
        ttl_ms: Option<u64>,
    ) -> Result<(Beat, bool), HeartbeatError> {
        if !self.caller(id) {
            return Err(HeartbeatError::Gone);
        }
        if let Some(t) = ttl_ms
            && !(LIMITS.min_ttl_ms..=LIMITS.max_ttl_ms).contains(&t)
        {
            return Err(HeartbeatError::Invalid(InvalidInput::new("ttl_ms", "")));
        }
        let now = self.now;
        let session = self.sessions.get_mut(&id).expect("alive");
        let changed = ttl_ms.is_some_and(|t| t != session.ttl_ms);
        session.ttl_ms = ttl_ms.unwrap_or(session.ttl_ms);
        session.deadline = now + session.ttl_ms;
        let beat = Beat {
            deadline: Mono(session.deadline),
            ttl_ms: session.ttl_ms,
        };
        Ok((beat, changed))
    }

    fn end(&mut self, id: SessionId, reason: EndReason) -> Option<Ended> {
        let deadline = self.sessions.get(&id)?.deadline;
        // A close that comes after the deadline is recorded as the expiry it was.
        let reason = if reason == EndReason::Closed && self.now >= deadline {
            EndReason::Expired
        } else {
            reason
        };
        Some(self.finish(id, reason))
    }

    fn acquire(&mut self, id: SessionId, key: &LockKey) -> Result<Acquired, AcquireError> {
        if !self.caller(id) {
            return Err(AcquireError::SessionGone);
        }
        if let Some(lock) = self.locks.get(key).cloned() {
            if lock.session == id {
                return Ok(Acquired {
                    token: Token(lock.token),
                    revision: self.revision,
                    fresh: false,
                });
            }
            if self.alive(lock.session) {
                return Err(AcquireError::Held {
                    holder: lock.session,
                    token: Token(lock.token),
                });
            }
            self.end_inline(lock.session);
        }
        let held = self.locks.values().filter(|l| l.session == id).count();
        if held >= self.max_locks {
            return Err(AcquireError::TooManyLocks(held));
        }
        let revision = self.mutation();
        let lock = MLock {
            session: id,
            token: revision,
            acquired_at: self.wall().0,
        };
        self.locks.insert(key.clone(), lock);
        self.grants.push((key.clone(), id, Token(revision)));
        Ok(Acquired {
            token: Token(revision),
            revision,
            fresh: true,
        })
    }

    fn release(&mut self, id: SessionId, key: &LockKey, token: Token) -> Result<u64, NotHolder> {
        if !self.caller(id) {
            return Err(NotHolder);
        }
        match self.locks.get(key) {
            Some(l) if l.session == id && l.token == token.0 => {}
            _ => return Err(NotHolder),
        }
        self.locks.remove(key);
        Ok(self.mutation())
    }

    fn put_pool(
        &mut self,
        name: &PoolName,
        capacity: u64,
        created_at: Option<UnixMs>,
    ) -> Result<PoolPut, InvalidInput> {
        if !(1..=MAX_CAPACITY).contains(&capacity) {
            return Err(InvalidInput::new("capacity", ""));
        }
        let created_at = created_at.unwrap_or(self.wall()).0;
        let created = !self.pools.contains_key(name);
        let pool = self.pools.entry(name.clone()).or_insert_with(|| MPool {
            capacity: 0,
            created_at,
            holders: BTreeMap::new(),
        });
        // Shrinking takes no seat away.
        pool.capacity = capacity as u32;
        pool.created_at = created_at;
        let revision = self.mutation();
        Ok(PoolPut { revision, created })
    }

    fn delete_pool(&mut self, name: &PoolName) -> Result<u64, PoolError> {
        if !self.pools.contains_key(name) {
            return Err(PoolError::NotFound);
        }
        // Seats of sessions past their deadline do not keep a pool alive.
        self.end_expired_holders(name);
        let in_use = self.pools[name].holders.len();
        if in_use > 0 {
            return Err(PoolError::InUse(in_use));
        }
        self.pools.remove(name);
        Ok(self.mutation())
    }

    fn acquire_seat(
        &mut self,
        id: SessionId,
        name: &PoolName,
        metadata: &str,
    ) -> Result<SeatGrant, SeatError> {
        if !metadata.is_empty() && !metadata.starts_with('{') {
            return Err(SeatError::Invalid(InvalidInput::new("metadata", "")));
        }
        if !self.pools.contains_key(name) {
            return Err(SeatError::PoolNotFound);
        }
        if !self.caller(id) {
            return Err(SeatError::SessionGone);
        }
        if let Some(seat) = self.pools[name].holders.get(&id) {
            return Ok(SeatGrant {
                token: Token(seat.token),
                revision: self.revision,
                fresh: false,
            });
        }
        if !self.pools[name].has_room() {
            self.end_expired_holders(name);
            let pool = &self.pools[name];
            if !pool.has_room() {
                return Err(SeatError::Exhausted {
                    capacity: pool.capacity,
                    in_use: pool.holders.len(),
                });
            }
        }
        let revision = self.mutation();
        let seat = MSeat {
            token: revision,
            acquired_at: self.wall().0,
            metadata: metadata.to_string(),
        };
        let pool = self.pools.get_mut(name).expect("checked above");
        pool.holders.insert(id, seat);
        self.seat_grants.push((name.clone(), id, Token(revision)));
        Ok(SeatGrant {
            token: Token(revision),
            revision,
            fresh: true,
        })
    }

    fn release_seat(
        &mut self,
        id: SessionId,
        name: &PoolName,
        token: Token,
    ) -> Result<u64, PoolError> {
        if !self.pools.contains_key(name) {
            return Err(PoolError::NotFound);
        }
        if !self.caller(id) {
            return Err(PoolError::NotHolder);
        }
        let pool = self.pools.get_mut(name).expect("checked above");
        match pool.holders.get(&id) {
            Some(seat) if seat.token == token.0 => {}
            _ => return Err(PoolError::NotHolder),
        }
        pool.holders.remove(&id);
        Ok(self.mutation())
    }

    fn enqueue(
        &mut self,
        id: JobId,
        queue: &QueueName,
        idempotent: bool,
        max_recoveries: Option<u32>,
        kind: Option<String>,
    ) -> Result<u64, InvalidInput> {
        self.enqueues += 1;
        let max_recoveries = max_recoveries.unwrap_or(DEFAULT_MAX_RECOVERIES);
        if max_recoveries > MAX_RECOVERIES {
            return Err(InvalidInput::new("max_recoveries", ""));
        }
        let kind = kind.unwrap_or_default();
        if kind.chars().any(char::is_control) {
            return Err(InvalidInput::new("kind", ""));
        }
        let job = MJob {
            queue: queue.clone(),
            kind,
            idempotent,
            max_recoveries,
            recovery_count: 0,
            attempt: 0,
            status: JobStatus::Queued,
            enqueued_at: self.wall().0,
            updated_at: self.wall().0,
        };
        self.jobs.insert(id, job);
        self.queued.entry(queue.clone()).or_default().push_back(id);
        self.made.push(id);
        Ok(self.mutation())
    }

    fn claim(&mut self, id: SessionId, queue: &QueueName) -> Result<Option<Claim>, ClaimGone> {
        if !self.caller(id) {
            return Err(ClaimGone);
        }
        let Some(job_id) = self.queued.get_mut(queue).and_then(VecDeque::pop_front) else {
            return Ok(None);
        };
        let revision = self.mutation();
        let token = Token(revision);
        let wall = self.wall().0;
        let job = self.jobs.get_mut(&job_id).expect("queued jobs exist");
        job.attempt += 1;
        job.status = JobStatus::Claimed {
            session_id: id,
            token,
            claimed_at: UnixMs(wall),
        };
        job.updated_at = wall;
        let claim = Claim {
            job: job_id,
            token,
            attempt: job.attempt,
            recovery_count: job.recovery_count,
            kind: job.kind.clone(),
            revision,
        };
        let session = self.sessions.get_mut(&id).expect("alive");
        session.claims.push(job_id);
        self.claims.push((job_id, id, token));
        Ok(Some(claim))
    }

    fn finish_job(
        &mut self,
        id: SessionId,
        job_id: JobId,
        token: Token,
        finish: &Finish,
    ) -> Result<u64, JobError> {
        if !self.jobs.contains_key(&job_id) {
            return Err(JobError::NotFound);
        }
        let live = self.caller(id);
        let current = Model::claimant(&self.jobs[&job_id]) == Some((id, token));
        if !(live && current) {
            return Err(JobError::StaleToken);
        }
        let session = self.sessions.get_mut(&id).expect("alive");
        session.claims.retain(|j| *j != job_id);
        let revision = self.mutation();
        let wall = self.wall().0;
        let job = self.jobs.get_mut(&job_id).expect("checked above");
        job.updated_at = wall;
        job.status = match finish {
            Finish::Complete { result } => JobStatus::Done {
                result: result.clone(),
            },
            Finish::Fail { reason } => JobStatus::Failed {
                reason: reason.clone(),
            },
            // Back to the head, no recovery counted.
            Finish::Release => JobStatus::Queued,
        };
        if *finish == Finish::Release {
            self.push_head(job_id);
        }
        Ok(revision)
    }

    fn requeue(&mut self, job_id: JobId) -> Result<u64, JobError> {
        let wall = self.wall().0;
        let job = self.jobs.get_mut(&job_id).ok_or(JobError::NotFound)?;
        if !matches!(job.status, JobStatus::Failed { .. }) {
            return Err(JobError::NotFailed);
        }
        job.status = JobStatus::Queued;
        job.recovery_count = 0;
        job.updated_at = wall;
        let queue = job.queue.clone();
        self.queued.entry(queue).or_default().push_back(job_id);
        Ok(self.mutation())
    }

    /// Finished jobs that a purge of those finished before `before` may take, oldest first.
    fn purgeable(&self, before: UnixMs) -> Vec<(u64, JobId)> {
        let mut due: Vec<_> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.finished() && j.updated_at < before.0)
            .map(|(id, j)| (j.updated_at, *id))
            .collect();
        due.sort();
        due
    }

    /// Purges write no audit event and take no revision.
    fn purge(&mut self, ids: &[JobId]) {
        for id in ids {
            let job = self.jobs.remove(id).expect("purged jobs exist");
            assert!(job.finished(), "the model purges finished jobs only");
        }
    }

    /// Applies a transition; where the rules leave an order open it takes the one in
    /// `follow` (the harness's), and otherwise ids and claims in ascending order.
    fn step(&mut self, transition: &Transition) {
        match transition {
            Transition::Open { slot, id, ttl_ms } => {
                let _ = self.open(*slot, *id, *ttl_ms);
            }
            Transition::Heartbeat { id, ttl_ms } => {
                let _ = self.heartbeat(*id, *ttl_ms);
            }
            Transition::End { id, reason } => {
                self.end(*id, *reason);
            }
            Transition::Acquire { id, key } => {
                let _ = self.acquire(*id, key);
            }
            Transition::Release { id, key, token } => {
                let _ = self.release(*id, key, *token);
            }
            Transition::Advance { ms } => self.now += ms,
            Transition::Reap { limit } => {
                for (_, id) in self.due().into_iter().take(*limit) {
                    self.finish(id, EndReason::Expired);
                }
            }
            Transition::PutPool {
                pool,
                capacity,
                created_at,
            } => {
                let _ = self.put_pool(pool, *capacity, *created_at);
            }
            Transition::DeletePool { pool } => {
                let _ = self.delete_pool(pool);
            }
            Transition::AcquireSeat { id, pool, metadata } => {
                let _ = self.acquire_seat(*id, pool, metadata);
            }
            Transition::ReleaseSeat { id, pool, token } => {
                let _ = self.release_seat(*id, pool, *token);
            }
            Transition::Enqueue {
                job,
                queue,
                idempotent,
                max_recoveries,
                kind,
            } => {
                let _ = self.enqueue(*job, queue, *idempotent, *max_recoveries, kind.clone());
            }
            Transition::Claim { id, queue } => {
                let _ = self.claim(*id, queue);
            }
            Transition::FinishJob {
                id,
                job,
                token,
                finish,
            } => {
                let _ = self.finish_job(*id, *job, *token, finish);
            }
            Transition::Requeue { job } => {
                let _ = self.requeue(*job);
            }
            Transition::Purge { age_ms, limit } => {
                let before = UnixMs(self.wall().0 - age_ms);
                let due = self.purgeable(before).into_iter().take(*limit);
                let ids: Vec<JobId> = due.map(|(_, id)| id).collect();
                self.purge(&ids);
            }
        }
        self.inline.clear();
        self.follow = Follow::default();
    }

    /// Counts of `queue`'s jobs by state.
    fn counts(&self, queue: &QueueName) -> QueueCounts {
        let mut counts = QueueCounts::default();
        for job in self.jobs.values().filter(|j| j.queue == *queue) {
            match job.status {
                JobStatus::Queued => counts.queued += 1,
                JobStatus::Claimed { .. } => counts.claimed += 1,
                JobStatus::Done { .. } => counts.done += 1,
                JobStatus::Failed { .. } => counts.failed += 1,
            }
        }
        counts
    }

    /// The record the store should hold for `job`, but for its `order`, which is the state's
    /// business (the harness checks the order it gives separately).
    fn record(job: &MJob) -> JobRecord {
        JobRecord {
            queue: job.queue.to_string(),
            kind: job.kind.clone(),
            idempotent: job.idempotent,
            max_recoveries: job.max_recoveries,
            recovery_count: job.recovery_count,
            attempt: job.attempt,
            order: 0,
            status: job.status.clone(),
            enqueued_at: UnixMs(job.enqueued_at),
            updated_at: UnixMs(job.updated_at),
        }
    }
}

/// Session ids to act on: mostly the slots' live sessions, sometimes one still present but
/// past its deadline, a slot's ended one, one that ended long ago, or one never opened.
fn pick_id(model: &Model) -> BoxedStrategy<SessionId> {
    let never_opened = any::<u128>()
        .prop_map(|n| SessionId::from_u128(n | 1))
        .boxed();
    let mut choices = vec![(1, never_opened)];
    let mut live = Vec::new();
    let mut due = Vec::new();
    let mut ended = Vec::new();
    for id in model.slots.iter().flatten() {
        match model.sessions.get(id) {
            Some(_) if model.alive(*id) => live.push(*id),
            Some(_) => due.push(*id),
            None => ended.push(*id),
        }
    }
    for (weight, ids) in [(20, live), (3, due), (2, ended), (1, model.ended.clone())] {
        if !ids.is_empty() {
            choices.push((weight, select(ids).boxed()));
        }
    }
    Union::new_weighted(choices).boxed()
}

/// Who acquires what: mostly anyone anything, sometimes a session at its lock limit, or a
/// key whose holder is past its deadline (and so is ended inline for the caller).
fn pick_acquire(model: &Model, ids: BoxedStrategy<SessionId>) -> BoxedStrategy<Transition> {
    let mut held = BTreeMap::<SessionId, usize>::new();
    for l in model.locks.values() {
        *held.entry(l.session).or_default() += 1;
    }
    let full: Vec<SessionId> = held
        .iter()
        .filter(|(id, n)| **n >= model.max_locks && model.alive(**id))
        .map(|(id, _)| *id)
        .collect();
    let lost: Vec<LockKey> = model
        .locks
        .iter()
        .filter(|(_, l)| !model.alive(l.session))
        .map(|(k, _)| k.clone())
        .collect();
    let mut who = vec![(3, ids)];
    if !held.is_empty() {
        who.push((2, select(held.into_keys().collect::<Vec<_>>()).boxed()));
    }
    if !full.is_empty() {
        who.push((3, select(full).boxed()));
    }
    let mut what = vec![(2, pick_key())];
    if !lost.is_empty() {
        what.push((3, select(lost).boxed()));
    }
    (Union::new_weighted(who), Union::new_weighted(what))
        .prop_map(|(id, key)| Transition::Acquire { id, key })
        .boxed()
}

/// One of `names`, mostly among those in `likely` (pools that exist, queues with a job).
fn pick_name(names: &[&'static str], likely: Vec<LockKey>) -> BoxedStrategy<LockKey> {
    let any = select(names.to_vec()).prop_map(key).boxed();
    if likely.is_empty() {
        return any;
    }
    Union::new_weighted(vec![(1, any), (5, select(likely).boxed())]).boxed()
}

fn pick_key() -> BoxedStrategy<LockKey> {
    select(KEYS.to_vec()).prop_map(key).boxed()
}

fn pick_pool() -> BoxedStrategy<PoolName> {
    select(POOLS.to_vec()).prop_map(key).boxed()
}

fn pick_queue() -> BoxedStrategy<QueueName> {
    select(QUEUES.to_vec()).prop_map(key).boxed()
}

/// Job ids to act on: mostly one ever enqueued (purged or not), sometimes one never enqueued.
fn pick_job(model: &Model) -> BoxedStrategy<JobId> {
    let never_made = any::<u128>().prop_map(|n| JobId::from_u128(n | 1)).boxed();
    let mut choices = vec![(1, never_made)];
    if !model.made.is_empty() {
        choices.push((6, select(model.made.clone()).boxed()));
    }
    Union::new_weighted(choices).boxed()
}

/// A token off the right one: the session, or the token one below or above. Or the grant as
/// it was made: right while it stands, stale once it has been given back or lost.
fn twist(twist: u8, holder: SessionId, token: Token, other: SessionId) -> (SessionId, Token) {
    match twist {
        0 => (other, token),
        1 => (holder, Token(token.0 - 1)),
        2 => (holder, Token(token.0 + 1)),
        _ => (holder, token),
    }
}

/// Releases: mostly by the holder with its token, sometimes a stale grant, a token off by
/// one, the wrong session, or something random.
fn pick_release(model: &Model, ids: BoxedStrategy<SessionId>) -> BoxedStrategy<Transition> {
    let random = (ids.clone(), pick_key(), 0..=model.revision + 1)
        .prop_map(|(id, key, token)| Transition::Release {
            id,
            key,
            token: Token(token),
        })
        .boxed();
    let mut choices = vec![(1, random)];
    let held: Vec<(LockKey, SessionId, Token)> = model
        .locks
        .iter()
        .map(|(k, l)| (k.clone(), l.session, Token(l.token)))
        .collect();
    if !held.is_empty() {
        let right = select(held)
            .prop_map(|(key, id, token)| Transition::Release { id, key, token })
            .boxed();
        choices.push((6, right));
    }
    if !model.grants.is_empty() {
        let twisted = (select(model.grants.clone()), 0..4u8, ids)
            .prop_map(|((key, holder, token), n, other)| {
                let (id, token) = twist(n, holder, token, other);
                Transition::Release { id, key, token }
            })
            .boxed();
        choices.push((3, twisted));
    }
    Union::new_weighted(choices).boxed()
}

/// Seat releases, picked like lock releases.
fn pick_seat_release(model: &Model, ids: BoxedStrategy<SessionId>) -> BoxedStrategy<Transition> {
    let random = (ids.clone(), pick_pool(), 0..=model.revision + 1)
        .prop_map(|(id, pool, token)| Transition::ReleaseSeat {
            id,
            pool,
            token: Token(token),
        })
        .boxed();
    let mut choices = vec![(1, random)];
    let held: Vec<(PoolName, SessionId, Token)> = model
        .pools
        .iter()
        .flat_map(|(name, p)| {
            let seats = p.holders.iter();
            seats.map(|(s, seat)| (name.clone(), *s, Token(seat.token)))
        })
        .collect();
    if !held.is_empty() {
        let right = select(held)
            .prop_map(|(pool, id, token)| Transition::ReleaseSeat { id, pool, token })
            .boxed();
        choices.push((6, right));
    }
    if !model.seat_grants.is_empty() {
        let twisted = (select(model.seat_grants.clone()), 0..4u8, ids)
            .prop_map(|((pool, holder, token), n, other)| {
                let (id, token) = twist(n, holder, token, other);
                Transition::ReleaseSeat { id, pool, token }
            })
            .boxed();
        choices.push((3, twisted));
    }
    Union::new_weighted(choices).boxed()
}

/// Finishing jobs: mostly the current claim, sometimes a claim twisted or stale, or anything.
fn pick_finish(model: &Model, ids: BoxedStrategy<SessionId>) -> BoxedStrategy<Transition> {
    let how = || {
        prop_oneof![
            3 => Just(Finish::Complete { result: RESULT.into() }),
            2 => Just(Finish::Fail { reason: WORKER_REASON.into() }),
            2 => Just(Finish::Release),
        ]
    };
    let random = (ids.clone(), pick_job(model), 0..=model.revision + 1, how())
        .prop_map(|(id, job, token, finish)| Transition::FinishJob {
            id,
            job,
            token: Token(token),
            finish,
        })
        .boxed();
    let mut choices = vec![(1, random)];
    let current: Vec<(JobId, SessionId, Token)> = model
        .jobs
        .iter()
        .filter_map(|(job, j)| Model::claimant(j).map(|(s, t)| (*job, s, t)))
        .collect();
    if !current.is_empty() {
        let right = (select(current), how())
            .prop_map(|((job, id, token), finish)| Transition::FinishJob {
                id,
                job,
                token,
                finish,
            })
            .boxed();
        choices.push((6, right));
    }
    if !model.claims.is_empty() {
        let twisted = (select(model.claims.clone()), 0..4u8, ids, how())
            .prop_map(|((job, holder, token), n, other, finish)| {
                let (id, token) = twist(n, holder, token, other);
                Transition::FinishJob {
                    id,
                    job,
                    token,
                    finish,
                }
            })
            .boxed();
        choices.push((3, twisted));
    }
    Union::new_weighted(choices).boxed()
}

/// Requeues: mostly a failed job, sometimes any job, ever enqueued or not.
fn pick_requeue(model: &Model) -> BoxedStrategy<Transition> {
    let failed: Vec<JobId> = model
        .jobs
        .iter()
        .filter(|(_, j)| matches!(j.status, JobStatus::Failed { .. }))
        .map(|(id, _)| *id)
        .collect();
    let mut choices = vec![(1, pick_job(model))];
    if !failed.is_empty() {
        choices.push((4, select(failed).boxed()));
    }
    Union::new_weighted(choices)
        .prop_map(|job| Transition::Requeue { job })
        .boxed()
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        select(MAX_LOCKS.to_vec())
            .prop_map(|max_locks| Model {
                max_locks,
                ..Model::default()
            })
            .boxed()
    }

    fn transitions(model: &Model) -> BoxedStrategy<Transition> {
        let ids = pick_id(model);
        let id = opened_id(model.opens);
        let job = job_id(model.enqueues);
        let open_ttl = prop_oneof![
            16 => select(TTLS.to_vec()).prop_map(Some),
            1 => Just(None),
            1 => Just(Some(LIMITS.min_ttl_ms - 1)),
        ];
        let beat_ttl = prop_oneof![
            6 => Just(None),
            4 => select(TTLS.to_vec()).prop_map(Some),
            1 => Just(Some(LIMITS.min_ttl_ms - 1)),
        ];
        let reason = prop_oneof![3 => Just(EndReason::Closed), 1 => Just(EndReason::Admin)];
        // Sometimes exactly onto a live session's deadline: it and every session due with it
        // expire together, while those due later live on.
        let ahead: Vec<u64> = model
            .sessions
            .values()
            .filter(|s| s.deadline > model.now)
            .map(|s| s.deadline - model.now)
            .collect();
        let onto_deadline = if ahead.is_empty() {
            Just(250).boxed()
        } else {
            select(ahead).boxed()
        };
        let clock_step = prop_oneof![
            4 => (0..8u64).prop_map(|n| n * 250),
            1 => 0..3_000u64,
            1 => 0..3u64,
            2 => onto_deadline,
        ];
        let capacity = prop_oneof![20 => 1..=3u64, 1 => Just(0u64)];
        let created_at = prop_oneof![3 => Just(None), 1 => Just(Some(UnixMs(WALL0 - 1)))];
        let metadata = prop_oneof![
            12 => Just(String::new()),
            4 => Just(r#"{"host":"h1"}"#.to_string()),
            1 => Just("[1]".to_string()),
        ];
        let max_recoveries = prop_oneof![
            24 => (0..=2u32).prop_map(Some),
            2 => Just(None),
            1 => Just(Some(MAX_RECOVERIES + 1)),
        ];
        let kind = prop_oneof![
            12 => Just(None),
            6 => Just(Some("build".to_string())),
            1 => Just(Some("bad\u{7}kind".to_string())),
        ];
        let purge_age = select(vec![0u64, 250, 1_000, 5_000]);
        // Open eagerly while few sessions are present, so that there is something to race;
        // make pools while there are none, so that there are seats to race for.
        let live = model.sessions.keys().filter(|id| model.alive(**id)).count();
        let open_weight = match live {
            0 => 30,
            1 | 2 => 8,
            _ => 3,
        };
        let pool_weight = if model.pools.is_empty() { 8 } else { 2 };
        let pools = pick_name(&POOLS, model.pools.keys().cloned().collect());
        let full = model
            .pools
            .iter()
            .filter(|(_, p)| !p.has_room() && p.capacity > 1);
        let full: Vec<PoolName> = full.map(|(n, _)| n.clone()).collect();
        let pools = if full.is_empty() {
            pools
        } else {
            Union::new_weighted(vec![(3, pools), (1, select(full).boxed())]).boxed()
        };
        let with_jobs = model.queued.iter().filter(|(_, q)| !q.is_empty());
        let queues = pick_name(&QUEUES, with_jobs.map(|(q, _)| q.clone()).collect());
        // While a lock or a full pool's seat is held by a session past its deadline, contend
        // for it: a contender ends such holders inline, and that window is short.
        let lost_lock = model.locks.values().any(|l| !model.alive(l.session));
        let acquire_weight = if lost_lock { 10 } else { 4 };
        let lost_seat = model
            .pools
            .values()
            .any(|p| !p.has_room() && p.holders.keys().any(|h| !model.alive(*h)));
        let seat_weight = if lost_seat { 10 } else { 5 };
        let claimed = model.jobs.values().any(|j| Model::claimant(j).is_some());
        let finish_weight = if claimed { 6 } else { 1 };
        prop_oneof![
            open_weight => (0..SLOTS, open_ttl)
                .prop_map(move |(slot, ttl_ms)| Transition::Open { slot, id, ttl_ms }),
            3 => (ids.clone(), beat_ttl)
                .prop_map(|(id, ttl_ms)| Transition::Heartbeat { id, ttl_ms }),
            2 => (ids.clone(), reason).prop_map(|(id, reason)| Transition::End { id, reason }),
            acquire_weight => pick_acquire(model, ids.clone()),
            3 => pick_release(model, ids.clone()),
            4 => clock_step.prop_map(|ms| Transition::Advance { ms }),
            2 => (1..=3usize).prop_map(|limit| Transition::Reap { limit }),
            pool_weight => (pick_pool(), capacity, created_at).prop_map(
                |(pool, capacity, created_at)| Transition::PutPool {
                    pool,
                    capacity,
                    created_at,
                }
            ),
            1 => pick_pool().prop_map(|pool| Transition::DeletePool { pool }),
            seat_weight => (ids.clone(), pools, metadata).prop_map(|(id, pool, metadata)| {
                Transition::AcquireSeat { id, pool, metadata }
            }),
            3 => pick_seat_release(model, ids.clone()),
            3 => (pick_queue(), any::<bool>(), max_recoveries, kind).prop_map(
                move |(queue, idempotent, max_recoveries, kind)| Transition::Enqueue {
                    job,
                    queue,
                    idempotent,
                    max_recoveries,
                    kind,
                }
            ),
            4 => (ids.clone(), queues).prop_map(|(id, queue)| Transition::Claim { id, queue }),
            finish_weight => pick_finish(model, ids),
            1 => pick_requeue(model),
            1 => (purge_age, 1..=3usize).prop_map(|(age_ms, limit)| Transition::Purge {
                age_ms,
                limit
            }),
        ]
        .boxed()
    }

    fn apply(mut model: Model, transition: &Transition) -> Model {
        model.step(transition);
        model
    }
}

/// A record change awaiting the audit event that accounts for it.
#[derive(Debug)]
enum Fact {
    Opened(SessionId),
    LockPut(LockKey, LockRecord),
    LockDeleted(LockKey, SessionId, Token),
    SessionDeleted(SessionId),
    PoolPut(PoolName, u32),
    PoolDeleted(PoolName),
    SeatPut(PoolName, SessionId, Token),
    SeatDeleted(PoolName, SessionId, Token),
    JobPut {
        id: JobId,
        before: Option<Box<JobRecord>>,
        after: Box<JobRecord>,
    },
}

/// What an end settled before its own event: a seat taken back or a job recovered or failed.
#[derive(Debug)]
enum Settled {
    Seat(SessionId, PoolName, Token, EndReason),
    Job(SessionId, JobId, JobOutcome),
}

/// A session's end as its events tell it, or as `Ended` reports it.
#[derive(Debug, PartialEq)]
struct EndStory {
    id: SessionId,
    reason: EndReason,
    released: Vec<(String, Token)>,
    seats: Vec<(String, Token)>,
    jobs: Vec<(JobId, JobOutcome)>,
}

impl EndStory {
    fn of(e: &Ended) -> EndStory {
        let named = |grants: &[(LockKey, Token)]| {
            let grants = grants.iter();
            grants.map(|(k, t)| (k.to_string(), *t)).collect()
        };
        EndStory {
            id: e.id,
            reason: e.reason,
            released: named(&e.released),
            seats: named(&e.seats),
            jobs: e.jobs.clone(),
        }
    }
}

/// The one record change a plain event accounts for.
fn only(facts: &mut Vec<Fact>, settled: &[Settled], kind: EventKind) -> Fact {
    assert!(settled.is_empty(), "{kind:?} inside an end: {settled:?}");
    assert_eq!(
        facts.len(),
        1,
        "{kind:?} must account for one change: {facts:?}"
    );
    facts.pop().expect("one")
}

/// The last record change, for an event of an end's cascade: what came before it in the same
/// end can only be the locks it released (accounted for by the end's own event).
fn in_cascade(facts: &mut Vec<Fact>, kind: EventKind) -> Fact {
    let fact = facts.pop();
    let fact = fact.unwrap_or_else(|| panic!("{kind:?} accounts for no change"));
    for f in facts.iter() {
        assert!(matches!(f, Fact::LockDeleted(..)), "{f:?} before {kind:?}");
    }
    fact
}

/// What the store would hold after writing every change set, validated change by change.
#[derive(Default)]
struct Store {
    sessions: BTreeMap<SessionId, u64>,
    locks: BTreeMap<LockKey, LockRecord>,
    pools: BTreeMap<PoolName, PoolRecord>,
    seats: BTreeMap<(PoolName, SessionId), SeatRecord>,
    jobs: BTreeMap<JobId, JobRecord>,
    payloads: BTreeMap<JobId, String>,
    event_seq: u64,
    max_token: u64,
    ever: BTreeSet<SessionId>,
    ever_jobs: BTreeSet<JobId>,
}

impl Store {
    fn grant_token(&mut self, token: Token) {
        assert!(token.0 > self.max_token, "token {token:?} does not grow");
        self.max_token = token.0;
    }

    /// Writes one step's changes; `ended` is every session the step reported ended.
    fn write(&mut self, out: &[Change], wall: UnixMs, ended: &[Ended]) {
        let mut facts = Vec::new();
        let mut settled = Vec::new();
        let mut stories = Vec::new();
        for change in out {
            match change {
                Change::PutSession { id, record } => {
                    assert!(self.ever.insert(*id), "session id {id} written twice");
                    assert_eq!(record.owner, OWNER);
                    assert_eq!(record.created_at, wall);
                    assert_eq!(record.metadata, "");
                    self.sessions.insert(*id, record.ttl_ms);
                    facts.push(Fact::Opened(*id));
                }
                Change::SetSessionTtl { id, ttl_ms } => {
                    let stored = self.sessions.get_mut(id);
                    *stored.unwrap_or_else(|| panic!("TTL set on unknown session {id}")) = *ttl_ms;
                }
                Change::DeleteSession { id } => {
                    assert!(
                        self.sessions.remove(id).is_some(),
                        "deleted unknown session {id}"
                    );
                    assert!(
                        self.locks.values().all(|l| l.session_id != *id),
                        "session {id} deleted while its locks remain"
                    );
                    assert!(
                        self.seats.keys().all(|(_, s)| s != id),
                        "session {id} deleted while its seats remain"
                    );
                    assert!(
                        self.jobs.values().all(|j| !matches!(
                            j.status,
                            JobStatus::Claimed { session_id, .. } if session_id == *id
                        )),
                        "session {id} deleted while it holds jobs"
                    );
                    facts.push(Fact::SessionDeleted(*id));
                }
                Change::PutLock { key, record } => {
                    assert!(
                        self.sessions.contains_key(&record.session_id),
                        "lock for unknown session"
                    );
                    self.grant_token(record.token);
                    assert_eq!(record.acquired_at, wall);
                    let before = self.locks.insert(key.clone(), record.clone());
                    assert!(
                        before.is_none(),
                        "lock {key} written while held: {before:?}"
                    );
                    facts.push(Fact::LockPut(key.clone(), record.clone()));
                }
                Change::DeleteLock { key, session_id } => {
                    let record = self.locks.remove(key);
                    let record = record.unwrap_or_else(|| panic!("DeleteLock of free lock {key}"));
                    assert_eq!(
                        record.session_id, *session_id,
                        "DeleteLock names the wrong holder"
                    );
                    facts.push(Fact::LockDeleted(key.clone(), *session_id, record.token));
                }
                Change::PutPool { name, record } => {
                    assert_eq!(record.metadata, "");
                    self.pools.insert(name.clone(), record.clone());
                    facts.push(Fact::PoolPut(name.clone(), record.capacity));
                }
                Change::DeletePool { name } => {
                    assert!(
                        self.pools.remove(name).is_some(),
                        "deleted unknown pool {name}"
                    );
                    assert!(
                        self.seats.keys().all(|(p, _)| p != name),
                        "pool {name} deleted while seats in it remain"
                    );
                    facts.push(Fact::PoolDeleted(name.clone()));
                }
                Change::PutSeat {
                    pool,
                    session_id,
                    record,
                } => {
                    assert!(self.pools.contains_key(pool), "seat in unknown pool {pool}");
                    assert!(
                        self.sessions.contains_key(session_id),
                        "seat for unknown session"
                    );
                    self.grant_token(record.token);
                    assert_eq!(record.acquired_at, wall);
                    let before = self
                        .seats
                        .insert((pool.clone(), *session_id), record.clone());
                    assert!(before.is_none(), "second seat in {pool} for {session_id}");
                    facts.push(Fact::SeatPut(pool.clone(), *session_id, record.token));
                }
                Change::DeleteSeat { pool, session_id } => {
                    let record = self.seats.remove(&(pool.clone(), *session_id));
                    let record =
                        record.unwrap_or_else(|| panic!("DeleteSeat of no seat in {pool}"));
                    facts.push(Fact::SeatDeleted(pool.clone(), *session_id, record.token));
                }
                Change::PutJob {
                    id,
                    record,
                    payload,
                } => {
                    assert_eq!(record.updated_at, wall, "job {id} updated_at");
                    assert!(
                        record.recovery_count <= record.max_recoveries,
                        "job {id} recovered more than its cap"
                    );
                    let before = self.jobs.insert(*id, record.clone());
                    if let Some(p) = payload {
                        assert!(self.ever_jobs.insert(*id), "job id {id} written twice");
                        assert_eq!(record.enqueued_at, wall);
                        self.payloads.insert(*id, p.clone());
                    } else {
                        assert!(before.is_some(), "PutJob of unknown job {id}");
                    }
                    if let JobStatus::Claimed {
                        session_id,
                        token,
                        claimed_at,
                    } = &record.status
                    {
                        assert!(
                            self.sessions.contains_key(session_id),
                            "job {id} claimed by unknown session"
                        );
                        self.grant_token(*token);
                        assert_eq!(*claimed_at, wall);
                    }
                    facts.push(Fact::JobPut {
                        id: *id,
                        before: before.map(Box::new),
                        after: Box::new(record.clone()),
                    });
                }
                Change::DeleteJob { id, .. } => {
                    // The retention purge: no audit event accounts for it.
                    let record = self.jobs.remove(id);
                    let record = record.unwrap_or_else(|| panic!("purged unknown job {id}"));
                    assert!(
                        matches!(
                            record.status,
                            JobStatus::Done { .. } | JobStatus::Failed { .. }
                        ),
                        "purged unfinished job {id}"
                    );
                    self.payloads.remove(id);
                }
                Change::Event(event) => {
                    assert_eq!(event.seq, self.event_seq + 1, "event seq");
                    self.event_seq = event.seq;
                    let want = account(event, wall, &mut facts, &mut settled, &mut stories);
                    assert_eq!(event, &want, "event");
                }
                // Request ids are the writer's, remembered beside a domain step, never one.
                Change::PutRequest { .. } | Change::DeleteRequest { .. } => {
                    panic!("the domain wrote a request id: {change:?}")
                }
            }
        }
        assert!(
            facts.is_empty(),
            "record changes without an audit event: {facts:?}"
        );
        assert!(settled.is_empty(), "settled outside an end: {settled:?}");
        let reported: Vec<EndStory> = ended.iter().map(EndStory::of).collect();
        assert_eq!(stories, reported, "one end event per ended session");
    }
}

/// The event that should account for the pending record changes, given `event`'s kind.
fn account(
    event: &Event,
    wall: UnixMs,
    facts: &mut Vec<Fact>,
    settled: &mut Vec<Settled>,
    stories: &mut Vec<EndStory>,
) -> Event {
    let kind = event.kind;
    let mut want = Event::new(event.seq, wall, kind);
    let system_reason = matches!(
        event.detail.as_deref(),
        Some(REASON_MAX_RECOVERIES | REASON_NOT_IDEMPOTENT)
    );
    match kind {
        EventKind::SessionOpened => match only(facts, settled, kind) {
            Fact::Opened(id) => {
                want.session_id = Some(id);
                want.owner = Some(OWNER.into());
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::LockAcquired => match only(facts, settled, kind) {
            Fact::LockPut(key, record) => {
                want.session_id = Some(record.session_id);
                want.key = Some(key.to_string());
                want.token = Some(record.token);
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::LockReleased => match only(facts, settled, kind) {
            Fact::LockDeleted(key, id, token) => {
                want.session_id = Some(id);
                want.key = Some(key.to_string());
                want.token = Some(token);
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::PoolPut => match only(facts, settled, kind) {
            Fact::PoolPut(name, capacity) => {
                want.pool = Some(name.to_string());
                want.detail = Some(format!("capacity {capacity}"));
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::PoolDeleted => match only(facts, settled, kind) {
            Fact::PoolDeleted(name) => want.pool = Some(name.to_string()),
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::SeatAcquired => match only(facts, settled, kind) {
            Fact::SeatPut(pool, id, token) => {
                want.session_id = Some(id);
                want.pool = Some(pool.to_string());
                want.token = Some(token);
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::SeatReleased => match only(facts, settled, kind) {
            Fact::SeatDeleted(pool, id, token) => {
                want.session_id = Some(id);
                want.pool = Some(pool.to_string());
                want.token = Some(token);
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::SeatReclaimed => match in_cascade(facts, kind) {
            Fact::SeatDeleted(pool, id, token) => {
                let reason = event.reason.expect("a reclaimed seat says why");
                want.session_id = Some(id);
                want.pool = Some(pool.to_string());
                want.token = Some(token);
                want.reason = Some(reason);
                settled.push(Settled::Seat(id, pool, token, reason));
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::JobEnqueued => match only(facts, settled, kind) {
            Fact::JobPut {
                id,
                before: None,
                after,
            } => {
                assert_eq!(after.status, JobStatus::Queued, "enqueued {id}");
                assert_eq!((after.attempt, after.recovery_count), (0, 0));
                want.job_id = Some(id);
                want.queue = Some(after.queue);
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::JobClaimed => match only(facts, settled, kind) {
            Fact::JobPut {
                id,
                before: Some(before),
                after,
            } => {
                assert_eq!(before.status, JobStatus::Queued, "claimed {id}");
                assert_eq!(after.attempt, before.attempt + 1, "attempt of {id}");
                assert_eq!(after.recovery_count, before.recovery_count);
                let JobStatus::Claimed {
                    session_id, token, ..
                } = after.status
                else {
                    panic!("{kind:?} of {id} which is {:?}", after.status);
                };
                want.session_id = Some(session_id);
                want.token = Some(token);
                want.job_id = Some(id);
                want.queue = Some(after.queue);
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::JobCompleted
        | EventKind::JobReleased
        | EventKind::JobFailed
        | EventKind::JobRecovered => {
            let by_end = kind == EventKind::JobRecovered || system_reason;
            let fact = if by_end {
                in_cascade(facts, kind)
            } else {
                only(facts, settled, kind)
            };
            let Fact::JobPut {
                id,
                before: Some(before),
                after,
            } = fact
            else {
                panic!("{kind:?} does not account for {fact:?}");
            };
            let JobStatus::Claimed {
                session_id, token, ..
            } = before.status
            else {
                panic!("{kind:?} of {id} which was {:?}", before.status);
            };
            assert_eq!(after.attempt, before.attempt, "attempt of {id}");
            want.session_id = Some(session_id);
            want.token = Some(token);
            want.job_id = Some(id);
            want.queue = Some(after.queue.clone());
            let recovery_count = after.recovery_count;
            match (kind, after.status) {
                (EventKind::JobCompleted, JobStatus::Done { .. })
                | (EventKind::JobReleased, JobStatus::Queued) => {
                    assert_eq!(recovery_count, before.recovery_count, "{kind:?} of {id}");
                }
                (EventKind::JobRecovered, JobStatus::Queued) => {
                    assert_eq!(recovery_count, before.recovery_count + 1, "recovered {id}");
                    let outcome = JobOutcome::Recovered { recovery_count };
                    settled.push(Settled::Job(session_id, id, outcome));
                }
                (EventKind::JobFailed, JobStatus::Failed { reason }) => {
                    assert_eq!(recovery_count, before.recovery_count, "failed {id}");
                    want.detail = Some(reason.clone());
                    if by_end {
                        settled.push(Settled::Job(session_id, id, JobOutcome::Failed { reason }));
                    }
                }
                (kind, status) => panic!("{kind:?} left {id} {status:?}"),
            }
        }
        EventKind::JobRequeued => match only(facts, settled, kind) {
            Fact::JobPut {
                id,
                before: Some(before),
                after,
            } => {
                assert!(
                    matches!(before.status, JobStatus::Failed { .. }),
                    "requeued {id} which was {:?}",
                    before.status
                );
                assert_eq!(after.status, JobStatus::Queued, "requeued {id}");
                assert_eq!(after.recovery_count, 0, "requeued {id}");
                assert_eq!(after.attempt, before.attempt, "requeued {id}");
                want.job_id = Some(id);
                want.queue = Some(after.queue);
            }
            other => panic!("{kind:?} does not account for {other:?}"),
        },
        EventKind::SessionClosed | EventKind::SessionExpired | EventKind::SessionEndedByAdmin => {
            let reason = match kind {
                EventKind::SessionClosed => EndReason::Closed,
                EventKind::SessionExpired => EndReason::Expired,
                _ => EndReason::Admin,
            };
            let Some(Fact::SessionDeleted(id)) = facts.pop() else {
                panic!("{kind:?} without the session's deletion last: {facts:?}");
            };
            let released: Vec<ReleasedLock> = facts
                .drain(..)
                .map(|fact| match fact {
                    Fact::LockDeleted(key, holder, token) if holder == id => ReleasedLock {
                        key: key.to_string(),
                        token,
                    },
                    other => panic!("{other:?} inside the end of {id}"),
                })
                .collect();
            let mut story = EndStory {
                id,
                reason,
                released: released.iter().map(|r| (r.key.clone(), r.token)).collect(),
                seats: Vec::new(),
                jobs: Vec::new(),
            };
            for s in settled.drain(..) {
                match s {
                    Settled::Seat(holder, pool, token, why) => {
                        assert_eq!(
                            (holder, why),
                            (id, reason),
                            "seat {pool} in the end of {id}"
                        );
                        story.seats.push((pool.to_string(), token));
                    }
                    Settled::Job(holder, job, outcome) => {
                        assert_eq!(holder, id, "job {job} in the end of {id}");
                        story.jobs.push((job, outcome));
                    }
                }
            }
            want.session_id = Some(id);
            want.reason = Some(reason);
            want.released = released;
            stories.push(story);
        }
        // Raising the token floor moves the counter and changes no record.
        EventKind::TokenFloorRaised => {
            assert!(
                facts.is_empty() && settled.is_empty(),
                "a floor raise with record changes: {facts:?}"
            );
            want.detail = event.detail.clone();
        }
    }
    want
}

/// The order in which `state` would hand out each queue's queued jobs, read by claiming them
/// all, one by one, for a probe session on a copy.
fn claim_order(state: &State, at: At) -> BTreeMap<QueueName, Vec<JobId>> {
    let mut copy = state.clone();
    let mut fx = Effects::default();
    let ttl = Some(LIMITS.max_ttl_ms);
    let opened = copy.open(probe(), "probe".into(), ttl, String::new(), at, &mut fx);
    opened.expect("the probe opens");
    let mut order = BTreeMap::new();
    for name in QUEUES {
        let queue = key(name);
        let mut jobs = Vec::new();
        while let Some(claim) = copy
            .claim(probe(), &queue, at, &mut fx)
            .expect("probe is live")
        {
            jobs.push(claim.job);
        }
        order.insert(queue, jobs);
    }
    order
}

/// A session's grants, in name order.
fn holdings(view: &SessionView) -> (Vec<(LockKey, Token)>, Vec<PoolName>, Vec<JobId>) {
    let (mut locks, mut seats, mut jobs) =
        (view.locks.clone(), view.seats.clone(), view.jobs.clone());
    locks.sort();
    seats.sort();
    jobs.sort();
    (locks, seats, jobs)
}

/// A pool's view with its holders in id order.
fn pool_view(state: &State, name: &PoolName) -> Option<PoolView> {
    let mut view = state.pool(name)?;
    view.holders.sort_by_key(|(s, _)| *s);
    Some(view)
}

/// The system under test with its own copy of the model, plus what the checks remember.
struct Harness {
    state: State,
    model: Model,
    store: Store,
    /// Sessions seen ended or at/after their deadline: gone for good.
    gone: BTreeSet<SessionId>,
    max_token: u64,
    revision: u64,
    /// Per pool, its holders when a change of capacity left it over capacity: only they
    /// may keep it there.
    shrunk: BTreeMap<PoolName, BTreeSet<SessionId>>,
}

impl Harness {
    /// Lock, seat and claim tokens all come from one counter, and each grant's is new.
    fn fresh_token(&mut self, what: &str, token: Token) {
        assert!(
            token.0 > self.max_token,
            "{what} token {token:?} does not grow past {}",
            self.max_token
        );
        self.max_token = token.0;
    }

    fn step(&mut self, transition: &Transition) {
        let at = At {
            now: Mono(self.model.now),
            wall: self.model.wall(),
        };
        let before = self.model.clone();
        let mut fx = Effects::default();
        // Sessions ended by `end` or `reap`, which return them rather than adding them to
        // `fx.ended`.
        let mut returned = Vec::new();
        // The state runs first; the model then follows its choices of order, if any.
        match transition {
            Transition::Open { slot, id, ttl_ms } => {
                let got = self
                    .state
                    .open(*id, OWNER.into(), *ttl_ms, String::new(), at, &mut fx);
                let expected = self.model.open(*slot, *id, *ttl_ms);
                assert_eq!(got.map_err(|e| e.field), expected, "open");
            }
            Transition::Heartbeat { id, ttl_ms } => {
                let got = self.state.heartbeat(*id, *ttl_ms, at, &mut fx);
                let got = got.map_err(|e| match e {
                    HeartbeatError::Invalid(e) => HeartbeatError::Invalid(field_only(e)),
                    gone => gone,
                });
                self.model.follow = Follow::of(&fx.ended);
                let expected = self.model.heartbeat(*id, *ttl_ms);
                if self.gone.contains(id) {
                    assert_eq!(got, Err(HeartbeatError::Gone), "a gone session came back");
                }
                let expected_beat = expected.clone().map(|(beat, _)| beat);
                assert_eq!(got, expected_beat, "heartbeat");
                if let Ok((_, changed)) = expected {
                    let persisted = match ttl_ms {
                        Some(ttl_ms) if changed => vec![Change::SetSessionTtl {
                            id: *id,
                            ttl_ms: *ttl_ms,
                        }],
                        _ => Vec::new(),
                    };
                    assert_eq!(fx.changes, persisted, "heartbeat changes");
                }
            }
            Transition::End { id, reason } => {
                let got = self.state.end(*id, *reason, at, &mut fx);
                self.model.follow = Follow::of(got.as_slice());
                let expected = self.model.end(*id, *reason);
                assert_eq!(got.clone().map(sorted), expected.map(sorted), "end");
                returned.extend(got);
            }
            Transition::Acquire { id, key } => {
                let got = self.state.acquire(*id, key, at, &mut fx);
                self.model.follow = Follow::of(&fx.ended);
                assert_eq!(got, self.model.acquire(*id, key), "acquire");
                if let Ok(Acquired {
                    token, fresh: true, ..
                }) = got
                {
                    self.fresh_token("lock", token);
                }
            }
            Transition::Release { id, key, token } => {
                let got = self.state.release(*id, key, *token, at, &mut fx);
                self.model.follow = Follow::of(&fx.ended);
                assert_eq!(got, self.model.release(*id, key, *token), "release");
            }
            Transition::Advance { ms } => self.model.now += ms,
            Transition::Reap { limit } => {
                let due = self.model.due();
                returned = self.state.reap(at, *limit, &mut fx);
                assert_eq!(returned.len(), due.len().min(*limit), "reap batch size");
                let mut reaped = BTreeMap::new();
                for e in &returned {
                    let deadline = due.iter().find(|(_, id)| *id == e.id).map(|(d, _)| *d);
                    let deadline = deadline.unwrap_or_else(|| panic!("reaped {} before due", e.id));
                    assert!(
                        reaped.insert(e.id, deadline).is_none(),
                        "reaped {} twice",
                        e.id
                    );
                }
                if let Some(latest) = reaped.values().max() {
                    for (deadline, id) in &due {
                        assert!(
                            reaped.contains_key(id) || deadline >= latest,
                            "reap skipped {id}, due earlier"
                        );
                    }
                }
                self.model.follow = Follow::of(&returned);
                for e in &returned {
                    let expected = self.model.finish(e.id, EndReason::Expired);
                    assert_eq!(sorted(e.clone()), sorted(expected), "reaped");
                }
            }
            Transition::PutPool {
                pool,
                capacity,
                created_at,
            } => {
                let got =
                    self.state
                        .put_pool(pool, *capacity, String::new(), *created_at, at, &mut fx);
                let expected = self.model.put_pool(pool, *capacity, *created_at);
                assert_eq!(got.clone().map_err(field_only), expected, "put_pool");
                if got.is_ok() {
                    let view = pool_view(&self.state, pool).expect("the pool was put");
                    let holders = view.holders.iter().map(|(s, _)| *s).collect();
                    if view.holders.len() > view.capacity as usize {
                        self.shrunk.insert(pool.clone(), holders);
                    } else {
                        self.shrunk.remove(pool);
                    }
                }
            }
            Transition::DeletePool { pool } => {
                let got = self.state.delete_pool(pool, at, &mut fx);
                self.model.follow = Follow::of(&fx.ended);
                assert_eq!(got, self.model.delete_pool(pool), "delete_pool");
                if got.is_ok() {
                    self.shrunk.remove(pool);
                }
            }
            Transition::AcquireSeat { id, pool, metadata } => {
                let got = self
                    .state
                    .acquire_seat(*id, pool, metadata.clone(), at, &mut fx);
                let got = got.map_err(|e| match e {
                    SeatError::Invalid(e) => SeatError::Invalid(field_only(e)),
                    other => other,
                });
                self.model.follow = Follow::of(&fx.ended);
                let expected = self.model.acquire_seat(*id, pool, metadata);
                assert_eq!(got, expected, "acquire_seat");
                if let Ok(SeatGrant {
                    token, fresh: true, ..
                }) = got
                {
                    self.fresh_token("seat", token);
                    // The grant is the last thing acquire_seat does: with it, the pool is at
                    // most full.
                    let view = pool_view(&self.state, pool).expect("granted in a pool");
                    assert!(
                        view.holders.len() <= view.capacity as usize,
                        "seat granted in full pool {pool}: {view:?}"
                    );
                }
            }
            Transition::ReleaseSeat { id, pool, token } => {
                let got = self.state.release_seat(*id, pool, *token, at, &mut fx);
                self.model.follow = Follow::of(&fx.ended);
                let expected = self.model.release_seat(*id, pool, *token);
                assert_eq!(got, expected, "release_seat");
            }
            Transition::Enqueue {
                job,
                queue,
                idempotent,
                max_recoveries,
                kind,
            } => {
                let new = NewJob {
                    queue: queue.clone(),
                    payload: payload(*job),
                    idempotent: *idempotent,
                    max_recoveries: *max_recoveries,
                    kind: kind.clone(),
                };
                let got = self.state.enqueue(*job, new, at, &mut fx);
                let expected =
                    self.model
                        .enqueue(*job, queue, *idempotent, *max_recoveries, kind.clone());
                assert_eq!(got.map_err(field_only), expected, "enqueue");
            }
            Transition::Claim { id, queue } => {
                let got = self.state.claim(*id, queue, at, &mut fx);
                self.model.follow = Follow::of(&fx.ended);
                assert_eq!(got, self.model.claim(*id, queue), "claim");
                if let Ok(Some(claim)) = got {
                    self.fresh_token("claim", claim.token);
                }
            }
            Transition::FinishJob {
                id,
                job,
                token,
                finish,
            } => {
                let status = self.state.job_status(*job).cloned();
                let got = self
                    .state
                    .finish_job(*id, *job, *token, finish.clone(), at, &mut fx);
                let got = got.map_err(|e| match e {
                    JobError::Invalid(e) => JobError::Invalid(field_only(e)),
                    other => other,
                });
                self.model.follow = Follow::of(&fx.ended);
                let expected = self.model.finish_job(*id, *job, *token, finish);
                assert_eq!(got, expected, "finish_job");
                if got.is_err() {
                    // A refused finish changes nothing, but for ending a caller found past
                    // its deadline, which settles that caller's jobs as any end does.
                    let settled_by_end = fx
                        .ended
                        .iter()
                        .any(|e| e.jobs.iter().any(|(j, _)| j == job));
                    if !settled_by_end {
                        assert_eq!(
                            self.state.job_status(*job),
                            status.as_ref(),
                            "refused finish"
                        );
                    }
                    if fx.ended.is_empty() {
                        assert!(
                            fx.changes.is_empty(),
                            "refused finish wrote {:?}",
                            fx.changes
                        );
                    }
                    for change in &fx.changes {
                        if let Change::Event(e) = change {
                            let worker =
                                matches!(e.kind, EventKind::JobCompleted | EventKind::JobReleased)
                                    || e.detail.as_deref() == Some(WORKER_REASON);
                            assert!(!worker, "refused finish still finished: {e:?}");
                        }
                    }
                }
            }
            Transition::Requeue { job } => {
                let got = self.state.requeue(*job, at, &mut fx);
                assert_eq!(got, self.model.requeue(*job), "requeue");
            }
            Transition::Purge { age_ms, limit } => {
                let cutoff = UnixMs(at.wall.0 - age_ms);
                let eligible = self.model.purgeable(cutoff);
                let n = self.state.purge_jobs(cutoff, *limit, &mut fx);
                let purged: Vec<JobId> = fx
                    .changes
                    .iter()
                    .map(|c| match c {
                        Change::DeleteJob { id, .. } => *id,
                        other => panic!("a purge wrote {other:?}"),
                    })
                    .collect();
                assert_eq!(purged.len(), n, "purge count");
                assert_eq!(n, eligible.len().min(*limit), "purge batch size");
                let mut taken = BTreeMap::new();
                for id in &purged {
                    let finished = eligible.iter().find(|(_, j)| j == id).map(|(t, _)| *t);
                    let finished = finished.unwrap_or_else(|| panic!("purged {id}, not due"));
                    assert!(taken.insert(*id, finished).is_none(), "purged {id} twice");
                }
                if let Some(latest) = taken.values().max() {
                    for (finished, id) in &eligible {
                        assert!(
                            taken.contains_key(id) || finished >= latest,
                            "purge skipped {id}, finished earlier"
                        );
                    }
                }
                self.model.purge(&purged);
            }
        }
        let inline = std::mem::take(&mut self.model.inline);
        let got_inline: Vec<Ended> = fx.ended.iter().cloned().map(sorted).collect();
        let inline: Vec<Ended> = inline.into_iter().map(sorted).collect();
        assert_eq!(got_inline, inline, "sessions ended inline");
        assert!(
            returned.is_empty() || fx.ended.is_empty(),
            "end and reap return what they end"
        );
        let ended: Vec<Ended> = fx.ended.iter().chain(&returned).cloned().collect();
        // No session ends before its deadline, and none ends twice.
        for e in &ended {
            let session = before.sessions.get(&e.id);
            let session = session.unwrap_or_else(|| panic!("ended {} which was not there", e.id));
            match e.reason {
                EndReason::Expired => assert!(session.deadline <= at.now.0, "expired early: {e:?}"),
                EndReason::Closed => assert!(at.now.0 < session.deadline, "closed after expiry"),
                EndReason::Admin => {}
            }
        }
        check_wakeups(&before, &self.model, &fx);
        self.store.write(&fx.changes, at.wall, &ended);
        assert!(self.state.revision() >= self.revision, "revision went back");
        self.revision = self.state.revision();
        self.model.follow = Follow::default();
        let now = self.model.now;
        self.gone.extend(self.model.ended.iter().copied());
        let past_deadline = self
            .model
            .sessions
            .iter()
            .filter(|(_, s)| s.deadline <= now);
        self.gone.extend(past_deadline.map(|(id, _)| *id));
    }

    fn check(&self) {
        let (state, model) = (&self.state, &self.model);
        let now = Mono(model.now);
        let at = At {
            now,
            wall: model.wall(),
        };
        if let Err(e) = state.check_invariants() {
            panic!("State::check_invariants: {e}");
        }
        assert_eq!(state.revision(), model.revision, "revision");
        assert_eq!(state.event_seq(), model.event_seq, "event seq");
        assert_eq!(state.session_count(), model.sessions.len(), "session count");
        assert_eq!(state.lock_count(), model.locks.len(), "lock count");
        let earliest = model.sessions.values().map(|s| Mono(s.deadline)).min();
        assert_eq!(state.earliest_deadline(), earliest, "earliest deadline");

        // At most one holder per key: the one the model names.
        for name in KEYS {
            let k = key(name);
            let expected = model.locks.get(&k).map(|l| LockView {
                key: k.clone(),
                session_id: l.session,
                token: Token(l.token),
                acquired_at: UnixMs(l.acquired_at),
            });
            assert_eq!(state.lock(&k), expected, "lock {k}");
        }

        // Pools: the model's capacity and holders; no more holders than the capacity, but
        // for those a shrink found there.
        let pools: Vec<(PoolName, u32, usize)> = model
            .pools
            .iter()
            .map(|(n, p)| (n.clone(), p.capacity, p.holders.len()))
            .collect();
        assert_eq!(state.pools(), pools, "pools");
        for name in POOLS {
            let name = key(name);
            let expected = model.pools.get(&name).map(|p| PoolView {
                name: name.clone(),
                capacity: p.capacity,
                holders: p
                    .holders
                    .iter()
                    .map(|(s, seat)| {
                        let seat = Seat {
                            token: Token(seat.token),
                            acquired_at: UnixMs(seat.acquired_at),
                        };
                        (*s, seat)
                    })
                    .collect(),
            });
            let view = pool_view(state, &name);
            assert_eq!(view, expected, "pool {name}");
            let has_room = model.pools.get(&name).is_some_and(MPool::has_room);
            assert_eq!(state.pool_has_room(&name), has_room, "room in {name}");
            if let Some(view) = view {
                let shrunk = self.shrunk.get(&name);
                let kept = view.holders.iter();
                let kept = kept.filter(|(s, _)| shrunk.is_some_and(|k| k.contains(s)));
                let allowed = (view.capacity as usize).max(kept.count());
                assert!(
                    view.holders.len() <= allowed,
                    "pool {name} over capacity: {view:?}"
                );
            }
        }

        // Jobs: every one ever enqueued is queued, claimed, done or failed, as the model has
        // it, until purged; none other exists; queues serve in the model's order.
        for id in &model.made {
            let expected = model.jobs.get(id).map(|j| in_memory(&j.status));
            assert_eq!(state.job_status(*id).cloned(), expected, "job {id}");
            let outcome = model
                .jobs
                .get(id)
                .filter(|j| Model::claimant(j).is_some())
                .map(Model::outcome);
            assert_eq!(state.job_outcome_if_ended(*id), outcome, "outcome of {id}");
        }
        assert_eq!(state.job_status(JobId::from_u128(1)), None, "unknown job");
        let queues: Vec<(QueueName, QueueCounts)> = QUEUES
            .iter()
            .map(|q| key(q))
            .filter(|q| model.jobs.values().any(|j| j.queue == *q))
            .map(|q| {
                let counts = model.counts(&q);
                (q, counts)
            })
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .collect();
        assert_eq!(state.queues(), queues, "queues");
        let total: u64 = queues
            .iter()
            .map(|(_, c)| c.queued + c.claimed + c.done + c.failed)
            .sum();
        assert_eq!(total, model.jobs.len() as u64, "jobs in the state");
        let order = claim_order(state, at);
        for name in QUEUES {
            let q = key(name);
            let expected: Vec<JobId> = model
                .queued
                .get(&q)
                .into_iter()
                .flatten()
                .copied()
                .collect();
            assert_eq!(order[&q], expected, "claim order of {q}");
            assert_eq!(
                state.queue_has_job(&q),
                !expected.is_empty(),
                "{q} has a job"
            );
        }

        // Every session, live or due, as the model has it; no key, seat or job twice.
        let due = state.due(now, usize::MAX);
        let due_ids: BTreeSet<SessionId> = due.iter().map(|v| v.id).collect();
        let model_due: BTreeSet<SessionId> = model.due().into_iter().map(|(_, id)| id).collect();
        assert_eq!(due_ids, model_due, "due sessions");
        assert!(
            due.windows(2).all(|w| w[0].deadline <= w[1].deadline),
            "due order"
        );
        let mut key_holders = BTreeMap::new();
        let mut claimants = BTreeMap::new();
        for (id, s) in &model.sessions {
            let live = now.0 < s.deadline;
            assert_eq!(state.is_live(*id, now), live, "{id} beats");
            let view = if live {
                state.session(*id, now)
            } else {
                assert_eq!(state.session(*id, now), None, "{id} is past its deadline");
                due.iter().find(|v| v.id == *id).cloned()
            };
            let view = view.unwrap_or_else(|| panic!("session {id} is missing"));
            assert_eq!(
                (view.ttl_ms, view.deadline),
                (s.ttl_ms, Mono(s.deadline)),
                "{id}"
            );
            let (locks, seats, jobs) = holdings(&view);
            assert_eq!(locks, model.locks_of(*id), "locks of {id}");
            // A pool listed twice would show here: the model's list names each once.
            assert_eq!(seats, model.seats_of(*id), "seats of {id}");
            assert_eq!(jobs, model.claims_of(*id), "jobs of {id}");
            for (k, _) in locks {
                let other = key_holders.insert(k.clone(), *id);
                assert!(other.is_none(), "two holders of {k}");
            }
            for job in jobs {
                let other = claimants.insert(job, *id);
                assert!(other.is_none(), "job {job} claimed by {id} and {other:?}");
            }
        }

        // Gone is terminal; an ended session holds nothing: no lock, seat or job.
        for id in &self.gone {
            assert_eq!(
                state.session(*id, now),
                None,
                "gone session {id} is visible"
            );
        }
        for id in &model.ended {
            assert!(!due_ids.contains(id), "ended session {id} is still due");
            for name in KEYS {
                let holder = state.lock(&key(name)).map(|l| l.session_id);
                assert_ne!(holder, Some(*id), "ended session {id} still holds {name}");
            }
            for name in POOLS {
                let view = state.pool(&key(name));
                let holds = view.is_some_and(|v| v.holders.iter().any(|(s, _)| s == id));
                assert!(!holds, "ended session {id} still has a seat in {name}");
            }
            for job in &model.made {
                let claimed = matches!(
                    state.job_status(*job),
                    Some(JobStatus::Claimed { session_id, .. }) if session_id == id
                );
                assert!(!claimed, "ended session {id} still holds job {job}");
            }
        }

        self.check_store();
        self.check_restore(at, &order);
    }

    /// The store holds what the model does.
    fn check_store(&self) {
        let (store, model) = (&self.store, &self.model);
        let stored: BTreeMap<SessionId, u64> = model
            .sessions
            .iter()
            .map(|(id, s)| (*id, s.ttl_ms))
            .collect();
        assert_eq!(store.sessions, stored, "stored sessions");
        let stored: BTreeMap<LockKey, LockRecord> = model
            .locks
            .iter()
            .map(|(k, l)| {
                let record = LockRecord {
                    session_id: l.session,
                    token: Token(l.token),
                    acquired_at: UnixMs(l.acquired_at),
                };
                (k.clone(), record)
            })
            .collect();
        assert_eq!(store.locks, stored, "stored locks");
        let stored: BTreeMap<PoolName, (u32, UnixMs)> = model
            .pools
            .iter()
            .map(|(n, p)| (n.clone(), (p.capacity, UnixMs(p.created_at))))
            .collect();
        let pools: BTreeMap<PoolName, (u32, UnixMs)> = store
            .pools
            .iter()
            .map(|(n, r)| (n.clone(), (r.capacity, r.created_at)))
            .collect();
        assert_eq!(pools, stored, "stored pools");
        let stored: BTreeMap<(PoolName, SessionId), SeatRecord> = model
            .pools
            .iter()
            .flat_map(|(n, p)| {
                p.holders.iter().map(|(s, seat)| {
                    let record = SeatRecord {
                        token: Token(seat.token),
                        acquired_at: UnixMs(seat.acquired_at),
                        metadata: seat.metadata.clone(),
                    };
                    ((n.clone(), *s), record)
                })
            })
            .collect();
        assert_eq!(store.seats, stored, "stored seats");
        let stored: BTreeMap<JobId, JobRecord> = model
            .jobs
            .iter()
            .map(|(id, j)| (*id, Model::record(j)))
            .collect();
        let jobs: BTreeMap<JobId, JobRecord> = store
            .jobs
            .iter()
            .map(|(id, r)| {
                (
                    *id,
                    JobRecord {
                        order: 0,
                        ..r.clone()
                    },
                )
            })
            .collect();
        assert_eq!(jobs, stored, "stored jobs");
        let payloads: BTreeMap<JobId, String> =
            model.jobs.keys().map(|id| (*id, payload(*id))).collect();
        assert_eq!(store.payloads, payloads, "stored payloads");
        // The stored order serves each queue as the model does.
        for (queue, jobs) in &model.queued {
            let mut queued: Vec<(i64, JobId)> = store
                .jobs
                .iter()
                .filter(|(_, r)| r.queue == queue.as_str() && r.status == JobStatus::Queued)
                .map(|(id, r)| (r.order, *id))
                .collect();
            queued.sort();
            let queued: Vec<JobId> = queued.into_iter().map(|(_, id)| id).collect();
            assert_eq!(queued, Vec::from(jobs.clone()), "stored order of {queue}");
        }
        assert_eq!(store.event_seq, model.event_seq, "stored event seq");
    }

    /// The store's records restore into the same locks, seats, jobs and queue order.
    fn check_restore(&self, at: At, order: &BTreeMap<QueueName, Vec<JobId>>) {
        let (state, store) = (&self.state, &self.store);
        let from = Restore {
            revision: state.revision(),
            event_seq: state.event_seq(),
            sessions: store.sessions.iter().map(|(id, t)| (*id, *t)).collect(),
            locks: store.locks.clone().into_iter().collect(),
            pools: store
                .pools
                .iter()
                .map(|(n, r)| (n.clone(), r.capacity))
                .collect(),
            seats: store
                .seats
                .iter()
                .map(|((p, s), r)| (p.clone(), *s, r.token, r.acquired_at))
                .collect(),
            jobs: store.jobs.clone().into_iter().collect(),
        };
        let limits = limits(self.model.max_locks);
        let restored = State::restore(limits, from, at.now).expect("the store's records restore");
        if let Err(e) = restored.check_invariants() {
            panic!("restored state: {e}");
        }
        assert_eq!(restored.revision(), state.revision(), "restored revision");
        for name in KEYS {
            assert_eq!(
                restored.lock(&key(name)),
                state.lock(&key(name)),
                "restored {name}"
            );
        }
        assert_eq!(restored.pools(), state.pools(), "restored pools");
        for name in POOLS {
            let name = key(name);
            assert_eq!(
                pool_view(&restored, &name),
                pool_view(state, &name),
                "restored pool {name}"
            );
        }
        for id in self.model.sessions.keys() {
            let view = restored.session(*id, at.now);
            let view = view.unwrap_or_else(|| panic!("restored {id} is missing"));
            let locks = self.model.locks_of(*id);
            let seats = self.model.seats_of(*id);
            let jobs = self.model.claims_of(*id);
            assert_eq!(holdings(&view), (locks, seats, jobs), "restored {id}");
        }
        for id in &self.model.made {
            assert_eq!(
                restored.job_status(*id),
                state.job_status(*id),
                "restored job {id}"
            );
        }
        assert_eq!(restored.queues(), state.queues(), "restored queues");
        assert_eq!(&claim_order(&restored, at), order, "restored claim order");
    }
}

/// Whatever a step freed is announced to waiters: exactly the keys it left free (a key that
/// an expired holder lost to the caller is not free), every pool that has a seat free now
/// that it freed one or grew, and every queue a job went back to.
fn check_wakeups(before: &Model, after: &Model, fx: &Effects) {
    let freed: Vec<LockKey> = before
        .locks
        .keys()
        .filter(|k| !after.locks.contains_key(*k))
        .cloned()
        .collect();
    let mut announced = fx.freed_locks.clone();
    announced.sort();
    assert_eq!(announced, freed, "freed locks");
    for (name, pool) in &after.pools {
        let opened_up = before.pools.get(name).is_none_or(|b| {
            pool.capacity > b.capacity || b.holders.keys().any(|h| !pool.holders.contains_key(h))
        });
        if pool.has_room() && opened_up {
            assert!(
                fx.freed_pools.contains(name),
                "pool {name} has a seat free that no waiter is told of: {:?}",
                fx.freed_pools
            );
        }
    }
    for (id, job) in &after.jobs {
        let was_queued = before
            .jobs
            .get(id)
            .is_some_and(|j| j.status == JobStatus::Queued);
        if job.status == JobStatus::Queued && !was_queued {
            assert!(
                fx.ready_queues.contains(&job.queue),
                "job {id} queued in {} and no waiter told: {:?}",
                job.queue,
                fx.ready_queues
            );
        }
    }
}

impl StateMachineTest for Harness {
    type SystemUnderTest = Harness;
    type Reference = Reference;

    fn init_test(model: &Model) -> Harness {
        Harness {
            state: State::new(limits(model.max_locks)),
            model: model.clone(),
            store: Store::default(),
            gone: BTreeSet::new(),
            max_token: 0,
            revision: 0,
            shrunk: BTreeMap::new(),
        }
    }

    fn apply(mut harness: Harness, _reference: &Model, transition: Transition) -> Harness {
        harness.step(&transition);
        harness
    }

    fn check_invariants(harness: &Harness, _reference: &Model) {
        harness.check();
    }
}

/// 1000 cases unless `PROPTEST_CASES` (or another `PROPTEST_*` variable) says otherwise.
/// Failures are kept next to this file, as `tests/model.proptest-regressions`.
fn config() -> Config {
    contextualize_config(Config {
        cases: 1_000,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    })
}

prop_state_machine! {
    #![proptest_config(config())]

    #[test]
    fn state_matches_model(sequential 1..60 => Harness);
}
