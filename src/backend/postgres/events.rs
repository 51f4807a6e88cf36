//! The audit log: numbering and reading.
//!
//! A sequence number taken at insert would be assigned in insert order but become visible
//! in commit order: a reader past 11 would never see a 10 that commits after 11. So events
//! are inserted without one, and `number_events` (a plpgsql function of the schema) numbers
//! committed events afterwards, one numbering at a time across nodes (an advisory lock held
//! to the end of its transaction), each after every number already given. Readers see only
//! numbered events, so the cursor can never pass an event that has yet to appear. Numbering
//! runs before every read, so an event a client was answered about is readable at once, and
//! in the background on every node.

use super::Postgres;
use crate::backend::Result;
use crate::domain::{EndReason, Event, EventKind, JobId, ReleasedLock, SessionId, Token, UnixMs};

const NUMBER: &str = "SELECT {ns}.number_events($1, $2, 10000)";

const PAGE: &str = "
SELECT seq, {ns}.ms(at), kind, session_id, key, token, reason, owner, released_keys,
       released_tokens, pool, queue, job_id, detail, actor
FROM {ns}.event WHERE seq > $1 ORDER BY seq LIMIT $2";

/// The oldest numbered events past the retention, a bounded batch at a time, from the
/// start of the log: trimming never leaves a hole behind a cursor.
const TRIM: &str = "
WITH oldest AS MATERIALIZED (
    SELECT seq, at FROM {ns}.event WHERE seq IS NOT NULL ORDER BY seq LIMIT $2
),
cut AS MATERIALIZED (
    SELECT coalesce(min(seq), 9223372036854775807) AS seq FROM oldest
    WHERE at >= {ns}.db_now() - $1::bigint * interval '1 millisecond'
),
d AS (
    DELETE FROM {ns}.event
    WHERE seq IS NOT NULL AND seq IN (SELECT oldest.seq FROM oldest, cut WHERE oldest.seq < cut.seq)
    RETURNING 1
)
SELECT count(*) FROM d";

impl Postgres {
    /// Numbers committed events; with `wait` false, gives up if another numbering is under
    /// way (it will number them). Returns how many were numbered.
    pub(crate) async fn number_events(&self, wait: bool) -> Result<i64> {
        let row = self
            .query_opt(NUMBER, &[&self.class(), &wait], false)
            .await?;
        Ok(row.map_or(0, |r| r.get(0)))
    }

    /// A page of the audit log after `after`, and the cursor of the next.
    pub async fn events(&self, after: u64, limit: usize) -> Result<(Vec<Event>, Option<u64>)> {
        self.number_events(true).await?;
        let rows = self
            .query(PAGE, &[&(after as i64), &(limit as i64)], true)
            .await?;
        let mut events = Vec::with_capacity(rows.len());
        for r in &rows {
            let Some(k) = EventKind::from_name(r.get(2)) else {
                tracing::warn!(
                    kind = r.get::<_, &str>(2),
                    "skipping an event of unknown kind"
                );
                continue;
            };
            let mut e = Event::new(
                r.get::<_, i64>(0) as u64,
                UnixMs(r.get::<_, i64>(1) as u64),
                k,
            );
            e.session_id = r.get::<_, Option<uuid::Uuid>>(3).map(SessionId);
            e.key = r.get(4);
            e.token = r.get::<_, Option<i64>>(5).map(|t| Token(t as u64));
            e.reason = r.get::<_, Option<&str>>(6).and_then(EndReason::from_name);
            e.owner = r.get(7);
            let keys: Option<Vec<String>> = r.get(8);
            let tokens: Option<Vec<i64>> = r.get(9);
            e.released = keys
                .unwrap_or_default()
                .into_iter()
                .zip(tokens.unwrap_or_default())
                .map(|(key, t)| ReleasedLock {
                    key,
                    token: Token(t as u64),
                })
                .collect();
            e.pool = r.get(10);
            e.queue = r.get(11);
            e.job_id = r.get::<_, Option<uuid::Uuid>>(12).map(JobId);
            e.detail = r.get(13);
            e.actor = r.get(14);
            events.push(e);
        }
        let next = rows.last().map(|r| r.get::<_, i64>(0) as u64);
        Ok((events, next))
    }

    /// Removes up to `batch` numbered events older than the retention.
    pub(crate) async fn trim_events(&self) -> Result<u64> {
        let c = self.config();
        let row = self
            .query_opt(
                TRIM,
                &[&(c.event_retention_ms as i64), &(c.event_trim_batch as i64)],
                false,
            )
            .await?;
        let n = row.map_or(0, |r| r.get::<_, i64>(0) as u64);
        self.inner.metrics.events_trimmed.inc_by(n);
        Ok(n)
    }
}
