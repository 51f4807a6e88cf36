//! What a mutation asks the store to persist: records, deletions and audit events.
//!
//! The records derive serde so the store's codec can write them; their field order is part
//! of the on-disk format (postcard is positional), so fields are only ever appended.

use serde::{Deserialize, Serialize};

use super::ids::{JobId, LockKey, SessionId, Token};
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
    pub const ALL: [EndReason; 3] = [EndReason::Closed, EndReason::Expired, EndReason::Admin];

    /// The reason named `name` (as [`as_str`](Self::as_str) writes it), for backends that
    /// store reasons as text.
    pub fn from_name(name: &str) -> Option<EndReason> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }

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
    PoolPut,
    PoolDeleted,
    SeatAcquired,
    SeatReleased,
    SeatReclaimed,
    JobEnqueued,
    JobClaimed,
    JobCompleted,
    JobFailed,
    JobRecovered,
    JobReleased,
    JobRequeued,
    /// Appended after 0.1.0: postcard numbers variants by position, so kinds are only ever
    /// added at the end.
    TokenFloorRaised,
}

impl EventKind {
    /// Every kind, in declaration order.
    pub const ALL: [EventKind; 19] = [
        EventKind::SessionOpened,
        EventKind::SessionClosed,
        EventKind::SessionExpired,
        EventKind::SessionEndedByAdmin,
        EventKind::LockAcquired,
        EventKind::LockReleased,
        EventKind::PoolPut,
        EventKind::PoolDeleted,
        EventKind::SeatAcquired,
        EventKind::SeatReleased,
        EventKind::SeatReclaimed,
        EventKind::JobEnqueued,
        EventKind::JobClaimed,
        EventKind::JobCompleted,
        EventKind::JobFailed,
        EventKind::JobRecovered,
        EventKind::JobReleased,
        EventKind::JobRequeued,
        EventKind::TokenFloorRaised,
    ];

    /// The kind named `name` (as [`as_str`](Self::as_str) writes it), for backends that
    /// store kinds as text.
    pub fn from_name(name: &str) -> Option<EventKind> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::SessionOpened => "session_opened",
            EventKind::SessionClosed => "session_closed",
            EventKind::SessionExpired => "session_expired",
            EventKind::SessionEndedByAdmin => "session_ended_by_admin",
            EventKind::LockAcquired => "lock_acquired",
            EventKind::LockReleased => "lock_released",
            EventKind::PoolPut => "pool_put",
            EventKind::PoolDeleted => "pool_deleted",
            EventKind::SeatAcquired => "seat_acquired",
            EventKind::SeatReleased => "seat_released",
            EventKind::SeatReclaimed => "seat_reclaimed",
            EventKind::JobEnqueued => "job_enqueued",
            EventKind::JobClaimed => "job_claimed",
            EventKind::JobCompleted => "job_completed",
            EventKind::JobFailed => "job_failed",
            EventKind::JobRecovered => "job_recovered",
            EventKind::JobReleased => "job_released",
            EventKind::JobRequeued => "job_requeued",
            EventKind::TokenFloorRaised => "token_floor_raised",
        }
    }

    /// Whether an operator's or admin's call that writes an event of this kind names its
    /// token in it (`Event::actor`): the ends, reclaims and settlements of a forced end or a
    /// manual reap, and the pool, requeue and floor actions. Grants a waiter receives because
    /// an operator freed something (`lock_acquired`, `seat_acquired`, `job_claimed`) are the
    /// waiter's own and never name the operator.
    pub fn names_actor(self) -> bool {
        matches!(
            self,
            EventKind::SessionEndedByAdmin
                | EventKind::SessionExpired
                | EventKind::SeatReclaimed
                | EventKind::JobRecovered
                | EventKind::JobFailed
                | EventKind::PoolPut
                | EventKind::PoolDeleted
                | EventKind::JobRequeued
                | EventKind::TokenFloorRaised
        )
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
    pub pool: Option<String>,
    pub queue: Option<String>,
    pub job_id: Option<JobId>,
    /// Free text: why a job failed (`max_recoveries_exceeded`, `not_idempotent`, or the
    /// worker's own reason), a pool's new capacity, and the like.
    pub detail: Option<String>,
    /// The name of the API token whose operator or admin call wrote this event (never its
    /// secret); `None` for what clients and the background reaper do, and when the server
    /// runs without tokens. Appended after 0.1.0: the embedded store writes events with it
    /// in record format 2 and still reads format 1 (see its codec).
    pub actor: Option<String>,
}

impl Event {
    /// An event of `kind` with every optional field empty, for the caller to fill in.
    pub fn new(seq: u64, at: UnixMs, kind: EventKind) -> Event {
        Event {
            seq,
            at,
            kind,
            session_id: None,
            key: None,
            token: None,
            reason: None,
            owner: None,
            released: Vec::new(),
            pool: None,
            queue: None,
            job_id: None,
            detail: None,
            actor: None,
        }
    }

    /// Names `actor` in the event if its kind is one an operator's call names (see
    /// [`EventKind::names_actor`]).
    pub fn stamp(&mut self, actor: &str) {
        if self.kind.names_actor() {
            self.actor = Some(actor.to_string());
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRecord {
    pub capacity: u32,
    pub created_at: UnixMs,
    /// Serialized JSON object, or empty.
    pub metadata: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeatRecord {
    pub token: Token,
    pub acquired_at: UnixMs,
    /// Serialized JSON object, or empty: user, host, hardware id, client version.
    pub metadata: String,
}

/// Where a job stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobStatus {
    Queued,
    Claimed {
        session_id: SessionId,
        token: Token,
        claimed_at: UnixMs,
    },
    Done {
        /// Serialized JSON, or empty.
        result: String,
    },
    Failed {
        reason: String,
    },
}

impl JobStatus {
    pub fn name(&self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Claimed { .. } => "claimed",
            JobStatus::Done { .. } => "done",
            JobStatus::Failed { .. } => "failed",
        }
    }

    /// A small number per state, for the store's (queue, state, job) index.
    pub fn code(&self) -> u8 {
        match self {
            JobStatus::Queued => 0,
            JobStatus::Claimed { .. } => 1,
            JobStatus::Done { .. } => 2,
            JobStatus::Failed { .. } => 3,
        }
    }
}

/// A job's durable record, without its payload (stored once, apart, at enqueue).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub queue: String,
    /// Empty when the client gave none.
    pub kind: String,
    pub idempotent: bool,
    pub max_recoveries: u32,
    pub recovery_count: u32,
    /// How many times it has been claimed.
    pub attempt: u32,
    /// Position in its queue: smaller is served first; recovered jobs go below every other.
    pub order: i64,
    pub status: JobStatus,
    pub enqueued_at: UnixMs,
    pub updated_at: UnixMs,
}

/// A remembered answer to a call that carried a `request_id` (see
/// `crate::backend::requests`): the call's fingerprint, its answer as JSON, and the wall time
/// it is forgotten at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub fingerprint: String,
    pub answer: String,
    pub expires_at: UnixMs,
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
    PutPool {
        name: LockKey,
        record: PoolRecord,
    },
    DeletePool {
        name: LockKey,
    },
    PutSeat {
        pool: LockKey,
        session_id: SessionId,
        record: SeatRecord,
    },
    DeleteSeat {
        pool: LockKey,
        session_id: SessionId,
    },
    /// Writes a job's record; `payload` only when it is enqueued. The store keeps its
    /// indexes (by queue and state, by claiming session) in step with the record.
    PutJob {
        id: JobId,
        record: JobRecord,
        payload: Option<String>,
    },
    /// Purges a finished job, payload and all.
    DeleteJob {
        id: JobId,
        queue: LockKey,
    },
    Event(Event),
    /// Remembers the answer to a call with a `request_id`, in the commit of its change.
    PutRequest {
        key: String,
        record: RequestRecord,
    },
    /// Forgets a request id past its retention.
    DeleteRequest {
        key: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind and reason reads back from the name it is stored under, and no two kinds
    /// share a name. (A kind added to `as_str` must be added to `ALL` too, or the text
    /// backends cannot read it back.)
    #[test]
    fn names_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for k in EventKind::ALL {
            assert!(seen.insert(k.as_str()), "{} named twice", k.as_str());
            assert_eq!(EventKind::from_name(k.as_str()), Some(k));
        }
        for r in EndReason::ALL {
            assert_eq!(EndReason::from_name(r.as_str()), Some(r));
        }
        assert_eq!(EventKind::from_name("no_such_kind"), None);
        assert_eq!(EndReason::from_name(""), None);
    }
}
