use super::*;
use crate::domain::jobs::NewJob;

const WALL: UnixMs = UnixMs(1_700_000_000_000);

fn at(ms: u64) -> At {
    At {
        now: Mono(ms),
        wall: UnixMs(WALL.0 + ms),
    }
}

fn key(s: &str) -> LockKey {
    LockKey::parse("key", s).unwrap()
}

fn open(state: &mut State, ttl: u64, now: u64) -> SessionId {
    let id = SessionId::random();
    state
        .open(
            id,
            "test".into(),
            Some(ttl),
            String::new(),
            at(now),
            &mut Effects::default(),
        )
        .unwrap();
    id
}

fn acquire(state: &mut State, id: SessionId, k: &str, now: u64) -> Result<Acquired, AcquireError> {
    state.acquire(id, &key(k), at(now), &mut Effects::default())
}

#[test]
fn open_persists_record_and_event() {
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    let id = SessionId::random();
    let opened = state
        .open(id, "alice".into(), None, "{}".into(), at(0), &mut fx)
        .unwrap();
    assert_eq!(opened.ttl_ms, 15_000);
    assert_eq!(opened.deadline, Mono(15_000));
    assert_eq!(opened.revision, 1);
    assert!(matches!(fx.changes[0], Change::PutSession { .. }));
    assert!(
        matches!(&fx.changes[1], Change::Event(e) if e.kind == EventKind::SessionOpened && e.seq == 1)
    );
}

#[test]
fn open_rejects_bad_input_and_changes_nothing() {
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    let cases = [
        ("", Some(5_000), "", "owner"),
        ("a", Some(10), "", "ttl_ms"),
        ("a", None, "[1]", "metadata"),
    ];
    for (owner, ttl, meta, field) in cases {
        let err = state
            .open(
                SessionId::random(),
                owner.into(),
                ttl,
                meta.into(),
                at(0),
                &mut fx,
            )
            .unwrap_err();
        assert_eq!(err.field, field);
    }
    assert!(fx.changes.is_empty());
    assert_eq!(state.revision(), 0);
    assert_eq!(state.session_count(), 0);
}

#[test]
fn heartbeat_extends_and_gone_is_terminal_and_durable() {
    let mut state = State::new(Limits::default());
    let id = open(&mut state, 1_000, 0);
    let beat = state
        .heartbeat(id, None, at(999), &mut Effects::default())
        .unwrap();
    assert_eq!(beat.deadline, Mono(1_999));
    // At the deadline the session is gone, and the answer is made durable: the session
    // is ended in the same change set, so no restart can bring it back.
    let mut fx = Effects::default();
    assert_eq!(
        state.heartbeat(id, None, at(1_999), &mut fx),
        Err(HeartbeatError::Gone)
    );
    assert!(
        fx.changes
            .iter()
            .any(|c| matches!(c, Change::DeleteSession { .. }))
    );
    assert_eq!(fx.ended.len(), 1);
    assert_eq!(fx.ended[0].reason, EndReason::Expired);
    assert_eq!(
        state.heartbeat(id, None, at(1_999), &mut Effects::default()),
        Err(HeartbeatError::Gone)
    );
    // A gone session with a bad TTL is still just gone.
    assert_eq!(
        state.heartbeat(id, Some(1), at(2_001), &mut Effects::default()),
        Err(HeartbeatError::Gone)
    );
    state.check_invariants().unwrap();
}

#[test]
fn a_reader_told_gone_takes_the_restart_grace_away_and_ends_nothing() {
    let mut state = State::new(Limits::default());
    let id = open(&mut state, 1_000, 0);
    let mut fx = Effects::default();
    assert!(state.confirm_live(id, Mono(999), &mut fx));
    assert!(fx.changes.is_empty());
    assert!(!state.confirm_live(id, Mono(1_000), &mut fx));
    assert_eq!(fx.changes, vec![Change::SetSessionTtl { id, ttl_ms: 0 }]);
    assert!(fx.ended.is_empty(), "a read ends nothing");
    // Asked again, nothing more to persist; an unknown id is simply gone.
    let mut again = Effects::default();
    assert!(!state.confirm_live(id, Mono(1_001), &mut again));
    assert!(!state.confirm_live(SessionId::random(), Mono(0), &mut again));
    assert!(again.changes.is_empty());
    assert_eq!(
        state.due(Mono(1_000), 10).len(),
        1,
        "still due for the reaper"
    );
    // A restart gives it `now + 0`: due at once, not revived.
    let restored = State::restore(
        Limits::default(),
        Restore {
            sessions: vec![(id, 0)],
            ..Restore::default()
        },
        Mono(50_000),
    )
    .unwrap();
    assert!(!restored.is_live(id, Mono(50_000)));
    assert_eq!(restored.due(Mono(50_000), 10).len(), 1);
    state.check_invariants().unwrap();
}

#[test]
fn heartbeat_with_new_ttl_is_persisted() {
    let mut state = State::new(Limits::default());
    let id = open(&mut state, 1_000, 0);
    let mut fx = Effects::default();
    let beat = state.heartbeat(id, Some(5_000), at(500), &mut fx).unwrap();
    assert_eq!(beat.deadline, Mono(5_500));
    assert_eq!(
        fx.changes,
        vec![Change::SetSessionTtl { id, ttl_ms: 5_000 }]
    );
    // The same TTL again changes nothing durable.
    let mut fx = Effects::default();
    state.heartbeat(id, Some(5_000), at(600), &mut fx).unwrap();
    assert!(fx.changes.is_empty());
    assert!(matches!(
        state.heartbeat(id, Some(1), at(700), &mut fx),
        Err(HeartbeatError::Invalid(_))
    ));
    assert!(state.is_live(id, Mono(700)));
    assert!(!state.is_live(id, Mono(5_600)));
    state.check_invariants().unwrap();
}

#[test]
fn acquire_is_exclusive_idempotent_and_fenced() {
    let mut state = State::new(Limits::default());
    let a = open(&mut state, 10_000, 0);
    let b = open(&mut state, 10_000, 0);
    let first = acquire(&mut state, a, "k", 1).unwrap();
    assert!(first.fresh);
    let again = acquire(&mut state, a, "k", 2).unwrap();
    assert_eq!(again.token, first.token);
    assert!(!again.fresh);
    assert_eq!(
        acquire(&mut state, b, "k", 3),
        Err(AcquireError::Held {
            holder: a,
            token: first.token
        })
    );
    let mut fx = Effects::default();
    state
        .release(a, &key("k"), first.token, at(4), &mut fx)
        .unwrap();
    assert_eq!(fx.freed_locks, vec![key("k")]);
    let second = acquire(&mut state, b, "k", 4).unwrap();
    assert!(second.token > first.token);
    state.check_invariants().unwrap();
}

#[test]
fn release_needs_live_holder_and_exact_token() {
    let mut state = State::new(Limits::default());
    let a = open(&mut state, 10_000, 0);
    let b = open(&mut state, 10_000, 0);
    let got = acquire(&mut state, a, "k", 1).unwrap();
    let mut fx = Effects::default();
    assert_eq!(
        state.release(b, &key("k"), got.token, at(2), &mut fx),
        Err(NotHolder)
    );
    assert_eq!(
        state.release(a, &key("k"), Token(got.token.0 - 1), at(2), &mut fx),
        Err(NotHolder)
    );
    assert_eq!(
        state.release(a, &key("free"), got.token, at(2), &mut fx),
        Err(NotHolder)
    );
    assert!(fx.changes.is_empty());
    assert!(
        state
            .release(a, &key("k"), got.token, at(2), &mut fx)
            .is_ok()
    );
    assert_eq!(
        state.release(a, &key("k"), got.token, at(2), &mut Effects::default()),
        Err(NotHolder)
    );
    // Past its deadline a holder no longer holds anything: it is ended, not released.
    let c = open(&mut state, 1_000, 0);
    let got = acquire(&mut state, c, "k", 1).unwrap();
    let mut fx = Effects::default();
    assert_eq!(
        state.release(c, &key("k"), got.token, at(1_000), &mut fx),
        Err(NotHolder)
    );
    assert_eq!(fx.ended.len(), 1);
    assert_eq!(fx.ended[0].released[..], [(key("k"), got.token)]);
    state.check_invariants().unwrap();
}

#[test]
fn expired_holder_is_ended_inline_for_a_contender() {
    let mut state = State::new(Limits::default());
    let a = open(&mut state, 1_000, 0);
    let b = open(&mut state, 10_000, 0);
    let old = acquire(&mut state, a, "k", 1).unwrap();
    assert!(matches!(
        acquire(&mut state, b, "k", 999),
        Err(AcquireError::Held { .. })
    ));
    let mut fx = Effects::default();
    let got = state.acquire(b, &key("k"), at(1_000), &mut fx).unwrap();
    assert!(got.token > old.token);
    assert_eq!(fx.ended.len(), 1);
    assert_eq!(fx.ended[0].id, a);
    assert_eq!(fx.ended[0].reason, EndReason::Expired);
    assert_eq!(fx.ended[0].released[..], [(key("k"), old.token)]);
    // The contender takes the key in the same change set; it is not offered to waiters.
    assert!(fx.freed_locks.is_empty());
    assert!(matches!(fx.changes[0], Change::DeleteLock { .. }));
    assert!(matches!(fx.changes[1], Change::DeleteSession { .. }));
    assert!(matches!(fx.changes[3], Change::PutLock { .. }));
    assert!(state.session(a, Mono(1_000)).is_none());
    state.check_invariants().unwrap();
}

#[test]
fn expired_session_cannot_acquire() {
    let mut state = State::new(Limits::default());
    let a = open(&mut state, 1_000, 0);
    let mut fx = Effects::default();
    let r = state.acquire(a, &key("k"), at(1_000), &mut fx);
    assert_eq!(r, Err(AcquireError::SessionGone));
    assert_eq!(fx.ended.len(), 1);
    assert_eq!(state.session_count(), 0);
    assert!(acquire(&mut state, SessionId::random(), "k", 0).is_err());
}

#[test]
fn end_cascades_and_reports_reason() {
    let mut state = State::new(Limits::default());
    let a = open(&mut state, 10_000, 0);
    for k in ["x", "y", "z"] {
        acquire(&mut state, a, k, 1).unwrap();
    }
    let mut fx = Effects::default();
    let ended = state.end(a, EndReason::Closed, at(5), &mut fx).unwrap();
    assert_eq!(ended.released.len(), 3);
    assert_eq!(ended.reason, EndReason::Closed);
    assert_eq!(state.lock_count(), 0);
    assert_eq!(
        fx.changes
            .iter()
            .filter(|c| matches!(c, Change::DeleteLock { .. }))
            .count(),
        3
    );
    assert_eq!(fx.freed_locks.len(), 3);
    assert!(state.end(a, EndReason::Closed, at(6), &mut fx).is_none());
    // Closing after the deadline is recorded as the expiry it was.
    let b = open(&mut state, 1_000, 0);
    let ended = state.end(b, EndReason::Closed, at(1_000), &mut fx).unwrap();
    assert_eq!(ended.reason, EndReason::Expired);
    state.check_invariants().unwrap();
}

#[test]
fn reap_takes_due_sessions_in_deadline_order_and_bounded() {
    let mut state = State::new(Limits::default());
    let ids: Vec<_> = (0..5)
        .map(|i| open(&mut state, 1_000 + i * 100, 0))
        .collect();
    let live = open(&mut state, 60_000, 0);
    assert_eq!(state.due(Mono(1_250), 100).len(), 3);
    let mut fx = Effects::default();
    let ended = state.reap(at(10_000), 2, &mut fx);
    assert_eq!(ended.iter().map(|e| e.id).collect::<Vec<_>>(), ids[..2]);
    let ended = state.reap(at(10_000), 100, &mut fx);
    assert_eq!(ended.iter().map(|e| e.id).collect::<Vec<_>>(), ids[2..]);
    assert!(state.session(live, Mono(10_000)).is_some());
    assert_eq!(state.earliest_deadline(), Some(Mono(60_000)));
    state.check_invariants().unwrap();
}

#[test]
fn reap_across_several_warmed_batches_ends_each_due_session_once() {
    // More due sessions than one batch the reaper warms at a time, holding none, one or
    // three locks, reaped with limits that end inside a batch.
    let mut state = State::new(Limits::default());
    let n = 3 * REAP_AHEAD as u64 + 5;
    let mut ids = Vec::new();
    for i in 0..n {
        let id = open(&mut state, 1_000 + i, 0);
        for k in 0..[0, 1, 3][(i % 3) as usize] {
            acquire(&mut state, id, &format!("k/{i}/{k}"), 0).unwrap();
        }
        ids.push(id);
    }
    let live = open(&mut state, 60_000, 0);
    acquire(&mut state, live, "live", 0).unwrap();
    let held: usize = ids.iter().map(|id| state.view(*id).locks.len()).sum();
    let mut fx = Effects::default();
    let mut ended = state.reap(at(10_000), REAP_AHEAD + 7, &mut fx);
    assert_eq!(ended.len(), REAP_AHEAD + 7);
    ended.extend(state.reap(at(10_000), 1_000, &mut fx));
    assert_eq!(ended.iter().map(|e| e.id).collect::<Vec<_>>(), ids);
    let released: usize = ended.iter().map(|e| e.released.len()).sum();
    assert_eq!(released, held);
    assert_eq!(fx.freed_locks.len(), held);
    let events = fx
        .changes
        .iter()
        .filter(|c| matches!(c, Change::Event(e) if e.kind == EventKind::SessionExpired))
        .count();
    assert_eq!(events, ids.len());
    assert!(state.lock(&key("live")).is_some());
    assert!(state.reap(at(10_000), 1_000, &mut fx).is_empty());
    state.check_invariants().unwrap();
}

#[test]
fn too_many_locks_is_refused() {
    let limits = Limits {
        max_locks_per_session: 2,
        ..Limits::default()
    };
    let mut state = State::new(limits);
    let a = open(&mut state, 10_000, 0);
    acquire(&mut state, a, "1", 0).unwrap();
    acquire(&mut state, a, "2", 0).unwrap();
    assert_eq!(
        acquire(&mut state, a, "3", 0),
        Err(AcquireError::TooManyLocks(2))
    );
    // Re-acquiring one it holds is still fine.
    assert!(acquire(&mut state, a, "1", 0).is_ok());
}

#[test]
fn grace_after_a_third_of_the_ttl() {
    let mut state = State::new(Limits::default());
    let a = open(&mut state, 3_000, 0);
    assert!(!state.session(a, Mono(1_000)).unwrap().in_grace(Mono(1_000)));
    assert!(state.session(a, Mono(1_001)).unwrap().in_grace(Mono(1_001)));
}

#[test]
fn ending_a_session_settles_seats_and_jobs_in_the_same_change_set() {
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    let pool = key("licences");
    state
        .put_pool(&pool, 1, String::new(), None, at(0), &mut fx)
        .unwrap();
    let queue = key("builds");
    let job = crate::domain::JobId::random();
    let new = |idempotent| NewJob {
        queue: queue.clone(),
        payload: "{}".into(),
        idempotent,
        max_recoveries: Some(1),
        kind: None,
    };
    state.enqueue(job, new(true), at(0), &mut fx).unwrap();
    let a = open(&mut state, 1_000, 0);
    state
        .acquire_seat(a, &pool, String::new(), at(1), &mut fx)
        .unwrap();
    let claim = state.claim(a, &queue, at(1), &mut fx).unwrap().unwrap();
    assert_eq!(claim.job, job);
    let mut fx = Effects::default();
    let ended = state.reap(at(1_000), 10, &mut fx);
    assert_eq!(ended[0].seats.len(), 1);
    assert_eq!(
        ended[0].jobs,
        vec![(job, JobOutcome::Recovered { recovery_count: 1 })]
    );
    assert_eq!(fx.freed_pools, vec![pool.clone()]);
    assert_eq!(fx.ready_queues, vec![queue.clone()]);
    assert!(state.pool_has_room(&pool));
    // The old claim's token is stale now.
    let b = open(&mut state, 10_000, 1_000);
    let mut fx = Effects::default();
    assert_eq!(
        state.finish_job(
            a,
            job,
            claim.token,
            crate::domain::Finish::Complete {
                result: String::new()
            },
            at(1_001),
            &mut fx
        ),
        Err(crate::domain::JobError::StaleToken)
    );
    let again = state.claim(b, &queue, at(1_001), &mut fx).unwrap().unwrap();
    assert_eq!(again.recovery_count, 1);
    assert_eq!(again.attempt, 2);
    // At the cap, the next orphaning fails the job.
    let ended = state.end(b, EndReason::Admin, at(1_002), &mut fx).unwrap();
    assert_eq!(
        ended.jobs,
        vec![(
            job,
            JobOutcome::Failed {
                reason: "max_recoveries_exceeded".into()
            }
        )]
    );
    state.check_invariants().unwrap();
}

#[test]
fn restore_gives_every_session_a_fresh_ttl_and_rejects_orphans() {
    let id = SessionId::random();
    let record = LockRecord {
        session_id: id,
        token: Token(7),
        acquired_at: WALL,
    };
    let state = State::restore(
        Limits::default(),
        Restore {
            revision: 9,
            event_seq: 3,
            sessions: vec![(id, 2_000)],
            locks: vec![(key("k"), record.clone())],
            ..Restore::default()
        },
        Mono(50_000),
    )
    .unwrap();
    assert_eq!(
        state.session(id, Mono(51_999)).unwrap().deadline,
        Mono(52_000)
    );
    assert_eq!(state.revision(), 9);
    state.check_invariants().unwrap();

    // The expiry index, built in one go from the sorted deadlines, orders them by deadline
    // whatever the order the sessions were read in.
    let ids: Vec<SessionId> = (0..3).map(|_| SessionId::random()).collect();
    let state = State::restore(
        Limits::default(),
        Restore {
            sessions: vec![(ids[0], 3_000), (ids[1], 1_000), (ids[2], 2_000)],
            ..Restore::default()
        },
        Mono(0),
    )
    .unwrap();
    state.check_invariants().unwrap();
    assert_eq!(state.earliest_deadline(), Some(Mono(1_000)));

    let orphan = State::restore(
        Limits::default(),
        Restore {
            revision: 9,
            event_seq: 3,
            locks: vec![(key("k"), record.clone())],
            ..Restore::default()
        },
        Mono(0),
    );
    assert!(matches!(orphan, Err(RestoreError::Orphan { .. })));
    let above = State::restore(
        Limits::default(),
        Restore {
            revision: 6,
            event_seq: 3,
            sessions: vec![(id, 2_000)],
            locks: vec![(key("k"), record)],
            ..Restore::default()
        },
        Mono(0),
    );
    assert!(matches!(
        above,
        Err(RestoreError::TokenAboveRevision { .. })
    ));
}

/// Reaping while leaving the rows to the store ends the same sessions with the same
/// releases, seats, jobs, events and counters as a reap that deletes them, and emits
/// exactly the same changes less the row and grant deletes.
#[test]
fn reaping_leaving_rows_differs_only_by_the_row_deletes() {
    let mut state = State::new(Limits::default());
    let mut fx = Effects::default();
    let pool = key("licences");
    state
        .put_pool(&pool, 2, String::new(), None, at(0), &mut fx)
        .unwrap();
    let queue = key("builds");
    state
        .enqueue(
            crate::domain::JobId::random(),
            NewJob {
                queue: queue.clone(),
                payload: "{}".into(),
                idempotent: true,
                max_recoveries: Some(1),
                kind: None,
            },
            at(0),
            &mut fx,
        )
        .unwrap();
    for i in 0..4 {
        let id = open(&mut state, 1_000 + i * 10, 0);
        acquire(&mut state, id, &format!("k{i}"), 1).unwrap();
        acquire(&mut state, id, &format!("k{i}/b"), 1).unwrap();
        if i < 2 {
            state
                .acquire_seat(id, &pool, String::new(), at(1), &mut fx)
                .unwrap();
        }
        if i == 3 {
            state.claim(id, &queue, at(1), &mut fx).unwrap().unwrap();
        }
    }
    let live = open(&mut state, 60_000, 0);
    acquire(&mut state, live, "kept", 1).unwrap();

    let mut leaving = state.clone();
    let (mut all, mut left) = (Effects::default(), Effects::default());
    let ended = state.reap(at(5_000), 10, &mut all);
    assert_eq!(leaving.reap_leaving_rows(at(5_000), 10, &mut left), ended);
    assert_eq!(ended.len(), 4);
    assert_eq!(ended[3].jobs.len(), 1);
    let deletes =
        |c: &Change| matches!(c, Change::DeleteSession { .. } | Change::DeleteLock { .. });
    assert_eq!(all.changes.iter().filter(|c| deletes(c)).count(), 4 + 8);
    assert!(!left.changes.iter().any(deletes));
    all.changes.retain(|c| !deletes(c));
    assert_eq!(left.changes, all.changes);
    assert_eq!(left.freed_locks, all.freed_locks);
    assert_eq!(leaving.revision(), state.revision());
    assert_eq!(leaving.event_seq(), state.event_seq());
    leaving.check_invariants().unwrap();
    assert!(leaving.holds(live, &key("kept")));
    assert!(!leaving.holds(ended[0].id, &key("k0")));
}
