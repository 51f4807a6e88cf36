//! `/v1/pools`: seat pools for floating licences — create or resize, inspect, delete, and
//! take or give back a seat.

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Json, Router, routing};
use serde::{Deserialize, Serialize};

use super::error::ApiError;
use super::extract::{Body, KeyPath, Whole, metadata, session_id, whole};
use super::gate::Caller;
use super::retry;
use super::wire::json_or_null;
use super::{AppState, acting, audit, wait_slot};
use crate::auth::Scope;
use crate::backend::BackendError;
use crate::backend::requests::{Answer, Mutation};
use crate::domain::Token;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/pools", routing::get(list))
        .route(
            "/v1/pools/{pool}",
            routing::put(put).get(show).delete(delete),
        )
        .route("/v1/pools/{pool}/acquire", routing::post(acquire))
        .route("/v1/pools/{pool}/release", routing::post(release))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutRequest {
    capacity: Whole,
    metadata: Option<serde_json::Value>,
}

#[derive(Serialize)]
struct PutResponse {
    pool: String,
    capacity: u64,
    created: bool,
    revision: u64,
}

async fn put(
    State(app): State<AppState>,
    caller: Caller,
    KeyPath(pool): KeyPath,
    Body(req): Body<PutRequest>,
) -> Result<(StatusCode, Json<PutResponse>), ApiError> {
    let metadata = metadata(req.metadata)?;
    audit(&caller, "pool_put", &pool);
    let put = acting(&app, &caller)
        .put_pool(pool.clone(), req.capacity.0, metadata)
        .await?;
    let status = if put.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(PutResponse {
            pool: pool.to_string(),
            capacity: req.capacity.0,
            created: put.created,
            revision: put.revision,
        }),
    ))
}

#[derive(Serialize)]
struct Holder {
    session_id: String,
    owner: String,
    seat_token: u64,
    acquired_at: u64,
    /// Null when the holder is past its deadline and about to be reclaimed.
    last_heartbeat_at: Option<u64>,
    /// `active`, `grace`, or `expired` (past its deadline, not yet reclaimed).
    state: &'static str,
    metadata: serde_json::Value,
}

#[derive(Serialize)]
struct PoolResponse {
    pool: String,
    capacity: u32,
    in_use: usize,
    waiting: usize,
    created_at: u64,
    metadata: serde_json::Value,
    holders: Vec<Holder>,
}

async fn show(
    State(app): State<AppState>,
    KeyPath(pool): KeyPath,
) -> Result<Json<PoolResponse>, ApiError> {
    let info = app
        .engine
        .pool(&pool)
        .await?
        .ok_or(ApiError::PoolNotFound)?;
    Ok(Json(PoolResponse {
        pool: pool.to_string(),
        capacity: info.capacity,
        in_use: info.in_use,
        waiting: info.waiting,
        created_at: info.created_at.0,
        metadata: json_or_null(&info.metadata),
        holders: info
            .holders
            .into_iter()
            .map(|h| Holder {
                session_id: h.session_id.to_string(),
                owner: h.owner,
                seat_token: h.seat.token.0,
                acquired_at: h.seat.acquired_at.0,
                last_heartbeat_at: h.last_heartbeat_at.map(|t| t.0),
                state: match h.grace {
                    Some(false) => "active",
                    Some(true) => "grace",
                    None => "expired",
                },
                metadata: json_or_null(&h.seat.metadata),
            })
            .collect(),
    }))
}

#[derive(Serialize)]
struct PoolSummary {
    pool: String,
    capacity: u32,
    in_use: usize,
}

#[derive(Serialize)]
struct ListResponse {
    pools: Vec<PoolSummary>,
}

async fn list(State(app): State<AppState>, caller: Caller) -> Result<Json<ListResponse>, ApiError> {
    Ok(Json(ListResponse {
        pools: app
            .engine
            .pools()
            .await?
            .into_iter()
            // A scoped token sees the pools under its prefixes only.
            .filter(|(pool, _, _)| caller.sees(Scope::Pool, pool))
            .map(|(pool, capacity, in_use)| PoolSummary {
                pool,
                capacity,
                in_use,
            })
            .collect(),
    }))
}

#[derive(Serialize)]
struct DeleteResponse {
    deleted: bool,
    revision: u64,
}

async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    KeyPath(pool): KeyPath,
) -> Result<Json<DeleteResponse>, ApiError> {
    audit(&caller, "pool_delete", &pool);
    let revision = acting(&app, &caller).delete_pool(pool).await?;
    Ok(Json(DeleteResponse {
        deleted: true,
        revision,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AcquireRequest {
    session_id: String,
    wait_ms: Option<Whole>,
    metadata: Option<serde_json::Value>,
    /// Makes a retry safe: see `retry`.
    request_id: Option<String>,
}

#[derive(Serialize)]
struct AcquireResponse {
    pool: String,
    seat_token: u64,
    session_id: String,
    revision: u64,
}

async fn acquire(
    State(app): State<AppState>,
    caller: Caller,
    KeyPath(pool): KeyPath,
    Body(req): Body<AcquireRequest>,
) -> Result<Json<AcquireResponse>, ApiError> {
    let id = session_id(&req.session_id)?;
    caller.act(id)?;
    let metadata = metadata(req.metadata)?;
    let wait_ms = whole(req.wait_ms).unwrap_or(0);
    let request = retry::request(
        &caller,
        req.request_id,
        "seat_acquire",
        pool.as_str(),
        serde_json::json!({ "session_id": id.to_string(), "metadata": metadata }),
    )?;
    let _slot = wait_slot(&app, &caller, wait_ms, "pool", &pool)?;
    let granted = match request {
        None => {
            app.engine
                .acquire_seat(id, pool.clone(), metadata, wait_ms)
                .await?
        }
        Some(request) => {
            let op = Mutation::AcquireSeat {
                id,
                pool: pool.clone(),
                metadata,
                wait_ms,
            };
            let answer = app.engine.once(request, op).await?;
            answer.granted().ok_or(BackendError::RequestIdReused)?
        }
    };
    Ok(Json(AcquireResponse {
        pool: pool.to_string(),
        seat_token: granted.token.0,
        session_id: id.to_string(),
        revision: granted.revision,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseRequest {
    session_id: String,
    seat_token: Whole,
    request_id: Option<String>,
}

#[derive(Serialize)]
struct ReleaseResponse {
    released: bool,
    revision: u64,
}

async fn release(
    State(app): State<AppState>,
    caller: Caller,
    KeyPath(pool): KeyPath,
    Body(req): Body<ReleaseRequest>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    let id = session_id(&req.session_id)?;
    caller.act(id)?;
    let token = Token(req.seat_token.0);
    let request = retry::request(
        &caller,
        req.request_id,
        "seat_release",
        pool.as_str(),
        serde_json::json!({ "session_id": id.to_string(), "seat_token": token.0 }),
    )?;
    let revision = match request {
        None => app.engine.release_seat(id, pool, token).await?,
        Some(request) => {
            let op = Mutation::ReleaseSeat { id, pool, token };
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
