//! Job leases with orphan recovery. A queued job is claimed by a session with a fresh
//! fencing token; only that claim may finish it. When the claiming session ends for any
//! reason, in the same change set, an idempotent job with recoveries left goes back to the
//! head of its queue (`job_recovered`), any other becomes failed (`job_failed`) — never lost,
//! never held by two live sessions.

use std::collections::{BTreeMap, HashMap};

use super::change::{Change, EventKind, JobRecord, JobStatus};
use super::ids::{JobId, QueueName, SessionId, Token};
use super::limits::InvalidInput;
use super::state::{At, Effects, Gone, RestoreError, State};
use super::time::UnixMs;

pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024;
pub const MAX_RESULT_BYTES: usize = 64 * 1024;
pub const MAX_RECOVERIES: u32 = 1_000;
pub const DEFAULT_MAX_RECOVERIES: u32 = 3;
pub const MAX_KIND_BYTES: usize = 256;
pub const MAX_REASON_BYTES: usize = 4 * 1024;

pub const REASON_MAX_RECOVERIES: &str = "max_recoveries_exceeded";
pub const REASON_NOT_IDEMPOTENT: &str = "not_idempotent";

#[derive(Debug, Clone)]
pub(super) struct Job {
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

#[derive(Debug, Clone)]
pub(super) struct Queue {
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

/// What happened to a claimed job when its session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobOutcome {
    /// Back at the head of its queue, with this recovery count.
    Recovered { recovery_count: u32 },
    /// Failed for good, with this reason.
    Failed { reason: String },
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
    /// job will have.
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
    /// Checks the result and reason sizes.
    pub fn check(&self) -> Result<(), InvalidInput> {
        match self {
            Finish::Complete { result } => check_text("result", result, MAX_RESULT_BYTES),
            Finish::Fail { reason } => check_text("reason", reason, MAX_REASON_BYTES),
            Finish::Release => Ok(()),
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

impl State {
    pub(super) fn restore_jobs(
        &mut self,
        jobs: Vec<(JobId, JobRecord)>,
    ) -> Result<(), RestoreError> {
        for (id, r) in jobs {
            let queue_name = QueueName::parse("queue", &r.queue)
                .map_err(|_| RestoreError::BadQueue(id, r.queue.clone()))?;
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
                JobStatus::Claimed {
                    session_id, token, ..
                } => {
                    self.check_token(format!("job {id}"), *token)?;
                    let Some(s) = self.sessions.get_mut(session_id) else {
                        return Err(RestoreError::Orphan {
                            what: format!("job {id}"),
                            session: *session_id,
                        });
                    };
                    s.jobs.push(id);
                }
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
        }
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
    /// and emits its record (with `payload` when it is new).
    fn set_status(
        &mut self,
        id: JobId,
        status: JobStatus,
        at: At,
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
        if matches!(
            job.status,
            JobStatus::Done { .. } | JobStatus::Failed { .. }
        ) {
            self.finished.remove(&(job.updated_at, id));
        }
        let finished = matches!(status, JobStatus::Done { .. } | JobStatus::Failed { .. });
        job.status = status;
        job.updated_at = at.wall;
        if finished {
            self.finished.insert((at.wall, id));
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

    fn job_event(&mut self, id: JobId, kind: EventKind, at: At) -> super::change::Event {
        let job = &self.jobs[&id];
        let queue = job.queue.to_string();
        let token = match &job.status {
            JobStatus::Claimed { token, .. } => Some(*token),
            _ => None,
        };
        let mut event = self.event(at.wall, kind);
        event.job_id = Some(id);
        event.queue = Some(queue);
        event.token = token;
        event
    }

    /// Adds a job at the tail of its queue.
    pub fn enqueue(
        &mut self,
        id: JobId,
        new: NewJob,
        at: At,
        fx: &mut Effects,
    ) -> Result<u64, InvalidInput> {
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
                queue: new.queue.clone(),
                kind,
                idempotent: new.idempotent,
                max_recoveries,
                recovery_count: 0,
                attempt: 0,
                order,
                status: JobStatus::Queued,
                enqueued_at: at.wall,
                updated_at: at.wall,
            },
        );
        let revision = self.next_revision();
        let change = self.set_status(id, JobStatus::Queued, at, Some(new.payload));
        fx.changes.push(change);
        let event = self.job_event(id, EventKind::JobEnqueued, at);
        fx.changes.push(Change::Event(event));
        fx.ready_queues.push(new.queue);
        Ok(revision)
    }

    /// Whether `queue` has a job to claim.
    pub fn queue_has_job(&self, queue: &QueueName) -> bool {
        self.queues.get(queue).is_some_and(|q| !q.queued.is_empty())
    }

    /// Claims the first queued job of `queue` for session `id`; `None` when there is none.
    pub fn claim(
        &mut self,
        id: SessionId,
        queue_name: &QueueName,
        at: At,
        fx: &mut Effects,
    ) -> Result<Option<Claim>, ClaimGone> {
        self.live_or_end(id, at, fx).map_err(|Gone| ClaimGone)?;
        let Some(queue) = self.queues.get_mut(queue_name) else {
            return Ok(None);
        };
        let Some((_, job_id)) = queue.queued.pop_first() else {
            return Ok(None);
        };
        let revision = self.next_revision();
        let token = Token(revision);
        let job = self.jobs.get_mut(&job_id).expect("queued jobs exist");
        job.attempt += 1;
        let (attempt, recovery_count, kind) = (job.attempt, job.recovery_count, job.kind.clone());
        let change = self.set_status(
            job_id,
            JobStatus::Claimed {
                session_id: id,
                token,
                claimed_at: at.wall,
            },
            at,
            None,
        );
        fx.changes.push(change);
        self.sessions
            .get_mut(&id)
            .expect("checked live above")
            .jobs
            .push(job_id);
        let mut event = self.job_event(job_id, EventKind::JobClaimed, at);
        event.session_id = Some(id);
        fx.changes.push(Change::Event(event));
        Ok(Some(Claim {
            job: job_id,
            token,
            attempt,
            recovery_count,
            kind,
            revision,
        }))
    }

    /// Completes, fails or hands back a claimed job. Only the current claim (this live
    /// session with this token) may; anyone else gets `StaleToken` and changes nothing —
    /// a late worker can never finish a job that someone else now holds.
    pub fn finish_job(
        &mut self,
        id: SessionId,
        job_id: JobId,
        token: Token,
        finish: Finish,
        at: At,
        fx: &mut Effects,
    ) -> Result<u64, JobError> {
        finish.check()?;
        if !self.jobs.contains_key(&job_id) {
            return Err(JobError::NotFound);
        }
        // A claimant past its deadline is ended inline; its job was settled with it.
        let _ = self.live_or_end(id, at, fx);
        match &self.jobs[&job_id].status {
            JobStatus::Claimed {
                session_id,
                token: current,
                ..
            } if *session_id == id && *current == token => {}
            _ => return Err(JobError::StaleToken),
        }
        if let Some(s) = self.sessions.get_mut(&id)
            && let Some(pos) = s.jobs.iter().position(|j| *j == job_id)
        {
            s.jobs.swap_remove(pos);
        }
        let revision = self.next_revision();
        // The event names the claim that finished it, so it is built before the change.
        let (kind, status) = match finish {
            Finish::Complete { result } => (EventKind::JobCompleted, JobStatus::Done { result }),
            Finish::Fail { reason } => (EventKind::JobFailed, JobStatus::Failed { reason }),
            Finish::Release => (EventKind::JobReleased, JobStatus::Queued),
        };
        let mut event = self.job_event(job_id, kind, at);
        event.session_id = Some(id);
        if let JobStatus::Failed { reason } = &status {
            event.detail = Some(reason.clone());
        }
        if matches!(status, JobStatus::Queued) {
            let queue = self.jobs[&job_id].queue.clone();
            let order = self
                .queues
                .get_mut(&queue)
                .expect("a job's queue exists")
                .push_head(job_id);
            self.jobs.get_mut(&job_id).expect("present").order = order;
            fx.ready_queues.push(queue);
        }
        let change = self.set_status(job_id, status, at, None);
        fx.changes.push(change);
        fx.changes.push(Change::Event(event));
        Ok(revision)
    }

    /// Settles every job an ending session had claimed: recovered to the head of its queue
    /// when idempotent with recoveries left, failed otherwise.
    pub(super) fn settle_jobs(
        &mut self,
        id: SessionId,
        jobs: Vec<JobId>,
        at: At,
        fx: &mut Effects,
    ) -> Vec<(JobId, JobOutcome)> {
        let mut out = Vec::with_capacity(jobs.len());
        for job_id in jobs {
            let job = &self.jobs[&job_id];
            debug_assert!(
                matches!(job.status, JobStatus::Claimed { session_id, .. } if session_id == id)
            );
            let recover = job.idempotent && job.recovery_count < job.max_recoveries;
            let mut event;
            let outcome = if recover {
                event = self.job_event(job_id, EventKind::JobRecovered, at);
                let queue = self.jobs[&job_id].queue.clone();
                let order = self
                    .queues
                    .get_mut(&queue)
                    .expect("a job's queue exists")
                    .push_head(job_id);
                let job = self.jobs.get_mut(&job_id).expect("present");
                job.order = order;
                job.recovery_count += 1;
                let recovery_count = job.recovery_count;
                let change = self.set_status(job_id, JobStatus::Queued, at, None);
                fx.changes.push(change);
                fx.ready_queues.push(queue);
                JobOutcome::Recovered { recovery_count }
            } else {
                let reason = if job.idempotent {
                    REASON_MAX_RECOVERIES
                } else {
                    REASON_NOT_IDEMPOTENT
                };
                event = self.job_event(job_id, EventKind::JobFailed, at);
                event.detail = Some(reason.to_string());
                let change = self.set_status(
                    job_id,
                    JobStatus::Failed {
                        reason: reason.to_string(),
                    },
                    at,
                    None,
                );
                fx.changes.push(change);
                JobOutcome::Failed {
                    reason: reason.to_string(),
                }
            };
            event.session_id = Some(id);
            fx.changes.push(Change::Event(event));
            out.push((job_id, outcome));
        }
        out
    }

    /// Sends a failed job back to the tail of its queue, with its recovery count reset: an
    /// operator's explicit decision to try again.
    pub fn requeue(&mut self, job_id: JobId, at: At, fx: &mut Effects) -> Result<u64, JobError> {
        let job = self.jobs.get(&job_id).ok_or(JobError::NotFound)?;
        if !matches!(job.status, JobStatus::Failed { .. }) {
            return Err(JobError::NotFailed);
        }
        let queue = job.queue.clone();
        let order = self
            .queues
            .get_mut(&queue)
            .expect("a job's queue exists")
            .push_tail(job_id);
        let job = self.jobs.get_mut(&job_id).expect("present");
        job.order = order;
        job.recovery_count = 0;
        let revision = self.next_revision();
        let change = self.set_status(job_id, JobStatus::Queued, at, None);
        fx.changes.push(change);
        let event = self.job_event(job_id, EventKind::JobRequeued, at);
        fx.changes.push(Change::Event(event));
        fx.ready_queues.push(queue);
        Ok(revision)
    }

    /// Purges up to `limit` jobs that finished before `before`.
    pub fn purge_jobs(&mut self, before: UnixMs, limit: usize, fx: &mut Effects) -> usize {
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
            fx.changes.push(Change::DeleteJob {
                id,
                queue: job.queue.clone(),
            });
            purged += 1;
        }
        purged
    }

    pub fn queue_counts(&self, queue: &QueueName) -> QueueCounts {
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
    pub fn queues(&self) -> Vec<(QueueName, QueueCounts)> {
        let mut out: Vec<_> = self
            .queues
            .keys()
            .map(|q| (q.clone(), self.queue_counts(q)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// What ending its claimant now would do to `job` (for the reaper's dry run); `None`
    /// unless the job is claimed.
    pub fn job_outcome_if_ended(&self, job: JobId) -> Option<JobOutcome> {
        let j = self.jobs.get(&job)?;
        if !matches!(j.status, JobStatus::Claimed { .. }) {
            return None;
        }
        Some(if j.idempotent && j.recovery_count < j.max_recoveries {
            JobOutcome::Recovered {
                recovery_count: j.recovery_count + 1,
            }
        } else {
            JobOutcome::Failed {
                reason: if j.idempotent {
                    REASON_MAX_RECOVERIES
                } else {
                    REASON_NOT_IDEMPOTENT
                }
                .to_string(),
            }
        })
    }

    /// A job's state as memory has it (the store has the payload and result).
    pub fn job_status(&self, id: JobId) -> Option<&JobStatus> {
        self.jobs.get(&id).map(|j| &j.status)
    }

    pub(super) fn check_jobs(&self) -> Result<(), String> {
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
                JobStatus::Claimed {
                    session_id, token, ..
                } => {
                    if queued {
                        return Err(format!("claimed job {id} is still queued"));
                    }
                    let Some(s) = self.sessions.get(session_id) else {
                        return Err(format!(
                            "job {id} is claimed by missing session {session_id}"
                        ));
                    };
                    if !s.jobs.contains(id) {
                        return Err(format!("job {id} is not in its claimant's list"));
                    }
                    if token.0 > self.revision() {
                        return Err(format!("job {id} has a token above the revision"));
                    }
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
        for (sid, s) in &self.sessions {
            for id in &s.jobs {
                match self.jobs.get(id).map(|j| &j.status) {
                    Some(JobStatus::Claimed { session_id, .. }) if session_id == sid => {}
                    _ => return Err(format!("session {sid} lists job {id} it has not claimed")),
                }
            }
        }
        Ok(())
    }
}
