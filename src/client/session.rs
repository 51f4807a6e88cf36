//! A session that heartbeats in the background, keeps a local deadline ahead of the server's,
//! and hands out guards that give back what they hold when dropped.
//!
//! Two tasks belong to a session, both stopped by it: the heartbeat task, which owns the
//! local deadline and fires the loss signal, and the release task, which performs in order
//! the releases that dropped guards queue (a `Drop` cannot wait for a network call).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::http::{Client, ClientError, Reply, segment};

/// Why a session can no longer be trusted. Once lost, a session stays lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Loss {
    /// The server answered `session_gone`: the session expired, was closed or was ended by
    /// an operator. Everything it held has been released.
    Gone,
    /// The local deadline passed without a successful heartbeat. The server may still hold the
    /// session for a moment, but will not for long; act as if it were gone.
    Deadline,
    /// A heartbeat was refused with an answer that retrying cannot change (for example a
    /// missing or revoked API token).
    Refused { status: u16, code: String },
    /// This client closed the session.
    Closed,
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Loss::Gone => f.write_str("the server says the session is gone"),
            Loss::Deadline => {
                f.write_str("no heartbeat succeeded before the local deadline passed")
            }
            Loss::Refused { status, code } => write!(f, "a heartbeat was refused: {status} {code}"),
            Loss::Closed => f.write_str("the session was closed"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Transport(#[from] ClientError),
    /// The server answered with an error.
    #[error("{status} {code}: {message}")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
    /// The session was lost before or during the call.
    #[error("the session is lost: {0}")]
    Lost(Loss),
    /// The server answered with a body this client does not understand.
    #[error("unexpected answer from the server: {0}")]
    Unexpected(String),
}

impl Error {
    /// The API's error code (`lock_held`, `pool_exhausted`, `session_gone`, …), if the server
    /// answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            Error::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    pub(super) fn from_reply(r: &Reply) -> Error {
        Error::Api {
            status: r.status.as_u16(),
            code: r.body["error"].as_str().unwrap_or("error").to_string(),
            message: r.body["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| r.text.clone()),
        }
    }
}

/// Exponential backoff between retries: `first`, doubling, at most `max`, each delay cut by
/// up to a half at random so that clients that failed together do not retry together.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
    /// Attempts in all, the first included, for calls other than heartbeats (which retry until
    /// the local deadline).
    pub attempts: u32,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            first: Duration::from_millis(50),
            max: Duration::from_secs(2),
            attempts: 5,
        }
    }
}

impl Backoff {
    fn delay(&self, retry: u32) -> Duration {
        let full = self
            .first
            .saturating_mul(1u32 << retry.min(16))
            .min(self.max);
        // Random bits from the OS generator via a v4 id: no extra dependency for jitter.
        let r = (uuid::Uuid::new_v4().as_u128() & 0xffff) as u32;
        full - full.mul_f64(f64::from(r) / f64::from(0x1_0000u32) / 2.0)
    }
}

/// A fresh `request_id` for one logical call; only that call's retries send it again, so a
/// retry after a lost answer gets the first answer back instead of acting twice.
pub(super) fn request_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Whether an answer or failure is worth another attempt: transport errors and the `503`s
/// (overloaded, shutting down, an unreachable database, a failed store) may clear; every other
/// answer is final.
fn retryable(result: &Result<Reply, ClientError>) -> bool {
    match result {
        Err(ClientError::Connect { .. } | ClientError::Timeout(_)) => true,
        Err(_) => false,
        Ok(r) => r.status.as_u16() == 503,
    }
}

/// Posts `body` to `path`, again on transport errors and `503`s up to `backoff.attempts`
/// times while `go_on()` holds. Only for calls that are safe to repeat: idempotent ones, or
/// ones whose `body` carries a `request_id`.
pub(super) async fn post_retried(
    client: &Client,
    backoff: &Backoff,
    path: &str,
    body: &Value,
    go_on: impl Fn() -> bool,
) -> Result<Reply, ClientError> {
    let mut attempt = 0;
    loop {
        let result = client.post(path, body).await;
        attempt += 1;
        if retryable(&result) && attempt < backoff.attempts && go_on() {
            tokio::time::sleep(backoff.delay(attempt - 1)).await;
            continue;
        }
        return result;
    }
}

fn is_gone(r: &Reply) -> bool {
    r.status.as_u16() == 404 && r.body["error"] == "session_gone"
}

/// Fires when the session is lost. Cheap to clone; every clone sees the same loss.
#[derive(Clone)]
pub struct LossSignal(watch::Receiver<Option<Loss>>);

impl LossSignal {
    /// The loss, if the session is lost already.
    pub fn is_lost(&self) -> Option<Loss> {
        self.0.borrow().clone()
    }

    /// Waits until the session is lost, and says why.
    pub async fn lost(&self) -> Loss {
        let mut rx = self.0.clone();
        let seen = rx
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|v| v.clone());
        // The sender lives in the session's shared state, dropped only after the session and
        // every guard are: then the session is over in any case.
        seen.unwrap_or(Loss::Closed)
    }
}

/// What a dropped guard asks the release task to give back, or a marker that answers once
/// every earlier release was tried.
enum Release {
    Lock { key: String, token: u64 },
    Seat { pool: String, token: u64 },
    Job { id: String, token: u64 },
    Flush(oneshot::Sender<()>),
}

/// The state a session shares with its guards and tasks.
struct Shared {
    client: Client,
    id: String,
    backoff: Backoff,
    margin: Duration,
    /// The local deadline: moves only forward, set from the send time of a successful
    /// heartbeat.
    deadline: Mutex<Instant>,
    loss: watch::Sender<Option<Loss>>,
    releases: mpsc::UnboundedSender<Release>,
}

impl Shared {
    /// Records the first loss; later ones are ignored, so the signal says what happened first.
    fn lose(&self, loss: Loss) {
        self.loss.send_if_modified(|v| {
            if v.is_none() {
                *v = Some(loss);
                true
            } else {
                false
            }
        });
    }

    fn lost(&self) -> Option<Loss> {
        self.loss.borrow().clone()
    }

    fn check(&self) -> Result<(), Error> {
        match self.lost() {
            Some(loss) => Err(Error::Lost(loss)),
            None if Instant::now() >= *self.deadline.lock() => {
                self.lose(Loss::Deadline);
                Err(Error::Lost(Loss::Deadline))
            }
            None => Ok(()),
        }
    }

    /// Moves the local deadline to `sent + honoured - margin` if that is later.
    fn extend(&self, sent: Instant, honoured: Duration) {
        let candidate = sent + honoured.saturating_sub(self.margin);
        let mut deadline = self.deadline.lock();
        if candidate > *deadline {
            *deadline = candidate;
        }
    }

    /// One call, tried again on transport errors and `503`s up to `backoff.attempts` times.
    /// A `session_gone` answer marks the session lost.
    async fn call(&self, path: &str, body: &Value) -> Result<Reply, Error> {
        let go_on = || self.lost().is_none();
        let reply = post_retried(&self.client, &self.backoff, path, body, go_on).await?;
        if is_gone(&reply) {
            self.lose(Loss::Gone);
        }
        Ok(reply)
    }
}

/// Options of a session; [`Session::builder`] makes one.
pub struct SessionBuilder {
    client: Client,
    owner: String,
    ttl: Duration,
    interval: Option<Duration>,
    margin: Option<Duration>,
    metadata: Option<Value>,
    backoff: Backoff,
    watch: bool,
}

impl SessionBuilder {
    /// Also watch the session on the server (`GET /v1/sessions/{id}/watch`), so that the loss
    /// signal fires as soon as the server reports the session ended (an operator's end, an
    /// expiry), not only at the next heartbeat or the local deadline. The watch is reopened
    /// after a dropped stream; the local deadline stays the authority when it cannot be.
    pub fn watch(mut self, watch: bool) -> SessionBuilder {
        self.watch = watch;
        self
    }

    /// The session's TTL (default 15 s; the server bounds it, by default to 1 s – 24 h).
    pub fn ttl(mut self, ttl: Duration) -> SessionBuilder {
        self.ttl = ttl;
        self
    }

    /// How often to heartbeat (default a third of the TTL).
    pub fn heartbeat_every(mut self, interval: Duration) -> SessionBuilder {
        self.interval = Some(interval);
        self
    }

    /// How much earlier than the server the client gives the session up (default a tenth of
    /// the TTL, at least 50 ms): room for clock-rate differences and for acting on the loss.
    pub fn margin(mut self, margin: Duration) -> SessionBuilder {
        self.margin = Some(margin);
        self
    }

    /// A JSON object stored with the session.
    pub fn metadata(mut self, metadata: Value) -> SessionBuilder {
        self.metadata = Some(metadata);
        self
    }

    pub fn backoff(mut self, backoff: Backoff) -> SessionBuilder {
        self.backoff = backoff;
        self
    }

    /// Opens the session and starts its heartbeat and release tasks (on the current tokio
    /// runtime).
    pub async fn open(self) -> Result<Session, Error> {
        let ttl_ms = u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX);
        let body = json!({
            "owner": self.owner,
            "ttl_ms": ttl_ms,
            "metadata": self.metadata,
            "request_id": request_id(),
        });
        let mut attempt = 0;
        // Every attempt carries one request_id, so a retry after a lost answer gets the
        // session the first attempt opened rather than a second one. That session's deadline
        // was set when the first attempt arrived, so the local deadline counts from the first
        // send: it may only be early, never late.
        let sent = Instant::now();
        let reply = loop {
            let result = self.client.post("/v1/sessions", &body).await;
            attempt += 1;
            if retryable(&result) && attempt < self.backoff.attempts {
                tokio::time::sleep(self.backoff.delay(attempt - 1)).await;
                continue;
            }
            break result?;
        };
        if reply.status.as_u16() != 201 {
            return Err(Error::from_reply(&reply));
        }
        let id = reply.body["session_id"]
            .as_str()
            .ok_or_else(|| Error::Unexpected(reply.text.clone()))?
            .to_string();
        let granted = Duration::from_millis(reply.body["ttl_ms"].as_u64().unwrap_or(ttl_ms));
        let margin = self
            .margin
            .unwrap_or_else(|| (granted / 10).max(Duration::from_millis(50)));
        let interval = self.interval.unwrap_or(granted / 3);
        let (loss, _) = watch::channel(None);
        let (releases, queue) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            client: self.client,
            id,
            backoff: self.backoff,
            margin,
            deadline: Mutex::new(sent + granted.saturating_sub(margin)),
            loss,
            releases,
        });
        let heartbeat = tokio::spawn(heartbeat_loop(shared.clone(), interval, granted));
        if self.watch {
            tokio::spawn(watch_loop(Arc::downgrade(&shared), shared.loss.subscribe()));
        }
        let releaser = tokio::spawn(release_loop(
            shared.client.clone(),
            shared.id.clone(),
            shared.loss.subscribe(),
            queue,
        ));
        Ok(Session {
            shared,
            heartbeat,
            releaser: Some(releaser),
            closed: false,
        })
    }
}

/// Heartbeats every `interval` until the session is lost or its owner stops the task.
///
/// Each heartbeat races the local deadline: a heartbeat still in flight (or still being
/// retried) when the deadline passes does not delay the loss signal.
async fn heartbeat_loop(shared: Arc<Shared>, interval: Duration, ttl: Duration) {
    let mut closed = shared.loss.subscribe();
    let mut next = Instant::now() + interval;
    loop {
        let deadline = *shared.deadline.lock();
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {
                shared.lose(Loss::Deadline);
                return;
            }
            _ = closed.wait_for(Option::is_some) => return,
            _ = tokio::time::sleep_until(next) => {}
        }
        let outcome = tokio::select! {
            o = beat(&shared, ttl) => o,
            _ = tokio::time::sleep_until(deadline) => Err(Loss::Deadline),
            _ = closed.wait_for(Option::is_some) => return,
        };
        match outcome {
            Ok(sent) => next = sent + interval,
            Err(loss) => {
                shared.lose(loss);
                return;
            }
        }
    }
}

/// Follows the server's watch of the session and fires the loss signal when it reports the
/// end. Holds the session's state only weakly, so that it never keeps a dropped session
/// alive; ends with the loss (its own or any other).
async fn watch_loop(shared: std::sync::Weak<Shared>, mut lost: watch::Receiver<Option<Loss>>) {
    let mut retry = 0;
    loop {
        let Some(s) = shared.upgrade() else { return };
        let (client, id, backoff) = (s.client.clone(), s.id.clone(), s.backoff);
        drop(s);
        let gone = tokio::select! {
            g = follow_watch(&client, &id) => g,
            _ = lost.wait_for(Option::is_some) => return,
        };
        if gone {
            if let Some(s) = shared.upgrade() {
                s.lose(Loss::Gone);
            }
            return;
        }
        // The stream ended without an end (a restart, a proxy, a refusal): watch again.
        tokio::select! {
            _ = tokio::time::sleep(backoff.delay(retry.min(16))) => {}
            _ = lost.wait_for(Option::is_some) => return,
        }
        retry += 1;
    }
}

/// Reads one watch of the session to its end; true when it said the session is gone.
async fn follow_watch(client: &Client, id: &str) -> bool {
    match client.watch(&segment(id)).await {
        Ok(Ok(mut w)) => {
            while let Ok(Some(e)) = w.next().await {
                if e.is_loss() {
                    return true;
                }
                if e.is_final() {
                    return false;
                }
            }
            false
        }
        Ok(Err(r)) => is_gone(&r),
        Err(_) => false,
    }
}

/// One heartbeat, retried with backoff on transport errors and `503`s (the caller bounds it by
/// the local deadline). Returns when it was sent.
async fn beat(shared: &Shared, ttl: Duration) -> Result<Instant, Loss> {
    let path = format!("/v1/sessions/{}/heartbeat", segment(&shared.id));
    let mut retry = 0;
    loop {
        let sent = Instant::now();
        let result = shared.client.post(&path, &json!({})).await;
        if retryable(&result) {
            tokio::time::sleep(shared.backoff.delay(retry)).await;
            retry += 1;
            continue;
        }
        return match result {
            Ok(r) if r.status.is_success() => {
                // A server without `safe_for_ms` honours the session for the TTL from when it
                // handled the heartbeat, which was after `sent`.
                let honoured = r.body["safe_for_ms"]
                    .as_u64()
                    .map(Duration::from_millis)
                    .unwrap_or(ttl)
                    .min(ttl);
                shared.extend(sent, honoured);
                Ok(sent)
            }
            Ok(r) if is_gone(&r) => Err(Loss::Gone),
            Ok(r) => Err(Loss::Refused {
                status: r.status.as_u16(),
                code: r.body["error"].as_str().unwrap_or("error").to_string(),
            }),
            // Not JSON, or a bad token: retrying will not help.
            Err(e) => Err(Loss::Refused {
                status: 0,
                code: e.to_string(),
            }),
        };
    }
}

/// Gives back, in order, what dropped guards queued. Ends when every sender is gone (the
/// session and all its guards were dropped). Once the session is lost there is nothing left
/// to give back: the server released it all when the session ended.
async fn release_loop(
    client: Client,
    id: String,
    loss: watch::Receiver<Option<Loss>>,
    mut queue: mpsc::UnboundedReceiver<Release>,
) {
    let backoff = Backoff::default();
    while let Some(item) = queue.recv().await {
        let (path, body) = match item {
            Release::Flush(done) => {
                let _ = done.send(());
                continue;
            }
            _ if loss.borrow().is_some() => continue,
            Release::Lock { key, token } => (
                format!("/v1/locks/{}/release", segment(&key)),
                json!({"session_id": id, "token": token, "request_id": request_id()}),
            ),
            Release::Seat { pool, token } => (
                format!("/v1/pools/{}/release", segment(&pool)),
                json!({"session_id": id, "seat_token": token, "request_id": request_id()}),
            ),
            Release::Job { id: job, token } => (
                format!("/v1/jobs/{}/release", segment(&job)),
                json!({"session_id": id, "token": token, "request_id": request_id()}),
            ),
        };
        // Any final answer ends it: `not_holder` or `stale_token` mean already given back or
        // taken over; either way this session no longer holds it.
        let go_on = || loss.borrow().is_none();
        let _ = post_retried(&client, &backoff, &path, &body, go_on).await;
    }
}

/// A session on the server, kept alive in the background while this value lives.
///
/// Dropping it stops the heartbeats and closes the session in the background (best effort;
/// the server ends it at its TTL otherwise). [`Session::close`] closes it and waits.
pub struct Session {
    shared: Arc<Shared>,
    heartbeat: JoinHandle<()>,
    releaser: Option<JoinHandle<()>>,
    closed: bool,
}

impl Session {
    /// A session of `owner` with the default options (TTL 15 s, heartbeat every 5 s).
    pub fn builder(client: Client, owner: impl Into<String>) -> SessionBuilder {
        SessionBuilder {
            client,
            owner: owner.into(),
            ttl: Duration::from_secs(15),
            interval: None,
            margin: None,
            metadata: None,
            backoff: Backoff::default(),
            watch: false,
        }
    }

    pub fn id(&self) -> &str {
        &self.shared.id
    }

    /// The local deadline: the session must be treated as lost from this instant unless a
    /// heartbeat succeeds before it.
    pub fn deadline(&self) -> Instant {
        *self.shared.deadline.lock()
    }

    /// A signal that fires when the session is lost.
    pub fn loss_signal(&self) -> LossSignal {
        LossSignal(self.shared.loss.subscribe())
    }

    /// `Ok` while the session is trusted: not lost and its local deadline not passed. Call it
    /// right before a write that a token guards.
    pub fn check(&self) -> Result<(), Error> {
        self.shared.check()
    }

    /// Takes the lock `key` now, or fails with `lock_held`.
    pub async fn lock(&self, key: &str) -> Result<LockGuard, Error> {
        self.lock_wait(key, Duration::ZERO).await
    }

    /// Takes the lock `key`, waiting in line up to `wait` (the server caps one wait at its
    /// `max_wait_ms`).
    pub async fn lock_wait(&self, key: &str, wait: Duration) -> Result<LockGuard, Error> {
        self.check()?;
        let body = json!({
            "session_id": self.shared.id,
            "wait_ms": millis(wait),
            "request_id": request_id(),
        });
        let r = self
            .shared
            .call(&format!("/v1/locks/{}/acquire", segment(key)), &body)
            .await?;
        if !r.status.is_success() {
            return Err(self.failure(&r));
        }
        let token = r.body["token"]
            .as_u64()
            .ok_or_else(|| Error::Unexpected(r.text.clone()))?;
        Ok(LockGuard {
            shared: self.shared.clone(),
            key: key.to_string(),
            token,
            held: true,
        })
    }

    /// Takes a seat of `pool` now, or fails with `pool_exhausted`.
    pub async fn seat(&self, pool: &str) -> Result<SeatGuard, Error> {
        self.seat_wait(pool, Duration::ZERO, None).await
    }

    /// Takes a seat of `pool`, waiting in line up to `wait`, with `metadata` about the seat.
    pub async fn seat_wait(
        &self,
        pool: &str,
        wait: Duration,
        metadata: Option<Value>,
    ) -> Result<SeatGuard, Error> {
        self.check()?;
        let body = json!({
            "session_id": self.shared.id,
            "wait_ms": millis(wait),
            "metadata": metadata,
            "request_id": request_id(),
        });
        let r = self
            .shared
            .call(&format!("/v1/pools/{}/acquire", segment(pool)), &body)
            .await?;
        if !r.status.is_success() {
            return Err(self.failure(&r));
        }
        let token = r.body["seat_token"]
            .as_u64()
            .ok_or_else(|| Error::Unexpected(r.text.clone()))?;
        Ok(SeatGuard {
            shared: self.shared.clone(),
            pool: pool.to_string(),
            token,
            held: true,
        })
    }

    /// Claims the oldest job of `queue`, waiting up to `wait` for one; `None` when none came.
    /// Retried under one `request_id`: a retry after a lost answer gets the job the first
    /// attempt claimed, never a second one.
    pub async fn claim(&self, queue: &str, wait: Duration) -> Result<Option<JobGuard>, Error> {
        self.check()?;
        let body = json!({
            "session_id": self.shared.id,
            "wait_ms": millis(wait),
            "request_id": request_id(),
        });
        let r = self
            .shared
            .call(&format!("/v1/queues/{}/claim", segment(queue)), &body)
            .await?;
        match r.status.as_u16() {
            204 => Ok(None),
            200 => {
                let b = &r.body;
                let (Some(id), Some(token)) = (b["job_id"].as_str(), b["token"].as_u64()) else {
                    return Err(Error::Unexpected(r.text.clone()));
                };
                Ok(Some(JobGuard {
                    shared: self.shared.clone(),
                    id: id.to_string(),
                    token,
                    payload: b["payload"].clone(),
                    attempt: b["attempt"].as_u64().unwrap_or(1),
                    kind: b["kind"].as_str().map(str::to_string),
                    held: true,
                }))
            }
            _ => Err(self.failure(&r)),
        }
    }

    /// Waits until every release queued by guards dropped so far has been tried.
    pub async fn settle(&self) {
        let (done, wait) = oneshot::channel();
        if self.shared.releases.send(Release::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }

    /// Gives back what dropped guards queued, stops heartbeating and closes the session, which
    /// releases everything it still holds.
    pub async fn close(mut self) -> Result<(), Error> {
        self.settle().await;
        self.closed = true;
        self.heartbeat.abort();
        let path = format!("/v1/sessions/{}", segment(&self.shared.id));
        let mut attempt = 0;
        let result = loop {
            let result = self.shared.client.delete(&path).await;
            attempt += 1;
            if retryable(&result) && attempt < self.shared.backoff.attempts {
                tokio::time::sleep(self.shared.backoff.delay(attempt - 1)).await;
                continue;
            }
            break result;
        };
        self.shared.lose(Loss::Closed);
        let reply = result?;
        if reply.status.is_success() {
            Ok(())
        } else {
            Err(Error::from_reply(&reply))
        }
    }

    fn failure(&self, r: &Reply) -> Error {
        if is_gone(r) {
            Error::Lost(Loss::Gone)
        } else {
            Error::from_reply(r)
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.heartbeat.abort();
        if self.closed {
            return;
        }
        self.shared.lose(Loss::Closed);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let client = self.shared.client.clone();
        let path = format!("/v1/sessions/{}", segment(&self.shared.id));
        let releaser = self.releaser.take();
        runtime.spawn(async move {
            let _ = client.delete(&path).await;
            // The close released everything; queued releases would only answer not_holder.
            if let Some(r) = releaser {
                r.abort();
            }
        });
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A held lock. Dropping it gives the lock back (in the background; see
/// [`Session::settle`]).
pub struct LockGuard {
    shared: Arc<Shared>,
    key: String,
    token: u64,
    held: bool,
}

impl LockGuard {
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token of this grant: send it with every write to the guarded resource.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Gives the lock back now and waits for the answer.
    pub async fn release(mut self) -> Result<(), Error> {
        self.held = false;
        let body = json!({
            "session_id": self.shared.id,
            "token": self.token,
            "request_id": request_id(),
        });
        let r = self
            .shared
            .call(&format!("/v1/locks/{}/release", segment(&self.key)), &body)
            .await?;
        if r.status.is_success() {
            Ok(())
        } else {
            Err(Error::from_reply(&r))
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.held {
            let _ = self.shared.releases.send(Release::Lock {
                key: std::mem::take(&mut self.key),
                token: self.token,
            });
        }
    }
}

/// A held seat. Dropping it gives the seat back (in the background).
pub struct SeatGuard {
    shared: Arc<Shared>,
    pool: String,
    token: u64,
    held: bool,
}

impl SeatGuard {
    pub fn pool(&self) -> &str {
        &self.pool
    }

    pub fn token(&self) -> u64 {
        self.token
    }

    /// Gives the seat back now and waits for the answer.
    pub async fn release(mut self) -> Result<(), Error> {
        self.held = false;
        let body = json!({
            "session_id": self.shared.id,
            "seat_token": self.token,
            "request_id": request_id(),
        });
        let r = self
            .shared
            .call(&format!("/v1/pools/{}/release", segment(&self.pool)), &body)
            .await?;
        if r.status.is_success() {
            Ok(())
        } else {
            Err(Error::from_reply(&r))
        }
    }
}

impl Drop for SeatGuard {
    fn drop(&mut self) {
        if self.held {
            let _ = self.shared.releases.send(Release::Seat {
                pool: std::mem::take(&mut self.pool),
                token: self.token,
            });
        }
    }
}

/// A claimed job. Finish it with [`JobGuard::complete`] or [`JobGuard::fail`]; dropping it
/// unfinished hands it back to the head of its queue (in the background), so a worker that
/// stops or panics mid-job loses nothing.
pub struct JobGuard {
    shared: Arc<Shared>,
    id: String,
    token: u64,
    payload: Value,
    attempt: u64,
    kind: Option<String>,
    held: bool,
}

impl JobGuard {
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn token(&self) -> u64 {
        self.token
    }

    pub fn payload(&self) -> &Value {
        &self.payload
    }

    /// How many times the job has been claimed, this claim included.
    pub fn attempt(&self) -> u64 {
        self.attempt
    }

    pub fn kind(&self) -> Option<&str> {
        self.kind.as_deref()
    }

    /// Marks the job done with `result`. Retried under one `request_id`: a retry after a lost
    /// answer gets the first answer, not `stale_token`.
    pub async fn complete(self, result: Value) -> Result<(), Error> {
        self.finish("complete", json!({"result": result})).await
    }

    /// Marks the job failed for good (a dead letter) with `reason`.
    pub async fn fail(self, reason: &str) -> Result<(), Error> {
        self.finish("fail", json!({"reason": reason})).await
    }

    /// Hands the job back to the head of its queue now and waits for the answer.
    pub async fn release(self) -> Result<(), Error> {
        self.finish("release", json!({})).await
    }

    async fn finish(mut self, verb: &str, mut body: Value) -> Result<(), Error> {
        self.held = false;
        body["session_id"] = json!(self.shared.id);
        body["token"] = json!(self.token);
        body["request_id"] = json!(request_id());
        let r = self
            .shared
            .call(&format!("/v1/jobs/{}/{verb}", segment(&self.id)), &body)
            .await?;
        if r.status.is_success() {
            Ok(())
        } else {
            Err(Error::from_reply(&r))
        }
    }
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        if self.held {
            let _ = self.shared.releases.send(Release::Job {
                id: std::mem::take(&mut self.id),
                token: self.token,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_jitters_down_only() {
        let b = Backoff {
            first: Duration::from_millis(100),
            max: Duration::from_millis(1000),
            attempts: 5,
        };
        for (retry, full) in [
            (0, 100),
            (1, 200),
            (2, 400),
            (3, 800),
            (4, 1000),
            (30, 1000),
        ] {
            let d = b.delay(retry);
            let full = Duration::from_millis(full);
            assert!(d <= full && d >= full / 2, "retry {retry}: {d:?}");
        }
    }

    #[test]
    fn only_transport_errors_and_503s_are_retried() {
        let reply = |status: u16, error: &str| Reply {
            status: hyper::StatusCode::from_u16(status).unwrap(),
            body: json!({"error": error}),
            text: String::new(),
        };
        assert!(retryable(&Err(ClientError::Timeout(Duration::ZERO))));
        assert!(retryable(&Err(ClientError::Connect {
            server: "s".into(),
            message: "refused".into()
        })));
        assert!(!retryable(&Err(ClientError::NotJson("x".into()))));
        assert!(retryable(&Ok(reply(503, "overloaded"))));
        assert!(!retryable(&Ok(reply(404, "session_gone"))));
        assert!(!retryable(&Ok(reply(409, "lock_held"))));
        assert!(!retryable(&Ok(reply(401, "unauthorized"))));
    }
}
