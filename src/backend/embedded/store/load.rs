//! The start-up load: everything the in-memory state is rebuilt from, in one read
//! transaction.

use redb::{ReadTransaction, ReadableTable, ReadableTableMetadata};

use super::codec;
use super::db::Store;
use super::error::StoreError;
use super::tables::{
    EVENTS, JOBS, META, META_EVENT_SEQ, META_REVISION, POOLS, SEATS, SESSION_ROWS, SessionRow,
    corrupt, counter, stored_key,
};
use crate::domain::state::Restore;
use crate::domain::{JobId, JobRecord, PoolRecord, RequestRecord, SeatRecord, SessionId};

/// The audit counter to continue from: the stored one, unless the log already holds a
/// higher sequence number — a counter fallen behind (a bug, or a damaged file) would number
/// new events over old ones. Then the counter is repaired upward, in memory now and on disk
/// with the next commit; sequence numbers only need to be unique and increasing, so
/// skipping some loses nothing.
fn event_seq_above_the_log(txn: &ReadTransaction, stored: u64) -> Result<u64, StoreError> {
    let events = txn.open_table(EVENTS).map_err(StoreError::redb)?;
    let last = events
        .last()
        .map_err(StoreError::redb)?
        .map_or(0, |(seq, _)| seq.value());
    if last > stored {
        tracing::warn!(
            counter = stored,
            last_event = last,
            "the audit event counter is behind the last stored event; continuing from {last} \
             (`leasehold check` reports the file until the next write repairs it)"
        );
        return Ok(last);
    }
    Ok(stored)
}

impl Store {
    /// Everything the in-memory state is rebuilt from at start-up.
    /// Every remembered request id and its record, expired or not (the writer forgets
    /// those past their time in bounded passes).
    pub fn request_ids(&self) -> Result<Vec<(String, RequestRecord)>, StoreError> {
        let txn = self.read()?;
        let table = txn
            .open_table(super::tables::REQUEST_IDS)
            .map_err(StoreError::redb)?;
        let mut out = Vec::with_capacity(table.len().unwrap_or(0) as usize);
        for row in table.iter().map_err(StoreError::redb)? {
            let (key, bytes) = row.map_err(StoreError::redb)?;
            let record = codec::decode(bytes.value()).map_err(corrupt("request id"))?;
            out.push((key.value().to_string(), record));
        }
        Ok(out)
    }

    pub fn load(&self) -> Result<Restore, StoreError> {
        let txn = self.read()?;
        let meta = txn.open_table(META).map_err(StoreError::redb)?;
        let revision = counter(&meta, META_REVISION)?;
        let event_seq = event_seq_above_the_log(&txn, counter(&meta, META_EVENT_SEQ)?)?;
        let sessions_table = txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?;
        let mut sessions = Vec::with_capacity(sessions_table.len().unwrap_or(0) as usize);
        for row in sessions_table.iter().map_err(StoreError::redb)? {
            let (_, bytes) = row.map_err(StoreError::redb)?;
            let stored: SessionRow = codec::decode(bytes.value()).map_err(corrupt("session"))?;
            sessions.push((stored.id, stored.record.ttl_ms));
        }
        // The lock view was read from the stored grants at open, with no end pending; its keys
        // are shared with the state's.
        let locks = self.held.all();
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
}
