//! The integrity check: every invariant of the stored state, read in one transaction, each
//! broken one reported in words.

use std::collections::{HashMap, HashSet};

use redb::{ReadTransaction, ReadableTable, ReadableTableMetadata, TableHandle};

use super::codec;
use super::db::Store;
use super::endlog::{self, END_LOG};
use super::error::StoreError;
use super::tables::{
    EVENTS, JOB_PAYLOADS, JOBS, JOBS_BY_STATE, LOCK_ROWS, META, META_EVENT_SEQ, META_REVISION,
    META_SESSION_ROW, POOLS, SEATS, SESSION_IDS, SESSION_JOBS, SESSION_ROWS, SESSION_SEATS,
    SESSIONS_BY_OWNER, SessionRow, SessionRowHead, StoredGrant, counter, row_of,
};
use crate::backend::{CheckReport, TableSpace};
use crate::domain::{JobId, JobRecord, JobStatus, SeatRecord, SessionId};

impl Store {
    /// Verifies the store's own invariants: every lock is stored under a session's row, no
    /// key is held by two live sessions, the id and owner indexes match the session rows,
    /// every record decodes, and the counters are at or above everything they issued.
    /// Sessions are counted as the server sees them: without those a pending end-log record
    /// ended, which must still have their rows.
    pub fn check(&self) -> Result<CheckReport, StoreError> {
        let txn = self.read()?;
        let mut report = CheckReport::default();
        let meta = txn.open_table(META).map_err(StoreError::redb)?;
        report.revision = counter(&meta, META_REVISION)?;
        let event_seq = counter(&meta, META_EVENT_SEQ)?;
        let rows = txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?;
        let ids = txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
        let by_owner = txn
            .open_table(SESSIONS_BY_OWNER)
            .map_err(StoreError::redb)?;
        let grants = txn.open_table(LOCK_ROWS).map_err(StoreError::redb)?;
        let events = txn.open_table(EVENTS).map_err(StoreError::redb)?;
        let last_row = counter(&meta, META_SESSION_ROW)?;
        let problems = &mut report.problems;
        // Sessions a pending end-log record ended keep their rows until it is applied: they
        // are checked like any other but not counted.
        let log = txn.open_table(END_LOG).map_err(StoreError::redb)?;
        let pending = endlog::pending_sessions(&log).unwrap_or_else(|e| {
            problems.push(format!("the end log does not read: {e}"));
            Vec::new()
        });
        let pending_sessions: HashSet<u128> = pending.into_iter().collect();
        // A record and the deletes it names commit together: a pending session has its row.
        // Its grants wait with it, under that row: their keys may have been granted again.
        let mut pending_rows = HashSet::new();
        for &id in &pending_sessions {
            match ids.get(id).map_err(StoreError::redb)? {
                Some(row) => {
                    pending_rows.insert(row.value());
                }
                None => problems.push(format!(
                    "the end log names session {}, which has no row",
                    SessionId::from_u128(id)
                )),
            }
        }

        for entry in rows.iter().map_err(StoreError::redb)? {
            let (row, bytes) = entry.map_err(StoreError::redb)?;
            let row = row.value();
            if row > last_row {
                problems.push(format!(
                    "session row {row} is above the row counter {last_row}"
                ));
            }
            let stored = match codec::decode::<SessionRow>(bytes.value()) {
                Ok(stored) => stored,
                Err(e) => {
                    problems.push(format!("session row {row} does not decode: {e}"));
                    continue;
                }
            };
            let id = stored.id;
            report.sessions += u64::from(!pending_sessions.contains(&id.as_u128()));
            if row_of(&ids, id)? != Some(row) {
                problems.push(format!(
                    "session {id} in row {row} is missing from the id index"
                ));
            }
            if by_owner
                .get((stored.record.owner.as_str(), id.as_u128()))
                .map_err(StoreError::redb)?
                .is_none()
            {
                problems.push(format!("session {id} is missing from the owner index"));
            }
        }
        for entry in ids.iter().map_err(StoreError::redb)? {
            let (id, row) = entry.map_err(StoreError::redb)?;
            let (id, row) = (SessionId::from_u128(id.value()), row.value());
            let holds = match rows.get(row).map_err(StoreError::redb)? {
                Some(bytes) => codec::decode::<SessionRow>(bytes.value()).is_ok_and(|s| s.id == id),
                None => false,
            };
            if !holds {
                problems.push(format!(
                    "id index puts session {id} in row {row}, which holds another or none"
                ));
            }
        }
        for entry in by_owner.iter().map_err(StoreError::redb)? {
            let (entry, _) = entry.map_err(StoreError::redb)?;
            let (owner, id) = entry.value();
            let id = SessionId::from_u128(id);
            if row_of(&ids, id)?.is_none() {
                problems.push(format!(
                    "owner index names session {id} ({owner:?}) which does not exist"
                ));
            }
        }
        // Each key's live holder's row, to find a key held twice.
        let mut live_keys: HashMap<String, u64> = HashMap::new();
        for entry in grants.iter().map_err(StoreError::redb)? {
            let (entry, bytes) = entry.map_err(StoreError::redb)?;
            let (row, key) = entry.value();
            let rec = match codec::decode::<StoredGrant>(bytes.value()) {
                Ok(rec) => rec,
                Err(e) => {
                    problems.push(format!("lock {key:?} does not decode: {e}"));
                    continue;
                }
            };
            let holder = match rows.get(row).map_err(StoreError::redb)? {
                Some(bytes) => codec::decode_head::<SessionRowHead<'_>>(bytes.value()).is_ok(),
                None => false,
            };
            if !holder {
                problems.push(format!(
                    "lock {key:?} is stored under session row {row}, which holds no session"
                ));
            }
            if rec.token.0 > report.revision {
                problems.push(format!(
                    "lock {key:?} has token {} above the revision counter {}",
                    rec.token.0, report.revision
                ));
            }
            if pending_rows.contains(&row) {
                continue;
            }
            report.locks += 1;
            if let Some(other) = live_keys.insert(key.to_string(), row) {
                problems.push(format!(
                    "lock {key:?} is held by two live sessions, in rows {other} and {row}"
                ));
            }
        }
        check_seats(&txn, report.revision, problems)?;
        check_jobs(&txn, report.revision, problems)?;
        let hashes = txn
            .open_table(super::chain::EVENT_HASHES)
            .map_err(StoreError::redb)?;
        // Streamed: a row that cannot be read is reported by the pass below.
        let stored = events
            .iter()
            .map_err(StoreError::redb)?
            .filter_map(Result::ok)
            .map(|(k, v)| (k.value(), v.value().to_vec()));
        super::chain::verify(&hashes, stored, problems)?;
        for row in events.iter().map_err(StoreError::redb)? {
            let (seq, bytes) = row.map_err(StoreError::redb)?;
            report.events += 1;
            let seq = seq.value();
            if seq > event_seq {
                problems.push(format!(
                    "event {seq} is above the event counter {event_seq}"
                ));
            }
            if let Err(e) = codec::decode_event(bytes.value()) {
                problems.push(format!("event {seq} does not decode: {e}"));
            }
        }
        report.space = space(&txn)?;
        Ok(report)
    }
}

/// Every table's pages, largest first.
fn space(txn: &ReadTransaction) -> Result<Vec<TableSpace>, StoreError> {
    let mut out = Vec::new();
    for handle in txn.list_tables().map_err(StoreError::redb)? {
        let table = handle.name().to_string();
        let opened = txn.open_untyped_table(handle).map_err(StoreError::redb)?;
        let stats = opened.stats().map_err(StoreError::redb)?;
        out.push(TableSpace {
            table,
            rows: opened.len().map_err(StoreError::redb)?,
            bytes: stats.stored_bytes() + stats.metadata_bytes() + stats.fragmented_bytes(),
            stored: stats.stored_bytes(),
            free: stats.fragmented_bytes(),
        });
    }
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.table.cmp(&b.table)));
    Ok(out)
}

/// Every seat's session and pool exist, its token is below the counter, and the session →
/// seats index matches the seats both ways.
fn check_seats(
    txn: &ReadTransaction,
    revision: u64,
    problems: &mut Vec<String>,
) -> Result<(), StoreError> {
    let sessions = txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
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
    let sessions = txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
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
