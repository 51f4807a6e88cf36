//! The HTTP API (v1): a router with one file per resource, each handler doing
//! decode → validate → engine call → encode; `error` is the one error → status mapping.

mod admin;
pub mod error;
mod events;
mod extract;
mod jobs;
mod locks;
mod pools;
mod probes;
mod sessions;
mod wire;

use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tower_http::catch_panic::CatchPanicLayer;

use crate::engine::Engine;
use crate::metrics::{RequestLabels, RouteLabel};
use error::ApiError;
use extract::BodyLimit;

#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
}

/// Every route of the API, with the body limit, request metrics and panic catching.
pub fn router(engine: Engine, max_body_bytes: usize) -> Router {
    let state = AppState { engine };
    let job_body_limit = max_body_bytes + crate::domain::jobs::MAX_PAYLOAD_BYTES;
    Router::new()
        .merge(sessions::routes())
        .merge(locks::routes())
        .merge(pools::routes())
        // A job's payload or result may itself be 64 KiB: its routes take that much more.
        .merge(
            jobs::routes()
                .layer(DefaultBodyLimit::max(job_body_limit))
                .layer(axum::Extension(BodyLimit(job_body_limit))),
        )
        .merge(events::routes())
        .merge(admin::routes())
        .merge(probes::routes())
        .fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::Extension(BodyLimit(max_body_bytes)))
        .layer(CatchPanicLayer::new())
        .with_state(state)
}

/// Counts every request by route template, method and status, and times it.
async fn observe(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = req.method().as_str().to_owned();
    let response = next.run(req).await.into_response();
    // The route template, never the path: a path can carry a session id, a capability.
    tracing::debug!(
        route = %route,
        method = %method,
        status = response.status().as_u16(),
        elapsed_us = started.elapsed().as_micros() as u64,
        "request"
    );
    let m = app.engine.metrics();
    m.requests
        .get_or_create(&RequestLabels {
            route: route.clone(),
            method,
            status: response.status().as_u16(),
        })
        .inc();
    m.request_seconds
        .get_or_create(&RouteLabel { route })
        .observe(started.elapsed().as_secs_f64());
    response
}
