//! The rules of sessions, fenced locks, seat pools and job leases, as a pure state machine.
//!
//! Nothing here reads a clock, sleeps, spawns or does I/O: time arrives as an argument
//! ([`At`]: `Mono` for deadlines, `UnixMs` for what is shown to people), and every mutation
//! records in [`Effects`] the [`Change`]s that the store must persist before the caller may
//! acknowledge it.

pub mod change;
pub mod ids;
pub mod jobs;
pub mod limits;
pub mod pools;
pub mod state;
pub mod time;

pub use change::{
    Change, EndReason, Event, EventKind, JobRecord, JobStatus, LockRecord, PoolRecord,
    ReleasedLock, RequestRecord, SeatRecord, SessionRecord,
};
pub use ids::{JobId, LockKey, PoolName, QueueName, SessionId, Token};
pub use jobs::{Claim, ClaimGone, Finish, JobError, JobOutcome, NewJob, QueueCounts};
pub use limits::{InvalidInput, Limits};
pub use pools::{PoolError, PoolPut, PoolView, Seat, SeatError, SeatGrant};
pub use state::{
    AcquireError, Acquired, At, Beat, Effects, Ended, HeartbeatError, LockView, NotHolder, Opened,
    Restore, RestoreError, SessionView, State,
};
pub use time::{Mono, UnixMs};
