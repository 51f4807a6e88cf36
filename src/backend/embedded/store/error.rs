//! The store's one error type.

use std::path::PathBuf;

use super::codec::CodecError;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("storage: {0}")]
    Redb(#[from] redb::Error),
    #[error("cannot use data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("corrupt {table} record: {source}")]
    Corrupt {
        table: &'static str,
        source: CodecError,
    },
    #[error("stored lock key {key:?} breaks a rule: {rule}")]
    BadKey { key: String, rule: String },
    #[error("data file has schema {found}, this build reads schema {reads}")]
    Schema { found: u64, reads: u64 },
    #[error("revision would go back from {stored} to {new}")]
    RevisionWentBack { stored: u64, new: u64 },
    #[error("the audit event counter would go back from {stored} to {new}")]
    EventSeqWentBack { stored: u64, new: u64 },
    #[error("audit event {seq} is already written; it is never replaced")]
    EventExists { seq: u64 },
    #[error("audit event {seq} is above the event counter {counter} written with it")]
    EventAboveCounter { seq: u64, counter: u64 },
    /// The domain grants only to a present session; a grant without a row to store it under
    /// is a bug, refused rather than written where no check could find its holder.
    #[error("lock {key:?} is granted to session {session}, which has no row")]
    GrantWithoutSession {
        key: String,
        session: crate::domain::SessionId,
    },
    /// A grant is stored under its holder's row; one under a row without a session has no
    /// holder.
    #[error("lock {key:?} is stored under session row {row}, which holds no session")]
    GrantWithoutHolder { key: String, row: u64 },
    /// With no end pending, a key stored under two rows would be held twice.
    #[error("lock {key:?} is stored under two sessions with no end pending")]
    KeyHeldTwice { key: String },
    #[error("an earlier write failed; the store refuses writes until the server restarts")]
    Failed,
    /// The data file holds a table the backup's table list does not name: a backup would
    /// silently leave it out.
    #[error(
        "table {0:?} is in the data file but not in the store's table list; refusing an incomplete backup"
    )]
    UnlistedTable(String),
    #[error("{path} is not a Leasehold backup: {why}")]
    NotABackup { path: PathBuf, why: String },
}

impl StoreError {
    pub(super) fn redb(e: impl Into<redb::Error>) -> StoreError {
        StoreError::Redb(e.into())
    }
}
