//! The audit log's hash chain: each event's hash is SHA-256 of the previous event's hash,
//! its sequence number and its stored bytes, kept in a table beside the events so the event
//! encoding is unchanged. An event edited in the data file no longer matches the chain, and
//! `leasehold check` says where.
//!
//! Every event is linked, but since schema 6 only the hash of the last event of each commit
//! is stored (and the first event's of a chain that begins): the hashes between are chained
//! in memory, and `verify` recomputes them through the events. Storing one row a commit
//! rather than one an event is what keeps the chain cheap in a storm of expiries; a file
//! with every hash stored (schema 5 and before) verifies unchanged, each stored hash being a
//! point the recomputed chain must pass through.
//!
//! Trimming old events keeps the hash of the last one trimmed as the anchor the first kept
//! event chains from, computing it through the trimmed events when it was not stored.
//! Events written before the chain existed (an older data file) have no hash; the chain
//! starts at the first event that has one. A plain hash chain detects an edit unless every
//! later hash is rewritten too: the head hash, kept elsewhere, detects that.

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

/// The events one commit appends, linked as they come and stored once, at the end.
#[derive(Default)]
pub(super) struct Appender {
    /// The last event linked and its hash: the `prev` of the next, and what
    /// [`Appender::finish`] stores. `None` until the first event looks the head up.
    last: Option<(u64, Hash)>,
}

impl Appender {
    /// Links event `seq`, stored as `bytes`, after the previous one.
    pub(super) fn push(
        &mut self,
        hashes: &mut Table<u64, &[u8]>,
        seq: u64,
        bytes: &[u8],
    ) -> Result<(), StoreError> {
        let h = match self.last {
            Some((_, prev)) => link(&prev, seq, bytes),
            None => {
                // Sequence numbers only grow, so the last stored hash is the previous
                // event's: every commit stores its last.
                let head = hashes.last().map_err(StoreError::redb)?;
                let begins = head.is_none();
                let prev = head.and_then(|(_, h)| hash_of(h.value()));
                let h = link(&prev.unwrap_or([0; 32]), seq, bytes);
                // The chain's first event is stored too, marking where it begins over
                // older, unhashed events.
                if begins {
                    hashes.insert(seq, h.as_slice()).map_err(StoreError::redb)?;
                }
                h
            }
        };
        self.last = Some((seq, h));
        Ok(())
    }

    /// Stores the hash of the commit's last event: the head the next commit chains from.
    pub(super) fn finish(self, hashes: &mut Table<u64, &[u8]>) -> Result<(), StoreError> {
        if let Some((seq, h)) = self.last {
            hashes.insert(seq, h.as_slice()).map_err(StoreError::redb)?;
        }
        Ok(())
    }
}

fn stored(hashes: &Table<u64, &[u8]>, seq: u64) -> Result<Option<Hash>, StoreError> {
    Ok(hashes
        .get(seq)
        .map_err(StoreError::redb)?
        .and_then(|h| hash_of(h.value())))
}

/// Drops the hashes of the events `trimmed` (sequence numbers in order, still in `events`),
/// keeping the hash of the last one as the anchor of what is kept. An anchor that was not
/// stored is computed through the trimmed events from the last stored hash among or below
/// them; only then are their bytes read.
pub(super) fn trim(
    hashes: &mut Table<u64, &[u8]>,
    events: &Table<u64, &[u8]>,
    trimmed: &[u64],
) -> Result<(), StoreError> {
    let (Some(&first), Some(&last_trimmed)) = (trimmed.first(), trimmed.last()) else {
        return Ok(());
    };
    if stored(hashes, last_trimmed)?.is_none() {
        // The chain through the trimmed events, from the anchor below them or the first
        // stored hash among them; before either, the events predate the chain.
        let mut prev: Option<Hash> =
            match hashes.range(..first).map_err(StoreError::redb)?.next_back() {
                Some(row) => hash_of(row.map_err(StoreError::redb)?.1.value()),
                None => None,
            };
        for &seq in trimmed {
            prev = match (stored(hashes, seq)?, prev) {
                (Some(h), _) => Some(h),
                (None, Some(p)) => {
                    let bytes = events.get(seq).map_err(StoreError::redb)?;
                    bytes.map(|b| link(&p, seq, b.value()))
                }
                (None, None) => None,
            };
        }
        if let Some(anchor) = prev {
            hashes
                .insert(last_trimmed, anchor.as_slice())
                .map_err(StoreError::redb)?;
        }
    }
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

/// Verifies the chain over `events` (sequence number and stored bytes, in order): every
/// stored hash must be where the chain recomputed through the events arrives, the last
/// event must have one, and no hash may name an event after the last. Reports each
/// mismatch once and goes on from the stored hash.
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
    // The events linked since the last stored hash, first and last: they are proven only
    // when a later stored hash is reached.
    let mut unproven: Option<(u64, u64)> = None;
    let mut last_event = None;
    for (seq, bytes) in events {
        last_event = Some(seq);
        let stored = hashes
            .get(seq)
            .map_err(StoreError::redb)?
            .and_then(|h| hash_of(h.value()));
        let Some(running) = prev else {
            // Before the chain begins: an event from before it existed.
            if let Some(h) = stored {
                if h != link(&[0; 32], seq, &bytes) {
                    problems.push(format!(
                        "event {seq} does not match its hash in the audit chain: the event was edited"
                    ));
                }
                prev = Some(h);
            }
            continue;
        };
        let expected = link(&running, seq, &bytes);
        match stored {
            None => {
                unproven = Some((unproven.map_or(seq, |(first, _)| first), seq));
                prev = Some(expected);
            }
            Some(h) => {
                if h != expected {
                    problems.push(match unproven {
                        None => format!(
                            "event {seq} does not match its hash in the audit chain: the event, or one before it, was edited"
                        ),
                        Some((since, _)) => format!(
                            "event {seq} does not match its hash in the audit chain: an event from {since} to {seq}, or one before, was edited, added or deleted"
                        ),
                    });
                }
                unproven = None;
                // Go on from the stored hash, so one edit is reported once.
                prev = Some(h);
            }
        }
    }
    if let Some((first, last)) = unproven {
        problems.push(format!(
            "events {first} to {last} have no hash after them in the audit chain: events were added after its head, or the chain cut"
        ));
    }
    if let Some(last) = last_event
        && let Some(row) = hashes.range(last + 1..).map_err(StoreError::redb)?.next()
    {
        let (seq, _) = row.map_err(StoreError::redb)?;
        problems.push(format!(
            "the audit chain has a hash for event {}, after the last event {last}: events were deleted from its end",
            seq.value()
        ));
    }
    Ok(())
}
