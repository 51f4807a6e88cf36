//! Configuration: defaults, a TOML file, `LEASEHOLD_*` environment variables and flags, in
//! rising order of precedence, validated once at start-up with messages that name the
//! setting and its unit.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::backend::EngineConfig;
use crate::backend::postgres::PgSettings;
use crate::backend::redis::RedisSettings;
use crate::domain::Limits;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Where the state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// redb in `data_dir`, one node.
    Embedded,
    /// A PostgreSQL database shared by several nodes (`postgres_url`, `namespace`).
    Postgres,
    /// A Redis shared by several nodes (`redis_url`, `namespace`).
    Redis,
}

/// Every setting of `leasehold serve`. Durations are milliseconds (`_ms`), sizes bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address the HTTP API listens on.
    pub listen: SocketAddr,
    /// Where the state lives: `embedded` (redb in `data_dir`), `postgres` or `redis`.
    pub backend: BackendKind,
    /// Directory holding the data file (embedded backend).
    pub data_dir: PathBuf,
    /// A libpq connection URL, e.g. `postgres://leasehold@db1/leasehold` (postgres backend).
    pub postgres_url: Option<String>,
    /// A Redis URL, e.g. `redis://:password@cache1:6379/0` (redis backend).
    pub redis_url: Option<String>,
    /// Start against a Redis that is not crash-durable (not `appendonly yes` with
    /// `appendfsync always`): a warning is logged and the durability class exported.
    pub redis_allow_volatile: bool,
    /// Longest one Redis call may take before it is answered `backend_unavailable`.
    pub redis_timeout_ms: u64,
    /// The schema (postgres) or key prefix (redis) that holds this service's state; several
    /// services can share one database under different namespaces.
    pub namespace: String,
    /// Most connections one node opens to PostgreSQL.
    pub postgres_pool_size: usize,
    /// Longest one PostgreSQL statement may run before it is cancelled.
    pub postgres_statement_timeout_ms: u64,
    pub default_ttl_ms: u64,
    pub min_ttl_ms: u64,
    pub max_ttl_ms: u64,
    /// Longest an acquire may wait for a held lock.
    pub max_wait_ms: u64,
    pub max_locks_per_session: usize,
    /// Run the background reaper. Off, sessions past their deadline are still gone to every
    /// call and are ended inline by contenders or by `POST /v1/admin/reap`.
    pub reaper_enabled: bool,
    /// Longest the reaper sleeps between looks.
    pub reaper_interval_ms: u64,
    /// Most sessions one reaper pass ends in one transaction.
    pub reaper_batch: usize,
    /// About how long one reaper pass may hold the writer; passes are sized to it.
    pub reaper_pass_ms: u64,
    /// How long audit events are kept.
    pub event_retention_ms: u64,
    /// Most audit events one pass trims.
    pub event_trim_batch: usize,
    /// How long finished (done or failed) jobs are kept.
    pub job_retention_ms: u64,
    /// How long the answer to a call that carried a `request_id` is kept for its retries.
    pub request_id_retention_ms: u64,
    /// Most requests applied in one group commit.
    pub max_batch: usize,
    /// Most requests queued for the writer before new ones get 503.
    pub queue_capacity: usize,
    pub max_body_bytes: usize,
    pub header_read_timeout_ms: u64,
    /// A connection with no traffic for this long is closed.
    pub idle_timeout_ms: u64,
    pub max_connections: usize,
    /// Most open connections from one client address.
    pub max_connections_per_client: usize,
    /// Longest the body of one request may take to arrive; slower is 408.
    pub body_read_timeout_ms: u64,
    /// Most requests waiting at once on one lock key, pool or queue; more get 429.
    pub max_waiters_per_key: u32,
    /// Most requests of one token waiting at once; more get 429.
    pub max_waiters_per_token: u32,
    /// Most session watches open on this node at once; more get 503.
    pub max_watches: u32,
    /// Most session watches of one token open at once; more get 429.
    pub max_watches_per_token: u32,
    /// How often a watch re-reads its session and the audit log unprompted; the longest a
    /// grace, or an end no prompt announced, waits to be reported.
    pub watch_recheck_ms: u64,
    /// How often an idle watch stream carries a keep-alive comment.
    pub watch_keepalive_ms: u64,
    /// The API tokens file (see docs/security.md). Without one the server serves loopback
    /// addresses only, and every caller may do everything.
    pub tokens_file: Option<PathBuf>,
    /// Requests a second one token may make, sustained; more get 429 with Retry-After.
    pub rate_limit_per_s: f64,
    /// Requests one token may make at once above the sustained rate.
    pub rate_limit_burst: u32,
    /// Serve `/metrics` without a token (with tokens configured).
    pub metrics_open: bool,
    /// PEM certificate chain: with `tls_key_file`, the port speaks HTTPS only. Both are
    /// read again on SIGHUP.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of the certificate.
    pub tls_key_file: Option<PathBuf>,
    /// PEM certificates of the CAs whose client certificates the server verifies; a
    /// verified certificate whose DNS name a token's `cert_subject` names acts as that
    /// token. Read again on SIGHUP.
    pub tls_client_ca: Option<PathBuf>,
    /// Whether a client must present a certificate (`required`) or may (`optional`).
    pub tls_client_auth: ClientAuth,
    /// How long a shutdown waits for in-flight requests.
    pub shutdown_grace_ms: u64,
    /// redb's page cache.
    pub cache_size_bytes: usize,
    pub log_format: LogFormat,
    /// A tracing filter directive, e.g. `info` or `leasehold=debug`.
    pub log_level: String,
}

impl Default for Config {
    fn default() -> Config {
        let engine = EngineConfig::default();
        let limits = Limits::default();
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 7878)),
            backend: BackendKind::Embedded,
            data_dir: PathBuf::from("leasehold-data"),
            postgres_url: None,
            redis_url: None,
            redis_allow_volatile: false,
            redis_timeout_ms: 3_000,
            namespace: "leasehold".into(),
            postgres_pool_size: 16,
            postgres_statement_timeout_ms: 5_000,
            default_ttl_ms: limits.default_ttl_ms,
            min_ttl_ms: limits.min_ttl_ms,
            max_ttl_ms: limits.max_ttl_ms,
            max_wait_ms: engine.max_wait_ms,
            max_locks_per_session: limits.max_locks_per_session,
            reaper_enabled: true,
            reaper_interval_ms: engine.reaper_interval_ms,
            reaper_batch: engine.reaper_batch,
            reaper_pass_ms: engine.reaper_pass_ms,
            event_retention_ms: engine.event_retention_ms,
            event_trim_batch: engine.event_trim_batch,
            job_retention_ms: engine.job_retention_ms,
            request_id_retention_ms: engine.request_id_retention_ms,
            max_batch: engine.max_batch,
            queue_capacity: engine.queue_capacity,
            max_body_bytes: 64 * 1024,
            header_read_timeout_ms: 5_000,
            idle_timeout_ms: 120_000,
            max_connections: 4_096,
            max_connections_per_client: 1_024,
            body_read_timeout_ms: 10_000,
            max_waiters_per_key: 1_000,
            max_waiters_per_token: 1_000,
            max_watches: 1_000,
            max_watches_per_token: 100,
            watch_recheck_ms: 1_000,
            watch_keepalive_ms: 15_000,
            tokens_file: None,
            rate_limit_per_s: 1_000.0,
            rate_limit_burst: 2_000,
            metrics_open: false,
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca: None,
            tls_client_auth: ClientAuth::Optional,
            shutdown_grace_ms: 10_000,
            cache_size_bytes: 64 * 1024 * 1024,
            log_format: LogFormat::Text,
            log_level: "info".into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("setting {0}")]
    Invalid(String),
}

fn range<T: PartialOrd + std::fmt::Display>(
    name: &str,
    value: T,
    min: T,
    max: T,
    unit: &str,
) -> Result<(), ConfigError> {
    if value < min || value > max {
        return Err(ConfigError::Invalid(format!(
            "{name} = {value} is out of range: it must be between {min} and {max} {unit}"
        )));
    }
    Ok(())
}

/// A namespace becomes a schema name or a key prefix: keep it to what both accept unquoted.
pub fn valid_namespace(ns: &str) -> bool {
    let mut chars = ns.chars();
    matches!(chars.next(), Some('a'..='z' | '_'))
        && ns.len() <= 48
        && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
}

impl Config {
    /// Builds the configuration: defaults, then `file` (if any), then `overrides` (the
    /// settings given as flags or environment variables), then validates it.
    pub fn load(file: Option<&Path>, overrides: toml::Table) -> Result<Config, ConfigError> {
        let mut table = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_path_buf(),
                    source,
                })?;
                text.parse::<toml::Table>()
                    .map_err(|e| ConfigError::Parse {
                        path: path.to_path_buf(),
                        message: e.to_string(),
                    })?
            }
            None => toml::Table::new(),
        };
        table.extend(overrides);
        let config: Config = table
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                path: file
                    .map(Path::to_path_buf)
                    .unwrap_or_else(|| "<flags>".into()),
                message: e.message().to_string(),
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every rule once, naming the setting and its unit.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const DAY_MS: u64 = 86_400_000;
        if self.backend == BackendKind::Postgres && self.postgres_url.is_none() {
            return Err(ConfigError::Invalid(
                "backend = \"postgres\" needs postgres_url (a libpq URL such as postgres://user@host:5432/db)".into(),
            ));
        }
        if self.backend == BackendKind::Redis && self.redis_url.is_none() {
            return Err(ConfigError::Invalid(
                "backend = \"redis\" needs redis_url (a Redis URL such as redis://host:6379/0)"
                    .into(),
            ));
        }
        range(
            "redis_timeout_ms",
            self.redis_timeout_ms,
            100,
            600_000,
            "milliseconds",
        )?;
        if !valid_namespace(&self.namespace) {
            return Err(ConfigError::Invalid(format!(
                "namespace = {:?} must be 1 to 48 characters of a-z, 0-9 and _, starting with a letter or _",
                self.namespace
            )));
        }
        range(
            "postgres_pool_size",
            self.postgres_pool_size,
            1,
            1_000,
            "connections",
        )?;
        range(
            "postgres_statement_timeout_ms",
            self.postgres_statement_timeout_ms,
            10,
            600_000,
            "milliseconds",
        )?;
        range("min_ttl_ms", self.min_ttl_ms, 100, DAY_MS, "milliseconds")?;
        range(
            "max_ttl_ms",
            self.max_ttl_ms,
            self.min_ttl_ms,
            30 * DAY_MS,
            "milliseconds (and at least min_ttl_ms)",
        )?;
        range(
            "default_ttl_ms",
            self.default_ttl_ms,
            self.min_ttl_ms,
            self.max_ttl_ms,
            "milliseconds (between min_ttl_ms and max_ttl_ms)",
        )?;
        range(
            "max_wait_ms",
            self.max_wait_ms,
            0,
            3_600_000,
            "milliseconds",
        )?;
        range(
            "max_locks_per_session",
            self.max_locks_per_session,
            1,
            1_000_000,
            "locks",
        )?;
        range(
            "reaper_interval_ms",
            self.reaper_interval_ms,
            10,
            60_000,
            "milliseconds",
        )?;
        range("reaper_batch", self.reaper_batch, 1, 1_000_000, "sessions")?;
        range(
            "reaper_pass_ms",
            self.reaper_pass_ms,
            1,
            10_000,
            "milliseconds",
        )?;
        range(
            "event_retention_ms",
            self.event_retention_ms,
            1_000,
            3_650 * DAY_MS,
            "milliseconds",
        )?;
        range(
            "event_trim_batch",
            self.event_trim_batch,
            1,
            1_000_000,
            "events",
        )?;
        range(
            "job_retention_ms",
            self.job_retention_ms,
            1_000,
            3_650 * DAY_MS,
            "milliseconds",
        )?;
        range(
            "request_id_retention_ms",
            self.request_id_retention_ms,
            1_000,
            7 * DAY_MS,
            "milliseconds",
        )?;
        range("max_batch", self.max_batch, 1, 65_536, "requests")?;
        range(
            "queue_capacity",
            self.queue_capacity,
            1,
            10_000_000,
            "requests",
        )?;
        range(
            "max_body_bytes",
            self.max_body_bytes,
            1_024,
            64 * 1024 * 1024,
            "bytes",
        )?;
        range(
            "header_read_timeout_ms",
            self.header_read_timeout_ms,
            10,
            600_000,
            "milliseconds",
        )?;
        range(
            "idle_timeout_ms",
            self.idle_timeout_ms,
            100,
            86_400_000,
            "milliseconds",
        )?;
        if self.idle_timeout_ms <= self.max_wait_ms {
            return Err(ConfigError::Invalid(format!(
                "idle_timeout_ms = {} must be greater than max_wait_ms = {} (milliseconds): a request waiting for a lock moves no bytes",
                self.idle_timeout_ms, self.max_wait_ms
            )));
        }
        range(
            "max_connections",
            self.max_connections,
            1,
            1_000_000,
            "connections",
        )?;
        range(
            "max_connections_per_client",
            self.max_connections_per_client,
            1,
            self.max_connections,
            "connections (and at most max_connections)",
        )?;
        range(
            "body_read_timeout_ms",
            self.body_read_timeout_ms,
            10,
            600_000,
            "milliseconds",
        )?;
        range(
            "max_waiters_per_key",
            self.max_waiters_per_key,
            1,
            1_000_000,
            "requests",
        )?;
        range(
            "max_waiters_per_token",
            self.max_waiters_per_token,
            1,
            1_000_000,
            "requests",
        )?;
        range("max_watches", self.max_watches, 1, 1_000_000, "watches")?;
        range(
            "max_watches_per_token",
            self.max_watches_per_token,
            1,
            self.max_watches,
            "watches (and at most max_watches)",
        )?;
        range(
            "watch_recheck_ms",
            self.watch_recheck_ms,
            10,
            60_000,
            "milliseconds",
        )?;
        range(
            "watch_keepalive_ms",
            self.watch_keepalive_ms,
            1_000,
            300_000,
            "milliseconds",
        )?;
        if !(self.rate_limit_per_s.is_finite()
            && self.rate_limit_per_s >= 0.001
            && self.rate_limit_per_s <= 1e9)
        {
            return Err(ConfigError::Invalid(format!(
                "rate_limit_per_s = {} is out of range: it must be between 0.001 and 1000000000 requests a second",
                self.rate_limit_per_s
            )));
        }
        range(
            "rate_limit_burst",
            self.rate_limit_burst,
            1,
            1_000_000_000,
            "requests",
        )?;
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(ConfigError::Invalid(
                "tls_cert_file and tls_key_file go together: set both for HTTPS, or neither".into(),
            ));
        }
        if self.tls_client_ca.is_some() && self.tls_cert_file.is_none() {
            return Err(ConfigError::Invalid(
                "tls_client_ca needs tls_cert_file and tls_key_file: client certificates are checked in the TLS handshake".into(),
            ));
        }
        if self.tls_client_auth == ClientAuth::Required && self.tls_client_ca.is_none() {
            return Err(ConfigError::Invalid(
                "tls_client_auth = \"required\" needs tls_client_ca: the CAs client certificates are verified against".into(),
            ));
        }
        if self.tokens_file.is_none() && !self.listen.ip().is_loopback() {
            return Err(ConfigError::Invalid(format!(
                "listen = {} is not a loopback address and no tokens_file is set: without API tokens anyone who can reach the port could end any session; create a token (leasehold tokens create) and set tokens_file, or listen on 127.0.0.1",
                self.listen
            )));
        }
        range(
            "shutdown_grace_ms",
            self.shutdown_grace_ms,
            0,
            600_000,
            "milliseconds",
        )?;
        range(
            "cache_size_bytes",
            self.cache_size_bytes,
            1024 * 1024,
            1 << 40,
            "bytes",
        )?;
        if tracing_subscriber::EnvFilter::try_new(&self.log_level).is_err() {
            return Err(ConfigError::Invalid(format!(
                "log_level = {:?} is not a valid filter (try \"info\" or \"leasehold=debug\")",
                self.log_level
            )));
        }
        Ok(())
    }

    /// How the PostgreSQL backend reaches its database (`postgres_url` is checked by
    /// `validate` when `backend = "postgres"`).
    pub fn postgres(&self) -> PgSettings {
        PgSettings {
            url: self.postgres_url.clone().unwrap_or_default(),
            namespace: self.namespace.clone(),
            pool_size: self.postgres_pool_size,
            statement_timeout_ms: self.postgres_statement_timeout_ms,
        }
    }

    pub fn api(&self) -> crate::api::ApiLimits {
        crate::api::ApiLimits {
            max_body_bytes: self.max_body_bytes,
            body_read_timeout: std::time::Duration::from_millis(self.body_read_timeout_ms),
            max_waiters_per_key: self.max_waiters_per_key,
            max_waiters_per_token: self.max_waiters_per_token,
            watch: crate::api::watch::WatchLimits {
                max_watches: self.max_watches,
                max_watches_per_token: self.max_watches_per_token,
                recheck: std::time::Duration::from_millis(self.watch_recheck_ms),
                // A stream must move bytes before the idle timeout closes its connection.
                keepalive: std::time::Duration::from_millis(
                    self.watch_keepalive_ms.min(self.idle_timeout_ms / 2).max(1),
                ),
            },
        }
    }

    pub fn rate_limit(&self) -> crate::auth::RateLimit {
        crate::auth::RateLimit {
            per_s: self.rate_limit_per_s,
            burst: f64::from(self.rate_limit_burst),
        }
    }

    /// How the Redis backend reaches Redis (`redis_url` is checked by `validate` when
    /// `backend = "redis"`).
    pub fn redis(&self) -> RedisSettings {
        RedisSettings {
            url: self.redis_url.clone().unwrap_or_default(),
            namespace: self.namespace.clone(),
            allow_volatile: self.redis_allow_volatile,
            timeout_ms: self.redis_timeout_ms,
        }
    }

    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            limits: Limits {
                min_ttl_ms: self.min_ttl_ms,
                max_ttl_ms: self.max_ttl_ms,
                default_ttl_ms: self.default_ttl_ms,
                max_locks_per_session: self.max_locks_per_session,
            },
            max_wait_ms: self.max_wait_ms,
            reaper_enabled: self.reaper_enabled,
            reaper_interval_ms: self.reaper_interval_ms,
            reaper_batch: self.reaper_batch,
            reaper_pass_ms: self.reaper_pass_ms,
            event_retention_ms: self.event_retention_ms,
            event_trim_batch: self.event_trim_batch,
            job_retention_ms: self.job_retention_ms,
            request_id_retention_ms: self.request_id_retention_ms,
            max_batch: self.max_batch,
            queue_capacity: self.queue_capacity,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overrides(pairs: &[(&str, toml::Value)]) -> toml::Table {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
        assert_eq!(
            Config::load(None, toml::Table::new()).unwrap(),
            Config::default()
        );
    }

    #[test]
    fn file_then_overrides() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leasehold.toml");
        std::fs::write(
            &path,
            "reaper_interval_ms = 250\nlisten = \"0.0.0.0:9000\"\n",
        )
        .unwrap();
        let c = Config::load(
            Some(&path),
            overrides(&[("listen", toml::Value::String("127.0.0.1:9001".into()))]),
        )
        .unwrap();
        assert_eq!(c.reaper_interval_ms, 250);
        assert_eq!(c.listen.port(), 9001);
    }

    #[test]
    fn errors_name_the_setting_and_unit() {
        let cases: &[(&str, toml::Value, &str)] = &[
            (
                "reaper_interval_ms",
                toml::Value::Integer(1),
                "reaper_interval_ms = 1 is out of range: it must be between 10 and 60000 milliseconds",
            ),
            (
                "default_ttl_ms",
                toml::Value::Integer(500),
                "default_ttl_ms = 500",
            ),
            ("max_body_bytes", toml::Value::Integer(10), "bytes"),
            (
                "request_id_retention_ms",
                toml::Value::Integer(999),
                "request_id_retention_ms = 999 is out of range: it must be between 1000 and 604800000 milliseconds",
            ),
            ("log_level", toml::Value::String("[[".into()), "log_level"),
            (
                "backend",
                toml::Value::String("postgres".into()),
                "needs postgres_url",
            ),
            (
                "backend",
                toml::Value::String("redis".into()),
                "needs redis_url",
            ),
            (
                "namespace",
                toml::Value::String("Bad-Name".into()),
                "namespace",
            ),
        ];
        for (name, value, expect) in cases {
            let err = Config::load(None, overrides(&[(name, value.clone())])).unwrap_err();
            assert!(err.to_string().contains(expect), "{name}: {err}");
        }
    }

    #[test]
    fn unknown_settings_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leasehold.toml");
        std::fs::write(&path, "reaper_intervall_ms = 250\n").unwrap();
        let err = Config::load(Some(&path), toml::Table::new()).unwrap_err();
        assert!(err.to_string().contains("reaper_intervall_ms"), "{err}");
    }
}

/// Whether a TLS client must present a certificate signed by `tls_client_ca`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    /// A client may present one; without one it authenticates with a bearer token.
    #[default]
    Optional,
    /// The handshake fails without a verified client certificate.
    Required,
}
