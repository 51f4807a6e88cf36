//! The Rust client of the HTTP API. It uses none of the server's code, only the wire format.
//!
//! Two layers:
//!
//! - [`Client`]: one HTTP call, one [`Reply`], no retries (the command-line tools and the
//!   tests use it directly).
//! - [`Session`]: a session that heartbeats in the background, with guards that give back
//!   what they hold when dropped — [`LockGuard`] from [`Session::lock`], [`SeatGuard`] from
//!   [`Session::seat`], [`JobGuard`] from [`Session::claim`] — and a [`LossSignal`] that
//!   fires when the session can no longer be trusted.
//! - [`Client::watch`]: the server's own account of a session as it happens ([`Watch`]):
//!   `grace`, then each lock and seat lost and how the session ended.
//!
//! # The local deadline
//!
//! The server ends a session `ttl` after it last heard a heartbeat. The client cannot know
//! when the server heard it, but it knows when it *sent* it, which was earlier. So the session
//! keeps a local deadline: the send time of the last successful heartbeat, plus the time the
//! server said it honours the session from its answer (`safe_for_ms`, at most the TTL), minus
//! a margin for clocks that run at slightly different rates. The local deadline therefore
//! always falls before the server's. When it passes without a successful heartbeat, or a
//! heartbeat answers `session_gone`, the [`LossSignal`] fires: stop writing to anything the
//! session's tokens guard.
//!
//! # Retries
//!
//! Heartbeats, acquires, releases, claims, job finishes, enqueues and the close are retried
//! with exponential backoff on transport errors and `503` answers. Every one that changes
//! something — the open, a lock or seat acquire or release, a claim, a complete, fail or hand
//! back, an enqueue ([`Client::enqueue`]) — carries a `request_id` that its retries repeat, so
//! a retry whose first attempt worked but whose answer was lost gets that first answer: a late
//! retry of an acquire never takes a lock released meanwhile, a release's retry is not answered
//! `not_holder`, a claim's retry gets the job the first attempt claimed (not a second one), a
//! complete's retry is not answered `stale_token`, and an enqueue is never duplicated. A retried
//! open answers the session the first attempt opened, and the local deadline counts from the
//! first send. A heartbeat is retried only until the local deadline. `404 session_gone` is
//! terminal and never retried.
//!
//! ```no_run
//! use std::time::Duration;
//! use leasehold::client::{Client, Session};
//!
//! # async fn example() -> Result<(), leasehold::client::Error> {
//! let client = Client::new("http://127.0.0.1:7878")?;
//! let session = Session::builder(client, "nightly-report")
//!     .ttl(Duration::from_secs(15))
//!     .open()
//!     .await?;
//! let lock = session.lock_wait("reports/nightly", Duration::from_secs(30)).await?;
//! let lost = session.loss_signal();
//! tokio::select! {
//!     _ = do_the_work(lock.token()) => {}
//!     loss = lost.lost() => eprintln!("stopped: {loss}"),
//! }
//! drop(lock);
//! session.close().await?;
//! # Ok(()) }
//! # async fn do_the_work(_token: u64) {}
//! ```

mod enqueue;
mod http;
mod session;
mod watch;

pub use enqueue::{Enqueued, NewJob};
pub use http::{Client, ClientError, Reply, TlsFiles, segment};
pub use session::{
    Backoff, Error, JobGuard, LockGuard, Loss, LossSignal, SeatGuard, Session, SessionBuilder,
};
pub use watch::{Watch, WatchEvent};
