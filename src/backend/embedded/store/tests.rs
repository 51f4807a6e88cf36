use super::*;
use crate::domain::{
    At, Change, Effects, Limits, LockKey, LockRecord, Mono, SessionId, State, Token, UnixMs,
};

fn at(ms: u64) -> At {
    At {
        now: Mono(ms),
        wall: UnixMs(1_700_000_000_000 + ms),
    }
}

fn commit(store: &Store, state: &State, fx: &mut Effects) {
    store
        .commit(&Batch {
            changes: &fx.changes,
            revision: state.revision(),
            event_seq: state.event_seq(),
            trim_events: None,
            ..Default::default()
        })
        .unwrap();
    fx.clear();
}

#[test]
fn what_is_committed_loads_back_and_checks_clean() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    let id = SessionId::random();
    state
        .open(id, "a".into(), Some(5_000), String::new(), at(0), &mut fx)
        .unwrap();
    let key = LockKey::parse("key", "k").unwrap();
    state.acquire(id, &key, at(1), &mut fx).unwrap();
    commit(&store, &state, &mut fx);
    let restore = store.load().unwrap();
    assert_eq!(restore.revision, 2);
    assert_eq!(restore.sessions, vec![(id, 5_000)]);
    assert_eq!(restore.locks.len(), 1);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(store.session_locks(id).unwrap().len(), 1);
}

/// A grant to a session without a row has nowhere to be stored: the commit is refused
/// whole (and the store fail-stops), rather than writing a lock no check could tie to a
/// holder.
#[test]
fn a_grant_to_a_session_without_a_row_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let orphan = Change::PutLock {
        key: LockKey::parse("key", "k").unwrap(),
        record: LockRecord {
            session_id: SessionId::random(),
            token: Token(5),
            acquired_at: UnixMs(0),
        },
    };
    let err = store
        .commit(&Batch {
            changes: &[orphan],
            revision: 5,
            ..Default::default()
        })
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::GrantWithoutSession { key, .. } if key == "k"),
        "{err}"
    );
    assert!(store.failed());
    drop(store);
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    assert!(store.load().unwrap().locks.is_empty());
    assert_eq!(store.check().unwrap().revision, 0);
}

/// Writes grant rows straight into `lock_rows`, as a damaged file or a bug would leave them.
fn put_grant_rows(store: &Store, rows: &[(u64, &str, u64)]) {
    let txn = store.db.begin_write().unwrap();
    {
        let mut table = txn.open_table(super::tables::LOCK_ROWS).unwrap();
        for (row, key, token) in rows {
            let grant = super::tables::StoredGrant {
                token: Token(*token),
                acquired_at: UnixMs(0),
            };
            table
                .insert((*row, *key), super::codec::encode(&grant).as_slice())
                .unwrap();
        }
    }
    txn.commit().unwrap();
}

/// `check` finds a lock stored under a row without a session, one with a token above the
/// counter, and a key held by two live sessions; and a start refuses each.
#[test]
fn check_reports_every_broken_grant() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    sessions_with_locks(&store, &mut state, 2);
    // Rows 1 and 2 are the two sessions, which hold k0 and k1.
    put_grant_rows(&store, &[(2, "k0", 1), (2, "late", 99)]);
    let mut problems = store.check().unwrap().problems;
    problems.sort();
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(problems[0].contains("\"k0\" is held by two live sessions, in rows 1 and 2"));
    assert!(problems[1].contains("\"late\" has token 99 above the revision counter"));
    drop(store);
    let err = Store::open(dir.path(), 1 << 20).unwrap_err();
    assert!(
        matches!(&err, StoreError::KeyHeldTwice { key } if key == "k0"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    sessions_with_locks(&store, &mut State::new(Limits::default()), 2);
    put_grant_rows(&store, &[(7, "orphan", 1)]);
    let problems = store.check().unwrap().problems;
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("\"orphan\" is stored under session row 7, which holds no session"),
        "{problems:?}"
    );
    drop(store);
    let err = Store::open(dir.path(), 1 << 20).unwrap_err();
    assert!(
        matches!(&err, StoreError::GrantWithoutHolder { key, row: 7 } if key == "orphan"),
        "{err}"
    );
}

#[test]
fn the_revision_never_goes_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let batch = |revision| Batch {
        changes: &[],
        revision,
        event_seq: 0,
        trim_events: None,
        ..Default::default()
    };
    store.commit(&batch(10)).unwrap();
    assert!(matches!(
        store.commit(&batch(9)),
        Err(StoreError::RevisionWentBack { stored: 10, new: 9 })
    ));
    // The refused commit failed the store for good.
    assert!(store.failed());
    assert!(matches!(store.commit(&batch(11)), Err(StoreError::Failed)));
}

#[test]
fn an_io_failure_fail_stops_and_loses_nothing_committed() {
    let dir = tempfile::tempdir().unwrap();
    let (store, switch) = Store::open_with_faults(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    let id = SessionId::random();
    state
        .open(id, "a".into(), Some(5_000), String::new(), at(0), &mut fx)
        .unwrap();
    commit(&store, &state, &mut fx);
    switch.fail_writes();
    state
        .open(
            SessionId::random(),
            "b".into(),
            None,
            String::new(),
            at(1),
            &mut fx,
        )
        .unwrap();
    assert!(
        store
            .commit(&Batch {
                changes: &fx.changes,
                revision: state.revision(),
                event_seq: state.event_seq(),
                trim_events: None,
                ..Default::default()
            })
            .is_err()
    );
    assert!(store.failed());
    drop(store);
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    assert_eq!(store.load().unwrap().sessions, vec![(id, 5_000)]);
}

#[test]
fn old_events_are_trimmed_in_bounded_batches() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    for i in 0..5 {
        state
            .open(
                SessionId::random(),
                "a".into(),
                None,
                String::new(),
                at(i * 1_000),
                &mut fx,
            )
            .unwrap();
    }
    commit(&store, &state, &mut fx);
    let trim = |limit| {
        store
            .commit(&Batch {
                changes: &[],
                revision: state.revision(),
                event_seq: state.event_seq(),
                trim_events: Some((at(3_500).wall, limit)),
                ..Default::default()
            })
            .unwrap()
            .events_trimmed
    };
    assert_eq!(trim(3), 3);
    assert_eq!(trim(3), 1);
    assert_eq!(trim(3), 0);
    let left: Vec<u64> = store.events(0, 10).unwrap().iter().map(|e| e.seq).collect();
    assert_eq!(left, vec![5]);
}

/// Rewrites a file of this schema into schema 6's lock layout: each key's grant (the highest
/// token, where a pending end left an older one) in `locks`, every grant's (row, key) in
/// `row_locks`, and no `lock_rows`.
fn downgrade_to_v6(dir: &std::path::Path) {
    use redb::ReadableTable;

    use super::tables::{LOCK_ROWS, META, META_SCHEMA, SESSION_ROWS, StoredGrant, v6};
    let db = redb::Database::open(dir.join(DATA_FILE)).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let holders = holders_by_row(&txn.open_table(SESSION_ROWS).unwrap());
        let grants = txn.open_table(LOCK_ROWS).unwrap();
        let mut locks = txn.open_table(v6::LOCKS).unwrap();
        let mut index = txn.open_table(v6::ROW_LOCKS).unwrap();
        for entry in grants.iter().unwrap() {
            let (k, v) = entry.unwrap();
            let (row, key) = k.value();
            let grant: StoredGrant = super::codec::decode(v.value()).unwrap();
            let record = grant.held_by(holders[&row]);
            let bytes = super::codec::encode(&record);
            let newer = match locks.get(key).unwrap() {
                Some(old) => {
                    let old: LockRecord = super::codec::decode(old.value()).unwrap();
                    record.token > old.token
                }
                None => true,
            };
            if newer {
                locks.insert(key, bytes.as_slice()).unwrap();
            }
            index.insert((row, key), ()).unwrap();
        }
        txn.open_table(META)
            .unwrap()
            .insert(META_SCHEMA, 6)
            .unwrap();
    }
    assert!(txn.delete_table(LOCK_ROWS).unwrap());
    txn.commit().unwrap();
}

/// Rewrites a file of this schema into the layout release 0.1.0 wrote (schema 1): sessions
/// keyed by their id in `sessions`, the grants index in `session_locks`, no row tables or
/// counter. Every other table had the same layout in 0.1.0 as in schema 6, so what it leaves
/// is a 0.1.0 file.
fn downgrade_to_v1(dir: &std::path::Path) {
    use redb::{ReadableDatabase, ReadableTable, TableHandle};

    use super::tables::{
        META, META_SCHEMA, META_SESSION_ROW, SESSION_IDS, SESSION_ROWS, SessionRow, v1, v6,
    };
    downgrade_to_v6(dir);
    let db = redb::Database::open(dir.join(DATA_FILE)).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let rows = txn.open_table(SESSION_ROWS).unwrap();
        let index = txn.open_table(v6::ROW_LOCKS).unwrap();
        let mut old = txn.open_table(v1::SESSIONS).unwrap();
        let mut old_index = txn.open_table(v1::SESSION_LOCKS).unwrap();
        let mut by_row = std::collections::HashMap::new();
        for entry in rows.iter().unwrap() {
            let (row, bytes) = entry.unwrap();
            let stored: SessionRow = super::codec::decode(bytes.value()).unwrap();
            by_row.insert(row.value(), stored.id.as_u128());
            old.insert(
                stored.id.as_u128(),
                super::codec::encode(&stored.record).as_slice(),
            )
            .unwrap();
        }
        for entry in index.iter().unwrap() {
            let (k, _) = entry.unwrap();
            let (row, key) = k.value();
            old_index.insert((by_row[&row], key), ()).unwrap();
        }
        let mut meta = txn.open_table(META).unwrap();
        meta.insert(META_SCHEMA, 1).unwrap();
        meta.remove(META_SESSION_ROW).unwrap();
    }
    txn.delete_table(SESSION_ROWS).unwrap();
    txn.delete_table(SESSION_IDS).unwrap();
    txn.delete_table(v6::ROW_LOCKS).unwrap();
    txn.commit().unwrap();
    let read = db.begin_read().unwrap();
    let tables: Vec<String> = read
        .list_tables()
        .unwrap()
        .map(|t| t.name().to_string())
        .collect();
    assert!(tables.contains(&"sessions".to_string()), "{tables:?}");
    assert!(tables.contains(&"locks".to_string()), "{tables:?}");
    assert!(!tables.contains(&"session_rows".to_string()), "{tables:?}");
}

/// A file written by 0.1.0 opens with this build and keeps its sessions (ids, owners, TTLs,
/// metadata), locks and their tokens, pools, seats, jobs, audit events and counters; the
/// migrated file checks clean, names only this schema's tables, and new sessions get rows
/// above the migrated ones.
#[test]
fn a_schema_1_file_migrates_and_keeps_everything() {
    use crate::domain::{NewJob, PoolName};

    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    let pool = PoolName::parse("pool", "licences").unwrap();
    state
        .put_pool(&pool, 3, "{}".into(), None, at(0), &mut fx)
        .unwrap();
    let queue = LockKey::parse("queue", "thumbs").unwrap();
    let mut ids = Vec::new();
    for i in 0..20u64 {
        let id = SessionId::random();
        ids.push(id);
        state
            .open(
                id,
                format!("owner-{}", i % 3),
                Some(60_000),
                format!("{{\"n\":{i}}}"),
                at(10 + i),
                &mut fx,
            )
            .unwrap();
        for k in 0..(i % 3) {
            let key = LockKey::parse("key", &format!("k/{i}/{k}")).unwrap();
            state.acquire(id, &key, at(40 + i), &mut fx).unwrap();
        }
        if i < 2 {
            state
                .acquire_seat(id, &pool, String::new(), at(60 + i), &mut fx)
                .unwrap();
        }
        if i == 5 {
            let job = NewJob {
                queue: queue.clone(),
                payload: "{}".into(),
                idempotent: true,
                max_recoveries: None,
                kind: None,
            };
            state
                .enqueue(crate::domain::JobId::random(), job, at(70), &mut fx)
                .unwrap();
            state.claim(id, &queue, at(71), &mut fx).unwrap().unwrap();
        }
        commit(&store, &state, &mut fx);
    }
    // Some end, as in service: their rows and grants must not come back.
    for id in &ids[15..] {
        state
            .end(*id, crate::domain::EndReason::Closed, at(100), &mut fx)
            .unwrap();
    }
    commit(&store, &state, &mut fx);
    let before = store.load().unwrap();
    let sessions_before: Vec<_> = ids[..15]
        .iter()
        .map(|id| (*id, store.session(*id).unwrap().unwrap()))
        .collect();
    let locks_before: Vec<_> = ids
        .iter()
        .map(|id| store.session_locks(*id).unwrap())
        .collect();
    let events_before = store.events(0, 1_000).unwrap();
    drop(store);

    downgrade_to_v1(dir.path());

    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let after = store.load().unwrap();
    assert_eq!(after.revision, before.revision);
    assert_eq!(after.event_seq, before.event_seq);
    let sorted = |mut v: Vec<(SessionId, u64)>| {
        v.sort();
        v
    };
    assert_eq!(
        sorted(after.sessions.clone()),
        sorted(before.sessions.clone())
    );
    assert_eq!(after.sessions.len(), 15);
    assert_eq!(after.locks, before.locks);
    assert_eq!(after.pools, before.pools);
    assert_eq!(after.seats, before.seats);
    assert_eq!(after.jobs, before.jobs);
    for (id, record) in &sessions_before {
        assert_eq!(store.session(*id).unwrap().as_ref(), Some(record));
    }
    for (id, locks) in ids.iter().zip(&locks_before) {
        assert_eq!(&store.session_locks(*id).unwrap(), locks);
    }
    assert_eq!(store.events(0, 1_000).unwrap(), events_before);
    // Rows follow creation order: the first session opened got the first row.
    assert_eq!(after.sessions[0].0, ids[0]);
    let owners = store.sessions(Some("owner-1"), None, 100).unwrap();
    assert_eq!(owners.len(), 5);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.sessions, 15);

    // The state rebuilt from the migrated file carries on: a new session and a new grant.
    let mut state = State::restore(Limits::default(), after, Mono(0)).unwrap();
    let id = SessionId::random();
    state
        .open(id, "new".into(), None, String::new(), at(200), &mut fx)
        .unwrap();
    let key = LockKey::parse("key", "after-migration").unwrap();
    let granted = state.acquire(id, &key, at(201), &mut fx).unwrap();
    assert!(granted.token.0 > before.revision);
    commit(&store, &state, &mut fx);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(store.session_locks(id).unwrap().len(), 1);
    drop(store);

    // Opening again migrates nothing more: the file is at this schema.
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    assert_eq!(store.load().unwrap().sessions.len(), 16);
    drop(store);
    use redb::{ReadableDatabase, TableHandle};
    let db = redb::Database::open(dir.path().join(DATA_FILE)).unwrap();
    let read = db.begin_read().unwrap();
    let mut tables: Vec<String> = read
        .list_tables()
        .unwrap()
        .map(|t| t.name().to_string())
        .collect();
    tables.sort();
    let mut expected: Vec<String> = TABLES.iter().map(|t| t.to_string()).collect();
    expected.sort();
    assert_eq!(tables, expected);
}

#[test]
fn a_file_newer_than_this_build_is_refused_untouched() {
    use redb::ReadableDatabase;

    use super::tables::{META, META_SCHEMA};
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path(), 1 << 20).unwrap());
    {
        let db = redb::Database::open(dir.path().join(DATA_FILE)).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(META)
            .unwrap()
            .insert(META_SCHEMA, 99)
            .unwrap();
        txn.commit().unwrap();
    }
    let err = Store::open(dir.path(), 1 << 20).unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Schema {
                found: 99,
                reads: super::tables::SCHEMA_VERSION
            }
        ),
        "{err}"
    );
    let db = redb::Database::open(dir.path().join(DATA_FILE)).unwrap();
    let read = db.begin_read().unwrap();
    let schema = read.open_table(META).unwrap().get(META_SCHEMA).unwrap();
    assert_eq!(schema.map(|v| v.value()), Some(99));
}

/// Opens `n` sessions of a 1 s lease, each holding lock `k{i}`, and commits them.
fn sessions_with_locks(store: &Store, state: &mut State, n: usize) -> Vec<SessionId> {
    let mut fx = Effects::default();
    let ids: Vec<SessionId> = (0..n).map(|_| SessionId::random()).collect();
    for (i, id) in ids.iter().enumerate() {
        state
            .open(*id, "a".into(), Some(1_000), String::new(), at(0), &mut fx)
            .unwrap();
        let key = LockKey::parse("key", &format!("k{i}")).unwrap();
        state.acquire(*id, &key, at(0), &mut fx).unwrap();
    }
    commit(store, state, &mut fx);
    ids
}

/// Reaps every due session at `ms` and commits the pass with its deletes in the end log.
fn reap_deferred(store: &Store, state: &mut State, ms: u64) -> usize {
    let mut fx = Effects::default();
    let ended = state.reap_leaving_rows(at(ms), usize::MAX, &mut fx);
    let mut log = Ended::default();
    log.extend(&ended);
    store
        .commit(&Batch {
            changes: &fx.changes,
            revision: state.revision(),
            event_seq: state.event_seq(),
            ended: Some(&log),
            ..Default::default()
        })
        .unwrap();
    ended.len()
}

/// Opens a long-lived session at 5 001 ms, after the ended sessions' deadline, and commits
/// it holding `key`.
fn live_holding(store: &Store, state: &mut State, key: &LockKey) -> SessionId {
    let mut fx = Effects::default();
    let live = SessionId::random();
    state
        .open(
            live,
            "b".into(),
            Some(60_000),
            String::new(),
            at(5_001),
            &mut fx,
        )
        .unwrap();
    state.acquire(live, key, at(5_001), &mut fx).unwrap();
    commit(store, state, &mut fx);
    live
}

/// How many times each session id appears in an end event.
fn ends_per_session(store: &Store) -> std::collections::HashMap<String, usize> {
    let mut seen = std::collections::HashMap::new();
    let events = store.events(0, usize::MAX).unwrap();
    for pair in events.windows(2) {
        assert!(pair[0].seq < pair[1].seq, "events out of order");
    }
    for e in events {
        if matches!(e.kind, crate::domain::EventKind::SessionExpired) {
            *seen.entry(format!("{:?}", e.session_id)).or_default() += 1;
        }
    }
    seen
}

/// A reaper pass's session deletes wait in the end log: meanwhile `check` holds and the
/// ended sessions' keys are free (one is granted again); a crash before they are applied
/// loses nothing, and the next open applies them before the load, so no ended session comes
/// back and each is audited once.
#[test]
fn deferred_ends_check_clean_and_survive_a_crash_applied_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    let ids = sessions_with_locks(&store, &mut state, 50);
    assert_eq!(reap_deferred(&store, &mut state, 5_000), 50);
    // A live session takes the first ended session's key before the log is applied.
    let k0 = LockKey::parse("key", "k0").unwrap();
    let live = live_holding(&store, &mut state, &k0);
    assert_eq!(store.pending_ends().unwrap(), 1);
    assert_eq!(store.lock("k0").unwrap().unwrap().session_id, live);
    assert_eq!(store.lock("k1").unwrap(), None);
    assert_view_mirrors_the_table(&store);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!((report.sessions, report.locks), (1, 1));
    let ends = ends_per_session(&store);
    assert_eq!(ends.len(), 50);
    assert!(ends.values().all(|&n| n == 1), "{ends:?}");

    // The crash: the handle goes without anything more written.
    drop(store);
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    assert_eq!(store.pending_ends().unwrap(), 0);
    let restore = store.load().unwrap();
    assert_eq!(restore.sessions, vec![(live, 60_000)]);
    assert_eq!(restore.locks.len(), 1);
    assert_eq!(restore.locks[0].0, k0);
    assert_eq!(restore.locks[0].1.session_id, live);
    assert_view_mirrors_the_table(&store);
    for id in &ids {
        assert!(store.session_locks(*id).unwrap().is_empty());
    }
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(ends_per_session(&store), ends);
}

/// Every stored grant, hidden or not, in key order (then holder).
fn stored_locks(store: &Store) -> Vec<(String, SessionId)> {
    let mut out: Vec<(String, SessionId)> = stored_grants(store)
        .into_iter()
        .map(|(k, l)| (k, l.session_id))
        .collect();
    out.sort();
    out
}

/// Every stored grant, with its holder read from the row it is stored under.
fn stored_grants(store: &Store) -> Vec<(String, LockRecord)> {
    use redb::{ReadableDatabase, ReadableTable};
    let txn = store.db.begin_read().unwrap();
    let holders = holders_by_row(&txn.open_table(super::tables::SESSION_ROWS).unwrap());
    let table = txn.open_table(super::tables::LOCK_ROWS).unwrap();
    table
        .iter()
        .unwrap()
        .map(|row| {
            let (k, v) = row.unwrap();
            let (row, key) = k.value();
            let grant: super::tables::StoredGrant = super::codec::decode(v.value()).unwrap();
            (key.to_string(), grant.held_by(holders[&row]))
        })
        .collect()
}

/// Each session row's session.
fn holders_by_row(
    rows: &impl redb::ReadableTable<u64, &'static [u8]>,
) -> std::collections::HashMap<u64, SessionId> {
    rows.iter()
        .unwrap()
        .map(|entry| {
            let (row, bytes) = entry.unwrap();
            let stored: super::tables::SessionRow = super::codec::decode(bytes.value()).unwrap();
            (row.value(), stored.id)
        })
        .collect()
}

/// The in-memory lock view holds, for each stored key, its newest grant (the highest token:
/// an older one is a pending end's), and the sessions of the pending end-log records.
fn assert_view_mirrors_the_table(store: &Store) {
    use redb::ReadableDatabase;
    let mut newest: std::collections::BTreeMap<String, LockRecord> = Default::default();
    for (key, lock) in stored_grants(store) {
        let keep = newest.get(&key).is_none_or(|l| l.token < lock.token);
        if keep {
            newest.insert(key, lock);
        }
    }
    let rows: Vec<(String, LockRecord)> = newest.into_iter().collect();
    let txn = store.db.begin_read().unwrap();
    let log = txn.open_table(super::endlog::END_LOG).unwrap();
    let mut pending = super::endlog::pending_sessions(&log).unwrap();
    pending.sort_unstable();
    assert_eq!(store.held.contents(), (rows, pending));
}

/// A reaper pass's grants stay stored until its record is applied, and no read shows them
/// meanwhile; applying deletes them, but not a later grant of the same key.
#[test]
fn deferred_grants_are_hidden_until_applied_and_a_later_grant_stays() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    let ids = sessions_with_locks(&store, &mut state, 3);
    assert_eq!(reap_deferred(&store, &mut state, 5_000), 3);
    let live = live_holding(&store, &mut state, &LockKey::parse("key", "k1").unwrap());

    // Deferred: the ended sessions' grants are all still stored, each under its own row,
    // and the live grant of k1 beside the ended one.
    let stored = stored_locks(&store);
    let mut expect = vec![
        ("k0".to_string(), ids[0]),
        ("k1".to_string(), ids[1]),
        ("k1".to_string(), live),
        ("k2".to_string(), ids[2]),
    ];
    expect.sort();
    assert_eq!(stored, expect);
    // No read shows them.
    assert_eq!(store.lock("k0").unwrap(), None);
    assert_eq!(store.lock("k2").unwrap(), None);
    assert_eq!(store.lock("k1").unwrap().unwrap().session_id, live);
    let listed = store.locks("", None, 10).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].0.as_str(), listed[0].1.session_id), ("k1", live));
    // A page after a hidden key, and one that starts on it, still find the shown lock.
    assert_eq!(store.locks("", Some("k0"), 10).unwrap(), listed);
    assert_eq!(store.locks("k", None, 1).unwrap(), listed);
    assert!(store.locks("k2", None, 10).unwrap().is_empty());
    assert_view_mirrors_the_table(&store);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!((report.sessions, report.locks), (1, 1));

    // Applied: the ended grants are gone from the table, the later grant of k1 is kept.
    let applied = store
        .commit(&Batch {
            revision: state.revision(),
            event_seq: state.event_seq(),
            apply_ended: 100,
            ..Default::default()
        })
        .unwrap()
        .ends_applied;
    assert_eq!(applied, 3);
    assert_eq!(stored_locks(&store), vec![("k1".to_string(), live)]);
    assert_eq!(store.session_locks(live).unwrap().len(), 1);
    assert_view_mirrors_the_table(&store);
    assert_eq!(store.lock("k1").unwrap().unwrap().session_id, live);
    assert_eq!(store.locks("", None, 10).unwrap().len(), 1);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!((report.sessions, report.locks), (1, 1));
}

/// Applying in a batch takes whole records, oldest first, until the asked-for count, and
/// leaves the rest pending.
#[test]
fn deferred_ends_apply_in_batches_of_whole_records() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    sessions_with_locks(&store, &mut state, 10);
    reap_deferred(&store, &mut state, 5_000);
    sessions_with_locks(&store, &mut state, 10);
    reap_deferred(&store, &mut state, 10_000);
    assert_eq!(store.pending_ends().unwrap(), 2);
    let apply = |n| {
        store
            .commit(&Batch {
                revision: state.revision(),
                event_seq: state.event_seq(),
                apply_ended: n,
                ..Default::default()
            })
            .unwrap()
            .ends_applied
    };
    assert_eq!(apply(1), 10);
    assert_eq!(store.pending_ends().unwrap(), 1);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(apply(100), 10);
    assert_eq!(apply(100), 0);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!((report.sessions, report.locks), (0, 0));
    assert!(store.load().unwrap().sessions.is_empty());
}

/// `check` finds an end-log record whose sessions have no rows.
#[test]
fn check_reports_an_end_log_record_without_its_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let stray = Ended {
        sessions: vec![SessionId::random().as_u128()],
    };
    store
        .commit(&Batch {
            ended: Some(&stray),
            ..Default::default()
        })
        .unwrap();
    let report = store.check().unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(report.problems[0].contains("end log"));
}

/// A schema-3 file (no `end_log`) opens at the current schema with the table created and
/// everything kept.
#[test]
fn a_schema_3_file_migrates_to_the_current_schema() {
    use redb::ReadableDatabase;

    use super::tables::{META, META_SCHEMA, SCHEMA_VERSION};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    let ids = sessions_with_locks(&store, &mut state, 3);
    drop(store);
    downgrade_to_v6(dir.path());
    {
        let db = redb::Database::open(dir.path().join(DATA_FILE)).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(META)
            .unwrap()
            .insert(META_SCHEMA, 3)
            .unwrap();
        assert!(txn.delete_table(super::endlog::END_LOG).unwrap());
        txn.commit().unwrap();
    }
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    assert_eq!(SCHEMA_VERSION, 7);
    {
        let read = store.db.begin_read().unwrap();
        let schema = read.open_table(META).unwrap().get(META_SCHEMA).unwrap();
        assert_eq!(schema.map(|v| v.value()), Some(SCHEMA_VERSION));
    }
    assert_eq!(store.pending_ends().unwrap(), 0);
    let restore = store.load().unwrap();
    assert_eq!(restore.sessions.len(), 3);
    assert_eq!(restore.locks.len(), 3);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    // And a reaper pass on the migrated file defers and applies like on a new one.
    assert_eq!(reap_deferred(&store, &mut state, 5_000), ids.len());
    drop(store);
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    assert!(store.load().unwrap().sessions.is_empty());
}

/// A schema-6 file, with a reaper pass's record pending and one of its keys granted again
/// since, opens at the current schema: every grant moves under its holder's row, the pending
/// end applies without touching the later grant, every token stays, and it checks clean.
#[test]
fn a_schema_6_file_moves_its_grants_under_their_rows() {
    use redb::{ReadableDatabase, TableHandle};

    use super::tables::{META, META_SCHEMA, SCHEMA_VERSION};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    let ended = sessions_with_locks(&store, &mut state, 3);
    assert_eq!(reap_deferred(&store, &mut state, 5_000), 3);
    let k1 = LockKey::parse("key", "k1").unwrap();
    let live = live_holding(&store, &mut state, &k1);
    let token = store.lock("k1").unwrap().unwrap().token;
    let mut fx = Effects::default();
    let other = live_holding(&store, &mut state, &LockKey::parse("key", "x").unwrap());
    let extra = LockKey::parse("key", "y").unwrap();
    state.acquire(other, &extra, at(5_002), &mut fx).unwrap();
    commit(&store, &state, &mut fx);
    let revision = state.revision();
    drop(store);
    downgrade_to_v6(dir.path());

    let store = Store::open(dir.path(), 1 << 20).unwrap();
    {
        let read = store.db.begin_read().unwrap();
        let schema = read.open_table(META).unwrap().get(META_SCHEMA).unwrap();
        assert_eq!(schema.map(|v| v.value()), Some(SCHEMA_VERSION));
        let tables: Vec<String> = read
            .list_tables()
            .unwrap()
            .map(|t| t.name().to_string())
            .collect();
        assert!(!tables.iter().any(|t| t == "locks" || t == "row_locks"));
    }
    // The pending end was applied at open: only the live grants are left.
    assert_eq!(store.pending_ends().unwrap(), 0);
    assert_eq!(
        stored_locks(&store),
        vec![
            ("k1".to_string(), live),
            ("x".to_string(), other),
            ("y".to_string(), other)
        ]
    );
    assert_eq!(store.lock("k1").unwrap().unwrap().token, token);
    assert_eq!(store.session_locks(other).unwrap().len(), 2);
    for id in &ended {
        assert!(store.session_locks(*id).unwrap().is_empty());
    }
    let restore = store.load().unwrap();
    assert_eq!(restore.revision, revision);
    assert_eq!(restore.locks.len(), 3);
    assert_view_mirrors_the_table(&store);
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!((report.sessions, report.locks), (2, 3));
}

/// A schema-6 file holding a lock of a session without a row is refused at open, naming the
/// lock, and left at schema 6 as it was.
#[test]
fn a_schema_6_lock_without_its_session_is_refused_untouched() {
    use redb::{ReadableDatabase, ReadableTableMetadata};

    use super::tables::{META, META_SCHEMA, v6};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    sessions_with_locks(&store, &mut state, 2);
    drop(store);
    downgrade_to_v6(dir.path());
    {
        let db = redb::Database::open(dir.path().join(DATA_FILE)).unwrap();
        let txn = db.begin_write().unwrap();
        let stray = LockRecord {
            session_id: SessionId::random(),
            token: Token(1),
            acquired_at: UnixMs(0),
        };
        txn.open_table(v6::LOCKS)
            .unwrap()
            .insert("stray", super::codec::encode(&stray).as_slice())
            .unwrap();
        txn.commit().unwrap();
    }
    let err = Store::open(dir.path(), 1 << 20).unwrap_err();
    assert!(
        matches!(&err, StoreError::GrantWithoutSession { key, .. } if key == "stray"),
        "{err}"
    );
    let db = redb::Database::open(dir.path().join(DATA_FILE)).unwrap();
    let read = db.begin_read().unwrap();
    let schema = read.open_table(META).unwrap().get(META_SCHEMA).unwrap();
    assert_eq!(schema.map(|v| v.value()), Some(6));
    assert_eq!(read.open_table(v6::LOCKS).unwrap().len().unwrap(), 3);
}

/// Compacting a file that a mass of sessions grew and then left gives space back, and keeps
/// every live session, lock, event and counter; the compacted file checks clean.
#[test]
fn compacting_gives_back_the_space_of_ended_sessions_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    let mut ids = Vec::new();
    for batch in 0..20u64 {
        for i in 0..1_000u64 {
            let id = SessionId::random();
            ids.push(id);
            let metadata = format!(
                "{{\"host\":\"worker-{batch}-{i}\",\"pad\":\"{}\"}}",
                "x".repeat(200)
            );
            state
                .open(
                    id,
                    format!("owner-{}", i % 7),
                    Some(60_000),
                    metadata,
                    at(batch),
                    &mut fx,
                )
                .unwrap();
            let key = LockKey::parse("key", &format!("job/{batch}/{i}")).unwrap();
            state.acquire(id, &key, at(batch), &mut fx).unwrap();
        }
        commit(&store, &state, &mut fx);
    }
    // All but the last hundred end.
    for id in &ids[..ids.len() - 100] {
        state
            .end(*id, crate::domain::EndReason::Closed, at(100), &mut fx)
            .unwrap();
    }
    commit(&store, &state, &mut fx);
    let before = store.load().unwrap();
    let events = store.events(0, usize::MAX).unwrap();
    let size = || std::fs::metadata(dir.path().join(DATA_FILE)).unwrap().len();
    let grown = size();

    assert!(store.compact().unwrap() > 0);
    let compacted = size();
    assert!(compacted < grown, "{compacted} >= {grown}");
    let report = store.check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!((report.sessions, report.locks), (100, 100));
    drop(store);

    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let after = store.load().unwrap();
    assert_eq!(after.revision, before.revision);
    assert_eq!(after.event_seq, before.event_seq);
    assert_eq!(after.sessions, before.sessions);
    assert_eq!(after.locks, before.locks);
    assert_eq!(store.events(0, usize::MAX).unwrap(), events);
    for id in &ids[ids.len() - 100..] {
        assert_eq!(store.session_locks(*id).unwrap().len(), 1);
    }
}

/// Opens a session at `i` seconds into `fx`: one `session_opened` event.
fn open_at(state: &mut State, i: u64, fx: &mut Effects) {
    state
        .open(
            SessionId::random(),
            "a".into(),
            None,
            String::new(),
            at(i * 1_000),
            fx,
        )
        .unwrap();
}

/// Opens sessions `from..to` in one commit each of `per_commit` sessions (an event each).
fn events_in_commits(store: &Store, state: &mut State, from: u64, to: u64, per_commit: u64) {
    let mut fx = Effects::default();
    for i in from..to {
        open_at(state, i, &mut fx);
        if (i + 1 - from).is_multiple_of(per_commit) {
            commit(store, state, &mut fx);
        }
    }
    commit(store, state, &mut fx);
}

fn stored_hashes(store: &Store) -> Vec<u64> {
    use redb::{ReadableDatabase, ReadableTable};
    let txn = store.db.begin_read().unwrap();
    let table = txn.open_table(super::chain::EVENT_HASHES).unwrap();
    table
        .iter()
        .unwrap()
        .map(|r| r.unwrap().0.value())
        .collect()
}

/// Runs `f` on the raw `events` and `event_hashes` tables in one committed transaction.
fn edit_events(
    store: &Store,
    f: impl FnOnce(&mut redb::Table<u64, &[u8]>, &mut redb::Table<u64, &[u8]>),
) {
    let txn = store.db.begin_write().unwrap();
    {
        let mut events = txn.open_table(super::tables::EVENTS).unwrap();
        let mut hashes = txn.open_table(super::chain::EVENT_HASHES).unwrap();
        f(&mut events, &mut hashes);
    }
    txn.commit().unwrap();
}

/// What `check` finds wrong with the audit chain (an edited event may also not decode).
fn problems(store: &Store) -> Vec<String> {
    let mut found = store.check().unwrap().problems;
    found.retain(|p| p.contains("audit chain"));
    found
}

/// The one problem `check` finds with the audit chain.
fn only_problem(store: &Store) -> String {
    let mut found = problems(store);
    assert_eq!(found.len(), 1, "{found:?}");
    found.remove(0)
}

/// Flips a bit of event `seq`'s stored bytes, as an edit of the data file would.
fn tamper(store: &Store, seq: u64) {
    use redb::ReadableTable;
    edit_events(store, |events, _| {
        let mut b = events.get(seq).unwrap().unwrap().value().to_vec();
        *b.last_mut().unwrap() ^= 1;
        events.insert(seq, b.as_slice()).unwrap();
    });
}

/// The chain stores a hash for the last event of each commit (and the chain's first), and
/// `check` still finds an event edited, deleted or added anywhere, not only where a hash
/// is stored.
#[test]
fn one_hash_a_commit_still_proves_every_event() {
    use redb::ReadableTable;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    events_in_commits(&store, &mut state, 0, 12, 4);
    // Events 1..=12 in three commits: the first event, then each commit's last.
    assert_eq!(stored_hashes(&store), vec![1, 4, 8, 12]);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));

    // An event with no stored hash of its own, edited: reported at the next stored hash.
    tamper(&store, 6);
    let found = only_problem(&store);
    assert!(found.contains("event 8 does not match its hash"), "{found}");
    assert!(found.contains("from 5 to 8"), "{found}");
    // Flipped back, it verifies again.
    tamper(&store, 6);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));

    // An event deleted from the middle of a commit.
    edit_events(&store, |events, _| {
        events.remove(10).unwrap();
    });
    let found = problems(&store);
    assert!(
        found.iter().any(|p| p.contains("event 12 does not match")),
        "{found:?}"
    );
    // Another event's bytes in its place do not mend the chain.
    edit_events(&store, |events, _| {
        let sixth = events.get(6).unwrap().unwrap().value().to_vec();
        events.insert(10, sixth.as_slice()).unwrap();
    });
    assert!(!problems(&store).is_empty());

    // The last event deleted: its hash names an event after the last.
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    events_in_commits(&store, &mut state, 0, 6, 3);
    edit_events(&store, |events, _| {
        events.remove(6).unwrap();
    });
    let found = problems(&store);
    assert!(
        found
            .iter()
            .any(|p| p.contains("hash for event 6, after the last event 5")),
        "{found:?}"
    );
    // Events added after the head (its hash gone with the deleted event): everything
    // after the last stored hash is unproven.
    edit_events(&store, |events, hashes| {
        let fifth = events.get(5).unwrap().unwrap().value().to_vec();
        events.insert(6, fifth.as_slice()).unwrap();
        events.insert(7, fifth.as_slice()).unwrap();
        hashes.remove(6).unwrap();
    });
    let found = only_problem(&store);
    assert!(found.contains("events 4 to 7 have no hash"), "{found}");
}

/// A file written before one hash a commit, with every event's hash stored, verifies as it
/// is, and goes on chaining from its last hash.
#[test]
fn a_chain_with_every_hash_stored_verifies_and_goes_on() {
    use redb::ReadableTable;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    events_in_commits(&store, &mut state, 0, 6, 6);
    // As schema 5 wrote it: a hash for every event.
    edit_events(&store, |events, hashes| {
        let mut prev = [0; 32];
        for seq in 1..=6 {
            let bytes = events.get(seq).unwrap().unwrap().value().to_vec();
            prev = super::chain::link(&prev, seq, &bytes);
            hashes.insert(seq, prev.as_slice()).unwrap();
        }
    });
    assert_eq!(stored_hashes(&store), vec![1, 2, 3, 4, 5, 6]);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));
    events_in_commits(&store, &mut state, 6, 10, 4);
    assert_eq!(stored_hashes(&store), vec![1, 2, 3, 4, 5, 6, 10]);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));
    // Editing an old event is still found at its own hash.
    tamper(&store, 3);
    let found = only_problem(&store);
    assert!(found.contains("event 3 does not match"), "{found}");
}

/// Events 1..=`n` as a file written before the audit chain holds them: no hashes.
fn older_unhashed_events(store: &Store, state: &mut State, n: u64) {
    events_in_commits(store, state, 0, n, n);
    edit_events(store, |_, hashes| {
        for seq in 1..=n {
            hashes.remove(seq).unwrap();
        }
    });
}

/// Events from before the chain existed stay outside it; the chain begins at the first
/// event appended after, whose hash is stored to mark where it begins.
#[test]
fn a_chain_begun_over_older_events_marks_its_first() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    older_unhashed_events(&store, &mut state, 3);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));
    events_in_commits(&store, &mut state, 3, 7, 4);
    assert_eq!(stored_hashes(&store), vec![4, 7]);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));
    tamper(&store, 5);
    assert!(problems(&store)[0].contains("event 7 does not match"));
}

/// Trims `limit` events older than `before_ms` in a commit of `changes`; returns how many
/// it trimmed.
fn trim_commit(
    store: &Store,
    state: &State,
    changes: &[Change],
    before_ms: u64,
    limit: usize,
) -> usize {
    store
        .commit(&Batch {
            changes,
            revision: state.revision(),
            event_seq: state.event_seq(),
            trim_events: Some((at(before_ms).wall, limit)),
            ..Default::default()
        })
        .unwrap()
        .events_trimmed
}

/// Trimming inside a commit's events leaves the hash of the last trimmed as the anchor,
/// computed through them, and what is kept verifies.
#[test]
fn trimming_inside_a_commit_computes_the_anchor() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    events_in_commits(&store, &mut state, 0, 10, 5);
    assert_eq!(stored_hashes(&store), vec![1, 5, 10]);
    for (limit, anchors) in [(3, vec![3, 5, 10]), (4, vec![7, 10])] {
        assert_eq!(trim_commit(&store, &state, &[], 20_000, limit), limit);
        assert_eq!(stored_hashes(&store), anchors);
        assert!(problems(&store).is_empty(), "{:?}", problems(&store));
    }
    // The anchor proves what follows it: editing the first kept event is found.
    tamper(&store, 8);
    assert!(problems(&store)[0].contains("event 10 does not match"));
}

/// Trimming events from before the chain existed leaves no anchor while only they go, and
/// a trim that crosses into the chain anchors what is kept at its last trimmed event.
#[test]
fn trimming_across_where_the_chain_begins() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    older_unhashed_events(&store, &mut state, 3);
    events_in_commits(&store, &mut state, 3, 8, 5);
    assert_eq!(stored_hashes(&store), vec![4, 8]);

    // Only unhashed events trimmed: nothing to anchor, the chain's marker stays.
    assert_eq!(trim_commit(&store, &state, &[], 20_000, 2), 2);
    assert_eq!(stored_hashes(&store), vec![4, 8]);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));

    // The last unhashed event and the chain's first two go: the anchor is computed from
    // the marker, and the marker goes with the events below the anchor.
    assert_eq!(trim_commit(&store, &state, &[], 20_000, 3), 3);
    assert_eq!(stored_hashes(&store), vec![5, 8]);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));
    // The anchor proves what follows it.
    tamper(&store, 7);
    let found = only_problem(&store);
    assert!(found.contains("event 8 does not match"), "{found}");
}

/// A commit whose trim takes every event, its own last one included, keeps that event's
/// hash as the anchor: the log is empty yet the next commit chains on from it, and an
/// edit after that is still found.
#[test]
fn a_commit_that_trims_its_own_last_event_keeps_it_as_the_anchor() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1 << 20).unwrap();
    let mut state = State::new(Limits::default());
    events_in_commits(&store, &mut state, 0, 4, 4);
    let mut fx = Effects::default();
    for i in 4..6 {
        open_at(&mut state, i, &mut fx);
    }
    // Events 5 and 6 are appended and, with 1..=4, all older than the cut.
    assert_eq!(trim_commit(&store, &state, &fx.changes, 60_000, 100), 6);
    fx.clear();
    assert_eq!(store.check().unwrap().events, 0);
    assert_eq!(stored_hashes(&store), vec![6]);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));

    events_in_commits(&store, &mut state, 100, 103, 3);
    assert_eq!(stored_hashes(&store), vec![6, 9]);
    assert!(problems(&store).is_empty(), "{:?}", problems(&store));
    tamper(&store, 7);
    let found = only_problem(&store);
    assert!(found.contains("event 9 does not match"), "{found}");
}
