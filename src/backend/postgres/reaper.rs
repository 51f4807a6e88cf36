//! The reaper: a task on every node, one pass at a time across nodes. A pass takes a
//! transaction-scoped advisory lock (`pg_try_advisory_xact_lock`: a node that finds it
//! taken skips its turn), then ends a bounded batch of due sessions in one set-based
//! statement (see `sessions::END`), so each ended session is audited exactly once and a
//! mass expiry costs about what a batched cascading delete does. Passes follow one another
//! while they come back full; otherwise the task sleeps until the earliest deadline, at
//! most one reaper interval.

use std::time::{Duration, Instant};

use super::schema::{LOCK_EVENTS, LOCK_REAP};
use super::sessions::END_DUE;
use super::{Postgres, transact};
use crate::backend::{DueSession, ReapOutcome, Result};
use crate::domain::jobs::{REASON_MAX_RECOVERIES, REASON_NOT_IDEMPOTENT};
use crate::domain::{JobId, JobOutcome, SessionId, Token, UnixMs};

const TRY_LOCK: &str = "SELECT pg_try_advisory_xact_lock($1, $2)";
const LOCK: &str = "SELECT pg_advisory_xact_lock($1, $2)";

/// Milliseconds until the earliest deadline (0 when one has passed); NULL with no session.
const NEXT_DUE: &str =
    "SELECT greatest(0, {ns}.ms(min(expires_at)) - {ns}.ms({ns}.db_now())) FROM {ns}.session";

const PURGE_JOBS: &str = "
WITH d AS (
    DELETE FROM {ns}.job WHERE id IN (
        SELECT id FROM {ns}.job
        WHERE status IN ('done', 'failed')
          AND updated_at < {ns}.db_now() - $1::bigint * interval '1 millisecond'
        LIMIT $2)
    RETURNING 1)
SELECT count(*) FROM d";

const DUE: &str = "
SELECT s.id, {ns}.ms(s.expires_at),
       ARRAY(SELECT key::text FROM {ns}.lock WHERE session_id = s.id ORDER BY token),
       ARRAY(SELECT token FROM {ns}.lock WHERE session_id = s.id ORDER BY token),
       ARRAY(SELECT pool::text FROM {ns}.seat WHERE session_id = s.id ORDER BY pool),
       ARRAY(SELECT id FROM {ns}.job WHERE claim_session = s.id ORDER BY id),
       ARRAY(SELECT idempotent AND recovery_count < max_recoveries
             FROM {ns}.job WHERE claim_session = s.id ORDER BY id),
       ARRAY(SELECT recovery_count FROM {ns}.job WHERE claim_session = s.id ORDER BY id),
       ARRAY(SELECT idempotent FROM {ns}.job WHERE claim_session = s.id ORDER BY id)
FROM {ns}.session s WHERE s.expires_at <= {ns}.db_now() ORDER BY s.expires_at LIMIT $1";

pub(super) async fn run(pg: Postgres) {
    let mut stop = pg.inner.stop.subscribe();
    let interval = Duration::from_millis(pg.config().reaper_interval_ms.max(1));
    let mut wait = interval;
    let ceiling = pg.config().reaper_batch.max(1);
    // A pass must finish well inside the statement timeout, or it is cancelled and, at the
    // same size, cancelled again: the reaper would stall with sessions due.
    let comfortable = Duration::from_millis(pg.statement_timeout_ms() / 4);
    let mut size = ceiling;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return,
        }
        wait = interval;
        if pg.ensure_ready().is_err() {
            continue;
        }
        loop {
            let started = Instant::now();
            match pg.pass(false, size).await {
                Ok(Some(outcome)) => {
                    let took = started.elapsed();
                    let m = &pg.inner.metrics;
                    m.reaper_pass_seconds.observe(took.as_secs_f64());
                    if outcome.sessions > 0 {
                        m.reaper_batch_size.observe(outcome.sessions as f64);
                        tracing::info!(
                            sessions = outcome.sessions,
                            locks = outcome.locks,
                            pass_ms = took.as_millis() as u64,
                            "reaped expired sessions"
                        );
                    }
                    let full = outcome.sessions >= size;
                    size = next_size(size, Some(took), comfortable, ceiling);
                    if !full {
                        break;
                    }
                }
                // Another node's pass holds the lock: its turn.
                Ok(None) => break,
                Err(e) => {
                    size = next_size(size, None, comfortable, ceiling);
                    tracing::warn!(error = %e, next_pass = size, "reaper pass failed");
                    break;
                }
            }
        }
        if let Err(e) = pg.retention().await {
            tracing::warn!(error = %e, "retention pass failed");
        }
        if let Ok(Some(row)) = pg.query_opt(NEXT_DUE, &[], true).await
            && let Some(ms) = row.get::<_, Option<i64>>(0)
        {
            wait = interval.min(Duration::from_millis(ms.max(1) as u64));
        }
    }
}

/// The size of the next background pass: halved (to at least [`MIN_PASS`]) after a pass that
/// failed — a statement timeout is the usual cause — or took longer than `comfortable`;
/// doubled back towards `ceiling` after one that finished in under half of it.
fn next_size(size: usize, took: Option<Duration>, comfortable: Duration, ceiling: usize) -> usize {
    match took {
        Some(t) if t <= comfortable / 2 => (size * 2).min(ceiling),
        Some(t) if t <= comfortable => size,
        _ => (size / 2).max(MIN_PASS.min(ceiling)),
    }
}

/// The smallest pass the background reaper shrinks to.
const MIN_PASS: usize = 64;

impl Postgres {
    /// One pass: ends up to `size` due sessions. `None` when another node's pass holds the
    /// reaper lock and `wait` is false.
    pub(crate) async fn pass(&self, wait: bool, size: usize) -> Result<Option<ReapOutcome>> {
        let batch = size.max(1) as i64;
        let ended = transact!(self, |tx, after| {
            let locked = if wait {
                self.q(&tx, LOCK, &[&self.class(), &LOCK_REAP]).await?;
                true
            } else {
                self.q_one(&tx, TRY_LOCK, &[&self.class(), &LOCK_REAP])
                    .await?
                    .is_some_and(|r| r.get::<_, bool>(0))
            };
            if locked {
                // The pass numbers its own events (see `END_DUE`): the numbering lock is held
                // from before its statement's snapshot to its commit.
                self.q(&tx, LOCK, &[&self.class(), &LOCK_EVENTS]).await?;
                Some(
                    self.end_in(&tx, &mut after, &END_DUE, &[&batch, &self.actor()])
                        .await?,
                )
            } else {
                None
            }
        })?;
        // After the commit: the watches read these ends in the log.
        if ended.as_ref().is_some_and(|e| e.sessions() > 0) {
            self.inner.ends.notify_one();
        }
        Ok(ended.map(|e| ReapOutcome {
            sessions: e.sessions(),
            locks: e.locks,
            seats: e.seats,
            jobs: e.recovered + e.failed.len(),
        }))
    }

    /// Ends every session past its deadline now, in bounded passes; waits for another
    /// node's pass rather than skipping.
    pub async fn reap_now(&self) -> Result<ReapOutcome> {
        let mut total = ReapOutcome::default();
        loop {
            let pass = self
                .pass(true, self.config().reaper_batch)
                .await?
                .unwrap_or_default();
            total += pass;
            if pass.sessions < self.config().reaper_batch.max(1) {
                break;
            }
        }
        // Retention is bounded per call, as a background round's is.
        self.retention().await?;
        self.refresh_gauges().await?;
        Ok(total)
    }

    /// Purges finished jobs and trims audit events past their retention, one bounded batch
    /// each.
    pub(crate) async fn retention(&self) -> Result<()> {
        let c = self.config();
        self.query(
            PURGE_JOBS,
            &[&(c.job_retention_ms as i64), &(c.reaper_batch as i64)],
            false,
        )
        .await?;
        self.query(super::requests::PURGE, &[&(c.reaper_batch as i64)], false)
            .await?;
        self.trim_events().await?;
        Ok(())
    }

    /// What a reap now would end, changing nothing.
    pub async fn reap_dry_run(&self, limit: usize) -> Result<Vec<DueSession>> {
        let rows = self.query(DUE, &[&(limit as i64)], true).await?;
        Ok(rows
            .iter()
            .map(|r| {
                let keys: Vec<String> = r.get(2);
                let tokens: Vec<i64> = r.get(3);
                let jobs: Vec<uuid::Uuid> = r.get(5);
                let recover: Vec<bool> = r.get(6);
                let counts: Vec<i32> = r.get(7);
                let idempotent: Vec<bool> = r.get(8);
                DueSession {
                    id: SessionId(r.get(0)),
                    expired_at: UnixMs(r.get::<_, i64>(1) as u64),
                    locks: keys
                        .into_iter()
                        .zip(tokens)
                        .map(|(k, t)| (k, Token(t as u64)))
                        .collect(),
                    seats: r.get(4),
                    jobs: jobs
                        .into_iter()
                        .enumerate()
                        .map(|(i, id)| {
                            let outcome = if recover[i] {
                                JobOutcome::Recovered {
                                    recovery_count: counts[i] as u32 + 1,
                                }
                            } else {
                                JobOutcome::Failed {
                                    reason: if idempotent[i] {
                                        REASON_MAX_RECOVERIES
                                    } else {
                                        REASON_NOT_IDEMPOTENT
                                    }
                                    .to_string(),
                                }
                            };
                            (JobId(id), outcome)
                        })
                        .collect(),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_shrink_after_a_failure_or_a_slow_pass_and_grow_back_when_quick() {
        let ok = Duration::from_millis(1_000);
        // A failed pass (a statement timeout) halves, down to the floor and no lower.
        assert_eq!(next_size(10_000, None, ok, 10_000), 5_000);
        assert_eq!(next_size(100, None, ok, 10_000), 64);
        assert_eq!(next_size(64, None, ok, 10_000), 64);
        // So does a pass slower than comfortable.
        assert_eq!(
            next_size(8_000, Some(Duration::from_millis(1_200)), ok, 10_000),
            4_000
        );
        // Between half and all of comfortable: keep the size.
        assert_eq!(
            next_size(4_000, Some(Duration::from_millis(700)), ok, 10_000),
            4_000
        );
        // Quick passes double, up to the ceiling.
        assert_eq!(
            next_size(4_000, Some(Duration::from_millis(100)), ok, 10_000),
            8_000
        );
        assert_eq!(
            next_size(8_000, Some(Duration::from_millis(100)), ok, 10_000),
            10_000
        );
        // A ceiling below the floor is the floor.
        assert_eq!(next_size(10, None, ok, 10), 10);
    }
}
