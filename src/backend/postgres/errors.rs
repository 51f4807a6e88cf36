//! What a PostgreSQL failure means for the caller: retry the transaction (the server rolled
//! it back: a deadlock or serialization failure), a unique violation (a race to create the
//! same row), or unavailable (the outcome of a mutation is unknown).

use crate::backend::BackendError;

#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("PostgreSQL: {}", chain(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("no PostgreSQL connection: {}", chain(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
}

/// An error with its causes: the driver's own message alone ("error connecting to server")
/// leaves out why.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

/// SQLSTATEs after which the server has rolled the transaction back, so running it again
/// from the start cannot apply anything twice.
const RETRYABLE: &[&str] = &["40001", "40P01"];
const UNIQUE_VIOLATION: &str = "23505";
const QUERY_CANCELED: &str = "57014";

impl PgError {
    fn code(&self) -> Option<&str> {
        match self {
            PgError::Db(e) => e.as_db_error().map(|d| d.code().code()),
            PgError::Pool(deadpool_postgres::PoolError::Backend(e)) => {
                e.as_db_error().map(|d| d.code().code())
            }
            PgError::Pool(_) => None,
        }
    }

    /// A deadlock or serialization failure: nothing was applied.
    pub fn is_retryable(&self) -> bool {
        self.code().is_some_and(|c| RETRYABLE.contains(&c))
    }

    pub fn is_unique_violation(&self) -> bool {
        self.code() == Some(UNIQUE_VIOLATION)
    }

    /// The database could not be reached, or the connection broke: the node is not ready
    /// until a probe gets through again.
    pub fn is_connection(&self) -> bool {
        match self {
            PgError::Db(e) => {
                e.is_closed()
                    || e.as_db_error().is_none()
                    || self.code().is_some_and(|c| {
                        c.starts_with("08") || c.starts_with("57P") || c == "53300"
                    })
            }
            PgError::Pool(_) => true,
        }
    }

    /// Said to the client: no SQL text, no parameters.
    pub fn describe(&self) -> String {
        match self.code() {
            Some(QUERY_CANCELED) => "a PostgreSQL statement ran past statement_timeout".into(),
            _ if self.is_connection() => format!("PostgreSQL is unreachable ({self})"),
            _ => self.to_string(),
        }
    }
}

impl From<PgError> for BackendError {
    fn from(e: PgError) -> BackendError {
        if !e.is_connection() && e.code() != Some(QUERY_CANCELED) {
            // Neither the network nor a timeout: a statement the schema refused.
            tracing::error!(error = %e, "PostgreSQL refused a statement");
        }
        BackendError::Unavailable(e.describe())
    }
}

/// A connection URL with its password replaced, for logs and messages. Handles both the
/// URL form (`postgres://user:secret@host/db`) and the key-value form (`password=secret`).
pub fn redact(url: &str) -> String {
    if let Some(rest) = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
    {
        let scheme = &url[..url.len() - rest.len()];
        let (authority, tail) = match rest.find(['/', '?']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let authority = match authority.rfind('@') {
            Some(at) => {
                let (user_info, host) = authority.split_at(at);
                match user_info.find(':') {
                    Some(colon) => format!("{}:***{host}", &user_info[..colon]),
                    None => authority.to_string(),
                }
            }
            None => authority.to_string(),
        };
        let tail = redact_query(tail);
        return format!("{scheme}{authority}{tail}");
    }
    url.split_whitespace()
        .map(|part| match part.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => part.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn redact_query(tail: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_string();
    };
    let query = query
        .split('&')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => kv.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{path}?{query}")
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_never_reach_the_log() {
        let cases = [
            (
                "postgres://app:s3cret@db1:5432/leasehold",
                "postgres://app:***@db1:5432/leasehold",
            ),
            ("postgres://app@db1/x", "postgres://app@db1/x"),
            (
                "postgresql://db1/x?user=a&password=p",
                "postgresql://db1/x?user=a&password=***",
            ),
            (
                "host=db1 user=app password=s3cret dbname=x",
                "host=db1 user=app password=*** dbname=x",
            ),
        ];
        for (url, want) in cases {
            assert_eq!(redact(url), want);
        }
    }
}
