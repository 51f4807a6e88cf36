//! Wiring: configuration → store → engine → router → server. Used by `leasehold serve` and
//! by the tests, which start the real server on port 0 with a manual clock.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::backend::embedded::store::{Store, StoreError};
use crate::backend::embedded::{Embedded, StartError};
use crate::backend::postgres::{self, Postgres};
use crate::backend::redis::{self, Redis};
use crate::clock::Clock;
use crate::config::{BackendKind, Config};
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::server::{self, ServerLimits};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Start(#[from] StartError),
    #[error(transparent)]
    Postgres(#[from] postgres::StartError),
    #[error(transparent)]
    Redis(#[from] redis::StartError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A running server.
pub struct App {
    pub addr: SocketAddr,
    pub engine: Engine,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl App {
    /// Starts the configured backend and serves: the embedded store in `config.data_dir`,
    /// or PostgreSQL at `config.postgres_url` (started even while the database is
    /// unreachable, unready until it is reached).
    pub async fn start(config: &Config, clock: Arc<dyn Clock>) -> Result<App, AppError> {
        match config.backend {
            BackendKind::Embedded => {
                let store = Store::open(&config.data_dir, config.cache_size_bytes)?;
                App::start_with_store(config, clock, store).await
            }
            BackendKind::Postgres => {
                let metrics = Arc::new(Metrics::new());
                let backend =
                    Postgres::start(config.engine(), config.postgres(), clock, metrics).await?;
                App::serve(config, Engine::from(backend)).await
            }
            BackendKind::Redis => {
                let metrics = Arc::new(Metrics::new());
                let backend = Redis::start(config.engine(), config.redis(), clock, metrics).await?;
                App::serve(config, Engine::from(backend)).await
            }
        }
    }

    /// Starts serving on an already opened store (tests inject failing storage this way).
    pub async fn start_with_store(
        config: &Config,
        clock: Arc<dyn Clock>,
        store: Store,
    ) -> Result<App, AppError> {
        let metrics = Arc::new(Metrics::new());
        let engine = Engine::from(Embedded::start(config.engine(), store, clock, metrics)?);
        App::serve(config, engine).await
    }

    async fn serve(config: &Config, engine: Engine) -> Result<App, AppError> {
        let listener = match TcpListener::bind(config.listen).await {
            Ok(l) => l,
            Err(source) => {
                engine.shutdown();
                return Err(AppError::Listen {
                    addr: config.listen,
                    source,
                });
            }
        };
        let addr = listener.local_addr().map_err(|source| AppError::Listen {
            addr: config.listen,
            source,
        })?;
        let router = crate::api::router(engine.clone(), config.max_body_bytes);
        let limits = ServerLimits {
            header_read_timeout: Duration::from_millis(config.header_read_timeout_ms),
            idle_timeout: Duration::from_millis(config.idle_timeout_ms),
            max_connections: config.max_connections,
            shutdown_grace: Duration::from_millis(config.shutdown_grace_ms),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::run(listener, router, limits, async {
            let _ = stopped.await;
        }));
        Ok(App {
            addr,
            engine,
            stop: Some(stop),
            task: Some(task),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, drains in-flight requests, then stops the engine (the writer
    /// finishes what is queued) and closes the store.
    pub async fn shutdown(mut self) {
        self.engine.begin_drain();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        let engine = self.engine.clone();
        let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
    }

    /// Waits until the server task ends (it ends only through `shutdown`).
    pub async fn serve_until(mut self, signal: impl std::future::Future<Output = ()>) {
        signal.await;
        // Not ready any more, and waiters answered, before the listener closes.
        self.engine.begin_drain();
        tracing::info!("shutting down: draining in-flight requests");
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.shutdown().await;
    }
}
