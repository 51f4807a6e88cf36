//! `/v1/sessions`: open, heartbeat, close, inspect and list sessions.

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Json, Router, routing};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::error::ApiError;
use super::extract::{Body, Query, SessionPath, Whole, metadata, page_limit, session_id, whole};
use super::gate::Caller;
use super::retry;
use super::wire::{Session, ms};
use crate::backend::requests::{Answer, Mutation};
use crate::backend::{BackendError, OpenedSession};
use crate::domain::{EndReason, UnixMs};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sessions", routing::post(open).get(list))
        .route("/v1/sessions/{id}", routing::get(show).delete(close))
        .route("/v1/sessions/{id}/heartbeat", routing::post(heartbeat))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenRequest {
    owner: String,
    ttl_ms: Option<Whole>,
    metadata: Option<serde_json::Value>,
    /// Makes a retry safe: a retry answers the first session instead of opening another.
    request_id: Option<String>,
}

#[derive(Serialize)]
struct OpenResponse {
    session_id: String,
    ttl_ms: u64,
    expires_at: u64,
    revision: u64,
}

async fn open(
    State(app): State<AppState>,
    caller: Caller,
    Body(req): Body<OpenRequest>,
) -> Result<(StatusCode, Json<OpenResponse>), ApiError> {
    let metadata = metadata(req.metadata)?;
    let ttl_ms = whole(req.ttl_ms);
    let request = retry::request(
        &caller,
        req.request_id,
        "session_open",
        "",
        serde_json::json!({ "owner": req.owner, "ttl_ms": ttl_ms, "metadata": metadata }),
    )?;
    let opened = match request {
        None => {
            app.engine
                .open_as(caller.mint(), req.owner, ttl_ms, metadata)
                .await?
        }
        Some(request) => {
            let op = Mutation::Open {
                id: caller.mint(),
                owner: req.owner,
                ttl_ms,
                metadata,
            };
            match app.engine.once(request, op).await? {
                Answer::Opened {
                    session,
                    ttl_ms,
                    expires_at,
                    revision,
                } => OpenedSession {
                    id: session,
                    ttl_ms,
                    expires_at: UnixMs(expires_at),
                    revision,
                },
                _ => return Err(BackendError::RequestIdReused.into()),
            }
        }
    };
    Ok((
        StatusCode::CREATED,
        Json(OpenResponse {
            session_id: opened.id.to_string(),
            ttl_ms: opened.ttl_ms,
            expires_at: ms(opened.expires_at),
            revision: opened.revision,
        }),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HeartbeatRequest {
    ttl_ms: Option<Whole>,
}

#[derive(Serialize)]
pub(super) struct HeartbeatResponse {
    expires_at: u64,
    ttl_ms: u64,
    /// How long, from this answer, the server honours the session at least: the TTL less the
    /// time spent handling the heartbeat (the deadline was set during that time, so it lies at
    /// least this far ahead). A client counting it from its own send time stays on the safe
    /// side of the server's deadline.
    safe_for_ms: u64,
}

pub(super) async fn heartbeat(
    State(app): State<AppState>,
    caller: Caller,
    SessionPath(id): SessionPath,
    Body(req): Body<HeartbeatRequest>,
) -> Result<Json<HeartbeatResponse>, ApiError> {
    caller.act(id)?;
    let started = std::time::Instant::now();
    let beat = app.engine.heartbeat(id, whole(req.ttl_ms)).await?;
    // Rounded up, so that the figure never overstates what is left.
    let spent_ms = started.elapsed().as_micros().div_ceil(1000) as u64;
    Ok(Json(HeartbeatResponse {
        expires_at: ms(beat.expires_at),
        ttl_ms: beat.ttl_ms,
        safe_for_ms: beat.ttl_ms.saturating_sub(spent_ms),
    }))
}

#[derive(Serialize)]
pub struct CloseResponse {
    /// Locks released with the session.
    pub released: usize,
    pub seats_released: usize,
    pub jobs_settled: usize,
    pub revision: u64,
}

/// Ends a session for `reason` through `engine` (acting for an operator for a forced end);
/// shared with the admin route. Its watchers on this node are told at once.
pub async fn end(
    app: &AppState,
    engine: &crate::engine::Engine,
    id: crate::domain::SessionId,
    reason: EndReason,
) -> Result<Json<CloseResponse>, ApiError> {
    let closed = engine.end(id, reason).await?;
    // Its watchers learn of it now, not at the log's next re-check.
    app.watches.prompt();
    Ok(Json(match closed {
        Some(c) => CloseResponse {
            released: c.released,
            seats_released: c.seats,
            jobs_settled: c.jobs,
            revision: c.revision,
        },
        None => CloseResponse {
            released: 0,
            seats_released: 0,
            jobs_settled: 0,
            revision: engine.revision().await?,
        },
    }))
}

async fn close(
    State(app): State<AppState>,
    caller: Caller,
    SessionPath(id): SessionPath,
) -> Result<Json<CloseResponse>, ApiError> {
    caller.act(id)?;
    // A client's close of its own session names nobody: only operator actions do.
    end(&app, &app.engine, id, EndReason::Closed).await
}

async fn show(
    State(app): State<AppState>,
    caller: Caller,
    SessionPath(id): SessionPath,
) -> Result<Json<Session>, ApiError> {
    caller.read_session(id)?;
    match app.engine.session(id).await? {
        Some(info) => Ok(Json(info.into())),
        None => Err(ApiError::SessionGone),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    owner: Option<String>,
    after: Option<String>,
    limit: Option<usize>,
}

#[derive(Serialize)]
struct ListResponse {
    sessions: Vec<Session>,
    next: Option<String>,
}

async fn list(
    State(app): State<AppState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<ListResponse>, ApiError> {
    let limit = page_limit(q.limit, 100, 1_000)?;
    let after = match q.after.as_deref() {
        Some(a) => Some(session_id(a).map_err(|_| {
            ApiError::invalid(
                "after",
                "after must be a session id (the previous page's next)",
            )
        })?),
        None => None,
    };
    let (sessions, next) = app
        .engine
        .sessions(q.owner.as_deref(), after, limit)
        .await?;
    Ok(Json(ListResponse {
        sessions: sessions.into_iter().map(Session::from).collect(),
        next: next.map(|n| n.to_string()),
    }))
}
