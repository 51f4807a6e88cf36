//! The end log: the sessions reaper passes ended, one record per pass, whose rows are
//! deleted later in sorted batches.
//!
//! A pass's commit writes at once everything another write or a read could later touch: the
//! audit events of the sessions it ended (in sequence order, hash chained), the deletes of
//! their grants (`locks`, `row_locks`: lock reads are served from the table), seats and jobs.
//! Only the deletes of the sessions' own rows — `session_ids`, `session_rows` and
//! `sessions_by_owner`, two of them keyed by the random id — are deferred: the commit
//! appends one `end_log` record naming the sessions instead. Memory is the authority on
//! which sessions are live, and every read of those rows passes through it.
//!
//! Invariants that make the deferral sound:
//! - a record commits in the transaction of the pass's events, so a record exists exactly
//!   when the sessions it names are ended in the audit log and still have their rows;
//! - a session id is never reused, so deleting its rows late cannot hit a later session;
//! - applying is idempotent (every delete tolerates an absent row), and deletes the record
//!   in the transaction that applies it: a crash before that commit applies it again;
//! - `Store::open` applies every pending record before anything is loaded, so a restart
//!   never brings an ended session back.

use redb::{ReadableTable, ReadableTableMetadata, Table, WriteTransaction};
use serde::{Deserialize, Serialize};

use super::codec;
use super::error::StoreError;
pub(super) use super::tables::END_LOG;
use super::tables::{
    LOCKS, ROW_LOCKS, SESSION_IDS, SESSION_ROWS, SESSIONS_BY_OWNER, SessionRowHead, corrupt, row_of,
};
use crate::domain::{Change, SessionId};

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

    /// Takes the session deletes out of `changes[from..]`, keeping every other change in
    /// its order. Only for sessions a reaper pass ended: nothing refers to them again.
    pub fn take_from(&mut self, changes: &mut Vec<Change>, from: usize) {
        let mut tail = changes.split_off(from);
        tail.retain(|c| match c {
            Change::DeleteSession { id } => {
                self.sessions.push(id.as_u128());
                false
            }
            _ => true,
        });
        changes.append(&mut tail);
    }
}

/// The tables a delete of a session or a grant touches.
pub(super) struct SessionTables<'t> {
    pub rows: Table<'t, u64, &'static [u8]>,
    pub ids: Table<'t, u128, u64>,
    pub by_owner: Table<'t, (&'static str, u128), ()>,
    pub locks: Table<'t, &'static str, &'static [u8]>,
    pub index: Table<'t, (u64, &'static str), ()>,
}

impl<'t> SessionTables<'t> {
    pub fn open(txn: &'t WriteTransaction) -> Result<SessionTables<'t>, StoreError> {
        Ok(SessionTables {
            rows: txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?,
            ids: txn.open_table(SESSION_IDS).map_err(StoreError::redb)?,
            by_owner: txn
                .open_table(SESSIONS_BY_OWNER)
                .map_err(StoreError::redb)?,
            locks: txn.open_table(LOCKS).map_err(StoreError::redb)?,
            index: txn.open_table(ROW_LOCKS).map_err(StoreError::redb)?,
        })
    }

    /// Deletes session `id`'s row and its id and owner entries; nothing when it has none.
    pub fn delete_session(&mut self, id: u128) -> Result<(), StoreError> {
        let Some(row) = self
            .ids
            .remove(id)
            .map_err(StoreError::redb)?
            .map(|r| r.value())
        else {
            return Ok(());
        };
        let removed = self.rows.remove(row).map_err(StoreError::redb)?;
        if let Some(bytes) = removed {
            let head: SessionRowHead<'_> =
                codec::decode_head(bytes.value()).map_err(corrupt("session"))?;
            debug_assert_eq!(head.id.as_u128(), id);
            self.by_owner
                .remove((head.owner, id))
                .map_err(StoreError::redb)?;
        }
        Ok(())
    }

    /// Deletes `holder`'s grant of `key`: the lock and its index entry, found through the
    /// holder's row, so before that row is deleted.
    pub fn delete_grant(&mut self, key: &str, holder: u128) -> Result<(), StoreError> {
        self.locks.remove(key).map_err(StoreError::redb)?;
        if let Some(row) = row_of(&self.ids, SessionId::from_u128(holder))? {
            self.index.remove((row, key)).map_err(StoreError::redb)?;
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

/// Applies the oldest pending records, whole, until at least `limit` sessions are applied or
/// none is left, and deletes them; returns the sessions applied. The deletes are made in row
/// order, so neighbouring rows share their page.
pub(super) fn apply(txn: &WriteTransaction, limit: usize) -> Result<usize, StoreError> {
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
    for (_, id) in &rows {
        t.delete_session(*id)?;
    }
    Ok(rows.len())
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
