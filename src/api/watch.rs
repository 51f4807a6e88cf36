//! `GET /v1/sessions/{id}/watch`: a session's loss signal as server-sent events.
//!
//! Two parts. The node's [`Watches`] hub tails the audit log once for all the watches of the
//! node: the log is the one record every backend keeps of how a session ended and of each
//! lock and seat it lost with the end (seats reclaimed first, then the end naming the locks,
//! on every backend), and on the shared backends it holds the ends made by every node. Each
//! end is handed to the watches of its session, so a node reads the log once however many
//! watch, and never scans anything per watch.
//!
//! Each watch is a task that sends the snapshot, then re-reads its own session (one point
//! read) every `watch_recheck_ms` to report `grace` and `active`, and ends the stream with the
//! session's end. Ends made through this node's API prompt the tail at once, and so does the
//! backend's signal of ends (`Backend::ends`: the reaper, an inline reap, and on the shared
//! backends another node's commit). The tail's own re-check bounds how late an end is
//! reported when a signal is lost, so a lost prompt delays a watcher and never strands it.
//!
//! While the backend cannot be read or is not ready, a watch says so once with an
//! `unavailable` event, and sends the session's state again when a read succeeds.
//!
//! Invariant: a watch registers with the hub, and waits until the hub's cursor follows the
//! log, before it reads its snapshot. Any end the snapshot does not show is therefore
//! numbered after the cursor and is handed to the watch.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::{Router, routing};
use futures_util::Stream;
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc, oneshot, watch};

use super::AppState;
use super::error::ApiError;
use super::extract::SessionPath;
use super::gate::Caller;
use super::wire::{Session, ms};
use crate::backend::SessionInfo;
use crate::domain::{EndReason, Event, EventKind, SessionId, Token, UnixMs};
use crate::engine::Engine;

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/sessions/{id}/watch", routing::get(open_watch))
}

/// The watch settings (`max_watches`, `max_watches_per_token`, `watch_recheck_ms`,
/// `watch_keepalive_ms`).
#[derive(Debug, Clone, Copy)]
pub struct WatchLimits {
    /// Most watches open on this node at once; more are `503 too_many_watches`.
    pub max_watches: u32,
    /// Most watches of one token open at once; more are `429 too_many_watches`.
    pub max_watches_per_token: u32,
    /// How often a watch re-reads its session, and the tail re-reads the log, unprompted.
    pub recheck: Duration,
    /// How often an idle stream carries a comment, so that proxies keep it open.
    pub keepalive: Duration,
}

/// Events read from the log in one call.
const PAGE: usize = 1_000;

/// Re-checks a watch waits, once its session reads as gone, for the end to come through the
/// log before it reports `gone` without a reason.
const GONE_RECHECKS: u32 = 10;

/// How a session ended, as the log records it.
#[derive(Debug)]
struct Ending {
    reason: EndReason,
    at: UnixMs,
    locks: Vec<(String, Token)>,
    seats: Vec<(String, Token)>,
}

/// The node's watches and the one tail of the audit log that serves them.
pub struct Watches {
    limits: WatchLimits,
    engine: Engine,
    state: parking_lot::Mutex<HubState>,
    /// Wakes the tail: a watch arrived or an end was made on this node.
    prompt: Notify,
    /// True while the tail follows the log; false while no watch is open (the cursor then
    /// falls behind and is found again when one arrives).
    live: watch::Sender<bool>,
    /// Set once, when the server begins to shut down: every stream ends.
    closed: watch::Sender<bool>,
    tail_started: AtomicBool,
}

#[derive(Default)]
struct HubState {
    next: u64,
    /// The watches of each session, each waiting for the end.
    subs: HashMap<SessionId, Vec<(u64, oneshot::Sender<Ending>)>>,
    /// Seats reclaimed from a watched session, held until its end event (which follows
    /// them in the log) comes.
    seats: HashMap<SessionId, Vec<(String, Token)>>,
    open: u32,
    per_token: HashMap<String, u32>,
}

/// A watch's place in the hub, given back on drop.
struct Registration {
    hub: Arc<Watches>,
    id: SessionId,
    sub: u64,
    token: Option<String>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut st = self.hub.state.lock();
        if let Some(list) = st.subs.get_mut(&self.id) {
            list.retain(|(n, _)| *n != self.sub);
            if list.is_empty() {
                st.subs.remove(&self.id);
                st.seats.remove(&self.id);
            }
        }
        st.open -= 1;
        if let Some(name) = &self.token
            && let Some(n) = st.per_token.get_mut(name)
        {
            *n -= 1;
            if *n == 0 {
                st.per_token.remove(name);
            }
        }
        self.hub.engine.metrics().watches_open.dec();
    }
}

impl Watches {
    pub fn new(engine: Engine, limits: WatchLimits) -> Arc<Watches> {
        Arc::new(Watches {
            limits,
            engine,
            state: parking_lot::Mutex::new(HubState::default()),
            prompt: Notify::new(),
            live: watch::Sender::new(false),
            closed: watch::Sender::new(false),
            tail_started: AtomicBool::new(false),
        })
    }

    /// Ends every stream and refuses new watches (`serve` calls it as it begins to drain):
    /// a watch never holds a shutdown up.
    pub fn close(&self) {
        self.closed.send_replace(true);
    }

    /// An end was made on this node: read the log now rather than at the next re-check.
    pub fn prompt(&self) {
        self.prompt.notify_one();
    }

    /// Registers a watch of `id`, within the caps, and returns once the tail follows the log.
    async fn register(
        self: &Arc<Self>,
        id: SessionId,
        caller: &Caller,
    ) -> Result<(Registration, oneshot::Receiver<Ending>), ApiError> {
        if *self.closed.borrow() {
            return Err(ApiError::Engine(crate::backend::BackendError::ShuttingDown));
        }
        let token = match caller {
            Caller::Token(t) => Some(t.name.clone()),
            Caller::Open => None,
        };
        let (tx, rx) = oneshot::channel();
        let reg = {
            let mut st = self.state.lock();
            if st.open >= self.limits.max_watches {
                return Err(ApiError::TooManyWatches { per_token: false });
            }
            if let Some(name) = &token {
                let n = st.per_token.entry(name.clone()).or_insert(0);
                if *n >= self.limits.max_watches_per_token {
                    return Err(ApiError::TooManyWatches { per_token: true });
                }
                *n += 1;
            }
            st.open += 1;
            st.next += 1;
            let sub = st.next;
            st.subs.entry(id).or_default().push((sub, tx));
            self.engine.metrics().watches_open.inc();
            Registration {
                hub: self.clone(),
                id,
                sub,
                token,
            }
        };
        if !self.tail_started.swap(true, Ordering::AcqRel) {
            tokio::spawn(tail(self.clone()));
        }
        self.prompt();
        let mut live = self.live.subscribe();
        let mut closed = self.closed.subscribe();
        tokio::select! {
            _ = until_set(&mut live) => {}
            _ = until_set(&mut closed) => return Err(shutting_down()),
        }
        Ok((reg, rx))
    }

    /// Hands the ends in `events` to the watches of their sessions.
    fn dispatch(&self, events: Vec<Event>) {
        let mut st = self.state.lock();
        for e in events {
            let Some(id) = e.session_id else { continue };
            if !st.subs.contains_key(&id) {
                continue;
            }
            let reason = match e.kind {
                EventKind::SeatReclaimed => {
                    if let (Some(pool), Some(token)) = (e.pool, e.token) {
                        st.seats.entry(id).or_default().push((pool, token));
                    }
                    continue;
                }
                EventKind::SessionClosed => EndReason::Closed,
                EventKind::SessionExpired => EndReason::Expired,
                EventKind::SessionEndedByAdmin => EndReason::Admin,
                _ => continue,
            };
            let seats = st.seats.remove(&id).unwrap_or_default();
            let locks: Vec<(String, Token)> =
                e.released.into_iter().map(|l| (l.key, l.token)).collect();
            for (_, tx) in st.subs.remove(&id).unwrap_or_default() {
                let _ = tx.send(Ending {
                    reason,
                    at: e.at,
                    locks: locks.clone(),
                    seats: seats.clone(),
                });
            }
        }
    }
}

/// Returns once the flag is set; never, if its sender is gone unset.
async fn until_set(flag: &mut watch::Receiver<bool>) {
    loop {
        if *flag.borrow_and_update() {
            return;
        }
        if flag.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

fn shutting_down() -> ApiError {
    ApiError::Engine(crate::backend::BackendError::ShuttingDown)
}

/// The tail: follows the audit log while any watch is open, from the log's end as it was
/// when the first of them arrived.
async fn tail(hub: Arc<Watches>) {
    let mut closed = hub.closed.subscribe();
    let ends = hub.engine.ends();
    let mut cursor = 0u64;
    loop {
        if *closed.borrow() {
            return;
        }
        // Decided under the lock a watch registers under: a watch that arrives after this
        // sees `live` false and waits for the cursor to be found again. Idle means no watch
        // is registered, not that none waits for an end: a watch whose end was just handed
        // over may not yet have seen `live` turn true, and must not see it turn false first.
        let idle = {
            let st = hub.state.lock();
            let idle = st.open == 0;
            if idle {
                hub.live.send_replace(false);
            }
            idle
        };
        if idle {
            tokio::select! {
                _ = hub.prompt.notified() => {}
                _ = closed.changed() => return,
            }
            continue;
        }
        if !*hub.live.borrow() {
            match log_end(&hub.engine, cursor).await {
                Ok(end) => {
                    cursor = end;
                    hub.live.send_replace(true);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "watches: cannot find the end of the audit log");
                    tokio::select! {
                        _ = tokio::time::sleep(hub.limits.recheck) => {}
                        _ = closed.changed() => return,
                    }
                    continue;
                }
            }
        }
        loop {
            match hub.engine.events(cursor, PAGE).await {
                Ok((events, next)) => {
                    let full = events.len() == PAGE;
                    hub.dispatch(events);
                    if let Some(n) = next {
                        cursor = cursor.max(n);
                    }
                    if !full {
                        break;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "watches: cannot read the audit log");
                    break;
                }
            }
        }
        tokio::select! {
            _ = hub.prompt.notified() => {}
            _ = ends.notified() => {}
            _ = tokio::time::sleep(hub.limits.recheck) => {}
            _ = closed.changed() => return,
        }
    }
}

/// The last sequence number of the log at or after `from`: the least `x` with no event after
/// it, found by doubling from `from` and then halving, a few dozen one-row reads at most.
async fn log_end(engine: &Engine, from: u64) -> crate::backend::Result<u64> {
    let first = engine.events(from, 1).await?.0;
    let Some(e) = first.first() else {
        return Ok(from);
    };
    // `lo` has an event at or after it; `hi` has none after it.
    let mut lo = e.seq;
    let mut step = 1u64;
    let hi = loop {
        let x = lo.saturating_add(step);
        match engine.events(x, 1).await?.0.first() {
            Some(e) if x < u64::MAX => {
                lo = e.seq;
                step = step.saturating_mul(2);
            }
            _ => break x,
        }
    };
    let mut hi = hi;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match engine.events(mid, 1).await?.0.first() {
            Some(e) => lo = e.seq.min(hi),
            None => hi = mid,
        }
    }
    // `lo` is an event's number and nothing lies after `hi`; between them nothing either.
    Ok(lo)
}

async fn open_watch(
    State(app): State<AppState>,
    caller: Caller,
    SessionPath(id): SessionPath,
) -> Result<
    (
        [(&'static str, &'static str); 1],
        Sse<impl Stream<Item = Result<SseEvent, Infallible>>>,
    ),
    ApiError,
> {
    caller.read_session(id)?;
    let hub = app.watches.clone();
    let (reg, ending) = hub.register(id, &caller).await?;
    let first = match app.engine.session(id).await? {
        Some(info) => info,
        None => return Err(ApiError::SessionGone),
    };
    let (tx, mut rx) = mpsc::channel::<SseEvent>(16);
    tokio::spawn(follow(reg, first, ending, tx));
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|e| e.map(Ok)));
    // Proxies that buffer answers (nginx) would hold the events back.
    Ok((
        [("x-accel-buffering", "no")],
        Sse::new(stream).keep_alive(
            KeepAlive::new()
                .interval(hub.limits.keepalive)
                .text("keep-alive"),
        ),
    ))
}

/// One stream's events, numbered from 1.
struct Out {
    tx: mpsc::Sender<SseEvent>,
    n: u64,
}

impl Out {
    /// False once the client has gone.
    async fn send(&mut self, kind: &str, data: Value) -> bool {
        self.n += 1;
        let event = SseEvent::default()
            .id(self.n.to_string())
            .event(kind)
            .data(data.to_string());
        self.tx.send(event).await.is_ok()
    }
}

fn state_of(info: &SessionInfo) -> &'static str {
    if info.grace { "grace" } else { "active" }
}

fn state_data(info: &SessionInfo) -> Value {
    json!({
        "session_id": info.id.to_string(),
        "expires_at": ms(info.expires_at),
        "last_heartbeat_at": ms(info.last_heartbeat_at),
    })
}

/// Sends the snapshot, then each change of state, then the end; returns when the stream
/// ends (the end, the client gone, or the server shutting down).
async fn follow(
    reg: Registration,
    first: SessionInfo,
    mut ending: oneshot::Receiver<Ending>,
    tx: mpsc::Sender<SseEvent>,
) {
    let hub = reg.hub.clone();
    let id = reg.id;
    let mut out = Out { tx, n: 0 };
    let mut state = state_of(&first);
    let snapshot = serde_json::to_value(Session::from(first)).unwrap_or(Value::Null);
    if !out.send("snapshot", snapshot).await {
        return;
    }
    let mut closed = hub.closed.subscribe();
    let mut gone_for: Option<u32> = None;
    // Set while the backend is unavailable, after the one `unavailable` event.
    let mut down = false;
    loop {
        let recheck = tokio::time::sleep(hub.limits.recheck);
        tokio::select! {
            end = &mut ending => {
                if let Ok(end) = end {
                    report_end(&mut out, id, end).await;
                }
                return;
            }
            _ = until_set(&mut closed) => {
                out.send("shutting_down", json!({"session_id": id.to_string()})).await;
                return;
            }
            _ = out.tx.closed() => return,
            _ = recheck => {}
        }
        if let Some(n) = &mut gone_for {
            *n += 1;
            if *n > GONE_RECHECKS {
                // The end never showed in the log (trimmed, or unreadable): say the session
                // is gone without saying why.
                out.send("gone", json!({"session_id": id.to_string()}))
                    .await;
                return;
            }
            hub.prompt();
            continue;
        }
        let read = if hub.engine.ready() {
            hub.engine.session(id).await
        } else {
            Err(crate::backend::BackendError::Unavailable(
                "the backend is not ready".into(),
            ))
        };
        match read {
            Ok(Some(info)) => {
                let now = state_of(&info);
                if (now != state || down) && !out.send(now, state_data(&info)).await {
                    return;
                }
                state = now;
                down = false;
            }
            Ok(None) => {
                // Gone: its end is in the log, or it is past its deadline and not yet
                // reaped, which ends it now as its expiry, as any reader may. Ending a
                // gone session again changes nothing.
                if let Err(e) = hub.engine.end(id, EndReason::Expired).await {
                    tracing::debug!(error = %e, "watch: cannot settle a gone session");
                }
                gone_for = Some(0);
                hub.prompt();
            }
            // A failed read says nothing about the session's fate: the watcher learns that
            // the server cannot tell, once, and the next re-check reads again.
            Err(e) => {
                tracing::debug!(error = %e, "watch: cannot read the session");
                if !down {
                    down = true;
                    let data = json!({"session_id": id.to_string(), "error": e.to_string()});
                    if !out.send("unavailable", data).await {
                        return;
                    }
                }
            }
        }
    }
}

/// Each lock and seat lost, then the end itself.
async fn report_end(out: &mut Out, id: SessionId, end: Ending) {
    for (key, token) in &end.locks {
        if !out
            .send("lock_lost", json!({"key": key, "token": token.0}))
            .await
        {
            return;
        }
    }
    for (pool, token) in &end.seats {
        if !out
            .send("seat_lost", json!({"pool": pool, "seat_token": token.0}))
            .await
        {
            return;
        }
    }
    let kind = match end.reason {
        EndReason::Closed => "closed",
        EndReason::Expired => "expired",
        EndReason::Admin => "ended_by_admin",
    };
    out.send(
        kind,
        json!({
            "session_id": id.to_string(),
            "at": ms(end.at),
            "released": end.locks.len(),
            "seats_released": end.seats.len(),
        }),
    )
    .await;
}
