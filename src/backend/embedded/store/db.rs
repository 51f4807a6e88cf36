//! The store's handle: the redb database in the data directory, opened (optionally on a
//! backend whose writes can be made to fail), and the fail-stop flag.
//!
//! After any failed write the store refuses every later one (fail-stop): a retry could
//! acknowledge something a torn commit lost.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use redb::{Database, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata};

use super::codec;
use super::endlog;
use super::error::StoreError;
use super::fault::{FaultSwitch, FaultyBackend};
use super::held::Held;
use super::migrate;
use super::tables::{
    self, LOCK_ROWS, META, META_SCHEMA, SCHEMA_VERSION, SESSION_ROWS, SessionRowHead, StoredGrant,
    corrupt, stored_key,
};
use crate::domain::{LockKey, LockRecord, SessionId};

/// Sessions per transaction when the pending ends are applied at open.
const OPEN_APPLY_SESSIONS: usize = 50_000;

/// The file inside the data directory.
pub const DATA_FILE: &str = "leasehold.redb";

pub struct Store {
    pub(super) db: Database,
    path: PathBuf,
    /// Set by the first failed write; never cleared while the process lives.
    pub(super) failed: AtomicBool,
    /// The committed locks not hidden by a pending end, in key order: what lock reads
    /// answer from ([`super::held`]).
    pub(super) held: Held,
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

    /// Creates the tables of a new file, or brings an older file to this schema in the
    /// same transaction; refuses a file newer than this build.
    fn init(db: Database, path: PathBuf) -> Result<Store, StoreError> {
        let txn = db.begin_write().map_err(StoreError::redb)?;
        {
            let mut meta = txn.open_table(META).map_err(StoreError::redb)?;
            let schema = meta
                .get(META_SCHEMA)
                .map_err(StoreError::redb)?
                .map(|v| v.value());
            match schema {
                None | Some(SCHEMA_VERSION) => {}
                // Schema 3 lacks only `end_log`, which `create_all` adds; schema 2's events,
                // all of format 1, read as they are; schema 4's end-log records apply as
                // they are; schema 5's chain, a hash for every event, verifies as it is;
                // schema 6's grants move under their holders' rows.
                Some(from @ (1..=6)) => {
                    drop(meta);
                    let sessions = if from == 1 {
                        Some(migrate::v1_to_v2(&txn)?)
                    } else {
                        None
                    };
                    let grants = migrate::v6_to_v7(&txn)?;
                    tracing::info!(
                        sessions = sessions.map(|m| m.sessions),
                        grants,
                        path = %path.display(),
                        "data file migrated from schema {from} to {SCHEMA_VERSION}"
                    );
                    meta = txn.open_table(META).map_err(StoreError::redb)?;
                }
                Some(found) => {
                    return Err(StoreError::Schema {
                        found,
                        reads: SCHEMA_VERSION,
                    });
                }
            }
            if schema != Some(SCHEMA_VERSION) {
                meta.insert(META_SCHEMA, SCHEMA_VERSION)
                    .map_err(StoreError::redb)?;
            }
            tables::create_all(&txn)?;
        }
        txn.commit().map_err(StoreError::redb)?;
        let mut store = Store {
            db,
            path,
            failed: AtomicBool::new(false),
            held: Held::default(),
        };
        store.apply_all_ends()?;
        // With no end pending, every stored grant is a held lock.
        store.held = Held::new(store.lock_rows()?);
        Ok(store)
    }

    /// Every stored grant, in key order. Called with no end pending, when each key is
    /// stored once: a key under two rows is refused, as the load would hold it twice. Each
    /// grant's holder is the session of its row; both tables are in row order, so they are
    /// read side by side.
    fn lock_rows(&self) -> Result<Vec<(LockKey, LockRecord)>, StoreError> {
        let txn = self.read()?;
        let table = txn.open_table(LOCK_ROWS).map_err(StoreError::redb)?;
        let sessions = txn.open_table(SESSION_ROWS).map_err(StoreError::redb)?;
        let mut sessions = sessions.iter().map_err(StoreError::redb)?;
        // The last session row read: (row, its session).
        let mut holder: Option<(u64, SessionId)> = None;
        let mut locks = Vec::with_capacity(table.len().map_err(StoreError::redb)? as usize);
        for entry in table.iter().map_err(StoreError::redb)? {
            let (k, bytes) = entry.map_err(StoreError::redb)?;
            let (row, key) = k.value();
            while holder.is_none_or(|(r, _)| r < row) {
                let Some(next) = sessions.next() else {
                    break;
                };
                let (r, session) = next.map_err(StoreError::redb)?;
                let head: SessionRowHead<'_> =
                    codec::decode_head(session.value()).map_err(corrupt("session"))?;
                holder = Some((r.value(), head.id));
            }
            let id = match holder {
                Some((r, id)) if r == row => id,
                _ => {
                    return Err(StoreError::GrantWithoutHolder {
                        key: key.to_string(),
                        row,
                    });
                }
            };
            let grant: StoredGrant = codec::decode(bytes.value()).map_err(corrupt("lock"))?;
            locks.push((stored_key(key)?, grant.held_by(id)));
        }
        locks.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if let Some(pair) = locks.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(StoreError::KeyHeldTwice {
                key: pair[0].0.to_string(),
            });
        }
        Ok(locks)
    }

    /// Applies every pending end-log record, so that what is loaded has no ended session
    /// in it. A crash part-way leaves the unapplied records for the next open.
    fn apply_all_ends(&self) -> Result<(), StoreError> {
        let mut applied = 0;
        loop {
            let txn = self.db.begin_write().map_err(StoreError::redb)?;
            let n = endlog::apply(&txn, OPEN_APPLY_SESSIONS)?.sessions.len();
            if n == 0 {
                // Nothing was pending: the empty transaction is dropped, not committed.
                break;
            }
            txn.commit().map_err(StoreError::redb)?;
            applied += n;
        }
        if applied > 0 {
            tracing::info!(sessions = applied, path = %self.path.display(), "applied pending session ends");
        }
        Ok(())
    }

    /// Moves the live pages to the front of the file and gives back the free space behind
    /// them, pass after pass until one frees nothing; returns the passes that did. A running
    /// store reuses free pages but shrinks the file only where its tail is free, so a file
    /// once grown by a storm keeps its size; this is the offline `leasehold compact`. Each
    /// pass is a commit: a crash part-way leaves a smaller or an unchanged, whole file.
    pub fn compact(&mut self) -> Result<u32, StoreError> {
        let mut passes = 0;
        while self.db.compact().map_err(StoreError::redb)? {
            passes += 1;
        }
        Ok(passes)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many end-log records are waiting to be applied.
    pub fn pending_ends(&self) -> Result<u64, StoreError> {
        let txn = self.read()?;
        endlog::pending(&txn.open_table(endlog::END_LOG).map_err(StoreError::redb)?)
    }

    /// True once a write has failed: readiness is false and every write is refused.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    pub(super) fn read(&self) -> Result<ReadTransaction, StoreError> {
        self.db.begin_read().map_err(StoreError::redb)
    }
}

fn prepare_dir(dir: &Path) -> Result<PathBuf, StoreError> {
    std::fs::create_dir_all(dir).map_err(|source| StoreError::DataDir {
        path: dir.to_path_buf(),
        source,
    })?;
    Ok(dir.join(DATA_FILE))
}
