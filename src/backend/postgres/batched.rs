//! Concurrent heartbeats, lock acquires and lock releases of one node sent together: each
//! kind goes through a [`Batcher`], so while a statement of a kind is unanswered, the
//! requests that arrive meanwhile go as one statement (a second goes beside the first once
//! [`EXTRA_FROM`] wait, at most [`IN_FLIGHT`] at once) — one commit, one
//! wake-up of a backend — instead of one each. A lone request goes alone, by the statement
//! it always used.
//!
//! - **Heartbeats**: one conditional `UPDATE … FROM unnest(…)` of the live sessions of the
//!   batch. A session missing from its answer (gone, past its deadline, its row locked by
//!   another transaction, or asked twice in the batch) is sent alone, by the one-session
//!   path, which says gone only once the end is durable.
//! - **Acquires** (first attempts that may take the key; waiting, request ids and ending an
//!   expired holder keep their own paths) and **releases**: one call of `acquire_many` or
//!   `release_many` (schema version 6), built on the one-element `acquire` and `release`,
//!   each element answered as alone. An element answered `busy` is sent alone. Since schema
//!   version 8 a batch writes its elements' audit events together at its end, numbered when
//!   the numbering lock is free (`log_events`), instead of each unnumbered and numbered later.
//!
//! **No deadlock.** A batch statement never waits for a lock another transaction holds: the
//! heartbeat skips locked session rows, and the lock functions take every lock an element
//! needs without waiting first (`pg_try_advisory_xact_lock`, `SKIP LOCKED`), answering
//! `busy` when one is held; the numbering lock at the batch's end is only tried too. So a
//! batch is in no wait cycle, whatever the order in which concurrent batches (of this node
//! or another) and other transactions take key locks and row locks, and no element waits
//! for another element's lock: the locks an element takes
//! belong to the batch's transaction, which holds them already for the next element. Any
//! batch may therefore run beside any other, and several of a kind are in flight at once.
//!
//! **Failures.** A statement refused as a deadlock or serialization failure (rolled back:
//! nothing happened) is sent again; a broken connection leaves every element's outcome
//! unknown and each is answered unavailable, as alone; any other failure (the server
//! refused the statement, or it ran out of time, and rolled back) must not fail requests
//! that would have succeeded alone, so each element is then sent alone.
//!
//! **Token order.** A grant in a batch draws its token inside the batch's statement, after
//! it holds the key's advisory lock, which it holds to the commit, exactly as alone: per
//! key, tokens strictly increase. And the statement began after every request of its batch
//! arrived, so a token acknowledged before one of them arrived was drawn (and committed)
//! before the statement began; `nextval` never goes back, so the grant's token is greater.

use std::sync::Weak;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio_postgres::Row;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::{Inner, Postgres};
use crate::backend::batch::{Batcher, Limits};
use crate::backend::waiting::Step;
use crate::backend::{BackendError, Beat, Granted, Result};
use crate::domain::{LockKey, SessionId, Token};

/// Statements of one kind unanswered at once: a second lets the database run the next batch
/// while the first waits for its commit's WAL flush, or on another core.
const IN_FLIGHT: usize = 2;
/// Requests that must wait before a statement goes beside one already unanswered. The
/// first statement goes at once (a lone request costs what it always did); the second only
/// for a batch worth its statement, its commit and its executor start-ups. When any free
/// slot sent whatever waited, a slot freed by a fast answer took one or two requests alone:
/// under lock churn at 64 clients, two statements in flight cost the database 155-164 µs a
/// pair and did 0.61-0.69× the raw tables, four 200-207 µs (0.55-0.57×), one 116-124 µs
/// but left a core idle (0.72-0.74×). With the second waiting for 16, 132-142 µs and
/// 0.72-0.80× (`pg-ab.sh`, `docs/benchmarks.md`).
const EXTRA_FROM: usize = 16;
/// The most requests one statement carries, so a batch holds its locks a bounded time.
const MAX_BATCH: usize = 256;

/// The live sessions among `$1` extended, each by its own TTL `$2` (`NULL`: its current
/// one), on the database clock; rows another transaction holds are skipped, never waited
/// for. Answers the sessions it extended.
const HEARTBEAT_MANY: &str = "
WITH b AS MATERIALIZED (SELECT * FROM unnest($1::uuid[], $2::bigint[]) AS b (id, ttl)),
t AS MATERIALIZED (
    SELECT s.id FROM {ns}.session s
    WHERE s.id = ANY ($1::uuid[]) AND s.expires_at > {ns}.db_now()
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE {ns}.session s SET
    ttl_ms = coalesce(b.ttl, s.ttl_ms),
    expires_at = {ns}.db_now() + coalesce(b.ttl, s.ttl_ms) * interval '1 millisecond',
    last_heartbeat_at = {ns}.db_now()
FROM t JOIN b ON b.id = t.id
WHERE s.id = t.id
RETURNING s.id, {ns}.ms(s.expires_at), s.ttl_ms";

const ACQUIRE_MANY: &str = "
SELECT answer, granted, revision, held FROM {ns}.acquire_many($1, $2::text[], $3::uuid[], $4)";

const RELEASE_MANY: &str =
    "SELECT answer, revision FROM {ns}.release_many($1, $2::text[], $3::uuid[], $4::bigint[])";

type Heartbeat = (SessionId, Option<i64>);
type Acquire = (SessionId, LockKey);
type Release = (SessionId, LockKey, Token);

/// The node's batchers, one per kind.
pub(crate) struct Batches {
    heartbeat: Batcher<Heartbeat, Result<Beat>>,
    acquire: Batcher<Acquire, Result<Step<Granted, ()>>>,
    release: Batcher<Release, Result<u64>>,
    /// The most requests one batch of each kind carried (heartbeats, acquires, releases).
    pub(crate) largest: [AtomicUsize; 3],
}

/// Starts a batcher whose batches `send` answers on the node; the batcher holds the node
/// weakly, so it does not keep the node alive.
fn batcher<Q, A, F, Fut>(node: &Weak<Inner>, send: F) -> Batcher<Q, A>
where
    Q: Send + 'static,
    A: Send + 'static,
    F: Fn(Postgres, Vec<Q>) -> Fut + Send + Sync + Copy + 'static,
    Fut: std::future::Future<Output = Vec<A>> + Send + 'static,
{
    let node = node.clone();
    let limits = Limits {
        in_flight: IN_FLIGHT,
        max_batch: MAX_BATCH,
        extra_from: EXTRA_FROM,
    };
    Batcher::start(limits, move |batch: Vec<Q>| {
        let node = node.upgrade();
        async move {
            match node {
                Some(inner) => send(Postgres { inner, actor: None }, batch).await,
                // The node is gone: nobody waits for the answers.
                None => Vec::new(),
            }
        }
    })
}

impl Batches {
    pub(crate) fn start(node: &Weak<Inner>) -> Batches {
        Batches {
            heartbeat: batcher(node, |pg, batch| async move { pg.heartbeats(batch).await }),
            acquire: batcher(node, |pg, batch| async move { pg.acquires(batch).await }),
            release: batcher(node, |pg, batch| async move { pg.releases(batch).await }),
            largest: Default::default(),
        }
    }
}

/// What became of a batch statement.
enum Sent {
    Rows(Vec<Row>),
    /// Every element is answered unavailable, with this reason.
    Unavailable(String),
    /// Every element is sent alone.
    Alone,
}

fn stopped() -> BackendError {
    BackendError::Unavailable("the node is stopping".into())
}

impl Postgres {
    pub(super) async fn heartbeat_batched(&self, id: SessionId, ttl: Option<i64>) -> Result<Beat> {
        let batches = &self.inner.batches;
        batches
            .heartbeat
            .call((id, ttl))
            .await
            .unwrap_or_else(|| Err(stopped()))
    }

    pub(super) async fn acquire_batched(
        &self,
        id: SessionId,
        key: &LockKey,
    ) -> Result<Step<Granted, ()>> {
        let batches = &self.inner.batches;
        batches
            .acquire
            .call((id, key.clone()))
            .await
            .unwrap_or_else(|| Err(stopped()))
    }

    pub(super) async fn release_batched(
        &self,
        id: SessionId,
        key: LockKey,
        token: Token,
    ) -> Result<u64> {
        let batches = &self.inner.batches;
        batches
            .release
            .call((id, key, token))
            .await
            .unwrap_or_else(|| Err(stopped()))
    }

    /// Runs one batch statement outside a transaction (it is its own), sending it again when
    /// the server rolled it back as a deadlock or serialization failure.
    async fn send_batch(&self, template: &'static str, params: &[&(dyn ToSql + Sync)]) -> Sent {
        if let Err(e) = self.ensure_ready() {
            return Sent::Unavailable(reason(e));
        }
        let sql = self.sql(template);
        let mut tries = 0u32;
        loop {
            match self.send_once(&sql, params).await {
                Ok(rows) => return Sent::Rows(rows),
                Err(e) if e.is_retryable() && tries < 3 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(u64::from(tries) * 3))
                        .await;
                }
                Err(e) if e.is_connection() => return Sent::Unavailable(reason(self.failed(e))),
                Err(e) => {
                    tracing::warn!(error = %e, "a batch statement failed; its requests go alone");
                    return Sent::Alone;
                }
            }
        }
    }

    async fn heartbeats(&self, batch: Vec<Heartbeat>) -> Vec<Result<Beat>> {
        self.inner.batches.largest[0].fetch_max(batch.len(), Ordering::Relaxed);
        if batch.len() == 1 {
            let (id, ttl) = batch[0];
            return vec![self.heartbeat_alone(id, ttl).await];
        }
        // A session asked twice is sent once, with its first TTL: the answer below goes to
        // its first request, and the later ones find none and go alone.
        let mut seen = std::collections::HashSet::new();
        let (ids, ttls): (Vec<Uuid>, Vec<Option<i64>>) = batch
            .iter()
            .filter(|(id, _)| seen.insert(id.0))
            .map(|(id, ttl)| (id.0, *ttl))
            .unzip();
        let mut beaten = std::collections::HashMap::new();
        match self.send_batch(HEARTBEAT_MANY, &[&ids, &ttls]).await {
            Sent::Rows(rows) => {
                for row in rows {
                    beaten.insert(row.get::<_, Uuid>(0), (row.get::<_, i64>(1), row.get(2)));
                }
            }
            Sent::Unavailable(why) => return unavailable(batch.len(), &why),
            Sent::Alone => {}
        }
        let mut answers = Vec::with_capacity(batch.len());
        for (id, ttl) in batch {
            answers.push(match beaten.remove(&id.0) {
                Some((expires_at, ttl_ms)) => Ok(self.beaten(expires_at, ttl_ms)),
                None => self.heartbeat_alone(id, ttl).await,
            });
        }
        answers
    }

    async fn acquires(&self, batch: Vec<Acquire>) -> Vec<Result<Step<Granted, ()>>> {
        self.inner.batches.largest[1].fetch_max(batch.len(), Ordering::Relaxed);
        if batch.len() == 1 {
            let (id, key) = &batch[0];
            return vec![self.try_acquire_alone(*id, key, true).await];
        }
        let max = self.config().limits.max_locks_per_session as i64;
        let keys: Vec<&str> = batch.iter().map(|(_, k)| k.as_str()).collect();
        let sids: Vec<Uuid> = batch.iter().map(|(id, _)| id.0).collect();
        let rows = match self
            .send_batch(ACQUIRE_MANY, &[&self.class(), &keys, &sids, &max])
            .await
        {
            Sent::Rows(rows) if rows.len() == batch.len() => rows.into_iter().map(Some).collect(),
            Sent::Unavailable(why) => return unavailable(batch.len(), &why),
            Sent::Rows(_) | Sent::Alone => vec![None; batch.len()],
        };
        let mut answers = Vec::with_capacity(batch.len());
        for ((id, key), row) in batch.into_iter().zip(rows) {
            answers.push(match row {
                Some(row) if row.get::<_, &str>(0) != "busy" => {
                    self.acquire_answer(id, &key, true, &row).await
                }
                _ => self.try_acquire_alone(id, &key, true).await,
            });
        }
        answers
    }

    async fn releases(&self, batch: Vec<Release>) -> Vec<Result<u64>> {
        self.inner.batches.largest[2].fetch_max(batch.len(), Ordering::Relaxed);
        if batch.len() == 1 {
            let (id, key, token) = batch.into_iter().next().expect("one release");
            return vec![self.release_alone(id, key, token).await];
        }
        let keys: Vec<&str> = batch.iter().map(|(_, k, _)| k.as_str()).collect();
        let sids: Vec<Uuid> = batch.iter().map(|(id, _, _)| id.0).collect();
        let tokens: Vec<i64> = batch.iter().map(|(_, _, t)| t.0 as i64).collect();
        let rows = match self
            .send_batch(RELEASE_MANY, &[&self.class(), &keys, &sids, &tokens])
            .await
        {
            Sent::Rows(rows) if rows.len() == batch.len() => rows.into_iter().map(Some).collect(),
            Sent::Unavailable(why) => return unavailable(batch.len(), &why),
            Sent::Rows(_) | Sent::Alone => vec![None; batch.len()],
        };
        let mut answers = Vec::with_capacity(batch.len());
        for ((id, key, token), row) in batch.into_iter().zip(rows) {
            answers.push(match row {
                Some(row) if row.get::<_, &str>(0) != "busy" => {
                    self.release_answer(id, key, &row).await
                }
                _ => self.release_alone(id, key, token).await,
            });
        }
        answers
    }
}

fn reason(e: BackendError) -> String {
    match e {
        BackendError::Unavailable(why) => why,
        other => other.to_string(),
    }
}

fn unavailable<T>(n: usize, why: &str) -> Vec<Result<T>> {
    (0..n)
        .map(|_| Err(BackendError::Unavailable(why.to_string())))
        .collect()
}
