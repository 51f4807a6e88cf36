//! Identifiers and tokens: newtypes so that a key can never be passed where a session id goes.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::limits::InvalidInput;

/// A session id: a random UUID v4 drawn from the OS RNG.
///
/// It is a capability (whoever knows it may act for the session), so it is never sequential
/// and never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SessionId(pub Uuid);

impl SessionId {
    pub fn random() -> SessionId {
        SessionId(Uuid::new_v4())
    }

    pub fn as_u128(self) -> u128 {
        self.0.as_u128()
    }

    pub fn from_u128(v: u128) -> SessionId {
        SessionId(Uuid::from_u128(v))
    }

    /// Parses the textual form; the field name goes into the error.
    pub fn parse(field: &'static str, text: &str) -> Result<SessionId, InvalidInput> {
        Uuid::try_parse(text)
            .map(SessionId)
            .map_err(|_| InvalidInput::new(field, "must be a session id (a UUID)"))
    }

    /// What logs may show of the id: its first eight hex digits (32 random bits), enough to
    /// find the session in the audit log, far too few to act for it.
    pub fn log_prefix(self) -> String {
        let mut text = self.to_string();
        text.truncate(8);
        text
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

/// Hashes a [`SessionId`] by folding its bits: the id is 122 random bits drawn by the server,
/// so it is its own good hash, and SipHash over it is work for nothing on every lookup.
///
/// Only for maps whose keys the server drew ([`SessionIds`]): an attacker who could choose
/// keys could pick colliding ones; a client can only look up ids, never insert its own.
#[derive(Default, Clone, Copy)]
pub struct SessionIdHasher(u64);

impl std::hash::Hasher for SessionIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // A UUID hashes as its 16 bytes (after a length prefix, which `write_usize` takes).
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(word);
        }
    }

    fn write_usize(&mut self, _len: usize) {}
}

/// A map keyed by session id, hashed by [`SessionIdHasher`].
pub type SessionIds<V> =
    std::collections::HashMap<SessionId, V, std::hash::BuildHasherDefault<SessionIdHasher>>;

/// A job id: a random UUID v4, like session ids never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct JobId(pub Uuid);

impl JobId {
    pub fn random() -> JobId {
        JobId(Uuid::new_v4())
    }

    pub fn as_u128(self) -> u128 {
        self.0.as_u128()
    }

    pub fn from_u128(v: u128) -> JobId {
        JobId(Uuid::from_u128(v))
    }

    pub fn parse(field: &'static str, text: &str) -> Result<JobId, InvalidInput> {
        Uuid::try_parse(text)
            .map(JobId)
            .map_err(|_| InvalidInput::new(field, "must be a job id (a UUID)"))
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

/// A pool name: the same rules as a lock key.
pub type PoolName = LockKey;
/// A queue name: the same rules as a lock key.
pub type QueueName = LockKey;

/// A lock key: 1..=512 bytes of UTF-8 without control characters.
///
/// Shared (`Arc`) between the lock table and the holder's grant list, so holding a key in two
/// indexes costs one allocation.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockKey(Arc<str>);

impl LockKey {
    pub const MAX_BYTES: usize = 512;

    pub fn parse(field: &'static str, text: &str) -> Result<LockKey, InvalidInput> {
        if text.is_empty() {
            return Err(InvalidInput::new(field, "must not be empty"));
        }
        if text.len() > Self::MAX_BYTES {
            return Err(InvalidInput::new(
                field,
                format!("must be at most {} bytes of UTF-8", Self::MAX_BYTES),
            ));
        }
        if text.chars().any(char::is_control) {
            return Err(InvalidInput::new(
                field,
                "must not contain control characters",
            ));
        }
        Ok(LockKey(Arc::from(text)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A map keyed by lock keys is looked up by the key's text: a `LockKey`'s order, equality
/// and hash are its text's.
impl std::borrow::Borrow<str> for LockKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A fencing token: a value of the global revision counter at the moment of a grant.
///
/// Strictly greater than every token issued before it by this store, across restarts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Token(pub u64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_rules() {
        let cases: &[(&str, bool)] = &[
            ("a", true),
            ("jobs/nightly-backup", true),
            ("数据库/迁移", true),
            ("with space", true),
            ("", false),
            ("tab\there", false),
            ("new\nline", false),
            ("nul\0", false),
            ("del\u{7f}", false),
        ];
        for (text, ok) in cases {
            assert_eq!(LockKey::parse("key", text).is_ok(), *ok, "{text:?}");
        }
        assert!(LockKey::parse("key", &"k".repeat(512)).is_ok());
        let err = LockKey::parse("key", &"k".repeat(513)).unwrap_err();
        assert_eq!(err.field, "key");
        // 512 bytes, not characters: 171 three-byte characters are 513 bytes.
        assert!(LockKey::parse("key", &"数".repeat(171)).is_err());
    }

    #[test]
    fn session_ids_hash_apart() {
        use std::hash::BuildHasher;
        let build = std::hash::BuildHasherDefault::<SessionIdHasher>::default();
        let a = SessionId::from_u128(1);
        let b = SessionId::from_u128(1 << 64);
        let c = SessionId::from_u128(2);
        let hashes = [build.hash_one(a), build.hash_one(b), build.hash_one(c)];
        assert_ne!(hashes[0], hashes[1]);
        assert_ne!(hashes[0], hashes[2]);
        assert_eq!(build.hash_one(a), build.hash_one(SessionId::from_u128(1)));
        let mut map: SessionIds<u32> = SessionIds::default();
        for i in 0..1_000u32 {
            map.insert(SessionId::random(), i);
        }
        assert_eq!(map.len(), 1_000);
    }

    #[test]
    fn session_id_parse() {
        let id = SessionId::random();
        assert_eq!(SessionId::parse("session_id", &id.to_string()).unwrap(), id);
        assert_eq!(
            SessionId::parse("session_id", "nope").unwrap_err().field,
            "session_id"
        );
        assert_eq!(SessionId::from_u128(id.as_u128()), id);
    }
}
