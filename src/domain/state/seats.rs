//! The seat rules of the aggregate: who may take, keep and give back a seat in a pool.
//!
//! Every seat is held by a live session, which lists it; every grant takes a fresh token
//! from the revision; a pool never gains a holder while it is at or above its capacity.

use super::{At, Effects, Gone, RestoreError, State, unlist};
use crate::domain::change::{Change, EndReason, EventKind, PoolRecord, SeatRecord};
use crate::domain::ids::{PoolName, SessionId, Token};
use crate::domain::limits::InvalidInput;
use crate::domain::pools::{self, PoolError, PoolPut, PoolView, Seat, SeatError, SeatGrant};
use crate::domain::time::UnixMs;

impl State {
    pub(super) fn restore_pools(
        &mut self,
        pools: Vec<(PoolName, u32)>,
        seats: Vec<(PoolName, SessionId, Token, UnixMs)>,
    ) -> Result<(), RestoreError> {
        for (name, capacity) in pools {
            self.pools.put(&name, capacity);
        }
        for (name, session, token, acquired_at) in seats {
            self.check_token(|| format!("seat in pool {name:?}"), token)?;
            let Some(s) = self.sessions.get_mut(&session) else {
                return Err(RestoreError::Orphan {
                    what: format!("seat in pool {name:?}"),
                    session,
                });
            };
            if !self.pools.seat(&name, session, Seat { token, acquired_at }) {
                return Err(RestoreError::SeatWithoutPool(name.to_string()));
            }
            s.seats.push(name);
        }
        Ok(())
    }

    /// Creates a pool or changes its capacity (1..=1 000 000) and metadata. `created_at` is
    /// when an existing pool was created; a new one is created now.
    pub fn put_pool(
        &mut self,
        name: &PoolName,
        capacity: u64,
        metadata: String,
        created_at: Option<UnixMs>,
        at: At,
        fx: &mut Effects,
    ) -> Result<PoolPut, InvalidInput> {
        let capacity = pools::capacity(capacity)?;
        if !metadata.is_empty() {
            self.limits.metadata(&metadata)?;
        }
        let resized = self.pools.put(name, capacity);
        if resized.room_added {
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
        Ok(PoolPut {
            revision,
            created: resized.created,
        })
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
        let holders: Vec<SessionId> = pool.holders().collect();
        for holder in holders {
            let _ = self.live_or_end(holder, at, fx);
        }
        self.pools.remove_empty(name)?;
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
        if !self.pools.contains(pool_name) {
            return Err(SeatError::PoolNotFound);
        }
        self.live_or_end(id, at, fx)
            .map_err(|Gone| SeatError::SessionGone)?;
        let pool = self.pools.get(pool_name).expect("checked above");
        if let Some(seat) = pool.seat(id) {
            return Ok(SeatGrant {
                token: seat.token,
                revision: self.revision(),
                fresh: false,
            });
        }
        if !pool.has_room() {
            self.end_expired_seat_holders(pool_name, at, fx);
            let pool = self.pools.get(pool_name).expect("checked above");
            if !pool.has_room() {
                return Err(SeatError::Exhausted {
                    capacity: pool.capacity(),
                    in_use: pool.in_use(),
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
        self.pools.seat(pool_name, id, seat);
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
        self.pools.holds(pool, id)
    }

    /// Ends every holder of a seat in `pool` that is past its deadline; their seats are
    /// reclaimed and offered to whoever waits first.
    pub fn end_expired_seat_holders(&mut self, pool: &PoolName, at: At, fx: &mut Effects) {
        let Some(p) = self.pools.get(pool) else {
            return;
        };
        let expired: Vec<SessionId> = p
            .holders()
            .filter(|h| self.sessions.get(h).is_none_or(|s| s.expired(at.now)))
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
        if !self.pools.contains(pool_name) {
            return Err(PoolError::NotFound);
        }
        self.live_or_end(id, at, fx)
            .map_err(|Gone| PoolError::NotHolder)?;
        match self.pools.get(pool_name).and_then(|p| p.seat(id)) {
            Some(seat) if seat.token == token => {}
            _ => return Err(PoolError::NotHolder),
        }
        self.pools.unseat(pool_name, id);
        if let Some(s) = self.sessions.get_mut(&id) {
            unlist(&mut s.seats, pool_name);
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
            let seat = self
                .pools
                .unseat(&name, id)
                .expect("a session's seat list only names seats it holds, in pools that exist");
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
        self.pools.has_room(pool)
    }

    pub fn pool(&self, name: &PoolName) -> Option<PoolView> {
        self.pools.view(name)
    }

    /// Every pool with its capacity and seats in use, in name order.
    pub fn pools(&self) -> Vec<(PoolName, u32, usize)> {
        self.pools.list()
    }

    /// Every seat's holder is a session that lists it, with a token at most the revision;
    /// every seat a session lists is held.
    pub(super) fn check_seats(&self) -> Result<(), String> {
        for (name, holder, seat) in self.pools.seats() {
            let Some(s) = self.sessions.get(&holder) else {
                return Err(format!("seat in {name} held by missing session {holder}"));
            };
            if !s.seats.contains(name) {
                return Err(format!("seat in {name} is not in {holder}'s seat list"));
            }
            if seat.token.0 > self.revision() {
                return Err(format!("seat in {name} has a token above the revision"));
            }
        }
        for (id, s) in &self.sessions {
            for name in &s.seats {
                if !self.pools.holds(name, *id) {
                    return Err(format!(
                        "session {id} lists a seat in {name} it does not hold"
                    ));
                }
            }
        }
        Ok(())
    }
}
