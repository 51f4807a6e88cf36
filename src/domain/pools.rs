//! Seat pools (counting semaphores, floating licences): at most `capacity` sessions hold a
//! seat, one seat per session per pool, each seat with a fencing token from the global
//! counter. Shrinking a pool takes no seat away; new grants wait until use falls below it.

use std::collections::HashMap;

use super::change::{Change, EndReason, EventKind, PoolRecord, SeatRecord};
use super::ids::{PoolName, SessionId, Token};
use super::limits::InvalidInput;
use super::state::{At, Effects, Gone, RestoreError, State};
use super::time::UnixMs;

pub const MAX_CAPACITY: u64 = 1_000_000;

#[derive(Debug, Clone)]
pub(super) struct Pool {
    pub(super) capacity: u32,
    pub(super) holders: HashMap<SessionId, Seat>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seat {
    pub token: Token,
    pub acquired_at: UnixMs,
}

impl Pool {
    fn has_room(&self) -> bool {
        self.holders.len() < self.capacity as usize
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolView {
    pub name: PoolName,
    pub capacity: u32,
    pub holders: Vec<(SessionId, Seat)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolPut {
    pub revision: u64,
    pub created: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeatGrant {
    pub token: Token,
    pub revision: u64,
    /// False when the session already held a seat and got it back.
    pub fresh: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeatError {
    #[error("the session is gone")]
    SessionGone,
    #[error("no such pool")]
    PoolNotFound,
    #[error("every seat is taken ({in_use} in use of {capacity})")]
    Exhausted { capacity: u32, in_use: usize },
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("no such pool")]
    NotFound,
    #[error("the pool has {0} seats in use")]
    InUse(usize),
    #[error("the session does not hold a seat with this token")]
    NotHolder,
}

impl State {
    pub(super) fn restore_pools(
        &mut self,
        pools: Vec<(PoolName, u32)>,
        seats: Vec<(PoolName, SessionId, Token, UnixMs)>,
    ) -> Result<(), RestoreError> {
        for (name, capacity) in pools {
            self.pools.insert(
                name,
                Pool {
                    capacity,
                    holders: HashMap::new(),
                },
            );
        }
        for (name, session, token, acquired_at) in seats {
            self.check_token(format!("seat in pool {name:?}"), token)?;
            let Some(s) = self.sessions.get_mut(&session) else {
                return Err(RestoreError::Orphan {
                    what: format!("seat in pool {name:?}"),
                    session,
                });
            };
            let Some(pool) = self.pools.get_mut(&name) else {
                return Err(RestoreError::SeatWithoutPool(name.to_string()));
            };
            s.seats.push(name.clone());
            pool.holders.insert(session, Seat { token, acquired_at });
        }
        Ok(())
    }

    /// Creates a pool or changes its capacity (1..=1 000 000) and metadata.
    pub fn put_pool(
        &mut self,
        name: &PoolName,
        capacity: u64,
        metadata: String,
        created_at: Option<UnixMs>,
        at: At,
        fx: &mut Effects,
    ) -> Result<PoolPut, InvalidInput> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(InvalidInput::new(
                "capacity",
                format!("must be between 1 and {MAX_CAPACITY} seats"),
            ));
        }
        if !metadata.is_empty() {
            self.limits.metadata(&metadata)?;
        }
        let capacity = capacity as u32;
        let created = !self.pools.contains_key(name);
        let pool = self.pools.entry(name.clone()).or_insert_with(|| Pool {
            capacity,
            holders: HashMap::new(),
        });
        let grew = capacity > pool.capacity;
        pool.capacity = capacity;
        if grew || created {
            fx.freed_pools.push(name.clone());
        }
        let revision = self.next_revision();
        fx.changes.push(Change::PutPool {
            name: name.clone(),
            record: PoolRecord {
                capacity,
                created_at: created_at.unwrap_or(at.wall),
                metadata,
            },
        });
        let mut event = self.event(at.wall, EventKind::PoolPut);
        event.pool = Some(name.to_string());
        event.detail = Some(format!("capacity {capacity}"));
        fx.changes.push(Change::Event(event));
        Ok(PoolPut { revision, created })
    }

    /// Deletes an empty pool.
    pub fn delete_pool(
        &mut self,
        name: &PoolName,
        at: At,
        fx: &mut Effects,
    ) -> Result<u64, PoolError> {
        let pool = self.pools.get(name).ok_or(PoolError::NotFound)?;
        // Seats of sessions past their deadline do not keep a pool alive.
        let holders: Vec<SessionId> = pool.holders.keys().copied().collect();
        for holder in holders {
            let _ = self.live_or_end(holder, at, fx);
        }
        let in_use = self.pools[name].holders.len();
        if in_use > 0 {
            return Err(PoolError::InUse(in_use));
        }
        self.pools.remove(name);
        let revision = self.next_revision();
        fx.changes.push(Change::DeletePool { name: name.clone() });
        let mut event = self.event(at.wall, EventKind::PoolDeleted);
        event.pool = Some(name.to_string());
        fx.changes.push(Change::Event(event));
        Ok(revision)
    }

    /// Gives session `id` a seat in `pool`; a session that already holds one gets it back.
    ///
    /// When the pool is full, holders past their deadline are ended inline first, so a
    /// contender never waits for the reaper.
    pub fn acquire_seat(
        &mut self,
        id: SessionId,
        pool_name: &PoolName,
        metadata: String,
        at: At,
        fx: &mut Effects,
    ) -> Result<SeatGrant, SeatError> {
        if !metadata.is_empty() {
            self.limits.metadata(&metadata)?;
        }
        if !self.pools.contains_key(pool_name) {
            return Err(SeatError::PoolNotFound);
        }
        self.live_or_end(id, at, fx)
            .map_err(|Gone| SeatError::SessionGone)?;
        let pool = &self.pools[pool_name];
        if let Some(seat) = pool.holders.get(&id) {
            return Ok(SeatGrant {
                token: seat.token,
                revision: self.revision(),
                fresh: false,
            });
        }
        if !pool.has_room() {
            self.end_expired_seat_holders(pool_name, at, fx);
            let pool = &self.pools[pool_name];
            if !pool.has_room() {
                return Err(SeatError::Exhausted {
                    capacity: pool.capacity,
                    in_use: pool.holders.len(),
                });
            }
            // Room was made inline; this caller takes one seat of it, the waiters the rest.
            if let Some(pos) = fx.freed_pools.iter().position(|p| p == pool_name) {
                fx.freed_pools.remove(pos);
            }
        }
        let revision = self.next_revision();
        let token = Token(revision);
        let seat = Seat {
            token,
            acquired_at: at.wall,
        };
        self.pools
            .get_mut(pool_name)
            .expect("checked above")
            .holders
            .insert(id, seat);
        self.sessions
            .get_mut(&id)
            .expect("checked live above")
            .seats
            .push(pool_name.clone());
        fx.changes.push(Change::PutSeat {
            pool: pool_name.clone(),
            session_id: id,
            record: SeatRecord {
                token,
                acquired_at: at.wall,
                metadata,
            },
        });
        let mut event = self.event(at.wall, EventKind::SeatAcquired);
        event.session_id = Some(id);
        event.pool = Some(pool_name.to_string());
        event.token = Some(token);
        fx.changes.push(Change::Event(event));
        Ok(SeatGrant {
            token,
            revision,
            fresh: true,
        })
    }

    /// Whether session `id` holds a seat in `pool`.
    pub fn holds_seat(&self, id: SessionId, pool: &PoolName) -> bool {
        self.pools
            .get(pool)
            .is_some_and(|p| p.holders.contains_key(&id))
    }

    /// Ends every holder of a seat in `pool` that is past its deadline; their seats are
    /// reclaimed and offered to whoever waits first.
    pub fn end_expired_seat_holders(&mut self, pool: &PoolName, at: At, fx: &mut Effects) {
        let Some(p) = self.pools.get(pool) else {
            return;
        };
        let expired: Vec<SessionId> = p
            .holders
            .keys()
            .filter(|h| self.sessions.get(h).is_none_or(|s| s.expired(at.now)))
            .copied()
            .collect();
        for holder in expired {
            let _ = self.live_or_end(holder, at, fx);
        }
    }

    /// Gives a seat back if the live session `id` holds it with exactly `token`.
    pub fn release_seat(
        &mut self,
        id: SessionId,
        pool_name: &PoolName,
        token: Token,
        at: At,
        fx: &mut Effects,
    ) -> Result<u64, PoolError> {
        if !self.pools.contains_key(pool_name) {
            return Err(PoolError::NotFound);
        }
        self.live_or_end(id, at, fx)
            .map_err(|Gone| PoolError::NotHolder)?;
        let pool = self.pools.get_mut(pool_name).expect("checked above");
        match pool.holders.get(&id) {
            Some(seat) if seat.token == token => {}
            _ => return Err(PoolError::NotHolder),
        }
        pool.holders.remove(&id);
        if let Some(s) = self.sessions.get_mut(&id)
            && let Some(pos) = s.seats.iter().position(|p| p == pool_name)
        {
            s.seats.swap_remove(pos);
        }
        let revision = self.next_revision();
        fx.changes.push(Change::DeleteSeat {
            pool: pool_name.clone(),
            session_id: id,
        });
        fx.freed_pools.push(pool_name.clone());
        let mut event = self.event(at.wall, EventKind::SeatReleased);
        event.session_id = Some(id);
        event.pool = Some(pool_name.to_string());
        event.token = Some(token);
        fx.changes.push(Change::Event(event));
        Ok(revision)
    }

    /// Takes back every seat of an ending session, one `seat_reclaimed` event each.
    pub(super) fn reclaim_seats(
        &mut self,
        id: SessionId,
        seats: Vec<PoolName>,
        reason: EndReason,
        at: At,
        fx: &mut Effects,
    ) -> Vec<(PoolName, Token)> {
        let mut out = Vec::with_capacity(seats.len());
        for name in seats {
            let pool = self
                .pools
                .get_mut(&name)
                .expect("a pool with holders is never deleted");
            let seat = pool
                .holders
                .remove(&id)
                .expect("a session's seat list only names seats it holds");
            fx.changes.push(Change::DeleteSeat {
                pool: name.clone(),
                session_id: id,
            });
            fx.freed_pools.push(name.clone());
            let mut event = self.event(at.wall, EventKind::SeatReclaimed);
            event.session_id = Some(id);
            event.pool = Some(name.to_string());
            event.token = Some(seat.token);
            event.reason = Some(reason);
            fx.changes.push(Change::Event(event));
            out.push((name, seat.token));
        }
        out
    }

    /// Whether `pool` can grant a seat now.
    pub fn pool_has_room(&self, pool: &PoolName) -> bool {
        self.pools.get(pool).is_some_and(Pool::has_room)
    }

    pub fn pool(&self, name: &PoolName) -> Option<PoolView> {
        self.pools.get(name).map(|p| PoolView {
            name: name.clone(),
            capacity: p.capacity,
            holders: p.holders.iter().map(|(s, seat)| (*s, *seat)).collect(),
        })
    }

    /// Every pool with its capacity and seats in use, in name order.
    pub fn pools(&self) -> Vec<(PoolName, u32, usize)> {
        let mut out: Vec<_> = self
            .pools
            .iter()
            .map(|(n, p)| (n.clone(), p.capacity, p.holders.len()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    pub(super) fn check_pools(&self) -> Result<(), String> {
        for (name, pool) in &self.pools {
            for (holder, seat) in &pool.holders {
                let Some(s) = self.sessions.get(holder) else {
                    return Err(format!("seat in {name} held by missing session {holder}"));
                };
                if !s.seats.contains(name) {
                    return Err(format!("seat in {name} is not in {holder}'s seat list"));
                }
                if seat.token.0 > self.revision() {
                    return Err(format!("seat in {name} has a token above the revision"));
                }
            }
        }
        for (id, s) in &self.sessions {
            for name in &s.seats {
                if !self
                    .pools
                    .get(name)
                    .is_some_and(|p| p.holders.contains_key(id))
                {
                    return Err(format!(
                        "session {id} lists a seat in {name} it does not hold"
                    ));
                }
            }
        }
        Ok(())
    }
}
