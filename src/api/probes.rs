//! `/healthz`, `/readyz` and `/metrics`.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::{Json, Router, routing};
use serde_json::json;

use super::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", routing::get(healthz))
        .route("/readyz", routing::get(readyz))
        .route("/metrics", routing::get(metrics))
}

/// The process is up and serving HTTP.
pub(super) async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// The store accepts writes. False for good after a storage failure (fail-stop).
async fn readyz(State(app): State<AppState>) -> impl IntoResponse {
    if app.engine.ready() {
        (StatusCode::OK, Json(json!({"ready": true})))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"ready": false, "reason": "the store failed or the server is stopping"})),
        )
    }
}

async fn metrics(State(app): State<AppState>) -> impl IntoResponse {
    app.engine
        .metrics()
        .ready
        .set(i64::from(app.engine.ready()));
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.engine.metrics().render(),
    )
}
