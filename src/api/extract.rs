//! Request decoding with errors that name the field: JSON bodies (objects only, unknown
//! fields refused, an empty body read as `{}`), query strings (strict UTF-8, each parameter
//! once), and path parameters (named as the API reference names them).
//!
//! One rule for `null`: on an optional field it means the same as leaving the field out; on
//! a required field it is refused like any other wrong type. Integer fields take any JSON
//! number with a whole value (`14454` and `14454.0`), as JSON Schema's `integer` does.

use axum::body::Bytes;
use std::time::Duration;

use axum::extract::{FromRequest, FromRequestParts, MatchedPath, Path, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::error::ApiError;
use super::gate::Caller;
use crate::auth::Scope;
use crate::domain::{LockKey, SessionId};

/// A JSON body of type `T`.
pub struct Body<T>(pub T);

/// The field a serde message names (`missing field `owner``, `unknown field `colour``).
fn named_field(message: &str) -> Option<String> {
    let rest = message
        .strip_prefix("missing field `")
        .or_else(|| message.strip_prefix("unknown field `"))
        .or_else(|| message.strip_prefix("duplicate field `"))?;
    rest.split('`').next().map(str::to_string)
}

fn decode_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    // A missing or unknown field is reported at its parent; name the field itself.
    let named = named_field(&inner.to_string());
    let field = match (path.as_str(), named) {
        // Not a field of the object: the body as a whole is at fault.
        (".", None) => Some("body".to_string()),
        (".", named) => named,
        (_, Some(named)) if !path.ends_with(&named) => Some(format!("{path}.{named}")),
        _ => Some(path),
    };
    let message = match field.as_deref() {
        Some("body") | None => format!("invalid JSON body: {inner}"),
        Some(f) => format!("{f}: {inner}"),
    };
    ApiError::Invalid { field, message }
}

fn body_error(message: impl Into<String>) -> ApiError {
    ApiError::Invalid {
        field: Some("body".into()),
        message: message.into(),
    }
}

pub fn json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let bytes: &[u8] = match bytes.iter().position(|b| !b.is_ascii_whitespace()) {
        // No body at all is `{}`; whitespace alone is no JSON value, and is refused below.
        None if bytes.is_empty() => b"{}",
        None => {
            return Err(body_error(
                "the request body is whitespace, not a JSON object",
            ));
        }
        // Only an object has named fields: an array would be read positionally by serde,
        // past every field check.
        Some(i) if bytes[i] == b'{' => bytes,
        Some(_) => return Err(body_error("the request body must be a JSON object")),
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(decode_error)?;
    // One JSON value and nothing after it: `{...} trailing` is malformed, not a prefix.
    de.end()
        .map_err(|e| body_error(format!("invalid JSON body: {e}")))?;
    Ok(value)
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .copied()
            .unwrap_or(BodyLimit {
                bytes: usize::MAX,
                read_timeout: Duration::MAX,
            });
        // The whole body within the deadline: a client dripping bytes holds a connection
        // and a task, so it gets 408 rather than as long as it likes.
        let read = tokio::time::timeout(limit.read_timeout, Bytes::from_request(req, state));
        let bytes = match read.await {
            Err(_) => return Err(ApiError::BodyTimeout(limit.read_timeout)),
            Ok(r) => r.map_err(|e| {
                if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::PayloadTooLarge(limit.bytes)
                } else {
                    body_error(e.body_text())
                }
            })?,
        };
        json(&bytes).map(Body)
    }
}

/// A JSON body read straight from the connection, under the same limit, deadline and
/// errors as [`Body`] gives a routed request: the hot routes' way in.
pub async fn read_json<T: DeserializeOwned>(
    body: hyper::body::Incoming,
    limit: BodyLimit,
) -> Result<Body<T>, ApiError> {
    use http_body_util::BodyExt;
    let limited = http_body_util::Limited::new(body, limit.bytes);
    match tokio::time::timeout(limit.read_timeout, limited.collect()).await {
        Err(_) => Err(ApiError::BodyTimeout(limit.read_timeout)),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::PayloadTooLarge(limit.bytes))
        }
        // The words of the router's own rejection, so both ways in read alike.
        Ok(Err(e)) => Err(body_error(format!(
            "Failed to buffer the request body: {e}"
        ))),
        Ok(Ok(collected)) => json(&collected.to_bytes()).map(Body),
    }
}

/// An unsigned 64-bit integer from a JSON body: any number with a whole value in
/// 0..=2^64-1, also when written with a fraction part or exponent (`14454.0`, `1e3`), as
/// JSON Schema's `integer` allows. A float is taken only up to 2^53, where every whole
/// value is still exact; beyond that it must be written as an integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Whole(pub u64);

impl<'de> serde::Deserialize<'de> for Whole {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Whole, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Whole;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a whole number from 0 to 18446744073709551615")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Whole, E> {
                Ok(Whole(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Whole, E> {
                u64::try_from(v)
                    .map(Whole)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Whole, E> {
                const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
                if v.fract() == 0.0 && (0.0..=EXACT).contains(&v) {
                    Ok(Whole(v as u64))
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Float(v), &self))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// An optional whole number, `null` read as absent.
pub fn whole(v: Option<Whole>) -> Option<u64> {
    v.map(|w| w.0)
}

/// The configured body limits, put into each request so the 413 message can say them.
#[derive(Clone, Copy)]
pub struct BodyLimit {
    pub bytes: usize,
    /// Longest the body of one request may take to arrive.
    pub read_timeout: Duration,
}

/// A query string of type `T`.
pub struct Query<T>(pub T);

/// Every parameter must decode to UTF-8: a lossy decoding would turn bad bytes into U+FFFD
/// and quietly filter on a name nobody asked for.
fn strict_query(query: &str) -> Result<(), ApiError> {
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name_ok = percent_encoding::percent_decode_str(name)
            .decode_utf8()
            .map(|n| n.into_owned());
        let Ok(name) = name_ok else {
            return Err(ApiError::invalid(
                "query",
                "the query string has a parameter name that is not UTF-8",
            ));
        };
        if percent_encoding::percent_decode_str(value)
            .decode_utf8()
            .is_err()
        {
            return Err(ApiError::Invalid {
                message: format!("query parameter {name}: not valid UTF-8 once percent-decoded"),
                field: Some(name),
            });
        }
    }
    Ok(())
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let query = parts.uri.query().unwrap_or("");
        strict_query(query)?;
        let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(de)
            .map(Query)
            .map_err(|e| {
                let path = e.path().to_string();
                let inner = e.into_inner().to_string();
                let field = match named_field(&inner) {
                    Some(named) => named,
                    None if path == "." => "query".to_string(),
                    None => path,
                };
                ApiError::Invalid {
                    message: format!("query parameter {field}: {inner}"),
                    field: Some(field),
                }
            })
    }
}

/// The documented name of a route's path parameter: the template says `{id}`, the
/// reference says `session_id` or `job_id`.
fn param_field(parts: &Parts) -> &'static str {
    let template = parts
        .extensions
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
        .unwrap_or("");
    if template.starts_with("/v1/jobs/") || template.starts_with("/v1/admin/jobs/") {
        "job_id"
    } else if template.starts_with("/v1/sessions/") || template.starts_with("/v1/admin/sessions/") {
        "session_id"
    } else if template.contains("{pool}") {
        "pool"
    } else if template.contains("{queue}") {
        "queue"
    } else {
        "key"
    }
}

fn path_error(parts: &Parts, e: axum::extract::rejection::PathRejection) -> ApiError {
    let field = param_field(parts);
    ApiError::Invalid {
        message: format!("path parameter {field}: {}", e.body_text()),
        field: Some(field.to_string()),
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
        Err(e) => Err(path_error(parts, e)),
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
            Err(e) => return Err(path_error(parts, e)),
        };
        let (name, text) = params.into_iter().next().unwrap_or_default();
        let (field, scope) = match name.as_str() {
            "pool" => ("pool", Scope::Pool),
            "queue" => ("queue", Scope::Queue),
            _ => ("key", Scope::Key),
        };
        KeyPath::parse(field, scope, &text, parts.extensions.get::<Caller>())
    }
}

impl KeyPath {
    /// A decoded name of the parameter `field`, checked against the caller's scopes.
    pub fn parse(
        field: &'static str,
        scope: Scope,
        text: &str,
        caller: Option<&Caller>,
    ) -> Result<KeyPath, ApiError> {
        let key = LockKey::parse(field, text)?;
        // A name outside the token's scopes is refused before anything is looked up.
        if let Some(caller) = caller {
            caller.scope(scope, field, text)?;
        }
        Ok(KeyPath(key))
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
