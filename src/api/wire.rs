//! JSON shapes shared by several resources.

use serde::Serialize;

use crate::domain::{Event, LockRecord, UnixMs};
use crate::engine::SessionInfo;

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
}

impl From<SessionInfo> for Session {
    fn from(s: SessionInfo) -> Session {
        let metadata = if s.record.metadata.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(&s.record.metadata).unwrap_or(serde_json::Value::Null)
        };
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
    pub reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub released: Vec<HeldLock>,
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
            reason: e.reason.map(|r| r.as_str()),
            owner: e.owner,
            released: e
                .released
                .into_iter()
                .map(|r| HeldLock {
                    key: r.key,
                    token: r.token.0,
                })
                .collect(),
        }
    }
}

pub fn ms(t: UnixMs) -> u64 {
    t.0
}
