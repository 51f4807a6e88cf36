//! JSON shapes shared by several resources.

use serde::Serialize;

use crate::backend::SessionInfo;
use crate::domain::{Event, LockRecord, UnixMs};

#[derive(Serialize)]
pub struct HeldLock {
    pub key: String,
    pub token: u64,
}

#[derive(Serialize)]
pub struct Session {
    pub session_id: String,
    pub owner: String,
    pub ttl_ms: u64,
    pub created_at: u64,
    pub expires_at: u64,
    pub last_heartbeat_at: u64,
    /// `active`, or `grace` once a third of the TTL has passed without a heartbeat.
    pub state: &'static str,
    pub metadata: serde_json::Value,
    pub locks: Vec<HeldLock>,
    pub seats: Vec<HeldSeat>,
    pub jobs: Vec<String>,
}

#[derive(Serialize)]
pub struct HeldSeat {
    pub pool: String,
    pub seat_token: u64,
}

/// Stored JSON text back to a value; empty (none given) is null.
pub fn json_or_null(text: &str) -> serde_json::Value {
    if text.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_str(text).unwrap_or(serde_json::Value::Null)
    }
}

impl From<SessionInfo> for Session {
    fn from(s: SessionInfo) -> Session {
        let metadata = json_or_null(&s.record.metadata);
        Session {
            session_id: s.id.to_string(),
            owner: s.record.owner,
            ttl_ms: s.ttl_ms,
            created_at: s.record.created_at.0,
            expires_at: s.expires_at.0,
            last_heartbeat_at: s.last_heartbeat_at.0,
            state: if s.grace { "grace" } else { "active" },
            metadata,
            locks: s
                .locks
                .into_iter()
                .map(|(key, token)| HeldLock {
                    key,
                    token: token.0,
                })
                .collect(),
            seats: s
                .seats
                .into_iter()
                .map(|(pool, token)| HeldSeat {
                    pool,
                    seat_token: token.0,
                })
                .collect(),
            jobs: s.jobs.into_iter().map(|j| j.to_string()).collect(),
        }
    }
}

#[derive(Serialize)]
pub struct Lock {
    pub key: String,
    pub session_id: String,
    pub token: u64,
    pub acquired_at: u64,
}

impl Lock {
    pub fn new(key: String, r: LockRecord) -> Lock {
        Lock {
            key,
            session_id: r.session_id.to_string(),
            token: r.token.0,
            acquired_at: r.acquired_at.0,
        }
    }
}

#[derive(Serialize)]
pub struct AuditEvent {
    pub seq: u64,
    pub at: u64,
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub released: Vec<HeldLock>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The API token of the operator or admin action that wrote the event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
}

impl From<Event> for AuditEvent {
    fn from(e: Event) -> AuditEvent {
        AuditEvent {
            seq: e.seq,
            at: e.at.0,
            kind: e.kind.as_str(),
            session_id: e.session_id.map(|s| s.to_string()),
            key: e.key,
            token: e.token.map(|t| t.0),
            reason: e.reason.map(|r| r.as_str().to_string()).or_else(|| {
                // A job failure's reason is its detail.
                (e.kind == crate::domain::EventKind::JobFailed)
                    .then(|| e.detail.clone())
                    .flatten()
            }),
            owner: e.owner,
            released: e
                .released
                .into_iter()
                .map(|r| HeldLock {
                    key: r.key,
                    token: r.token.0,
                })
                .collect(),
            pool: e.pool,
            queue: e.queue,
            job_id: e.job_id.map(|j| j.to_string()),
            // A job failure's detail is already its reason.
            detail: e
                .detail
                .filter(|_| e.kind != crate::domain::EventKind::JobFailed),
            actor: e.actor,
        }
    }
}

pub fn ms(t: UnixMs) -> u64 {
    t.0
}
