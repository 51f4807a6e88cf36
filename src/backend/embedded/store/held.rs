//! The committed locks, in key order, in memory, with the sessions whose ends are pending:
//! what lock reads answer from (the data file keeps the grants under their holders' rows
//! only, in `lock_rows`).
//!
//! Invariant: between commits, `rows` holds, for each key stored in `lock_rows`, its newest
//! grant (an older one is a pending end's, whose key was granted again), and `ended` exactly
//! the sessions named by the pending end-log records. A reaper pass leaves its sessions'
//! grants stored until its record is applied after the storm (see
//! [`super::endlog`]), and reads hide a lock whose holder is in `ended`. Walking the redb
//! table past a million such rows took about 0.4 s a page (`store/list_hidden`); here a
//! page steps over them in memory, looking each holder up in a hash set (about 0.11 s), and
//! a point read is one lookup. The rows leave the view when their record is applied, off the
//! storm.
//! Keeping them until then, rather than taking each out as its pass commits, keeps the
//! storm's own work to one set insert a session: taking 100 000 keys out of an ordered map
//! one by one, in deadline order, cost the writer more than the walks it saved.
//!
//! The writer updates the view after each commit is durable, under its write lock, so a
//! read sees the state after some commit and never a part of one: no lock is shown before its
//! grant is durable nor hidden before its release or end is. The writer answers a batch's
//! requests after the update, so a client reads its own writes.

use std::collections::{BTreeMap, HashSet};
use std::hash::BuildHasherDefault;
use std::ops::Bound;

use parking_lot::RwLock;

use super::endlog::{Applied, Ended};
use crate::domain::ids::SessionIdHasher;
use crate::domain::{Change, LockKey, LockRecord};

/// The ids of sessions with ends pending; drawn by the server, so hashed by their own bits.
type EndedIds = HashSet<u128, BuildHasherDefault<SessionIdHasher>>;

#[derive(Debug, Default)]
struct Rows {
    locks: BTreeMap<LockKey, LockRecord>,
    ended: EndedIds,
}

impl Rows {
    fn shown(&self, lock: &LockRecord) -> bool {
        !self.ended.contains(&lock.session_id.as_u128())
    }
}

#[derive(Debug, Default)]
pub(super) struct Held {
    rows: RwLock<Rows>,
}

impl Held {
    /// A view of the stored grants, given in key order, with no end pending.
    pub fn new(locks: Vec<(LockKey, LockRecord)>) -> Held {
        Held {
            rows: RwLock::new(Rows {
                locks: locks.into_iter().collect(),
                ended: EndedIds::default(),
            }),
        }
    }

    /// Brings the view to the state after a commit, in the commit's own order: `changes`,
    /// then the end-log records it `applied`, then the record it `appended`.
    pub fn committed(&self, changes: &[Change], applied: &Applied, appended: Option<&Ended>) {
        let locks_changed = changes
            .iter()
            .any(|c| matches!(c, Change::PutLock { .. } | Change::DeleteLock { .. }));
        if !locks_changed && applied.sessions.is_empty() && appended.is_none() {
            return;
        }
        let mut rows = self.rows.write();
        for change in changes {
            match change {
                Change::PutLock { key, record } => {
                    rows.locks.insert(key.clone(), record.clone());
                }
                // As in the table: the delete of an ending session's grant is unconditional.
                Change::DeleteLock { key, .. } => {
                    rows.locks.remove(key.as_str());
                }
                _ => {}
            }
        }
        // As in the table: only while the ended session still holds the key.
        for (key, holder) in &applied.grants {
            if rows
                .locks
                .get(key.as_str())
                .is_some_and(|l| l.session_id.as_u128() == *holder)
            {
                rows.locks.remove(key.as_str());
            }
        }
        for id in &applied.sessions {
            rows.ended.remove(id);
        }
        if let Some(ended) = appended {
            rows.ended.extend(ended.sessions.iter().copied());
        }
    }

    /// The lock on `key`, unless it is free or its holder's end is pending.
    pub fn get(&self, key: &str) -> Option<LockRecord> {
        let rows = self.rows.read();
        rows.locks.get(key).filter(|l| rows.shown(l)).cloned()
    }

    /// Up to `limit` shown locks in key order whose key starts with `prefix`, after `after`.
    pub fn page(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Vec<(String, LockRecord)> {
        let start = match after {
            Some(after) if after >= prefix => Bound::Excluded(after),
            _ => Bound::Included(prefix),
        };
        let rows = self.rows.read();
        rows.locks
            .range::<str, _>((start, Bound::Unbounded))
            .take_while(|(key, _)| key.as_str().starts_with(prefix))
            .filter(|(_, lock)| rows.shown(lock))
            .take(limit)
            .map(|(key, lock)| (key.as_str().to_string(), lock.clone()))
            .collect()
    }

    /// Every lock, in key order, sharing the keys: what a start-up loads, when no end is
    /// pending.
    pub fn all(&self) -> Vec<(LockKey, LockRecord)> {
        let rows = self.rows.read();
        debug_assert!(rows.ended.is_empty(), "loaded with ends pending");
        rows.locks
            .iter()
            .map(|(k, l)| (k.clone(), l.clone()))
            .collect()
    }
}

#[cfg(test)]
impl Held {
    /// Every row, hidden or not, in key order, and the pending sessions, sorted.
    pub fn contents(&self) -> (Vec<(String, LockRecord)>, Vec<u128>) {
        let rows = self.rows.read();
        let mut ended: Vec<u128> = rows.ended.iter().copied().collect();
        ended.sort_unstable();
        let locks = rows
            .locks
            .iter()
            .map(|(k, l)| (k.as_str().to_string(), l.clone()))
            .collect();
        (locks, ended)
    }
}
