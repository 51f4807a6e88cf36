//! The aggregate: sessions, locks, the expiry index and the two durable counters, holding the
//! pool table (`Pools`) and the job table (`Jobs`), with the rules that cross them.
//!
//! The session and lock rules live here, with the cascade: ending a session releases its
//! locks, reclaims its seats and settles its jobs in one change set. The seat rules
//! (`seats`) and the job rules (`queues`) are further `impl State` blocks: they decide who
//! may take what, draw tokens and record events, and leave each table to keep itself in step.
//!
//! Invariants (checked by `check_invariants` in tests and by the model-based test):
//! - every lock's, seat's and claimed job's holder is a session in `sessions`, and that
//!   session lists it (the session → grants index that makes the cascade one lookup);
//! - every session has exactly one entry in `expiry`, at its current deadline;
//! - every token is at most `revision`, and `revision` only grows;
//! - a pool never gains a holder while it is at or above its capacity.

use std::collections::{BTreeSet, HashMap};

use smallvec::SmallVec;

pub use floor::{FloorRaised, MAX_TOKEN_FLOOR, floor_detail, validate_token_floor};

mod floor;
mod queues;
mod seats;
#[cfg(test)]
mod tests;

use super::change::{
    Change, EndReason, Event, EventKind, JobRecord, LockRecord, ReleasedLock, SessionRecord,
};
use super::ids::{JobId, LockKey, PoolName, QueueName, SessionId, SessionIds, Token};
use super::jobs::{JobOutcome, Jobs};
use super::limits::{InvalidInput, Limits};
use super::pools::Pools;
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

/// How many due sessions a reaper pass takes off the expiry index at a time, to warm their
/// entries together before ending them one by one (see [`State::warm`]).
const REAP_AHEAD: usize = 32;

/// Whether an end emits the deletes of the session's row and its grants.
#[derive(Debug, Clone, Copy)]
enum Rows {
    Delete,
    /// The store deletes them from the ended session's id (its end log).
    Leave,
}

#[derive(Debug, Clone)]
struct Session {
    ttl_ms: u64,
    deadline: Mono,
    /// The keys, pools and jobs this session holds. Short vectors: sessions hold few
    /// grants, and `max_locks_per_session` bounds the locks.
    ///
    /// The first key is kept inline, in the session's own entry: most holders hold one
    /// lock, and ending a session reads its keys, so a separate buffer was one more cache
    /// miss (and an allocation at the grant) for each of a million sessions a storm ends.
    locks: SmallVec<[LockKey; 1]>,
    seats: Vec<PoolName>,
    jobs: Vec<JobId>,
}

impl Session {
    fn new(ttl_ms: u64, deadline: Mono) -> Session {
        Session {
            ttl_ms,
            deadline,
            locks: SmallVec::new(),
            seats: Vec::new(),
            jobs: Vec::new(),
        }
    }

    fn expired(&self, now: Mono) -> bool {
        now >= self.deadline
    }
}

/// Removes the first `item` from a session's short list of grants.
fn unlist<T: PartialEq>(list: &mut Vec<T>, item: &T) {
    if let Some(pos) = list.iter().position(|x| x == item) {
        list.swap_remove(pos);
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
    /// Inline for the usual one lock: a storm ends a million of these.
    pub released: SmallVec<[(LockKey, Token); 1]>,
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
    limits: Limits,
    sessions: SessionIds<Session>,
    /// Keyed by the users' strings, so hashed with a per-process random seed (foldhash's
    /// fast keyed hash: SipHash cost a measurable share of ending a session).
    locks: HashMap<LockKey, Lock, foldhash::fast::RandomState>,
    /// Ordered by deadline so the reaper finds due sessions in O(due), never by a scan.
    expiry: BTreeSet<(Mono, SessionId)>,
    pools: Pools,
    jobs: Jobs,
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
    pub jobs: Vec<(JobId, JobRecord)>,
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
            sessions: SessionIds::default(),
            locks: HashMap::default(),
            expiry: BTreeSet::new(),
            pools: Pools::default(),
            jobs: Jobs::default(),
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
        let mut expiry = Vec::with_capacity(from.sessions.len());
        for (id, ttl_ms) in from.sessions {
            let deadline = now.plus_ms(ttl_ms);
            state.sessions.insert(id, Session::new(ttl_ms, deadline));
            expiry.push((deadline, id));
        }
        // Built in one go (`from_iter` sorts, then fills the tree bottom-up): a million
        // inserts in random id order cost a cache miss each, most of a restart's time.
        state.expiry = BTreeSet::from_iter(expiry);
        state.locks.reserve(from.locks.len());
        for (key, record) in from.locks {
            state.check_token(|| format!("lock {key:?}"), record.token)?;
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

    /// `what` names the record in the error; it is only formatted for one.
    fn check_token(&self, what: impl FnOnce() -> String, token: Token) -> Result<(), RestoreError> {
        if token.0 > self.revision {
            return Err(RestoreError::TokenAboveRevision {
                what: what(),
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

    fn next_revision(&mut self) -> u64 {
        self.revision += 1;
        self.revision
    }

    fn event(&mut self, at: UnixMs, kind: EventKind) -> Event {
        self.event_seq += 1;
        Event::new(self.event_seq, at, kind)
    }

    /// The live session `id`, or why not. A session past its deadline is ended inline
    /// (recorded as expired) so that every later call finds it gone, durably.
    fn live_or_end(&mut self, id: SessionId, at: At, fx: &mut Effects) -> Result<(), Gone> {
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

    /// Whether `id` is live at `at`, asked on a write path about to answer "gone": a session
    /// past its deadline is ended inline (recorded as expired), so that once these changes
    /// are committed the answer is durable.
    pub fn live_or_end_expired(&mut self, id: SessionId, at: At, fx: &mut Effects) -> bool {
        self.live_or_end(id, at, fx).is_ok()
    }

    /// Whether `id` is live at `now`, asked by a reader about to answer "gone".
    ///
    /// Reads change nothing a client can see, so a session past its deadline is not ended
    /// here (that is the reaper's, or a contender's). It loses its restart grace instead: its
    /// TTL, in memory and persisted, becomes 0, so that a restart, which gives every session
    /// `now + ttl`, finds it due at once rather than reviving it. Once that change is
    /// committed the answer "gone" holds across any restart. The TTL is not read again
    /// while the process lives: past its deadline, the session can only be ended.
    pub fn confirm_live(&mut self, id: SessionId, now: Mono, fx: &mut Effects) -> bool {
        match self.sessions.get_mut(&id) {
            None => false,
            Some(s) if s.expired(now) => {
                if s.ttl_ms != 0 {
                    s.ttl_ms = 0;
                    fx.changes.push(Change::SetSessionTtl { id, ttl_ms: 0 });
                }
                false
            }
            Some(_) => true,
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
        self.sessions.insert(id, Session::new(ttl_ms, deadline));
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

    fn end_unchecked(
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
        self.end_unlisted(id, session, reason, Rows::Delete, at, fx)
    }

    /// Ends `session`, already taken out of `sessions` and `expiry`: releases its locks,
    /// seats and jobs and records the end, all in `fx`; the deletes of the session's row and
    /// its grants only with `Rows::Delete`.
    fn end_unlisted(
        &mut self,
        id: SessionId,
        session: Session,
        reason: EndReason,
        rows: Rows,
        at: At,
        fx: &mut Effects,
    ) -> Ended {
        let revision = self.next_revision();
        let mut released = SmallVec::with_capacity(session.locks.len());
        let mut listed = Vec::with_capacity(session.locks.len());
        for key in session.locks {
            let lock = self
                .locks
                .remove(&key)
                .expect("a session's grant list only names locks it holds");
            debug_assert_eq!(lock.session, id);
            listed.push(ReleasedLock {
                key: key.to_string(),
                token: lock.token,
            });
            if let Rows::Delete = rows {
                fx.changes.push(Change::DeleteLock {
                    key: key.clone(),
                    session_id: id,
                });
            }
            fx.freed_locks.push(key.clone());
            released.push((key, lock.token));
        }
        let seats = self.reclaim_seats(id, session.seats, reason, at, fx);
        let jobs = self.settle_jobs(id, session.jobs, at, fx);
        if let Rows::Delete = rows {
            fx.changes.push(Change::DeleteSession { id });
        }
        let mut event = self.event(at.wall, EventKind::for_end(reason));
        event.session_id = Some(id);
        event.reason = Some(reason);
        event.released = listed;
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
        self.reap_rows(at, limit, Rows::Delete, fx)
    }

    /// As [`reap`](Self::reap), but leaves the ended sessions' rows and grants out of `fx`:
    /// for a store that deletes them itself, later, from the ids in the returned ends (the
    /// embedded store's end log). Everything else an end writes (its seats, jobs and audit
    /// events) is in `fx` as with `reap`.
    pub fn reap_leaving_rows(&mut self, at: At, limit: usize, fx: &mut Effects) -> Vec<Ended> {
        self.reap_rows(at, limit, Rows::Leave, fx)
    }

    fn reap_rows(&mut self, at: At, limit: usize, rows: Rows, fx: &mut Effects) -> Vec<Ended> {
        // Sized once: a storm's pass ends hundreds, and growing would copy them each time.
        let mut ended = Vec::with_capacity(limit.min(self.expiry.len()));
        let mut due = [SessionId::from_u128(0); REAP_AHEAD];
        while ended.len() < limit {
            // One walk of the expiry index per session: taken off it here, not looked up
            // again by the end.
            let want = (limit - ended.len()).min(REAP_AHEAD);
            let mut n = 0;
            while n < want {
                match self.expiry.first() {
                    Some(&(deadline, _)) if deadline <= at.now => {}
                    _ => break,
                }
                due[n] = self.expiry.pop_first().expect("just seen").1;
                n += 1;
            }
            if n == 0 {
                break;
            }
            self.warm(&due[..n]);
            // Ending a session releases its own grants and settles its own jobs, and never
            // ends or touches another session, so every id taken off the index above is
            // still present when its turn comes.
            for &id in &due[..n] {
                let session = self
                    .sessions
                    .remove(&id)
                    .expect("every expiry entry names a present session");
                ended.push(self.end_unlisted(id, session, EndReason::Expired, rows, at, fx));
            }
        }
        ended
    }

    /// Reads what ending the sessions `ids` will read first — each one's entry, its first
    /// lock key and that key's entry in the lock table — one lookup after another but
    /// independent of each other, so that the processor waits for their cache misses
    /// together rather than one session's at a time. A storm's sessions were opened and
    /// granted long before, scattered over memory: these misses were most of what ending
    /// one cost.
    fn warm(&self, ids: &[SessionId]) {
        for id in ids {
            if let Some(key) = self.sessions.get(id).and_then(|s| s.locks.first()) {
                std::hint::black_box(key.as_str().as_bytes().first().copied());
            }
        }
        // Each session is found again here (in cache by now) rather than its key kept from
        // the loop above: keeping the keys in an array measured slower (criterion
        // `domain/reap/1000000`: 1.48 s against 1.10 s).
        for id in ids {
            if let Some(key) = self.sessions.get(id).and_then(|s| s.locks.first()) {
                std::hint::black_box(self.locks.get(key));
            }
        }
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
        self.check_seats()?;
        self.check_claims()?;
        Ok(())
    }
}

/// The caller's session is unknown, ended or past its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Gone;
