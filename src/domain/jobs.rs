//! The job table: every job's record, each queue's order and counts, and the finished jobs by
//! when they finished (for the retention purge).
//!
//! A queued job is claimed by a session with a fresh fencing token; only that claim may
//! finish it. When the claiming session ends, an idempotent job with recoveries left goes
//! back to the head of its queue, any other becomes failed — never lost, never held by two
//! live sessions. The table knows nothing of sessions' liveness, tokens or events: the
//! aggregate ([`super::state::State`]) checks the claimant, draws the token and records the
//! event; the table keeps its own indexes in step and returns each record to persist.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::change::{Change, Event, EventKind, JobRecord, JobStatus};
use super::ids::{JobId, QueueName, SessionId, Token};
use super::limits::InvalidInput;
use super::time::UnixMs;

pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024;
pub const MAX_RESULT_BYTES: usize = 64 * 1024;
pub const MAX_RECOVERIES: u32 = 1_000;
pub const DEFAULT_MAX_RECOVERIES: u32 = 3;
pub const MAX_KIND_BYTES: usize = 256;
pub const MAX_REASON_BYTES: usize = 4 * 1024;

pub const REASON_MAX_RECOVERIES: &str = "max_recoveries_exceeded";
pub const REASON_NOT_IDEMPOTENT: &str = "not_idempotent";

/// What happened to a claimed job when its session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobOutcome {
    /// Back at the head of its queue, with this recovery count.
    Recovered { recovery_count: u32 },
    /// Failed for good, with this reason.
    Failed { reason: String },
}

impl JobOutcome {
    /// The audit event that records this outcome.
    pub fn event_kind(&self) -> EventKind {
        match self {
            JobOutcome::Recovered { .. } => EventKind::JobRecovered,
            JobOutcome::Failed { .. } => EventKind::JobFailed,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewJob {
    pub queue: QueueName,
    /// Serialized JSON.
    pub payload: String,
    pub idempotent: bool,
    pub max_recoveries: Option<u32>,
    pub kind: Option<String>,
}

impl NewJob {
    /// Checks the payload and kind sizes and the recovery cap; returns the cap and kind the
    /// job will have. Every backend applies these rules before it stores a job.
    pub fn checked(&self) -> Result<(u32, String), InvalidInput> {
        check_text("payload", &self.payload, MAX_PAYLOAD_BYTES)?;
        let max_recoveries = self.max_recoveries.unwrap_or(DEFAULT_MAX_RECOVERIES);
        if max_recoveries > MAX_RECOVERIES {
            return Err(InvalidInput::new(
                "max_recoveries",
                format!("must be at most {MAX_RECOVERIES}"),
            ));
        }
        let kind = self.kind.clone().unwrap_or_default();
        check_text("kind", &kind, MAX_KIND_BYTES)?;
        if kind.chars().any(char::is_control) {
            return Err(InvalidInput::new(
                "kind",
                "must not contain control characters",
            ));
        }
        Ok((max_recoveries, kind))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub job: JobId,
    pub token: Token,
    pub attempt: u32,
    pub recovery_count: u32,
    pub kind: String,
    pub revision: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the session is gone")]
pub struct ClaimGone;

/// How a claimant finishes or hands back its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    Complete {
        result: String,
    },
    Fail {
        reason: String,
    },
    /// Back to the head of the queue, no recovery counted (a worker draining).
    Release,
}

impl Finish {
    /// The text limits of what the claimant sends.
    pub fn check(&self) -> Result<(), InvalidInput> {
        match self {
            Finish::Complete { result } => check_text("result", result, MAX_RESULT_BYTES),
            Finish::Fail { reason } => check_text("reason", reason, MAX_REASON_BYTES),
            Finish::Release => Ok(()),
        }
    }

    /// The audit event that records this finish.
    pub fn event_kind(&self) -> EventKind {
        match self {
            Finish::Complete { .. } => EventKind::JobCompleted,
            Finish::Fail { .. } => EventKind::JobFailed,
            Finish::Release => EventKind::JobReleased,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("no such job")]
    NotFound,
    #[error("the token is not the job's current claim")]
    StaleToken,
    #[error("the job is not failed")]
    NotFailed,
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
}

/// Counts of a queue's jobs by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueCounts {
    pub queued: u64,
    pub claimed: u64,
    pub done: u64,
    pub failed: u64,
}

fn check_text(field: &'static str, text: &str, max: usize) -> Result<(), InvalidInput> {
    if text.len() > max {
        return Err(InvalidInput::new(
            field,
            format!("must be at most {max} bytes"),
        ));
    }
    Ok(())
}

#[derive(Debug, Clone)]
struct Job {
    queue: QueueName,
    kind: String,
    idempotent: bool,
    max_recoveries: u32,
    recovery_count: u32,
    attempt: u32,
    order: i64,
    /// `Done` keeps no result in memory: it is written once, at completion.
    status: JobStatus,
    enqueued_at: UnixMs,
    updated_at: UnixMs,
}

impl Job {
    fn finished(&self) -> bool {
        matches!(
            self.status,
            JobStatus::Done { .. } | JobStatus::Failed { .. }
        )
    }

    /// What ending its claimant would do: recover it while it is idempotent with
    /// recoveries left, fail it otherwise.
    fn orphan_outcome(&self) -> JobOutcome {
        if self.idempotent && self.recovery_count < self.max_recoveries {
            JobOutcome::Recovered {
                recovery_count: self.recovery_count + 1,
            }
        } else {
            JobOutcome::Failed {
                reason: if self.idempotent {
                    REASON_MAX_RECOVERIES
                } else {
                    REASON_NOT_IDEMPOTENT
                }
                .to_string(),
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Queue {
    /// Queued jobs by order: the first is the next claim.
    queued: BTreeMap<i64, JobId>,
    /// Next order at the head (recovered jobs): counts down from -1.
    head: i64,
    /// Next order at the tail (new jobs): counts up from 1.
    tail: i64,
    /// Jobs by state: queued, claimed, done, failed.
    counts: [u64; 4],
}

impl Queue {
    fn new() -> Queue {
        Queue {
            queued: BTreeMap::new(),
            head: -1,
            tail: 1,
            counts: [0; 4],
        }
    }

    fn push_tail(&mut self, id: JobId) -> i64 {
        let order = self.tail;
        self.tail += 1;
        self.queued.insert(order, id);
        order
    }

    fn push_head(&mut self, id: JobId) -> i64 {
        let order = self.head;
        self.head -= 1;
        self.queued.insert(order, id);
        order
    }

    fn count(&mut self, status: &JobStatus, delta: i64) {
        let c = &mut self.counts[status.code() as usize];
        *c = c
            .checked_add_signed(delta)
            .expect("job counts never go negative");
    }
}

/// A job's record read back from the store, which names a queue this build cannot parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BadQueue(pub(super) String);

/// Every job, queue and finished job.
#[derive(Debug, Clone, Default)]
pub(super) struct Jobs {
    jobs: HashMap<JobId, Job>,
    queues: HashMap<QueueName, Queue>,
    /// Finished jobs by when they finished, for the retention purge.
    finished: BTreeSet<(UnixMs, JobId)>,
}

impl Jobs {
    /// Puts back a job as the store has it.
    pub(super) fn restore(&mut self, id: JobId, r: JobRecord) -> Result<(), BadQueue> {
        let queue_name =
            QueueName::parse("queue", &r.queue).map_err(|_| BadQueue(r.queue.clone()))?;
        let queue = self
            .queues
            .entry(queue_name.clone())
            .or_insert_with(Queue::new);
        queue.count(&r.status, 1);
        match &r.status {
            JobStatus::Queued => {
                queue.queued.insert(r.order, id);
                queue.head = queue.head.min(r.order - 1);
                queue.tail = queue.tail.max(r.order + 1);
            }
            JobStatus::Claimed { .. } => {}
            JobStatus::Done { .. } | JobStatus::Failed { .. } => {
                self.finished.insert((r.updated_at, id));
            }
        }
        let status = match r.status {
            JobStatus::Done { .. } => JobStatus::Done {
                result: String::new(),
            },
            other => other,
        };
        self.jobs.insert(
            id,
            Job {
                queue: queue_name,
                kind: r.kind,
                idempotent: r.idempotent,
                max_recoveries: r.max_recoveries,
                recovery_count: r.recovery_count,
                attempt: r.attempt,
                order: r.order,
                status,
                enqueued_at: r.enqueued_at,
                updated_at: r.updated_at,
            },
        );
        Ok(())
    }

    fn record(&self, id: JobId) -> JobRecord {
        let j = &self.jobs[&id];
        JobRecord {
            queue: j.queue.to_string(),
            kind: j.kind.clone(),
            idempotent: j.idempotent,
            max_recoveries: j.max_recoveries,
            recovery_count: j.recovery_count,
            attempt: j.attempt,
            order: j.order,
            status: j.status.clone(),
            enqueued_at: j.enqueued_at,
            updated_at: j.updated_at,
        }
    }

    /// Moves a job to `status`, keeping the queue's counts and the finished index in step,
    /// and returns its record to persist (with `payload` when it is new).
    fn set_status(
        &mut self,
        id: JobId,
        status: JobStatus,
        wall: UnixMs,
        payload: Option<String>,
    ) -> Change {
        let job = self.jobs.get_mut(&id).expect("set_status on a present job");
        let queue = self
            .queues
            .get_mut(&job.queue)
            .expect("a job's queue exists");
        if payload.is_none() {
            queue.count(&job.status, -1);
        }
        queue.count(&status, 1);
        if job.finished() {
            self.finished.remove(&(job.updated_at, id));
        }
        job.status = status;
        job.updated_at = wall;
        if job.finished() {
            self.finished.insert((wall, id));
        }
        let record = self.record(id);
        // The result is persisted once; memory keeps none.
        if let JobStatus::Done { result } = &mut self.jobs.get_mut(&id).expect("present").status {
            result.clear();
        }
        Change::PutJob {
            id,
            record,
            payload,
        }
    }

    /// Puts a job back at the head of its queue (it was handed back or recovered) and
    /// returns the queue, which now has a job for its waiters.
    fn push_head(&mut self, id: JobId) -> QueueName {
        let queue = self.jobs[&id].queue.clone();
        let order = self
            .queues
            .get_mut(&queue)
            .expect("a job's queue exists")
            .push_head(id);
        self.jobs.get_mut(&id).expect("present").order = order;
        queue
    }

    /// Fills in what an audit event says of job `id`: the job, its queue, and the token of
    /// its claim while it is claimed.
    pub(super) fn describe(&self, id: JobId, event: &mut Event) {
        let job = &self.jobs[&id];
        event.job_id = Some(id);
        event.queue = Some(job.queue.to_string());
        event.token = match &job.status {
            JobStatus::Claimed { token, .. } => Some(*token),
            _ => None,
        };
    }

    /// Adds a job at the tail of its queue; returns its record, payload included.
    pub(super) fn enqueue(
        &mut self,
        id: JobId,
        new: NewJob,
        wall: UnixMs,
    ) -> Result<Change, InvalidInput> {
        let (max_recoveries, kind) = new.checked()?;
        debug_assert!(!self.jobs.contains_key(&id), "job ids are never reused");
        let queue = self
            .queues
            .entry(new.queue.clone())
            .or_insert_with(Queue::new);
        let order = queue.push_tail(id);
        self.jobs.insert(
            id,
            Job {
                queue: new.queue,
                kind,
                idempotent: new.idempotent,
                max_recoveries,
                recovery_count: 0,
                attempt: 0,
                order,
                status: JobStatus::Queued,
                enqueued_at: wall,
                updated_at: wall,
            },
        );
        Ok(self.set_status(id, JobStatus::Queued, wall, Some(new.payload)))
    }

    pub(super) fn contains(&self, id: JobId) -> bool {
        self.jobs.contains_key(&id)
    }

    /// Whether `queue` has a job to claim.
    pub(super) fn has_queued(&self, queue: &QueueName) -> bool {
        self.queues.get(queue).is_some_and(|q| !q.queued.is_empty())
    }

    /// Claims the first queued job of `queue` for `session` with `token`, drawn by the
    /// caller once it knows there is a job (`has_queued`).
    pub(super) fn claim_next(
        &mut self,
        queue: &QueueName,
        session: SessionId,
        token: Token,
        wall: UnixMs,
    ) -> (Claim, Change) {
        let (_, id) = self
            .queues
            .get_mut(queue)
            .and_then(|q| q.queued.pop_first())
            .expect("claim_next is called on a queue with a queued job");
        let job = self.jobs.get_mut(&id).expect("queued jobs exist");
        job.attempt += 1;
        let claim = Claim {
            job: id,
            token,
            attempt: job.attempt,
            recovery_count: job.recovery_count,
            kind: job.kind.clone(),
            revision: token.0,
        };
        let status = JobStatus::Claimed {
            session_id: session,
            token,
            claimed_at: wall,
        };
        (claim, self.set_status(id, status, wall, None))
    }

    /// The current claim of a job: who holds it, with which token.
    pub(super) fn claimant(&self, id: JobId) -> Option<(SessionId, Token)> {
        match self.jobs.get(&id).map(|j| &j.status) {
            Some(JobStatus::Claimed {
                session_id, token, ..
            }) => Some((*session_id, *token)),
            _ => None,
        }
    }

    /// Finishes a claimed job as its claimant asked; returns its record and, for a job handed
    /// back, its queue (which now has a job for its waiters).
    pub(super) fn finish(
        &mut self,
        id: JobId,
        finish: Finish,
        wall: UnixMs,
    ) -> (Change, Option<QueueName>) {
        let (status, ready) = match finish {
            Finish::Complete { result } => (JobStatus::Done { result }, None),
            Finish::Fail { reason } => (JobStatus::Failed { reason }, None),
            Finish::Release => (JobStatus::Queued, Some(self.push_head(id))),
        };
        (self.set_status(id, status, wall, None), ready)
    }

    /// Settles a job whose claimant ended: recovered to the head of its queue when
    /// idempotent with recoveries left, failed otherwise. Returns the outcome, the record,
    /// and the queue when it has a job for its waiters again.
    pub(super) fn orphan(
        &mut self,
        id: JobId,
        wall: UnixMs,
    ) -> (JobOutcome, Change, Option<QueueName>) {
        let outcome = self.jobs[&id].orphan_outcome();
        match &outcome {
            JobOutcome::Recovered { recovery_count } => {
                let queue = self.push_head(id);
                self.jobs.get_mut(&id).expect("present").recovery_count = *recovery_count;
                let change = self.set_status(id, JobStatus::Queued, wall, None);
                (outcome, change, Some(queue))
            }
            JobOutcome::Failed { reason } => {
                let status = JobStatus::Failed {
                    reason: reason.clone(),
                };
                let change = self.set_status(id, status, wall, None);
                (outcome, change, None)
            }
        }
    }

    /// Sends a failed job back to the tail of its queue with its recovery count reset;
    /// returns its record and its queue.
    pub(super) fn requeue(
        &mut self,
        id: JobId,
        wall: UnixMs,
    ) -> Result<(Change, QueueName), JobError> {
        let job = self.jobs.get(&id).ok_or(JobError::NotFound)?;
        if !matches!(job.status, JobStatus::Failed { .. }) {
            return Err(JobError::NotFailed);
        }
        let queue = job.queue.clone();
        let order = self
            .queues
            .get_mut(&queue)
            .expect("a job's queue exists")
            .push_tail(id);
        let job = self.jobs.get_mut(&id).expect("present");
        job.order = order;
        job.recovery_count = 0;
        Ok((self.set_status(id, JobStatus::Queued, wall, None), queue))
    }

    /// Purges up to `limit` jobs that finished before `before`, pushing their deletions to
    /// `out`; returns how many.
    pub(super) fn purge(&mut self, before: UnixMs, limit: usize, out: &mut Vec<Change>) -> usize {
        let mut purged = 0;
        while purged < limit {
            let Some(&(at, id)) = self.finished.first() else {
                break;
            };
            if at >= before {
                break;
            }
            self.finished.pop_first();
            let job = self.jobs.remove(&id).expect("finished jobs exist");
            if let Some(q) = self.queues.get_mut(&job.queue) {
                q.count(&job.status, -1);
                if q.counts == [0; 4] {
                    self.queues.remove(&job.queue);
                }
            }
            out.push(Change::DeleteJob {
                id,
                queue: job.queue,
            });
            purged += 1;
        }
        purged
    }

    pub(super) fn counts(&self, queue: &QueueName) -> QueueCounts {
        match self.queues.get(queue) {
            Some(q) => QueueCounts {
                queued: q.counts[0],
                claimed: q.counts[1],
                done: q.counts[2],
                failed: q.counts[3],
            },
            None => QueueCounts::default(),
        }
    }

    /// Every queue with its counts, in name order.
    pub(super) fn queues(&self) -> Vec<(QueueName, QueueCounts)> {
        let mut out: Vec<_> = self
            .queues
            .keys()
            .map(|q| (q.clone(), self.counts(q)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// What ending its claimant now would do to a claimed job; `None` for any other.
    pub(super) fn outcome_if_orphaned(&self, id: JobId) -> Option<JobOutcome> {
        let j = self.jobs.get(&id)?;
        matches!(j.status, JobStatus::Claimed { .. }).then(|| j.orphan_outcome())
    }

    pub(super) fn status(&self, id: JobId) -> Option<&JobStatus> {
        self.jobs.get(&id).map(|j| &j.status)
    }

    /// Every claimed job with its claimant and token, for the aggregate's invariant check.
    pub(super) fn claims(&self) -> impl Iterator<Item = (JobId, SessionId, Token)> + '_ {
        self.jobs.iter().filter_map(|(id, j)| match &j.status {
            JobStatus::Claimed {
                session_id, token, ..
            } => Some((*id, *session_id, *token)),
            _ => None,
        })
    }

    /// The table's own invariants: each job sits in its queue exactly while it is queued,
    /// the counts match the jobs, and no job was recovered past its cap.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut counts: HashMap<&QueueName, [u64; 4]> = HashMap::new();
        for (id, job) in &self.jobs {
            counts.entry(&job.queue).or_default()[job.status.code() as usize] += 1;
            if job.recovery_count > job.max_recoveries {
                return Err(format!("job {id} recovered more than its cap"));
            }
            let queue = self
                .queues
                .get(&job.queue)
                .ok_or_else(|| format!("job {id} has no queue"))?;
            let queued = queue.queued.get(&job.order) == Some(id);
            match &job.status {
                JobStatus::Queued if !queued => {
                    return Err(format!("queued job {id} is not in its queue"));
                }
                JobStatus::Claimed { .. } if queued => {
                    return Err(format!("claimed job {id} is still queued"));
                }
                _ => {}
            }
        }
        for (name, queue) in &self.queues {
            if counts.get(name).copied().unwrap_or_default() != queue.counts {
                return Err(format!("queue {name} counts are out of step"));
            }
            for id in queue.queued.values() {
                if !matches!(
                    self.jobs.get(id).map(|j| &j.status),
                    Some(JobStatus::Queued)
                ) {
                    return Err(format!("queue {name} lists {id} which is not queued"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> QueueName {
        QueueName::parse("queue", "q").unwrap()
    }

    fn new(idempotent: bool, max_recoveries: u32) -> NewJob {
        NewJob {
            queue: queue(),
            payload: "{}".into(),
            idempotent,
            max_recoveries: Some(max_recoveries),
            kind: None,
        }
    }

    #[test]
    fn recovered_jobs_go_to_the_head_and_the_cap_fails_them() {
        let mut jobs = Jobs::default();
        let (a, b) = (JobId::from_u128(1), JobId::from_u128(2));
        jobs.enqueue(a, new(true, 1), UnixMs(0)).unwrap();
        jobs.enqueue(b, new(true, 1), UnixMs(0)).unwrap();
        let s = SessionId::from_u128(9);
        let (claim, _) = jobs.claim_next(&queue(), s, Token(5), UnixMs(1));
        assert_eq!((claim.job, claim.attempt), (a, 1));
        assert_eq!(jobs.claimant(a), Some((s, Token(5))));
        let (outcome, _, ready) = jobs.orphan(a, UnixMs(2));
        assert_eq!(outcome, JobOutcome::Recovered { recovery_count: 1 });
        assert_eq!(ready, Some(queue()));
        // Back at the head, ahead of the job enqueued after it.
        let (again, _) = jobs.claim_next(&queue(), s, Token(6), UnixMs(3));
        assert_eq!((again.job, again.attempt, again.recovery_count), (a, 2, 1));
        let (outcome, _, ready) = jobs.orphan(a, UnixMs(4));
        assert_eq!(
            outcome,
            JobOutcome::Failed {
                reason: REASON_MAX_RECOVERIES.into()
            }
        );
        assert_eq!(ready, None);
        assert_eq!(
            jobs.counts(&queue()),
            QueueCounts {
                queued: 1,
                claimed: 0,
                done: 0,
                failed: 1
            }
        );
        jobs.check().unwrap();
    }

    #[test]
    fn enqueue_checks_its_input() {
        let mut jobs = Jobs::default();
        let big = NewJob {
            payload: "x".repeat(MAX_PAYLOAD_BYTES + 1),
            ..new(true, 1)
        };
        assert_eq!(
            jobs.enqueue(JobId::from_u128(1), big, UnixMs(0))
                .unwrap_err()
                .field,
            "payload"
        );
        let many = new(true, MAX_RECOVERIES + 1);
        assert_eq!(
            jobs.enqueue(JobId::from_u128(1), many, UnixMs(0))
                .unwrap_err()
                .field,
            "max_recoveries"
        );
        assert!(jobs.queues().is_empty());
    }

    #[test]
    fn purge_takes_the_oldest_finished_first_and_drops_empty_queues() {
        let mut jobs = Jobs::default();
        let s = SessionId::from_u128(9);
        for i in 1..=3 {
            jobs.enqueue(JobId::from_u128(i), new(false, 0), UnixMs(0))
                .unwrap();
            jobs.claim_next(&queue(), s, Token(i as u64), UnixMs(0));
            jobs.orphan(JobId::from_u128(i), UnixMs(i as u64 * 10));
        }
        let mut out = Vec::new();
        assert_eq!(jobs.purge(UnixMs(25), 10, &mut out), 2);
        assert_eq!(out.len(), 2);
        assert_eq!(jobs.purge(UnixMs(100), 10, &mut out), 1);
        assert!(jobs.queues().is_empty());
        jobs.check().unwrap();
    }
}
