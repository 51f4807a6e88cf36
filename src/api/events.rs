//! `/v1/events`: the audit log, read from a cursor.

use axum::extract::State;
use axum::{Json, Router, routing};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::error::ApiError;
use super::extract::{Query, page_limit};
use super::gate::Caller;
use super::wire::AuditEvent;

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/events", routing::get(list))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    after: Option<u64>,
    limit: Option<usize>,
}

#[derive(Serialize)]
struct EventsResponse {
    events: Vec<AuditEvent>,
    /// The cursor to pass as `after` next time: the last sequence number returned, or the
    /// same `after` when nothing new has happened yet.
    next: u64,
}

async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Query(q): Query<EventsQuery>,
) -> Result<Json<EventsResponse>, ApiError> {
    // The log names keys, pools and queues of every scope.
    caller.unscoped("reading the audit log")?;
    let limit = page_limit(q.limit, 100, 10_000)?;
    let after = q.after.unwrap_or(0);
    let (events, next) = app.engine.events(after, limit).await?;
    Ok(Json(EventsResponse {
        events: events.into_iter().map(AuditEvent::from).collect(),
        next: next.unwrap_or(after),
    }))
}
