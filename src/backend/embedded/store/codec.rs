//! Record encoding: one format byte, then postcard.
//!
//! The format byte lets a later release read old records and migrate them; it is only ever
//! added to. Postcard's wire format is stable since 1.0.
//!
//! Audit events are written in format 2, which appends `actor` to the layout of format 1;
//! an event of format 1 (written before `actor` existed) reads with no actor. Its stored
//! bytes are never rewritten, so the hash chain over them still verifies.

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::domain::{EndReason, Event, EventKind, JobId, ReleasedLock, SessionId, Token, UnixMs};

/// The format every record but an event is written in today.
pub const FORMAT_V1: u8 = 1;
/// The format events are written in today: format 1's layout and then `actor`.
pub const FORMAT_V2: u8 = 2;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("record is empty")]
    Empty,
    #[error("record has format {0}, which this build does not read (it reads up to {FORMAT_V2})")]
    UnknownFormat(u8),
    #[error("record does not decode: {0}")]
    Postcard(#[from] postcard::Error),
}

/// Room a record's bytes start with: most records fit, so encoding allocates once rather
/// than growing the buffer from one byte through every power of two.
const RECORD_ROOM: usize = 64;
/// The same for an audit event, which carries more text (a key, an owner, a reason).
pub const EVENT_ROOM: usize = 192;

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut buf = Vec::with_capacity(RECORD_ROOM);
    buf.push(FORMAT_V1);
    // Serializing plain structs into a Vec cannot fail.
    postcard::to_io(value, &mut buf).expect("postcard encodes into a Vec");
    buf
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_head(bytes)
}

/// Decodes the leading fields of a record, borrowing its text from `bytes`: for a reader
/// that needs one field of a record and not a copy of all of it. Postcard is positional and
/// fields are only appended, so a struct of a record's first fields reads its bytes.
pub fn decode_head<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, CodecError> {
    match bytes.split_first() {
        None => Err(CodecError::Empty),
        Some((&FORMAT_V1, rest)) => Ok(postcard::from_bytes(rest)?),
        Some((&other, _)) => Err(CodecError::UnknownFormat(other)),
    }
}

/// An event as format 1 laid it out: every field of [`Event`] before `actor`, in order.
/// Never changed: it is how events written before format 2 read.
#[derive(Serialize, Deserialize)]
struct EventV1 {
    seq: u64,
    at: UnixMs,
    kind: EventKind,
    session_id: Option<SessionId>,
    key: Option<String>,
    token: Option<Token>,
    reason: Option<EndReason>,
    owner: Option<String>,
    released: Vec<ReleasedLock>,
    pool: Option<String>,
    queue: Option<String>,
    job_id: Option<JobId>,
    detail: Option<String>,
}

impl From<EventV1> for Event {
    fn from(e: EventV1) -> Event {
        Event {
            seq: e.seq,
            at: e.at,
            kind: e.kind,
            session_id: e.session_id,
            key: e.key,
            token: e.token,
            reason: e.reason,
            owner: e.owner,
            released: e.released,
            pool: e.pool,
            queue: e.queue,
            job_id: e.job_id,
            detail: e.detail,
            actor: None,
        }
    }
}

/// Encodes `event` into `buf`, replacing what it held: a commit that appends hundreds of
/// events encodes them all through one buffer instead of allocating one each.
pub fn encode_event_into(event: &Event, buf: &mut Vec<u8>) {
    buf.clear();
    buf.push(FORMAT_V2);
    postcard::to_io(event, &mut *buf).expect("postcard encodes into a Vec");
}

/// Reads an event of either format.
pub fn decode_event(bytes: &[u8]) -> Result<Event, CodecError> {
    match bytes.split_first() {
        None => Err(CodecError::Empty),
        Some((&FORMAT_V1, rest)) => Ok(postcard::from_bytes::<EventV1>(rest)?.into()),
        Some((&FORMAT_V2, rest)) => Ok(postcard::from_bytes(rest)?),
        Some((&other, _)) => Err(CodecError::UnknownFormat(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::LockRecord;

    fn encode_event(event: &Event) -> Vec<u8> {
        let mut buf = Vec::new();
        encode_event_into(event, &mut buf);
        buf
    }

    #[test]
    fn round_trip_and_format_byte() {
        let rec = LockRecord {
            session_id: SessionId::random(),
            token: Token(42),
            acquired_at: UnixMs(1_700_000_000_000),
        };
        let bytes = encode(&rec);
        assert_eq!(bytes[0], FORMAT_V1);
        assert_eq!(decode::<LockRecord>(&bytes).unwrap(), rec);
        let mut future = bytes.clone();
        future[0] = 9;
        assert!(matches!(
            decode::<LockRecord>(&future),
            Err(CodecError::UnknownFormat(9))
        ));
        assert!(matches!(decode::<LockRecord>(&[]), Err(CodecError::Empty)));
        assert!(decode::<LockRecord>(&bytes[..5]).is_err());
    }

    fn sample_event() -> Event {
        let mut e = Event::new(7, UnixMs(1_700_000_000_000), EventKind::SessionEndedByAdmin);
        e.session_id = Some(SessionId::random());
        e.reason = Some(EndReason::Admin);
        e.released = vec![ReleasedLock {
            key: "k".into(),
            token: Token(3),
        }];
        e.detail = Some("d".into());
        e
    }

    /// An event written before `actor` existed (format 1, as 0.1.0 and later wrote it)
    /// still reads, with no actor; one written now round-trips its actor.
    #[test]
    fn events_of_format_1_read_with_no_actor() {
        let e = sample_event();
        let v1 = EventV1 {
            seq: e.seq,
            at: e.at,
            kind: e.kind,
            session_id: e.session_id,
            key: e.key.clone(),
            token: e.token,
            reason: e.reason,
            owner: e.owner.clone(),
            released: e.released.clone(),
            pool: e.pool.clone(),
            queue: e.queue.clone(),
            job_id: e.job_id,
            detail: e.detail.clone(),
        };
        // What the generic record encoding wrote for events before format 2.
        let old = encode(&v1);
        assert_eq!(old[0], FORMAT_V1);
        assert_eq!(decode_event(&old).unwrap(), e);

        let mut named = e.clone();
        named.actor = Some("ops-1".into());
        let new = encode_event(&named);
        assert_eq!(new[0], FORMAT_V2);
        assert_eq!(decode_event(&new).unwrap(), named);
        // The actor is in the stored bytes, so the hash chain over them covers it.
        assert_ne!(encode_event(&e), new);
        assert!(decode_event(&new[..new.len() - 1]).is_err());
        assert!(matches!(decode_event(&[]), Err(CodecError::Empty)));
        assert!(matches!(
            decode_event(&[9, 0]),
            Err(CodecError::UnknownFormat(9))
        ));
    }

    /// The bytes of a format-1 event, fixed: a change to `EventV1` or to how postcard lays
    /// it out would make old data files unreadable, and fails here first.
    #[test]
    fn a_stored_format_1_event_decodes() {
        // seq 5, at 1000, kind pool_put (6), no session/key/token/reason/owner, no releases,
        // pool "p", no queue/job, detail "capacity 2".
        let mut bytes = vec![
            1, 5, 0xe8, 0x07, 6, 0, 0, 0, 0, 0, 0, 1, 1, b'p', 0, 0, 1, 10,
        ];
        bytes.extend_from_slice(b"capacity 2");
        let e = decode_event(&bytes).unwrap();
        let mut want = Event::new(5, UnixMs(1000), EventKind::PoolPut);
        want.pool = Some("p".into());
        want.detail = Some("capacity 2".into());
        assert_eq!(e, want);
    }
}
