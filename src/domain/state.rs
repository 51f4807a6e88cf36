//! The in-memory state of sessions, locks, seat pools and jobs, and the session and lock
//! rules. Seat and job rules live in `pools` and `jobs`, as further `impl State` blocks.
//!
//! Invariants (checked by `check_invariants` in tests and by the model-based test):
//! - every lock's, seat's and claimed job's holder is a session in `sessions`, and that
//!   session lists it (the session → grants index that makes the cascade one lookup);
//! - every session has exactly one entry in `expiry`, at its current deadline;
//! - every token is at most `revision`, and `revision` only grows;
//! - a pool never gains a holder while it is at or above its capacity.

use std::collections::{BTreeSet, HashMap};

use super::change::{Change, EndReason, Event, EventKind, LockRecord, ReleasedLock, SessionRecord};
use super::ids::{JobId, LockKey, PoolName, QueueName, SessionId, Token};
use super::jobs::{Job, JobOutcome, Queue};
use super::limits::{InvalidInput, Limits};
use super::pools::Pool;
use super::time::{Mono, UnixMs};

/// One reading of both clocks, taken once per batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct At {
    /// Decides liveness.
    pub now: Mono,
    /// Stamps records and events.
    pub wall: UnixMs,
}

/// What mutations produced, besides their results: the changes to persist, the sessions
/// they ended inline, and the resources that became available for waiters.
#[derive(Debug, Default)]
pub struct Effects {
    pub changes: Vec<Change>,
    /// Sessions ended as a side effect (an expired holder or caller ended inline).
    pub ended: Vec<Ended>,
    pub freed_locks: Vec<LockKey>,
    pub freed_pools: Vec<PoolName>,
    pub ready_queues: Vec<QueueName>,
}

impl Effects {
    pub fn clear(&mut self) {
        self.changes.clear();
        self.ended.clear();
        self.freed_locks.clear();
        self.freed_pools.clear();
        self.ready_queues.clear();
    }
}

#[derive(Debug, Clone)]
pub(super) struct Session {
    pub(super) ttl_ms: u64,
    pub(super) deadline: Mono,
    /// The keys, pools and jobs this session holds. Short vectors: sessions hold few
    /// grants, and `max_locks_per_session` bounds the locks.
    pub(super) locks: Vec<LockKey>,
    pub(super) seats: Vec<PoolName>,
    pub(super) jobs: Vec<JobId>,
}

impl Session {
    pub(super) fn expired(&self, now: Mono) -> bool {
        now >= self.deadline
    }
}

#[derive(Debug, Clone)]
struct Lock {
    session: SessionId,
    token: Token,
    acquired_at: UnixMs,
}

/// A session as a reader sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionView {
    pub id: SessionId,
    pub ttl_ms: u64,
    pub deadline: Mono,
    pub locks: Vec<(LockKey, Token)>,
    pub seats: Vec<PoolName>,
    pub jobs: Vec<JobId>,
}

impl SessionView {
    /// When the last heartbeat (or the open, or the restart) happened on the monotonic clock.
    pub fn last_heartbeat(&self) -> Mono {
        Mono(self.deadline.0.saturating_sub(self.ttl_ms))
    }

    /// `grace` once a third of the TTL has passed without a heartbeat: the client is late
    /// but not yet gone.
    pub fn in_grace(&self, now: Mono) -> bool {
        now.since(self.last_heartbeat()) > self.ttl_ms / 3
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockView {
    pub key: LockKey,
    pub session_id: SessionId,
    pub token: Token,
    pub acquired_at: UnixMs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    pub revision: u64,
    pub deadline: Mono,
    pub ttl_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    pub deadline: Mono,
    pub ttl_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeartbeatError {
    #[error("the session is gone")]
    Gone,
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
}

/// A session that ended, with everything it released in the same change set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub id: SessionId,
    pub reason: EndReason,
    pub released: Vec<(LockKey, Token)>,
    pub seats: Vec<(PoolName, Token)>,
    pub jobs: Vec<(JobId, JobOutcome)>,
    pub revision: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acquired {
    pub token: Token,
    pub revision: u64,
    /// False when the holder asked again and got its own grant back.
    pub fresh: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AcquireError {
    #[error("the session is gone")]
    SessionGone,
    #[error("the lock is held by another session")]
    Held { holder: SessionId, token: Token },
    #[error("the session already holds {0} locks, the most one session may hold")]
    TooManyLocks(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the session does not hold this with this token")]
pub struct NotHolder;

/// Sessions, locks, pools, jobs, the expiry index and the two durable counters.
#[derive(Debug, Clone)]
pub struct State {
    pub(super) limits: Limits,
    pub(super) sessions: HashMap<SessionId, Session>,
    locks: HashMap<LockKey, Lock>,
    /// Ordered by deadline so the reaper finds due sessions in O(due), never by a scan.
    expiry: BTreeSet<(Mono, SessionId)>,
    pub(super) pools: HashMap<PoolName, Pool>,
    pub(super) jobs: HashMap<JobId, Job>,
    pub(super) queues: HashMap<QueueName, Queue>,
    /// Finished jobs by when they finished, for the retention purge.
    pub(super) finished: BTreeSet<(UnixMs, JobId)>,
    /// The last revision issued. Every mutation takes the next one; tokens are revisions.
    revision: u64,
    /// The last audit sequence number issued.
    event_seq: u64,
}

/// Everything `State::restore` needs from the store.
#[derive(Default)]
pub struct Restore {
    pub revision: u64,
    pub event_seq: u64,
    pub sessions: Vec<(SessionId, u64)>,
    pub locks: Vec<(LockKey, LockRecord)>,
    pub pools: Vec<(PoolName, u32)>,
    pub seats: Vec<(PoolName, SessionId, Token, UnixMs)>,
    pub jobs: Vec<(JobId, super::change::JobRecord)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RestoreError {
    #[error("{what} names session {session} which does not exist")]
    Orphan { what: String, session: SessionId },
    #[error("{what} has token {token} above the revision counter {revision}")]
    TokenAboveRevision {
        what: String,
        token: u64,
        revision: u64,
    },
    #[error("seat in pool {0:?}, which does not exist")]
    SeatWithoutPool(String),
    #[error("job {0} names queue {1:?}, which is not a valid name")]
    BadQueue(JobId, String),
}

impl State {
    pub fn new(limits: Limits) -> State {
        State {
            limits,
            sessions: HashMap::new(),
            locks: HashMap::new(),
            expiry: BTreeSet::new(),
            pools: HashMap::new(),
            jobs: HashMap::new(),
            queues: HashMap::new(),
            finished: BTreeSet::new(),
            revision: 0,
            event_seq: 0,
        }
    }

    /// Rebuilds the state from what the store holds. Every session gets a fresh deadline of
    /// `now + ttl` (the restart grace): heartbeats are not persisted, so this is the only
    /// deadline that can never expire a live client early.
    pub fn restore(limits: Limits, from: Restore, now: Mono) -> Result<State, RestoreError> {
        let mut state = State::new(limits);
        state.revision = from.revision;
        state.event_seq = from.event_seq;
        state.sessions.reserve(from.sessions.len());
        for (id, ttl_ms) in from.sessions {
            let deadline = now.plus_ms(ttl_ms);
            state.sessions.insert(
                id,
                Session {
                    ttl_ms,
                    deadline,
                    locks: Vec::new(),
                    seats: Vec::new(),
                    jobs: Vec::new(),
                },
            );
            state.expiry.insert((deadline, id));
        }
        state.locks.reserve(from.locks.len());
        for (key, record) in from.locks {
            state.check_token(format!("lock {key:?}"), record.token)?;
            let Some(session) = state.sessions.get_mut(&record.session_id) else {
                return Err(RestoreError::Orphan {
                    what: format!("lock {key:?}"),
                    session: record.session_id,
                });
            };
            session.locks.push(key.clone());
            state.locks.insert(
                key,
                Lock {
                    session: record.session_id,
                    token: record.token,
                    acquired_at: record.acquired_at,
                },
            );
        }
        state.restore_pools(from.pools, from.seats)?;
        state.restore_jobs(from.jobs)?;
        Ok(state)
    }

    pub(super) fn check_token(&self, what: String, token: Token) -> Result<(), RestoreError> {
        if token.0 > self.revision {
            return Err(RestoreError::TokenAboveRevision {
                what,
                token: token.0,
                revision: self.revision,
            });
        }
        Ok(())
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    pub fn event_seq(&self) -> u64 {
        self.event_seq
    }

    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    pub fn lock_count(&self) -> usize {
        self.locks.len()
    }

    /// The earliest deadline of any session: when the reaper next has work.
    pub fn earliest_deadline(&self) -> Option<Mono> {
        self.expiry.first().map(|(d, _)| *d)
    }

    pub(super) fn next_revision(&mut self) -> u64 {
        self.revision += 1;
        self.revision
    }

    pub(super) fn event(&mut self, at: UnixMs, kind: EventKind) -> Event {
        self.event_seq += 1;
        Event::new(self.event_seq, at, kind)
    }

    /// The live session `id`, or why not. A session past its deadline is ended inline
    /// (recorded as expired) so that every later call finds it gone, durably.
    pub(super) fn live_or_end(
        &mut self,
        id: SessionId,
        at: At,
        fx: &mut Effects,
    ) -> Result<(), Gone> {
        match self.sessions.get(&id) {
            None => Err(Gone),
            Some(s) if s.expired(at.now) => {
                let ended = self.end_unchecked(id, EndReason::Expired, at, fx);
                fx.ended.push(ended);
                Err(Gone)
            }
            Some(_) => Ok(()),
        }
    }

    /// Opens a session. The id comes from the caller (random) so this stays deterministic.
    pub fn open(
        &mut self,
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: String,
        at: At,
        fx: &mut Effects,
    ) -> Result<Opened, InvalidInput> {
        self.limits.owner(&owner)?;
        let ttl_ms = self.limits.ttl(ttl_ms)?;
        if !metadata.is_empty() {
            self.limits.metadata(&metadata)?;
        }
        debug_assert!(
            !self.sessions.contains_key(&id),
            "session ids are never reused"
        );
        let revision = self.next_revision();
        let deadline = at.now.plus_ms(ttl_ms);
        self.sessions.insert(
            id,
            Session {
                ttl_ms,
                deadline,
                locks: Vec::new(),
                seats: Vec::new(),
                jobs: Vec::new(),
            },
        );
        self.expiry.insert((deadline, id));
        let mut event = self.event(at.wall, EventKind::SessionOpened);
        event.session_id = Some(id);
        event.owner = Some(owner.clone());
        fx.changes.push(Change::PutSession {
            id,
            record: SessionRecord {
                owner,
                ttl_ms,
                created_at: at.wall,
                metadata,
            },
        });
        fx.changes.push(Change::Event(event));
        Ok(Opened {
            revision,
            deadline,
            ttl_ms,
        })
    }

    /// Whether `id` is a live session at `now`. Cheaper than `session` (no view is built),
    /// for the paths that only ask: a heartbeat the engine may answer without the writer, a
    /// fence check, a waiter's fate.
    pub fn is_live(&self, id: SessionId, now: Mono) -> bool {
        self.sessions.get(&id).is_some_and(|s| !s.expired(now))
    }

    /// Extends a live session's deadline to `now + ttl`.
    ///
    /// A session at or past its deadline is gone, even before the reaper has ended it: it is
    /// ended inline here, so the answer "gone" is durable and terminal. With a new `ttl_ms`
    /// the TTL is persisted (a `SetSessionTtl` change) so that the restart grace uses it;
    /// without one, a live session's heartbeat changes nothing durable.
    pub fn heartbeat(
        &mut self,
        id: SessionId,
        ttl_ms: Option<u64>,
        at: At,
        fx: &mut Effects,
    ) -> Result<Beat, HeartbeatError> {
        self.live_or_end(id, at, fx)
            .map_err(|Gone| HeartbeatError::Gone)?;
        let new_ttl = match ttl_ms {
            Some(t) => Some(self.limits.ttl(Some(t))?),
            None => None,
        };
        let session = self.sessions.get_mut(&id).expect("checked live above");
        if let Some(ttl) = new_ttl
            && ttl != session.ttl_ms
        {
            session.ttl_ms = ttl;
            fx.changes.push(Change::SetSessionTtl { id, ttl_ms: ttl });
        }
        let old = session.deadline;
        session.deadline = at.now.plus_ms(session.ttl_ms);
        let beat = Beat {
            deadline: session.deadline,
            ttl_ms: session.ttl_ms,
        };
        if old != beat.deadline {
            self.expiry.remove(&(old, id));
            self.expiry.insert((beat.deadline, id));
        }
        Ok(beat)
    }

    /// Ends a session for `reason`, releasing everything it holds in the same change set.
    /// Returns `None` for a session that is unknown or already ended.
    ///
    /// A client closing a session that is already past its deadline is recorded as what
    /// happened first: the session expired.
    pub fn end(
        &mut self,
        id: SessionId,
        reason: EndReason,
        at: At,
        fx: &mut Effects,
    ) -> Option<Ended> {
        let expired = self.sessions.get(&id)?.expired(at.now);
        let reason = if expired && reason == EndReason::Closed {
            EndReason::Expired
        } else {
            reason
        };
        Some(self.end_unchecked(id, reason, at, fx))
    }

    pub(super) fn end_unchecked(
        &mut self,
        id: SessionId,
        reason: EndReason,
        at: At,
        fx: &mut Effects,
    ) -> Ended {
        let session = self
            .sessions
            .remove(&id)
            .expect("end_unchecked is called on a present session");
        self.expiry.remove(&(session.deadline, id));
        let revision = self.next_revision();
        let mut released = Vec::with_capacity(session.locks.len());
        for key in session.locks {
            let lock = self
                .locks
                .remove(&key)
                .expect("a session's grant list only names locks it holds");
            debug_assert_eq!(lock.session, id);
            fx.changes.push(Change::DeleteLock {
                key: key.clone(),
                session_id: id,
            });
            fx.freed_locks.push(key.clone());
            released.push((key, lock.token));
        }
        let seats = self.reclaim_seats(id, session.seats, reason, at, fx);
        let jobs = self.settle_jobs(id, session.jobs, at, fx);
        fx.changes.push(Change::DeleteSession { id });
        let mut event = self.event(at.wall, EventKind::for_end(reason));
        event.session_id = Some(id);
        event.reason = Some(reason);
        event.released = released
            .iter()
            .map(|(k, t)| ReleasedLock {
                key: k.to_string(),
                token: *t,
            })
            .collect();
        fx.changes.push(Change::Event(event));
        Ended {
            id,
            reason,
            released,
            seats,
            jobs,
            revision,
        }
    }

    /// Grants `key` to session `id`, or says why not.
    ///
    /// A holder whose session is past its deadline but not yet reaped is ended first, in the
    /// same change set, so a contender never waits for the reaper; so is the caller itself
    /// when it is past its own deadline. The holder asking again gets its own grant back.
    pub fn acquire(
        &mut self,
        id: SessionId,
        key: &LockKey,
        at: At,
        fx: &mut Effects,
    ) -> Result<Acquired, AcquireError> {
        self.live_or_end(id, at, fx)
            .map_err(|Gone| AcquireError::SessionGone)?;
        if let Some(lock) = self.locks.get(key) {
            if lock.session == id {
                return Ok(Acquired {
                    token: lock.token,
                    revision: self.revision,
                    fresh: false,
                });
            }
            let (holder, token) = (lock.session, lock.token);
            if self.live_or_end(holder, at, fx).is_ok() {
                return Err(AcquireError::Held { holder, token });
            }
        }
        let held = self.sessions[&id].locks.len();
        if held >= self.limits.max_locks_per_session {
            // An expired holder ended above leaves the key free, announced to its waiters.
            return Err(AcquireError::TooManyLocks(held));
        }
        // If an expired holder was ended inline, the key is not offered to waiters: this
        // caller takes it in the same change set.
        fx.freed_locks.retain(|k| k != key);
        let revision = self.next_revision();
        let token = Token(revision);
        self.sessions
            .get_mut(&id)
            .expect("checked above")
            .locks
            .push(key.clone());
        self.locks.insert(
            key.clone(),
            Lock {
                session: id,
                token,
                acquired_at: at.wall,
            },
        );
        fx.changes.push(Change::PutLock {
            key: key.clone(),
            record: LockRecord {
                session_id: id,
                token,
                acquired_at: at.wall,
            },
        });
        let mut event = self.event(at.wall, EventKind::LockAcquired);
        event.session_id = Some(id);
        event.key = Some(key.to_string());
        event.token = Some(token);
        fx.changes.push(Change::Event(event));
        Ok(Acquired {
            token,
            revision,
            fresh: true,
        })
    }

    /// Whether session `id` holds `key`.
    pub fn holds(&self, id: SessionId, key: &LockKey) -> bool {
        self.locks.get(key).is_some_and(|l| l.session == id)
    }

    /// Ends the holder of `key` if it is past its deadline, so that the key goes to whoever
    /// waits for it first. True when the key was freed.
    pub fn end_expired_holder(&mut self, key: &LockKey, at: At, fx: &mut Effects) -> bool {
        match self.locks.get(key) {
            Some(lock) => {
                let holder = lock.session;
                self.live_or_end(holder, at, fx).is_err()
            }
            None => false,
        }
    }

    /// Releases `key` if the live session `id` holds it with exactly `token`; returns the
    /// revision. A session past its deadline is ended inline and holds nothing any more.
    pub fn release(
        &mut self,
        id: SessionId,
        key: &LockKey,
        token: Token,
        at: At,
        fx: &mut Effects,
    ) -> Result<u64, NotHolder> {
        self.live_or_end(id, at, fx).map_err(|Gone| NotHolder)?;
        match self.locks.get(key) {
            Some(lock) if lock.session == id && lock.token == token => {}
            _ => return Err(NotHolder),
        }
        self.locks.remove(key);
        if let Some(session) = self.sessions.get_mut(&id)
            && let Some(pos) = session.locks.iter().position(|k| k == key)
        {
            session.locks.swap_remove(pos);
        }
        let revision = self.next_revision();
        fx.changes.push(Change::DeleteLock {
            key: key.clone(),
            session_id: id,
        });
        fx.freed_locks.push(key.clone());
        let mut event = self.event(at.wall, EventKind::LockReleased);
        event.session_id = Some(id);
        event.key = Some(key.to_string());
        event.token = Some(token);
        fx.changes.push(Change::Event(event));
        Ok(revision)
    }

    /// Ends up to `limit` sessions whose deadline is at or before `now`, earliest first.
    pub fn reap(&mut self, at: At, limit: usize, fx: &mut Effects) -> Vec<Ended> {
        let mut ended = Vec::new();
        while ended.len() < limit {
            match self.expiry.first() {
                Some(&(deadline, id)) if deadline <= at.now => {
                    ended.push(self.end_unchecked(id, EndReason::Expired, at, fx));
                }
                _ => break,
            }
        }
        ended
    }

    /// The sessions a reap at `now` would end (at most `limit`), changing nothing.
    pub fn due(&self, now: Mono, limit: usize) -> Vec<SessionView> {
        self.expiry
            .iter()
            .take_while(|(deadline, _)| *deadline <= now)
            .take(limit)
            .map(|(_, id)| self.view(*id))
            .collect()
    }

    fn view(&self, id: SessionId) -> SessionView {
        let s = &self.sessions[&id];
        SessionView {
            id,
            ttl_ms: s.ttl_ms,
            deadline: s.deadline,
            locks: s
                .locks
                .iter()
                .map(|k| (k.clone(), self.locks[k].token))
                .collect(),
            seats: s.seats.clone(),
            jobs: s.jobs.clone(),
        }
    }

    /// A live session; `None` when it is unknown, ended, or past its deadline.
    pub fn session(&self, id: SessionId, now: Mono) -> Option<SessionView> {
        match self.sessions.get(&id) {
            Some(s) if !s.expired(now) => Some(self.view(id)),
            _ => None,
        }
    }

    pub fn lock(&self, key: &LockKey) -> Option<LockView> {
        self.locks.get(key).map(|l| LockView {
            key: key.clone(),
            session_id: l.session,
            token: l.token,
            acquired_at: l.acquired_at,
        })
    }

    /// Checks the structural invariants; used by tests after every step.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.expiry.len() != self.sessions.len() {
            return Err(format!(
                "expiry index has {} entries for {} sessions",
                self.expiry.len(),
                self.sessions.len()
            ));
        }
        for (id, s) in &self.sessions {
            if !self.expiry.contains(&(s.deadline, *id)) {
                return Err(format!("session {id} is missing from the expiry index"));
            }
            for key in &s.locks {
                match self.locks.get(key) {
                    Some(l) if l.session == *id => {}
                    _ => return Err(format!("session {id} lists {key} which it does not hold")),
                }
            }
        }
        for (key, lock) in &self.locks {
            let Some(s) = self.sessions.get(&lock.session) else {
                return Err(format!(
                    "lock {key} is held by missing session {}",
                    lock.session
                ));
            };
            if !s.locks.contains(key) {
                return Err(format!("lock {key} is not in its holder's grant list"));
            }
            if lock.token.0 > self.revision {
                return Err(format!("lock {key} has a token above the revision"));
            }
        }
        self.check_pools()?;
        self.check_jobs()?;
        Ok(())
    }
}

/// The caller's session is unknown, ended or past its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Gone;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::jobs::NewJob;

    const WALL: UnixMs = UnixMs(1_700_000_000_000);

    fn at(ms: u64) -> At {
        At {
            now: Mono(ms),
            wall: UnixMs(WALL.0 + ms),
        }
    }

    fn key(s: &str) -> LockKey {
        LockKey::parse("key", s).unwrap()
    }

    fn open(state: &mut State, ttl: u64, now: u64) -> SessionId {
        let id = SessionId::random();
        state
            .open(
                id,
                "test".into(),
                Some(ttl),
                String::new(),
                at(now),
                &mut Effects::default(),
            )
            .unwrap();
        id
    }

    fn acquire(
        state: &mut State,
        id: SessionId,
        k: &str,
        now: u64,
    ) -> Result<Acquired, AcquireError> {
        state.acquire(id, &key(k), at(now), &mut Effects::default())
    }

    #[test]
    fn open_persists_record_and_event() {
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        let id = SessionId::random();
        let opened = state
            .open(id, "alice".into(), None, "{}".into(), at(0), &mut fx)
            .unwrap();
        assert_eq!(opened.ttl_ms, 15_000);
        assert_eq!(opened.deadline, Mono(15_000));
        assert_eq!(opened.revision, 1);
        assert!(matches!(fx.changes[0], Change::PutSession { .. }));
        assert!(
            matches!(&fx.changes[1], Change::Event(e) if e.kind == EventKind::SessionOpened && e.seq == 1)
        );
    }

    #[test]
    fn open_rejects_bad_input_and_changes_nothing() {
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        let cases = [
            ("", Some(5_000), "", "owner"),
            ("a", Some(10), "", "ttl_ms"),
            ("a", None, "[1]", "metadata"),
        ];
        for (owner, ttl, meta, field) in cases {
            let err = state
                .open(
                    SessionId::random(),
                    owner.into(),
                    ttl,
                    meta.into(),
                    at(0),
                    &mut fx,
                )
                .unwrap_err();
            assert_eq!(err.field, field);
        }
        assert!(fx.changes.is_empty());
        assert_eq!(state.revision(), 0);
        assert_eq!(state.session_count(), 0);
    }

    #[test]
    fn heartbeat_extends_and_gone_is_terminal_and_durable() {
        let mut state = State::new(Limits::default());
        let id = open(&mut state, 1_000, 0);
        let beat = state
            .heartbeat(id, None, at(999), &mut Effects::default())
            .unwrap();
        assert_eq!(beat.deadline, Mono(1_999));
        // At the deadline the session is gone, and the answer is made durable: the session
        // is ended in the same change set, so no restart can bring it back.
        let mut fx = Effects::default();
        assert_eq!(
            state.heartbeat(id, None, at(1_999), &mut fx),
            Err(HeartbeatError::Gone)
        );
        assert!(
            fx.changes
                .iter()
                .any(|c| matches!(c, Change::DeleteSession { .. }))
        );
        assert_eq!(fx.ended.len(), 1);
        assert_eq!(fx.ended[0].reason, EndReason::Expired);
        assert_eq!(
            state.heartbeat(id, None, at(1_999), &mut Effects::default()),
            Err(HeartbeatError::Gone)
        );
        // A gone session with a bad TTL is still just gone.
        assert_eq!(
            state.heartbeat(id, Some(1), at(2_001), &mut Effects::default()),
            Err(HeartbeatError::Gone)
        );
        state.check_invariants().unwrap();
    }

    #[test]
    fn heartbeat_with_new_ttl_is_persisted() {
        let mut state = State::new(Limits::default());
        let id = open(&mut state, 1_000, 0);
        let mut fx = Effects::default();
        let beat = state.heartbeat(id, Some(5_000), at(500), &mut fx).unwrap();
        assert_eq!(beat.deadline, Mono(5_500));
        assert_eq!(
            fx.changes,
            vec![Change::SetSessionTtl { id, ttl_ms: 5_000 }]
        );
        // The same TTL again changes nothing durable.
        let mut fx = Effects::default();
        state.heartbeat(id, Some(5_000), at(600), &mut fx).unwrap();
        assert!(fx.changes.is_empty());
        assert!(matches!(
            state.heartbeat(id, Some(1), at(700), &mut fx),
            Err(HeartbeatError::Invalid(_))
        ));
        assert!(state.is_live(id, Mono(700)));
        assert!(!state.is_live(id, Mono(5_600)));
        state.check_invariants().unwrap();
    }

    #[test]
    fn acquire_is_exclusive_idempotent_and_fenced() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 10_000, 0);
        let b = open(&mut state, 10_000, 0);
        let first = acquire(&mut state, a, "k", 1).unwrap();
        assert!(first.fresh);
        let again = acquire(&mut state, a, "k", 2).unwrap();
        assert_eq!(again.token, first.token);
        assert!(!again.fresh);
        assert_eq!(
            acquire(&mut state, b, "k", 3),
            Err(AcquireError::Held {
                holder: a,
                token: first.token
            })
        );
        let mut fx = Effects::default();
        state
            .release(a, &key("k"), first.token, at(4), &mut fx)
            .unwrap();
        assert_eq!(fx.freed_locks, vec![key("k")]);
        let second = acquire(&mut state, b, "k", 4).unwrap();
        assert!(second.token > first.token);
        state.check_invariants().unwrap();
    }

    #[test]
    fn release_needs_live_holder_and_exact_token() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 10_000, 0);
        let b = open(&mut state, 10_000, 0);
        let got = acquire(&mut state, a, "k", 1).unwrap();
        let mut fx = Effects::default();
        assert_eq!(
            state.release(b, &key("k"), got.token, at(2), &mut fx),
            Err(NotHolder)
        );
        assert_eq!(
            state.release(a, &key("k"), Token(got.token.0 - 1), at(2), &mut fx),
            Err(NotHolder)
        );
        assert_eq!(
            state.release(a, &key("free"), got.token, at(2), &mut fx),
            Err(NotHolder)
        );
        assert!(fx.changes.is_empty());
        assert!(
            state
                .release(a, &key("k"), got.token, at(2), &mut fx)
                .is_ok()
        );
        assert_eq!(
            state.release(a, &key("k"), got.token, at(2), &mut Effects::default()),
            Err(NotHolder)
        );
        // Past its deadline a holder no longer holds anything: it is ended, not released.
        let c = open(&mut state, 1_000, 0);
        let got = acquire(&mut state, c, "k", 1).unwrap();
        let mut fx = Effects::default();
        assert_eq!(
            state.release(c, &key("k"), got.token, at(1_000), &mut fx),
            Err(NotHolder)
        );
        assert_eq!(fx.ended.len(), 1);
        assert_eq!(fx.ended[0].released, vec![(key("k"), got.token)]);
        state.check_invariants().unwrap();
    }

    #[test]
    fn expired_holder_is_ended_inline_for_a_contender() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 1_000, 0);
        let b = open(&mut state, 10_000, 0);
        let old = acquire(&mut state, a, "k", 1).unwrap();
        assert!(matches!(
            acquire(&mut state, b, "k", 999),
            Err(AcquireError::Held { .. })
        ));
        let mut fx = Effects::default();
        let got = state.acquire(b, &key("k"), at(1_000), &mut fx).unwrap();
        assert!(got.token > old.token);
        assert_eq!(fx.ended.len(), 1);
        assert_eq!(fx.ended[0].id, a);
        assert_eq!(fx.ended[0].reason, EndReason::Expired);
        assert_eq!(fx.ended[0].released, vec![(key("k"), old.token)]);
        // The contender takes the key in the same change set; it is not offered to waiters.
        assert!(fx.freed_locks.is_empty());
        assert!(matches!(fx.changes[0], Change::DeleteLock { .. }));
        assert!(matches!(fx.changes[1], Change::DeleteSession { .. }));
        assert!(matches!(fx.changes[3], Change::PutLock { .. }));
        assert!(state.session(a, Mono(1_000)).is_none());
        state.check_invariants().unwrap();
    }

    #[test]
    fn expired_session_cannot_acquire() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 1_000, 0);
        let mut fx = Effects::default();
        let r = state.acquire(a, &key("k"), at(1_000), &mut fx);
        assert_eq!(r, Err(AcquireError::SessionGone));
        assert_eq!(fx.ended.len(), 1);
        assert_eq!(state.session_count(), 0);
        assert!(acquire(&mut state, SessionId::random(), "k", 0).is_err());
    }

    #[test]
    fn end_cascades_and_reports_reason() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 10_000, 0);
        for k in ["x", "y", "z"] {
            acquire(&mut state, a, k, 1).unwrap();
        }
        let mut fx = Effects::default();
        let ended = state.end(a, EndReason::Closed, at(5), &mut fx).unwrap();
        assert_eq!(ended.released.len(), 3);
        assert_eq!(ended.reason, EndReason::Closed);
        assert_eq!(state.lock_count(), 0);
        assert_eq!(
            fx.changes
                .iter()
                .filter(|c| matches!(c, Change::DeleteLock { .. }))
                .count(),
            3
        );
        assert_eq!(fx.freed_locks.len(), 3);
        assert!(state.end(a, EndReason::Closed, at(6), &mut fx).is_none());
        // Closing after the deadline is recorded as the expiry it was.
        let b = open(&mut state, 1_000, 0);
        let ended = state.end(b, EndReason::Closed, at(1_000), &mut fx).unwrap();
        assert_eq!(ended.reason, EndReason::Expired);
        state.check_invariants().unwrap();
    }

    #[test]
    fn reap_takes_due_sessions_in_deadline_order_and_bounded() {
        let mut state = State::new(Limits::default());
        let ids: Vec<_> = (0..5)
            .map(|i| open(&mut state, 1_000 + i * 100, 0))
            .collect();
        let live = open(&mut state, 60_000, 0);
        assert_eq!(state.due(Mono(1_250), 100).len(), 3);
        let mut fx = Effects::default();
        let ended = state.reap(at(10_000), 2, &mut fx);
        assert_eq!(ended.iter().map(|e| e.id).collect::<Vec<_>>(), ids[..2]);
        let ended = state.reap(at(10_000), 100, &mut fx);
        assert_eq!(ended.iter().map(|e| e.id).collect::<Vec<_>>(), ids[2..]);
        assert!(state.session(live, Mono(10_000)).is_some());
        assert_eq!(state.earliest_deadline(), Some(Mono(60_000)));
        state.check_invariants().unwrap();
    }

    #[test]
    fn too_many_locks_is_refused() {
        let limits = Limits {
            max_locks_per_session: 2,
            ..Limits::default()
        };
        let mut state = State::new(limits);
        let a = open(&mut state, 10_000, 0);
        acquire(&mut state, a, "1", 0).unwrap();
        acquire(&mut state, a, "2", 0).unwrap();
        assert_eq!(
            acquire(&mut state, a, "3", 0),
            Err(AcquireError::TooManyLocks(2))
        );
        // Re-acquiring one it holds is still fine.
        assert!(acquire(&mut state, a, "1", 0).is_ok());
    }

    #[test]
    fn grace_after_a_third_of_the_ttl() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 3_000, 0);
        assert!(!state.session(a, Mono(1_000)).unwrap().in_grace(Mono(1_000)));
        assert!(state.session(a, Mono(1_001)).unwrap().in_grace(Mono(1_001)));
    }

    #[test]
    fn ending_a_session_settles_seats_and_jobs_in_the_same_change_set() {
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        let pool = key("licences");
        state
            .put_pool(&pool, 1, String::new(), None, at(0), &mut fx)
            .unwrap();
        let queue = key("builds");
        let job = crate::domain::JobId::random();
        let new = |idempotent| NewJob {
            queue: queue.clone(),
            payload: "{}".into(),
            idempotent,
            max_recoveries: Some(1),
            kind: None,
        };
        state.enqueue(job, new(true), at(0), &mut fx).unwrap();
        let a = open(&mut state, 1_000, 0);
        state
            .acquire_seat(a, &pool, String::new(), at(1), &mut fx)
            .unwrap();
        let claim = state.claim(a, &queue, at(1), &mut fx).unwrap().unwrap();
        assert_eq!(claim.job, job);
        let mut fx = Effects::default();
        let ended = state.reap(at(1_000), 10, &mut fx);
        assert_eq!(ended[0].seats.len(), 1);
        assert_eq!(
            ended[0].jobs,
            vec![(job, JobOutcome::Recovered { recovery_count: 1 })]
        );
        assert_eq!(fx.freed_pools, vec![pool.clone()]);
        assert_eq!(fx.ready_queues, vec![queue.clone()]);
        assert!(state.pool_has_room(&pool));
        // The old claim's token is stale now.
        let b = open(&mut state, 10_000, 1_000);
        let mut fx = Effects::default();
        assert_eq!(
            state.finish_job(
                a,
                job,
                claim.token,
                crate::domain::Finish::Complete {
                    result: String::new()
                },
                at(1_001),
                &mut fx
            ),
            Err(crate::domain::JobError::StaleToken)
        );
        let again = state.claim(b, &queue, at(1_001), &mut fx).unwrap().unwrap();
        assert_eq!(again.recovery_count, 1);
        assert_eq!(again.attempt, 2);
        // At the cap, the next orphaning fails the job.
        let ended = state.end(b, EndReason::Admin, at(1_002), &mut fx).unwrap();
        assert_eq!(
            ended.jobs,
            vec![(
                job,
                JobOutcome::Failed {
                    reason: "max_recoveries_exceeded".into()
                }
            )]
        );
        state.check_invariants().unwrap();
    }

    #[test]
    fn restore_gives_every_session_a_fresh_ttl_and_rejects_orphans() {
        let id = SessionId::random();
        let record = LockRecord {
            session_id: id,
            token: Token(7),
            acquired_at: WALL,
        };
        let state = State::restore(
            Limits::default(),
            Restore {
                revision: 9,
                event_seq: 3,
                sessions: vec![(id, 2_000)],
                locks: vec![(key("k"), record.clone())],
                ..Restore::default()
            },
            Mono(50_000),
        )
        .unwrap();
        assert_eq!(
            state.session(id, Mono(51_999)).unwrap().deadline,
            Mono(52_000)
        );
        assert_eq!(state.revision(), 9);
        state.check_invariants().unwrap();

        let orphan = State::restore(
            Limits::default(),
            Restore {
                revision: 9,
                event_seq: 3,
                locks: vec![(key("k"), record.clone())],
                ..Restore::default()
            },
            Mono(0),
        );
        assert!(matches!(orphan, Err(RestoreError::Orphan { .. })));
        let above = State::restore(
            Limits::default(),
            Restore {
                revision: 6,
                event_seq: 3,
                sessions: vec![(id, 2_000)],
                locks: vec![(key("k"), record)],
                ..Restore::default()
            },
            Mono(0),
        );
        assert!(matches!(
            above,
            Err(RestoreError::TokenAboveRevision { .. })
        ));
    }
}
