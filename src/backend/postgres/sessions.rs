//! Sessions: open, heartbeat, end (by any reason, one statement for one or many), and the
//! reads.

use std::sync::LazyLock;

use tokio_postgres::Row;
use uuid::Uuid;

use super::{After, PgError, Postgres};
use crate::backend::waiting::Resource;
use crate::backend::{BackendError, Beat, Closed, OpenedSession, Result, SessionInfo, SessionPage};
use crate::domain::{EndReason, JobId, SessionId, SessionRecord, Token, UnixMs};

/// Ends the sessions `{source}` selects (`id`, `ctid`, `reason`), already locked `FOR UPDATE` by
/// that select, in one statement: the statement draws one revision if it ends any (it is
/// one mutation, however many sessions it ends); their claimed jobs go back to the head of their queue
/// (idempotent, under the cap: `recovery_count + 1`) or fail (`max_recoveries_exceeded`,
/// `not_idempotent`); their events are written in the embedded backend's order (per
/// session: seats reclaimed, jobs settled, then the end with the locks released); and their
/// rows are deleted, the cascade trigger on `session` removing their locks and seats. Every
/// sub-statement reads the snapshot the statement started with, and the trigger runs at its
/// end, so the locks and seats read here are the ones the cascade removes.
///
/// One row: sessions ended by reason, the revision, how many locks and seats were released
/// and jobs recovered, the reasons jobs failed; and, when the statement freed no more than a
/// notification can list one by one, the keys, the pools whose seats were reclaimed, the
/// queues jobs were recovered into and the queues they failed in. A mass expiry frees too
/// many to list: everyone is woken instead.
const END: &str = r#"
WITH target AS MATERIALIZED ({source}),
rev AS MATERIALIZED (
    SELECT nextval('{ns}.revision') AS revision FROM (SELECT 1 FROM target LIMIT 1) AS found
),
ended AS MATERIALIZED (SELECT id, ctid, reason FROM target),
-- Looked up through the session indexes: a join would scan every lock and seat per batch.
locks AS MATERIALIZED (
    SELECT session_id, key, token FROM {ns}.lock
    WHERE session_id = ANY (ARRAY(SELECT id FROM ended))
),
-- Not even looked up when no session holds a seat: a lookup per ended session costs.
seats AS MATERIALIZED (
    SELECT session_id, pool, token FROM {ns}.seat
    WHERE session_id = ANY (ARRAY(SELECT id FROM ended)) AND EXISTS (SELECT 1 FROM {ns}.seat)
),
jobs AS (
    UPDATE {ns}.job j SET
        status = CASE WHEN j.idempotent AND j.recovery_count < j.max_recoveries
                      THEN 'queued' ELSE 'failed' END,
        recovery_count = CASE WHEN j.idempotent AND j.recovery_count < j.max_recoveries
                              THEN j.recovery_count + 1 ELSE j.recovery_count END,
        ord = CASE WHEN j.idempotent AND j.recovery_count < j.max_recoveries
                   THEN -nextval('{ns}.job_head') ELSE j.ord END,
        reason = CASE WHEN j.idempotent AND j.recovery_count < j.max_recoveries THEN NULL
                      WHEN j.idempotent THEN 'max_recoveries_exceeded'
                      ELSE 'not_idempotent' END,
        claim_session = NULL,
        claimed_at = NULL,
        updated_at = {ns}.db_now()
    FROM ended e
    WHERE j.claim_session = e.id
    RETURNING j.id, j.queue, j.token, j.status, j.reason, e.id AS session_id
),
{backlog}events AS (
    INSERT INTO {ns}.event (kind, session_id, token, reason, pool, queue, job_id, detail,
                            released_keys, released_tokens, actor, seq)
    SELECT kind, session_id, token, reason, pool, queue, job_id, detail, keys, tokens,
           {actor}, {seq} FROM (
        SELECT e.id AS session, 1 AS part, 'seat_reclaimed' AS kind,
               e.id AS session_id, st.token, e.reason, st.pool::text AS pool, NULL::text AS queue,
               NULL::uuid AS job_id, NULL::text AS detail, NULL::text[] AS keys,
               NULL::bigint[] AS tokens
        FROM seats st JOIN ended e ON e.id = st.session_id
        UNION ALL
        SELECT j.session_id, 2,
               CASE WHEN j.status = 'queued' THEN 'job_recovered' ELSE 'job_failed' END,
               j.session_id, j.token, NULL, NULL, j.queue, j.id, j.reason, NULL, NULL
        FROM jobs j
        UNION ALL
        SELECT e.id, 3,
               CASE e.reason WHEN 'closed' THEN 'session_closed'
                             WHEN 'expired' THEN 'session_expired'
                             ELSE 'session_ended_by_admin' END,
               e.id, NULL, e.reason, NULL, NULL, NULL, NULL,
               coalesce(r.keys, '{}'), coalesce(r.tokens, '{}')
        FROM ended e LEFT JOIN (
            -- In token order, from a sorted subquery: an ordered aggregate would sort each
            -- session's one or two locks on their own.
            SELECT session_id, array_agg(key::text) AS keys, array_agg(token) AS tokens
            FROM (SELECT * FROM locks ORDER BY session_id, token) AS sorted
            GROUP BY session_id
        ) r ON r.session_id = e.id
    ) x ORDER BY session, part
    RETURNING 1
),{counter}
-- By the row addresses the select locked: they cannot move while the rows are locked, and a
-- TID scan needs neither an index probe per row nor a scan of the table.
gone AS (
    DELETE FROM {ns}.session WHERE ctid = ANY (ARRAY(SELECT ctid FROM ended))
),
counts AS MATERIALIZED (
    SELECT (SELECT count(*) FROM locks) AS locks, (SELECT count(*) FROM seats) AS seats,
           (SELECT count(*) FROM jobs) AS jobs
)
SELECT count(*) FILTER (WHERE e.reason = 'closed'),
       count(*) FILTER (WHERE e.reason = 'expired'),
       count(*) FILTER (WHERE e.reason = 'admin'),
       coalesce((SELECT revision FROM rev), 0),
       (SELECT locks FROM counts), (SELECT seats FROM counts),
       (SELECT count(*) FROM jobs WHERE status = 'queued'),
       (SELECT coalesce(array_agg(reason), '{}') FROM jobs WHERE status = 'failed'),
       (SELECT locks + seats + jobs <= 64 FROM counts),
       (SELECT coalesce(array_agg(key::text), '{}') FROM locks
        WHERE (SELECT locks + seats + jobs <= 64 FROM counts)),
       (SELECT coalesce(array_agg(pool::text), '{}') FROM seats
        WHERE (SELECT locks + seats + jobs <= 64 FROM counts)),
       (SELECT coalesce(array_agg(queue::text), '{}') FROM jobs
        WHERE status = 'queued' AND (SELECT locks + seats + jobs <= 64 FROM counts)),
       (SELECT coalesce(array_agg(queue::text), '{}') FROM jobs
        WHERE status = 'failed' AND (SELECT locks + seats + jobs <= 64 FROM counts))
FROM ended e
"#;

/// `actor` is the SQL of the `actor` column of every event written: a parameter for the
/// statements an operator's call runs, `NULL` for the others.
fn end_sql(source: &str, actor: &str) -> String {
    END.replace("{source}", source)
        .replace("{actor}", actor)
        .replace("{backlog}", "")
        .replace("{seq}", "NULL::bigint")
        .replace("{counter}", "")
}

/// Numbers, in the end statement itself, the events it writes and every committed event
/// still unnumbered that its snapshot sees. The caller holds the numbering lock
/// (`LOCK_EVENTS`) from before the statement began to its commit, so nobody numbers
/// meanwhile, and the order is that of `number_events`: the backlog first, in id order (each
/// committed before this statement's snapshot was taken, so before these events were
/// written), then these events in their order. An event that commits after the snapshot was
/// taken is concurrent with this statement and is numbered after it. A mass expiry's events
/// are then written once, numbered, instead of written and then rewritten by the numbering.
fn end_sql_numbered(source: &str, actor: &str) -> String {
    END.replace("{source}", source)
        .replace("{actor}", actor)
        .replace(
            "{backlog}",
            "counter AS MATERIALIZED (SELECT last FROM {ns}.event_counter),
backlog AS MATERIALIZED (
    SELECT ctid AS at, row_number() OVER (ORDER BY id) AS n
    FROM {ns}.event WHERE seq IS NULL
),
prior AS (
    UPDATE {ns}.event e SET seq = (SELECT last FROM counter) + b.n
    FROM backlog b WHERE e.ctid = b.at
),
",
        )
        .replace(
            "{seq}",
            "(SELECT last FROM counter) + (SELECT count(*) FROM backlog)
           + row_number() OVER (ORDER BY session, part)",
        )
        .replace(
            "{counter}",
            "
numbered AS (
    UPDATE {ns}.event_counter
    SET last = last + (SELECT count(*) FROM backlog) + (SELECT count(*) FROM events)
    WHERE (SELECT count(*) FROM backlog) + (SELECT count(*) FROM events) > 0
),",
        )
}

/// One session ($1), for $2 (`closed`, `admin`), by the operator $3 if any; a client closing a session already past
/// its deadline is recorded as what happened first: it expired.
pub(super) static END_ONE: LazyLock<String> = LazyLock::new(|| {
    end_sql(
        "SELECT id, ctid, CASE WHEN $2::text = 'closed' AND expires_at <= {ns}.db_now()
                         THEN 'expired' ELSE $2::text END AS reason
         FROM {ns}.session WHERE id = $1 FOR UPDATE",
        "$3::text",
    )
});

/// One session ($1) if it is past its deadline. `FOR UPDATE` re-reads a row a concurrent
/// transaction changed, so a session that a heartbeat just extended is left alone.
pub(super) static END_EXPIRED_ONE: LazyLock<String> = LazyLock::new(|| {
    end_sql(
        "SELECT id, ctid, 'expired'::text AS reason FROM {ns}.session
         WHERE id = $1 AND expires_at <= {ns}.db_now() FOR UPDATE",
        "NULL::text",
    )
});

/// Up to $1 sessions past their deadline, earliest first, reaped by the operator $2 if any; rows another transaction holds
/// (a pass on another node, a request of the session) are skipped, never waited for. Its
/// events are numbered as they are written: the caller must hold the numbering lock.
pub(super) static END_DUE: LazyLock<String> = LazyLock::new(|| {
    end_sql_numbered(
        "SELECT id, ctid, 'expired'::text AS reason FROM {ns}.session
         WHERE expires_at <= {ns}.db_now() ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED",
        "$2::text",
    )
});

/// Every seat holder of pool $1 past its deadline, ended by the call of the operator $2 if any
/// (a pool deletion) or of a client (`NULL`).
pub(super) static END_EXPIRED_SEAT_HOLDERS: LazyLock<String> = LazyLock::new(|| {
    end_sql(
        "SELECT s.id, s.ctid, 'expired'::text AS reason FROM {ns}.session s
         WHERE s.expires_at <= {ns}.db_now()
           AND s.id IN (SELECT session_id FROM {ns}.seat WHERE pool = $1)
         ORDER BY s.id FOR UPDATE OF s",
        "$2::text",
    )
});

/// What one end statement ended and freed.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ended {
    /// Sessions ended: closed, expired, by an operator.
    pub by_reason: [u64; 3],
    pub revision: u64,
    pub locks: usize,
    pub seats: usize,
    pub recovered: usize,
    /// Why each failed job failed.
    pub failed: Vec<String>,
    /// What was freed, by name; `None` when too much was freed to list.
    pub listed: Option<Freed>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Freed {
    pub keys: Vec<String>,
    pub pools: Vec<String>,
    pub recovered: Vec<String>,
    pub failed: Vec<String>,
}

impl Ended {
    fn from_row(row: &Row) -> Ended {
        let count = |i| row.get::<_, i64>(i) as u64;
        Ended {
            by_reason: [count(0), count(1), count(2)],
            revision: count(3),
            locks: count(4) as usize,
            seats: count(5) as usize,
            recovered: count(6) as usize,
            failed: row.get(7),
            listed: row.get::<_, bool>(8).then(|| Freed {
                keys: row.get(9),
                pools: row.get(10),
                recovered: row.get(11),
                failed: row.get(12),
            }),
        }
    }

    pub fn sessions(&self) -> usize {
        self.by_reason.iter().sum::<u64>() as usize
    }

    /// What the end made available to waiters, when listed.
    pub fn freed(&self) -> impl Iterator<Item = Resource> + '_ {
        let named = |text: &String| crate::domain::LockKey::parse("key", text).ok();
        self.listed.iter().flat_map(move |f| {
            f.keys
                .iter()
                .filter_map(named)
                .map(Resource::Lock)
                .chain(f.pools.iter().filter_map(named).map(Resource::Pool))
                .chain(f.recovered.iter().filter_map(named).map(Resource::Queue))
        })
    }

    /// The answer to a close: `None` when nothing was ended.
    pub fn closed(&self) -> Option<Closed> {
        (self.sessions() > 0).then(|| Closed {
            released: self.locks,
            seats: self.seats,
            jobs: self.recovered + self.failed.len(),
            revision: self.revision,
        })
    }
}

pub(super) const OPEN: &str = "
WITH r AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision),
s AS (
    INSERT INTO {ns}.session (id, owner, metadata, ttl_ms, expires_at)
    VALUES ($1, $2, $3::text::jsonb, $4::bigint,
            {ns}.db_now() + $4::bigint * interval '1 millisecond')
    RETURNING {ns}.ms(expires_at) AS expires_at
),
e AS (
    INSERT INTO {ns}.event (kind, session_id, owner) VALUES ('session_opened', $1, $2)
)
SELECT r.revision, s.expires_at FROM r, s";

const HEARTBEAT: &str = "
UPDATE {ns}.session SET
    ttl_ms = coalesce($2::bigint, ttl_ms),
    expires_at = {ns}.db_now() + coalesce($2::bigint, ttl_ms) * interval '1 millisecond',
    last_heartbeat_at = {ns}.db_now()
WHERE id = $1 AND expires_at > {ns}.db_now()
RETURNING {ns}.ms(expires_at), ttl_ms";

const LIVE: &str = "SELECT expires_at > {ns}.db_now() FROM {ns}.session WHERE id = $1";

/// What `GET /v1/sessions/{id}` shows; `grace` once a third of the TTL has passed since the
/// last heartbeat.
const INFO_COLUMNS: &str = "
SELECT s.id, s.owner, coalesce(s.metadata::text, ''), s.ttl_ms, {ns}.ms(s.created_at),
       {ns}.ms(s.expires_at), {ns}.ms(s.last_heartbeat_at),
       s.expires_at > {ns}.db_now() AS live,
       {ns}.db_now() - s.last_heartbeat_at > (s.ttl_ms / 3) * interval '1 millisecond' AS grace,
       ARRAY(SELECT key::text FROM {ns}.lock WHERE session_id = s.id ORDER BY key),
       ARRAY(SELECT token FROM {ns}.lock WHERE session_id = s.id ORDER BY key),
       ARRAY(SELECT pool::text FROM {ns}.seat WHERE session_id = s.id ORDER BY pool),
       ARRAY(SELECT token FROM {ns}.seat WHERE session_id = s.id ORDER BY pool),
       ARRAY(SELECT id FROM {ns}.job WHERE claim_session = s.id ORDER BY id)
FROM {ns}.session s";

static INFO_ONE: LazyLock<String> = LazyLock::new(|| format!("{INFO_COLUMNS} WHERE s.id = $1"));
static INFO_PAGE: LazyLock<String> =
    LazyLock::new(|| format!("{INFO_COLUMNS} WHERE s.id > $1 ORDER BY s.id LIMIT $2"));
static INFO_PAGE_OWNER: LazyLock<String> = LazyLock::new(|| {
    format!("{INFO_COLUMNS} WHERE s.owner = $3 AND s.id > $1 ORDER BY s.id LIMIT $2")
});

fn info(row: &Row) -> (bool, SessionInfo) {
    let ttl_ms = row.get::<_, i64>(3) as u64;
    let keys: Vec<String> = row.get(9);
    let key_tokens: Vec<i64> = row.get(10);
    let pools: Vec<String> = row.get(11);
    let seat_tokens: Vec<i64> = row.get(12);
    let jobs: Vec<Uuid> = row.get(13);
    let live: bool = row.get(7);
    (
        live,
        SessionInfo {
            id: SessionId(row.get(0)),
            record: SessionRecord {
                owner: row.get(1),
                ttl_ms,
                created_at: UnixMs(row.get::<_, i64>(4) as u64),
                metadata: row.get(2),
            },
            ttl_ms,
            expires_at: UnixMs(row.get::<_, i64>(5) as u64),
            last_heartbeat_at: UnixMs(row.get::<_, i64>(6) as u64),
            grace: row.get(8),
            locks: keys
                .into_iter()
                .zip(key_tokens)
                .map(|(k, t)| (k, Token(t as u64)))
                .collect(),
            seats: pools
                .into_iter()
                .zip(seat_tokens)
                .map(|(p, t)| (p, Token(t as u64)))
                .collect(),
            jobs: jobs.into_iter().map(JobId).collect(),
        },
    )
}

impl Postgres {
    /// Runs an end statement inside a transaction and records what it ended.
    pub(crate) async fn end_in(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        after: &mut After,
        statement: &'static LazyLock<String>,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> std::result::Result<Ended, PgError> {
        let sql: &'static str = statement.as_str();
        let ended = self
            .q_one(tx, sql, params)
            .await?
            .map(|r| Ended::from_row(&r))
            .unwrap_or_default();
        if ended.sessions() > 0 {
            after.ended(ended.clone());
        }
        Ok(ended)
    }

    /// Runs an end statement on its own: one statement is one transaction, so a close
    /// costs one round trip, not three (`BEGIN`, the statement, `COMMIT`). Then does what
    /// the commit leaves to do. A deadlock or serialization failure (rolled back) is tried
    /// again; a broken connection is not (the end may have committed).
    pub(crate) async fn end_alone(
        &self,
        statement: &'static LazyLock<String>,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Ended> {
        let sql: &'static str = statement.as_str();
        let ended = self
            .query(sql, params, false)
            .await?
            .first()
            .map(Ended::from_row)
            .unwrap_or_default();
        let mut after = After::default();
        if ended.sessions() > 0 {
            after.ended(ended.clone());
        }
        self.committed(after);
        Ok(ended)
    }

    pub async fn open(
        &self,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession> {
        self.open_as(SessionId::random(), owner, ttl_ms, metadata)
            .await
    }

    pub async fn open_as(
        &self,
        id: SessionId,
        owner: String,
        ttl_ms: Option<u64>,
        metadata: Option<String>,
    ) -> Result<OpenedSession> {
        let limits = &self.config().limits;
        limits.owner(&owner)?;
        let ttl_ms = limits.ttl(ttl_ms)?;
        let metadata = metadata.filter(|m| !m.is_empty());
        if let Some(m) = &metadata {
            limits.metadata(m)?;
        }
        let row = self
            .query_opt(OPEN, &[&id.0, &owner, &metadata, &(ttl_ms as i64)], false)
            .await?
            .ok_or_else(|| {
                BackendError::Unavailable("the session insert returned nothing".into())
            })?;
        self.inner.metrics.sessions_opened.inc();
        self.inner.metrics.sessions_active.inc();
        Ok(OpenedSession {
            id,
            ttl_ms,
            expires_at: UnixMs(row.get::<_, i64>(1) as u64),
            revision: row.get::<_, i64>(0) as u64,
        })
    }

    /// Extends a live session. When the conditional update touches no row the session is
    /// gone; if its row is still there (past its deadline) it is ended first, so that
    /// "gone" is never said before the end is durable.
    pub async fn heartbeat(&self, id: SessionId, ttl_ms: Option<u64>) -> Result<Beat> {
        let ttl = match ttl_ms.map(|t| self.config().limits.ttl(Some(t))) {
            None => None,
            Some(Ok(t)) => Some(t as i64),
            // A gone session with a bad TTL is still just gone.
            Some(Err(e)) => {
                return if self.live_or_end(id).await? {
                    Err(e.into())
                } else {
                    Err(BackendError::SessionGone)
                };
            }
        };
        self.heartbeat_batched(id, ttl).await
    }

    /// A heartbeat with a valid TTL (`None`: the session's own), by the one-session
    /// statement.
    pub(super) async fn heartbeat_alone(&self, id: SessionId, ttl: Option<i64>) -> Result<Beat> {
        match self.query_opt(HEARTBEAT, &[&id.0, &ttl], false).await? {
            Some(row) => Ok(self.beaten(row.get(0), row.get(1))),
            None => {
                self.end_if_expired(id).await?;
                Err(BackendError::SessionGone)
            }
        }
    }

    /// A session extended to `expires_at` with `ttl_ms`, counted.
    pub(super) fn beaten(&self, expires_at: i64, ttl_ms: i64) -> Beat {
        self.inner.metrics.heartbeats.inc();
        Beat {
            expires_at: UnixMs(expires_at as u64),
            ttl_ms: ttl_ms as u64,
        }
    }

    /// Whether `id` is live; a session past its deadline is ended on the way.
    pub(crate) async fn live_or_end(&self, id: SessionId) -> Result<bool> {
        match self.query_opt(LIVE, &[&id.0], true).await? {
            None => Ok(false),
            Some(row) if row.get::<_, bool>(0) => Ok(true),
            Some(_) => {
                self.end_if_expired(id).await?;
                Ok(false)
            }
        }
    }

    /// Ends `id` if it is past its deadline.
    pub(crate) async fn end_if_expired(&self, id: SessionId) -> Result<()> {
        let ended = self.end_alone(&END_EXPIRED_ONE, &[&id.0]).await?;
        if let Some(c) = ended.closed() {
            c.log(id, EndReason::Expired);
        }
        Ok(())
    }

    pub async fn end(&self, id: SessionId, reason: EndReason) -> Result<Option<Closed>> {
        let ended = self
            .end_alone(&END_ONE, &[&id.0, &reason.as_str(), &self.actor()])
            .await?;
        let closed = ended.closed();
        if let Some(c) = &closed {
            c.log(id, reason);
        }
        Ok(closed)
    }

    /// A live session and what it holds. One past its deadline is ended before `None`.
    pub async fn session(&self, id: SessionId) -> Result<Option<SessionInfo>> {
        let Some(row) = self.query_opt(INFO_ONE.as_str(), &[&id.0], true).await? else {
            return Ok(None);
        };
        let (live, info) = info(&row);
        if !live {
            self.end_if_expired(id).await?;
            return Ok(None);
        }
        Ok(Some(info))
    }

    /// A page of live sessions in id order; the cursor comes from the page as read, so a
    /// session past its deadline on it is left out without shortening the walk.
    pub async fn sessions(
        &self,
        owner: Option<&str>,
        after: Option<SessionId>,
        limit: usize,
    ) -> Result<SessionPage> {
        let after = after.map_or(Uuid::nil(), |a| a.0);
        let fetch = (limit + 1) as i64;
        let rows = match owner {
            Some(o) => {
                self.query(INFO_PAGE_OWNER.as_str(), &[&after, &fetch, &o], true)
                    .await?
            }
            None => {
                self.query(INFO_PAGE.as_str(), &[&after, &fetch], true)
                    .await?
            }
        };
        let mut page: Vec<(bool, SessionInfo)> = rows.iter().map(info).collect();
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|(_, s)| s.id)
        } else {
            None
        };
        Ok((
            page.into_iter()
                .filter(|(live, _)| *live)
                .map(|(_, s)| s)
                .collect(),
            next,
        ))
    }
}
