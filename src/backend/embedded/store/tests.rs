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

#[test]
fn check_reports_an_orphan_lock() {
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
    store
        .commit(&Batch {
            changes: &[orphan],
            revision: 3,
            event_seq: 0,
            trim_events: None,
        })
        .unwrap();
    let report = store.check().unwrap();
    assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
    assert!(report.problems[0].contains("does not exist"));
    assert!(report.problems[1].contains("above the revision counter"));
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
