//! The read side of the handle: sessions, locks, fences, pools, jobs, queues, the audit log
//! and the reaper's dry run. Records come from redb read transactions, so they show only
//! what has been committed, and liveness from the in-memory deadlines. Reads do not wait for
//! the writer, except one about to say a session is gone: see [`Embedded::session`].

use super::Embedded;
use super::commands::Command;
use super::waiters::Resource;
use crate::backend::{
    BackendError, DueSession, Fence, JobPage, LockPage, PoolInfo, QueueInfo, SeatHolder,
    SessionInfo,
};
use crate::domain::time::to_wall;
use crate::domain::{
    Event, JobId, JobRecord, JobStatus, LockKey, LockRecord, Mono, PoolName, QueueName, SessionId,
    SessionRecord, SessionView, Token, UnixMs,
};

/// Keeps the first `limit` rows of a page fetched with one extra, and returns the last kept
/// row (the next cursor) only when the extra row showed there is more.
fn more<T>(rows: &mut Vec<T>, limit: usize) -> Option<&T> {
    if rows.len() > limit {
        rows.truncate(limit);
        rows.last()
    } else {
        None
    }
}

impl Embedded {
    /// What a reap now would end, changing nothing.
    pub fn reap_dry_run(&self, limit: usize) -> Result<Vec<DueSession>, BackendError> {
        self.vouch_for_liveness()?;
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let state = self.shared.state.lock();
        Ok(state
            .due(now, limit)
            .into_iter()
            .map(|v| DueSession {
                id: v.id,
                expired_at: to_wall(v.deadline, now, wall),
                locks: v
                    .locks
                    .into_iter()
                    .map(|(k, t)| (k.to_string(), t))
                    .collect(),
                seats: v.seats.iter().map(|p| p.to_string()).collect(),
                jobs: v
                    .jobs
                    .iter()
                    .filter_map(|j| state.job_outcome_if_ended(*j).map(|o| (*j, o)))
                    .collect(),
            })
            .collect())
    }

    fn info(
        &self,
        view: SessionView,
        record: SessionRecord,
        now: Mono,
        wall: UnixMs,
    ) -> Result<SessionInfo, BackendError> {
        let store = &self.shared.store;
        let locks = store
            .session_locks(view.id)?
            .into_iter()
            .map(|(k, r)| (k, r.token))
            .collect();
        let seats = store.session_seats(view.id)?;
        let jobs = store.session_jobs(view.id)?;
        Ok(SessionInfo {
            id: view.id,
            ttl_ms: view.ttl_ms,
            expires_at: to_wall(view.deadline, now, wall),
            last_heartbeat_at: to_wall(view.last_heartbeat(), now, wall),
            grace: view.in_grace(now),
            record,
            locks,
            seats,
            jobs,
        })
    }

    /// Liveness lives in memory, and after a failed commit memory may hold changes that
    /// were never committed: from then on the server no longer vouches for who is alive.
    fn vouch_for_liveness(&self) -> Result<(), BackendError> {
        if self.shared.store.failed() {
            Err(BackendError::StoreFailed)
        } else {
            Ok(())
        }
    }

    /// A live session, as committed. `None` when it is gone, which is said only once no
    /// restart can revive it: a session memory no longer has live may be ended but not yet
    /// committed, or past its deadline and not yet ended, and the restart grace would bring
    /// it back either way. So the writer is asked: it takes the restart grace away from one
    /// past its deadline (leaving its end to the reaper or a contender), and answers after
    /// the commit.
    pub async fn session(&self, id: SessionId) -> Result<Option<SessionInfo>, BackendError> {
        if let Some(info) = self.live_session(id)? {
            return Ok(Some(info));
        }
        if self.confirm_live(id).await? {
            // Opened, but not yet committed when it was read: it is now.
            self.live_session(id)
        } else {
            Ok(None)
        }
    }

    /// Whether `id` is live, as the writer finds it; see [`Command::ConfirmLive`].
    async fn confirm_live(&self, id: SessionId) -> Result<bool, BackendError> {
        self.call(|reply| Command::ConfirmLive { id, reply }).await
    }

    /// A session that memory has live, with its committed record; `None` otherwise.
    fn live_session(&self, id: SessionId) -> Result<Option<SessionInfo>, BackendError> {
        self.vouch_for_liveness()?;
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let Some(view) = self.shared.state.lock().session(id, now) else {
            return Ok(None);
        };
        let Some(record) = self.shared.store.session(id)? else {
            return Ok(None);
        };
        self.info(view, record, now, wall).map(Some)
    }

    /// A page of live sessions in id order, and the cursor of the next page.
    pub fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> Result<(Vec<SessionInfo>, Option<SessionId>), BackendError> {
        self.vouch_for_liveness()?;
        let mut rows = self.shared.store.sessions(owner, after, limit + 1)?;
        let next = more(&mut rows, limit).map(|(id, _)| *id);
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let views: Vec<_> = {
            let state = self.shared.state.lock();
            rows.into_iter()
                .filter_map(|(id, rec)| state.session(id, now).map(|v| (v, rec)))
                .collect()
        };
        let infos = views
            .into_iter()
            .map(|(v, rec)| self.info(v, rec, now, wall))
            .collect::<Result<_, _>>()?;
        Ok((infos, next))
    }

    pub fn lock(&self, key: &LockKey) -> Result<Option<LockRecord>, BackendError> {
        Ok(self.shared.store.lock(key.as_str())?)
    }

    pub fn locks(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, BackendError> {
        let mut rows = self.shared.store.locks(prefix, after, limit + 1)?;
        let next = more(&mut rows, limit).map(|(k, _)| k.clone());
        Ok((rows, next))
    }

    /// May a resource still accept `token` for `key`? Only while it is the token of the key's
    /// present holder and that holder's session is alive.
    pub fn fence(&self, key: &LockKey, token: Token) -> Result<Fence, BackendError> {
        self.vouch_for_liveness()?;
        let Some(lock) = self.shared.store.lock(key.as_str())? else {
            return Ok(Fence {
                current: false,
                latest: None,
            });
        };
        let live = self
            .shared
            .state
            .lock()
            .is_live(lock.session_id, self.shared.clock.now());
        Ok(Fence {
            current: live && lock.token == token,
            latest: Some(lock.token),
        })
    }

    pub fn events(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<Event>, Option<u64>), BackendError> {
        let events = self.shared.store.events(after, limit)?;
        let next = events.last().map(|e| e.seq);
        Ok((events, next))
    }

    /// A pool with its holders as committed and their liveness.
    pub fn pool(&self, name: &PoolName) -> Result<Option<PoolInfo>, BackendError> {
        self.vouch_for_liveness()?;
        let Some(record) = self.shared.store.pool(name.as_str())? else {
            return Ok(None);
        };
        let seats = self.shared.store.seats(name.as_str())?;
        let now = self.shared.clock.now();
        let wall = self.shared.clock.wall();
        let state = self.shared.state.lock();
        let waiting = self
            .shared
            .waiters
            .lock()
            .waiting(&Resource::Pool(name.clone()));
        let holders = seats
            .into_iter()
            .map(|(sid, seat, session)| {
                let live = state.session(sid, now);
                SeatHolder {
                    session_id: sid,
                    owner: session.map(|s| s.owner).unwrap_or_default(),
                    seat,
                    last_heartbeat_at: live
                        .as_ref()
                        .map(|v| to_wall(v.last_heartbeat(), now, wall)),
                    grace: live.as_ref().map(|v| v.in_grace(now)),
                }
            })
            .collect::<Vec<_>>();
        Ok(Some(PoolInfo {
            capacity: record.capacity,
            in_use: holders.len(),
            waiting,
            metadata: record.metadata,
            created_at: record.created_at,
            holders,
        }))
    }

    /// Every pool: name, capacity, seats in use.
    pub fn pools(&self) -> Result<Vec<(String, u32, usize)>, BackendError> {
        self.vouch_for_liveness()?;
        Ok(self
            .shared
            .state
            .lock()
            .pools()
            .into_iter()
            .map(|(n, c, u)| (n.to_string(), c, u))
            .collect())
    }

    pub fn job(&self, id: JobId) -> Result<Option<(JobRecord, String)>, BackendError> {
        Ok(self.shared.store.job(id)?)
    }

    pub fn queue(&self, name: &QueueName) -> Result<QueueInfo, BackendError> {
        self.vouch_for_liveness()?;
        let counts = self.shared.state.lock().queue_counts(name);
        let waiting = self
            .shared
            .waiters
            .lock()
            .waiting(&Resource::Queue(name.clone()));
        Ok(QueueInfo { counts, waiting })
    }

    /// Jobs of a queue in one state, a page at a time, and the cursor of the next page.
    pub fn queue_jobs(
        &self,
        queue: &QueueName,
        state: &JobStatus,
        after: Option<JobId>,
        limit: usize,
    ) -> Result<JobPage, BackendError> {
        let mut rows =
            self.shared
                .store
                .jobs_in_state(queue.as_str(), state.code(), after, limit + 1)?;
        let next = more(&mut rows, limit).map(|(id, _)| *id);
        Ok((rows, next))
    }

    /// The current revision (what a read-only answer reports).
    pub fn revision(&self) -> u64 {
        self.shared.state.lock().revision()
    }
}
