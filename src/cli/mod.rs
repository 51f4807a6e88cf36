//! The command line: `serve`, the client commands that talk to a running server, the
//! offline integrity check and the PostgreSQL migrations.

mod backup;
mod bench;
mod check;
mod generate;
mod notify;
mod remote;
mod run;
mod serve;
mod tokens;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use serde::Serialize;

use crate::config::LogFormat;

#[derive(Parser)]
#[command(
    name = "leasehold",
    version,
    about = "Sessions, fenced locks, seat pools and job leases in one binary"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server.
    Serve(Box<ServeArgs>),
    /// Verify the stored state offline; exits 1 with a report when an invariant does not
    /// hold.
    Check {
        /// The data directory (the server must not be running on it).
        #[arg(long, env = "LEASEHOLD_DATA_DIR", default_value = "leasehold-data")]
        data_dir: PathBuf,
        /// Which store to check.
        #[arg(
            long,
            env = "LEASEHOLD_BACKEND",
            value_enum,
            default_value = "embedded"
        )]
        backend: crate::config::BackendKind,
        #[command(flatten)]
        postgres: PostgresArgs,
        /// Redis URL, for --backend redis.
        #[arg(long, env = "LEASEHOLD_REDIS_URL")]
        redis_url: Option<String>,
    },
    /// Give the embedded data file's free space back to the file system, offline, and check
    /// the result (a running server reuses free pages but keeps the file's size).
    Compact {
        /// The data directory (the server must not be running on it).
        #[arg(long, env = "LEASEHOLD_DATA_DIR", default_value = "leasehold-data")]
        data_dir: PathBuf,
    },
    /// Apply the PostgreSQL schema migrations of a namespace (serve also applies them at
    /// start); refuses a schema newer than this build knows.
    Migrate {
        #[command(flatten)]
        postgres: PostgresArgs,
    },
    /// Inspect or end sessions on a running server.
    Sessions {
        #[command(flatten)]
        server: ServerArg,
        #[command(subcommand)]
        action: SessionsAction,
    },
    /// Inspect locks on a running server.
    Locks {
        #[command(flatten)]
        server: ServerArg,
        #[command(subcommand)]
        action: LocksAction,
    },
    /// Inspect, create, resize or delete seat pools on a running server.
    Pools {
        #[command(flatten)]
        server: ServerArg,
        #[command(subcommand)]
        action: PoolsAction,
    },
    /// Inspect jobs and queues, list dead letters, requeue failed jobs.
    Jobs {
        #[command(flatten)]
        server: ServerArg,
        #[command(subcommand)]
        action: JobsAction,
    },
    /// Print the audit log.
    Events {
        #[command(flatten)]
        server: ServerArg,
        /// Start after this sequence number.
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// Most events per request.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// Keep polling for new events.
        #[arg(long)]
        follow: bool,
    },
    /// Generate load against a running server and report throughput and latency.
    Bench(bench::BenchArgs),
    /// Run a command while holding a lock and/or seats; stop it if the lease is lost.
    Run(Box<run::RunArgs>),
    /// Run a reaper pass now, or with --dry-run list what it would end.
    Reap {
        #[command(flatten)]
        server: ServerArg,
        #[arg(long)]
        dry_run: bool,
    },
    /// API tokens in a tokens file (create, list, revoke; the server reloads the file on
    /// SIGHUP), and the fencing-token floor of a running server (raise-floor).
    Tokens {
        /// The tokens file, as the server's tokens_file setting names it (create, list,
        /// revoke).
        #[arg(long, env = "LEASEHOLD_TOKENS_FILE", global = true)]
        file: Option<PathBuf>,
        #[command(flatten)]
        server: ServerArg,
        #[command(subcommand)]
        action: tokens::TokensAction,
    },
    /// Write a consistent snapshot of a running embedded server to a file, without stopping
    /// it.
    Backup(backup::BackupArgs),
    /// Make a backup the data directory of a stopped server: verified, checked, and with the
    /// token counter raised above every token issued before the restore.
    Restore(backup::RestoreArgs),
    /// Write the manual pages or the shell completions (used by the package build).
    #[command(hide = true)]
    Generate {
        #[command(subcommand)]
        what: GenerateWhat,
    },
}

#[derive(Subcommand)]
enum GenerateWhat {
    /// A page for `leasehold` and for each subcommand, in section 1.
    Man {
        /// Directory to write into (created if missing).
        #[arg(long)]
        out: PathBuf,
    },
    /// bash, zsh and fish completions.
    Completions {
        /// Directory to write into (created if missing).
        #[arg(long)]
        out: PathBuf,
    },
}

/// Where the PostgreSQL state lives.
#[derive(Args)]
struct PostgresArgs {
    /// PostgreSQL connection URL (libpq form).
    #[arg(long, env = "LEASEHOLD_POSTGRES_URL")]
    postgres_url: Option<String>,
    /// Schema (postgres) or key prefix (redis) holding the state.
    #[arg(long, env = "LEASEHOLD_NAMESPACE", default_value = "leasehold")]
    namespace: String,
}

#[derive(Args)]
struct ServerArg {
    /// The server's base URL.
    #[arg(
        long,
        env = "LEASEHOLD_SERVER",
        default_value = "http://127.0.0.1:7878",
        global = true
    )]
    server: String,
    /// The API token to call with (sent as `Authorization: Bearer`); needed when the
    /// server has a tokens file.
    #[arg(
        long,
        env = "LEASEHOLD_API_TOKEN",
        global = true,
        hide_env_values = true
    )]
    token: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
}

/// How an `https://` server is verified, and the certificate presented to it.
#[derive(Args, Clone, Default)]
pub(crate) struct TlsArgs {
    /// PEM file of the CA certificates an https:// server's certificate must chain to
    /// (the only roots trusted; required for https://).
    #[arg(long, env = "LEASEHOLD_CA_FILE", value_name = "PEM", global = true)]
    ca_file: Option<PathBuf>,
    /// PEM client certificate chain, for a server that maps client certificates to tokens.
    #[arg(
        long,
        env = "LEASEHOLD_CLIENT_CERT",
        value_name = "PEM",
        requires = "client_key",
        global = true
    )]
    client_cert: Option<PathBuf>,
    /// PEM private key of --client-cert.
    #[arg(
        long,
        env = "LEASEHOLD_CLIENT_KEY",
        value_name = "PEM",
        requires = "client_cert",
        global = true,
        hide_env_values = true
    )]
    client_key: Option<PathBuf>,
}

impl TlsArgs {
    pub(crate) fn files(&self) -> crate::client::TlsFiles {
        crate::client::TlsFiles {
            ca_file: self.ca_file.clone(),
            client_cert: self.client_cert.clone(),
            client_key: self.client_key.clone(),
        }
    }
}

#[derive(Subcommand)]
enum SessionsAction {
    /// List live sessions.
    List {
        #[arg(long)]
        owner: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Show one session and what it holds.
    Show { id: String },
    /// End a session as an operator (audited); releases everything it holds.
    End { id: String },
}

#[derive(Subcommand)]
enum LocksAction {
    /// List held locks.
    List {
        #[arg(long, default_value = "")]
        prefix: String,
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Show who holds a lock.
    Show { key: String },
}

#[derive(Subcommand)]
enum PoolsAction {
    /// List pools with their use.
    List,
    /// Show a pool and every seat holder.
    Show { pool: String },
    /// Create a pool or change its capacity.
    Put {
        pool: String,
        #[arg(long)]
        capacity: u64,
    },
    /// Delete an empty pool.
    Delete { pool: String },
}

#[derive(Subcommand)]
enum JobsAction {
    /// Show one job.
    Show { id: String },
    /// Show a queue's counts by state.
    Queue { queue: String },
    /// List a queue's failed jobs (dead letters).
    Failed {
        queue: String,
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Send a failed job back to its queue (audited).
    Requeue { id: String },
}

/// Every setting of `serve`, as a flag and a `LEASEHOLD_*` variable; unset ones fall back to
/// the config file, then the defaults (see `Config`).
#[derive(Args, Serialize, Default)]
pub struct ServeArgs {
    /// A TOML file with any of the settings below (names as in the file: `reaper_interval_ms`).
    #[arg(long, env = "LEASEHOLD_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:7878]
    #[arg(long, env = "LEASEHOLD_LISTEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<SocketAddr>,
    /// Where the state lives [default: embedded]
    #[arg(long, env = "LEASEHOLD_BACKEND", value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    backend: Option<crate::config::BackendKind>,
    /// Data directory of the embedded backend [default: leasehold-data]
    #[arg(long, env = "LEASEHOLD_DATA_DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    data_dir: Option<PathBuf>,
    /// PostgreSQL connection URL (libpq form), for --backend postgres
    #[arg(long, env = "LEASEHOLD_POSTGRES_URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_url: Option<String>,
    /// Redis URL, for --backend redis
    #[arg(long, env = "LEASEHOLD_REDIS_URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    redis_url: Option<String>,
    /// Start against a Redis that is not crash-durable [default: false]
    #[arg(long, env = "LEASEHOLD_REDIS_ALLOW_VOLATILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    redis_allow_volatile: Option<bool>,
    /// Longest one Redis call may take, in ms [default: 3000]
    #[arg(long, env = "LEASEHOLD_REDIS_TIMEOUT_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    redis_timeout_ms: Option<u64>,
    /// Schema (postgres) or key prefix (redis) holding this service's state [default: leasehold]
    #[arg(long, env = "LEASEHOLD_NAMESPACE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<String>,
    /// Most connections one node opens to PostgreSQL [default: 16]
    #[arg(long, env = "LEASEHOLD_POSTGRES_POOL_SIZE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_pool_size: Option<usize>,
    /// Longest one PostgreSQL statement may run, in ms [default: 5000]
    #[arg(long, env = "LEASEHOLD_POSTGRES_STATEMENT_TIMEOUT_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    postgres_statement_timeout_ms: Option<u64>,
    /// TTL of a session that asks for none, in ms [default: 15000]
    #[arg(long, env = "LEASEHOLD_DEFAULT_TTL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    default_ttl_ms: Option<u64>,
    /// Shortest TTL a session may ask for, in ms [default: 1000]
    #[arg(long, env = "LEASEHOLD_MIN_TTL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    min_ttl_ms: Option<u64>,
    /// Longest TTL a session may ask for, in ms [default: 86400000]
    #[arg(long, env = "LEASEHOLD_MAX_TTL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_ttl_ms: Option<u64>,
    /// Longest an acquire may wait for a held lock, in ms [default: 60000]
    #[arg(long, env = "LEASEHOLD_MAX_WAIT_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_wait_ms: Option<u64>,
    /// Most locks one session may hold [default: 10000]
    #[arg(long, env = "LEASEHOLD_MAX_LOCKS_PER_SESSION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_locks_per_session: Option<usize>,
    /// Run the background reaper [default: true]
    #[arg(long, env = "LEASEHOLD_REAPER_ENABLED")]
    #[serde(skip_serializing_if = "Option::is_none")]
    reaper_enabled: Option<bool>,
    /// Longest the reaper sleeps between looks, in ms [default: 1000]
    #[arg(long, env = "LEASEHOLD_REAPER_INTERVAL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    reaper_interval_ms: Option<u64>,
    /// Most sessions one reaper pass ends [default: 10000]
    #[arg(long, env = "LEASEHOLD_REAPER_BATCH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    reaper_batch: Option<usize>,
    /// About how long one reaper pass may hold the writer, in ms [default: 2]
    #[arg(long, env = "LEASEHOLD_REAPER_PASS_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    reaper_pass_ms: Option<u64>,
    /// How long audit events are kept, in ms [default: 604800000]
    #[arg(long, env = "LEASEHOLD_EVENT_RETENTION_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    event_retention_ms: Option<u64>,
    /// Most audit events trimmed per pass [default: 10000]
    #[arg(long, env = "LEASEHOLD_EVENT_TRIM_BATCH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    event_trim_batch: Option<usize>,
    /// How long finished jobs are kept, in ms [default: 604800000]
    #[arg(long, env = "LEASEHOLD_JOB_RETENTION_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    job_retention_ms: Option<u64>,
    /// How long the answer to a call with a request_id is kept for its retries, in ms
    /// [default: 86400000]
    #[arg(long, env = "LEASEHOLD_REQUEST_ID_RETENTION_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id_retention_ms: Option<u64>,
    /// Most requests in one group commit [default: 4096]
    #[arg(long, env = "LEASEHOLD_MAX_BATCH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_batch: Option<usize>,
    /// Most requests queued for the writer [default: 65536]
    #[arg(long, env = "LEASEHOLD_QUEUE_CAPACITY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    queue_capacity: Option<usize>,
    /// Largest request body, in bytes [default: 65536]
    #[arg(long, env = "LEASEHOLD_MAX_BODY_BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_body_bytes: Option<usize>,
    /// Time allowed to send request headers, in ms [default: 5000]
    #[arg(long, env = "LEASEHOLD_HEADER_READ_TIMEOUT_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    header_read_timeout_ms: Option<u64>,
    /// A connection silent this long is closed, in ms [default: 120000]
    #[arg(long, env = "LEASEHOLD_IDLE_TIMEOUT_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    idle_timeout_ms: Option<u64>,
    /// Most open connections [default: 4096]
    #[arg(long, env = "LEASEHOLD_MAX_CONNECTIONS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_connections: Option<usize>,
    /// Most open connections from one client address [default: 1024]
    #[arg(long, env = "LEASEHOLD_MAX_CONNECTIONS_PER_CLIENT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_connections_per_client: Option<usize>,
    /// Longest a request body may take to arrive, in ms [default: 10000]
    #[arg(long, env = "LEASEHOLD_BODY_READ_TIMEOUT_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    body_read_timeout_ms: Option<u64>,
    /// Most requests waiting on one key, pool or queue [default: 1000]
    #[arg(long, env = "LEASEHOLD_MAX_WAITERS_PER_KEY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_waiters_per_key: Option<u32>,
    /// Most requests of one token waiting at once [default: 1000]
    #[arg(long, env = "LEASEHOLD_MAX_WAITERS_PER_TOKEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_waiters_per_token: Option<u32>,
    /// Most session watches open on this node at once [default: 1000]
    #[arg(long, env = "LEASEHOLD_MAX_WATCHES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_watches: Option<u32>,
    /// Most session watches of one token open at once [default: 100]
    #[arg(long, env = "LEASEHOLD_MAX_WATCHES_PER_TOKEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_watches_per_token: Option<u32>,
    /// How often a watch re-reads its session unprompted, in ms [default: 1000]
    #[arg(long, env = "LEASEHOLD_WATCH_RECHECK_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    watch_recheck_ms: Option<u64>,
    /// How often an idle watch stream carries a keep-alive comment, in ms [default: 15000]
    #[arg(long, env = "LEASEHOLD_WATCH_KEEPALIVE_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    watch_keepalive_ms: Option<u64>,
    /// The API tokens file; without one only loopback addresses may be served [default: none]
    #[arg(long, env = "LEASEHOLD_TOKENS_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens_file: Option<PathBuf>,
    /// Requests a second per token, sustained [default: 1000]
    #[arg(long, env = "LEASEHOLD_RATE_LIMIT_PER_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    rate_limit_per_s: Option<f64>,
    /// Requests per token at once above the sustained rate [default: 2000]
    #[arg(long, env = "LEASEHOLD_RATE_LIMIT_BURST")]
    #[serde(skip_serializing_if = "Option::is_none")]
    rate_limit_burst: Option<u32>,
    /// Serve /metrics without a token [default: false]
    #[arg(long, env = "LEASEHOLD_METRICS_OPEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    metrics_open: Option<bool>,
    /// PEM certificate chain; with --tls-key-file the port speaks HTTPS [default: none]
    #[arg(long, env = "LEASEHOLD_TLS_CERT_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_cert_file: Option<PathBuf>,
    /// PEM private key of the certificate [default: none]
    #[arg(long, env = "LEASEHOLD_TLS_KEY_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_key_file: Option<PathBuf>,
    /// PEM CA certificates that client certificates are verified against [default: none]
    #[arg(long, env = "LEASEHOLD_TLS_CLIENT_CA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_client_ca: Option<PathBuf>,
    /// Client certificates: optional or required [default: optional]
    #[arg(long, env = "LEASEHOLD_TLS_CLIENT_AUTH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_client_auth: Option<crate::config::ClientAuth>,
    /// How long shutdown waits for in-flight requests, in ms [default: 10000]
    #[arg(long, env = "LEASEHOLD_SHUTDOWN_GRACE_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    shutdown_grace_ms: Option<u64>,
    /// redb page cache, in bytes [default: 67108864]
    #[arg(long, env = "LEASEHOLD_CACHE_SIZE_BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_size_bytes: Option<usize>,
    /// Log format [default: text]
    #[arg(long, env = "LEASEHOLD_LOG_FORMAT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    log_format: Option<LogFormat>,
    /// Log filter, e.g. info or leasehold=debug [default: info]
    #[arg(long, env = "LEASEHOLD_LOG_LEVEL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    log_level: Option<String>,
}

pub fn run(cli: Cli) -> ExitCode {
    if cli.command.ends_quietly_on_a_closed_pipe() {
        stop_at_a_closed_pipe();
    }
    match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Check {
            data_dir,
            backend,
            postgres,
            redis_url,
        } => match backend {
            crate::config::BackendKind::Embedded => check::run(&data_dir),
            crate::config::BackendKind::Postgres => {
                check::run_postgres(postgres.postgres_url.as_deref(), &postgres.namespace)
            }
            crate::config::BackendKind::Redis => {
                check::run_redis(redis_url.as_deref(), &postgres.namespace)
            }
        },
        Command::Compact { data_dir } => check::compact(&data_dir),
        Command::Migrate { postgres } => {
            check::migrate(postgres.postgres_url.as_deref(), &postgres.namespace)
        }
        Command::Sessions { server, action } => remote::block_on(remote::sessions(&server, action)),
        Command::Locks { server, action } => remote::block_on(remote::locks(&server, action)),
        Command::Events {
            server,
            after,
            limit,
            follow,
        } => remote::block_on(remote::events(&server, after, limit, follow)),
        Command::Pools { server, action } => remote::block_on(remote::pools(&server, action)),
        Command::Jobs { server, action } => remote::block_on(remote::jobs(&server, action)),
        Command::Bench(args) => bench::run(args),
        Command::Run(args) => run::run(*args),
        Command::Reap { server, dry_run } => remote::block_on(remote::reap(&server, dry_run)),
        Command::Tokens {
            file,
            server,
            action,
        } => tokens::run(file.as_deref(), &server, action),
        Command::Backup(args) => backup::backup(args),
        Command::Restore(args) => backup::restore(args),
        Command::Generate { what } => generate::run(what),
    }
}

impl Command {
    /// Whether the command is one whose output is read through a pipe (`check | less`,
    /// `events | head`), and so should end as Unix tools do when its reader goes away: a
    /// report or a listing, printed after whatever it changed is done.
    ///
    /// Not `serve`: its output is its log, and a reader gone (a stopped journal) must never
    /// stop the server. Not `run`: it holds a lock for its child and must release it,
    /// whatever becomes of its own output.
    fn ends_quietly_on_a_closed_pipe(&self) -> bool {
        !matches!(self, Command::Serve(_) | Command::Run(_))
    }
}

/// Lets the process end on SIGPIPE, its default, as `head`, `grep -q` or a closed `less`
/// expect: the Rust runtime ignores the signal, so a write to a closed pipe fails instead and
/// `println!` panics with a backtrace hint. Sockets are unaffected: the standard library
/// sends on them with `MSG_NOSIGNAL`, so a peer gone is still an error to handle.
fn stop_at_a_closed_pipe() {
    // SAFETY: called at the start of `main`'s work, before any thread is spawned, and
    // SIG_DFL is a valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use clap::CommandFactory;

    /// Every setting of the config file must also be a flag of `serve` (and so a variable).
    #[test]
    fn every_setting_has_a_flag() {
        let defaults = toml::Table::try_from(Config::default()).unwrap();
        let cmd = Cli::command();
        let serve = cmd.find_subcommand("serve").unwrap();
        for name in defaults.keys() {
            assert!(
                serve.get_arguments().any(|a| a.get_id() == name.as_str()),
                "setting {name} has no --{} flag",
                name.replace('_', "-")
            );
        }
    }

    #[test]
    fn flags_override_the_file() {
        let args = Cli::try_parse_from([
            "leasehold",
            "serve",
            "--reaper-interval-ms",
            "250",
            "--listen",
            "127.0.0.1:0",
        ])
        .unwrap();
        let Command::Serve(args) = args.command else {
            panic!("not serve")
        };
        let overrides = toml::Table::try_from(&args).unwrap();
        let config = Config::load(None, overrides).unwrap();
        assert_eq!(config.reaper_interval_ms, 250);
        assert_eq!(config.listen.port(), 0);
    }
}
