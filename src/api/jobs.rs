//! `/v1/queues` and `/v1/jobs`: job leases — enqueue, claim, finish or hand back, inspect,
//! and list dead letters.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::error::ApiError;
use super::extract::{Body, KeyPath, Query, Whole, page_limit, session_id, whole};
use super::gate::Caller;
use super::retry;
use super::wire::json_or_null;
use super::{AppState, wait_slot};
use crate::auth::Scope;
use crate::backend::BackendError;
use crate::backend::requests::{Answer, Mutation};
use crate::domain::{Finish, JobId, JobRecord, JobStatus, NewJob, Token};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/queues/{queue}", routing::get(queue))
        .route("/v1/queues/{queue}/jobs", routing::post(enqueue).get(list))
        .route("/v1/queues/{queue}/claim", routing::post(claim))
        .route("/v1/jobs/{id}", routing::get(show))
        .route("/v1/jobs/{id}/complete", routing::post(complete))
        .route("/v1/jobs/{id}/fail", routing::post(fail))
        .route("/v1/jobs/{id}/release", routing::post(release))
}

/// The `{id}` of a job route.
pub struct JobPath(pub JobId);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for JobPath {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        let text = super::extract::first_segment(parts, state).await?;
        Ok(JobPath(JobId::parse("job_id", &text)?))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnqueueRequest {
    payload: serde_json::Value,
    idempotent: Option<bool>,
    max_recoveries: Option<Whole>,
    kind: Option<String>,
    /// Makes a retry safe: see `retry`.
    request_id: Option<String>,
}

/// A recovery budget beyond `u32` is refused here; the domain's own ceiling applies after.
fn max_recoveries(v: Option<Whole>) -> Result<Option<u32>, ApiError> {
    whole(v)
        .map(|n| {
            u32::try_from(n).map_err(|_| {
                ApiError::invalid(
                    "max_recoveries",
                    "max_recoveries must be a whole number from 0 to 4294967295",
                )
            })
        })
        .transpose()
}

#[derive(Serialize)]
struct EnqueueResponse {
    job_id: String,
    queue: String,
    revision: u64,
}

async fn enqueue(
    State(app): State<AppState>,
    caller: Caller,
    KeyPath(queue): KeyPath,
    Body(req): Body<EnqueueRequest>,
) -> Result<(StatusCode, Json<EnqueueResponse>), ApiError> {
    let job = NewJob {
        queue: queue.clone(),
        payload: req.payload.to_string(),
        idempotent: req.idempotent.unwrap_or(false),
        max_recoveries: max_recoveries(req.max_recoveries)?,
        kind: req.kind,
    };
    let request = retry::request(
        &caller,
        req.request_id,
        "job_enqueue",
        queue.as_str(),
        serde_json::json!({
            "payload": job.payload,
            "idempotent": job.idempotent,
            "max_recoveries": job.max_recoveries,
            "kind": job.kind,
        }),
    )?;
    let (id, revision) = match request {
        None => app.engine.enqueue(job).await?,
        Some(request) => match app.engine.once(request, Mutation::Enqueue(job)).await? {
            Answer::Enqueued { job, revision } => (job, revision),
            _ => return Err(BackendError::RequestIdReused.into()),
        },
    };
    Ok((
        StatusCode::CREATED,
        Json(EnqueueResponse {
            job_id: id.to_string(),
            queue: queue.to_string(),
            revision,
        }),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimRequest {
    session_id: String,
    wait_ms: Option<Whole>,
    request_id: Option<String>,
}

#[derive(Serialize)]
struct ClaimResponse {
    job_id: String,
    queue: String,
    token: u64,
    payload: serde_json::Value,
    attempt: u32,
    recovery_count: u32,
    kind: Option<String>,
    revision: u64,
}

async fn claim(
    State(app): State<AppState>,
    caller: Caller,
    KeyPath(queue): KeyPath,
    Body(req): Body<ClaimRequest>,
) -> Result<Response, ApiError> {
    let id = session_id(&req.session_id)?;
    caller.act(id)?;
    let wait_ms = whole(req.wait_ms).unwrap_or(0);
    let request = retry::request(
        &caller,
        req.request_id,
        "job_claim",
        queue.as_str(),
        serde_json::json!({ "session_id": id.to_string() }),
    )?;
    let _slot = wait_slot(&app, &caller, wait_ms, "queue", &queue)?;
    let claimed = match request {
        None => app.engine.claim(id, queue.clone(), wait_ms).await?,
        Some(request) => {
            let op = Mutation::Claim {
                id,
                queue: queue.clone(),
                wait_ms,
            };
            match app.engine.once(request, op).await? {
                Answer::NoJob => None,
                answer => Some(answer.claimed().ok_or(BackendError::RequestIdReused)?),
            }
        }
    };
    let Some(c) = claimed else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    // The claim is committed, and so is the job's payload: it was written at enqueue.
    let payload = app
        .engine
        .job(c.job)
        .await?
        .map(|(_, p)| json_or_null(&p))
        .unwrap_or(serde_json::Value::Null);
    Ok(Json(ClaimResponse {
        job_id: c.job.to_string(),
        queue: queue.to_string(),
        token: c.token.0,
        payload,
        attempt: c.attempt,
        recovery_count: c.recovery_count,
        kind: (!c.kind.is_empty()).then_some(c.kind),
        revision: c.revision,
    })
    .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompleteRequest {
    session_id: String,
    token: Whole,
    result: Option<serde_json::Value>,
    request_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FailRequest {
    session_id: String,
    token: Whole,
    reason: Option<String>,
    request_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseRequest {
    session_id: String,
    token: Whole,
    request_id: Option<String>,
}

#[derive(Serialize)]
struct FinishResponse {
    job_id: String,
    state: &'static str,
    revision: u64,
}

/// Finishes or hands back `job` for its claim (`session`, `token`); with a request id, a
/// retry answers the first answer (`route` and `asked` fingerprint the call).
async fn finish(
    app: &AppState,
    caller: &Caller,
    job: JobId,
    (session, token): (&str, u64),
    how: Finish,
    request_id: Option<String>,
) -> Result<Json<FinishResponse>, ApiError> {
    let id = session_id(session)?;
    caller.act(id)?;
    let (state, route, asked) = match &how {
        Finish::Complete { result } => ("done", "job_complete", json!({ "result": result })),
        Finish::Fail { reason } => ("failed", "job_fail", json!({ "reason": reason })),
        Finish::Release => ("queued", "job_release", json!({})),
    };
    let asked = json!({ "session_id": id.to_string(), "token": token, "asked": asked });
    let request = retry::request(caller, request_id, route, &job.to_string(), asked)?;
    let token = Token(token);
    let revision = match request {
        None => app.engine.finish_job(id, job, token, how).await?,
        Some(request) => {
            let op = Mutation::Finish {
                id,
                job,
                token,
                finish: how,
            };
            match app.engine.once(request, op).await? {
                Answer::Finished { revision } => revision,
                _ => return Err(BackendError::RequestIdReused.into()),
            }
        }
    };
    Ok(Json(FinishResponse {
        job_id: job.to_string(),
        state,
        revision,
    }))
}

async fn complete(
    State(app): State<AppState>,
    caller: Caller,
    JobPath(job): JobPath,
    Body(req): Body<CompleteRequest>,
) -> Result<Json<FinishResponse>, ApiError> {
    let result = req.result.map(|r| r.to_string()).unwrap_or_default();
    let claim = (req.session_id.as_str(), req.token.0);
    let how = Finish::Complete { result };
    finish(&app, &caller, job, claim, how, req.request_id).await
}

async fn fail(
    State(app): State<AppState>,
    caller: Caller,
    JobPath(job): JobPath,
    Body(req): Body<FailRequest>,
) -> Result<Json<FinishResponse>, ApiError> {
    let reason = req.reason.unwrap_or_else(|| "failed by worker".into());
    let claim = (req.session_id.as_str(), req.token.0);
    let how = Finish::Fail { reason };
    finish(&app, &caller, job, claim, how, req.request_id).await
}

async fn release(
    State(app): State<AppState>,
    caller: Caller,
    JobPath(job): JobPath,
    Body(req): Body<ReleaseRequest>,
) -> Result<Json<FinishResponse>, ApiError> {
    let claim = (req.session_id.as_str(), req.token.0);
    finish(&app, &caller, job, claim, Finish::Release, req.request_id).await
}

#[derive(Serialize)]
pub struct Job {
    job_id: String,
    queue: String,
    state: &'static str,
    kind: Option<String>,
    idempotent: bool,
    attempt: u32,
    recovery_count: u32,
    max_recoveries: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    claimed_by: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    claimed_at: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    failure_reason: Option<String>,
    enqueued_at: u64,
    updated_at: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<serde_json::Value>,
}

pub fn job_json(id: JobId, r: JobRecord, payload: Option<&str>) -> Job {
    let mut job = Job {
        job_id: id.to_string(),
        state: r.status.name(),
        queue: r.queue,
        kind: (!r.kind.is_empty()).then_some(r.kind),
        idempotent: r.idempotent,
        attempt: r.attempt,
        recovery_count: r.recovery_count,
        max_recoveries: r.max_recoveries,
        claimed_by: None,
        token: None,
        claimed_at: None,
        result: None,
        failure_reason: None,
        enqueued_at: r.enqueued_at.0,
        updated_at: r.updated_at.0,
        payload: payload.map(json_or_null),
    };
    match r.status {
        JobStatus::Queued => {}
        JobStatus::Claimed {
            session_id,
            token,
            claimed_at,
        } => {
            job.claimed_by = Some(session_id.to_string());
            job.token = Some(token.0);
            job.claimed_at = Some(claimed_at.0);
        }
        JobStatus::Done { result } => job.result = Some(json_or_null(&result)),
        JobStatus::Failed { reason } => job.failure_reason = Some(reason),
    }
    job
}

async fn show(
    State(app): State<AppState>,
    caller: Caller,
    JobPath(id): JobPath,
) -> Result<Json<Job>, ApiError> {
    let (record, payload) = app
        .engine
        .job(id)
        .await?
        // A job in a queue outside the token's scopes reads as absent: ids are no oracle.
        .filter(|(r, _)| caller.sees(Scope::Queue, &r.queue))
        .ok_or(ApiError::JobNotFound)?;
    Ok(Json(job_json(id, record, Some(&payload))))
}

#[derive(Serialize)]
struct QueueResponse {
    queue: String,
    queued: u64,
    claimed: u64,
    done: u64,
    failed: u64,
    waiting: usize,
}

async fn queue(
    State(app): State<AppState>,
    KeyPath(queue): KeyPath,
) -> Result<Json<QueueResponse>, ApiError> {
    let info = app.engine.queue(&queue).await?;
    Ok(Json(QueueResponse {
        queue: queue.to_string(),
        queued: info.counts.queued,
        claimed: info.counts.claimed,
        done: info.counts.done,
        failed: info.counts.failed,
        waiting: info.waiting,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    state: Option<String>,
    after: Option<String>,
    limit: Option<usize>,
}

#[derive(Serialize)]
struct ListResponse {
    jobs: Vec<Job>,
    next: Option<String>,
}

async fn list(
    State(app): State<AppState>,
    KeyPath(queue): KeyPath,
    Query(q): Query<ListQuery>,
) -> Result<Json<ListResponse>, ApiError> {
    let limit = page_limit(q.limit, 100, 1_000)?;
    let state = match q.state.as_deref().unwrap_or("failed") {
        "queued" => JobStatus::Queued,
        "claimed" => JobStatus::Claimed {
            session_id: crate::domain::SessionId::from_u128(0),
            token: Token(0),
            claimed_at: crate::domain::UnixMs(0),
        },
        "done" => JobStatus::Done {
            result: String::new(),
        },
        "failed" => JobStatus::Failed {
            reason: String::new(),
        },
        other => {
            return Err(ApiError::invalid(
                "state",
                format!("state must be queued, claimed, done or failed, not {other:?}"),
            ));
        }
    };
    let after = match q.after.as_deref() {
        Some(a) => Some(
            JobId::parse("after", a)
                .map_err(|_| ApiError::invalid("after", "after must be a job id"))?,
        ),
        None => None,
    };
    let (rows, next) = app.engine.queue_jobs(&queue, &state, after, limit).await?;
    Ok(Json(ListResponse {
        jobs: rows
            .into_iter()
            .map(|(id, r)| job_json(id, r, None))
            .collect(),
        next: next.map(|n| n.to_string()),
    }))
}
