//! `/v1/locks` and `/v1/fence`: acquire, release, inspect and list locks, and the fencing
//! check a protected resource makes before it accepts a write.

use axum::extract::State;
use axum::{Json, Router, routing};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::error::ApiError;
use super::extract::{Body, KeyPath, Query, Whole, page_limit, session_id, whole};
use super::gate::Caller;
use super::retry;
use super::wire::Lock;
use super::{AppState, wait_slot};
use crate::auth::Scope;
use crate::backend::requests::{Answer, Mutation};
use crate::backend::{BackendError, Granted};
use crate::domain::Token;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/locks", routing::get(list))
        .route("/v1/locks/{key}", routing::get(show))
        .route("/v1/locks/{key}/acquire", routing::post(acquire))
        .route("/v1/locks/{key}/release", routing::post(release))
        .route("/v1/fence/{key}", routing::get(fence))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AcquireRequest {
    session_id: String,
    wait_ms: Option<Whole>,
    /// Makes a retry safe: see `retry`.
    request_id: Option<String>,
}

#[derive(Serialize)]
pub(super) struct AcquireResponse {
    key: String,
    token: u64,
    session_id: String,
    revision: u64,
}

pub(super) async fn acquire(
    State(app): State<AppState>,
    caller: Caller,
    KeyPath(key): KeyPath,
    Body(req): Body<AcquireRequest>,
) -> Result<Json<AcquireResponse>, ApiError> {
    let id = session_id(&req.session_id)?;
    caller.act(id)?;
    let wait_ms = whole(req.wait_ms).unwrap_or(0);
    let request = retry::request(
        &caller,
        req.request_id,
        "lock_acquire",
        key.as_str(),
        json!({ "session_id": id.to_string() }),
    )?;
    let _slot = wait_slot(&app, &caller, wait_ms, "lock", &key)?;
    let granted = match request {
        None => app.engine.acquire(id, key.clone(), wait_ms).await?,
        Some(request) => {
            let op = Mutation::Acquire {
                id,
                key: key.clone(),
                wait_ms,
            };
            match app.engine.once(request, op).await? {
                Answer::Granted { token, revision } => Granted {
                    token: Token(token),
                    revision,
                },
                _ => return Err(BackendError::RequestIdReused.into()),
            }
        }
    };
    Ok(Json(AcquireResponse {
        key: key.to_string(),
        token: granted.token.0,
        session_id: id.to_string(),
        revision: granted.revision,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReleaseRequest {
    session_id: String,
    token: Whole,
    request_id: Option<String>,
}

#[derive(Serialize)]
pub(super) struct ReleaseResponse {
    released: bool,
    revision: u64,
}

pub(super) async fn release(
    State(app): State<AppState>,
    caller: Caller,
    KeyPath(key): KeyPath,
    Body(req): Body<ReleaseRequest>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    let id = session_id(&req.session_id)?;
    caller.act(id)?;
    let request = retry::request(
        &caller,
        req.request_id,
        "lock_release",
        key.as_str(),
        json!({ "session_id": id.to_string(), "token": req.token.0 }),
    )?;
    let revision = match request {
        None => app.engine.release(id, key, Token(req.token.0)).await?,
        Some(request) => {
            let op = Mutation::Release {
                id,
                key,
                token: Token(req.token.0),
            };
            match app.engine.once(request, op).await? {
                Answer::Released { revision } => revision,
                _ => return Err(BackendError::RequestIdReused.into()),
            }
        }
    };
    Ok(Json(ReleaseResponse {
        released: true,
        revision,
    }))
}

async fn show(State(app): State<AppState>, KeyPath(key): KeyPath) -> Result<Json<Lock>, ApiError> {
    match app.engine.lock(&key).await? {
        Some(record) => Ok(Json(Lock::new(key.to_string(), record))),
        None => Err(ApiError::LockFree),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    prefix: Option<String>,
    after: Option<String>,
    limit: Option<usize>,
}

#[derive(Serialize)]
struct ListResponse {
    locks: Vec<Lock>,
    next: Option<String>,
}

async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Query(q): Query<ListQuery>,
) -> Result<Json<ListResponse>, ApiError> {
    let limit = page_limit(q.limit, 100, 1_000)?;
    // A scoped token lists under one of its prefixes, so the filter is the scope check.
    caller.scope(Scope::Key, "prefix", q.prefix.as_deref().unwrap_or(""))?;
    let (rows, next) = app
        .engine
        .locks(q.prefix.as_deref().unwrap_or(""), q.after.as_deref(), limit)
        .await?;
    Ok(Json(ListResponse {
        locks: rows.into_iter().map(|(k, r)| Lock::new(k, r)).collect(),
        next,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FenceQuery {
    token: u64,
}

#[derive(Serialize)]
struct FenceResponse {
    key: String,
    token: u64,
    /// True only while `token` is the token of the key's present, live holder.
    current: bool,
    /// The present holder's token, or null when the key is free.
    latest: Option<u64>,
}

async fn fence(
    State(app): State<AppState>,
    KeyPath(key): KeyPath,
    Query(q): Query<FenceQuery>,
) -> Result<Json<FenceResponse>, ApiError> {
    let f = app.engine.fence(&key, Token(q.token)).await?;
    Ok(Json(FenceResponse {
        key: key.to_string(),
        token: q.token,
        current: f.current,
        latest: f.latest.map(|t| t.0),
    }))
}
