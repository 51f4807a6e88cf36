//! The HTTP server: our own hyper accept loop around the axum router, so that the header
//! read timeout works, idle connections are closed, connections are capped, and a shutdown
//! drains in-flight requests.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Connection limits and timeouts.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_grace: Duration,
}

/// Serves `app` on `listener` until `shutdown` completes, then stops accepting, lets
/// in-flight requests finish (up to `shutdown_grace`) and returns.
///
/// Taking a bound listener lets tests bind port 0.
pub async fn run(
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        // At the connection cap, stop accepting: the kernel's backlog holds the rest.
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(pair) => pair,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(AtomicU64::new(0));
        let io = TokioIo::new(Tracked {
            inner: stream,
            origin: Instant::now(),
            last: activity.clone(),
        });
        let conn = http.serve_connection(io, TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        let idle = limits.idle_timeout;
        tokio::spawn(async move {
            let _permit = permit;
            tokio::pin!(conn);
            let origin = Instant::now();
            loop {
                let last = Duration::from_millis(activity.load(Ordering::Relaxed));
                let idle_for = origin.elapsed().saturating_sub(last);
                let wait = idle.saturating_sub(idle_for);
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!(%peer, error = %e, "connection ended with an error");
                        }
                        return;
                    }
                    () = tokio::time::sleep(wait) => {
                        let last = Duration::from_millis(activity.load(Ordering::Relaxed));
                        if origin.elapsed().saturating_sub(last) >= idle {
                            tracing::debug!(%peer, "closing idle connection");
                            return;
                        }
                    }
                }
            }
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(limits.shutdown_grace) => {
            tracing::warn!("shutdown grace ran out with requests still in flight");
        }
    }
}

/// A stream that records when it last moved bytes, for the idle timeout.
///
/// A request waiting for a lock moves no bytes, so `idle_timeout` must exceed `max_wait_ms`;
/// config validation enforces that.
struct Tracked {
    inner: TcpStream,
    origin: Instant,
    last: Arc<AtomicU64>,
}

impl Tracked {
    fn touch(&self) {
        self.last
            .store(self.origin.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() != before {
            self.touch();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
