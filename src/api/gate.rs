//! What every request passes before it is routed, as plain calls on the request path: the
//! early 413 from `Content-Length`, the token, the role the route needs, and the token's
//! rate. A request refused here never has its body read, so a client that sent
//! `Expect: 100-continue` gets its refusal instead of `100 Continue`.

use std::sync::Arc;

use axum::http::{Method, Request, header};

use super::error::ApiError;
use crate::auth::{Auth, CertMatch, Role, Scope, Token};
use crate::domain::SessionId;
use crate::tls::ClientCert;

/// Who is calling, put into the request for the handlers.
#[derive(Clone)]
pub enum Caller {
    /// No tokens are configured: the server listens on loopback only and every caller may
    /// do everything.
    Open,
    Token(Arc<Token>),
}

impl Caller {
    /// The token's name for audit records, `-` when no tokens are configured.
    pub fn name(&self) -> &str {
        match self {
            Caller::Open => "-",
            Caller::Token(t) => &t.name,
        }
    }

    /// The name an operator or admin action's audit events carry as `actor`: the token's
    /// (never its secret), or none when no tokens are configured.
    pub fn actor(&self) -> Option<Arc<str>> {
        match self {
            Caller::Open => None,
            Caller::Token(t) => Some(Arc::from(t.name.as_str())),
        }
    }

    /// A name outside the token's scopes is `403 forbidden`, naming the parameter.
    pub fn scope(&self, scope: Scope, field: &'static str, name: &str) -> Result<(), ApiError> {
        match self {
            Caller::Token(t) if !t.allows(scope, name) => Err(ApiError::Forbidden {
                field: Some(field),
                message: format!("{field} {name:?} is outside this token's scopes"),
            }),
            _ => Ok(()),
        }
    }

    /// Whether the resource is visible to this caller at all; out of scope reads as absent
    /// where the resource is named by an id (a job), so ids are no oracle.
    pub fn sees(&self, scope: Scope, name: &str) -> bool {
        match self {
            Caller::Open => true,
            Caller::Token(t) => t.allows(scope, name),
        }
    }

    /// Calls that reach across every scope (the audit log, a reap, force-ending any
    /// session) need a token without scopes.
    pub fn unscoped(&self, what: &str) -> Result<(), ApiError> {
        match self {
            Caller::Token(t) if !t.unscoped() => Err(ApiError::Forbidden {
                field: None,
                message: format!("{what} needs a token without scopes"),
            }),
            _ => Ok(()),
        }
    }

    /// Acting through a session needs the token that opened it; any other token is told the
    /// session is gone, exactly as for one that never existed.
    pub fn act(&self, id: SessionId) -> Result<(), ApiError> {
        match self {
            Caller::Token(t) if !t.opened(id) => Err(ApiError::SessionGone),
            _ => Ok(()),
        }
    }

    /// Reading a session: readers and above see any; a client sees its own only.
    pub fn read_session(&self, id: SessionId) -> Result<(), ApiError> {
        match self {
            Caller::Token(t) if t.role == Role::Client && !t.opened(id) => {
                Err(ApiError::SessionGone)
            }
            _ => Ok(()),
        }
    }

    /// A new session id: bound to the token, or random without tokens.
    pub fn mint(&self) -> SessionId {
        match self {
            Caller::Open => SessionId::random(),
            Caller::Token(t) => t.mint(),
        }
    }

    pub fn waiting(&self) -> Option<&Arc<std::sync::atomic::AtomicU32>> {
        match self {
            Caller::Open => None,
            Caller::Token(t) => Some(&t.waiting),
        }
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Caller, ApiError> {
        // The gate puts a caller into every request it lets through with a token; none
        // means no tokens are configured.
        Ok(parts
            .extensions
            .get::<Caller>()
            .cloned()
            .unwrap_or(Caller::Open))
    }
}

/// The checks before routing.
pub struct Gate {
    /// None: no tokens configured (loopback only).
    pub auth: Option<Arc<Auth>>,
    /// `/metrics` without a token.
    pub metrics_open: bool,
    pub max_body_bytes: usize,
    pub job_body_bytes: usize,
}

/// The role a route needs, or `None` for the probes anyone may call.
fn needs(method: &Method, path: &str, metrics_open: bool) -> Option<Role> {
    match path {
        "/healthz" | "/readyz" => return None,
        "/metrics" if metrics_open => return None,
        _ => {}
    }
    if method == Method::GET || method == Method::HEAD {
        return Some(Role::Reader);
    }
    if let Some(rest) = path.strip_prefix("/v1/admin/") {
        // The token floor and backups are the admin's alone; every other admin route is
        // an operator's.
        if rest.starts_with("token") || rest.starts_with("backup") {
            return Some(Role::Admin);
        }
        return Some(Role::Operator);
    }
    if (method == Method::PUT || method == Method::DELETE)
        && let Some(rest) = path.strip_prefix("/v1/pools/")
        && !rest.contains('/')
    {
        return Some(Role::Operator);
    }
    Some(Role::Client)
}

fn bearer<B>(req: &Request<B>) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The token a request acts as. A verified client certificate whose DNS name a token's
/// `cert_subject` names stands for that token; a bearer header, when present, must be
/// valid, and must be the same token as a mapped certificate's. A certificate no token
/// names carries no identity: the bearer header alone decides.
fn caller_token<B>(auth: &Auth, req: &Request<B>) -> Result<Arc<Token>, ApiError> {
    let by_cert = match req.extensions().get::<Arc<ClientCert>>() {
        Some(c) => match auth.lookup_cert(&c.names) {
            CertMatch::None => None,
            CertMatch::One(t) => Some(t),
            CertMatch::Ambiguous => {
                return Err(ApiError::CertRefused(
                    "the client certificate's names map to more than one token",
                ));
            }
        },
        None => None,
    };
    match (bearer(req), by_cert) {
        (Some(secret), cert) => {
            let token = auth.lookup(secret).ok_or(ApiError::Unauthorized)?;
            match cert {
                Some(c) if c.hash != token.hash => Err(ApiError::CertRefused(
                    "the bearer token and the client certificate stand for different tokens",
                )),
                _ => Ok(token),
            }
        }
        (None, Some(token)) => Ok(token),
        (None, None) => Err(ApiError::Unauthorized),
    }
}

impl Gate {
    fn body_limit(&self, path: &str) -> usize {
        if path.starts_with("/v1/queues/") || path.starts_with("/v1/jobs/") {
            self.job_body_bytes
        } else {
            self.max_body_bytes
        }
    }

    /// Lets the request through (with its caller) or answers it at once.
    pub fn admit<B>(&self, req: &mut Request<B>) -> Result<(), ApiError> {
        let path = req.uri().path();
        // A declared length over the limit is refused before a byte of the body is read.
        let limit = self.body_limit(path);
        if let Some(len) = req.headers().get(header::CONTENT_LENGTH)
            && let Some(len) = len.to_str().ok().and_then(|l| l.parse::<u64>().ok())
            && len > limit as u64
        {
            return Err(ApiError::PayloadTooLarge(limit));
        }
        let Some(auth) = &self.auth else {
            return Ok(());
        };
        let Some(role) = needs(req.method(), path, self.metrics_open) else {
            return Ok(());
        };
        let token = caller_token(auth, req)?;
        if token.role < role {
            return Err(ApiError::Forbidden {
                field: None,
                message: format!(
                    "a {} token may not make this call; it needs {}",
                    token.role.as_str(),
                    role.as_str()
                ),
            });
        }
        token
            .take(auth.rate)
            .map_err(|retry_after_s| ApiError::RateLimited { retry_after_s })?;
        req.extensions_mut().insert(Caller::Token(token));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_need_the_documented_roles() {
        let cases = [
            (Method::GET, "/healthz", None),
            (Method::GET, "/readyz", None),
            (Method::GET, "/metrics", Some(Role::Reader)),
            (Method::GET, "/v1/sessions", Some(Role::Reader)),
            (Method::POST, "/v1/sessions", Some(Role::Client)),
            (Method::DELETE, "/v1/sessions/x", Some(Role::Client)),
            (Method::POST, "/v1/locks/a/acquire", Some(Role::Client)),
            (Method::PUT, "/v1/pools/p", Some(Role::Operator)),
            (Method::DELETE, "/v1/pools/p", Some(Role::Operator)),
            (Method::POST, "/v1/pools/p/acquire", Some(Role::Client)),
            (Method::POST, "/v1/admin/reap", Some(Role::Operator)),
            (Method::POST, "/v1/admin/token-floor", Some(Role::Admin)),
            (Method::POST, "/v1/admin/backup", Some(Role::Admin)),
        ];
        for (m, p, want) in cases {
            assert_eq!(needs(&m, p, false), want, "{m} {p}");
        }
        assert_eq!(needs(&Method::GET, "/metrics", true), None);
    }
}
