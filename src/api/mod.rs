//! The HTTP API (v1): a router with one file per resource, each handler doing
//! decode → validate → engine call → encode; `error` is the one error → status mapping.

mod admin;
pub mod error;
mod events;
mod extract;
pub mod gate;
mod hot;
mod jobs;
mod locks;
mod pools;
mod probes;
mod retry;
mod sessions;
pub mod watch;
mod wire;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    waits: Arc<Waits>,
    /// The node's session watches.
    pub watches: Arc<watch::Watches>,
}

/// Limits the API applies above the backend.
#[derive(Debug, Clone, Copy)]
pub struct ApiLimits {
    pub max_body_bytes: usize,
    pub body_read_timeout: Duration,
    /// Most requests waiting on one lock key, pool or queue at once.
    pub max_waiters_per_key: u32,
    /// Most requests of one token waiting at once.
    pub max_waiters_per_token: u32,
    /// Session watches: their caps, re-check and keep-alive.
    pub watch: watch::WatchLimits,
}

impl ApiLimits {
    /// The job routes take a payload or result of its own 64 KiB limit on top.
    pub fn job_body_bytes(&self) -> usize {
        self.max_body_bytes + crate::domain::jobs::MAX_PAYLOAD_BYTES
    }
}

/// Waiting requests per resource, to bound a flood of waiters on one key. Only requests
/// that wait (`wait_ms` > 0) come here, so the map costs nothing on the fast path.
struct Waits {
    per_key: parking_lot::Mutex<HashMap<(&'static str, String), u32>>,
    max_per_key: u32,
    max_per_token: u32,
}

/// A waiting request's places in the per-key and per-token counts, given back on drop.
pub struct WaitSlot {
    waits: Arc<Waits>,
    key: Option<(&'static str, String)>,
    _token: Option<crate::auth::WaitSlot>,
}

impl Drop for WaitSlot {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut map = self.waits.per_key.lock();
            if let Some(n) = map.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&key);
                }
            }
        }
    }
}

/// A place among the waiters of `name` (a lock key, pool or queue) and of the caller's
/// token, or `429 too_many_waiters`. A request that does not wait takes none.
pub fn wait_slot(
    app: &AppState,
    caller: &gate::Caller,
    wait_ms: u64,
    kind: &'static str,
    name: &impl std::fmt::Display,
) -> Result<Option<WaitSlot>, ApiError> {
    if wait_ms == 0 {
        return Ok(None);
    }
    let token = match caller.waiting() {
        Some(counter) => Some(
            crate::auth::WaitSlot::take(counter, app.waits.max_per_token)
                .ok_or(ApiError::TooManyWaiters("for this token"))?,
        ),
        None => None,
    };
    let key = (kind, name.to_string());
    {
        let mut map = app.waits.per_key.lock();
        let n = map.entry(key.clone()).or_insert(0);
        if *n >= app.waits.max_per_key {
            return Err(ApiError::TooManyWaiters(match kind {
                "lock" => "on this lock",
                "pool" => "on this pool",
                _ => "on this queue",
            }));
        }
        *n += 1;
    }
    Ok(Some(WaitSlot {
        waits: app.waits.clone(),
        key: Some(key),
        _token: token,
    }))
}

/// An operator's or admin's action, in the log with the token that made it (never its
/// secret).
pub fn audit(caller: &gate::Caller, action: &str, target: &impl std::fmt::Display) {
    tracing::info!(target: "leasehold::audit", token = caller.name(), action, %target, "admin action");
}

/// The engine acting for `caller`, for an operator or admin action: the audit events the
/// action writes name the caller's token as `actor`.
pub fn acting(app: &AppState, caller: &gate::Caller) -> crate::engine::Engine {
    app.engine.acting_as(caller.actor())
}

/// Every route of the API, with the body limit, request metrics and panic catching.
fn router(state: AppState, limits: ApiLimits) -> Router {
    let max_body_bytes = limits.max_body_bytes;
    let job_body_limit = limits.job_body_bytes();
    let body = |bytes| BodyLimit {
        bytes,
        read_timeout: limits.body_read_timeout,
    };
    Router::new()
        .merge(sessions::routes())
        .merge(watch::routes())
        .merge(locks::routes())
        .merge(pools::routes())
        // A job's payload or result may itself be 64 KiB: its routes take that much more.
        .merge(
            jobs::routes()
                .layer(DefaultBodyLimit::max(job_body_limit))
                .layer(axum::Extension(body(job_body_limit))),
        )
        .merge(events::routes())
        .merge(admin::routes())
        .merge(probes::routes())
        .fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::Extension(body(max_body_bytes)))
        .layer(CatchPanicLayer::new())
        .with_state(state)
}

/// The API as the server calls it: the hot routes on their short way, the rest through the
/// router.
#[derive(Clone)]
pub struct Api {
    router: Router,
    hot: Arc<hot::Hot>,
}

impl Api {
    /// Every route of the API, with the body limit, request metrics and panic catching; and the
    /// node's watches, for the server to close as it shuts down.
    pub fn new(engine: Engine, limits: ApiLimits) -> (Api, Arc<watch::Watches>) {
        let watches = watch::Watches::new(engine.clone(), limits.watch);
        let state = AppState {
            watches: watches.clone(),
            engine,
            waits: Arc::new(Waits {
                per_key: parking_lot::Mutex::new(HashMap::new()),
                max_per_key: limits.max_waiters_per_key,
                max_per_token: limits.max_waiters_per_token,
            }),
        };
        let body = BodyLimit {
            bytes: limits.max_body_bytes,
            read_timeout: limits.body_read_timeout,
        };
        let api = Api {
            hot: Arc::new(hot::Hot::new(state.clone(), body)),
            router: router(state, limits),
        };
        (api, watches)
    }

    /// Answers one request the gate let through.
    pub async fn call(self, req: hyper::Request<hyper::body::Incoming>) -> Response {
        match hot::route(req.method(), req.uri().path()) {
            Some(route) => hot::catch_panic(self.hot.serve(route, req)).await,
            None => match tower::ServiceExt::oneshot(self.router, req).await {
                Ok(response) => response,
                Err(never) => match never {},
            },
        }
    }
}

/// Counts every request by route template, method and status, and times it.
async fn observe(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = method_label(req.method()).to_owned();
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

/// The method as a metric label: the methods the API knows, and `other` for the rest, so
/// that a client sending made-up methods cannot grow the series without bound.
fn method_label(m: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *m {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        _ => "other",
    }
}
