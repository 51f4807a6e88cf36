//! What a mutation asks the store to persist: records, deletions and audit events.
//!
//! The records derive serde so the store's codec can write them; their field order is part
//! of the on-disk format (postcard is positional), so fields are only ever appended.

use serde::{Deserialize, Serialize};

use super::ids::{LockKey, SessionId, Token};
use super::time::UnixMs;

/// The durable part of a session. The deadline is not here: it lives on the monotonic clock
/// and is rebuilt as `now + ttl` at start-up (the restart grace).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub owner: String,
    pub ttl_ms: u64,
    pub created_at: UnixMs,
    /// Serialized JSON object, or empty when the client sent none.
    pub metadata: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockRecord {
    pub session_id: SessionId,
    pub token: Token,
    pub acquired_at: UnixMs,
}

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// Its client closed it.
    Closed,
    /// It stopped heartbeating and its deadline passed.
    Expired,
    /// An operator ended it.
    Admin,
}

impl EndReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Closed => "closed",
            EndReason::Expired => "expired",
            EndReason::Admin => "admin",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    SessionOpened,
    SessionClosed,
    SessionExpired,
    SessionEndedByAdmin,
    LockAcquired,
    LockReleased,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::SessionOpened => "session_opened",
            EventKind::SessionClosed => "session_closed",
            EventKind::SessionExpired => "session_expired",
            EventKind::SessionEndedByAdmin => "session_ended_by_admin",
            EventKind::LockAcquired => "lock_acquired",
            EventKind::LockReleased => "lock_released",
        }
    }

    pub fn for_end(reason: EndReason) -> EventKind {
        match reason {
            EndReason::Closed => EventKind::SessionClosed,
            EndReason::Expired => EventKind::SessionExpired,
            EndReason::Admin => EventKind::SessionEndedByAdmin,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleasedLock {
    pub key: String,
    pub token: Token,
}

/// One audit event. `seq` strictly increases across the store's whole life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub seq: u64,
    pub at: UnixMs,
    pub kind: EventKind,
    pub session_id: Option<SessionId>,
    pub key: Option<String>,
    pub token: Option<Token>,
    pub reason: Option<EndReason>,
    pub owner: Option<String>,
    /// For a session's end: every lock released with it, in the same transaction.
    pub released: Vec<ReleasedLock>,
}

/// One thing to persist. A batch of changes from one or more requests is written in one
/// transaction, followed by the counters (`revision`, `event_seq`) as they stand after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    PutSession {
        id: SessionId,
        record: SessionRecord,
    },
    SetSessionTtl {
        id: SessionId,
        ttl_ms: u64,
    },
    /// Deletes the session record; its locks are deleted by their own `DeleteLock` changes,
    /// emitted in the same batch (the cascade).
    DeleteSession {
        id: SessionId,
    },
    PutLock {
        key: LockKey,
        record: LockRecord,
    },
    DeleteLock {
        key: LockKey,
        session_id: SessionId,
    },
    Event(Event),
}
