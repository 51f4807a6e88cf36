//! The integrity check: every invariant of the stored state, read in one transaction, each
//! broken one reported in words.

use redb::{ReadTransaction, ReadableTable};

use super::codec;
use super::db::Store;
use super::error::StoreError;
use super::tables::{
    EVENTS, JOB_PAYLOADS, JOBS, JOBS_BY_STATE, LOCKS, META, META_EVENT_SEQ, META_REVISION, POOLS,
    SEATS, SESSION_JOBS, SESSION_LOCKS, SESSION_SEATS, SESSIONS, SESSIONS_BY_OWNER, counter,
};
use crate::backend::CheckReport;
use crate::domain::{
    Event, JobId, JobRecord, JobStatus, LockRecord, SeatRecord, SessionId, SessionRecord,
};

impl Store {
    /// Verifies the store's own invariants: every lock's session exists, the session → grants
    /// index matches the locks, the owner index matches the sessions, every record decodes,
    /// and the counters are at or above everything they issued.
    pub fn check(&self) -> Result<CheckReport, StoreError> {
        let txn = self.read()?;
        let mut report = CheckReport::default();
        let meta = txn.open_table(META).map_err(StoreError::redb)?;
        report.revision = counter(&meta, META_REVISION)?;
        let event_seq = counter(&meta, META_EVENT_SEQ)?;
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
