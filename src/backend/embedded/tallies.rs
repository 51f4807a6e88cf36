//! Metrics bookkeeping: what a batch did, counted while it is applied and published only
//! once it has committed, so the metrics never count what a failed commit lost.

use std::collections::BTreeSet;

use crate::backend::{Closed, ReapOutcome};
use crate::domain::{Change, EndReason, Ended, JobOutcome, PoolName, QueueName, SessionId, State};
use crate::metrics::{Metrics, ReasonLabel};

/// The log line of one ended session, written once its batch has committed.
pub struct EndLine {
    /// Kept as the id, so a storm's lines cost no text until they are written; logged as
    /// its first eight hex digits, never the whole id (a capability).
    session: SessionId,
    reason: EndReason,
    closed: Closed,
}

impl EndLine {
    pub fn log(&self) {
        self.closed.log(self.session, self.reason);
    }
}

/// Counts to add to the metrics once the batch has committed, and the pools and queues
/// whose gauges need refreshing then.
#[derive(Default)]
pub struct Tally {
    pub opened: u64,
    /// Calls answered from a request id's record.
    pub replays: u64,
    ended: [u64; 3],
    pub acquired: u64,
    pub released: u64,
    released_by_expiry: u64,
    seats_reclaimed: u64,
    pub seats_refused: u64,
    jobs_recovered: u64,
    pub jobs_failed: Vec<String>,
    touched_pools: BTreeSet<PoolName>,
    touched_queues: BTreeSet<QueueName>,
    /// One per session ended in the batch other than by a reaper pass; logged after the
    /// replies, off the state lock.
    pub ends: Vec<EndLine>,
    /// What the batch's reaper passes ended, logged as one line for all of them.
    pub reaped: ReapOutcome,
    /// True once any session ended in the batch (whatever the log level).
    pub any_end: bool,
}

impl Tally {
    /// A session ended, with everything it released, by a close, an operator or a call that
    /// found it past its deadline: counted, and logged on a line of its own.
    pub fn ended(&mut self, e: &Ended) {
        self.count(e);
        // Lines that the log level would drop are not collected.
        if tracing::enabled!(tracing::Level::INFO) {
            self.ends.push(EndLine {
                session: e.id,
                reason: e.reason,
                closed: Closed::from(e),
            });
        }
    }

    /// The sessions a reaper pass ended and what it released: counted, and added to the
    /// batch's one line. Returns the pass's own outcome.
    pub fn reaped(&mut self, ended: &[Ended]) -> ReapOutcome {
        let mut pass = ReapOutcome::default();
        for e in ended {
            self.count(e);
            pass += ReapOutcome {
                sessions: 1,
                locks: e.released.len(),
                seats: e.seats.len(),
                jobs: e.jobs.len(),
            };
        }
        self.reaped += pass;
        pass
    }

    fn count(&mut self, e: &Ended) {
        let i = match e.reason {
            EndReason::Closed => 0,
            EndReason::Expired => 1,
            EndReason::Admin => 2,
        };
        self.ended[i] += 1;
        self.any_end = true;
        if e.reason == EndReason::Expired {
            self.released_by_expiry += e.released.len() as u64;
        }
        self.seats_reclaimed += e.seats.len() as u64;
        for (_, outcome) in &e.jobs {
            match outcome {
                JobOutcome::Recovered { .. } => self.jobs_recovered += 1,
                JobOutcome::Failed { reason } => self.jobs_failed.push(reason.clone()),
            }
        }
    }

    /// Notes the pools and queues a batch's changes touched.
    pub fn touched(&mut self, changes: &[Change]) {
        for change in changes {
            match change {
                Change::PutPool { name, .. }
                | Change::DeletePool { name }
                | Change::PutSeat { pool: name, .. }
                | Change::DeleteSeat { pool: name, .. } => {
                    self.touched_pools.insert(name.clone());
                }
                Change::PutJob { record, .. } => {
                    if let Ok(q) = QueueName::parse("queue", &record.queue) {
                        self.touched_queues.insert(q);
                    }
                }
                Change::DeleteJob { queue, .. } => {
                    self.touched_queues.insert(queue.clone());
                }
                _ => {}
            }
        }
    }

    /// Adds the counts to the metrics and refreshes the gauges from `state`.
    pub fn publish(self, m: &Metrics, state: &State) {
        m.sessions_active.set(state.session_count() as i64);
        m.locks_held.set(state.lock_count() as i64);
        m.sessions_opened.inc_by(self.opened);
        m.request_id_replays.inc_by(self.replays);
        for (i, reason) in [EndReason::Closed, EndReason::Expired, EndReason::Admin]
            .into_iter()
            .enumerate()
        {
            if self.ended[i] > 0 {
                m.sessions_ended
                    .get_or_create(&ReasonLabel {
                        reason: reason.as_str().into(),
                    })
                    .inc_by(self.ended[i]);
            }
        }
        m.locks_acquired.inc_by(self.acquired);
        m.locks_released.inc_by(self.released);
        m.locks_released_by_expiry.inc_by(self.released_by_expiry);
        m.seats_reclaimed.inc_by(self.seats_reclaimed);
        m.seats_refused.inc_by(self.seats_refused);
        m.jobs_recovered.inc_by(self.jobs_recovered);
        for reason in self.jobs_failed {
            m.jobs_failed.get_or_create(&ReasonLabel { reason }).inc();
        }
        for pool in self.touched_pools {
            m.set_pool(
                pool.as_str(),
                state.pool(&pool).map(|p| (p.capacity, p.holders.len())),
            );
        }
        for queue in self.touched_queues {
            m.set_queue(queue.as_str(), state.queue_counts(&queue));
        }
    }
}
