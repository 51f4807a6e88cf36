//! The hot routes (heartbeat, lock acquire and release, `/healthz`) served without the
//! router: a match on method and path segments, the body read and decoded in place, the
//! request counted on handles resolved once, and a panic answered as the router's panic
//! layer answers it. The handlers are the router's own; only the way to them is shorter.
//!
//! Invariant: a request takes this way only when the match is certain to pick the route the
//! router would (one segment: not empty, no `/`) and its parameter decodes as the router's
//! would (percent-escapes decoding to UTF-8, as `Path` decodes them); anything else goes to
//! the router. Both ways give the same statuses, bodies and metric series. Keys with a `/`
//! (escaped as `%2F`, the usual shape of a namespaced key) take this way too.

use std::borrow::Cow;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use axum::extract::State;
use axum::http::{Method, Request};
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use hyper::body::Incoming;
use tower_http::catch_panic::{DefaultResponseForPanic, ResponseForPanic};

use super::AppState;
use super::error::ApiError;
use super::extract::{BodyLimit, KeyPath, SessionPath, read_json};
use super::gate::Caller;
use crate::auth::Scope;
use crate::domain::SessionId;
use crate::metrics::RouteMeter;

/// A hot route, with where its one path parameter lies in the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Heartbeat(usize, usize),
    Acquire(usize, usize),
    Release(usize, usize),
    Healthz,
}

/// The hot route of `method` and `path`, if the router would surely pick it.
pub fn route(method: &Method, path: &str) -> Option<Route> {
    if *method == Method::GET {
        return (path == "/healthz").then_some(Route::Healthz);
    }
    if *method != Method::POST {
        return None;
    }
    // One segment between `prefix` and `suffix` whose escapes decode to UTF-8: its start and
    // end in `path`. A segment that does not decode goes to the router, which refuses it.
    let param = |prefix: &str, suffix: &str| -> Option<(usize, usize)> {
        let rest = path.strip_prefix(prefix)?.strip_suffix(suffix)?;
        let one = !rest.is_empty() && !rest.contains('/');
        let decodes = !rest.contains('%') || decoded(rest).is_some();
        (one && decodes).then_some((prefix.len(), prefix.len() + rest.len()))
    };
    if let Some((a, b)) = param("/v1/sessions/", "/heartbeat") {
        return Some(Route::Heartbeat(a, b));
    }
    if let Some((a, b)) = param("/v1/locks/", "/acquire") {
        return Some(Route::Acquire(a, b));
    }
    if let Some((a, b)) = param("/v1/locks/", "/release") {
        return Some(Route::Release(a, b));
    }
    None
}

/// A path parameter percent-decoded as the router's `Path` decodes it; `None` when the
/// result is not UTF-8.
fn decoded(text: &str) -> Option<Cow<'_, str>> {
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .ok()
}

/// The parameter at `a..b` of `path`, decoded. [`route`] only matched it if it decodes, so
/// the error is for a caller that skipped it.
fn decoded_param<'p>(
    path: &'p str,
    a: usize,
    b: usize,
    field: &'static str,
) -> Result<Cow<'p, str>, ApiError> {
    decoded(&path[a..b]).ok_or_else(|| {
        ApiError::invalid(
            field,
            format!("path parameter {field}: not valid UTF-8 once percent-decoded"),
        )
    })
}

/// The state of the hot routes: the router's, the body limit of their routes, and one
/// meter per route.
pub struct Hot {
    app: AppState,
    body: BodyLimit,
    heartbeat: RouteMeter,
    acquire: RouteMeter,
    release: RouteMeter,
    healthz: RouteMeter,
}

impl Hot {
    pub fn new(app: AppState, body: BodyLimit) -> Hot {
        let m = app.engine.metrics();
        Hot {
            heartbeat: m.route_meter("/v1/sessions/{id}/heartbeat", "POST"),
            acquire: m.route_meter("/v1/locks/{key}/acquire", "POST"),
            release: m.route_meter("/v1/locks/{key}/release", "POST"),
            healthz: m.route_meter("/healthz", "GET"),
            app,
            body,
        }
    }

    /// Answers a request `route` matched. The gate has let it through.
    pub async fn serve(&self, route: Route, req: Request<Incoming>) -> Response {
        let started = Instant::now();
        let (mut parts, body) = req.into_parts();
        // The gate puts a caller into every request it lets through with a token; none
        // means no tokens are configured.
        let caller = parts.extensions.remove::<Caller>().unwrap_or(Caller::Open);
        let path = parts.uri.path();
        let app = || State(self.app.clone());
        // Extractors in the handlers' order: the path, then the body.
        let (meter, response) = match route {
            Route::Healthz => (
                &self.healthz,
                super::probes::healthz().await.into_response(),
            ),
            Route::Heartbeat(a, b) => {
                let answer = async {
                    let id =
                        SessionId::parse("session_id", &decoded_param(path, a, b, "session_id")?)?;
                    let body = read_json(body, self.body).await?;
                    super::sessions::heartbeat(app(), caller, SessionPath(id), body).await
                };
                (&self.heartbeat, answer.await.into_response())
            }
            Route::Acquire(a, b) => {
                let answer = async {
                    let text = decoded_param(path, a, b, "key")?;
                    let key = KeyPath::parse("key", Scope::Key, &text, Some(&caller))?;
                    let body = read_json(body, self.body).await?;
                    super::locks::acquire(app(), caller, key, body).await
                };
                (&self.acquire, answer.await.into_response())
            }
            Route::Release(a, b) => {
                let answer = async {
                    let text = decoded_param(path, a, b, "key")?;
                    let key = KeyPath::parse("key", Scope::Key, &text, Some(&caller))?;
                    let body = read_json(body, self.body).await?;
                    super::locks::release(app(), caller, key, body).await
                };
                (&self.release, answer.await.into_response())
            }
        };
        let status = response.status().as_u16();
        let elapsed = started.elapsed();
        // The route template, never the path: a path can carry a session id, a capability.
        tracing::debug!(
            route = meter.route(),
            method = meter.method(),
            status,
            elapsed_us = elapsed.as_micros() as u64,
            "request"
        );
        meter.observe(status, elapsed);
        response
    }
}

/// `future`'s answer, or the answer the router's panic layer gives (500) if it panics, so a
/// panicking handler costs its request, not the connection.
///
/// Not an `async fn`: one would keep `future` twice in its own state, as the argument and as
/// the pinned local it polls, and every request's future is copied as it starts.
pub fn catch_panic(future: impl Future<Output = Response>) -> impl Future<Output = Response> {
    AssertUnwindSafe(future).catch_unwind().map(|answer| {
        answer.unwrap_or_else(|panic| {
            DefaultResponseForPanic::default()
                .response_for_panic(panic)
                .map(axum::body::Body::new)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_segments_take_the_hot_way() {
        let post = Method::POST;
        let hb = "/v1/sessions/abc/heartbeat";
        assert_eq!(route(&post, hb), Some(Route::Heartbeat(13, 16)));
        assert_eq!(
            route(&post, "/v1/locks/k-1/acquire"),
            Some(Route::Acquire(10, 13))
        );
        assert_eq!(
            route(&post, "/v1/locks/k/release"),
            Some(Route::Release(10, 11))
        );
        assert_eq!(route(&Method::GET, "/healthz"), Some(Route::Healthz));
        // Escapes that decode to UTF-8, a `/` among them, are one segment the router's way.
        assert_eq!(
            route(&post, "/v1/locks/a%2Fb/acquire"),
            Some(Route::Acquire(10, 15))
        );
        assert_eq!(
            route(&post, "/v1/locks/%E6%95%B0/release"),
            Some(Route::Release(10, 19))
        );
        assert_eq!(decoded_param("/x/a%2Fb", 3, 8, "key").unwrap(), "a/b");
        for (m, p) in [
            (&Method::GET, hb),
            (&Method::HEAD, "/healthz"),
            (&Method::POST, "/healthz"),
            (&post, "/v1/sessions//heartbeat"),
            (&post, "/v1/sessions/a/b/heartbeat"),
            (&post, "/v1/sessions/abc/heartbeat/"),
            (&post, "/v1/locks/%FF%FE/acquire"),
            (&post, "/v1/locks/a/b/release"),
            (&post, "/v1/locks/acquire"),
            (&Method::GET, "/healthz/"),
        ] {
            assert_eq!(route(m, p), None, "{m} {p}");
        }
    }

    #[tokio::test]
    async fn a_panic_in_a_handler_answers_500_and_an_answer_passes_through() {
        let answer = catch_panic(async { axum::http::StatusCode::ACCEPTED.into_response() }).await;
        assert_eq!(answer.status(), axum::http::StatusCode::ACCEPTED);
        // Panics after a first poll, as a handler would after awaiting something.
        async fn broken() -> Response {
            tokio::task::yield_now().await;
            panic!("the handler broke")
        }
        let answer = catch_panic(broken()).await;
        assert_eq!(
            answer.status(),
            axum::http::StatusCode::INTERNAL_SERVER_ERROR
        );
    }
}
