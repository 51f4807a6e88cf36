//! Locks: acquire (a contender ends an expired holder in its own transaction), release,
//! the reads, and the fencing check.

use uuid::Uuid;

use super::sessions::END_EXPIRED_ONE;
use super::{After, Fail, Postgres, transact};
use crate::backend::waiting::{Resource, Step};
use crate::backend::{BackendError, Fence, Granted, LockPage, Result};
use crate::domain::{LockKey, LockRecord, SessionId, Token, UnixMs};

/// Serialises every grant of one key, across nodes, until the transaction ends. A free key
/// has no row to lock, so its token order rests on this lock (see the module doc): the
/// token is drawn after it is taken. Two keys whose hashes collide only wait for each other.
const KEY_LOCK: &str = "SELECT pg_advisory_xact_lock($1, hashtext($2))";

/// With the key's lock held: whether the caller ($2) is live (its row locked so that a
/// concurrent acquire of the same session cannot pass the per-session limit), the key's
/// holder, token and liveness, how many locks the caller holds, and the revision.
const STATE: &str = "
WITH me AS MATERIALIZED (
    SELECT expires_at > {ns}.db_now() AS live FROM {ns}.session WHERE id = $2
    FOR NO KEY UPDATE
)
SELECT (SELECT live FROM me), l.session_id, l.token,
       (SELECT h.expires_at > {ns}.db_now() FROM {ns}.session h WHERE h.id = l.session_id),
       (SELECT count(*) FROM {ns}.lock WHERE session_id = $2),
       (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {ns}.revision)
FROM (SELECT 1) AS one LEFT JOIN {ns}.lock l ON l.key = $1";

/// One attempt in one statement: see `acquire` in the schema's second migration.
const ACQUIRE: &str =
    "SELECT answer, granted, revision, held FROM {ns}.acquire($1, $2, $3, $4, $5, false)";

const HOLDER: &str = "SELECT session_id FROM {ns}.lock WHERE key = $1";

const GRANT: &str = "
WITH g AS (
    INSERT INTO {ns}.lock (key, session_id, token)
    VALUES ($1, $2, nextval('{ns}.revision'))
    RETURNING token
),
e AS (
    INSERT INTO {ns}.event (kind, session_id, key, token)
    SELECT 'lock_acquired', $2, $1, token FROM g
)
SELECT token FROM g";

/// One release in one statement: see `release` in the schema's fifth migration (`MIGRATION_RELEASE`). The free
/// key is announced to other nodes after the commit (see `Postgres::announce`).
const RELEASE: &str = "SELECT answer, revision FROM {ns}.release($1, $2, $3, false)";

/// Releases key $1 if the live session $2 holds it with token $3, as one statement inside a
/// caller's transaction (a release with a request id, whose answer is recorded in the same
/// transaction); answers the revision, or no row when nothing was released.
pub(super) const RELEASE_IN_TX: &str = "
WITH me AS MATERIALIZED (
    SELECT id FROM {ns}.session WHERE id = $2 AND expires_at > {ns}.db_now() FOR KEY SHARE
),
gone AS (
    DELETE FROM {ns}.lock l USING me
    WHERE l.key = $1 AND l.session_id = me.id AND l.token = $3
    RETURNING l.key
),
rev AS MATERIALIZED (SELECT nextval('{ns}.revision') AS revision FROM gone),
e AS (
    INSERT INTO {ns}.event (kind, session_id, key, token)
    SELECT 'lock_released', $2, $1, $3 FROM rev
)
SELECT revision FROM rev";

const LOCK: &str = "SELECT session_id, token, {ns}.ms(acquired_at) FROM {ns}.lock WHERE key = $1";

/// A page of keys under a prefix. The statement is prepared once, so its plan is generic: a
/// `LIKE` with a parameter bounds no index scan, and the scan from `after` to the first
/// `limit` matches would walk every key past the prefix's range when fewer are left (a poll
/// of an emptied prefix read the whole table). So the range is also given as bounds of the
/// key's own order, `$4 <= key < $5` (see `prefix_range`); `LIKE` keeps the match exact.
const LOCKS: &str = "
SELECT key::text, session_id, token, {ns}.ms(acquired_at) FROM {ns}.lock
WHERE key LIKE $1 AND key > $2 AND key >= $4 AND key < $5 ORDER BY key LIMIT $3";

/// The same without an upper bound, for a prefix that has none (empty, or only of the
/// greatest character).
const LOCKS_UNBOUNDED: &str = "
SELECT key::text, session_id, token, {ns}.ms(acquired_at) FROM {ns}.lock
WHERE key LIKE $1 AND key > $2 AND key >= $4 ORDER BY key LIMIT $3";

const FENCE: &str = "
SELECT l.token, s.expires_at > {ns}.db_now()
FROM {ns}.lock l JOIN {ns}.session s ON s.id = l.session_id WHERE l.key = $1";

pub(crate) enum Try {
    Gone,
    /// The caller already holds the key.
    Own(Token, u64),
    Held,
    /// Free, but others wait ahead of the caller.
    Behind,
    TooMany(usize),
    Granted(Token),
}

/// The keys that start with `prefix` are exactly those from `prefix` up to, not including,
/// the returned bound, when there is one: keys are in byte order (`COLLATE "C"`), which for
/// UTF-8 is the order of code points, so every key that starts with `prefix` sorts below
/// `prefix` with its last character that has a successor replaced by that successor (and
/// what follows it dropped).
fn prefix_upper_bound(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        let next = match last {
            '\u{D7FF}' => Some('\u{E000}'),
            c => char::from_u32(c as u32 + 1),
        };
        if let Some(next) = next {
            chars.push(next);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

/// `text` as a LIKE pattern that matches itself literally, followed by anything.
fn prefix_pattern(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 1);
    for c in text.chars() {
        if matches!(c, '\\' | '%' | '_') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('%');
    out
}

impl Postgres {
    pub async fn acquire(&self, id: SessionId, key: LockKey, wait_ms: u64) -> Result<Granted> {
        let deadline = self.wait_deadline(wait_ms);
        self.waiting()
            .lock(key.clone(), deadline, |may_take| {
                self.try_acquire(id, &key, may_take)
            })
            .await
    }

    /// One attempt. `may_take` false (others wait ahead on this node) still returns the
    /// caller's own grant and still ends an expired holder, but takes no free key.
    ///
    /// One round trip: the schema's `acquire` function runs the attempt under the key's
    /// lock and answers; an attempt that may take the key goes with concurrent ones as one
    /// call of `acquire_many` (see `batched`). Only when a session must be ended on the way
    /// (the caller or the holder is past its deadline) does the attempt run again as a
    /// transaction of several statements, which ends it with the one end statement and
    /// decides afresh under the same locks.
    async fn try_acquire(
        &self,
        id: SessionId,
        key: &LockKey,
        may_take: bool,
    ) -> Result<Step<Granted, ()>> {
        if may_take {
            self.acquire_batched(id, key).await
        } else {
            self.try_acquire_alone(id, key, may_take).await
        }
    }

    /// One attempt by the one-element statement.
    pub(super) async fn try_acquire_alone(
        &self,
        id: SessionId,
        key: &LockKey,
        may_take: bool,
    ) -> Result<Step<Granted, ()>> {
        let max = self.config().limits.max_locks_per_session as i64;
        let row = self
            .query_opt(
                ACQUIRE,
                &[&self.class(), &key.as_str(), &id.0, &may_take, &max],
                false,
            )
            .await?
            .ok_or_else(|| BackendError::Unavailable("the acquire returned nothing".into()))?;
        self.acquire_answer(id, key, may_take, &row).await
    }

    /// What the schema's `acquire` answered (`answer, granted, revision, held`), alone or as
    /// an element of `acquire_many`.
    pub(super) async fn acquire_answer(
        &self,
        id: SessionId,
        key: &LockKey,
        may_take: bool,
        row: &tokio_postgres::Row,
    ) -> Result<Step<Granted, ()>> {
        let answer: &str = row.get(0);
        let token = || Token(row.get::<_, Option<i64>>(1).unwrap_or_default() as u64);
        let revision = || row.get::<_, Option<i64>>(2).unwrap_or_default() as u64;
        Ok(match answer {
            "gone" => return Err(BackendError::SessionGone),
            "expired" | "holder_expired" => {
                return self.try_acquire_ending(id, key, may_take).await;
            }
            "own" => Step::Done(Granted {
                token: token(),
                revision: revision(),
            }),
            "held" => Step::Busy(()),
            "behind" => Step::Room(()),
            "too_many" => {
                let held = row.get::<_, Option<i64>>(3).unwrap_or_default() as usize;
                return Err(BackendError::TooManyLocks(held));
            }
            "granted" => {
                self.inner.metrics.locks_acquired.inc();
                self.inner.metrics.locks_held.inc();
                Step::Done(Granted {
                    token: token(),
                    revision: revision(),
                })
            }
            other => {
                return Err(BackendError::Unavailable(format!(
                    "the acquire answered {other:?}, which this build does not know"
                )));
            }
        })
    }

    /// One attempt that may have to end a session past its deadline (the caller, or the
    /// key's holder) in its own transaction, so the contender never waits for the reaper.
    async fn try_acquire_ending(
        &self,
        id: SessionId,
        key: &LockKey,
        may_take: bool,
    ) -> Result<Step<Granted, ()>> {
        let outcome = transact!(self, |tx, after| {
            self.decide_in(&tx, &mut after, id, key, may_take).await?
        })?;
        self.step(outcome)
    }

    /// What one decided attempt answers.
    pub(crate) fn step(&self, outcome: Try) -> Result<Step<Granted, ()>> {
        Ok(match outcome {
            Try::Gone => return Err(BackendError::SessionGone),
            Try::TooMany(n) => return Err(BackendError::TooManyLocks(n)),
            Try::Own(token, revision) => Step::Done(Granted { token, revision }),
            Try::Held => Step::Busy(()),
            Try::Behind => Step::Room(()),
            Try::Granted(token) => {
                self.inner.metrics.locks_acquired.inc();
                self.inner.metrics.locks_held.inc();
                Step::Done(Granted {
                    token,
                    revision: token.0,
                })
            }
        })
    }

    /// One attempt decided under the key's lock, inside the caller's transaction: the
    /// caller or the key's holder past its deadline is ended on the way.
    pub(crate) async fn decide_in(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        after: &mut After,
        id: SessionId,
        key: &LockKey,
        may_take: bool,
    ) -> std::result::Result<Try, Fail> {
        let max = self.config().limits.max_locks_per_session;
        Ok({
            self.q(tx, KEY_LOCK, &[&self.class(), &key.as_str()])
                .await?;
            let row = self
                .q_one(tx, STATE, &[&key.as_str(), &id.0])
                .await?
                .ok_or(Fail::Answer(BackendError::Unavailable(
                    "the lock state query returned nothing".into(),
                )))?;
            let me_live: Option<bool> = row.get(0);
            let holder: Option<Uuid> = row.get(1);
            let token: Option<i64> = row.get(2);
            let holder_live: Option<bool> = row.get(3);
            let held = row.get::<_, i64>(4) as usize;
            let revision = row.get::<_, i64>(5) as u64;
            match (me_live, holder) {
                (None, _) => Try::Gone,
                (Some(false), _) => {
                    self.end_in(tx, after, &END_EXPIRED_ONE, &[&id.0]).await?;
                    Try::Gone
                }
                (Some(true), Some(h)) if h == id.0 => {
                    Try::Own(Token(token.unwrap_or_default() as u64), revision)
                }
                (Some(true), Some(_)) if holder_live == Some(true) => Try::Held,
                (Some(true), holder) => {
                    let mut free = true;
                    if let Some(h) = holder {
                        // Past its deadline: ended here, so the contender never waits
                        // for the reaper. It may have been ended meanwhile, or extended.
                        self.end_in(tx, after, &END_EXPIRED_ONE, &[&h]).await?;
                        free = self.q_one(tx, HOLDER, &[&key.as_str()]).await?.is_none();
                    }
                    if !free {
                        Try::Held
                    } else if !may_take {
                        Try::Behind
                    } else if held >= max {
                        Try::TooMany(held)
                    } else {
                        let row = self
                            .q_one(tx, GRANT, &[&key.as_str(), &id.0])
                            .await?
                            .ok_or(Fail::Answer(BackendError::Unavailable(
                                "the grant returned nothing".into(),
                            )))?;
                        Try::Granted(Token(row.get::<_, i64>(0) as u64))
                    }
                }
            }
        })
    }

    /// One round trip when the key is released or the caller does not hold it; a caller
    /// past its deadline holds nothing any more and is ended, durably, before the answer.
    pub async fn release(&self, id: SessionId, key: LockKey, token: Token) -> Result<u64> {
        self.release_batched(id, key, token).await
    }

    /// One release by the one-element statement.
    pub(super) async fn release_alone(
        &self,
        id: SessionId,
        key: LockKey,
        token: Token,
    ) -> Result<u64> {
        let row = self
            .query_opt(RELEASE, &[&key.as_str(), &id.0, &(token.0 as i64)], false)
            .await?
            .ok_or_else(|| BackendError::Unavailable("the release returned nothing".into()))?;
        self.release_answer(id, key, &row).await
    }

    /// What the schema's `release` answered (`answer, revision`), alone or as an element
    /// of `release_many`.
    pub(super) async fn release_answer(
        &self,
        id: SessionId,
        key: LockKey,
        row: &tokio_postgres::Row,
    ) -> Result<u64> {
        match row.get::<_, &str>(0) {
            "released" => {
                self.inner.metrics.locks_released.inc();
                self.inner.metrics.locks_held.dec();
                let freed = Resource::Lock(key);
                self.announce(std::slice::from_ref(&freed), false);
                self.waiting().wake(&freed);
                Ok(row.get::<_, Option<i64>>(1).unwrap_or_default() as u64)
            }
            "not_holder" | "gone" => Err(BackendError::NotHolder),
            "expired" => {
                self.end_if_expired(id).await?;
                Err(BackendError::NotHolder)
            }
            other => Err(BackendError::Unavailable(format!(
                "the release answered {other:?}, which this build does not know"
            ))),
        }
    }

    pub async fn lock(&self, key: &LockKey) -> Result<Option<LockRecord>> {
        Ok(self
            .query_opt(LOCK, &[&key.as_str()], true)
            .await?
            .map(|r| LockRecord {
                session_id: SessionId(r.get(0)),
                token: Token(r.get::<_, i64>(1) as u64),
                acquired_at: UnixMs(r.get::<_, i64>(2) as u64),
            }))
    }

    pub async fn locks(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LockPage> {
        let pattern = prefix_pattern(prefix);
        let after = after.unwrap_or("");
        let fetch = (limit + 1) as i64;
        let rows = match prefix_upper_bound(prefix) {
            Some(upper) => {
                self.query(LOCKS, &[&pattern, &after, &fetch, &prefix, &upper], true)
                    .await?
            }
            None => {
                self.query(LOCKS_UNBOUNDED, &[&pattern, &after, &fetch, &prefix], true)
                    .await?
            }
        };
        let mut page: Vec<(String, LockRecord)> = rows
            .iter()
            .map(|r| {
                (
                    r.get(0),
                    LockRecord {
                        session_id: SessionId(r.get(1)),
                        token: Token(r.get::<_, i64>(2) as u64),
                        acquired_at: UnixMs(r.get::<_, i64>(3) as u64),
                    },
                )
            })
            .collect();
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|(k, _)| k.clone())
        } else {
            None
        };
        Ok((page, next))
    }

    /// Current only while `token` is the token of the key's holder and the holder's session
    /// is alive on the database clock.
    pub async fn fence(&self, key: &LockKey, token: Token) -> Result<Fence> {
        Ok(match self.query_opt(FENCE, &[&key.as_str()], true).await? {
            None => Fence {
                current: false,
                latest: None,
            },
            Some(r) => {
                let latest = Token(r.get::<_, i64>(0) as u64);
                Fence {
                    current: r.get::<_, bool>(1) && latest == token,
                    latest: Some(latest),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_prefix_range_holds_exactly_the_keys_that_start_with_it() {
        use super::prefix_upper_bound as upper;
        assert_eq!(upper(""), None);
        assert_eq!(upper("mass-expiry/1/").as_deref(), Some("mass-expiry/10"));
        assert_eq!(upper("a\u{10FFFF}").as_deref(), Some("b"));
        assert_eq!(upper("\u{10FFFF}\u{10FFFF}"), None);
        assert_eq!(upper("x\u{D7FF}").as_deref(), Some("x\u{E000}"));
        // In byte order, as the lock table's "C" collation compares.
        let keys = [
            "mass-expiry/1/",
            "mass-expiry/1/0",
            "mass-expiry/1/\u{10FFFF}",
            "mass-expiry/10",
            "mass-expiry/1",
            "mass-expiry/0/z",
            "x\u{D7FF}",
            "x\u{D7FF}\u{10FFFF}",
            "x\u{E000}",
        ];
        for prefix in [
            "mass-expiry/1/",
            "mass-expiry/1",
            "x\u{D7FF}",
            "a\u{10FFFF}",
        ] {
            let bound = upper(prefix).unwrap();
            for key in keys {
                let inside =
                    key.as_bytes() >= prefix.as_bytes() && key.as_bytes() < bound.as_bytes();
                assert_eq!(inside, key.starts_with(prefix), "{prefix:?} {key:?}");
            }
        }
    }

    #[test]
    fn like_patterns_escape_wildcards() {
        assert_eq!(super::prefix_pattern("a_b%c\\"), "a\\_b\\%c\\\\%");
        assert_eq!(super::prefix_pattern(""), "%");
    }
}
