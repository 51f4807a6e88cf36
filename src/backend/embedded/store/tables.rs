//! The table layout of the data file, and the helpers every reader of its rows shares.
//!
//! Tables (schema 7; schema 6 kept the locks keyed by their key in `locks` with a grants
//! index `row_locks` beside it, schema 5 stored the hash of every audit event rather than of
//! each commit's last, schema 4 deferred only the session rows of an end-log record, schema 3
//! had the same without `end_log`, schema 2 also had every event in record format 1):
//! - `meta`: the durable counters (`revision`, `event_seq`, `session_row`) and the schema
//!   version;
//! - `session_rows`: row number → [`SessionRow`] (the public id and its `SessionRecord`), with
//!   `session_ids` (session id → row) to find a row by id, and `sessions_by_owner` (owner,
//!   session id) as the owner index;
//! - `lock_rows`: (holder's row, key) → [`StoredGrant`] (token, when acquired): every grant,
//!   stored under its holder, whose id is the row's.
//!   No table is keyed by the lock key alone: lock reads answer from the committed locks in
//!   memory ([`super::held`]), loaded from this table at open, so a key-ordered copy on disk
//!   served no reader and cost a page on a random spot of its B-tree for every grant and
//!   release (in schema 6 it was a fifth of the pages of a million live locks, half of them
//!   free space). That the key is held once is the domain's rule; `check` proves it.
//!   redb has no foreign keys, so the cascade is emulated: the domain emits one `DeleteLock`
//!   per grant of an ending session and they commit in the same transaction, except for the
//!   sessions a reaper pass ends, whose grants go with their rows when their end-log record
//!   is applied; until then the key may be granted again, and then two rows name it, the
//!   newer grant (the higher token) being the held one.
//!
//! Why rows: session ids are random (they are capabilities), so rows keyed by them put every
//! session on a random page of each table, and a mass end dirtied nearly every page of
//! several B-trees. A row number is issued by the store in creation order (`session_row`
//! ratchets up and is never reused), so sessions opened together sit on neighbouring pages
//! of `session_rows` and `lock_rows`, and ending them together copies few pages. Only the
//! small `session_ids` entries and the owner index still follow the random id: listings
//! and the API's session-id order need them.
//! - `pools`: name → `PoolRecord`; `seats`: (pool, session id) → `SeatRecord`, with
//!   `session_seats` (session id, pool) as the session → seats index;
//! - `jobs`: job id → `JobRecord`, `job_payloads`: job id → payload (written once), with
//!   `jobs_by_state` (queue, state, job id) for listing dead letters and `session_jobs`
//!   (session id, job id) for the claims a session holds;
//! - `events`: sequence number → `Event`, the audit log, with `event_hashes` (sequence number
//!   → hash) holding the chain's hash of the last event of each commit ([`super::chain`]);
//! - `end_log` (schema 4): record number → the sessions of one reaper pass whose rows and
//!   grants (schema 5) are still to be deleted, pending until applied in a later batch
//!   ([`super::endlog`]).
//!
//! [`ALL`] names every table of the current schema, for whatever must visit them all (the
//! migration's check, a backup). Schema 1 (release 0.1.0) kept sessions in `sessions`
//! (session id → `SessionRecord`) and the grants index in `session_locks` (session id, key);
//! `migrate` rewrites them into the tables above.

use redb::{Key, ReadableTable, TableDefinition, Value, WriteTransaction};
use serde::{Deserialize, Serialize};

use super::codec::{self, CodecError};
use super::error::StoreError;
use crate::domain::{LockKey, LockRecord, SessionId, SessionRecord, Token, UnixMs};

pub(super) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
pub(super) const SESSION_ROWS: TableDefinition<u64, &[u8]> = TableDefinition::new("session_rows");
pub(super) const SESSION_IDS: TableDefinition<u128, u64> = TableDefinition::new("session_ids");
pub(super) const SESSIONS_BY_OWNER: TableDefinition<(&str, u128), ()> =
    TableDefinition::new("sessions_by_owner");
pub(super) const LOCK_ROWS: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("lock_rows");
pub(super) const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
/// Record number → an encoded `endlog::Ended`: the pending ends, oldest first (see
/// [`super::endlog`]).
pub(super) const END_LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("end_log");
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
/// `{scope}/{request_id}` → `RequestRecord`: the answers kept for retries. Added without a
/// schema bump: a file without it gets it empty at open, and an older build ignores it.
pub(super) const REQUEST_IDS: TableDefinition<&str, &[u8]> = TableDefinition::new("request_ids");

/// Schema 6's lock tables (and schema 2's to 5's), read only by the migration, which deletes
/// them.
pub(super) mod v6 {
    use redb::TableDefinition;

    pub const LOCKS: TableDefinition<&str, &[u8]> = TableDefinition::new("locks");
    pub const ROW_LOCKS: TableDefinition<(u64, &str), ()> = TableDefinition::new("row_locks");
}

/// Schema 1's tables, read only by the migration, which deletes them.
pub(super) mod v1 {
    use redb::TableDefinition;

    pub const SESSIONS: TableDefinition<u128, &[u8]> = TableDefinition::new("sessions");
    pub const SESSION_LOCKS: TableDefinition<(u128, &str), ()> =
        TableDefinition::new("session_locks");
}

/// The name of every table of the current schema.
pub const ALL: &[&str] = &[
    "meta",
    "session_rows",
    "session_ids",
    "sessions_by_owner",
    "lock_rows",
    "events",
    "pools",
    "seats",
    "session_seats",
    "jobs",
    "job_payloads",
    "jobs_by_state",
    "session_jobs",
    "event_hashes",
    "request_ids",
    "end_log",
];

pub(super) const META_SCHEMA: &str = "schema";
pub(super) const META_REVISION: &str = "revision";
pub(super) const META_EVENT_SEQ: &str = "event_seq";
/// The last session row number issued; 0 before the first.
pub(super) const META_SESSION_ROW: &str = "session_row";
/// 3: audit events may be of record format 2 (with `actor`), which a build of schema 2 cannot
/// read; stamping the file 3 makes such a build refuse it at start instead of failing on its
/// first event. Nothing is rewritten from 2 to 3.
/// 4: the `end_log` table of deferred session ends ([`super::endlog`]). A build of schema 3
/// would load the sessions a pending record ended as live, and end them a second time in
/// the audit log; stamping the file 4 makes it refuse the file. From 3 the table is only
/// created.
/// 5: an end-log record's sessions keep their grants in `locks` and `row_locks` until it is
/// applied. A build of schema 4 would apply such a record without deleting them and then find
/// locks held by sessions that do not exist; stamping the file 5 makes it refuse the file.
/// From 4 nothing changes: a schema-4 record's grants are already gone, and applying it finds
/// none.
/// 6: `event_hashes` keeps the audit chain's hash of each commit's last event (and of the
/// chain's first, and the anchor a trim leaves), not of every event. A build of schema 5
/// would report the events between as missing from the chain; stamping the file 6 makes it
/// refuse the file. From 5 nothing changes: a hash for every event verifies as it is.
/// 7: the grants live in `lock_rows`, under their holder's row; `locks` and `row_locks` are
/// gone. A build of schema 6 would find no locks; stamping the file 7 makes it refuse it.
/// From 6 the grants are rewritten ([`super::migrate::v6_to_v7`]).
pub(super) const SCHEMA_VERSION: u64 = 7;

/// A stored session: its public id travels in the row, which is keyed by row number.
///
/// Postcard is positional: fields are only ever appended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SessionRow {
    pub id: SessionId,
    pub record: SessionRecord,
}

/// A borrowed [`SessionRow`] to encode without copying the record; the same bytes.
#[derive(Serialize)]
pub(super) struct SessionRowRef<'a> {
    pub id: SessionId,
    pub record: &'a SessionRecord,
}

/// The first fields of a stored [`SessionRow`], borrowed: what ending a session needs of
/// its row (the owner, to remove it from the owner index), without copying the record.
#[derive(Deserialize)]
pub(super) struct SessionRowHead<'a> {
    pub id: SessionId,
    #[serde(borrow)]
    pub owner: &'a str,
}

/// A grant as `lock_rows` stores it: its holder is the session of the row it is stored under,
/// so the id is not repeated (16 bytes a lock).
///
/// Postcard is positional: fields are only ever appended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct StoredGrant {
    pub token: Token,
    pub acquired_at: UnixMs,
}

impl StoredGrant {
    pub fn of(lock: &LockRecord) -> StoredGrant {
        StoredGrant {
            token: lock.token,
            acquired_at: lock.acquired_at,
        }
    }

    /// The lock, held by `holder`, the session of the row it was stored under.
    pub fn held_by(self, holder: SessionId) -> LockRecord {
        LockRecord {
            session_id: holder,
            token: self.token,
            acquired_at: self.acquired_at,
        }
    }
}

/// Something done to every table of the data file.
pub(super) trait EachTable {
    fn table<K: Key + 'static, V: Value + 'static>(
        &mut self,
        def: TableDefinition<'static, K, V>,
    ) -> Result<(), StoreError>;
}

/// Every table of the data file, in one list: a backup copies exactly these (and refuses a
/// file holding any other), so a table added to the layout is added here.
pub(super) fn each_table(f: &mut impl EachTable) -> Result<(), StoreError> {
    f.table(META)?;
    f.table(SESSION_ROWS)?;
    f.table(SESSION_IDS)?;
    f.table(SESSIONS_BY_OWNER)?;
    f.table(LOCK_ROWS)?;
    f.table(EVENTS)?;
    f.table(POOLS)?;
    f.table(SEATS)?;
    f.table(SESSION_SEATS)?;
    f.table(JOBS)?;
    f.table(JOB_PAYLOADS)?;
    f.table(JOBS_BY_STATE)?;
    f.table(SESSION_JOBS)?;
    f.table(super::chain::EVENT_HASHES)?;
    f.table(REQUEST_IDS)?;
    f.table(END_LOG)?;
    Ok(())
}

/// Creates every table that is missing, so that readers never find one absent.
pub(super) fn create_all(txn: &WriteTransaction) -> Result<(), StoreError> {
    txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?;
    txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
    txn.open_table(SESSIONS_BY_OWNER)
        .map_err(StoreError::redb)?;
    txn.open_table(LOCK_ROWS).map_err(StoreError::redb)?;
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
    txn.open_table(REQUEST_IDS).map_err(StoreError::redb)?;
    txn.open_table(END_LOG).map_err(StoreError::redb)?;
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

/// The row of session `id`, if it has one.
pub(super) fn row_of(
    ids: &impl ReadableTable<u128, u64>,
    id: SessionId,
) -> Result<Option<u64>, StoreError> {
    Ok(ids
        .get(id.as_u128())
        .map_err(StoreError::redb)?
        .map(|r| r.value()))
}

/// The stored record of session `id`, found through its row.
pub(super) fn session_record(
    ids: &impl ReadableTable<u128, u64>,
    rows: &impl ReadableTable<u64, &'static [u8]>,
    id: SessionId,
) -> Result<Option<SessionRecord>, StoreError> {
    match row_of(ids, id)? {
        Some(row) => record_at(rows, row),
        None => Ok(None),
    }
}

/// The stored record in session row `row`, if there is one.
pub(super) fn record_at(
    rows: &impl ReadableTable<u64, &'static [u8]>,
    row: u64,
) -> Result<Option<SessionRecord>, StoreError> {
    let found: Option<SessionRow> = decoded(rows.get(row).map_err(StoreError::redb)?, "session")?;
    Ok(found.map(|r| r.record))
}
