//! Request decoding with errors that name the field: JSON bodies (unknown fields refused,
//! an empty body read as `{}`), query strings, and path parameters.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::error::ApiError;
use crate::domain::{LockKey, SessionId};

/// A JSON body of type `T`.
pub struct Body<T>(pub T);

/// The field a serde message names (`missing field `owner``, `unknown field `colour``).
fn named_field(message: &str) -> Option<String> {
    let rest = message
        .strip_prefix("missing field `")
        .or_else(|| message.strip_prefix("unknown field `"))?;
    rest.split('`').next().map(str::to_string)
}

fn decode_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    // A missing or unknown field is reported at its parent; name the field itself.
    let named = named_field(&inner.to_string());
    let field = match (path.as_str(), named) {
        (".", named) => named,
        (_, Some(named)) if !path.ends_with(&named) => Some(format!("{path}.{named}")),
        _ => Some(path),
    };
    let message = match &field {
        Some(f) => format!("{f}: {inner}"),
        None => format!("invalid JSON body: {inner}"),
    };
    ApiError::Invalid { field, message }
}

pub fn json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(decode_error)?;
    // One JSON value and nothing after it: `{...} trailing` is malformed, not a prefix.
    de.end().map_err(|e| ApiError::Invalid {
        field: None,
        message: format!("invalid JSON body: {e}"),
    })?;
    Ok(value)
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map(|l| l.0)
            .unwrap_or(usize::MAX);
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge(limit)
            } else {
                ApiError::Invalid {
                    field: None,
                    message: e.body_text(),
                }
            }
        })?;
        json(&bytes).map(Body)
    }
}

/// The configured body limit, put into each request so the 413 message can say it.
#[derive(Clone, Copy)]
pub struct BodyLimit(pub usize);

/// A query string of type `T`.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let query = parts.uri.query().unwrap_or("");
        let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(de)
            .map(Query)
            .map_err(|e| {
                let path = e.path().to_string();
                let inner = e.into_inner().to_string();
                let field = match named_field(&inner) {
                    Some(named) => named,
                    None => path,
                };
                ApiError::Invalid {
                    message: format!("query parameter {field}: {inner}"),
                    field: Some(field),
                }
            })
    }
}

/// The first percent-decoded parameter of the route.
pub async fn first_segment<S: Send + Sync>(parts: &mut Parts, _: &S) -> Result<String, ApiError> {
    Ok(segments(parts)
        .await?
        .into_iter()
        .next()
        .unwrap_or_default())
}

/// Optional metadata: absent or null is none, an object is kept as JSON text, anything else
/// is refused.
pub fn metadata(value: Option<serde_json::Value>) -> Result<Option<String>, ApiError> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v @ serde_json::Value::Object(_)) => Ok(Some(v.to_string())),
        Some(_) => Err(ApiError::invalid(
            "metadata",
            "metadata must be a JSON object",
        )),
    }
}

/// The percent-decoded parameters of the route, in order.
async fn segments(parts: &mut Parts) -> Result<Vec<String>, ApiError> {
    match Path::<Vec<String>>::from_request_parts(parts, &()).await {
        Ok(Path(v)) => Ok(v),
        Err(e) => Err(ApiError::Invalid {
            field: None,
            message: e.body_text(),
        }),
    }
}

/// The `{id}` of a session route.
pub struct SessionPath(pub SessionId);

impl<S: Send + Sync> FromRequestParts<S> for SessionPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let segs = segments(parts).await?;
        let text = segs.first().map(String::as_str).unwrap_or("");
        Ok(SessionPath(SessionId::parse("session_id", text)?))
    }
}

/// The `{key}`, `{pool}` or `{queue}` of a route: percent-decoded, so any valid name works,
/// `/` included. An invalid one is reported under the parameter's own name.
pub struct KeyPath(pub LockKey);

impl<S: Send + Sync> FromRequestParts<S> for KeyPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let params = match Path::<Vec<(String, String)>>::from_request_parts(parts, &()).await {
            Ok(Path(v)) => v,
            Err(e) => {
                return Err(ApiError::Invalid {
                    field: None,
                    message: e.body_text(),
                });
            }
        };
        let (name, text) = params.into_iter().next().unwrap_or_default();
        let field = match name.as_str() {
            "pool" => "pool",
            "queue" => "queue",
            _ => "key",
        };
        Ok(KeyPath(LockKey::parse(field, &text)?))
    }
}

/// A session id sent in a body: parsed with the field name in the error.
pub fn session_id(text: &str) -> Result<SessionId, ApiError> {
    Ok(SessionId::parse("session_id", text)?)
}

/// Page sizes: a missing limit takes `default`; above `max` is an error, not a silent cap.
pub fn page_limit(limit: Option<usize>, default: usize, max: usize) -> Result<usize, ApiError> {
    match limit {
        None => Ok(default),
        Some(0) => Err(ApiError::invalid("limit", "limit must be at least 1")),
        Some(n) if n > max => Err(ApiError::invalid(
            "limit",
            format!("limit must be at most {max}"),
        )),
        Some(n) => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_messages_name_their_field() {
        assert_eq!(
            named_field("missing field `owner`").as_deref(),
            Some("owner")
        );
        assert_eq!(
            named_field("unknown field `colour`, expected one of `owner`").as_deref(),
            Some("colour")
        );
        assert_eq!(named_field("invalid type: string"), None);
    }

    #[test]
    fn one_value_and_nothing_after_it() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct T {
            a: u32,
        }
        assert!(json::<T>(b"{\"a\":1}  ").is_ok());
        assert!(json::<T>(b"{\"a\":1} x").is_err());
        assert!(json::<T>(b"{\"a\":1}{\"a\":2}").is_err());
    }
}
