//! Job leases: enqueue, claim (the oldest queued job, `FOR UPDATE SKIP LOCKED`), finish or
//! hand back (only the current claim), requeue of failed jobs, and the reads. Recovery and
//! failure of the jobs of an ending session are in the end statement (`sessions`).

use tokio_postgres::Row;
use uuid::Uuid;

use super::sessions::END_EXPIRED_ONE;
use super::{Fail, Postgres, transact};
use crate::backend::requests::{Answer, Request};
use crate::backend::waiting::{Resource, Step};
use crate::backend::{BackendError, Claimed, JobPage, QueueInfo, Result};
use crate::domain::{
    Finish, JobId, JobRecord, JobStatus, NewJob, QueueCounts, QueueName, SessionId, Token, UnixMs,
};

pub(super) const ENQUEUE: &str = "
WITH r AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision),
j AS (
    INSERT INTO {ns}.job (id, queue, kind, payload, idempotent, max_recoveries, ord, status)
    VALUES ($1, $2, $3, $4::text::json, $5, $6, nextval('{ns}.job_tail'), 'queued')
),
e AS (INSERT INTO {ns}.event (kind, job_id, queue) VALUES ('job_enqueued', $1, $2))
SELECT revision FROM r";

const LIVE_SHARE: &str =
    "SELECT expires_at > {ns}.db_now() FROM {ns}.session WHERE id = $1 FOR KEY SHARE";

/// Claims the first queued job of $1 for $2. The job row is locked (skipping rows other
/// claimants hold) before its token is drawn.
const CLAIM: &str = "
WITH next AS MATERIALIZED (
    SELECT id FROM {ns}.job WHERE queue = $1 AND status = 'queued'
    ORDER BY ord LIMIT 1 FOR UPDATE SKIP LOCKED
),
c AS (
    UPDATE {ns}.job t SET status = 'claimed', claim_session = $2,
        token = nextval('{ns}.revision'), claimed_at = {ns}.db_now(),
        attempt = t.attempt + 1, updated_at = {ns}.db_now()
    FROM next WHERE t.id = next.id
    RETURNING t.id, t.token, t.attempt, t.recovery_count, t.kind, t.queue
),
e AS (
    INSERT INTO {ns}.event (kind, session_id, job_id, queue, token)
    SELECT 'job_claimed', $2, id, queue, token FROM c
)
SELECT id, token, attempt, recovery_count, kind FROM c";

const ANY_QUEUED: &str = "SELECT 1 FROM {ns}.job WHERE queue = $1 AND status = 'queued' LIMIT 1";

const JOB_EXISTS: &str = "SELECT 1 FROM {ns}.job WHERE id = $1";

const JOB_FOR_UPDATE: &str =
    "SELECT status, claim_session, token, queue::text FROM {ns}.job WHERE id = $1 FOR UPDATE";

/// Completes ($2 `done`, result $3), fails ($2 `failed`, reason $4) or hands back ($2
/// `queued`, to the head of the queue) job $1; event $5 names the claim ($6, its token).
const FINISH: &str = "
WITH r AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision),
u AS (
    UPDATE {ns}.job SET status = $2,
        result = CASE WHEN $2 = 'done' THEN $3::text::json END,
        reason = CASE WHEN $2 = 'failed' THEN $4::text END,
        ord = CASE WHEN $2 = 'queued' THEN -nextval('{ns}.job_head') ELSE ord END,
        claim_session = NULL, claimed_at = NULL, updated_at = {ns}.db_now()
    WHERE id = $1
    RETURNING queue, token
),
e AS (
    INSERT INTO {ns}.event (kind, session_id, job_id, queue, token, detail)
    SELECT $5, $6, $1, queue, token, $4::text FROM u
)
SELECT revision FROM r";

const REQUEUE: &str = "
WITH r AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision),
u AS (
    UPDATE {ns}.job SET status = 'queued', ord = nextval('{ns}.job_tail'),
        recovery_count = 0, reason = NULL, updated_at = {ns}.db_now()
    WHERE id = $1
    RETURNING queue
),
e AS (
    INSERT INTO {ns}.event (kind, job_id, queue, actor)
    SELECT 'job_requeued', $1, queue, $2::text FROM u
)
SELECT r.revision, u.queue::text FROM r, u";

const RECORD_COLUMNS: &str = "
SELECT queue::text, kind, idempotent, max_recoveries, recovery_count, attempt, ord, status,
       claim_session, token, {ns}.ms(claimed_at), coalesce(result::text, ''),
       coalesce(reason, ''), {ns}.ms(enqueued_at), {ns}.ms(updated_at), id";

static JOB: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!("{RECORD_COLUMNS}, payload::text FROM {{ns}}.job WHERE id = $1")
});

static JOBS_IN_STATE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{RECORD_COLUMNS} FROM {{ns}}.job WHERE queue = $1 AND status = $2 AND id > $3
         ORDER BY id LIMIT $4"
    )
});

const COUNTS: &str = "SELECT status, count(*) FROM {ns}.job WHERE queue = $1 GROUP BY status";

const ALL_COUNTS: &str =
    "SELECT queue::text, status, count(*) FROM {ns}.job GROUP BY queue, status ORDER BY queue";

fn record(r: &Row) -> (JobId, JobRecord) {
    let status: String = r.get(7);
    let status = match status.as_str() {
        "queued" => JobStatus::Queued,
        "claimed" => JobStatus::Claimed {
            session_id: SessionId(r.get::<_, Option<Uuid>>(8).unwrap_or_default()),
            token: Token(r.get::<_, Option<i64>>(9).unwrap_or_default() as u64),
            claimed_at: UnixMs(r.get::<_, Option<i64>>(10).unwrap_or_default() as u64),
        },
        "done" => JobStatus::Done { result: r.get(11) },
        _ => JobStatus::Failed { reason: r.get(12) },
    };
    (
        JobId(r.get(15)),
        JobRecord {
            queue: r.get(0),
            kind: r.get(1),
            idempotent: r.get(2),
            max_recoveries: r.get::<_, i32>(3) as u32,
            recovery_count: r.get::<_, i32>(4) as u32,
            attempt: r.get::<_, i32>(5) as u32,
            order: r.get(6),
            status,
            enqueued_at: UnixMs(r.get::<_, i64>(13) as u64),
            updated_at: UnixMs(r.get::<_, i64>(14) as u64),
        },
    )
}

fn add(counts: &mut QueueCounts, status: &str, n: i64) {
    let n = n as u64;
    match status {
        "queued" => counts.queued += n,
        "claimed" => counts.claimed += n,
        "done" => counts.done += n,
        _ => counts.failed += n,
    }
}

enum Finished {
    Done(u64, String),
    NotFound,
    Stale,
    /// The first answer of a call with the same request id.
    Replay(Answer),
}

impl Postgres {
    pub async fn enqueue(&self, job: NewJob) -> Result<(JobId, u64)> {
        let (max_recoveries, kind) = job.checked()?;
        let id = JobId::random();
        let row = self
            .query_opt(
                ENQUEUE,
                &[
                    &id.0,
                    &job.queue.as_str(),
                    &kind,
                    &job.payload,
                    &job.idempotent,
                    &(max_recoveries as i32),
                ],
                false,
            )
            .await?
            .ok_or_else(|| BackendError::Unavailable("the enqueue returned nothing".into()))?;
        self.gauge_queue(job.queue.as_str(), "queued", 1);
        let freed = Resource::Queue(job.queue);
        self.announce(std::slice::from_ref(&freed), false);
        self.waiting().wake(&freed);
        Ok((id, row.get::<_, i64>(0) as u64))
    }

    pub async fn claim(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
    ) -> Result<Option<Claimed>> {
        self.claim_once(id, queue, wait_ms, None).await
    }

    /// A claim, with a request id if `request` is given: a replay answers the job first
    /// claimed, and is not counted again.
    pub(super) async fn claim_once(
        &self,
        id: SessionId,
        queue: QueueName,
        wait_ms: u64,
        request: Option<&Request>,
    ) -> Result<Option<Claimed>> {
        let deadline = self.wait_deadline(wait_ms);
        let claimed = self
            .waiting()
            .claim(queue.clone(), deadline, &self.inner.metrics, |may_take| {
                self.try_claim(id, &queue, may_take, request)
            })
            .await?;
        Ok(match claimed {
            Some((c, false)) => {
                self.gauge_queue(queue.as_str(), "queued", -1);
                self.gauge_queue(queue.as_str(), "claimed", 1);
                Some(c)
            }
            Some((c, true)) => {
                self.inner.metrics.request_id_replays.inc();
                Some(c)
            }
            None => None,
        })
    }

    /// One claim attempt; a claim found in the request id's record is `(claim, true)`.
    async fn try_claim(
        &self,
        id: SessionId,
        queue: &QueueName,
        may_take: bool,
        request: Option<&Request>,
    ) -> Result<Step<(Claimed, bool), ()>> {
        let (claimed, replay) = transact!(self, |tx, after| {
            let replay = self.begin_request(&tx, request).await?;
            let live = match replay {
                Some(_) => None,
                None => self.q_one(&tx, LIVE_SHARE, &[&id.0]).await?,
            };
            let claimed = match live {
                _ if replay.is_some() => Ok(Ok(None)),
                None => Err(BackendError::SessionGone),
                Some(r) if !r.get::<_, bool>(0) => {
                    self.end_in(&tx, &mut after, &END_EXPIRED_ONE, &[&id.0])
                        .await?;
                    Err(BackendError::SessionGone)
                }
                Some(_) if !may_take => {
                    let any = self.q_one(&tx, ANY_QUEUED, &[&queue.as_str()]).await?;
                    Ok(Err(any.is_some()))
                }
                Some(_) => Ok(Ok(self
                    .q_one(&tx, CLAIM, &[&queue.as_str(), &id.0])
                    .await?
                    .map(|r| {
                        let token = r.get::<_, i64>(1) as u64;
                        Claimed {
                            job: JobId(r.get(0)),
                            token: Token(token),
                            attempt: r.get::<_, i32>(2) as u32,
                            recovery_count: r.get::<_, i32>(3) as u32,
                            kind: r.get(4),
                            revision: token,
                        }
                    }))),
            };
            if replay.is_none() {
                let answer = match &claimed {
                    Ok(Ok(Some(c))) => Some(Answer::from(c)),
                    _ => None,
                };
                self.settle_request(&tx, request, answer.as_ref()).await?;
            }
            (claimed, replay)
        })?;
        if let Some(a) = replay {
            let c = a.claimed().ok_or(BackendError::RequestIdReused)?;
            return Ok(Step::Done((c, true)));
        }
        Ok(match claimed? {
            Ok(Some(c)) => Step::Done((c, false)),
            Ok(None) | Err(false) => Step::Busy(()),
            // Jobs are there, but others wait ahead of the caller.
            Err(true) => Step::Room(()),
        })
    }

    /// Only the current claim (this live session with this token) may finish a job; anyone
    /// else gets `StaleToken` and changes nothing. A claimant past its deadline is ended
    /// first, which settles the job, so it too gets `StaleToken`.
    pub async fn finish_job(
        &self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
    ) -> Result<u64> {
        self.finish_once(id, job, token, finish, None).await
    }

    /// A finish, with a request id if `request` is given: a replay answers the first
    /// revision, and is not counted again.
    pub(super) async fn finish_once(
        &self,
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
        request: Option<&Request>,
    ) -> Result<u64> {
        finish.check()?;
        let (status, result, reason, kind) = match &finish {
            Finish::Complete { result } => (
                "done",
                (!result.is_empty()).then_some(result.as_str()),
                None,
                "job_completed",
            ),
            Finish::Fail { reason } => ("failed", None, Some(reason.as_str()), "job_failed"),
            Finish::Release => ("queued", None, None, "job_released"),
        };
        let outcome = transact!(self, |tx, after| {
            let replay = self.begin_request(&tx, request).await?;
            let outcome = if let Some(a) = replay {
                Finished::Replay(a)
            } else if self.q_one(&tx, JOB_EXISTS, &[&job.0]).await?.is_none() {
                Finished::NotFound
            } else {
                // The session row before the job row: the order the end statement takes them.
                if let Some(r) = self.q_one(&tx, LIVE_SHARE, &[&id.0]).await?
                    && !r.get::<_, bool>(0)
                {
                    self.end_in(&tx, &mut after, &END_EXPIRED_ONE, &[&id.0])
                        .await?;
                }
                let current = self.q_one(&tx, JOB_FOR_UPDATE, &[&job.0]).await?;
                let is_claim = current.as_ref().is_some_and(|r| {
                    r.get::<_, String>(0) == "claimed"
                        && r.get::<_, Option<Uuid>>(1) == Some(id.0)
                        && r.get::<_, Option<i64>>(2) == Some(token.0 as i64)
                });
                if !is_claim {
                    Finished::Stale
                } else {
                    let row = self
                        .q_one(
                            &tx,
                            FINISH,
                            &[&job.0, &status, &result, &reason, &kind, &id.0],
                        )
                        .await?
                        .ok_or(Fail::Answer(BackendError::Unavailable(
                            "the job update returned nothing".into(),
                        )))?;
                    if status == "queued"
                        && let Some(q) = current
                            .as_ref()
                            .and_then(|r| QueueName::parse("queue", &r.get::<_, String>(3)).ok())
                    {
                        after.freed.push(Resource::Queue(q));
                    }
                    let queue = current.map(|r| r.get::<_, String>(3)).unwrap_or_default();
                    Finished::Done(row.get::<_, i64>(0) as u64, queue)
                }
            };
            match &outcome {
                Finished::Replay(_) => {}
                Finished::Done(revision, _) => {
                    let a = Answer::Finished {
                        revision: *revision,
                    };
                    self.settle_request(&tx, request, Some(&a)).await?;
                }
                Finished::NotFound | Finished::Stale => {
                    self.settle_request(&tx, request, None).await?;
                }
            }
            outcome
        })?;
        match outcome {
            Finished::Replay(Answer::Finished { revision }) => {
                self.inner.metrics.request_id_replays.inc();
                Ok(revision)
            }
            Finished::Replay(_) => Err(BackendError::RequestIdReused),
            Finished::NotFound => Err(BackendError::JobNotFound),
            Finished::Stale => Err(BackendError::StaleToken),
            Finished::Done(revision, queue) => {
                self.gauge_queue(&queue, "claimed", -1);
                self.gauge_queue(&queue, status, 1);
                if status == "failed" {
                    self.inner
                        .metrics
                        .jobs_failed
                        .get_or_create(&crate::metrics::ReasonLabel {
                            reason: "worker".into(),
                        })
                        .inc();
                }
                Ok(revision)
            }
        }
    }

    /// Sends a failed job back to the tail of its queue with its recovery count reset.
    pub async fn requeue(&self, job: JobId) -> Result<u64> {
        let r = transact!(self, |tx, after| {
            match self.q_one(&tx, JOB_FOR_UPDATE, &[&job.0]).await? {
                None => Err(BackendError::JobNotFound),
                Some(r) if r.get::<_, String>(0) != "failed" => Err(BackendError::JobNotFailed),
                Some(_) => {
                    let row = self
                        .q_one(&tx, REQUEUE, &[&job.0, &self.actor()])
                        .await?
                        .ok_or(Fail::Answer(BackendError::Unavailable(
                            "the requeue returned nothing".into(),
                        )))?;
                    let queue: String = row.get(1);
                    if let Ok(q) = QueueName::parse("queue", &queue) {
                        after.freed.push(Resource::Queue(q));
                    }
                    Ok((row.get::<_, i64>(0) as u64, queue))
                }
            }
        })?;
        let (revision, queue) = r?;
        self.gauge_queue(&queue, "failed", -1);
        self.gauge_queue(&queue, "queued", 1);
        Ok(revision)
    }

    pub async fn job(&self, id: JobId) -> Result<Option<(JobRecord, String)>> {
        Ok(self
            .query_opt(JOB.as_str(), &[&id.0], true)
            .await?
            .map(|r| (record(&r).1, r.get(16))))
    }

    pub async fn queue(&self, name: &QueueName) -> Result<QueueInfo> {
        let mut counts = QueueCounts::default();
        for r in self.query(COUNTS, &[&name.as_str()], true).await? {
            add(&mut counts, r.get(0), r.get(1));
        }
        Ok(QueueInfo {
            counts,
            waiting: self.waiting().waiting(&Resource::Queue(name.clone())),
        })
    }

    pub(crate) async fn all_queue_counts(&self) -> Result<Vec<(String, QueueCounts)>> {
        let mut out: Vec<(String, QueueCounts)> = Vec::new();
        for r in self.query(ALL_COUNTS, &[], true).await? {
            let queue: String = r.get(0);
            if out.last().is_none_or(|(q, _)| *q != queue) {
                out.push((queue, QueueCounts::default()));
            }
            let last = out.last_mut().expect("pushed above");
            add(&mut last.1, r.get(1), r.get(2));
        }
        Ok(out)
    }

    pub async fn queue_jobs(
        &self,
        queue: &QueueName,
        state: &JobStatus,
        after: Option<JobId>,
        limit: usize,
    ) -> Result<JobPage> {
        let after = after.map_or(Uuid::nil(), |a| a.0);
        let rows = self
            .query(
                JOBS_IN_STATE.as_str(),
                &[
                    &queue.as_str(),
                    &state.name(),
                    &after,
                    &((limit + 1) as i64),
                ],
                true,
            )
            .await?;
        let mut page: Vec<(JobId, JobRecord)> = rows.iter().map(record).collect();
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|(id, _)| *id)
        } else {
            None
        };
        Ok((page, next))
    }
}
