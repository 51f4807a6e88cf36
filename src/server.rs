//! The HTTP server: our own hyper accept loop around the axum router, so that the header
//! read timeout works (and does not cut kept-alive connections short), idle connections
//! are closed, connections are capped in all and per client address, every request passes
//! the gate, and a shutdown drains in-flight requests.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use hyper::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};

use crate::api::Api;
use crate::api::gate::Gate;

/// Connection limits and timeouts.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// From the first byte of a request (or from accepting the connection) to the end of
    /// its headers.
    pub header_read_timeout: Duration,
    /// A kept-alive connection between requests, or one moving no bytes, is closed after
    /// this long.
    pub idle_timeout: Duration,
    pub max_connections: usize,
    /// Most open connections from one client address.
    pub max_connections_per_client: usize,
    pub shutdown_grace: Duration,
}

/// Where a connection is in its current request, for the header read timeout: hyper's own
/// timer would also run between kept-alive requests and cut the idle connection short.
const HEADERS: u8 = 0;
const BODY: u8 = 1;
const IDLE: u8 = 2;

/// Open connections by client address, for the per-client cap.
#[derive(Default)]
struct PerClient(parking_lot::Mutex<HashMap<IpAddr, usize>>);

/// A connection's place in [`PerClient`], given back when it closes.
struct ClientSlot {
    map: Arc<PerClient>,
    ip: IpAddr,
}

impl PerClient {
    fn take(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<ClientSlot> {
        let mut m = self.0.lock();
        let n = m.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            map: self.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut m = self.map.0.lock();
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// The answer to a connection over its client's cap, written before closing it.
const TOO_MANY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: 94\r\n\r\n{\"error\":\"too_many_connections\",\"message\":\"this client address has too many open connections\"}";

/// Serves `app` on `listener` until `shutdown` completes, then stops accepting, lets
/// in-flight requests finish (up to `shutdown_grace`) and returns. Each request passes
/// `gate` (token, role, rate, declared body size) before it is routed.
///
/// Taking a bound listener lets tests bind port 0.
pub async fn run(
    listener: TcpListener,
    app: Api,
    gate: Arc<Gate>,
    tls: Option<Arc<crate::tls::Tls>>,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let per_client = Arc::new(PerClient::default());
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(None)
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
        let Some(client_slot) = per_client.take(peer.ip(), limits.max_connections_per_client)
        else {
            drop(permit);
            tracing::debug!(%peer, "refusing a connection over the per-client cap");
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let mut stream = stream;
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    let _ = stream.write_all(TOO_MANY).await;
                    let _ = stream.shutdown().await;
                })
                .await;
            });
            continue;
        };
        let _ = stream.set_nodelay(true);
        let api = app.clone();
        let gate = gate.clone();
        let http = http.clone();
        let watcher = graceful.watcher();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _client_slot = client_slot;
            let origin = Instant::now();
            let state = Arc::new(ConnState::default());
            match tls {
                None => {
                    let io = Tracked::new(stream, origin, state.clone());
                    serve(
                        http, io, api, gate, watcher, state, origin, limits, peer, None,
                    )
                    .await
                }
                Some(tls) => {
                    // The handshake counts against the header read timeout: a client that
                    // opens a connection and says nothing is closed as before.
                    let Some((stream, client)) =
                        tls.accept(stream, limits.header_read_timeout, peer).await
                    else {
                        return;
                    };
                    let io = Tracked::new(stream, origin, state.clone());
                    let client = client.map(Arc::new);
                    serve(
                        http, io, api, gate, watcher, state, origin, limits, peer, client,
                    )
                    .await
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

/// Serves one connection until it ends, is idle for `idle_timeout`, or stalls in a
/// request's headers for `header_read_timeout`.
#[allow(clippy::too_many_arguments)]
async fn serve<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    http: http1::Builder,
    io: Tracked<S>,
    api: Api,
    gate: Arc<Gate>,
    watcher: hyper_util::server::graceful::Watcher,
    state: Arc<ConnState>,
    origin: Instant,
    limits: ServerLimits,
    peer: std::net::SocketAddr,
    client: Option<Arc<crate::tls::ClientCert>>,
) {
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let api = api.clone();
        // The connection's verified client certificate, for the gate to map to a token.
        if let Some(c) = &client {
            req.extensions_mut().insert(c.clone());
        }
        let admitted = gate.admit(&mut req);
        async move {
            let response = match admitted {
                Ok(()) => api.call(req).await,
                Err(refusal) => refusal.into_response(),
            };
            Ok::<_, Infallible>(response)
        }
    });
    let conn = http.serve_connection(TokioIo::new(io), service);
    let conn = watcher.watch(conn);
    let (idle, header_timeout) = (limits.idle_timeout, limits.header_read_timeout);
    tokio::pin!(conn);
    loop {
        let now = origin.elapsed();
        let last = Duration::from_millis(state.last.load(Ordering::Relaxed));
        let idle_for = now.saturating_sub(last);
        if idle_for >= idle {
            tracing::debug!(%peer, "closing idle connection");
            return;
        }
        let mut wait = idle - idle_for;
        if state.phase.load(Ordering::Relaxed) == HEADERS {
            let since = Duration::from_millis(state.headers_since.load(Ordering::Relaxed));
            let reading = now.saturating_sub(since);
            if reading >= header_timeout {
                tracing::debug!(%peer, "closing a connection slow to send its headers");
                return;
            }
            wait = wait.min(header_timeout - reading);
        }
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                return;
            }
            () = tokio::time::sleep(wait) => {}
            // A new request started: its header deadline is now the nearer one.
            () = state.started.notified() => {}
        }
    }
}

/// What the connection's watcher reads: last activity, the request phase, and when the
/// current request's headers began. Milliseconds since the connection was accepted.
#[derive(Default)]
struct ConnState {
    last: AtomicU64,
    phase: AtomicU8,
    headers_since: AtomicU64,
    started: Notify,
}

/// A stream that records when it last moved bytes and where it is in a request, for the
/// idle and header timeouts, and that gives hyper's own error answers (431, 414, a bad
/// `Content-Length`), which have no body, the API's JSON error body.
///
/// A request waiting for a lock moves no bytes, so `idle_timeout` must exceed `max_wait_ms`;
/// config validation enforces that.
struct Tracked<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> {
    /// Taken only when the connection is dropped, to linger ([`linger`]).
    inner: Option<S>,
    origin: Instant,
    state: Arc<ConnState>,
    /// The last bytes read, to find the blank line that ends the headers across reads.
    tail: u32,
    /// A replacement answer not yet written out.
    pending: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> Tracked<S> {
    fn new(inner: S, origin: Instant, state: Arc<ConnState>) -> Tracked<S> {
        Tracked {
            inner: Some(inner),
            origin,
            state,
            tail: 0,
            pending: Vec::new(),
        }
    }

    fn io(&mut self) -> Pin<&mut S> {
        stream(&mut self.inner)
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    fn touch(&self) {
        self.state.last.store(self.now_ms(), Ordering::Relaxed);
    }

    fn on_read(&mut self, data: &[u8]) {
        let phase = self.state.phase.load(Ordering::Relaxed);
        if phase == IDLE {
            // The first byte of the next request: its headers are now on the clock.
            self.state
                .headers_since
                .store(self.now_ms(), Ordering::Relaxed);
            self.state.phase.store(HEADERS, Ordering::Relaxed);
            self.state.started.notify_one();
            self.tail = 0;
        }
        if self.state.phase.load(Ordering::Relaxed) == HEADERS && ends_headers(&mut self.tail, data)
        {
            self.state.phase.store(BODY, Ordering::Relaxed);
        }
    }

    /// Writes out a replacement answer; ready once all of it is gone.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while !self.pending.is_empty() {
            let n = std::task::ready!(stream(&mut self.inner).poll_write(cx, &self.pending))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.pending.drain(..n);
        }
        Poll::Ready(Ok(()))
    }
}

const BLANK_LINE: u32 = u32::from_be_bytes(*b"\r\n\r\n");

/// Whether `data`, read after the bytes whose last four `tail` holds, completes a blank line
/// (the end of the headers); `tail` becomes the last four bytes read. Any blank line since
/// the headers began will do, and a body's lies after the headers' own, so the search runs
/// from the end, where the blank line of a request with a small body is found at once.
fn ends_headers(tail: &mut u32, data: &[u8]) -> bool {
    // A blank line across the two reads ends in the first three bytes of this one.
    for &b in data.iter().take(3) {
        *tail = (*tail << 8) | u32::from(b);
        if *tail == BLANK_LINE {
            return true;
        }
    }
    if data.windows(4).rev().any(|w| w == b"\r\n\r\n") {
        return true;
    }
    for &b in data.iter().skip(3).rev().take(4).rev() {
        *tail = (*tail << 8) | u32::from(b);
    }
    false
}

/// hyper's own refusal of a request it could not parse: an error status and no
/// `content-type` (every answer of the API has one). Returns the API's answer instead.
fn replace_http_error(data: &[u8]) -> Option<Vec<u8>> {
    let rest = data.strip_prefix(b"HTTP/1.1 ")?;
    let status: u16 = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    if status < 400 {
        return None;
    }
    let head_end = data.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = data[..head_end].to_ascii_lowercase();
    if head.windows(13).any(|w| w == b"content-type:") {
        return None;
    }
    let (reason, error, message) = match status {
        431 => (
            "Request Header Fields Too Large",
            "headers_too_large",
            "the request headers are over the server's limit",
        ),
        414 => (
            "URI Too Long",
            "uri_too_long",
            "the request target is over the server's limit",
        ),
        505 => (
            "HTTP Version Not Supported",
            "http_version_not_supported",
            "the server speaks HTTP/1.1 (and 1.0)",
        ),
        _ => (
            "Bad Request",
            "invalid_request",
            "the request is not well-formed HTTP/1.1 (for example a bad Content-Length or Transfer-Encoding)",
        ),
    };
    let status = if matches!(status, 431 | 414 | 505) {
        status
    } else {
        400
    };
    let body = format!("{{\"error\":\"{error}\",\"message\":\"{message}\"}}");
    Some(
        format!(
            "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes(),
    )
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = self.io().poll_read(cx, buf);
        if buf.filled().len() != before {
            self.touch();
            self.on_read(&buf.filled()[before..]);
        }
        r
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        std::task::ready!(self.poll_pending(cx))?;
        // Bytes of an answer: the request is done (a `100 Continue` is not an answer).
        if !data.starts_with(b"HTTP/1.1 100 ") {
            if self.state.phase.load(Ordering::Relaxed) != IDLE
                && let Some(replacement) = replace_http_error(data)
            {
                self.pending = replacement;
                self.state.phase.store(IDLE, Ordering::Relaxed);
                self.touch();
                std::task::ready!(self.poll_pending(cx))?;
                return Poll::Ready(Ok(data.len()));
            }
            if data.starts_with(b"HTTP/1.") {
                self.state.phase.store(IDLE, Ordering::Relaxed);
            }
        }
        let r = self.io().poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::task::ready!(self.poll_pending(cx))?;
        self.io().poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::task::ready!(self.poll_pending(cx))?;
        self.io().poll_shutdown(cx)
    }
}

/// The stream of a [`Tracked`] connection, there until the connection is dropped; a free
/// function so that a caller can borrow the connection's other fields beside it.
fn stream<S: Unpin>(inner: &mut Option<S>) -> Pin<&mut S> {
    Pin::new(
        inner
            .as_mut()
            .expect("the stream is taken only when the connection is dropped"),
    )
}

/// How long a closed connection goes on reading, and how much, before it is closed for good.
const LINGER_FOR: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 8 * 1024 * 1024;

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> Drop for Tracked<S> {
    fn drop(&mut self) {
        if let Some(io) = self.inner.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(linger(io));
        }
    }
}

/// Closes a connection without losing the answer it sent last. Closing a socket that still
/// has unread bytes makes the kernel reset the connection, and the reset can destroy the
/// answer before the client reads it: a client still sending a body the server refused
/// (`413`, declared over `max_body_bytes`) saw a broken pipe instead of the 413. So the
/// write side is shut and whatever still arrives is read and dropped until the client
/// closes, for at most [`LINGER_FOR`] and [`LINGER_BYTES`], as HTTP servers' lingering
/// close does. Off the connection's task: the connection's slot is already given back.
async fn linger<S: AsyncRead + AsyncWrite + Unpin>(mut io: S) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(LINGER_FOR, async {
        let _ = io.shutdown().await;
        // In the task's own allocation: most closes read nothing but the end of the stream.
        let mut buf = [0u8; 4096];
        let mut read = 0;
        while read < LINGER_BYTES {
            match io.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_of_the_headers_is_found_in_one_read_or_across_reads() {
        let whole = b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\n{}";
        for split in 0..whole.len() {
            let (a, b) = whole.split_at(split);
            let mut tail = 0;
            let first = ends_headers(&mut tail, a);
            let found = first || ends_headers(&mut tail, b);
            assert!(found, "split at {split}");
            // Found no earlier than the read that completes the blank line.
            assert_eq!(first, split >= whole.len() - 2, "split at {split}");
        }
        // Byte by byte.
        let mut tail = 0;
        let at = whole.iter().position(|&b| ends_headers(&mut tail, &[b]));
        assert_eq!(at, Some(whole.len() - 3));
        let mut tail = 0;
        assert!(!ends_headers(&mut tail, b"GET / HTTP/1.1\r\nhost: a\r\n"));
        assert!(ends_headers(&mut tail, b"\r\n"));
    }
}
