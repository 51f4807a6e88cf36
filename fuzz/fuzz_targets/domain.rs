//! Random operations on the domain state, with the structural invariants checked after
//! every one: no sequence of requests, however odd, may leave two holders of a key, a seat
//! over capacity, an orphan grant or a job in two places.
#![no_main]

use arbitrary::Arbitrary;
use leasehold::domain::{
    At, Effects, EndReason, Finish, JobId, Limits, LockKey, Mono, NewJob, SessionId, State, Token,
    UnixMs,
};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Op {
    Open { ttl: u16 },
    Heartbeat { s: u8, ttl: Option<u16> },
    End { s: u8, admin: bool },
    Acquire { s: u8, k: u8 },
    Release { s: u8, k: u8, t: u8 },
    PutPool { p: u8, capacity: u8 },
    DeletePool { p: u8 },
    Seat { s: u8, p: u8 },
    ReleaseSeat { s: u8, p: u8, t: u8 },
    Enqueue { q: u8, idempotent: bool, max: u8 },
    Claim { s: u8, q: u8 },
    Finish { s: u8, j: u8, t: u8, how: u8 },
    Requeue { j: u8 },
    Advance { ms: u16 },
    Reap { limit: u8 },
}

fn nth<T: Copy>(v: &[T], i: u8) -> Option<T> {
    v.get(i as usize % v.len().max(1)).copied()
}

fn name(prefix: &str, i: u8) -> LockKey {
    LockKey::parse("key", &format!("{prefix}{}", i % 4)).expect("valid name")
}

fuzz_target!(|ops: Vec<Op>| {
    let mut state = State::new(Limits {
        max_locks_per_session: 3,
        ..Limits::default()
    });
    let mut sessions: Vec<SessionId> = Vec::new();
    let mut jobs: Vec<JobId> = Vec::new();
    let mut now = 0u64;
    let mut last_revision = 0;
    for op in ops {
        let at = At {
            now: Mono(now),
            wall: UnixMs(1_700_000_000_000 + now),
        };
        let mut fx = Effects::default();
        match op {
            Op::Open { ttl } => {
                let id = SessionId::random();
                if state
                    .open(
                        id,
                        "f".into(),
                        Some(u64::from(ttl) * 10),
                        String::new(),
                        at,
                        &mut fx,
                    )
                    .is_ok()
                {
                    sessions.push(id);
                }
            }
            Op::Heartbeat { s, ttl } => {
                if let Some(id) = nth(&sessions, s) {
                    let _ = state.heartbeat(id, ttl.map(|t| u64::from(t) * 10), at, &mut fx);
                }
            }
            Op::End { s, admin } => {
                if let Some(id) = nth(&sessions, s) {
                    let reason = if admin {
                        EndReason::Admin
                    } else {
                        EndReason::Closed
                    };
                    let _ = state.end(id, reason, at, &mut fx);
                }
            }
            Op::Acquire { s, k } => {
                if let Some(id) = nth(&sessions, s) {
                    let _ = state.acquire(id, &name("k", k), at, &mut fx);
                }
            }
            Op::Release { s, k, t } => {
                if let Some(id) = nth(&sessions, s) {
                    let _ = state.release(id, &name("k", k), Token(u64::from(t)), at, &mut fx);
                }
            }
            Op::PutPool { p, capacity } => {
                let _ = state.put_pool(
                    &name("p", p),
                    u64::from(capacity % 4),
                    String::new(),
                    None,
                    at,
                    &mut fx,
                );
            }
            Op::DeletePool { p } => {
                let _ = state.delete_pool(&name("p", p), at, &mut fx);
            }
            Op::Seat { s, p } => {
                if let Some(id) = nth(&sessions, s) {
                    let _ = state.acquire_seat(id, &name("p", p), String::new(), at, &mut fx);
                }
            }
            Op::ReleaseSeat { s, p, t } => {
                if let Some(id) = nth(&sessions, s) {
                    let _ = state.release_seat(id, &name("p", p), Token(u64::from(t)), at, &mut fx);
                }
            }
            Op::Enqueue { q, idempotent, max } => {
                let id = JobId::random();
                let new = NewJob {
                    queue: name("q", q),
                    payload: "{}".into(),
                    idempotent,
                    max_recoveries: Some(u32::from(max % 3)),
                    kind: None,
                };
                if state.enqueue(id, new, at, &mut fx).is_ok() {
                    jobs.push(id);
                }
            }
            Op::Claim { s, q } => {
                if let Some(id) = nth(&sessions, s) {
                    let _ = state.claim(id, &name("q", q), at, &mut fx);
                }
            }
            Op::Finish { s, j, t, how } => {
                if let (Some(id), Some(jid)) = (nth(&sessions, s), nth(&jobs, j)) {
                    let finish = match how % 3 {
                        0 => Finish::Complete {
                            result: String::new(),
                        },
                        1 => Finish::Fail { reason: "f".into() },
                        _ => Finish::Release,
                    };
                    let _ = state.finish_job(id, jid, Token(u64::from(t)), finish, at, &mut fx);
                }
            }
            Op::Requeue { j } => {
                if let Some(jid) = nth(&jobs, j) {
                    let _ = state.requeue(jid, at, &mut fx);
                }
            }
            Op::Advance { ms } => now += u64::from(ms),
            Op::Reap { limit } => {
                let _ = state.reap(at, usize::from(limit), &mut fx);
            }
        }
        if let Err(e) = state.check_invariants() {
            panic!("invariant broken: {e}");
        }
        assert!(state.revision() >= last_revision, "the revision went back");
        last_revision = state.revision();
    }
});
