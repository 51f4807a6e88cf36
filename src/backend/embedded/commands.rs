//! What the writer is asked to do, and how answers get back: one [`Command`] per request,
//! each with the channel its answer goes to, and the answers held back until their batch has
//! committed.

use tokio::sync::oneshot;

use crate::backend::requests::Request;
use crate::backend::{BackendError, Beat, Claimed, Closed, Granted, OpenedSession, ReapOutcome};
use crate::domain::state::FloorRaised;
use crate::domain::{Claim, PoolPut};
use crate::domain::{
    EndReason, Finish, JobId, LockKey, Mono, NewJob, PoolName, QueueName, SessionId, Token,
};

/// Where one request's answer goes.
pub type Reply<T> = oneshot::Sender<Result<T, BackendError>>;

pub enum Command {
    Open {
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: String,
        request: Option<Request>,
        reply: Reply<OpenedSession>,
    },
    Heartbeat {
        id: SessionId,
        ttl_ms: Option<u64>,
        reply: Reply<Beat>,
    },
    End {
        id: SessionId,
        reason: EndReason,
        reply: Reply<Option<Closed>>,
    },
    /// Whether a session is live, asked by a reader about to answer "gone": one past its
    /// deadline loses its restart grace (see `State::confirm_live`), and the answer leaves
    /// after that is committed, as does the answer for one whose end is being committed.
    ConfirmLive {
        id: SessionId,
        reply: Reply<bool>,
    },
    Acquire {
        id: SessionId,
        key: LockKey,
        /// Wait until this instant if the lock is held; `None` answers at once.
        deadline: Option<Mono>,
        /// Remember the grant for this request's retries.
        request: Option<Request>,
        reply: Reply<Granted>,
    },
    Release {
        id: SessionId,
        key: LockKey,
        token: Token,
        request: Option<Request>,
        reply: Reply<u64>,
    },
    /// Creates or resizes a pool. The writer reads the existing record itself, so that
    /// reading and writing it are one step.
    PutPool {
        name: PoolName,
        capacity: u64,
        /// New metadata; `None` keeps what the pool has.
        metadata: Option<String>,
        reply: Reply<PoolPut>,
    },
    DeletePool {
        name: PoolName,
        reply: Reply<u64>,
    },
    AcquireSeat {
        id: SessionId,
        pool: PoolName,
        metadata: String,
        deadline: Option<Mono>,
        request: Option<Request>,
        reply: Reply<Granted>,
    },
    ReleaseSeat {
        id: SessionId,
        pool: PoolName,
        token: Token,
        request: Option<Request>,
        reply: Reply<u64>,
    },
    Enqueue {
        id: JobId,
        job: NewJob,
        request: Option<Request>,
        /// The job's id (a remembered one for a retry) and the revision.
        reply: Reply<(JobId, u64)>,
    },
    Claim {
        id: SessionId,
        queue: QueueName,
        deadline: Option<Mono>,
        request: Option<Request>,
        reply: Reply<Option<Claimed>>,
    },
    FinishJob {
        id: SessionId,
        job: JobId,
        token: Token,
        finish: Finish,
        request: Option<Request>,
        reply: Reply<u64>,
    },
    Requeue {
        job: JobId,
        reply: Reply<u64>,
    },
    /// Raises the revision counter to at least `floor` (an operator's action).
    RaiseTokenFloor {
        floor: u64,
        reply: Reply<FloorRaised>,
    },
    Reap {
        size: PassSize,
        reply: Reply<ReapOutcome>,
    },
    /// `cmd`, on behalf of the API token named `actor`: the events it writes of the kinds
    /// an operator's call names carry that name.
    As {
        actor: std::sync::Arc<str>,
        cmd: Box<Command>,
    },
    /// Answer every waiter `ShuttingDown` now, so a drain does not wait out long polls.
    Drain,
    /// Finish what is queued before this, then exit.
    Stop,
}

/// How many due sessions one reaper pass may end.
#[derive(Debug, Clone, Copy)]
pub enum PassSize {
    /// As many as the writer's [`PassSizer`] fits in the pass budget: the background reaper,
    /// whose passes share the writer with clients.
    Paced,
    /// Up to this many: an operator's reap, which asks for everything now.
    AtMost(usize),
}

/// An answer held back until the batch that produced it has committed; called with `true`
/// when the commit failed, and then answers `StoreFailed` instead.
pub type Pending = Box<dyn FnOnce(bool) + Send>;

/// Holds `result` back until the batch's commit.
pub fn pend<T: Send + 'static>(
    pending: &mut Vec<Pending>,
    reply: Reply<T>,
    result: Result<T, BackendError>,
) {
    pending.push(Box::new(move |failed| {
        let _ = reply.send(if failed {
            Err(BackendError::StoreFailed)
        } else {
            result
        });
    }));
}

/// Answers a command that will not be applied.
pub fn refuse(cmd: Command, e: BackendError) {
    fn no<T>(tx: Reply<T>, e: BackendError) {
        let _ = tx.send(Err(e));
    }
    match cmd {
        Command::Open { reply, .. } => no(reply, e),
        Command::Heartbeat { reply, .. } => no(reply, e),
        Command::End { reply, .. } => no(reply, e),
        Command::Acquire { reply, .. } | Command::AcquireSeat { reply, .. } => no(reply, e),
        Command::Enqueue { reply, .. } => no(reply, e),
        Command::Release { reply, .. }
        | Command::DeletePool { reply, .. }
        | Command::ReleaseSeat { reply, .. }
        | Command::FinishJob { reply, .. }
        | Command::Requeue { reply, .. } => no(reply, e),
        Command::PutPool { reply, .. } => no(reply, e),
        Command::ConfirmLive { reply, .. } => no(reply, e),
        Command::Claim { reply, .. } => no(reply, e),
        Command::Reap { reply, .. } => no(reply, e),
        Command::RaiseTokenFloor { reply, .. } => no(reply, e),
        Command::As { cmd, .. } => refuse(*cmd, e),
        Command::Drain | Command::Stop => {}
    }
}

pub fn granted(token: Token, revision: u64) -> Granted {
    Granted { token, revision }
}

pub fn claimed(c: Claim) -> Claimed {
    Claimed {
        job: c.job,
        token: c.token,
        attempt: c.attempt,
        recovery_count: c.recovery_count,
        kind: c.kind,
        revision: c.revision,
    }
}
