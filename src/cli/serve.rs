//! `leasehold serve`: configuration → logging → store → engine → HTTP, until SIGTERM/SIGINT;
//! SIGHUP reloads the tokens file.

use std::process::ExitCode;
use std::sync::Arc;

use super::ServeArgs;
use crate::app::App;
use crate::clock::SystemClock;
use crate::config::Config;

/// Turns transparent huge pages off for this process (Linux; a no-op elsewhere).
///
/// The allocator asks for huge pages on its arenas, so the first touch of a fresh arena
/// page zeroes 2 MiB in the kernel while the store writer waits: during an expiry storm
/// that was an eighth of the writer's time and doubled the p99 of requests beside it
/// (docs/benchmarks.md). Leasehold's heap is small, so ordinary pages cost it nothing
/// measurable. Only `serve` does this: the flag is inherited by child processes, and
/// `leasehold run` must leave the command it starts as it found it.
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: PR_SET_THP_DISABLE takes plain integers and touches no memory of ours.
        let rc = unsafe {
            libc::prctl(
                libc::PR_SET_THP_DISABLE,
                1 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
        if rc != 0 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "cannot turn transparent huge pages off; expiry storms may stall longer"
            );
        }
    }
}

pub fn run(args: ServeArgs) -> ExitCode {
    let overrides = match toml::Table::try_from(&args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("leasehold: {e}");
            return ExitCode::from(2);
        }
    };
    let config = match Config::load(args.config.as_deref(), overrides) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("leasehold: {e}");
            return ExitCode::from(2);
        }
    };
    // Held to the end of `run`, after the runtime is dropped: its drop writes out the
    // lines still queued, the last ones included.
    let _log = crate::logging::init(&config);
    no_transparent_huge_pages();
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("leasehold: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let started = std::time::Instant::now();
        let app = match App::start(&config, Arc::new(SystemClock::new())).await {
            Ok(app) => app,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                eprintln!("leasehold: {e}");
                return ExitCode::FAILURE;
            }
        };
        app.engine
            .metrics()
            .count_log_drops_from(crate::logging::dropped_lines);
        match config.backend {
            crate::config::BackendKind::Embedded => tracing::info!(
                listen = %app.addr,
                data_dir = %config.data_dir.display(),
                startup_ms = started.elapsed().as_millis() as u64,
                "leasehold is serving"
            ),
            crate::config::BackendKind::Postgres => tracing::info!(
                listen = %app.addr,
                postgres = %crate::backend::postgres::redact(
                    config.postgres_url.as_deref().unwrap_or_default()
                ),
                namespace = %config.namespace,
                ready = app.engine.ready(),
                startup_ms = started.elapsed().as_millis() as u64,
                "leasehold is serving"
            ),
            crate::config::BackendKind::Redis => tracing::info!(
                listen = %app.addr,
                redis = %crate::backend::redis::redact(
                    config.redis_url.as_deref().unwrap_or_default()
                ),
                namespace = %config.namespace,
                ready = app.engine.ready(),
                startup_ms = started.elapsed().as_millis() as u64,
                "leasehold is serving"
            ),
        }
        reload_on_hangup(app.reloadable());
        // Bound and open: systemd (Type=notify) may now count the service as started.
        super::notify::notify("READY=1");
        app.serve_until(async {
            shutdown_signal().await;
            super::notify::notify("STOPPING=1");
        })
        .await;
        tracing::info!("stopped");
        ExitCode::SUCCESS
    })
}

/// SIGHUP reloads the tokens file and the TLS certificate; connections and requests in
/// flight carry on. Without either it is logged and ignored, rather than ending the process.
fn reload_on_hangup((auth, tls): (Option<Arc<crate::auth::Auth>>, Option<Arc<crate::tls::Tls>>)) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            if auth.is_none() && tls.is_none() {
                tracing::info!("SIGHUP: no tokens_file or TLS certificate to reload");
                continue;
            }
            if let Err(e) = crate::app::reload(auth.as_deref(), tls.as_deref()) {
                tracing::error!(error = %e, "SIGHUP: not reloaded; what is in force stays");
            }
        }
    });
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
}
