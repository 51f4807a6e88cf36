//! The rules of sessions and fenced locks, as a pure state machine.
//!
//! Nothing here reads a clock, sleeps, spawns or does I/O: time arrives as arguments
//! (`Mono` for deadlines, `UnixMs` for what is shown to people), and every mutation returns
//! the [`Change`]s that the store must persist before the caller may acknowledge it.

pub mod change;
pub mod ids;
pub mod limits;
pub mod state;
pub mod time;

pub use change::{Change, EndReason, Event, EventKind, LockRecord, ReleasedLock, SessionRecord};
pub use ids::{LockKey, SessionId, Token};
pub use limits::{InvalidInput, Limits};
pub use state::{
    AcquireError, Acquired, Beat, Ended, HeartbeatError, LockView, NotHolder, Opened, Restore,
    RestoreError, SessionView, State,
};
pub use time::{Mono, UnixMs};
