//! The table layout of the data file, and the helpers every reader of its rows shares.
//!
//! Tables:
//! - `meta`: the durable counters (`revision`, `event_seq`) and the schema version;
//! - `sessions`: session id → `SessionRecord`, with `sessions_by_owner` as its owner index;
//! - `locks`: key → `LockRecord`, with `session_locks` (session id, key) as the session → grants
//!   index. redb has no foreign keys, so the cascade is emulated: the domain emits one
//!   `DeleteLock` per grant of an ending session and they commit in the same transaction.
//! - `pools`: name → `PoolRecord`; `seats`: (pool, session id) → `SeatRecord`, with
//!   `session_seats` (session id, pool) as the session → seats index;
//! - `jobs`: job id → `JobRecord`, `job_payloads`: job id → payload (written once), with
//!   `jobs_by_state` (queue, state, job id) for listing dead letters and `session_jobs`
//!   (session id, job id) for the claims a session holds;
//! - `events`: sequence number → `Event`, the audit log.

use redb::{ReadableTable, TableDefinition, WriteTransaction};

use super::codec::{self, CodecError};
use super::error::StoreError;
use crate::domain::LockKey;

pub(super) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
pub(super) const SESSIONS: TableDefinition<u128, &[u8]> = TableDefinition::new("sessions");
pub(super) const SESSIONS_BY_OWNER: TableDefinition<(&str, u128), ()> =
    TableDefinition::new("sessions_by_owner");
pub(super) const LOCKS: TableDefinition<&str, &[u8]> = TableDefinition::new("locks");
pub(super) const SESSION_LOCKS: TableDefinition<(u128, &str), ()> =
    TableDefinition::new("session_locks");
pub(super) const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
pub(super) const POOLS: TableDefinition<&str, &[u8]> = TableDefinition::new("pools");
pub(super) const SEATS: TableDefinition<(&str, u128), &[u8]> = TableDefinition::new("seats");
pub(super) const SESSION_SEATS: TableDefinition<(u128, &str), ()> =
    TableDefinition::new("session_seats");
pub(super) const JOBS: TableDefinition<u128, &[u8]> = TableDefinition::new("jobs");
pub(super) const JOB_PAYLOADS: TableDefinition<u128, &[u8]> = TableDefinition::new("job_payloads");
pub(super) const JOBS_BY_STATE: TableDefinition<(&str, u8, u128), ()> =
    TableDefinition::new("jobs_by_state");
pub(super) const SESSION_JOBS: TableDefinition<(u128, u128), ()> =
    TableDefinition::new("session_jobs");

pub(super) const META_SCHEMA: &str = "schema";
pub(super) const META_REVISION: &str = "revision";
pub(super) const META_EVENT_SEQ: &str = "event_seq";
pub(super) const SCHEMA_VERSION: u64 = 1;

/// Creates every table that is missing, so that readers never find one absent.
pub(super) fn create_all(txn: &WriteTransaction) -> Result<(), StoreError> {
    txn.open_table(SESSIONS).map_err(StoreError::redb)?;
    txn.open_table(SESSIONS_BY_OWNER)
        .map_err(StoreError::redb)?;
    txn.open_table(LOCKS).map_err(StoreError::redb)?;
    txn.open_table(SESSION_LOCKS).map_err(StoreError::redb)?;
    txn.open_table(EVENTS).map_err(StoreError::redb)?;
    txn.open_table(super::chain::EVENT_HASHES)
        .map_err(StoreError::redb)?;
    txn.open_table(POOLS).map_err(StoreError::redb)?;
    txn.open_table(SEATS).map_err(StoreError::redb)?;
    txn.open_table(SESSION_SEATS).map_err(StoreError::redb)?;
    txn.open_table(JOBS).map_err(StoreError::redb)?;
    txn.open_table(JOB_PAYLOADS).map_err(StoreError::redb)?;
    txn.open_table(JOBS_BY_STATE).map_err(StoreError::redb)?;
    txn.open_table(SESSION_JOBS).map_err(StoreError::redb)?;
    Ok(())
}

/// A counter of the `meta` table; 0 before it was first written.
pub(super) fn counter(
    meta: &impl ReadableTable<&'static str, u64>,
    name: &str,
) -> Result<u64, StoreError> {
    Ok(meta
        .get(name)
        .map_err(StoreError::redb)?
        .map(|v| v.value())
        .unwrap_or(0))
}

/// Decodes a record that a point lookup found, if it found one.
pub(super) fn decoded<T: serde::de::DeserializeOwned>(
    found: Option<redb::AccessGuard<'_, &'static [u8]>>,
    table: &'static str,
) -> Result<Option<T>, StoreError> {
    found
        .map(|bytes| codec::decode(bytes.value()).map_err(corrupt(table)))
        .transpose()
}

pub(super) fn corrupt(table: &'static str) -> impl FnOnce(CodecError) -> StoreError {
    move |source| StoreError::Corrupt { table, source }
}

/// A key, pool or queue name read back from the store; it passed the rules when written.
pub(super) fn stored_key(text: &str) -> Result<LockKey, StoreError> {
    LockKey::parse("key", text).map_err(|e| StoreError::BadKey {
        key: text.to_string(),
        rule: e.to_string(),
    })
}
