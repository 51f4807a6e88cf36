//! Wiring: configuration → store → engine → router → server. Used by `leasehold serve` and
//! by the tests, which start the real server on port 0 with a manual clock.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::api::gate::Gate;
use crate::auth::Auth;
use crate::backend::embedded::store::{Store, StoreError};
use crate::backend::embedded::{Embedded, StartError};
use crate::backend::postgres::{self, Postgres};
use crate::backend::redis::{self, Redis};
use crate::clock::Clock;
use crate::config::{BackendKind, Config};
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::server::{self, ServerLimits};
use crate::tls::Tls;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Start(#[from] StartError),
    #[error(transparent)]
    Postgres(#[from] postgres::StartError),
    #[error(transparent)]
    Tokens(#[from] crate::auth::TokensError),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
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
    /// The loaded API tokens, when a tokens file is configured.
    pub auth: Option<Arc<Auth>>,
    /// The certificate in force, when TLS is configured.
    pub tls: Option<Arc<Tls>>,
    /// The session watches, closed as the shutdown begins so that no stream holds it up.
    watches: Arc<crate::api::watch::Watches>,
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
        let auth = match &config.tokens_file {
            Some(path) => match Auth::load(path, config.rate_limit()) {
                Ok(a) => Some(Arc::new(a)),
                Err(e) => {
                    engine.shutdown();
                    return Err(e.into());
                }
            },
            None => None,
        };
        let tls = match (&config.tls_cert_file, &config.tls_key_file) {
            (Some(cert), Some(key)) => match Tls::load(
                cert,
                key,
                config
                    .tls_client_ca
                    .as_ref()
                    .map(|path| crate::tls::ClientCa {
                        path: path.clone(),
                        required: config.tls_client_auth == crate::config::ClientAuth::Required,
                    }),
            ) {
                Ok(t) => Some(Arc::new(t)),
                Err(e) => {
                    engine.shutdown();
                    return Err(e.into());
                }
            },
            _ => None,
        };
        match &auth {
            Some(a) => tracing::info!(tokens = a.len(), "API tokens loaded"),
            None => tracing::warn!(
                listen = %config.listen,
                "no tokens_file: serving a loopback address only, and every caller may do everything"
            ),
        }
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
        let api = config.api();
        let (router, watches) = crate::api::Api::new(engine.clone(), api);
        let gate = Arc::new(Gate {
            auth: auth.clone(),
            metrics_open: config.metrics_open,
            max_body_bytes: api.max_body_bytes,
            job_body_bytes: api.job_body_bytes(),
        });
        let limits = ServerLimits {
            header_read_timeout: Duration::from_millis(config.header_read_timeout_ms),
            idle_timeout: Duration::from_millis(config.idle_timeout_ms),
            max_connections: config.max_connections,
            max_connections_per_client: config.max_connections_per_client,
            shutdown_grace: Duration::from_millis(config.shutdown_grace_ms),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::run(
            listener,
            router,
            gate,
            tls.clone(),
            limits,
            async {
                let _ = stopped.await;
            },
        ));
        Ok(App {
            addr,
            engine,
            auth,
            tls,
            watches,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Reads the tokens file and the TLS certificate and key again (what SIGHUP does).
    /// What does not load leaves what is in force as it was.
    pub fn reload(&self) -> Result<(), AppError> {
        reload(self.auth.as_deref(), self.tls.as_deref())
    }

    /// What SIGHUP reloads, for a task that outlives the borrow of the app.
    pub fn reloadable(&self) -> (Option<Arc<Auth>>, Option<Arc<Tls>>) {
        (self.auth.clone(), self.tls.clone())
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, drains in-flight requests, then stops the engine (the writer
    /// finishes what is queued) and closes the store.
    pub async fn shutdown(mut self) {
        self.engine.begin_drain();
        self.watches.close();
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
        self.watches.close();
        tracing::info!("shutting down: draining in-flight requests");
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.shutdown().await;
    }
}

/// Reloads the tokens file and the certificate; both are tried, the first error returned.
pub fn reload(auth: Option<&Auth>, tls: Option<&Tls>) -> Result<(), AppError> {
    let tokens = match auth {
        Some(a) => a.reload().map(|n| {
            tracing::info!(tokens = n, "API tokens reloaded");
        }),
        None => Ok(()),
    };
    let cert = match tls {
        Some(t) => t
            .reload()
            .map(|()| tracing::info!("TLS certificate reloaded")),
        None => Ok(()),
    };
    tokens?;
    cert?;
    Ok(())
}
