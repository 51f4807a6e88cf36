//! The job rules of the aggregate: who may claim, finish and hand back a job.
//!
//! Only the current claim (this live session with this token) may finish a job; a claim
//! takes a fresh token from the revision; ending the claimant settles its jobs in the same
//! change set — recovered or failed, never lost, never held by two live sessions.

use super::{At, Effects, Gone, RestoreError, State, unlist};
use crate::domain::change::{Change, Event, EventKind, JobRecord, JobStatus};
use crate::domain::ids::{JobId, QueueName, SessionId, Token};
use crate::domain::jobs::{Claim, ClaimGone, Finish, JobError, JobOutcome, NewJob, QueueCounts};
use crate::domain::limits::InvalidInput;
use crate::domain::time::UnixMs;

impl State {
    pub(super) fn restore_jobs(
        &mut self,
        jobs: Vec<(JobId, JobRecord)>,
    ) -> Result<(), RestoreError> {
        for (id, record) in jobs {
            let claim = match &record.status {
                JobStatus::Claimed {
                    session_id, token, ..
                } => Some((*session_id, *token)),
                _ => None,
            };
            self.jobs
                .restore(id, record)
                .map_err(|bad| RestoreError::BadQueue(id, bad.0))?;
            if let Some((session, token)) = claim {
                self.check_token(|| format!("job {id}"), token)?;
                let Some(s) = self.sessions.get_mut(&session) else {
                    return Err(RestoreError::Orphan {
                        what: format!("job {id}"),
                        session,
                    });
                };
                s.jobs.push(id);
            }
        }
        Ok(())
    }

    /// An audit event about job `id`, as the job stands now.
    fn job_event(&mut self, id: JobId, kind: EventKind, at: At) -> Event {
        let mut event = self.event(at.wall, kind);
        self.jobs.describe(id, &mut event);
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
        let queue = new.queue.clone();
        let change = self.jobs.enqueue(id, new, at.wall)?;
        let revision = self.next_revision();
        fx.changes.push(change);
        let event = self.job_event(id, EventKind::JobEnqueued, at);
        fx.changes.push(Change::Event(event));
        fx.ready_queues.push(queue);
        Ok(revision)
    }

    /// Whether `queue` has a job to claim.
    pub fn queue_has_job(&self, queue: &QueueName) -> bool {
        self.jobs.has_queued(queue)
    }

    /// Claims the first queued job of `queue` for session `id`; `None` when there is none.
    pub fn claim(
        &mut self,
        id: SessionId,
        queue: &QueueName,
        at: At,
        fx: &mut Effects,
    ) -> Result<Option<Claim>, ClaimGone> {
        self.live_or_end(id, at, fx).map_err(|Gone| ClaimGone)?;
        if !self.jobs.has_queued(queue) {
            return Ok(None);
        }
        let token = Token(self.next_revision());
        let (claim, change) = self.jobs.claim_next(queue, id, token, at.wall);
        fx.changes.push(change);
        self.sessions
            .get_mut(&id)
            .expect("checked live above")
            .jobs
            .push(claim.job);
        let mut event = self.job_event(claim.job, EventKind::JobClaimed, at);
        event.session_id = Some(id);
        fx.changes.push(Change::Event(event));
        Ok(Some(claim))
    }

    /// Completes, fails or hands back a claimed job. Only the current claim (this live
    /// session with this token) may; anyone else gets `StaleToken` and changes nothing —
    /// a late worker can never finish a job that someone else now holds.
    pub fn finish_job(
        &mut self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
        at: At,
        fx: &mut Effects,
    ) -> Result<u64, JobError> {
        finish.check()?;
        if !self.jobs.contains(job) {
            return Err(JobError::NotFound);
        }
        // A claimant past its deadline is ended inline; its job was settled with it.
        let _ = self.live_or_end(id, at, fx);
        if self.jobs.claimant(job) != Some((id, token)) {
            return Err(JobError::StaleToken);
        }
        if let Some(s) = self.sessions.get_mut(&id) {
            unlist(&mut s.jobs, &job);
        }
        let revision = self.next_revision();
        // The event names the claim that finished it, so it is built before the change.
        let mut event = self.job_event(job, finish.event_kind(), at);
        event.session_id = Some(id);
        if let Finish::Fail { reason } = &finish {
            event.detail = Some(reason.clone());
        }
        let (change, ready) = self.jobs.finish(job, finish, at.wall);
        fx.ready_queues.extend(ready);
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
        for job in jobs {
            debug_assert_eq!(self.jobs.claimant(job).map(|(s, _)| s), Some(id));
            // The event names the claim that ended, so it is described before the change;
            // its kind follows from the outcome.
            let mut event = self.event(at.wall, EventKind::JobRecovered);
            self.jobs.describe(job, &mut event);
            let (outcome, change, ready) = self.jobs.orphan(job, at.wall);
            event.kind = outcome.event_kind();
            if let JobOutcome::Failed { reason } = &outcome {
                event.detail = Some(reason.clone());
            }
            fx.changes.push(change);
            fx.ready_queues.extend(ready);
            event.session_id = Some(id);
            fx.changes.push(Change::Event(event));
            out.push((job, outcome));
        }
        out
    }

    /// Sends a failed job back to the tail of its queue, with its recovery count reset: an
    /// operator's explicit decision to try again.
    pub fn requeue(&mut self, job: JobId, at: At, fx: &mut Effects) -> Result<u64, JobError> {
        let (change, queue) = self.jobs.requeue(job, at.wall)?;
        let revision = self.next_revision();
        fx.changes.push(change);
        let event = self.job_event(job, EventKind::JobRequeued, at);
        fx.changes.push(Change::Event(event));
        fx.ready_queues.push(queue);
        Ok(revision)
    }

    /// Purges up to `limit` jobs that finished before `before`.
    pub fn purge_jobs(&mut self, before: UnixMs, limit: usize, fx: &mut Effects) -> usize {
        self.jobs.purge(before, limit, &mut fx.changes)
    }

    pub fn queue_counts(&self, queue: &QueueName) -> QueueCounts {
        self.jobs.counts(queue)
    }

    /// Every queue with its counts, in name order.
    pub fn queues(&self) -> Vec<(QueueName, QueueCounts)> {
        self.jobs.queues()
    }

    /// What ending its claimant now would do to `job` (for the reaper's dry run); `None`
    /// unless the job is claimed.
    pub fn job_outcome_if_ended(&self, job: JobId) -> Option<JobOutcome> {
        self.jobs.outcome_if_orphaned(job)
    }

    /// A job's state as memory has it (the store has the payload and result).
    pub fn job_status(&self, id: JobId) -> Option<&JobStatus> {
        self.jobs.status(id)
    }

    /// The job table's own invariants, and every claim's claimant is a session that lists
    /// it, with a token at most the revision; every job a session lists is its claim.
    pub(super) fn check_claims(&self) -> Result<(), String> {
        self.jobs.check()?;
        for (job, session, token) in self.jobs.claims() {
            let Some(s) = self.sessions.get(&session) else {
                return Err(format!("job {job} is claimed by missing session {session}"));
            };
            if !s.jobs.contains(&job) {
                return Err(format!("job {job} is not in its claimant's list"));
            }
            if token.0 > self.revision() {
                return Err(format!("job {job} has a token above the revision"));
            }
        }
        for (sid, s) in &self.sessions {
            for job in &s.jobs {
                if self.jobs.claimant(*job).map(|(c, _)| c) != Some(*sid) {
                    return Err(format!("session {sid} lists job {job} it has not claimed"));
                }
            }
        }
        Ok(())
    }
}
