//! Writing: one `Batch` of changes in one write transaction with immediate durability
//! (fsync), together with the counters, so a token is never acknowledged before the counter
//! that issued it is durable.

use std::sync::atomic::Ordering;

use redb::{ReadableTable, WriteTransaction};

use super::chain;
use super::codec;
use super::db::Store;
use super::endlog::{self, Applied, Ended, SessionTables};
use super::error::StoreError;
use super::tables::{
    EVENTS, JOB_PAYLOADS, JOBS, JOBS_BY_STATE, META, META_EVENT_SEQ, META_REVISION,
    META_SESSION_ROW, POOLS, REQUEST_IDS, SEATS, SESSION_JOBS, SESSION_SEATS, SessionRow,
    SessionRowRef, StoredGrant, corrupt, counter, row_of,
};
use crate::domain::{Change, JobRecord, JobStatus, UnixMs};

/// One transaction's worth of writes.
#[derive(Default)]
pub struct Batch<'a> {
    pub changes: &'a [Change],
    /// The counters as they stand after `changes`.
    pub revision: u64,
    pub event_seq: u64,
    /// Trim audit events older than this, at most `limit` of them.
    pub trim_events: Option<(UnixMs, usize)>,
    /// The sessions reaper passes ended, whose rows go to the end log instead of being
    /// deleted now (see [`super::endlog`]).
    pub ended: Option<&'a Ended>,
    /// Apply pending end-log records, whole, until at least this many sessions are applied.
    pub apply_ended: usize,
}

/// What a commit did besides the changes themselves.
#[derive(Debug, Default, Clone, Copy)]
pub struct Committed {
    pub events_trimmed: usize,
    /// Sessions whose deferred deletes this commit applied.
    pub ends_applied: usize,
}

impl Store {
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
        let mut committed = apply(&txn, batch)?;
        // After the batch's own changes: a record is applied no sooner than the commit
        // after the one that appended it.
        let applied = if batch.apply_ended > 0 {
            endlog::apply(&txn, batch.apply_ended)?
        } else {
            Applied::default()
        };
        committed.ends_applied = applied.sessions.len();
        let appended = batch.ended.filter(|e| !e.is_empty());
        if let Some(ended) = appended {
            endlog::append(&txn, ended)?;
        }
        txn.commit().map_err(StoreError::redb)?;
        // Only now: a read must not show a lock before its grant is durable, nor hide one
        // before its release or end is.
        self.held.committed(batch.changes, &applied, appended);
        Ok(committed)
    }
}

/// Removes the index entries of the job record found in the table (none when it was absent),
/// before it is rewritten or deleted.
fn unindex_job(
    by_state: &mut redb::Table<(&str, u8, u128), ()>,
    session_jobs: &mut redb::Table<(u128, u128), ()>,
    id: u128,
    old: Option<Result<JobRecord, super::codec::CodecError>>,
) -> Result<(), StoreError> {
    let Some(old) = old else {
        return Ok(());
    };
    let old = old.map_err(corrupt("job"))?;
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
    let mut t = SessionTables::open(txn)?;
    // Rows are issued in commit order, which is creation order: the domain emits a
    // session's `PutSession` in the batch that opens it.
    let stored_row = counter(&meta, META_SESSION_ROW)?;
    let mut last_row = stored_row;
    let mut events = txn.open_table(EVENTS).map_err(StoreError::redb)?;
    let mut hashes = txn
        .open_table(chain::EVENT_HASHES)
        .map_err(StoreError::redb)?;
    let mut pools = txn.open_table(POOLS).map_err(StoreError::redb)?;
    let mut seats = txn.open_table(SEATS).map_err(StoreError::redb)?;
    let mut session_seats = txn.open_table(SESSION_SEATS).map_err(StoreError::redb)?;
    let mut jobs = txn.open_table(JOBS).map_err(StoreError::redb)?;
    let mut payloads = txn.open_table(JOB_PAYLOADS).map_err(StoreError::redb)?;
    let mut by_state = txn.open_table(JOBS_BY_STATE).map_err(StoreError::redb)?;
    let mut session_jobs = txn.open_table(SESSION_JOBS).map_err(StoreError::redb)?;
    let mut requests = txn.open_table(REQUEST_IDS).map_err(StoreError::redb)?;
    // Links the batch's events, storing the last one's hash when they are all in.
    let mut chain = chain::Appender::default();
    // Each event is encoded here, stored and hashed before the next one.
    let mut event_bytes = Vec::with_capacity(codec::EVENT_ROOM);

    for change in batch.changes {
        match change {
            Change::PutSession { id, record } => {
                // A session is put once, at its open; a second put of the same id keeps
                // its row rather than leaving the first one orphaned.
                let row = match row_of(&t.ids, *id)? {
                    Some(row) => row,
                    None => {
                        last_row += 1;
                        last_row
                    }
                };
                let bytes = codec::encode(&SessionRowRef { id: *id, record });
                t.rows
                    .insert(row, bytes.as_slice())
                    .map_err(StoreError::redb)?;
                t.ids.insert(id.as_u128(), row).map_err(StoreError::redb)?;
                t.by_owner
                    .insert((record.owner.as_str(), id.as_u128()), ())
                    .map_err(StoreError::redb)?;
            }
            Change::SetSessionTtl { id, ttl_ms } => {
                let Some(row) = row_of(&t.ids, *id)? else {
                    continue;
                };
                let found = t
                    .rows
                    .get(row)
                    .map_err(StoreError::redb)?
                    .map(|b| codec::decode::<SessionRow>(b.value()));
                if let Some(stored) = found {
                    let mut stored = stored.map_err(corrupt("session"))?;
                    stored.record.ttl_ms = *ttl_ms;
                    t.rows
                        .insert(row, codec::encode(&stored).as_slice())
                        .map_err(StoreError::redb)?;
                }
            }
            Change::DeleteSession { id } => {
                let left = t.delete_session(id.as_u128())?;
                // The domain deletes an ending session's grants before its row.
                debug_assert!(left.is_empty(), "grants outlived their session: {left:?}");
            }
            Change::PutLock { key, record } => {
                let Some(row) = row_of(&t.ids, record.session_id)? else {
                    return Err(StoreError::GrantWithoutSession {
                        key: key.to_string(),
                        session: record.session_id,
                    });
                };
                let grant = StoredGrant::of(record);
                t.grants
                    .insert((row, key.as_str()), codec::encode(&grant).as_slice())
                    .map_err(StoreError::redb)?;
            }
            // An ending session's grants are deleted before its row, in one batch.
            Change::DeleteLock { key, session_id } => {
                t.delete_grant(key.as_str(), session_id.as_u128())?
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
                unindex_job(&mut by_state, &mut session_jobs, id, old)?;
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
                unindex_job(&mut by_state, &mut session_jobs, id, old)?;
                payloads.remove(id).map_err(StoreError::redb)?;
            }
            Change::Event(event) => {
                // A sequence number is issued once: an event above the counter written with
                // it, or over one already written, is a bug that would lose an audit record.
                if event.seq > batch.event_seq {
                    return Err(StoreError::EventAboveCounter {
                        seq: event.seq,
                        counter: batch.event_seq,
                    });
                }
                codec::encode_event_into(event, &mut event_bytes);
                let bytes = event_bytes.as_slice();
                let replaced = events
                    .insert(event.seq, bytes)
                    .map_err(StoreError::redb)?
                    .is_some();
                if replaced {
                    return Err(StoreError::EventExists { seq: event.seq });
                }
                // Hashed as it is appended, over the very bytes stored.
                chain.push(&mut hashes, event.seq, bytes)?;
            }
            Change::PutRequest { key, record } => {
                requests
                    .insert(key.as_str(), codec::encode(record).as_slice())
                    .map_err(StoreError::redb)?;
            }
            Change::DeleteRequest { key } => {
                requests.remove(key.as_str()).map_err(StoreError::redb)?;
            }
        }
    }

    // The counters only ratchet up: a lower value here is a bug that would reissue tokens
    // or sequence numbers.
    let stored = counter(&meta, META_REVISION)?;
    if batch.revision < stored {
        return Err(StoreError::RevisionWentBack {
            stored,
            new: batch.revision,
        });
    }
    let stored = counter(&meta, META_EVENT_SEQ)?;
    if batch.event_seq < stored {
        return Err(StoreError::EventSeqWentBack {
            stored,
            new: batch.event_seq,
        });
    }
    meta.insert(META_REVISION, batch.revision)
        .map_err(StoreError::redb)?;
    meta.insert(META_EVENT_SEQ, batch.event_seq)
        .map_err(StoreError::redb)?;
    if last_row != stored_row {
        meta.insert(META_SESSION_ROW, last_row)
            .map_err(StoreError::redb)?;
    }

    chain.finish(&mut hashes)?;

    let mut committed = Committed::default();
    if let Some((before, limit)) = batch.trim_events {
        let mut old = Vec::new();
        for row in events.iter().map_err(StoreError::redb)? {
            if old.len() == limit {
                break;
            }
            let (seq, bytes) = row.map_err(StoreError::redb)?;
            let event = codec::decode_event(bytes.value()).map_err(corrupt("event"))?;
            if event.at >= before {
                break;
            }
            old.push(seq.value());
        }
        // The anchor is computed while the trimmed events are still there to read.
        chain::trim(&mut hashes, &events, &old)?;
        for seq in &old {
            events.remove(*seq).map_err(StoreError::redb)?;
        }
        committed.events_trimmed = old.len();
    }
    Ok(committed)
}
