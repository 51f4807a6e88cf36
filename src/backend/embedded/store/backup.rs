//! Online backup and offline restore of the data file.
//!
//! A backup is a new redb file holding every table of one read transaction of the live
//! store. A redb read transaction is a consistent MVCC snapshot: it sees exactly the commits
//! before it began, and the writer keeps committing while it is open (the pages it reads
//! are kept until it ends), so taking a backup stalls no writer. The copy lists its tables
//! from one place (`tables::each_table`) and refuses a data file holding any other, so a
//! backup is never silently incomplete. Its `meta` table also records the snapshot's revision
//! (`backup_revision`, the highest token the backup knows of) and when it was taken
//! (`backup_taken_at`, Unix ms).
//!
//! A restore starts from such a file and raises the revision counter above every token the
//! lost server may have issued, including those after the backup (see `raise_for_restore`).

use std::collections::BTreeSet;
use std::path::Path;

use redb::{
    Key, MultimapTableHandle, ReadTransaction, ReadableDatabase, ReadableTable, TableDefinition,
    TableHandle, Value, WriteTransaction,
};

use super::db::Store;
use super::error::StoreError;
use super::tables::{self, EachTable, META, META_EVENT_SEQ, META_REVISION, META_SCHEMA, counter};
use super::write::Batch;
use crate::domain::state::floor_detail;
use crate::domain::{Change, Event, EventKind, UnixMs};

/// `meta` key of a backup: the revision of the snapshot.
const META_BACKUP_REVISION: &str = "backup_revision";
/// `meta` key of a backup: when the snapshot was taken, Unix ms on the server's clock.
const META_BACKUP_TAKEN_AT: &str = "backup_taken_at";

/// The page cache of a backup being written or inspected: it is written once, front to back.
const BACKUP_CACHE_BYTES: usize = 16 * 1024 * 1024;

/// What a backup holds, read from its `meta` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackupInfo {
    /// The revision counter of the snapshot: every token in the backup is at most this.
    pub revision: u64,
    pub event_seq: u64,
    pub schema: u64,
    pub taken_at: UnixMs,
    /// Rows copied, all tables together (`meta` included).
    pub rows: u64,
}

/// Copies every row of each table from a snapshot into the backup's write transaction.
struct Copy<'a> {
    from: &'a ReadTransaction,
    to: &'a WriteTransaction,
    copied: BTreeSet<String>,
    rows: u64,
}

impl EachTable for Copy<'_> {
    fn table<K: Key + 'static, V: Value + 'static>(
        &mut self,
        def: TableDefinition<'static, K, V>,
    ) -> Result<(), StoreError> {
        let src = self.from.open_table(def).map_err(StoreError::redb)?;
        let mut dst = self.to.open_table(def).map_err(StoreError::redb)?;
        for row in src.iter().map_err(StoreError::redb)? {
            let (k, v) = row.map_err(StoreError::redb)?;
            dst.insert(k.value(), v.value()).map_err(StoreError::redb)?;
            self.rows += 1;
        }
        self.copied.insert(def.name().to_string());
        Ok(())
    }
}

impl Store {
    /// Writes a backup of one consistent snapshot of the store to `dest`, a new file, and
    /// fsyncs it. Holds no lock the writer takes: the writer keeps committing meanwhile.
    pub fn backup_into(&self, dest: &Path, taken_at: UnixMs) -> Result<BackupInfo, StoreError> {
        if self.failed() {
            return Err(StoreError::Failed);
        }
        let snapshot = self.read()?;
        let out = redb::Builder::new()
            .set_cache_size(BACKUP_CACHE_BYTES)
            .create(dest)
            .map_err(StoreError::redb)?;
        let txn = out.begin_write().map_err(StoreError::redb)?;
        let mut copy = Copy {
            from: &snapshot,
            to: &txn,
            copied: BTreeSet::new(),
            rows: 0,
        };
        tables::each_table(&mut copy)?;
        let rows = copy.rows;
        for handle in snapshot.list_tables().map_err(StoreError::redb)? {
            if !copy.copied.contains(handle.name()) {
                return Err(StoreError::UnlistedTable(handle.name().to_string()));
            }
        }
        if let Some(handle) = snapshot
            .list_multimap_tables()
            .map_err(StoreError::redb)?
            .next()
        {
            return Err(StoreError::UnlistedTable(handle.name().to_string()));
        }
        let info = {
            let mut meta = txn.open_table(META).map_err(StoreError::redb)?;
            let revision = counter(&meta, META_REVISION)?;
            meta.insert(META_BACKUP_REVISION, revision)
                .map_err(StoreError::redb)?;
            meta.insert(META_BACKUP_TAKEN_AT, taken_at.0)
                .map_err(StoreError::redb)?;
            BackupInfo {
                revision,
                event_seq: counter(&meta, META_EVENT_SEQ)?,
                schema: counter(&meta, META_SCHEMA)?,
                taken_at,
                rows,
            }
        };
        // Default durability: the commit fsyncs the backup before it is read back.
        txn.commit().map_err(StoreError::redb)?;
        drop(snapshot);
        Ok(info)
    }

    /// Raises the revision counter of a store just restored from a backup to `floor` and
    /// records the raise, so that every token issued from here on is above `floor`; removes
    /// the backup's own `meta` keys. Offline: nothing else writes to the store.
    pub fn raise_for_restore(&self, floor: u64, at: UnixMs) -> Result<u64, StoreError> {
        let restore = self.load()?;
        let previous = restore.revision;
        let mut event = Event::new(restore.event_seq + 1, at, EventKind::TokenFloorRaised);
        event.detail = Some(floor_detail(floor, previous));
        // The raise takes its own revision above the floor, as it does online.
        let revision = previous.max(floor) + 1;
        self.commit(&Batch {
            changes: &[Change::Event(event)],
            revision,
            event_seq: restore.event_seq + 1,
            trim_events: None,
            ..Default::default()
        })?;
        let txn = self.db.begin_write().map_err(StoreError::redb)?;
        {
            let mut meta = txn.open_table(META).map_err(StoreError::redb)?;
            meta.remove(META_BACKUP_REVISION)
                .map_err(StoreError::redb)?;
            meta.remove(META_BACKUP_TAKEN_AT)
                .map_err(StoreError::redb)?;
        }
        txn.commit().map_err(StoreError::redb)?;
        Ok(revision)
    }
}

/// A backup ready to be sent: the file, open for reading and already unlinked (nothing is
/// left behind however the sending ends), its length and what it holds.
pub struct BackupFile {
    pub file: std::fs::File,
    pub len: u64,
    pub info: BackupInfo,
}

impl Store {
    /// Writes a backup into a new file beside the data file (same file system, so the space
    /// it needs is where the operator watches it), opens it and unlinks it.
    pub fn backup_file(&self, taken_at: UnixMs) -> Result<BackupFile, StoreError> {
        let dir = self.path().parent().unwrap_or(Path::new("."));
        let path = dir.join(format!(".backup-{}.partial", uuid::Uuid::new_v4().simple()));
        let data_dir = |source| StoreError::DataDir {
            path: path.clone(),
            source,
        };
        let built = self.backup_into(&path, taken_at).and_then(|info| {
            let file = std::fs::File::open(&path).map_err(data_dir)?;
            let len = file.metadata().map_err(data_dir)?.len();
            Ok(BackupFile { file, len, info })
        });
        // Unlinked whether or not it was built; an open handle keeps the bytes readable.
        let _ = std::fs::remove_file(&path);
        built
    }
}

/// Reads what a backup file holds without writing to it; refuses a file that is not a
/// backup (no `backup_revision`), or whose schema is newer than this build reads. An older
/// schema is accepted: opening the restored copy migrates it, as it does a data directory.
pub fn inspect(path: &Path) -> Result<BackupInfo, StoreError> {
    let not_a_backup = |why: String| StoreError::NotABackup {
        path: path.to_path_buf(),
        why,
    };
    let db = redb::Builder::new()
        .set_cache_size(BACKUP_CACHE_BYTES)
        .open_read_only(path)
        .map_err(|e| not_a_backup(format!("not a readable redb file: {e}")))?;
    let txn = db.begin_read().map_err(StoreError::redb)?;
    let meta = txn
        .open_table(META)
        .map_err(|e| not_a_backup(format!("no meta table: {e}")))?;
    let Some(revision) = meta
        .get(META_BACKUP_REVISION)
        .map_err(StoreError::redb)?
        .map(|v| v.value())
    else {
        return Err(not_a_backup(
            "it has no backup_revision: a data file, not a file written by `leasehold backup`"
                .into(),
        ));
    };
    let schema = counter(&meta, META_SCHEMA)?;
    if schema > tables::SCHEMA_VERSION {
        return Err(StoreError::Schema {
            found: schema,
            reads: tables::SCHEMA_VERSION,
        });
    }
    let mut rows = 0;
    for handle in txn.list_tables().map_err(StoreError::redb)? {
        let table = txn.open_untyped_table(handle).map_err(StoreError::redb)?;
        rows += redb::ReadableTableMetadata::len(&table).map_err(StoreError::redb)?;
    }
    Ok(BackupInfo {
        revision,
        event_seq: counter(&meta, META_EVENT_SEQ)?,
        schema,
        taken_at: UnixMs(counter(&meta, META_BACKUP_TAKEN_AT)?),
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Names(BTreeSet<String>);

    impl EachTable for Names {
        fn table<K: Key + 'static, V: Value + 'static>(
            &mut self,
            def: TableDefinition<'static, K, V>,
        ) -> Result<(), StoreError> {
            self.0.insert(def.name().to_string());
            Ok(())
        }
    }

    /// The one table list names every table a fresh store creates, so a backup copies them
    /// all.
    #[test]
    fn the_table_list_names_every_table_of_a_fresh_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20).unwrap();
        let mut names = Names(BTreeSet::new());
        tables::each_table(&mut names).unwrap();
        let txn = store.read().unwrap();
        let created: BTreeSet<String> = txn
            .list_tables()
            .unwrap()
            .map(|h| h.name().to_string())
            .collect();
        assert_eq!(created, names.0);
        let listed: BTreeSet<String> = tables::ALL.iter().map(|n| n.to_string()).collect();
        assert_eq!(
            listed, names.0,
            "tables::ALL and tables::each_table disagree"
        );
    }

    #[test]
    fn a_backup_holds_the_snapshot_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 20).unwrap();
        let mut event = Event::new(1, UnixMs(5), EventKind::PoolPut);
        event.detail = Some("capacity 1".into());
        store
            .commit(&Batch {
                changes: &[Change::Event(event)],
                revision: 7,
                event_seq: 1,
                trim_events: None,
                ..Default::default()
            })
            .unwrap();
        let dest = dir.path().join("b.redb");
        let info = store.backup_into(&dest, UnixMs(99)).unwrap();
        assert_eq!((info.revision, info.event_seq), (7, 1));
        let seen = inspect(&dest).unwrap();
        assert_eq!(seen.revision, 7);
        assert_eq!(seen.taken_at, UnixMs(99));
        // A backup of a newer schema is refused by its version.
        let db = redb::Database::open(&dest).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(META)
            .unwrap()
            .insert(META_SCHEMA, tables::SCHEMA_VERSION + 1)
            .unwrap();
        txn.commit().unwrap();
        drop(db);
        let e = inspect(&dest).unwrap_err();
        assert!(matches!(e, StoreError::Schema { .. }), "{e}");
        // The data file itself is not a backup.
        drop(store);
        let e = inspect(&dir.path().join(super::super::DATA_FILE)).unwrap_err();
        assert!(matches!(e, StoreError::NotABackup { .. }), "{e}");
    }
}
