//! The plain HTTP client: one call, one answer, no retries. The sessions and guards of
//! [`super::Session`] are built on it; the command-line tools and the tests use it directly.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
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
    #[error("{what} {path}: {message}")]
    TlsFile {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("{0}")]
    TlsConfig(String),
    #[error("the certificate of {server} is not trusted: {message}")]
    Untrusted { server: String, message: String },
    #[error("{server} did not answer TLS ({message}); is it serving plain http://?")]
    NotTls { server: String, message: String },
}

/// Where an `https://` client finds its trust anchors and, optionally, the certificate it
/// presents. There are no built-in roots: an appliance's certificate comes from the site's
/// own CA, so `https://` needs `ca_file` and trusts only the CAs in it.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// PEM file of the CA certificates the server's certificate must chain to.
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain presented to a server that maps client certificates to tokens.
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `client_cert`.
    pub client_key: Option<PathBuf>,
}

type Connector = HttpsConnector<HttpConnector>;

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
    http: HyperClient<Connector, Full<Bytes>>,
    timeout: Duration,
    /// Whether the base URL is `https://`.
    https: bool,
    /// False for an `https://` client until `with_tls` gave it a CA file.
    tls_ready: bool,
    /// Sent as `Authorization: Bearer …` with every request when set.
    bearer: Option<String>,
}

fn build(config: rustls::ClientConfig) -> HyperClient<Connector, Full<Bytes>> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    HyperClient::builder(TokioExecutor::new()).build(connector)
}

fn read_file(what: &'static str, path: &Path) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path).map_err(|e| ClientError::TlsFile {
        what,
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ClientError> {
    let pem = read_file(what, path)?;
    let err = |message: String| ClientError::TlsFile {
        what,
        path: path.to_path_buf(),
        message,
    };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(err("holds no PEM certificate".into()));
    }
    Ok(certs)
}

/// The rustls configuration: the CA file's certificates as the only roots (with
/// `require_ca`, an https:// client without one is refused), and the client certificate.
fn tls_config(files: &TlsFiles, require_ca: bool) -> Result<rustls::ClientConfig, ClientError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    match &files.ca_file {
        Some(path) => {
            for cert in certs("CA file", path)? {
                roots.add(cert).map_err(|e| ClientError::TlsFile {
                    what: "CA file",
                    path: path.clone(),
                    message: format!("not a usable CA certificate: {e}"),
                })?;
            }
        }
        None if require_ca => {
            return Err(ClientError::TlsConfig(
                "an https:// server needs a CA file to verify it (--ca-file or LEASEHOLD_CA_FILE)"
                    .into(),
            ));
        }
        None => {}
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::TlsConfig(e.to_string()))?
        .with_root_certificates(roots);
    match (&files.client_cert, &files.client_key) {
        (Some(cert), Some(key)) => {
            let chain = certs("client certificate", cert)?;
            let pem = read_file("client key", key)?;
            let key_der =
                PrivateKeyDer::from_pem_slice(&pem).map_err(|e| ClientError::TlsFile {
                    what: "client key",
                    path: key.clone(),
                    message: format!("no PEM private key: {e}"),
                })?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| ClientError::TlsConfig(format!("client certificate and key: {e}")))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// Names a failed connection: an untrusted certificate or a peer that is not speaking TLS
/// get their own errors; anything else is a plain connect failure.
fn connect_error(server: &str, e: &(dyn std::error::Error + 'static)) -> ClientError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        // The connector wraps the rustls error in io::Errors, whose `source` skips the
        // wrapped error itself: descend through `get_ref` instead.
        if let Some(inner) = c
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            cause = Some(inner);
            continue;
        }
        let tls = c.downcast_ref::<rustls::Error>();
        match tls {
            Some(
                err @ (rustls::Error::InvalidCertificate(_)
                | rustls::Error::NoCertificatesPresented),
            ) => {
                return ClientError::Untrusted {
                    server: server.to_string(),
                    message: err.to_string(),
                };
            }
            Some(err @ rustls::Error::InvalidMessage(_)) => {
                return ClientError::NotTls {
                    server: server.to_string(),
                    message: err.to_string(),
                };
            }
            Some(err) => {
                return ClientError::Connect {
                    server: server.to_string(),
                    message: format!("TLS: {err}"),
                };
            }
            None => cause = c.source(),
        }
    }
    ClientError::Connect {
        server: server.to_string(),
        message: format!("{e:?}"),
    }
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
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => {
                return Err(ClientError::Url(
                    base,
                    "expected http://HOST:PORT or https://HOST:PORT".into(),
                ));
            }
        };
        if uri.host().is_none() {
            return Err(ClientError::Url(base, "the URL names no host".into()));
        }
        // Until `with_tls` gives an https:// client its CA file, it trusts nothing and
        // refuses to call (`tls_ready`).
        let http = build(tls_config(&TlsFiles::default(), false)?);
        Ok(Client {
            base,
            http,
            https,
            tls_ready: !https,
            timeout: Duration::from_secs(120),
            bearer: None,
        })
    }

    /// The same client, verifying the server against `files.ca_file` and presenting
    /// `files.client_cert` when set. Files are read here, so an unreadable or malformed
    /// file is an error now rather than on the first call.
    pub fn with_tls(mut self, files: &TlsFiles) -> Result<Client, ClientError> {
        if files.client_cert.is_some() != files.client_key.is_some() {
            return Err(ClientError::TlsConfig(
                "a client certificate and its key go together: give both or neither".into(),
            ));
        }
        if !self.https {
            if files.ca_file.is_some() || files.client_cert.is_some() {
                return Err(ClientError::TlsConfig(format!(
                    "TLS files were given but {} is not an https:// URL",
                    self.base
                )));
            }
            return Ok(self);
        }
        self.http = build(tls_config(files, true)?);
        self.tls_ready = true;
        Ok(self)
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
        if !self.tls_ready {
            return Err(ClientError::TlsConfig(format!(
                "{} is https:// but no CA file was given to verify it (--ca-file or LEASEHOLD_CA_FILE)",
                self.base
            )));
        }
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
                .map_err(|e| connect_error(&self.base, &e))?;
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
