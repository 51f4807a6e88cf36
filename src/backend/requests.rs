//! Safe retries: a mutation that carries a `request_id` is remembered with its first answer,
//! in the same transaction as its change, so that a retry answers the same instead of acting
//! twice. What every backend stores and how a stored record is judged live here; where and how
//! it is stored is each backend's.
//!
//! Only successes are remembered: a call that failed changed nothing (see the failure
//! contract in [`crate::backend`]), so its retry simply runs again. A call whose outcome was
//! unknown (a timeout) either committed, record and all, or did not, so its retry either
//! finds the record or acts for the first time: never twice.

use serde::{Deserialize, Serialize};

pub use crate::domain::RequestRecord;
use crate::domain::{
    Finish, JobId, LockKey, NewJob, PoolName, QueueName, SessionId, Token, UnixMs,
};

/// The longest `request_id` accepted, in bytes.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Whether `id` is a valid `request_id`: 1 to [`MAX_REQUEST_ID_LEN`] characters of
/// `A-Z a-z 0-9 - _ . : ~` (what a UUID, a ULID or a `host:pid:counter` is written with).
pub fn valid_request_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_REQUEST_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'~'))
}

/// One call's identity for its retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The caller's scope and the client's id, as one key: `{scope}/{request_id}`. The scope
    /// is a digest of the calling token's name (`-` without tokens), so two tokens never share
    /// a record and a key says nothing about which token it belongs to.
    pub key: String,
    /// A digest of what the call asked (route, resource and body without the id): a retry
    /// must ask the same, or it is refused as [`RequestCheck::Reused`].
    pub fingerprint: String,
}

/// A mutation that can be remembered.
#[derive(Debug, Clone)]
pub enum Mutation {
    Acquire {
        id: SessionId,
        key: LockKey,
        wait_ms: u64,
    },
    Release {
        id: SessionId,
        key: LockKey,
        token: Token,
    },
    Enqueue(NewJob),
    /// A session open: `id` is the one drawn for this call; a replay answers the first id.
    Open {
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    },
    /// A job claim, waiting up to `wait_ms`; a replay answers the job first granted.
    Claim {
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
    },
    /// A seat acquire, answered [`Answer::Granted`] with the seat token.
    AcquireSeat {
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
    },
    /// A seat release, answered [`Answer::Released`].
    ReleaseSeat {
        id: SessionId,
        pool: PoolName,
        token: Token,
    },
    /// A job's complete, fail or hand back by its claim.
    Finish {
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
    },
}

/// A remembered first answer. Stored as JSON by every backend (`serde_json`), so the
/// variants and their fields are only ever added to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "answer")]
pub enum Answer {
    Granted {
        token: u64,
        revision: u64,
    },
    Released {
        revision: u64,
    },
    Enqueued {
        job: JobId,
        revision: u64,
    },
    Opened {
        session: SessionId,
        ttl_ms: u64,
        expires_at: u64,
        revision: u64,
    },
    Claimed {
        job: JobId,
        token: u64,
        attempt: u32,
        recovery_count: u32,
        kind: String,
        revision: u64,
    },
    Finished {
        revision: u64,
    },
    /// A claim that found no job before its wait ran out. Never remembered: it changed
    /// nothing, so its retry claims afresh.
    NoJob,
}

impl From<crate::backend::Granted> for Answer {
    fn from(g: crate::backend::Granted) -> Answer {
        Answer::Granted {
            token: g.token.0,
            revision: g.revision,
        }
    }
}

/// A claim's answer: the job it claimed, or [`Answer::NoJob`] (never stored).
impl From<Option<&crate::backend::Claimed>> for Answer {
    fn from(c: Option<&crate::backend::Claimed>) -> Answer {
        c.map_or(Answer::NoJob, Answer::from)
    }
}

impl From<&crate::backend::Claimed> for Answer {
    fn from(c: &crate::backend::Claimed) -> Answer {
        Answer::Claimed {
            job: c.job,
            token: c.token.0,
            attempt: c.attempt,
            recovery_count: c.recovery_count,
            kind: c.kind.clone(),
            revision: c.revision,
        }
    }
}

impl Answer {
    /// The claim this answer remembers; `None` for any other answer.
    pub fn claimed(self) -> Option<crate::backend::Claimed> {
        match self {
            Answer::Claimed {
                job,
                token,
                attempt,
                recovery_count,
                kind,
                revision,
            } => Some(crate::backend::Claimed {
                job,
                token: Token(token),
                attempt,
                recovery_count,
                kind,
                revision,
            }),
            _ => None,
        }
    }

    /// The grant (of a lock or a seat) this answer remembers; `None` for any other answer.
    pub fn granted(self) -> Option<crate::backend::Granted> {
        match self {
            Answer::Granted { token, revision } => Some(crate::backend::Granted {
                token: Token(token),
                revision,
            }),
            _ => None,
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an answer always serializes")
    }

    /// `None` when the text is not an answer this build knows.
    pub fn from_json(text: &str) -> Option<Answer> {
        serde_json::from_str(text).ok()
    }
}

/// What a stored record (or none) says about a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestCheck {
    /// Never seen, or forgotten: act, and remember the answer.
    New,
    /// Seen with the same fingerprint: answer this, act not.
    Replay(Answer),
    /// Seen for a different call: refuse.
    Reused,
}

impl RequestCheck {
    /// Judges `record` at wall time `now`. A record past its expiry is as good as absent,
    /// whether or not it has been purged yet. A record whose answer this build cannot read
    /// is refused rather than acted on twice.
    pub fn of(
        request: &Request,
        record: Option<(&str, &str, UnixMs)>,
        now: UnixMs,
    ) -> RequestCheck {
        match record {
            None => RequestCheck::New,
            Some((_, _, expires_at)) if expires_at <= now => RequestCheck::New,
            Some((fingerprint, _, _)) if fingerprint != request.fingerprint => RequestCheck::Reused,
            Some((_, answer, _)) => match Answer::from_json(answer) {
                Some(a) => RequestCheck::Replay(a),
                None => RequestCheck::Reused,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_bounded_and_plain() {
        for ok in [
            "a",
            "0f3c2a1e-8d4b-4c8e-9a51-3b9e6f0d2c11",
            "host-1:4242:17",
            "A.b_c~d",
        ] {
            assert!(valid_request_id(ok), "{ok}");
        }
        let long = "x".repeat(MAX_REQUEST_ID_LEN + 1);
        for bad in ["", "a b", "a/b", "é", "a\n", long.as_str()] {
            assert!(!valid_request_id(bad), "{bad:?}");
        }
        assert!(valid_request_id(&"x".repeat(MAX_REQUEST_ID_LEN)));
    }

    #[test]
    fn a_record_is_judged_by_fingerprint_and_expiry() {
        let r = Request {
            key: "s/r1".into(),
            fingerprint: "f1".into(),
        };
        let answer = Answer::Released { revision: 7 }.to_json();
        let now = UnixMs(1_000);
        assert_eq!(RequestCheck::of(&r, None, now), RequestCheck::New);
        assert_eq!(
            RequestCheck::of(&r, Some(("f1", &answer, UnixMs(1_001))), now),
            RequestCheck::Replay(Answer::Released { revision: 7 })
        );
        assert_eq!(
            RequestCheck::of(&r, Some(("f2", &answer, UnixMs(1_001))), now),
            RequestCheck::Reused
        );
        assert_eq!(
            RequestCheck::of(&r, Some(("f2", &answer, UnixMs(1_000))), now),
            RequestCheck::New
        );
        assert_eq!(
            RequestCheck::of(&r, Some(("f1", "{}", UnixMs(1_001))), now),
            RequestCheck::Reused
        );
    }

    #[test]
    fn answers_round_trip_as_json() {
        for a in [
            Answer::Granted {
                token: 3,
                revision: 3,
            },
            Answer::Released { revision: 9 },
            Answer::Claimed {
                job: JobId::random(),
                token: 5,
                attempt: 2,
                recovery_count: 1,
                kind: "k".into(),
                revision: 5,
            },
            Answer::Finished { revision: 11 },
            Answer::Enqueued {
                job: JobId::random(),
                revision: 4,
            },
        ] {
            assert_eq!(Answer::from_json(&a.to_json()), Some(a));
        }
    }
}
