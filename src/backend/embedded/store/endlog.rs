//! The end log: the sessions reaper passes ended, one record per pass, whose rows are
//! deleted later in sorted batches.
//!
//! A pass's commit writes at once what another write could later depend on: the audit events
//! of the sessions it ended (in sequence order, hash chained) and the deletes of their seats
//! and jobs. The deletes of the sessions' own rows (`session_ids`, `session_rows`,
//! `sessions_by_owner`) and of their grants (`lock_rows`) are deferred: the commit appends
//! one `end_log` record naming the sessions instead. Those are the deletes that scatter: the
//! ids are random, so a pass of a few hundred sessions would dirty a page per session.
//! Applied later, many records at once and sorted by row, neighbouring deletes share their
//! pages.
//!
//! Invariants that make the deferral sound:
//! - a record commits in the transaction of the pass's events, so a record exists exactly
//!   when the sessions it names are ended in the audit log and may still have rows;
//! - memory is the authority on which sessions are live and which locks are held, and every
//!   read of a session row passes through it; a read of the locks passes through the
//!   store's set of sessions with ends pending ([`super::db::Store`]), so a lock of an ended
//!   session is not shown held once the commit that ended it has returned;
//! - a session id (and a row) is never reused, so deleting its rows late cannot hit a later
//!   session; its grants are stored under its own row, so a later grant of the same key,
//!   under another row, is kept;
//! - applying is idempotent (every delete tolerates an absent row), and deletes the record
//!   in the transaction that applies it: a crash before that commit applies it again;
//! - `Store::open` applies every pending record before anything is loaded, so a restart
//!   never brings an ended session or its locks back.

use redb::{ReadableTable, ReadableTableMetadata, Table, WriteTransaction};
use serde::{Deserialize, Serialize};

use super::codec;
use super::error::StoreError;
pub(super) use super::tables::END_LOG;
use super::tables::{
    LOCK_ROWS, SESSION_IDS, SESSION_ROWS, SESSIONS_BY_OWNER, SessionRowHead, corrupt, row_of,
};
use crate::domain::SessionId;

/// The sessions one reaper pass ended, whose rows are still to be deleted. Postcard is
/// positional: fields are only appended.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ended {
    pub sessions: Vec<u128>,
}

impl Ended {
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    pub fn clear(&mut self) {
        self.sessions.clear();
    }

    /// Adds the sessions a reaper pass ended, whose row and grant deletes it left out of its
    /// changes ([`crate::domain::State::reap_leaving_rows`]): applying the record finds
    /// each session's locks through the grant index.
    pub fn extend(&mut self, ended: &[crate::domain::Ended]) {
        self.sessions.extend(ended.iter().map(|e| e.id.as_u128()));
    }
}

/// The tables a delete of a session or a grant touches.
pub(super) struct SessionTables<'t> {
    pub rows: Table<'t, u64, &'static [u8]>,
    pub ids: Table<'t, u128, u64>,
    pub by_owner: Table<'t, (&'static str, u128), ()>,
    /// (holder's row, key) → `StoredGrant`.
    pub grants: Table<'t, (u64, &'static str), &'static [u8]>,
}

impl<'t> SessionTables<'t> {
    pub fn open(txn: &'t WriteTransaction) -> Result<SessionTables<'t>, StoreError> {
        Ok(SessionTables {
            rows: txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?,
            ids: txn.open_table(SESSION_IDS).map_err(StoreError::redb)?,
            by_owner: txn
                .open_table(SESSIONS_BY_OWNER)
                .map_err(StoreError::redb)?,
            grants: txn.open_table(LOCK_ROWS).map_err(StoreError::redb)?,
        })
    }

    /// Deletes session `id`'s row, its id and owner entries and every grant still stored
    /// under its row (the cascade: a grant never outlives its holder's row); nothing when it
    /// has none. Returns the keys of those grants.
    pub fn delete_session(&mut self, id: u128) -> Result<Vec<String>, StoreError> {
        let Some(row) = self
            .ids
            .remove(id)
            .map_err(StoreError::redb)?
            .map(|r| r.value())
        else {
            return Ok(Vec::new());
        };
        let mut keys = Vec::new();
        for entry in self
            .grants
            .extract_from_if((row, "")..(row + 1, ""), |_, _| true)
            .map_err(StoreError::redb)?
        {
            let (entry, _) = entry.map_err(StoreError::redb)?;
            keys.push(entry.value().1.to_string());
        }
        let removed = self.rows.remove(row).map_err(StoreError::redb)?;
        if let Some(bytes) = removed {
            let head: SessionRowHead<'_> =
                codec::decode_head(bytes.value()).map_err(corrupt("session"))?;
            debug_assert_eq!(head.id.as_u128(), id);
            self.by_owner
                .remove((head.owner, id))
                .map_err(StoreError::redb)?;
        }
        Ok(keys)
    }

    /// Deletes `holder`'s grant of `key`, found under the holder's row, so before that row
    /// is deleted.
    pub fn delete_grant(&mut self, key: &str, holder: u128) -> Result<(), StoreError> {
        if let Some(row) = row_of(&self.ids, SessionId::from_u128(holder))? {
            self.grants.remove((row, key)).map_err(StoreError::redb)?;
        }
        Ok(())
    }
}

/// Appends `ended` as the next record.
pub(super) fn append(txn: &WriteTransaction, ended: &Ended) -> Result<(), StoreError> {
    let mut log = txn.open_table(END_LOG).map_err(StoreError::redb)?;
    let next = match log.last().map_err(StoreError::redb)? {
        Some((k, _)) => k.value() + 1,
        None => 1,
    };
    log.insert(next, codec::encode(ended).as_slice())
        .map_err(StoreError::redb)?;
    Ok(())
}

/// What applying end-log records deleted.
#[derive(Debug, Default)]
pub(super) struct Applied {
    /// The sessions applied, in row order.
    pub sessions: Vec<u128>,
    /// Their grants, with the holder: a later grant of the same key, under another row, is
    /// not among them.
    pub grants: Vec<(String, u128)>,
}

/// Applies the oldest pending records, whole, until at least `limit` sessions are applied or
/// none is left, and deletes them. The deletes are made in row order, so neighbouring
/// deletes share their page: a session's grants sit under its row, next to those of the
/// sessions opened with it.
pub(super) fn apply(txn: &WriteTransaction, limit: usize) -> Result<Applied, StoreError> {
    let mut log = txn.open_table(END_LOG).map_err(StoreError::redb)?;
    let mut taken = Vec::new();
    let mut sessions = Vec::new();
    for entry in log.iter().map_err(StoreError::redb)? {
        if sessions.len() >= limit && !taken.is_empty() {
            break;
        }
        let (n, bytes) = entry.map_err(StoreError::redb)?;
        let ended: Ended = codec::decode(bytes.value()).map_err(corrupt("end_log"))?;
        taken.push(n.value());
        sessions.extend(ended.sessions);
    }
    for n in &taken {
        log.remove(*n).map_err(StoreError::redb)?;
    }
    let mut t = SessionTables::open(txn)?;
    let mut rows = Vec::with_capacity(sessions.len());
    for id in sessions {
        rows.push((row_of(&t.ids, SessionId::from_u128(id))?, id));
    }
    rows.sort_unstable();
    let mut grants = Vec::new();
    for &(_, id) in &rows {
        for key in t.delete_session(id)? {
            grants.push((key, id));
        }
    }
    Ok(Applied {
        sessions: rows.into_iter().map(|(_, id)| id).collect(),
        grants,
    })
}

/// How many records are pending.
pub(super) fn pending(log: &impl ReadableTableMetadata) -> Result<u64, StoreError> {
    log.len().map_err(StoreError::redb)
}

/// The sessions pending records name.
pub(super) fn pending_sessions(
    log: &impl ReadableTable<u64, &'static [u8]>,
) -> Result<Vec<u128>, StoreError> {
    let mut all = Vec::new();
    for entry in log.iter().map_err(StoreError::redb)? {
        let (_, bytes) = entry.map_err(StoreError::redb)?;
        let ended: Ended = codec::decode(bytes.value()).map_err(corrupt("end_log"))?;
        all.extend(ended.sessions);
    }
    Ok(all)
}
