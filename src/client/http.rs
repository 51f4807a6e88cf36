//! The plain HTTP client: one call, one answer, no retries. The sessions and guards of
//! [`super::Session`] are built on it; the command-line tools and the tests use it directly.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid server URL {0:?}: {1}")]
    Url(String, String),
    #[error("cannot reach {server}: {message}")]
    Connect { server: String, message: String },
    #[error("request timed out after {0:?}")]
    Timeout(Duration),
    #[error("the server sent a body that is not JSON: {0}")]
    NotJson(String),
    #[error("the API token holds a character not allowed in an HTTP header")]
    Token,
}

/// A response: status and JSON body (`Value::Null` when the body is empty).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub body: Value,
    pub text: String,
}

#[derive(Clone)]
pub struct Client {
    base: String,
    http: HyperClient<HttpConnector, Full<Bytes>>,
    timeout: Duration,
    /// Sent as `Authorization: Bearer …` with every request when set.
    bearer: Option<String>,
}

/// Percent-encodes one path segment (a lock key), `/` included.
pub fn segment(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

impl Client {
    pub fn new(server: &str) -> Result<Client, ClientError> {
        let base = server.trim_end_matches('/').to_string();
        let uri: hyper::Uri = base.parse().map_err(|e: hyper::http::uri::InvalidUri| {
            ClientError::Url(base.clone(), e.to_string())
        })?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(ClientError::Url(base, "expected http://HOST:PORT".into()));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Ok(Client {
            base,
            http: HyperClient::builder(TokioExecutor::new()).build(connector),
            timeout: Duration::from_secs(120),
            bearer: None,
        })
    }

    /// The same client, sending `token` as `Authorization: Bearer <token>` with every
    /// request (`None` or an empty token sends no header). A token that cannot be a header
    /// value (a control character, a non-ASCII byte) is refused here rather than on every call.
    pub fn with_token(mut self, token: Option<String>) -> Result<Client, ClientError> {
        let token = token.filter(|t| !t.is_empty());
        if let Some(t) = &token
            && hyper::header::HeaderValue::from_str(&format!("Bearer {t}")).is_err()
        {
            return Err(ClientError::Token);
        }
        self.bearer = token;
        Ok(self)
    }

    /// The same client with another per-request timeout (default 120 s, which must exceed
    /// the longest `wait_ms` asked for).
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    pub(super) fn bearer(&self) -> Option<&str> {
        self.bearer.as_deref()
    }

    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Reply, ClientError> {
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{}", self.base, path))
            .header("content-type", "application/json");
        if let Some(token) = &self.bearer {
            req = req.header("authorization", format!("Bearer {token}"));
        }
        let req = req
            .body(Full::new(Bytes::from(bytes)))
            .map_err(|e| ClientError::Url(path.to_string(), e.to_string()))?;
        let fut = async {
            let resp = self
                .http
                .request(req)
                .await
                .map_err(|e| ClientError::Connect {
                    server: self.base.clone(),
                    message: format!("{e:?}"),
                })?;
            let status = resp.status();
            let collected = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| ClientError::Connect {
                    server: self.base.clone(),
                    message: e.to_string(),
                })?;
            Ok::<_, ClientError>((status, collected.to_bytes()))
        };
        let (status, bytes) = tokio::time::timeout(self.timeout, fut)
            .await
            .map_err(|_| ClientError::Timeout(self.timeout))??;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let body = if bytes.is_empty() {
            Value::Null
        } else if status.as_u16() == 200 && text.starts_with('#') {
            // /metrics is text, not JSON.
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|_| ClientError::NotJson(text.clone()))?
        };
        Ok(Reply { status, body, text })
    }

    pub async fn get(&self, path: &str) -> Result<Reply, ClientError> {
        self.call(Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Result<Reply, ClientError> {
        self.call(Method::POST, path, Some(body)).await
    }

    pub async fn delete(&self, path: &str) -> Result<Reply, ClientError> {
        self.call(Method::DELETE, path, None).await
    }
}
