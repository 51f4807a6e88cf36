//! The audit log's hash chain: each event's hash is SHA-256 of the previous event's hash,
//! its sequence number and its stored bytes, kept in a table beside the events so the event
//! encoding is unchanged. An event edited in the data file no longer matches its hash, and
//! `leasehold check` says which.
//!
//! Trimming old events keeps the hash of the last one trimmed as the anchor the first kept
//! event chains from. Events written before the chain existed (an older data file) have no
//! hash; the chain starts at the first event that has one. A plain hash chain detects an
//! edit unless every later hash is rewritten too: the head hash, kept elsewhere, detects that.

use redb::{ReadableTable, Table, TableDefinition};
use sha2::{Digest, Sha256};

use super::error::StoreError;

pub(super) const EVENT_HASHES: TableDefinition<u64, &[u8]> = TableDefinition::new("event_hashes");

pub(super) type Hash = [u8; 32];

pub(super) fn link(prev: &Hash, seq: u64, bytes: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update(prev);
    h.update(seq.to_be_bytes());
    h.update(bytes);
    h.finalize().into()
}

fn hash_of(bytes: &[u8]) -> Option<Hash> {
    bytes.try_into().ok()
}

/// The hash the next appended event chains from: the last stored hash (sequence numbers
/// only grow, so it is the previous event's), or zeros before the first.
pub(super) fn head(hashes: &Table<u64, &[u8]>) -> Result<Hash, StoreError> {
    Ok(match hashes.last().map_err(StoreError::redb)? {
        Some((_, h)) => hash_of(h.value()).unwrap_or([0; 32]),
        None => [0; 32],
    })
}

/// Appends the hash of event `seq` (stored as `bytes`) chained from `prev`, and returns it:
/// the `prev` of the next event, so a batch of events looks the head up once, not once each.
pub(super) fn append(
    hashes: &mut Table<u64, &[u8]>,
    prev: &Hash,
    seq: u64,
    bytes: &[u8],
) -> Result<Hash, StoreError> {
    let h = link(prev, seq, bytes);
    hashes.insert(seq, h.as_slice()).map_err(StoreError::redb)?;
    Ok(h)
}

pub(super) fn trim(hashes: &mut Table<u64, &[u8]>, last_trimmed: u64) -> Result<(), StoreError> {
    let below: Vec<u64> = hashes
        .range(..last_trimmed)
        .map_err(StoreError::redb)?
        .map(|r| r.map(|(k, _)| k.value()))
        .collect::<Result<_, _>>()
        .map_err(StoreError::redb)?;
    for seq in below {
        hashes.remove(seq).map_err(StoreError::redb)?;
    }
    Ok(())
}

/// Verifies the chain over `events` (sequence number and stored bytes, in order), reporting
/// each event whose hash does not match or is missing once the chain has begun.
pub(super) fn verify(
    hashes: &impl ReadableTable<u64, &'static [u8]>,
    events: impl Iterator<Item = (u64, Vec<u8>)>,
    problems: &mut Vec<String>,
) -> Result<(), StoreError> {
    let mut events = events.peekable();
    let first_event = events.peek().map(|(seq, _)| *seq);
    // The anchor: a hash older than every kept event, left by trimming.
    let mut prev: Option<Hash> = None;
    if let Some(first) = first_event
        && let Some(row) = hashes.range(..first).map_err(StoreError::redb)?.next_back()
    {
        let (_, h) = row.map_err(StoreError::redb)?;
        prev = hash_of(h.value());
    }
    let mut begun = prev.is_some();
    for (seq, bytes) in events {
        let stored = hashes
            .get(seq)
            .map_err(StoreError::redb)?
            .and_then(|h| hash_of(h.value()));
        match stored {
            None if begun => problems.push(format!(
                "event {seq} has no hash in the audit chain: events were added or the chain cut"
            )),
            None => {}
            Some(h) => {
                let expected = link(&prev.unwrap_or([0; 32]), seq, &bytes);
                if h != expected {
                    problems.push(format!(
                        "event {seq} does not match its hash in the audit chain: the event, or one before it, was edited"
                    ));
                }
                begun = true;
                // Go on from the stored hash, so one edit is reported once.
                prev = Some(h);
            }
        }
    }
    Ok(())
}
