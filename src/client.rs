//! A small HTTP client for the API, used by the command-line tools and the tests.

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
    /// Sent as `Authorization: Bearer …` when set.
    token: Option<std::sync::Arc<str>>,
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
            token: None,
        })
    }

    /// The same client, calling with an API token.
    pub fn with_token(mut self, token: Option<&str>) -> Client {
        self.token = token.filter(|t| !t.is_empty()).map(Into::into);
        self
    }

    pub fn base(&self) -> &str {
        &self.base
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
        if let Some(t) = &self.token {
            req = req.header("authorization", format!("Bearer {t}"));
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
