//! The seat pool table (counting semaphores, floating licences): each pool's capacity and
//! who holds a seat, one seat per session per pool.
//!
//! The table knows nothing of sessions' liveness, tokens or events: the aggregate
//! ([`super::state::State`]) decides who may take a seat, draws the token, and records the
//! change. Shrinking a pool takes no seat away; new grants wait until use falls below it.

use std::collections::HashMap;

use super::ids::{PoolName, SessionId, Token};
use super::limits::InvalidInput;
use super::time::UnixMs;

pub const MAX_CAPACITY: u64 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seat {
    pub token: Token,
    pub acquired_at: UnixMs,
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

/// A pool's capacity, checked: 1 ..= [`MAX_CAPACITY`] seats.
pub fn capacity(requested: u64) -> Result<u32, InvalidInput> {
    if requested == 0 || requested > MAX_CAPACITY {
        return Err(InvalidInput::new(
            "capacity",
            format!("must be between 1 and {MAX_CAPACITY} seats"),
        ));
    }
    Ok(requested as u32)
}

#[derive(Debug, Clone)]
pub(super) struct Pool {
    capacity: u32,
    holders: HashMap<SessionId, Seat>,
}

impl Pool {
    pub(super) fn capacity(&self) -> u32 {
        self.capacity
    }

    pub(super) fn in_use(&self) -> usize {
        self.holders.len()
    }

    pub(super) fn has_room(&self) -> bool {
        self.holders.len() < self.capacity as usize
    }

    pub(super) fn seat(&self, session: SessionId) -> Option<Seat> {
        self.holders.get(&session).copied()
    }

    pub(super) fn holders(&self) -> impl Iterator<Item = SessionId> + '_ {
        self.holders.keys().copied()
    }
}

/// What a put did to a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Resized {
    pub(super) created: bool,
    /// Created, or given more seats: waiters may be served.
    pub(super) room_added: bool,
}

/// Every pool by name.
#[derive(Debug, Clone, Default)]
pub(super) struct Pools {
    by_name: HashMap<PoolName, Pool>,
}

impl Pools {
    pub(super) fn get(&self, name: &PoolName) -> Option<&Pool> {
        self.by_name.get(name)
    }

    pub(super) fn contains(&self, name: &PoolName) -> bool {
        self.by_name.contains_key(name)
    }

    /// Creates `name` with `capacity` seats, or changes its capacity.
    pub(super) fn put(&mut self, name: &PoolName, capacity: u32) -> Resized {
        let created = !self.by_name.contains_key(name);
        let pool = self.by_name.entry(name.clone()).or_insert_with(|| Pool {
            capacity,
            holders: HashMap::new(),
        });
        let grew = capacity > pool.capacity;
        pool.capacity = capacity;
        Resized {
            created,
            room_added: created || grew,
        }
    }

    /// Removes a pool no one holds a seat in.
    pub(super) fn remove_empty(&mut self, name: &PoolName) -> Result<(), PoolError> {
        let pool = self.by_name.get(name).ok_or(PoolError::NotFound)?;
        if !pool.holders.is_empty() {
            return Err(PoolError::InUse(pool.holders.len()));
        }
        self.by_name.remove(name);
        Ok(())
    }

    /// Seats `session` in `pool`. `false` when there is no such pool. Room is the caller's
    /// to check: a restored seat may stand above a capacity that was shrunk.
    pub(super) fn seat(&mut self, pool: &PoolName, session: SessionId, seat: Seat) -> bool {
        match self.by_name.get_mut(pool) {
            Some(p) => {
                p.holders.insert(session, seat);
                true
            }
            None => false,
        }
    }

    /// Takes back `session`'s seat in `pool`, if it holds one.
    pub(super) fn unseat(&mut self, pool: &PoolName, session: SessionId) -> Option<Seat> {
        self.by_name.get_mut(pool)?.holders.remove(&session)
    }

    pub(super) fn holds(&self, pool: &PoolName, session: SessionId) -> bool {
        self.by_name
            .get(pool)
            .is_some_and(|p| p.holders.contains_key(&session))
    }

    pub(super) fn has_room(&self, pool: &PoolName) -> bool {
        self.by_name.get(pool).is_some_and(Pool::has_room)
    }

    pub(super) fn view(&self, name: &PoolName) -> Option<PoolView> {
        self.by_name.get(name).map(|p| PoolView {
            name: name.clone(),
            capacity: p.capacity,
            holders: p.holders.iter().map(|(s, seat)| (*s, *seat)).collect(),
        })
    }

    /// Every pool with its capacity and seats in use, in name order.
    pub(super) fn list(&self) -> Vec<(PoolName, u32, usize)> {
        let mut out: Vec<_> = self
            .by_name
            .iter()
            .map(|(n, p)| (n.clone(), p.capacity, p.holders.len()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Every seat with its pool, for the aggregate's invariant check.
    pub(super) fn seats(&self) -> impl Iterator<Item = (&PoolName, SessionId, Seat)> + '_ {
        self.by_name
            .iter()
            .flat_map(|(name, p)| p.holders.iter().map(move |(s, seat)| (name, *s, *seat)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> PoolName {
        PoolName::parse("pool", s).unwrap()
    }

    fn seat(t: u64) -> Seat {
        Seat {
            token: Token(t),
            acquired_at: UnixMs(0),
        }
    }

    #[test]
    fn capacity_is_bounded() {
        for (asked, ok) in [
            (0, false),
            (1, true),
            (MAX_CAPACITY, true),
            (MAX_CAPACITY + 1, false),
        ] {
            assert_eq!(capacity(asked).is_ok(), ok, "{asked}");
        }
    }

    #[test]
    fn put_reports_created_and_added_room_and_shrinking_takes_no_seat() {
        let mut pools = Pools::default();
        let p = name("p");
        let put = pools.put(&p, 2);
        assert!(put.created && put.room_added);
        assert!(pools.seat(&p, SessionId::from_u128(1), seat(1)));
        assert!(pools.seat(&p, SessionId::from_u128(2), seat(2)));
        let shrunk = pools.put(&p, 1);
        assert!(!shrunk.created && !shrunk.room_added);
        assert_eq!(pools.get(&p).unwrap().in_use(), 2);
        assert!(!pools.has_room(&p));
        assert!(pools.put(&p, 3).room_added);
        assert!(pools.has_room(&p));
        assert!(!pools.seat(&name("other"), SessionId::from_u128(1), seat(3)));
    }

    #[test]
    fn only_an_empty_pool_is_removed() {
        let mut pools = Pools::default();
        let p = name("p");
        assert_eq!(pools.remove_empty(&p), Err(PoolError::NotFound));
        pools.put(&p, 1);
        pools.seat(&p, SessionId::from_u128(1), seat(1));
        assert_eq!(pools.remove_empty(&p), Err(PoolError::InUse(1)));
        assert_eq!(pools.unseat(&p, SessionId::from_u128(1)), Some(seat(1)));
        assert_eq!(pools.unseat(&p, SessionId::from_u128(1)), None);
        assert_eq!(pools.remove_empty(&p), Ok(()));
        assert!(pools.list().is_empty());
    }
}
