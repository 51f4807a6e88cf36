//! Versioned migrations of the data file, run by `Store::open` in the transaction that
//! checks the schema, so a migration commits whole or not at all: a crash part-way leaves
//! the file at the version it had, and the next open runs it again.
//!
//! Each step takes the file from one version to the next and touches only what changed
//! between them; counters, locks, pools, seats, jobs and the audit log are carried as they
//! are, so every token and sequence number issued before stays issued.

use redb::{ReadableTable, ReadableTableMetadata, WriteTransaction};

use super::codec;
use super::error::StoreError;
use super::tables::{
    LOCK_ROWS, META, META_SESSION_ROW, SESSION_IDS, SESSION_ROWS, SessionRowRef, StoredGrant,
    corrupt, counter, row_of, v1, v6,
};
use crate::domain::{LockRecord, SessionId, SessionRecord};

/// What a migration step rewrote, for the log line that reports it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Migrated {
    pub sessions: u64,
    pub grants: u64,
}

/// Schema 1 (release 0.1.0) → 2: sessions move from rows keyed by their random id to rows
/// keyed by a creation-ordered row number, and the grants index from (session id, key) to
/// (row, key).
///
/// Rows are issued in the order the sessions were created (`created_at`, then id), so the
/// sessions a storm ends together sit together from the start.
pub fn v1_to_v2(txn: &WriteTransaction) -> Result<Migrated, StoreError> {
    let mut done = Migrated::default();
    let mut sessions: Vec<(SessionId, SessionRecord)> = Vec::new();
    {
        let old = txn.open_table(v1::SESSIONS).map_err(StoreError::redb)?;
        sessions.reserve(old.len().map_err(StoreError::redb)? as usize);
        for entry in old.iter().map_err(StoreError::redb)? {
            let (id, bytes) = entry.map_err(StoreError::redb)?;
            let record: SessionRecord = codec::decode(bytes.value()).map_err(corrupt("session"))?;
            sessions.push((SessionId::from_u128(id.value()), record));
        }
    }
    sessions.sort_by_key(|(id, r)| (r.created_at, *id));
    let mut meta = txn.open_table(META).map_err(StoreError::redb)?;
    // A file at schema 1 has no rows yet; a counter present would be from a torn attempt,
    // which cannot commit, so it is read only to ratchet.
    let mut row = counter(&meta, META_SESSION_ROW)?;
    {
        let mut rows = txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?;
        let mut ids = txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
        let mut index = txn.open_table(v6::ROW_LOCKS).map_err(StoreError::redb)?;
        let old_index = txn
            .open_table(v1::SESSION_LOCKS)
            .map_err(StoreError::redb)?;
        for (id, record) in &sessions {
            row += 1;
            let bytes = codec::encode(&SessionRowRef { id: *id, record });
            rows.insert(row, bytes.as_slice())
                .map_err(StoreError::redb)?;
            ids.insert(id.as_u128(), row).map_err(StoreError::redb)?;
            done.sessions += 1;
            let sid = id.as_u128();
            for entry in old_index.range((sid, "")..).map_err(StoreError::redb)? {
                let (entry, _) = entry.map_err(StoreError::redb)?;
                let (holder, key) = entry.value();
                if holder != sid {
                    break;
                }
                index.insert((row, key), ()).map_err(StoreError::redb)?;
                done.grants += 1;
            }
        }
    }
    meta.insert(META_SESSION_ROW, row)
        .map_err(StoreError::redb)?;
    drop(meta);
    txn.delete_table(v1::SESSIONS).map_err(StoreError::redb)?;
    txn.delete_table(v1::SESSION_LOCKS)
        .map_err(StoreError::redb)?;
    Ok(done)
}

/// Schema 6 (and 2 to 5, whose lock tables were the same) → 7: each lock moves from `locks`
/// (key → record) to `lock_rows`, under its holder's row; `locks` and the grants index
/// `row_locks` are deleted. Returns how many grants moved.
///
/// The record in `locks` is the grant: an index entry without one is the grant of a session
/// a pending end-log record ended, whose key was granted again since (applying the record
/// deletes nothing else of it), and is dropped. A lock whose holder has no row could not be
/// loaded by the build that wrote it either (the load refuses a lock of an unknown session),
/// so the migration refuses it too, naming it, and the file stays as it was.
pub fn v6_to_v7(txn: &WriteTransaction) -> Result<u64, StoreError> {
    let mut moved = 0;
    {
        let locks = txn.open_table(v6::LOCKS).map_err(StoreError::redb)?;
        let ids = txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
        let mut grants = txn.open_table(LOCK_ROWS).map_err(StoreError::redb)?;
        for entry in locks.iter().map_err(StoreError::redb)? {
            let (key, bytes) = entry.map_err(StoreError::redb)?;
            let record: LockRecord = codec::decode(bytes.value()).map_err(corrupt("lock"))?;
            let Some(row) = row_of(&ids, record.session_id)? else {
                return Err(StoreError::GrantWithoutSession {
                    key: key.value().to_string(),
                    session: record.session_id,
                });
            };
            let grant = codec::encode(&StoredGrant::of(&record));
            grants
                .insert((row, key.value()), grant.as_slice())
                .map_err(StoreError::redb)?;
            moved += 1;
        }
    }
    txn.delete_table(v6::LOCKS).map_err(StoreError::redb)?;
    txn.delete_table(v6::ROW_LOCKS).map_err(StoreError::redb)?;
    Ok(moved)
}
