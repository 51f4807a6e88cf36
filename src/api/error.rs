//! The one place that maps errors to HTTP statuses and `{"error", "message"}` bodies. The
//! server's own refusals before routing (401, 413 from `Content-Length`, 429) are built here
//! too, so every 4xx and 5xx has the same shape.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
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
    /// The body did not arrive within `body_read_timeout_ms`.
    BodyTimeout(std::time::Duration),
    /// No valid `Authorization: Bearer` token.
    Unauthorized,
    /// A client certificate that cannot act as a caller here: it names two tokens, or a
    /// token other than the bearer header's. The reason is for the message.
    CertRefused(&'static str),
    /// The token's role or scopes do not allow the call; `field` names the parameter whose
    /// value is outside the scopes.
    Forbidden {
        field: Option<&'static str>,
        message: String,
    },
    /// The token's request rate is over its limit; retry after this many seconds.
    RateLimited {
        retry_after_s: u64,
    },
    /// Too many requests already wait on this key, or for this token.
    TooManyWaiters(&'static str),
    /// Too many session watches are open: this token's (`429`) or the node's (`503`).
    TooManyWatches {
        per_token: bool,
    },
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
            ApiError::BodyTimeout(t) => (
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!(
                    "the request body did not arrive within {} ms",
                    t.as_millis()
                ),
                Some("body".into()),
            ),
            ApiError::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "this call needs a valid API token: Authorization: Bearer <token>".into(),
                None,
            ),
            ApiError::CertRefused(why) => {
                (StatusCode::UNAUTHORIZED, "unauthorized", why.into(), None)
            }
            ApiError::Forbidden { field, message } => (
                StatusCode::FORBIDDEN,
                "forbidden",
                message,
                field.map(str::to_string),
            ),
            ApiError::RateLimited { retry_after_s } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!("this token is over its request rate; retry in {retry_after_s} s"),
                None,
            ),
            ApiError::TooManyWaiters(what) => (
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_waiters",
                format!("too many requests already wait {what}; retry later or wait less"),
                Some("wait_ms".into()),
            ),
            ApiError::TooManyWatches { per_token: true } => (
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_watches",
                "this token already has max_watches_per_token watches open; close one or retry later"
                    .into(),
                None,
            ),
            ApiError::TooManyWatches { per_token: false } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "too_many_watches",
                "this node already serves max_watches watches; retry later or on another node"
                    .into(),
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
                    // 409, as for the other calls that conflict with what is already recorded:
                    // the request is well formed, the id is taken.
                    E::RequestIdReused => {
                        return (
                            StatusCode::CONFLICT,
                            "request_id_reused",
                            e.to_string(),
                            Some("request_id".into()),
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
        let retry_after = match &self {
            ApiError::RateLimited { retry_after_s } => Some(*retry_after_s),
            ApiError::TooManyWaiters(_) | ApiError::TooManyWatches { .. } => Some(1),
            _ => None,
        };
        let (status, error, message, field) = self.parts();
        if status.is_server_error() {
            tracing::warn!(%status, error, %message, "request refused");
        }
        let mut response = (
            status,
            Json(Body {
                error,
                message,
                field,
                capacity,
                in_use,
            }),
        )
            .into_response();
        let headers = response.headers_mut();
        if let Some(s) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        match status {
            StatusCode::UNAUTHORIZED => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            // The rest of the body is not read: the connection cannot carry another request.
            StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT => {
                headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        response
    }
}
