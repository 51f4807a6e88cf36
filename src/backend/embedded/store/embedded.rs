//! The embedded store: one redb file in the data directory.
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
//!
//! Every write is one transaction with immediate durability (fsync) that also writes the
//! counters, so a token is never acknowledged before the counter that issued it is durable.
//! After any failed write the store refuses every later one (fail-stop): a retry could
//! acknowledge something a torn commit lost.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use redb::{
    Database, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata,
    TableDefinition, WriteTransaction,
};

use super::codec::{self, CodecError};
use super::fault::{FaultSwitch, FaultyBackend};
pub use crate::backend::CheckReport;
use crate::domain::state::Restore;
use crate::domain::{
    Change, Event, JobId, JobRecord, JobStatus, LockKey, LockRecord, PoolRecord, SeatRecord,
    SessionId, SessionRecord, Token, UnixMs,
};

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SESSIONS: TableDefinition<u128, &[u8]> = TableDefinition::new("sessions");
const SESSIONS_BY_OWNER: TableDefinition<(&str, u128), ()> =
    TableDefinition::new("sessions_by_owner");
const LOCKS: TableDefinition<&str, &[u8]> = TableDefinition::new("locks");
const SESSION_LOCKS: TableDefinition<(u128, &str), ()> = TableDefinition::new("session_locks");
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
const POOLS: TableDefinition<&str, &[u8]> = TableDefinition::new("pools");
const SEATS: TableDefinition<(&str, u128), &[u8]> = TableDefinition::new("seats");
const SESSION_SEATS: TableDefinition<(u128, &str), ()> = TableDefinition::new("session_seats");
const JOBS: TableDefinition<u128, &[u8]> = TableDefinition::new("jobs");
const JOB_PAYLOADS: TableDefinition<u128, &[u8]> = TableDefinition::new("job_payloads");
const JOBS_BY_STATE: TableDefinition<(&str, u8, u128), ()> = TableDefinition::new("jobs_by_state");
const SESSION_JOBS: TableDefinition<(u128, u128), ()> = TableDefinition::new("session_jobs");

const META_SCHEMA: &str = "schema";
const META_REVISION: &str = "revision";
const META_EVENT_SEQ: &str = "event_seq";
const SCHEMA_VERSION: u64 = 1;

/// The file inside the data directory.
pub const DATA_FILE: &str = "leasehold.redb";

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
    #[error("data file has schema {found}, this build reads schema {SCHEMA_VERSION}")]
    Schema { found: u64 },
    #[error("revision would go back from {stored} to {new}")]
    RevisionWentBack { stored: u64, new: u64 },
    #[error("an earlier write failed; the store refuses writes until the server restarts")]
    Failed,
}

impl StoreError {
    fn redb(e: impl Into<redb::Error>) -> StoreError {
        StoreError::Redb(e.into())
    }
}

/// Decodes a record that a point lookup found, if it found one.
fn decoded<T: serde::de::DeserializeOwned>(
    found: Option<redb::AccessGuard<'_, &'static [u8]>>,
    table: &'static str,
) -> Result<Option<T>, StoreError> {
    found
        .map(|bytes| codec::decode(bytes.value()).map_err(corrupt(table)))
        .transpose()
}

fn corrupt(table: &'static str) -> impl FnOnce(CodecError) -> StoreError {
    move |source| StoreError::Corrupt { table, source }
}

/// One transaction's worth of writes.
pub struct Batch<'a> {
    pub changes: &'a [Change],
    /// The counters as they stand after `changes`.
    pub revision: u64,
    pub event_seq: u64,
    /// Trim audit events older than this, at most `limit` of them.
    pub trim_events: Option<(UnixMs, usize)>,
}

/// What a commit did besides the changes themselves.
#[derive(Debug, Default, Clone, Copy)]
pub struct Committed {
    pub events_trimmed: usize,
}

pub struct Store {
    db: Database,
    path: PathBuf,
    failed: AtomicBool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

impl Store {
    /// Opens (or creates) the store in `dir`, with a page cache of `cache_bytes`.
    pub fn open(dir: &Path, cache_bytes: usize) -> Result<Store, StoreError> {
        let path = prepare_dir(dir)?;
        let db = redb::Builder::new()
            .set_cache_size(cache_bytes)
            .create(&path)
            .map_err(StoreError::redb)?;
        Store::init(db, path)
    }

    /// Opens the store on a backend whose writes can be made to fail, for fail-stop tests.
    pub fn open_with_faults(
        dir: &Path,
        cache_bytes: usize,
    ) -> Result<(Store, FaultSwitch), StoreError> {
        let path = prepare_dir(dir)?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|source| StoreError::DataDir {
                path: path.clone(),
                source,
            })?;
        let switch = FaultSwitch::default();
        let backend = FaultyBackend::new(file, switch.clone()).map_err(StoreError::redb)?;
        let db = redb::Builder::new()
            .set_cache_size(cache_bytes)
            .create_with_backend(backend)
            .map_err(StoreError::redb)?;
        Ok((Store::init(db, path)?, switch))
    }

    fn init(db: Database, path: PathBuf) -> Result<Store, StoreError> {
        let txn = db.begin_write().map_err(StoreError::redb)?;
        {
            let mut meta = txn.open_table(META).map_err(StoreError::redb)?;
            let schema = meta
                .get(META_SCHEMA)
                .map_err(StoreError::redb)?
                .map(|v| v.value());
            match schema {
                None => {
                    meta.insert(META_SCHEMA, SCHEMA_VERSION)
                        .map_err(StoreError::redb)?;
                }
                Some(SCHEMA_VERSION) => {}
                Some(found) => return Err(StoreError::Schema { found }),
            }
            txn.open_table(SESSIONS).map_err(StoreError::redb)?;
            txn.open_table(SESSIONS_BY_OWNER)
                .map_err(StoreError::redb)?;
            txn.open_table(LOCKS).map_err(StoreError::redb)?;
            txn.open_table(SESSION_LOCKS).map_err(StoreError::redb)?;
            txn.open_table(EVENTS).map_err(StoreError::redb)?;
            txn.open_table(POOLS).map_err(StoreError::redb)?;
            txn.open_table(SEATS).map_err(StoreError::redb)?;
            txn.open_table(SESSION_SEATS).map_err(StoreError::redb)?;
            txn.open_table(JOBS).map_err(StoreError::redb)?;
            txn.open_table(JOB_PAYLOADS).map_err(StoreError::redb)?;
            txn.open_table(JOBS_BY_STATE).map_err(StoreError::redb)?;
            txn.open_table(SESSION_JOBS).map_err(StoreError::redb)?;
        }
        txn.commit().map_err(StoreError::redb)?;
        Ok(Store {
            db,
            path,
            failed: AtomicBool::new(false),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True once a write has failed: readiness is false and every write is refused.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// Everything the in-memory state is rebuilt from at start-up.
    pub fn load(&self) -> Result<Restore, StoreError> {
        let txn = self.read()?;
        let meta = txn.open_table(META).map_err(StoreError::redb)?;
        let counter = |name| -> Result<u64, StoreError> {
            Ok(meta
                .get(name)
                .map_err(StoreError::redb)?
                .map(|v| v.value())
                .unwrap_or(0))
        };
        let revision = counter(META_REVISION)?;
        let event_seq = counter(META_EVENT_SEQ)?;
        let sessions_table = txn.open_table(SESSIONS).map_err(StoreError::redb)?;
        let mut sessions = Vec::with_capacity(sessions_table.len().unwrap_or(0) as usize);
        for row in sessions_table.iter().map_err(StoreError::redb)? {
            let (id, bytes) = row.map_err(StoreError::redb)?;
            let record: SessionRecord = codec::decode(bytes.value()).map_err(corrupt("session"))?;
            sessions.push((SessionId::from_u128(id.value()), record.ttl_ms));
        }
        let locks_table = txn.open_table(LOCKS).map_err(StoreError::redb)?;
        let mut locks = Vec::with_capacity(locks_table.len().unwrap_or(0) as usize);
        for row in locks_table.iter().map_err(StoreError::redb)? {
            let (key, bytes) = row.map_err(StoreError::redb)?;
            let record: LockRecord = codec::decode(bytes.value()).map_err(corrupt("lock"))?;
            locks.push((stored_key(key.value())?, record));
        }
        let mut pools = Vec::new();
        for row in txn
            .open_table(POOLS)
            .map_err(StoreError::redb)?
            .iter()
            .map_err(StoreError::redb)?
        {
            let (name, bytes) = row.map_err(StoreError::redb)?;
            let record: PoolRecord = codec::decode(bytes.value()).map_err(corrupt("pool"))?;
            pools.push((stored_key(name.value())?, record.capacity));
        }
        let mut seats = Vec::new();
        for row in txn
            .open_table(SEATS)
            .map_err(StoreError::redb)?
            .iter()
            .map_err(StoreError::redb)?
        {
            let (k, bytes) = row.map_err(StoreError::redb)?;
            let (pool, sid) = k.value();
            let record: SeatRecord = codec::decode(bytes.value()).map_err(corrupt("seat"))?;
            seats.push((
                stored_key(pool)?,
                SessionId::from_u128(sid),
                record.token,
                record.acquired_at,
            ));
        }
        let mut jobs = Vec::new();
        for row in txn
            .open_table(JOBS)
            .map_err(StoreError::redb)?
            .iter()
            .map_err(StoreError::redb)?
        {
            let (id, bytes) = row.map_err(StoreError::redb)?;
            let record: JobRecord = codec::decode(bytes.value()).map_err(corrupt("job"))?;
            jobs.push((JobId::from_u128(id.value()), record));
        }
        Ok(Restore {
            revision,
            event_seq,
            sessions,
            locks,
            pools,
            seats,
            jobs,
        })
    }

    /// Writes one batch in one transaction and fsyncs it. Nothing may be acknowledged before
    /// this returns `Ok`.
    pub fn commit(&self, batch: &Batch<'_>) -> Result<Committed, StoreError> {
        if self.failed() {
            return Err(StoreError::Failed);
        }
        let result = self.write_batch(batch);
        if result.is_err() {
            self.failed.store(true, Ordering::SeqCst);
        }
        result
    }

    fn write_batch(&self, batch: &Batch<'_>) -> Result<Committed, StoreError> {
        let txn = self.db.begin_write().map_err(StoreError::redb)?;
        let committed = apply(&txn, batch)?;
        txn.commit().map_err(StoreError::redb)?;
        Ok(committed)
    }

    fn read(&self) -> Result<ReadTransaction, StoreError> {
        self.db.begin_read().map_err(StoreError::redb)
    }

    pub fn session(&self, id: SessionId) -> Result<Option<SessionRecord>, StoreError> {
        let txn = self.read()?;
        let table = txn.open_table(SESSIONS).map_err(StoreError::redb)?;
        decoded(
            table.get(id.as_u128()).map_err(StoreError::redb)?,
            "session",
        )
    }

    /// Sessions in id order after `after`, optionally only those of `owner`.
    pub fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> Result<Vec<(SessionId, SessionRecord)>, StoreError> {
        let txn = self.read()?;
        let table = txn.open_table(SESSIONS).map_err(StoreError::redb)?;
        let start = match after {
            // u128::MAX is a valid cursor only in theory; saturating keeps the range empty.
            Some(id) => id.as_u128().checked_add(1),
            None => Some(0),
        };
        let Some(start) = start else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        match owner {
            None => {
                for row in table.range(start..).map_err(StoreError::redb)? {
                    if out.len() == limit {
                        break;
                    }
                    let (id, bytes) = row.map_err(StoreError::redb)?;
                    let record = codec::decode(bytes.value()).map_err(corrupt("session"))?;
                    out.push((SessionId::from_u128(id.value()), record));
                }
            }
            Some(owner) => {
                let index = txn
                    .open_table(SESSIONS_BY_OWNER)
                    .map_err(StoreError::redb)?;
                for row in index
                    .range((owner, start)..=(owner, u128::MAX))
                    .map_err(StoreError::redb)?
                {
                    if out.len() == limit {
                        break;
                    }
                    let (entry, _) = row.map_err(StoreError::redb)?;
                    let id = entry.value().1;
                    if let Some(bytes) = table.get(id).map_err(StoreError::redb)? {
                        let record = codec::decode(bytes.value()).map_err(corrupt("session"))?;
                        out.push((SessionId::from_u128(id), record));
                    }
                }
            }
        }
        Ok(out)
    }

    /// The locks a session holds, as committed, in key order.
    pub fn session_locks(&self, id: SessionId) -> Result<Vec<(String, LockRecord)>, StoreError> {
        let txn = self.read()?;
        let index = txn.open_table(SESSION_LOCKS).map_err(StoreError::redb)?;
        let locks = txn.open_table(LOCKS).map_err(StoreError::redb)?;
        let id = id.as_u128();
        let mut out = Vec::new();
        for row in index.range((id, "")..).map_err(StoreError::redb)? {
            let (entry, _) = row.map_err(StoreError::redb)?;
            let (sid, key) = entry.value();
            if sid != id {
                break;
            }
            if let Some(bytes) = locks.get(key).map_err(StoreError::redb)? {
                let record = codec::decode(bytes.value()).map_err(corrupt("lock"))?;
                out.push((key.to_string(), record));
            }
        }
        Ok(out)
    }

    pub fn lock(&self, key: &str) -> Result<Option<LockRecord>, StoreError> {
        let txn = self.read()?;
        let table = txn.open_table(LOCKS).map_err(StoreError::redb)?;
        decoded(table.get(key).map_err(StoreError::redb)?, "lock")
    }

    /// Held locks in key order whose key starts with `prefix`, after the key `after`.
    pub fn locks(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, LockRecord)>, StoreError> {
        let txn = self.read()?;
        let table = txn.open_table(LOCKS).map_err(StoreError::redb)?;
        let mut out = Vec::new();
        let range = match after {
            Some(after) if after >= prefix => {
                table.range::<&str>((std::ops::Bound::Excluded(after), std::ops::Bound::Unbounded))
            }
            _ => table.range(prefix..),
        }
        .map_err(StoreError::redb)?;
        for row in range {
            if out.len() == limit {
                break;
            }
            let (key, bytes) = row.map_err(StoreError::redb)?;
            let key = key.value();
            if !key.starts_with(prefix) {
                break;
            }
            out.push((
                key.to_string(),
                codec::decode(bytes.value()).map_err(corrupt("lock"))?,
            ));
        }
        Ok(out)
    }

    /// Audit events with a sequence number above `after`, oldest first.
    pub fn events(&self, after: u64, limit: usize) -> Result<Vec<Event>, StoreError> {
        let txn = self.read()?;
        let table = txn.open_table(EVENTS).map_err(StoreError::redb)?;
        let mut out = Vec::new();
        let Some(start) = after.checked_add(1) else {
            return Ok(out);
        };
        for row in table.range(start..).map_err(StoreError::redb)? {
            if out.len() == limit {
                break;
            }
            let (_, bytes) = row.map_err(StoreError::redb)?;
            out.push(codec::decode(bytes.value()).map_err(corrupt("event"))?);
        }
        Ok(out)
    }

    pub fn pool(&self, name: &str) -> Result<Option<PoolRecord>, StoreError> {
        let txn = self.read()?;
        let table = txn.open_table(POOLS).map_err(StoreError::redb)?;
        decoded(table.get(name).map_err(StoreError::redb)?, "pool")
    }

    /// Every seat of a pool, as committed, with the holder's session record.
    pub fn seats(
        &self,
        pool: &str,
    ) -> Result<Vec<(SessionId, SeatRecord, Option<SessionRecord>)>, StoreError> {
        let txn = self.read()?;
        let seats = txn.open_table(SEATS).map_err(StoreError::redb)?;
        let sessions = txn.open_table(SESSIONS).map_err(StoreError::redb)?;
        let mut out = Vec::new();
        for row in seats
            .range((pool, 0u128)..=(pool, u128::MAX))
            .map_err(StoreError::redb)?
        {
            let (k, bytes) = row.map_err(StoreError::redb)?;
            let sid = k.value().1;
            let seat = codec::decode(bytes.value()).map_err(corrupt("seat"))?;
            let session = decoded(sessions.get(sid).map_err(StoreError::redb)?, "session")?;
            out.push((SessionId::from_u128(sid), seat, session));
        }
        Ok(out)
    }

    /// The seats a session holds, as committed: (pool, token).
    pub fn session_seats(&self, id: SessionId) -> Result<Vec<(String, Token)>, StoreError> {
        let txn = self.read()?;
        let index = txn.open_table(SESSION_SEATS).map_err(StoreError::redb)?;
        let seats = txn.open_table(SEATS).map_err(StoreError::redb)?;
        let id = id.as_u128();
        let mut out = Vec::new();
        for row in index.range((id, "")..).map_err(StoreError::redb)? {
            let (entry, _) = row.map_err(StoreError::redb)?;
            let (sid, pool) = entry.value();
            if sid != id {
                break;
            }
            if let Some(b) = seats.get((pool, sid)).map_err(StoreError::redb)? {
                let seat: SeatRecord = codec::decode(b.value()).map_err(corrupt("seat"))?;
                out.push((pool.to_string(), seat.token));
            }
        }
        Ok(out)
    }

    /// The jobs a session has claimed, as committed.
    pub fn session_jobs(&self, id: SessionId) -> Result<Vec<JobId>, StoreError> {
        let txn = self.read()?;
        let index = txn.open_table(SESSION_JOBS).map_err(StoreError::redb)?;
        let id = id.as_u128();
        let mut out = Vec::new();
        for row in index
            .range((id, 0u128)..=(id, u128::MAX))
            .map_err(StoreError::redb)?
        {
            let (entry, _) = row.map_err(StoreError::redb)?;
            out.push(JobId::from_u128(entry.value().1));
        }
        Ok(out)
    }

    /// A job's record and payload, as committed.
    pub fn job(&self, id: JobId) -> Result<Option<(JobRecord, String)>, StoreError> {
        let txn = self.read()?;
        let jobs = txn.open_table(JOBS).map_err(StoreError::redb)?;
        let payloads = txn.open_table(JOB_PAYLOADS).map_err(StoreError::redb)?;
        let Some(b) = jobs.get(id.as_u128()).map_err(StoreError::redb)? else {
            return Ok(None);
        };
        let record = codec::decode(b.value()).map_err(corrupt("job"))?;
        let payload = match payloads.get(id.as_u128()).map_err(StoreError::redb)? {
            Some(p) => codec::decode(p.value()).map_err(corrupt("job payload"))?,
            None => String::new(),
        };
        Ok(Some((record, payload)))
    }

    /// Jobs of `queue` in state `code` (see `JobStatus::code`), in id order after `after`.
    pub fn jobs_in_state(
        &self,
        queue: &str,
        code: u8,
        after: Option<JobId>,
        limit: usize,
    ) -> Result<Vec<(JobId, JobRecord)>, StoreError> {
        let txn = self.read()?;
        let index = txn.open_table(JOBS_BY_STATE).map_err(StoreError::redb)?;
        let jobs = txn.open_table(JOBS).map_err(StoreError::redb)?;
        let Some(start) = after.map_or(Some(0), |a| a.as_u128().checked_add(1)) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for row in index
            .range((queue, code, start)..=(queue, code, u128::MAX))
            .map_err(StoreError::redb)?
        {
            if out.len() == limit {
                break;
            }
            let (entry, _) = row.map_err(StoreError::redb)?;
            let id = entry.value().2;
            if let Some(b) = jobs.get(id).map_err(StoreError::redb)? {
                out.push((
                    JobId::from_u128(id),
                    codec::decode(b.value()).map_err(corrupt("job"))?,
                ));
            }
        }
        Ok(out)
    }

    /// When the oldest audit event still kept was written.
    pub fn oldest_event_at(&self) -> Result<Option<UnixMs>, StoreError> {
        let txn = self.read()?;
        let table = txn.open_table(EVENTS).map_err(StoreError::redb)?;
        match table.first().map_err(StoreError::redb)? {
            Some((_, bytes)) => {
                let event: Event = codec::decode(bytes.value()).map_err(corrupt("event"))?;
                Ok(Some(event.at))
            }
            None => Ok(None),
        }
    }

    /// Verifies the store's own invariants: every lock's session exists, the session → grants
    /// index matches the locks, the owner index matches the sessions, every record decodes,
    /// and the counters are at or above everything they issued.
    pub fn check(&self) -> Result<CheckReport, StoreError> {
        let txn = self.read()?;
        let mut report = CheckReport::default();
        let meta = txn.open_table(META).map_err(StoreError::redb)?;
        let get = |name| -> Result<u64, StoreError> {
            Ok(meta
                .get(name)
                .map_err(StoreError::redb)?
                .map(|v| v.value())
                .unwrap_or(0))
        };
        report.revision = get(META_REVISION)?;
        let event_seq = get(META_EVENT_SEQ)?;
        let sessions = txn.open_table(SESSIONS).map_err(StoreError::redb)?;
        let by_owner = txn
            .open_table(SESSIONS_BY_OWNER)
            .map_err(StoreError::redb)?;
        let locks = txn.open_table(LOCKS).map_err(StoreError::redb)?;
        let index = txn.open_table(SESSION_LOCKS).map_err(StoreError::redb)?;
        let events = txn.open_table(EVENTS).map_err(StoreError::redb)?;
        let problems = &mut report.problems;

        for row in sessions.iter().map_err(StoreError::redb)? {
            let (id, bytes) = row.map_err(StoreError::redb)?;
            report.sessions += 1;
            let id = id.value();
            match codec::decode::<SessionRecord>(bytes.value()) {
                Ok(rec) => {
                    if by_owner
                        .get((rec.owner.as_str(), id))
                        .map_err(StoreError::redb)?
                        .is_none()
                    {
                        problems.push(format!(
                            "session {} is missing from the owner index",
                            SessionId::from_u128(id)
                        ));
                    }
                }
                Err(e) => problems.push(format!(
                    "session {} does not decode: {e}",
                    SessionId::from_u128(id)
                )),
            }
        }
        for row in by_owner.iter().map_err(StoreError::redb)? {
            let (entry, _) = row.map_err(StoreError::redb)?;
            let (owner, id) = entry.value();
            if sessions.get(id).map_err(StoreError::redb)?.is_none() {
                problems.push(format!(
                    "owner index names session {} ({owner:?}) which does not exist",
                    SessionId::from_u128(id)
                ));
            }
        }
        for row in locks.iter().map_err(StoreError::redb)? {
            let (key, bytes) = row.map_err(StoreError::redb)?;
            report.locks += 1;
            let key = key.value();
            let rec = match codec::decode::<LockRecord>(bytes.value()) {
                Ok(rec) => rec,
                Err(e) => {
                    problems.push(format!("lock {key:?} does not decode: {e}"));
                    continue;
                }
            };
            let sid = rec.session_id.as_u128();
            if sessions.get(sid).map_err(StoreError::redb)?.is_none() {
                problems.push(format!(
                    "lock {key:?} is held by session {} which does not exist",
                    rec.session_id
                ));
            }
            if index.get((sid, key)).map_err(StoreError::redb)?.is_none() {
                problems.push(format!(
                    "lock {key:?} is missing from its session's grant index"
                ));
            }
            if rec.token.0 > report.revision {
                problems.push(format!(
                    "lock {key:?} has token {} above the revision counter {}",
                    rec.token.0, report.revision
                ));
            }
        }
        for row in index.iter().map_err(StoreError::redb)? {
            let (entry, _) = row.map_err(StoreError::redb)?;
            let (sid, key) = entry.value();
            let holder = match locks.get(key).map_err(StoreError::redb)? {
                Some(bytes) => codec::decode::<LockRecord>(bytes.value())
                    .ok()
                    .map(|r| r.session_id.as_u128()),
                None => None,
            };
            if holder != Some(sid) {
                problems.push(format!(
                    "grant index says session {} holds {key:?}, the lock table disagrees",
                    SessionId::from_u128(sid)
                ));
            }
        }
        check_seats(&txn, report.revision, problems)?;
        check_jobs(&txn, report.revision, problems)?;
        for row in events.iter().map_err(StoreError::redb)? {
            let (seq, bytes) = row.map_err(StoreError::redb)?;
            report.events += 1;
            let seq = seq.value();
            if seq > event_seq {
                problems.push(format!(
                    "event {seq} is above the event counter {event_seq}"
                ));
            }
            if let Err(e) = codec::decode::<Event>(bytes.value()) {
                problems.push(format!("event {seq} does not decode: {e}"));
            }
        }
        Ok(report)
    }
}

/// Every seat's session and pool exist, its token is below the counter, and the session →
/// seats index matches the seats both ways.
fn check_seats(
    txn: &ReadTransaction,
    revision: u64,
    problems: &mut Vec<String>,
) -> Result<(), StoreError> {
    let sessions = txn.open_table(SESSIONS).map_err(StoreError::redb)?;
    let pools = txn.open_table(POOLS).map_err(StoreError::redb)?;
    let seats = txn.open_table(SEATS).map_err(StoreError::redb)?;
    let index = txn.open_table(SESSION_SEATS).map_err(StoreError::redb)?;
    for row in seats.iter().map_err(StoreError::redb)? {
        let (k, bytes) = row.map_err(StoreError::redb)?;
        let (pool, sid) = k.value();
        let who = SessionId::from_u128(sid);
        match codec::decode::<SeatRecord>(bytes.value()) {
            Ok(seat) if seat.token.0 > revision => problems.push(format!(
                "seat of {who} in {pool:?} has token {} above the revision counter {revision}",
                seat.token.0
            )),
            Ok(_) => {}
            Err(e) => problems.push(format!("seat of {who} in {pool:?} does not decode: {e}")),
        }
        if sessions.get(sid).map_err(StoreError::redb)?.is_none() {
            problems.push(format!(
                "seat in {pool:?} is held by session {who} which does not exist"
            ));
        }
        if pools.get(pool).map_err(StoreError::redb)?.is_none() {
            problems.push(format!(
                "seat of {who} is in pool {pool:?} which does not exist"
            ));
        }
        if index.get((sid, pool)).map_err(StoreError::redb)?.is_none() {
            problems.push(format!(
                "seat of {who} in {pool:?} is missing from its session's index"
            ));
        }
    }
    for row in index.iter().map_err(StoreError::redb)? {
        let (k, _) = row.map_err(StoreError::redb)?;
        let (sid, pool) = k.value();
        if seats.get((pool, sid)).map_err(StoreError::redb)?.is_none() {
            problems.push(format!(
                "seat index says session {} holds a seat in {pool:?}, the seat table disagrees",
                SessionId::from_u128(sid)
            ));
        }
    }
    Ok(())
}

/// Every job decodes and has its payload and state index entry; a claimed job's session
/// exists and its token is below the counter; the session → jobs index matches the claims.
fn check_jobs(
    txn: &ReadTransaction,
    revision: u64,
    problems: &mut Vec<String>,
) -> Result<(), StoreError> {
    let sessions = txn.open_table(SESSIONS).map_err(StoreError::redb)?;
    let jobs = txn.open_table(JOBS).map_err(StoreError::redb)?;
    let payloads = txn.open_table(JOB_PAYLOADS).map_err(StoreError::redb)?;
    let by_state = txn.open_table(JOBS_BY_STATE).map_err(StoreError::redb)?;
    let index = txn.open_table(SESSION_JOBS).map_err(StoreError::redb)?;
    for row in jobs.iter().map_err(StoreError::redb)? {
        let (id, bytes) = row.map_err(StoreError::redb)?;
        let id = id.value();
        let job = JobId::from_u128(id);
        let record = match codec::decode::<JobRecord>(bytes.value()) {
            Ok(r) => r,
            Err(e) => {
                problems.push(format!("job {job} does not decode: {e}"));
                continue;
            }
        };
        if payloads.get(id).map_err(StoreError::redb)?.is_none() {
            problems.push(format!("job {job} has no payload"));
        }
        if by_state
            .get((record.queue.as_str(), record.status.code(), id))
            .map_err(StoreError::redb)?
            .is_none()
        {
            problems.push(format!("job {job} is missing from the state index"));
        }
        if record.recovery_count > record.max_recoveries {
            problems.push(format!("job {job} was recovered more often than its cap"));
        }
        if let JobStatus::Claimed {
            session_id, token, ..
        } = &record.status
        {
            let sid = session_id.as_u128();
            if sessions.get(sid).map_err(StoreError::redb)?.is_none() {
                problems.push(format!(
                    "job {job} is claimed by session {session_id} which does not exist"
                ));
            }
            if index.get((sid, id)).map_err(StoreError::redb)?.is_none() {
                problems.push(format!(
                    "claimed job {job} is missing from its session's index"
                ));
            }
            if token.0 > revision {
                problems.push(format!(
                    "job {job} has claim token {} above the revision counter {revision}",
                    token.0
                ));
            }
        }
    }
    for row in by_state.iter().map_err(StoreError::redb)? {
        let (k, _) = row.map_err(StoreError::redb)?;
        let (queue, code, id) = k.value();
        let matches = match jobs.get(id).map_err(StoreError::redb)? {
            Some(b) => codec::decode::<JobRecord>(b.value())
                .is_ok_and(|r| r.queue == queue && r.status.code() == code),
            None => false,
        };
        if !matches {
            problems.push(format!(
                "state index lists job {} in {queue:?} state {code}, the job table disagrees",
                JobId::from_u128(id)
            ));
        }
    }
    for row in index.iter().map_err(StoreError::redb)? {
        let (k, _) = row.map_err(StoreError::redb)?;
        let (sid, id) = k.value();
        let claimed = match jobs.get(id).map_err(StoreError::redb)? {
            Some(b) => codec::decode::<JobRecord>(b.value()).is_ok_and(|r| {
                matches!(r.status, JobStatus::Claimed { session_id, .. } if session_id.as_u128() == sid)
            }),
            None => false,
        };
        if !claimed {
            problems.push(format!(
                "job index says session {} claimed job {}, the job table disagrees",
                SessionId::from_u128(sid),
                JobId::from_u128(id)
            ));
        }
    }
    Ok(())
}

/// A key, pool or queue name read back from the store; it passed the rules when written.
fn stored_key(text: &str) -> Result<LockKey, StoreError> {
    LockKey::parse("key", text).map_err(|e| StoreError::BadKey {
        key: text.to_string(),
        rule: e.to_string(),
    })
}

fn prepare_dir(dir: &Path) -> Result<PathBuf, StoreError> {
    std::fs::create_dir_all(dir).map_err(|source| StoreError::DataDir {
        path: dir.to_path_buf(),
        source,
    })?;
    Ok(dir.join(DATA_FILE))
}

/// Removes a job record's index entries, before it is rewritten or deleted.
fn unindex_job(
    by_state: &mut redb::Table<(&str, u8, u128), ()>,
    session_jobs: &mut redb::Table<(u128, u128), ()>,
    id: u128,
    old: &JobRecord,
) -> Result<(), StoreError> {
    by_state
        .remove((old.queue.as_str(), old.status.code(), id))
        .map_err(StoreError::redb)?;
    if let JobStatus::Claimed { session_id, .. } = &old.status {
        session_jobs
            .remove((session_id.as_u128(), id))
            .map_err(StoreError::redb)?;
    }
    Ok(())
}

fn apply(txn: &WriteTransaction, batch: &Batch<'_>) -> Result<Committed, StoreError> {
    let mut meta = txn.open_table(META).map_err(StoreError::redb)?;
    let mut sessions = txn.open_table(SESSIONS).map_err(StoreError::redb)?;
    let mut by_owner = txn
        .open_table(SESSIONS_BY_OWNER)
        .map_err(StoreError::redb)?;
    let mut locks = txn.open_table(LOCKS).map_err(StoreError::redb)?;
    let mut index = txn.open_table(SESSION_LOCKS).map_err(StoreError::redb)?;
    let mut events = txn.open_table(EVENTS).map_err(StoreError::redb)?;
    let mut pools = txn.open_table(POOLS).map_err(StoreError::redb)?;
    let mut seats = txn.open_table(SEATS).map_err(StoreError::redb)?;
    let mut session_seats = txn.open_table(SESSION_SEATS).map_err(StoreError::redb)?;
    let mut jobs = txn.open_table(JOBS).map_err(StoreError::redb)?;
    let mut payloads = txn.open_table(JOB_PAYLOADS).map_err(StoreError::redb)?;
    let mut by_state = txn.open_table(JOBS_BY_STATE).map_err(StoreError::redb)?;
    let mut session_jobs = txn.open_table(SESSION_JOBS).map_err(StoreError::redb)?;

    for change in batch.changes {
        match change {
            Change::PutSession { id, record } => {
                let id = id.as_u128();
                sessions
                    .insert(id, codec::encode(record).as_slice())
                    .map_err(StoreError::redb)?;
                by_owner
                    .insert((record.owner.as_str(), id), ())
                    .map_err(StoreError::redb)?;
            }
            Change::SetSessionTtl { id, ttl_ms } => {
                let found = sessions
                    .get(id.as_u128())
                    .map_err(StoreError::redb)?
                    .map(|b| codec::decode::<SessionRecord>(b.value()));
                if let Some(record) = found {
                    let mut record = record.map_err(corrupt("session"))?;
                    record.ttl_ms = *ttl_ms;
                    sessions
                        .insert(id.as_u128(), codec::encode(&record).as_slice())
                        .map_err(StoreError::redb)?;
                }
            }
            Change::DeleteSession { id } => {
                let removed = sessions
                    .remove(id.as_u128())
                    .map_err(StoreError::redb)?
                    .map(|b| codec::decode::<SessionRecord>(b.value()));
                if let Some(record) = removed {
                    let record = record.map_err(corrupt("session"))?;
                    by_owner
                        .remove((record.owner.as_str(), id.as_u128()))
                        .map_err(StoreError::redb)?;
                }
            }
            Change::PutLock { key, record } => {
                locks
                    .insert(key.as_str(), codec::encode(record).as_slice())
                    .map_err(StoreError::redb)?;
                index
                    .insert((record.session_id.as_u128(), key.as_str()), ())
                    .map_err(StoreError::redb)?;
            }
            Change::DeleteLock { key, session_id } => {
                locks.remove(key.as_str()).map_err(StoreError::redb)?;
                index
                    .remove((session_id.as_u128(), key.as_str()))
                    .map_err(StoreError::redb)?;
            }
            Change::PutPool { name, record } => {
                pools
                    .insert(name.as_str(), codec::encode(record).as_slice())
                    .map_err(StoreError::redb)?;
            }
            Change::DeletePool { name } => {
                pools.remove(name.as_str()).map_err(StoreError::redb)?;
            }
            Change::PutSeat {
                pool,
                session_id,
                record,
            } => {
                let sid = session_id.as_u128();
                seats
                    .insert((pool.as_str(), sid), codec::encode(record).as_slice())
                    .map_err(StoreError::redb)?;
                session_seats
                    .insert((sid, pool.as_str()), ())
                    .map_err(StoreError::redb)?;
            }
            Change::DeleteSeat { pool, session_id } => {
                let sid = session_id.as_u128();
                seats
                    .remove((pool.as_str(), sid))
                    .map_err(StoreError::redb)?;
                session_seats
                    .remove((sid, pool.as_str()))
                    .map_err(StoreError::redb)?;
            }
            Change::PutJob {
                id,
                record,
                payload,
            } => {
                let id = id.as_u128();
                let old = jobs
                    .get(id)
                    .map_err(StoreError::redb)?
                    .map(|b| codec::decode::<JobRecord>(b.value()));
                if let Some(old) = old {
                    unindex_job(
                        &mut by_state,
                        &mut session_jobs,
                        id,
                        &old.map_err(corrupt("job"))?,
                    )?;
                }
                jobs.insert(id, codec::encode(record).as_slice())
                    .map_err(StoreError::redb)?;
                by_state
                    .insert((record.queue.as_str(), record.status.code(), id), ())
                    .map_err(StoreError::redb)?;
                if let JobStatus::Claimed { session_id, .. } = &record.status {
                    session_jobs
                        .insert((session_id.as_u128(), id), ())
                        .map_err(StoreError::redb)?;
                }
                if let Some(payload) = payload {
                    payloads
                        .insert(id, codec::encode(payload).as_slice())
                        .map_err(StoreError::redb)?;
                }
            }
            Change::DeleteJob { id, .. } => {
                let id = id.as_u128();
                let old = jobs
                    .remove(id)
                    .map_err(StoreError::redb)?
                    .map(|b| codec::decode::<JobRecord>(b.value()));
                if let Some(old) = old {
                    unindex_job(
                        &mut by_state,
                        &mut session_jobs,
                        id,
                        &old.map_err(corrupt("job"))?,
                    )?;
                }
                payloads.remove(id).map_err(StoreError::redb)?;
            }
            Change::Event(event) => {
                events
                    .insert(event.seq, codec::encode(event).as_slice())
                    .map_err(StoreError::redb)?;
            }
        }
    }

    // The counters only ratchet up: a lower value here is a bug that would reissue tokens.
    let stored = meta
        .get(META_REVISION)
        .map_err(StoreError::redb)?
        .map(|v| v.value())
        .unwrap_or(0);
    if batch.revision < stored {
        return Err(StoreError::RevisionWentBack {
            stored,
            new: batch.revision,
        });
    }
    meta.insert(META_REVISION, batch.revision)
        .map_err(StoreError::redb)?;
    meta.insert(META_EVENT_SEQ, batch.event_seq)
        .map_err(StoreError::redb)?;

    let mut committed = Committed::default();
    if let Some((before, limit)) = batch.trim_events {
        let mut old = Vec::new();
        for row in events.iter().map_err(StoreError::redb)? {
            if old.len() == limit {
                break;
            }
            let (seq, bytes) = row.map_err(StoreError::redb)?;
            let event: Event = codec::decode(bytes.value()).map_err(corrupt("event"))?;
            if event.at >= before {
                break;
            }
            old.push(seq.value());
        }
        for seq in &old {
            events.remove(*seq).map_err(StoreError::redb)?;
        }
        committed.events_trimmed = old.len();
    }
    Ok(committed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{At, Effects, Limits, Mono, State};

    fn at(ms: u64) -> At {
        At {
            now: Mono(ms),
            wall: UnixMs(1_700_000_000_000 + ms),
        }
    }

    fn commit(store: &Store, state: &State, fx: &mut Effects) {
        store
            .commit(&Batch {
                changes: &fx.changes,
                revision: state.revision(),
                event_seq: state.event_seq(),
                trim_events: None,
            })
            .unwrap();
        fx.clear();
    }

    #[test]
    fn what_is_committed_loads_back_and_checks_clean() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20).unwrap();
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        let id = SessionId::random();
        state
            .open(id, "a".into(), Some(5_000), String::new(), at(0), &mut fx)
            .unwrap();
        let key = LockKey::parse("key", "k").unwrap();
        state.acquire(id, &key, at(1), &mut fx).unwrap();
        commit(&store, &state, &mut fx);
        let restore = store.load().unwrap();
        assert_eq!(restore.revision, 2);
        assert_eq!(restore.sessions, vec![(id, 5_000)]);
        assert_eq!(restore.locks.len(), 1);
        let report = store.check().unwrap();
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        assert_eq!(store.session_locks(id).unwrap().len(), 1);
    }

    #[test]
    fn check_reports_an_orphan_lock() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20).unwrap();
        let orphan = Change::PutLock {
            key: LockKey::parse("key", "k").unwrap(),
            record: LockRecord {
                session_id: SessionId::random(),
                token: Token(5),
                acquired_at: UnixMs(0),
            },
        };
        store
            .commit(&Batch {
                changes: &[orphan],
                revision: 3,
                event_seq: 0,
                trim_events: None,
            })
            .unwrap();
        let report = store.check().unwrap();
        assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
        assert!(report.problems[0].contains("does not exist"));
        assert!(report.problems[1].contains("above the revision counter"));
    }

    #[test]
    fn the_revision_never_goes_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20).unwrap();
        let batch = |revision| Batch {
            changes: &[],
            revision,
            event_seq: 0,
            trim_events: None,
        };
        store.commit(&batch(10)).unwrap();
        assert!(matches!(
            store.commit(&batch(9)),
            Err(StoreError::RevisionWentBack { stored: 10, new: 9 })
        ));
        // The refused commit failed the store for good.
        assert!(store.failed());
        assert!(matches!(store.commit(&batch(11)), Err(StoreError::Failed)));
    }

    #[test]
    fn an_io_failure_fail_stops_and_loses_nothing_committed() {
        let dir = tempfile::tempdir().unwrap();
        let (store, switch) = Store::open_with_faults(dir.path(), 1 << 20).unwrap();
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        let id = SessionId::random();
        state
            .open(id, "a".into(), Some(5_000), String::new(), at(0), &mut fx)
            .unwrap();
        commit(&store, &state, &mut fx);
        switch.fail_writes();
        state
            .open(
                SessionId::random(),
                "b".into(),
                None,
                String::new(),
                at(1),
                &mut fx,
            )
            .unwrap();
        assert!(
            store
                .commit(&Batch {
                    changes: &fx.changes,
                    revision: state.revision(),
                    event_seq: state.event_seq(),
                    trim_events: None,
                })
                .is_err()
        );
        assert!(store.failed());
        drop(store);
        let store = Store::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(store.load().unwrap().sessions, vec![(id, 5_000)]);
    }

    #[test]
    fn old_events_are_trimmed_in_bounded_batches() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20).unwrap();
        let mut state = State::new(Limits::default());
        let mut fx = Effects::default();
        for i in 0..5 {
            state
                .open(
                    SessionId::random(),
                    "a".into(),
                    None,
                    String::new(),
                    at(i * 1_000),
                    &mut fx,
                )
                .unwrap();
        }
        commit(&store, &state, &mut fx);
        let trim = |limit| {
            store
                .commit(&Batch {
                    changes: &[],
                    revision: state.revision(),
                    event_seq: state.event_seq(),
                    trim_events: Some((at(3_500).wall, limit)),
                })
                .unwrap()
                .events_trimmed
        };
        assert_eq!(trim(3), 3);
        assert_eq!(trim(3), 1);
        assert_eq!(trim(3), 0);
        let left: Vec<u64> = store.events(0, 10).unwrap().iter().map(|e| e.seq).collect();
        assert_eq!(left, vec![5]);
    }
}
