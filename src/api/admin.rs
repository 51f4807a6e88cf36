//! `/v1/admin`: operator actions, each audited.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header;
use axum::response::Response;
use axum::{Json, Router, routing};
use serde::{Deserialize, Serialize};

use super::error::ApiError;
use super::extract::{Body, SessionPath, Whole};
use super::gate::Caller;
use super::jobs::JobPath;
use super::sessions::{CloseResponse, end};
use super::wire::HeldLock;
use super::{AppState, acting, audit};
use crate::auth::Scope;
use crate::backend::BackendError;
use crate::domain::{EndReason, JobOutcome};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/admin/sessions/{id}/end", routing::post(end_session))
        .route("/v1/admin/reap", routing::post(reap))
        .route("/v1/admin/jobs/{id}/requeue", routing::post(requeue))
        .route("/v1/admin/tokens/floor", routing::post(raise_token_floor))
        .route("/v1/admin/backup", routing::post(backup))
}

#[derive(Serialize)]
struct RequeueResponse {
    job_id: String,
    state: &'static str,
    revision: u64,
}

/// Sends a failed job back to its queue (recovery count reset), audited as `job_requeued`.
async fn requeue(
    State(app): State<AppState>,
    caller: Caller,
    JobPath(job): JobPath,
) -> Result<Json<RequeueResponse>, ApiError> {
    if let Caller::Token(t) = &caller
        && !t.unscoped()
    {
        // A scoped operator requeues in its own queues only; another's job reads as absent.
        match app.engine.job(job).await? {
            Some((r, _)) if caller.sees(Scope::Queue, &r.queue) => {}
            _ => return Err(ApiError::JobNotFound),
        }
    }
    audit(&caller, "job_requeue", &job);
    let revision = acting(&app, &caller).requeue(job).await?;
    Ok(Json(RequeueResponse {
        job_id: job.to_string(),
        state: "queued",
        revision,
    }))
}

async fn end_session(
    State(app): State<AppState>,
    caller: Caller,
    SessionPath(id): SessionPath,
) -> Result<Json<CloseResponse>, ApiError> {
    caller.unscoped("force-ending a session")?;
    audit(&caller, "session_end", &id);
    end(&app, &acting(&app, &caller), id, EndReason::Admin).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReapRequest {
    /// Absent and `null` both mean false, as for every optional field.
    dry_run: Option<bool>,
}

#[derive(Serialize)]
struct DueSession {
    session_id: String,
    expired_at: u64,
    locks: Vec<HeldLock>,
    /// Pools whose seat would be reclaimed.
    seats: Vec<String>,
    jobs: Vec<DueJob>,
}

#[derive(Serialize)]
struct DueJob {
    job_id: String,
    /// `recover` or `fail`.
    action: &'static str,
    /// For `recover`, the recovery count it would have; for `fail`, why.
    #[serde(skip_serializing_if = "Option::is_none")]
    recovery_count: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum ReapResponse {
    DryRun {
        dry_run: bool,
        sessions: Vec<DueSession>,
    },
    Done {
        dry_run: bool,
        sessions_ended: usize,
        locks_released: usize,
        seats_released: usize,
        jobs_settled: usize,
        revision: u64,
    },
}

/// How many due sessions a dry run lists at most.
const DRY_RUN_LIMIT: usize = 10_000;

async fn reap(
    State(app): State<AppState>,
    caller: Caller,
    Body(req): Body<ReapRequest>,
) -> Result<Json<ReapResponse>, ApiError> {
    caller.unscoped("a reap")?;
    audit(&caller, "reap", &req.dry_run.unwrap_or(false));
    if req.dry_run.unwrap_or(false) {
        let sessions = app
            .engine
            .reap_dry_run(DRY_RUN_LIMIT)
            .await?
            .into_iter()
            .map(|d| DueSession {
                session_id: d.id.to_string(),
                expired_at: d.expired_at.0,
                locks: d
                    .locks
                    .into_iter()
                    .map(|(key, t)| HeldLock { key, token: t.0 })
                    .collect(),
                seats: d.seats,
                jobs: d
                    .jobs
                    .into_iter()
                    .map(|(id, outcome)| match outcome {
                        JobOutcome::Recovered { recovery_count } => DueJob {
                            job_id: id.to_string(),
                            action: "recover",
                            recovery_count: Some(recovery_count),
                            reason: None,
                        },
                        JobOutcome::Failed { reason } => DueJob {
                            job_id: id.to_string(),
                            action: "fail",
                            recovery_count: None,
                            reason: Some(reason),
                        },
                    })
                    .collect(),
            })
            .collect();
        return Ok(Json(ReapResponse::DryRun {
            dry_run: true,
            sessions,
        }));
    }
    let outcome = acting(&app, &caller).reap_now().await?;
    app.watches.prompt();
    Ok(Json(ReapResponse::Done {
        dry_run: false,
        sessions_ended: outcome.sessions,
        locks_released: outcome.locks,
        seats_released: outcome.seats,
        jobs_settled: outcome.jobs,
        revision: app.engine.revision().await?,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FloorRequest {
    floor: Whole,
}

#[derive(Serialize)]
struct FloorResponse {
    floor: u64,
    /// The counter (the highest token issued) before the raise.
    previous: u64,
    /// Whether the counter moved: false when it was already at or above `floor`.
    raised: bool,
    /// The revision of the raise itself; every later token is above it.
    revision: u64,
}

/// Raises the token floor: every token issued after the answer is above `floor`. Audited as
/// `token_floor_raised`.
async fn raise_token_floor(
    State(app): State<AppState>,
    caller: Caller,
    Body(req): Body<FloorRequest>,
) -> Result<Json<FloorResponse>, ApiError> {
    audit(&caller, "token_floor_raise", &req.floor.0);
    let r = acting(&app, &caller).raise_token_floor(req.floor.0).await?;
    Ok(Json(FloorResponse {
        floor: r.floor,
        previous: r.previous,
        raised: r.moved(),
        revision: r.revision,
    }))
}

/// Size of the pieces a backup is sent in.
const BACKUP_CHUNK_BYTES: usize = 256 * 1024;

/// A consistent snapshot of the embedded store as a redb file, streamed. The headers carry
/// what it holds: `leasehold-backup-revision` (every token in it is at most this) and
/// `leasehold-backup-taken-at` (Unix ms).
async fn backup(State(app): State<AppState>, caller: Caller) -> Result<Response, ApiError> {
    audit(&caller, "backup", &"data file");
    let made = app.engine.backup().await?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut file = made.file;
    // Read off the async workers; a client that goes away drops the receiver and ends this.
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        loop {
            let mut buf = vec![0; BACKUP_CHUNK_BYTES];
            let piece = match file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    buf.truncate(n);
                    Ok(Bytes::from(buf))
                }
                Err(e) => Err(e),
            };
            let stop = piece.is_err();
            if tx.blocking_send(piece).is_err() || stop {
                return;
            }
        }
    });
    tracing::info!(
        revision = made.info.revision,
        bytes = made.len,
        rows = made.info.rows,
        "sending a backup"
    );
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, made.len)
        .header("leasehold-backup-revision", made.info.revision)
        .header("leasehold-backup-taken-at", made.info.taken_at.0)
        .body(axum::body::Body::new(Chunks(rx)))
        .map_err(|e| ApiError::Engine(BackendError::Unavailable(e.to_string())))
}

/// A response body of the pieces a blocking reader sends.
struct Chunks(tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>);

impl hyper::body::Body for Chunks {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|piece| piece.map(|r| r.map(hyper::body::Frame::data)))
    }
}
