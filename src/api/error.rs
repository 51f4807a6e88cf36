//! The one place that maps errors to HTTP statuses and `{"error", "message"}` bodies.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::backend::BackendError;
use crate::domain::InvalidInput;

#[derive(Debug)]
pub enum ApiError {
    /// Malformed JSON, unknown fields, missing or out-of-range values.
    Invalid {
        field: Option<String>,
        message: String,
    },
    SessionGone,
    LockFree,
    PoolNotFound,
    JobNotFound,
    NotFound,
    MethodNotAllowed,
    PayloadTooLarge(usize),
    Engine(BackendError),
}

#[derive(Serialize)]
struct Body<'a> {
    error: &'a str,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<String>,
    /// For `pool_exhausted`: the pool's capacity and seats in use.
    #[serde(skip_serializing_if = "Option::is_none")]
    capacity: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    in_use: Option<usize>,
}

impl ApiError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            field: Some(field.into()),
            message: message.into(),
        }
    }

    fn parts(self) -> (StatusCode, &'static str, String, Option<String>) {
        use BackendError as E;
        match self {
            ApiError::Invalid { field, message } => {
                (StatusCode::BAD_REQUEST, "invalid_request", message, field)
            }
            ApiError::SessionGone | ApiError::Engine(E::SessionGone) => (
                StatusCode::NOT_FOUND,
                "session_gone",
                E::SessionGone.to_string(),
                None,
            ),
            ApiError::LockFree => (
                StatusCode::NOT_FOUND,
                "lock_free",
                "no session holds this lock".into(),
                None,
            ),
            ApiError::PoolNotFound | ApiError::Engine(E::PoolNotFound) => (
                StatusCode::NOT_FOUND,
                "pool_not_found",
                E::PoolNotFound.to_string(),
                None,
            ),
            ApiError::JobNotFound | ApiError::Engine(E::JobNotFound) => (
                StatusCode::NOT_FOUND,
                "job_not_found",
                E::JobNotFound.to_string(),
                None,
            ),
            ApiError::NotFound => (
                StatusCode::NOT_FOUND,
                "not_found",
                "no such endpoint; see the API reference".into(),
                None,
            ),
            ApiError::MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this endpoint does not take that method".into(),
                None,
            ),
            ApiError::PayloadTooLarge(max) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("the request body is over the limit of {max} bytes"),
                None,
            ),
            ApiError::Engine(e) => {
                let (status, code) = match &e {
                    E::SessionGone => (StatusCode::NOT_FOUND, "session_gone"),
                    E::LockHeld => (StatusCode::CONFLICT, "lock_held"),
                    E::NotHolder => (StatusCode::CONFLICT, "not_holder"),
                    E::TooManyLocks(_) => (StatusCode::CONFLICT, "too_many_locks"),
                    E::PoolNotFound => (StatusCode::NOT_FOUND, "pool_not_found"),
                    E::PoolExhausted { .. } => (StatusCode::CONFLICT, "pool_exhausted"),
                    E::PoolInUse(_) => (StatusCode::CONFLICT, "pool_in_use"),
                    E::JobNotFound => (StatusCode::NOT_FOUND, "job_not_found"),
                    E::StaleToken => (StatusCode::CONFLICT, "stale_token"),
                    E::JobNotFailed => (StatusCode::CONFLICT, "job_not_failed"),
                    E::Invalid(i) => {
                        return (
                            StatusCode::BAD_REQUEST,
                            "invalid_request",
                            i.to_string(),
                            Some(i.field.to_string()),
                        );
                    }
                    E::StoreFailed => (StatusCode::SERVICE_UNAVAILABLE, "store_failed"),
                    E::Overloaded(_) => (StatusCode::SERVICE_UNAVAILABLE, "overloaded"),
                    E::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
                    E::Store(_) => (StatusCode::SERVICE_UNAVAILABLE, "storage_error"),
                    E::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "backend_unavailable"),
                    E::Unsupported(_) => (StatusCode::NOT_IMPLEMENTED, "not_supported"),
                };
                (status, code, e.to_string(), None)
            }
        }
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> ApiError {
        ApiError::Engine(e)
    }
}

impl From<InvalidInput> for ApiError {
    fn from(e: InvalidInput) -> ApiError {
        ApiError::invalid(e.field, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (capacity, in_use) = match &self {
            ApiError::Engine(BackendError::PoolExhausted { capacity, in_use }) => {
                (Some(*capacity), Some(*in_use))
            }
            _ => (None, None),
        };
        let (status, error, message, field) = self.parts();
        if status.is_server_error() {
            tracing::warn!(%status, error, %message, "request refused");
        }
        (
            status,
            Json(Body {
                error,
                message,
                field,
                capacity,
                in_use,
            }),
        )
            .into_response()
    }
}
