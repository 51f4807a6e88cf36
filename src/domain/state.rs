//! The in-memory state of sessions and locks, and every rule that changes it.
//!
//! Invariants (checked by `check_invariants` in tests and by the model-based test):
//! - every lock's holder is a session in `sessions`, and that session lists the key;
//! - every session has exactly one entry in `expiry`, at its current deadline;
//! - every token is at most `revision`, and `revision` only grows.

use std::collections::{BTreeSet, HashMap};

use super::change::{Change, EndReason, Event, EventKind, LockRecord, ReleasedLock, SessionRecord};
use super::ids::{LockKey, SessionId, Token};
use super::limits::{InvalidInput, Limits};
use super::time::{Mono, UnixMs};

#[derive(Debug, Clone)]
struct Session {
    ttl_ms: u64,
    deadline: Mono,
    /// The keys this session holds: the session → grants index that makes the cascade one
    /// lookup. A short vector, since sessions hold few locks and `max_locks_per_session`
    /// bounds the worst case.
    locks: Vec<LockKey>,
}

impl Session {
    fn expired(&self, now: Mono) -> bool {
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

/// A session that ended, with what it released in the same change set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub id: SessionId,
    pub reason: EndReason,
    pub released: Vec<(LockKey, Token)>,
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
#[error("the session does not hold this lock with this token")]
pub struct NotHolder;

/// Sessions, locks, the expiry index and the two durable counters.
#[derive(Debug, Clone)]
pub struct State {
    limits: Limits,
    sessions: HashMap<SessionId, Session>,
    locks: HashMap<LockKey, Lock>,
    /// Ordered by deadline so the reaper finds due sessions in O(due), never by a scan.
    expiry: BTreeSet<(Mono, SessionId)>,
    /// The last revision issued. Every mutation takes the next one; tokens are revisions.
    revision: u64,
    /// The last audit sequence number issued.
    event_seq: u64,
}

/// Everything `State::restore` needs from the store.
pub struct Restore {
    pub revision: u64,
    pub event_seq: u64,
    pub sessions: Vec<(SessionId, u64)>,
    pub locks: Vec<(LockKey, LockRecord)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RestoreError {
    #[error("lock {key:?} names session {session} which does not exist")]
    OrphanLock { key: String, session: SessionId },
    #[error("lock {key:?} has token {token} above the revision counter {revision}")]
    TokenAboveRevision {
        key: String,
        token: u64,
        revision: u64,
    },
}

impl State {
    pub fn new(limits: Limits) -> State {
        State {
            limits,
            sessions: HashMap::new(),
            locks: HashMap::new(),
            expiry: BTreeSet::new(),
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
                },
            );
            state.expiry.insert((deadline, id));
        }
        state.locks.reserve(from.locks.len());
        for (key, record) in from.locks {
            if record.token.0 > state.revision {
                return Err(RestoreError::TokenAboveRevision {
                    key: key.to_string(),
                    token: record.token.0,
                    revision: state.revision,
                });
            }
            let Some(session) = state.sessions.get_mut(&record.session_id) else {
                return Err(RestoreError::OrphanLock {
                    key: key.to_string(),
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
        Ok(state)
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
        Event {
            seq: self.event_seq,
            at,
            kind,
            session_id: None,
            key: None,
            token: None,
            reason: None,
            owner: None,
            released: Vec::new(),
        }
    }

    /// Opens a session. The id comes from the caller (random) so this stays deterministic.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        &mut self,
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: String,
        now: Mono,
        wall: UnixMs,
        out: &mut Vec<Change>,
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
        let deadline = now.plus_ms(ttl_ms);
        self.sessions.insert(
            id,
            Session {
                ttl_ms,
                deadline,
                locks: Vec::new(),
            },
        );
        self.expiry.insert((deadline, id));
        let mut event = self.event(wall, EventKind::SessionOpened);
        event.session_id = Some(id);
        event.owner = Some(owner.clone());
        out.push(Change::PutSession {
            id,
            record: SessionRecord {
                owner,
                ttl_ms,
                created_at: wall,
                metadata,
            },
        });
        out.push(Change::Event(event));
        Ok(Opened {
            revision,
            deadline,
            ttl_ms,
        })
    }

    /// Extends a live session's deadline to `now + ttl`.
    ///
    /// A session at or past its deadline is gone, even before the reaper has ended it, and
    /// since `now` never goes back it stays gone: heartbeat false is terminal. With a new
    /// `ttl_ms` the TTL is persisted (a `SetSessionTtl` change) so that the restart grace uses
    /// it; without one nothing needs persisting and `out` is left untouched.
    pub fn heartbeat(
        &mut self,
        id: SessionId,
        ttl_ms: Option<u64>,
        now: Mono,
        out: &mut Vec<Change>,
    ) -> Result<Beat, HeartbeatError> {
        let new_ttl = match ttl_ms {
            Some(t) => Some(self.limits.ttl(Some(t))?),
            None => None,
        };
        let session = match self.sessions.get_mut(&id) {
            Some(s) if !s.expired(now) => s,
            _ => return Err(HeartbeatError::Gone),
        };
        if let Some(ttl) = new_ttl
            && ttl != session.ttl_ms
        {
            session.ttl_ms = ttl;
            out.push(Change::SetSessionTtl { id, ttl_ms: ttl });
        }
        let old = session.deadline;
        session.deadline = now.plus_ms(session.ttl_ms);
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
        now: Mono,
        wall: UnixMs,
        out: &mut Vec<Change>,
    ) -> Option<Ended> {
        let expired = self.sessions.get(&id)?.expired(now);
        let reason = if expired && reason == EndReason::Closed {
            EndReason::Expired
        } else {
            reason
        };
        Some(self.end_unchecked(id, reason, wall, out))
    }

    fn end_unchecked(
        &mut self,
        id: SessionId,
        reason: EndReason,
        wall: UnixMs,
        out: &mut Vec<Change>,
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
            out.push(Change::DeleteLock {
                key: key.clone(),
                session_id: id,
            });
            released.push((key, lock.token));
        }
        out.push(Change::DeleteSession { id });
        let mut event = self.event(wall, EventKind::for_end(reason));
        event.session_id = Some(id);
        event.reason = Some(reason);
        event.released = released
            .iter()
            .map(|(k, t)| ReleasedLock {
                key: k.to_string(),
                token: *t,
            })
            .collect();
        out.push(Change::Event(event));
        Ended {
            id,
            reason,
            released,
            revision,
        }
    }

    /// Grants `key` to session `id`, or says why not.
    ///
    /// A holder whose session is past its deadline but not yet reaped is ended first, in the
    /// same change set, so a contender never waits for the reaper. The holder asking again
    /// gets its own grant back unchanged. `ended` receives any session ended inline.
    #[allow(clippy::too_many_arguments)]
    pub fn acquire(
        &mut self,
        id: SessionId,
        key: &LockKey,
        now: Mono,
        wall: UnixMs,
        out: &mut Vec<Change>,
        ended: &mut Vec<Ended>,
    ) -> Result<Acquired, AcquireError> {
        match self.sessions.get(&id) {
            None => return Err(AcquireError::SessionGone),
            Some(s) if s.expired(now) => {
                ended.push(self.end_unchecked(id, EndReason::Expired, wall, out));
                return Err(AcquireError::SessionGone);
            }
            Some(_) => {}
        }
        if let Some(lock) = self.locks.get(key) {
            if lock.session == id {
                return Ok(Acquired {
                    token: lock.token,
                    revision: self.revision,
                    fresh: false,
                });
            }
            let holder = lock.session;
            let token = lock.token;
            let holder_expired = self.sessions.get(&holder).is_none_or(|s| s.expired(now));
            if !holder_expired {
                return Err(AcquireError::Held { holder, token });
            }
            ended.push(self.end_unchecked(holder, EndReason::Expired, wall, out));
        }
        let held = self.sessions[&id].locks.len();
        if held >= self.limits.max_locks_per_session {
            return Err(AcquireError::TooManyLocks(held));
        }
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
                acquired_at: wall,
            },
        );
        out.push(Change::PutLock {
            key: key.clone(),
            record: LockRecord {
                session_id: id,
                token,
                acquired_at: wall,
            },
        });
        let mut event = self.event(wall, EventKind::LockAcquired);
        event.session_id = Some(id);
        event.key = Some(key.to_string());
        event.token = Some(token);
        out.push(Change::Event(event));
        Ok(Acquired {
            token,
            revision,
            fresh: true,
        })
    }

    /// Releases `key` if `id` holds it with exactly `token`; returns the revision.
    pub fn release(
        &mut self,
        id: SessionId,
        key: &LockKey,
        token: Token,
        wall: UnixMs,
        out: &mut Vec<Change>,
    ) -> Result<u64, NotHolder> {
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
        out.push(Change::DeleteLock {
            key: key.clone(),
            session_id: id,
        });
        let mut event = self.event(wall, EventKind::LockReleased);
        event.session_id = Some(id);
        event.key = Some(key.to_string());
        event.token = Some(token);
        out.push(Change::Event(event));
        Ok(revision)
    }

    /// Ends up to `limit` sessions whose deadline is at or before `now`, earliest first.
    pub fn reap(
        &mut self,
        now: Mono,
        wall: UnixMs,
        limit: usize,
        out: &mut Vec<Change>,
    ) -> Vec<Ended> {
        let mut ended = Vec::new();
        while ended.len() < limit {
            match self.expiry.first() {
                Some(&(deadline, id)) if deadline <= now => {
                    ended.push(self.end_unchecked(id, EndReason::Expired, wall, out));
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WALL: UnixMs = UnixMs(1_700_000_000_000);

    fn key(s: &str) -> LockKey {
        LockKey::parse("key", s).unwrap()
    }

    fn open(state: &mut State, ttl: u64, now: Mono) -> SessionId {
        let id = SessionId::random();
        state
            .open(
                id,
                "test".into(),
                Some(ttl),
                String::new(),
                now,
                WALL,
                &mut Vec::new(),
            )
            .unwrap();
        id
    }

    fn acquire(
        state: &mut State,
        id: SessionId,
        k: &str,
        now: Mono,
    ) -> Result<Acquired, AcquireError> {
        state.acquire(id, &key(k), now, WALL, &mut Vec::new(), &mut Vec::new())
    }

    #[test]
    fn open_persists_record_and_event() {
        let mut state = State::new(Limits::default());
        let mut out = Vec::new();
        let id = SessionId::random();
        let opened = state
            .open(
                id,
                "alice".into(),
                None,
                "{}".into(),
                Mono(0),
                WALL,
                &mut out,
            )
            .unwrap();
        assert_eq!(opened.ttl_ms, 15_000);
        assert_eq!(opened.deadline, Mono(15_000));
        assert_eq!(opened.revision, 1);
        assert!(matches!(out[0], Change::PutSession { .. }));
        assert!(
            matches!(&out[1], Change::Event(e) if e.kind == EventKind::SessionOpened && e.seq == 1)
        );
    }

    #[test]
    fn open_rejects_bad_input_and_changes_nothing() {
        let mut state = State::new(Limits::default());
        let mut out = Vec::new();
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
                    Mono(0),
                    WALL,
                    &mut out,
                )
                .unwrap_err();
            assert_eq!(err.field, field);
        }
        assert!(out.is_empty());
        assert_eq!(state.revision(), 0);
        assert_eq!(state.session_count(), 0);
    }

    #[test]
    fn heartbeat_extends_and_gone_is_terminal() {
        let mut state = State::new(Limits::default());
        let id = open(&mut state, 1_000, Mono(0));
        let beat = state
            .heartbeat(id, None, Mono(999), &mut Vec::new())
            .unwrap();
        assert_eq!(beat.deadline, Mono(1_999));
        // At the deadline the session is gone, reaped or not, and stays gone.
        assert_eq!(
            state.heartbeat(id, None, Mono(1_999), &mut Vec::new()),
            Err(HeartbeatError::Gone)
        );
        assert_eq!(
            state.heartbeat(id, None, Mono(1_999), &mut Vec::new()),
            Err(HeartbeatError::Gone)
        );
        state.reap(Mono(2_000), WALL, 10, &mut Vec::new());
        assert_eq!(
            state.heartbeat(id, None, Mono(2_001), &mut Vec::new()),
            Err(HeartbeatError::Gone)
        );
        state.check_invariants().unwrap();
    }

    #[test]
    fn heartbeat_with_new_ttl_is_persisted() {
        let mut state = State::new(Limits::default());
        let id = open(&mut state, 1_000, Mono(0));
        let mut out = Vec::new();
        let beat = state
            .heartbeat(id, Some(5_000), Mono(500), &mut out)
            .unwrap();
        assert_eq!(beat.deadline, Mono(5_500));
        assert_eq!(out, vec![Change::SetSessionTtl { id, ttl_ms: 5_000 }]);
        // The same TTL again changes nothing durable.
        out.clear();
        state
            .heartbeat(id, Some(5_000), Mono(600), &mut out)
            .unwrap();
        assert!(out.is_empty());
        assert!(matches!(
            state.heartbeat(id, Some(1), Mono(700), &mut out),
            Err(HeartbeatError::Invalid(_))
        ));
        state.check_invariants().unwrap();
    }

    #[test]
    fn acquire_is_exclusive_idempotent_and_fenced() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 10_000, Mono(0));
        let b = open(&mut state, 10_000, Mono(0));
        let first = acquire(&mut state, a, "k", Mono(1)).unwrap();
        assert!(first.fresh);
        let again = acquire(&mut state, a, "k", Mono(2)).unwrap();
        assert_eq!(again.token, first.token);
        assert!(!again.fresh);
        assert_eq!(
            acquire(&mut state, b, "k", Mono(3)),
            Err(AcquireError::Held {
                holder: a,
                token: first.token
            })
        );
        state
            .release(a, &key("k"), first.token, WALL, &mut Vec::new())
            .unwrap();
        let second = acquire(&mut state, b, "k", Mono(4)).unwrap();
        assert!(second.token > first.token);
        state.check_invariants().unwrap();
    }

    #[test]
    fn release_needs_holder_and_exact_token() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 10_000, Mono(0));
        let b = open(&mut state, 10_000, Mono(0));
        let got = acquire(&mut state, a, "k", Mono(1)).unwrap();
        let mut out = Vec::new();
        assert_eq!(
            state.release(b, &key("k"), got.token, WALL, &mut out),
            Err(NotHolder)
        );
        assert_eq!(
            state.release(a, &key("k"), Token(got.token.0 - 1), WALL, &mut out),
            Err(NotHolder)
        );
        assert_eq!(
            state.release(a, &key("free"), got.token, WALL, &mut out),
            Err(NotHolder)
        );
        assert!(out.is_empty());
        assert!(
            state
                .release(a, &key("k"), got.token, WALL, &mut out)
                .is_ok()
        );
        assert_eq!(
            state.release(a, &key("k"), got.token, WALL, &mut out.clone()),
            Err(NotHolder)
        );
    }

    #[test]
    fn expired_holder_is_ended_inline_for_a_contender() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 1_000, Mono(0));
        let b = open(&mut state, 10_000, Mono(0));
        let old = acquire(&mut state, a, "k", Mono(1)).unwrap();
        assert!(matches!(
            acquire(&mut state, b, "k", Mono(999)),
            Err(AcquireError::Held { .. })
        ));
        let mut out = Vec::new();
        let mut ended = Vec::new();
        let got = state
            .acquire(b, &key("k"), Mono(1_000), WALL, &mut out, &mut ended)
            .unwrap();
        assert!(got.token > old.token);
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].id, a);
        assert_eq!(ended[0].reason, EndReason::Expired);
        assert_eq!(ended[0].released, vec![(key("k"), old.token)]);
        // Deleting the old grant, the session and its event come before the new grant.
        assert!(matches!(out[0], Change::DeleteLock { .. }));
        assert!(matches!(out[1], Change::DeleteSession { .. }));
        assert!(matches!(out[3], Change::PutLock { .. }));
        assert!(state.session(a, Mono(1_000)).is_none());
        state.check_invariants().unwrap();
    }

    #[test]
    fn expired_session_cannot_acquire() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 1_000, Mono(0));
        let mut ended = Vec::new();
        let r = state.acquire(a, &key("k"), Mono(1_000), WALL, &mut Vec::new(), &mut ended);
        assert_eq!(r, Err(AcquireError::SessionGone));
        assert_eq!(ended.len(), 1);
        assert_eq!(state.session_count(), 0);
        assert!(acquire(&mut state, SessionId::random(), "k", Mono(0)).is_err());
    }

    #[test]
    fn end_cascades_and_reports_reason() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 10_000, Mono(0));
        for k in ["x", "y", "z"] {
            acquire(&mut state, a, k, Mono(1)).unwrap();
        }
        let mut out = Vec::new();
        let ended = state
            .end(a, EndReason::Closed, Mono(5), WALL, &mut out)
            .unwrap();
        assert_eq!(ended.released.len(), 3);
        assert_eq!(ended.reason, EndReason::Closed);
        assert_eq!(state.lock_count(), 0);
        assert_eq!(
            out.iter()
                .filter(|c| matches!(c, Change::DeleteLock { .. }))
                .count(),
            3
        );
        assert!(
            state
                .end(a, EndReason::Closed, Mono(6), WALL, &mut out)
                .is_none()
        );
        // Closing after the deadline is recorded as the expiry it was.
        let b = open(&mut state, 1_000, Mono(0));
        let ended = state
            .end(b, EndReason::Closed, Mono(1_000), WALL, &mut out)
            .unwrap();
        assert_eq!(ended.reason, EndReason::Expired);
        state.check_invariants().unwrap();
    }

    #[test]
    fn reap_takes_due_sessions_in_deadline_order_and_bounded() {
        let mut state = State::new(Limits::default());
        let ids: Vec<_> = (0..5)
            .map(|i| open(&mut state, 1_000 + i * 100, Mono(0)))
            .collect();
        let live = open(&mut state, 60_000, Mono(0));
        assert_eq!(state.due(Mono(1_250), 100).len(), 3);
        let mut out = Vec::new();
        let ended = state.reap(Mono(10_000), WALL, 2, &mut out);
        assert_eq!(ended.iter().map(|e| e.id).collect::<Vec<_>>(), ids[..2]);
        let ended = state.reap(Mono(10_000), WALL, 100, &mut out);
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
        let a = open(&mut state, 10_000, Mono(0));
        acquire(&mut state, a, "1", Mono(0)).unwrap();
        acquire(&mut state, a, "2", Mono(0)).unwrap();
        assert_eq!(
            acquire(&mut state, a, "3", Mono(0)),
            Err(AcquireError::TooManyLocks(2))
        );
        // Re-acquiring one it holds is still fine.
        assert!(acquire(&mut state, a, "1", Mono(0)).is_ok());
    }

    #[test]
    fn grace_after_a_third_of_the_ttl() {
        let mut state = State::new(Limits::default());
        let a = open(&mut state, 3_000, Mono(0));
        assert!(!state.session(a, Mono(1_000)).unwrap().in_grace(Mono(1_000)));
        assert!(state.session(a, Mono(1_001)).unwrap().in_grace(Mono(1_001)));
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
                sessions: vec![],
                locks: vec![(key("k"), record.clone())],
            },
            Mono(0),
        );
        assert!(matches!(orphan, Err(RestoreError::OrphanLock { .. })));
        let above = State::restore(
            Limits::default(),
            Restore {
                revision: 6,
                event_seq: 3,
                sessions: vec![(id, 2_000)],
                locks: vec![(key("k"), record)],
            },
            Mono(0),
        );
        assert!(matches!(
            above,
            Err(RestoreError::TokenAboveRevision { .. })
        ));
    }
}
