//! Point and range reads, each in its own read transaction: they see only what has been
//! committed and never wait for the writer.

use redb::ReadableTable;

use super::codec;
use super::db::Store;
use super::error::StoreError;
use super::tables::{
    EVENTS, JOB_PAYLOADS, JOBS, JOBS_BY_STATE, LOCK_ROWS, POOLS, SEATS, SESSION_IDS, SESSION_JOBS,
    SESSION_ROWS, SESSION_SEATS, SESSIONS_BY_OWNER, StoredGrant, corrupt, decoded, record_at,
    row_of, session_record,
};
use crate::domain::{
    Event, JobId, JobRecord, LockRecord, PoolRecord, SeatRecord, SessionId, SessionRecord, Token,
    UnixMs,
};

impl Store {
    pub fn session(&self, id: SessionId) -> Result<Option<SessionRecord>, StoreError> {
        let txn = self.read()?;
        let ids = txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
        let rows = txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?;
        session_record(&ids, &rows, id)
    }

    /// Sessions in id order after `after`, optionally only those of `owner`.
    pub fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> Result<Vec<(SessionId, SessionRecord)>, StoreError> {
        let txn = self.read()?;
        let ids = txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
        let rows = txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?;
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
                // `session_ids` is in id order, the order of the listing.
                for entry in ids.range(start..).map_err(StoreError::redb)? {
                    if out.len() == limit {
                        break;
                    }
                    let (id, row) = entry.map_err(StoreError::redb)?;
                    let id = SessionId::from_u128(id.value());
                    if let Some(record) = record_at(&rows, row.value())? {
                        out.push((id, record));
                    }
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
                    let id = SessionId::from_u128(entry.value().1);
                    if let Some(record) = session_record(&ids, &rows, id)? {
                        out.push((id, record));
                    }
                }
            }
        }
        Ok(out)
    }

    /// The locks a session holds, as committed, in key order.
    pub fn session_locks(&self, id: SessionId) -> Result<Vec<(String, LockRecord)>, StoreError> {
        let txn = self.read()?;
        let ids = txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
        let grants = txn.open_table(LOCK_ROWS).map_err(StoreError::redb)?;
        let mut out = Vec::new();
        let Some(row) = row_of(&ids, id)? else {
            return Ok(out);
        };
        for entry in grants
            .range((row, "")..(row + 1, ""))
            .map_err(StoreError::redb)?
        {
            let (entry, bytes) = entry.map_err(StoreError::redb)?;
            let grant: StoredGrant = codec::decode(bytes.value()).map_err(corrupt("lock"))?;
            out.push((entry.value().1.to_string(), grant.held_by(id)));
        }
        Ok(out)
    }

    /// The lock on `key`, unless it is free or its holder's end is pending in the end log.
    pub fn lock(&self, key: &str) -> Result<Option<LockRecord>, StoreError> {
        Ok(self.held.get(key))
    }

    /// Held locks in key order whose key starts with `prefix`, after the key `after`.
    pub fn locks(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, LockRecord)>, StoreError> {
        Ok(self.held.page(prefix, after, limit))
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
            out.push(codec::decode_event(bytes.value()).map_err(corrupt("event"))?);
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
        let ids = txn.open_table(SESSION_IDS).map_err(StoreError::redb)?;
        let rows = txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?;
        let mut out = Vec::new();
        for row in seats
            .range((pool, 0u128)..=(pool, u128::MAX))
            .map_err(StoreError::redb)?
        {
            let (k, bytes) = row.map_err(StoreError::redb)?;
            let sid = k.value().1;
            let seat = codec::decode(bytes.value()).map_err(corrupt("seat"))?;
            let sid = SessionId::from_u128(sid);
            out.push((sid, seat, session_record(&ids, &rows, sid)?));
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
                let event = codec::decode_event(bytes.value()).map_err(corrupt("event"))?;
                Ok(Some(event.at))
            }
            None => Ok(None),
        }
    }
}
