//! Seat pools: create or resize, delete, take and give back seats, the reads. Every grant
//! locks the pool row first, so the count it checks against the capacity holds across
//! nodes until it commits.

use uuid::Uuid;

use super::sessions::{END_EXPIRED_ONE, END_EXPIRED_SEAT_HOLDERS};
use super::{Fail, Postgres, transact};
use crate::backend::requests::{Answer, Request};
use crate::backend::waiting::{Resource, Step};
use crate::backend::{BackendError, Granted, PoolInfo, Result, SeatHolder};
use crate::domain::pools::MAX_CAPACITY;
use crate::domain::{InvalidInput, PoolName, PoolPut, SeatRecord, SessionId, Token, UnixMs};

/// Serialises the creation of one pool name across nodes (a missing row cannot be locked).
const NAME_LOCK: &str = "SELECT pg_advisory_xact_lock($1, hashtext('pool:' || $2))";

const POOL_FOR_UPDATE: &str =
    "SELECT capacity, coalesce(metadata::text, '') FROM {ns}.pool WHERE name = $1 FOR UPDATE";

const CREATE: &str = "
WITH r AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision),
p AS (
    INSERT INTO {ns}.pool (name, capacity, metadata, revision)
    SELECT $1, $2, $3::text::jsonb, revision FROM r
),
e AS (
    INSERT INTO {ns}.event (kind, pool, detail, actor)
    VALUES ('pool_put', $1, 'capacity ' || $2, $4::text)
)
SELECT revision FROM r";

/// A resize keeps created_at, and the metadata unless new is given.
const RESIZE: &str = "
WITH r AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision),
p AS (
    UPDATE {ns}.pool SET capacity = $2, metadata = coalesce($3::text::jsonb, metadata),
                         revision = (SELECT revision FROM r)
    WHERE name = $1
),
e AS (
    INSERT INTO {ns}.event (kind, pool, detail, actor)
    VALUES ('pool_put', $1, 'capacity ' || $2, $4::text)
)
SELECT revision FROM r";

const SEATS_IN_USE: &str = "SELECT count(*) FROM {ns}.seat WHERE pool = $1";

const DELETE: &str = "
WITH r AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision),
p AS (DELETE FROM {ns}.pool WHERE name = $1),
e AS (INSERT INTO {ns}.event (kind, pool, actor) VALUES ('pool_deleted', $1, $2::text))
SELECT revision FROM r";

/// With the pool row locked: the caller's liveness, its seat if it has one, the seats in
/// use, and the revision.
const SEAT_STATE: &str = "
SELECT (SELECT expires_at > {ns}.db_now() FROM {ns}.session WHERE id = $2 FOR KEY SHARE),
       (SELECT token FROM {ns}.seat WHERE pool = $1 AND session_id = $2),
       (SELECT count(*) FROM {ns}.seat WHERE pool = $1),
       (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {ns}.revision)";

const TAKE_SEAT: &str = "
WITH g AS (
    INSERT INTO {ns}.seat (pool, session_id, token, metadata)
    VALUES ($1, $2, nextval('{ns}.revision'), $3::text::jsonb)
    RETURNING token
),
e AS (
    INSERT INTO {ns}.event (kind, session_id, pool, token)
    SELECT 'seat_acquired', $2, $1, token FROM g
)
SELECT token FROM g";

const RELEASE_SEAT: &str = "
WITH me AS MATERIALIZED (
    SELECT id FROM {ns}.session WHERE id = $2 AND expires_at > {ns}.db_now() FOR KEY SHARE
),
gone AS (
    DELETE FROM {ns}.seat st USING me
    WHERE st.pool = $1 AND st.session_id = me.id AND st.token = $3
    RETURNING st.pool
),
rev AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision FROM gone),
e AS (
    INSERT INTO {ns}.event (kind, session_id, pool, token)
    SELECT 'seat_released', $2, $1, $3 FROM rev
)
SELECT revision FROM rev";

const POOL_EXISTS: &str = "SELECT 1 FROM {ns}.pool WHERE name = $1";

const POOL: &str = "SELECT capacity, coalesce(metadata::text, ''), {ns}.ms(created_at) FROM {ns}.pool WHERE name = $1";

const HOLDERS: &str = "
SELECT st.session_id, s.owner, st.token, {ns}.ms(st.acquired_at),
       coalesce(st.metadata::text, ''), s.expires_at > {ns}.db_now(),
       {ns}.ms(s.last_heartbeat_at),
       {ns}.db_now() - s.last_heartbeat_at > (s.ttl_ms / 3) * interval '1 millisecond'
FROM {ns}.seat st JOIN {ns}.session s ON s.id = st.session_id
WHERE st.pool = $1 ORDER BY st.session_id";

const POOLS: &str = "
SELECT p.name::text, p.capacity, (SELECT count(*) FROM {ns}.seat st WHERE st.pool = p.name)
FROM {ns}.pool p ORDER BY p.name";

enum Seat {
    NoPool,
    Gone,
    Own(Token, u64),
    Full {
        capacity: u32,
        in_use: usize,
    },
    /// Room, but others wait ahead of the caller.
    Behind {
        capacity: u32,
        in_use: usize,
    },
    Granted(Token),
    /// The first answer of a call with the same request id.
    Replay(Answer),
}

impl Postgres {
    pub async fn put_pool(
        &self,
        name: PoolName,
        capacity: u64,
        metadata: Option<String>,
    ) -> Result<PoolPut> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(InvalidInput::new(
                "capacity",
                format!("must be between 1 and {MAX_CAPACITY} seats"),
            )
            .into());
        }
        let metadata = metadata.filter(|m| !m.is_empty());
        if let Some(m) = &metadata {
            self.config().limits.metadata(m)?;
        }
        let capacity = capacity as i32;
        let put = transact!(self, |tx, after| {
            // Two nodes creating the same pool at once: the second waits here, then finds
            // the row and resizes it.
            self.q(&tx, NAME_LOCK, &[&self.class(), &name.as_str()])
                .await?;
            let existing = self.q_one(&tx, POOL_FOR_UPDATE, &[&name.as_str()]).await?;
            let created = existing.is_none();
            let grew = existing
                .as_ref()
                .is_some_and(|r| r.get::<_, i32>(0) < capacity);
            let statement = if created { CREATE } else { RESIZE };
            let row = self
                .q_one(
                    &tx,
                    statement,
                    &[&name.as_str(), &capacity, &metadata, &self.actor()],
                )
                .await?
                .ok_or(Fail::Answer(BackendError::Unavailable(
                    "the pool write returned nothing".into(),
                )))?;
            if created || grew {
                after.freed.push(Resource::Pool(name.clone()));
            }
            PoolPut {
                revision: row.get::<_, i64>(0) as u64,
                created,
            }
        })?;
        self.inner
            .metrics
            .seats_capacity
            .get_or_create(&crate::metrics::PoolLabel {
                pool: name.to_string(),
            })
            .set(i64::from(capacity));
        self.gauge_seats(name.as_str(), 0);
        Ok(put)
    }

    /// Deletes a pool with no seat in use; holders past their deadline are ended first and
    /// do not keep it alive.
    pub async fn delete_pool(&self, name: PoolName) -> Result<u64> {
        let r = transact!(self, |tx, after| {
            if self
                .q_one(&tx, POOL_FOR_UPDATE, &[&name.as_str()])
                .await?
                .is_none()
            {
                Err(BackendError::PoolNotFound)
            } else {
                self.end_in(
                    &tx,
                    &mut after,
                    &END_EXPIRED_SEAT_HOLDERS,
                    &[&name.as_str(), &self.actor()],
                )
                .await?;
                let in_use: i64 = self
                    .q_one(&tx, SEATS_IN_USE, &[&name.as_str()])
                    .await?
                    .map_or(0, |r| r.get(0));
                if in_use > 0 {
                    Err(BackendError::PoolInUse(in_use as usize))
                } else {
                    let row = self
                        .q_one(&tx, DELETE, &[&name.as_str(), &self.actor()])
                        .await?;
                    // Waiters learn on their next try that the pool is gone.
                    after.freed.push(Resource::Pool(name.clone()));
                    Ok(row.map_or(0, |r| r.get::<_, i64>(0) as u64))
                }
            }
        })?;
        if r.is_ok() {
            self.inner.metrics.set_pool(name.as_str(), None);
        }
        r
    }

    pub async fn acquire_seat(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
    ) -> Result<Granted> {
        self.seat_once(id, pool, metadata, wait_ms, None).await
    }

    /// A seat acquire, with a request id if `request` is given: a replay answers the
    /// first grant, and is not counted again.
    pub(super) async fn seat_once(
        &self,
        id: SessionId,
        pool: PoolName,
        metadata: Option<String>,
        wait_ms: u64,
        request: Option<&Request>,
    ) -> Result<Granted> {
        let metadata = metadata.filter(|m| !m.is_empty());
        if let Some(m) = &metadata {
            self.config().limits.metadata(m)?;
        }
        let deadline = self.wait_deadline(wait_ms);
        self.waiting()
            .seat(pool.clone(), deadline, &self.inner.metrics, |may_take| {
                self.try_seat(id, &pool, &metadata, may_take, request)
            })
            .await
    }

    async fn try_seat(
        &self,
        id: SessionId,
        pool: &PoolName,
        metadata: &Option<String>,
        may_take: bool,
        request: Option<&Request>,
    ) -> Result<Step<Granted, (u32, usize)>> {
        let outcome = transact!(self, |tx, after| {
            let replay = self.begin_request(&tx, request).await?;
            let existing = match replay {
                Some(_) => None,
                None => self.q_one(&tx, POOL_FOR_UPDATE, &[&pool.as_str()]).await?,
            };
            let seat = match existing {
                _ if let Some(a) = &replay => Seat::Replay(a.clone()),
                None => Seat::NoPool,
                Some(p) => {
                    let capacity = p.get::<_, i32>(0) as u32;
                    let state = self
                        .q_one(&tx, SEAT_STATE, &[&pool.as_str(), &id.0])
                        .await?
                        .ok_or(Fail::Answer(BackendError::Unavailable(
                            "the seat state query returned nothing".into(),
                        )))?;
                    let live: Option<bool> = state.get(0);
                    let own: Option<i64> = state.get(1);
                    let mut in_use = state.get::<_, i64>(2) as usize;
                    let revision = state.get::<_, i64>(3) as u64;
                    match (live, own) {
                        (None, _) => Seat::Gone,
                        (Some(false), _) => {
                            self.end_in(&tx, &mut after, &END_EXPIRED_ONE, &[&id.0])
                                .await?;
                            Seat::Gone
                        }
                        (Some(true), Some(t)) => Seat::Own(Token(t as u64), revision),
                        (Some(true), None) => {
                            if in_use >= capacity as usize || !may_take {
                                // Holders past their deadline are ended here, so a
                                // contender never waits for the reaper.
                                let ended = self
                                    .end_in(
                                        &tx,
                                        &mut after,
                                        &END_EXPIRED_SEAT_HOLDERS,
                                        // A client's own call: nobody to name.
                                        &[&pool.as_str(), &None::<&str>],
                                    )
                                    .await?;
                                in_use -= ended.sessions().min(in_use);
                            }
                            if in_use >= capacity as usize {
                                Seat::Full { capacity, in_use }
                            } else if !may_take {
                                Seat::Behind { capacity, in_use }
                            } else {
                                let row = self
                                    .q_one(&tx, TAKE_SEAT, &[&pool.as_str(), &id.0, metadata])
                                    .await?
                                    .ok_or(Fail::Answer(BackendError::Unavailable(
                                        "the seat grant returned nothing".into(),
                                    )))?;
                                Seat::Granted(Token(row.get::<_, i64>(0) as u64))
                            }
                        }
                    }
                }
            };
            let answer = match &seat {
                Seat::Replay(_) => None,
                Seat::Own(token, revision) => Some(Answer::Granted {
                    token: token.0,
                    revision: *revision,
                }),
                Seat::Granted(token) => Some(Answer::Granted {
                    token: token.0,
                    revision: token.0,
                }),
                _ => None,
            };
            if replay.is_none() {
                self.settle_request(&tx, request, answer.as_ref()).await?;
            }
            seat
        })?;
        Ok(match outcome {
            Seat::Replay(a) => {
                self.inner.metrics.request_id_replays.inc();
                Step::Done(a.granted().ok_or(BackendError::RequestIdReused)?)
            }
            Seat::NoPool => return Err(BackendError::PoolNotFound),
            Seat::Gone => return Err(BackendError::SessionGone),
            Seat::Own(token, revision) => Step::Done(Granted { token, revision }),
            Seat::Full { capacity, in_use } => Step::Busy((capacity, in_use)),
            Seat::Behind { capacity, in_use } => Step::Room((capacity, in_use)),
            Seat::Granted(token) => {
                self.gauge_seats(pool.as_str(), 1);
                Step::Done(Granted {
                    token,
                    revision: token.0,
                })
            }
        })
    }

    pub async fn release_seat(&self, id: SessionId, pool: PoolName, token: Token) -> Result<u64> {
        let rows = self
            .query(
                RELEASE_SEAT,
                &[&pool.as_str(), &id.0, &(token.0 as i64)],
                false,
            )
            .await?;
        match rows.first() {
            Some(row) => Ok(self.seat_released(pool, row.get::<_, i64>(0) as u64)),
            None => Err(self.seat_not_released(id, &pool).await?),
        }
    }

    /// A seat release with a request id: the release statement and the record in one
    /// transaction; a replay answers the first revision.
    pub(super) async fn release_seat_once(
        &self,
        id: SessionId,
        pool: PoolName,
        token: Token,
        request: &Request,
    ) -> Result<u64> {
        let done = transact!(self, |tx, _after| {
            match self.begin_request(&tx, Some(request)).await? {
                Some(a) => (a, false),
                None => {
                    let row = self
                        .q_one(
                            &tx,
                            RELEASE_SEAT,
                            &[&pool.as_str(), &id.0, &(token.0 as i64)],
                        )
                        .await?
                        .ok_or(Fail::Answer(BackendError::NotHolder))?;
                    let a = Answer::Released {
                        revision: row.get::<_, i64>(0) as u64,
                    };
                    self.settle_request(&tx, Some(request), Some(&a)).await?;
                    (a, true)
                }
            }
        });
        match done {
            Ok((Answer::Released { revision }, true)) => Ok(self.seat_released(pool, revision)),
            Ok((Answer::Released { revision }, false)) => {
                self.inner.metrics.request_id_replays.inc();
                Ok(revision)
            }
            Ok(_) => Err(BackendError::RequestIdReused),
            Err(BackendError::NotHolder) => Err(self.seat_not_released(id, &pool).await?),
            Err(e) => Err(e),
        }
    }

    /// After a committed seat release: the gauge, and the pool's waiters woken.
    fn seat_released(&self, pool: PoolName, revision: u64) -> u64 {
        self.gauge_seats(pool.as_str(), -1);
        let freed = Resource::Pool(pool);
        self.announce(std::slice::from_ref(&freed), false);
        self.waiting().wake(&freed);
        revision
    }

    /// Why a release removed no seat: no such pool, the caller gone (ended here if past its
    /// deadline), or not its seat.
    async fn seat_not_released(&self, id: SessionId, pool: &PoolName) -> Result<BackendError> {
        if self
            .query_opt(POOL_EXISTS, &[&pool.as_str()], true)
            .await?
            .is_none()
        {
            return Ok(BackendError::PoolNotFound);
        }
        self.live_or_end(id).await?;
        Ok(BackendError::NotHolder)
    }

    /// A pool with its holders and their liveness on the database clock.
    pub async fn pool(&self, name: &PoolName) -> Result<Option<PoolInfo>> {
        let Some(p) = self.query_opt(POOL, &[&name.as_str()], true).await? else {
            return Ok(None);
        };
        let holders: Vec<SeatHolder> = self
            .query(HOLDERS, &[&name.as_str()], true)
            .await?
            .iter()
            .map(|r| {
                let live: bool = r.get(5);
                SeatHolder {
                    session_id: SessionId(r.get::<_, Uuid>(0)),
                    owner: r.get(1),
                    seat: SeatRecord {
                        token: Token(r.get::<_, i64>(2) as u64),
                        acquired_at: UnixMs(r.get::<_, i64>(3) as u64),
                        metadata: r.get(4),
                    },
                    last_heartbeat_at: live.then(|| UnixMs(r.get::<_, i64>(6) as u64)),
                    grace: live.then(|| r.get::<_, bool>(7)),
                }
            })
            .collect();
        Ok(Some(PoolInfo {
            capacity: p.get::<_, i32>(0) as u32,
            in_use: holders.len(),
            waiting: self.waiting().waiting(&Resource::Pool(name.clone())),
            metadata: p.get(1),
            created_at: UnixMs(p.get::<_, i64>(2) as u64),
            holders,
        }))
    }

    /// Every pool: name, capacity, seats in use (holders past their deadline included until
    /// they are reclaimed).
    pub async fn pools(&self) -> Result<Vec<(String, u32, usize)>> {
        Ok(self
            .query(POOLS, &[], true)
            .await?
            .iter()
            .map(|r| {
                (
                    r.get(0),
                    r.get::<_, i32>(1) as u32,
                    r.get::<_, i64>(2) as usize,
                )
            })
            .collect())
    }
}
