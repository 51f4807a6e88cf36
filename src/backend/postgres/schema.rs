//! Versioned migrations of the `{namespace}` schema, applied at start and by
//! `leasehold migrate`.
//!
//! All of a run happens in one transaction that first takes a transaction-scoped advisory
//! lock on the namespace, so two nodes starting together apply each migration once: the
//! second waits, then finds the schema up to date. A schema newer than this build knows is
//! refused, never touched: an older node must not run against tables it does not understand.

use tokio_postgres::GenericClient;

use super::errors::PgError;

/// The newest schema version this build knows.
pub const VERSION: i32 = 9;

/// Migration `n` is `MIGRATIONS[n - 1]`. Only ever append: a released migration never
/// changes, since nodes that applied it will not apply it again.
const MIGRATIONS: &[&str] = &[
    MIGRATION_1,
    MIGRATION_2,
    MIGRATION_ACTOR,
    MIGRATION_REQUEST_IDS,
    MIGRATION_RELEASE,
    MIGRATION_MANY,
    MIGRATION_CASCADE,
    MIGRATION_BATCH_EVENTS,
    MIGRATION_SET_BATCHES,
];

/// Version 9: a batch whose keys (and, for acquires, sessions) are all distinct does its
/// common work as a few set-based statements instead of a call of `acquire` or `release` per
/// element, each running about five statements of its own. Replaces two functions, same
/// signatures and answers.
///
/// **Acquire.** One statement tries every key's advisory lock; the next locks the rows of the
/// live sessions whose key it got (`SKIP LOCKED`); the next, with a snapshot taken after both
/// are held, inserts a lock row for every element whose key has no row and whose session is
/// under its limit. An element granted there is answered as `acquire` would grant it (its
/// count before the insert as `held`); one whose key's lock was not got is `busy`, as in
/// `acquire`; every other element (its session locked elsewhere, gone or expired, the key
/// held, its own, the limit reached) is answered by the batched `acquire` itself, which
/// takes the locks this transaction already holds again without waiting. Sessions distinct
/// keep each count exact; keys distinct keep a key from being granted twice in one
/// statement. Tokens: each grant draws its token under its key's advisory lock, held to the
/// commit, as alone.
///
/// **Release.** One statement locks the rows of the batch's keys (`SKIP LOCKED`) and deletes
/// those held by the element's session with its token, while the session is live; each
/// element deleted draws its revision in order, as `release` does; every other element is
/// answered by the batched `release`.
///
/// Driven by `pgbench` (batches of 16 fresh keys for 16 sessions, acquired then released),
/// the set-based forms cost the database 81–82 µs a pair against 98–99 µs.
const MIGRATION_SET_BATCHES: &str = r#"
CREATE OR REPLACE FUNCTION {ns}.acquire_many(lock_class integer, keys text[], sids uuid[],
                                             max_locks bigint)
    RETURNS TABLE (answer text, granted bigint, revision bigint, held bigint)
    LANGUAGE plpgsql SET enable_bitmapscan = off AS $$
DECLARE
    n integer := coalesce(array_length(keys, 1), 0);
    got boolean[];
    live uuid[];
    new_keys text[];
    new_toks bigint[];
    new_held bigint[];
    at integer;
    ev_sids uuid[] := '{}';
    ev_keys text[] := '{}';
    ev_toks bigint[] := '{}';
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    IF (SELECT count(DISTINCT k) FROM unnest(keys) k) = n
       AND (SELECT count(DISTINCT s) FROM unnest(sids) s) = n THEN
        got := ARRAY(SELECT pg_try_advisory_xact_lock(lock_class, hashtext(u.k))
                     FROM unnest(keys) WITH ORDINALITY AS u (k, i) ORDER BY u.i);
        live := ARRAY(SELECT s.id FROM {ns}.session s
                      WHERE s.id = ANY (ARRAY(SELECT sids[i] FROM generate_subscripts(keys, 1) i
                                              WHERE got[i]))
                        AND s.expires_at > {ns}.db_now()
                      FOR NO KEY UPDATE SKIP LOCKED);
        WITH c AS MATERIALIZED (
            SELECT e.i, keys[e.i] AS k, sids[e.i] AS sid,
                   (SELECT count(*) FROM {ns}.lock x WHERE x.session_id = sids[e.i]) AS mine
            FROM generate_subscripts(keys, 1) AS e (i)
            WHERE got[e.i] AND sids[e.i] = ANY (live)
              AND NOT EXISTS (SELECT 1 FROM {ns}.lock l WHERE l.key = keys[e.i])
        ), ins AS (
            INSERT INTO {ns}.lock (key, session_id, token)
            SELECT c.k, c.sid, nextval('{ns}.revision') FROM c WHERE c.mine < max_locks
            ORDER BY c.i
            RETURNING key, token
        )
        SELECT array_agg(ins.key), array_agg(ins.token), array_agg(c.mine)
        INTO new_keys, new_toks, new_held
        FROM ins JOIN c ON c.k = ins.key;
    END IF;
    -- `new_keys` and `got` stay NULL when the batch goes per element.
    FOR i IN 1 .. n LOOP
        at := array_position(new_keys, keys[i]);
        IF at IS NOT NULL THEN
            answer := 'granted';
            granted := new_toks[at];
            revision := granted;
            held := new_held[at];
        ELSIF got[i] IS NOT FALSE THEN
            SELECT a.answer, a.granted, a.revision, a.held
            INTO answer, granted, revision, held
            FROM {ns}.acquire(lock_class, keys[i], sids[i], true, max_locks, true) a;
        ELSE
            answer := 'busy'; granted := NULL; revision := NULL; held := NULL;
        END IF;
        IF answer = 'granted' THEN
            ev_sids := ev_sids || sids[i];
            ev_keys := ev_keys || keys[i];
            ev_toks := ev_toks || granted;
        END IF;
        RETURN NEXT;
    END LOOP;
    PERFORM {ns}.log_events(lock_class, 'lock_acquired', ev_sids, ev_keys, ev_toks);
END $$;

CREATE OR REPLACE FUNCTION {ns}.release_many(lock_class integer, keys text[], sids uuid[],
                                             toks bigint[])
    RETURNS TABLE (answer text, revision bigint)
    LANGUAGE plpgsql AS $$
DECLARE
    n integer := coalesce(array_length(keys, 1), 0);
    gone text[] := '{}';
    ev_sids uuid[] := '{}';
    ev_keys text[] := '{}';
    ev_toks bigint[] := '{}';
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    IF (SELECT count(DISTINCT k) FROM unnest(keys) k) = n THEN
        WITH rows AS MATERIALIZED (
            SELECT t.ctid AS row FROM {ns}.lock t WHERE t.key = ANY (keys)
            FOR UPDATE SKIP LOCKED
        ), d AS (
            DELETE FROM {ns}.lock l
            USING unnest(keys, sids, toks) AS e (k, sid, tok)
            WHERE l.ctid IN (SELECT r.row FROM rows r)
              AND l.key = e.k AND l.session_id = e.sid AND l.token = e.tok
              AND EXISTS (SELECT 1 FROM {ns}.session s
                          WHERE s.id = e.sid AND s.expires_at > {ns}.db_now())
            RETURNING l.key
        )
        SELECT coalesce(array_agg(d.key), '{}') INTO gone FROM d;
    END IF;
    FOR i IN 1 .. n LOOP
        IF keys[i] = ANY (gone) THEN
            answer := 'released';
            revision := nextval('{ns}.revision');
        ELSE
            SELECT r.answer, r.revision INTO answer, revision
            FROM {ns}.release(keys[i], sids[i], toks[i], true) r;
        END IF;
        IF answer = 'released' THEN
            ev_sids := ev_sids || sids[i];
            ev_keys := ev_keys || keys[i];
            ev_toks := ev_toks || toks[i];
        END IF;
        RETURN NEXT;
    END LOOP;
    PERFORM {ns}.log_events(lock_class, 'lock_released', ev_sids, ev_keys, ev_toks);
END $$;
"#;

/// Version 8: a batch call writes its elements' audit events once, numbered, at its end;
/// each element runs fewer statements; and an acquire counts the caller's locks by a plain
/// index scan. Replaces and adds functions only.
///
/// **Events.** Each element of `acquire_many` and `release_many` used to insert its event
/// unnumbered, and the numbering rewrote it later: two writes of the row, one entry in each
/// of the two partial indexes and a dead row to vacuum, per event. Now the batch collects
/// them and `log_events` inserts them all at its end. If the numbering lock is free, it
/// takes it and numbers the committed backlog first (`number_events`, in id order) and gives
/// its own events the numbers after it, exactly as the reaper's pass does (see `END_DUE`):
/// the lock is held to the commit, so no number becomes visible before a smaller one, and
/// every event committed before the batch took the lock is numbered before the batch's.
/// If the lock is held elsewhere, the events are inserted unnumbered, as before, and the
/// next numbering numbers them. It never waits for the lock: the reaper holds it while it
/// waits for row locks a batch may hold, so waiting could close a cycle; and batches that
/// queued for it (tried, with a 5 ms limit) did 0.82× the pairs of batches that do not wait
/// in one run, though they numbered 79% of their events in place against 44%.
///
/// **Fewer statements.** Each statement a plpgsql function runs pays for its executor's
/// start and end: a fifth of the database's time (`perf`, with `pgbench` driving the batch
/// calls). The one-element `acquire` and `release` gain a `batched` argument that does, in
/// the same statements, what the batch calls did before calling them: try the key's
/// advisory lock and the session's row (acquire) or the lock row (release, whose delete now
/// locks its row with `SKIP LOCKED` itself), answering `busy`. The acquire reads the key's holder and the
/// caller's lock count in one statement. Driven by `pgbench` with 4 clients calling batches
/// of 16 directly, this cut the database's CPU per lock pair from 160–162 µs to 114–140 µs.
///
/// **The count.** The per-session limit counts the caller's locks through `lock_session_idx`.
/// Lock rows churn, and the planner chose a bitmap scan, which visits every dead entry of the
/// session's locks on each acquire and never marks one dead; a plain index scan marks them as
/// it passes, so later scans skip them. Measured under lock churn at 64 clients
/// (`pg_stat_user_functions`), each `acquire` took 122 µs a call against 209 µs.
const MIGRATION_BATCH_EVENTS: &str = r#"
-- One attempt to acquire key `k` for session `sid`, as version 2's `acquire` (see there for
-- the answers and the locks). `batched`: an element of `acquire_many`, which must never wait
-- and writes the events of its elements itself (`log_events`): the key's advisory lock and
-- the session's row are only tried, and `busy` answered when either is held elsewhere (or
-- the session has no row: the node then sends the attempt alone, which says gone); no event
-- is written. Otherwise it waits for both and writes its `lock_acquired` event.
CREATE FUNCTION {ns}.acquire(lock_class integer, k text, sid uuid, may_take boolean,
                             max_locks bigint, batched boolean,
                             OUT answer text, OUT granted bigint, OUT revision bigint,
                             OUT held bigint)
    LANGUAGE plpgsql SET enable_bitmapscan = off AS $$
DECLARE
    me_live boolean;
    holder uuid;
    holder_token bigint;
    holder_live boolean;
    mine bigint;
BEGIN
    IF batched THEN
        IF NOT pg_try_advisory_xact_lock(lock_class, hashtext(k)) THEN
            answer := 'busy';
            RETURN;
        END IF;
        SELECT s.expires_at > {ns}.db_now() INTO me_live
        FROM {ns}.session s WHERE s.id = sid FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            answer := 'busy';
            RETURN;
        END IF;
    ELSE
        PERFORM pg_advisory_xact_lock(lock_class, hashtext(k));
        SELECT s.expires_at > {ns}.db_now() INTO me_live
        FROM {ns}.session s WHERE s.id = sid FOR NO KEY UPDATE;
        IF NOT FOUND THEN
            answer := 'gone';
            RETURN;
        END IF;
    END IF;
    IF NOT me_live THEN
        answer := 'expired';
        RETURN;
    END IF;
    -- The key's holder and the caller's count in one statement: a grant needs both.
    SELECT l.session_id, l.token,
           (SELECT count(*) FROM {ns}.lock c WHERE c.session_id = sid)
    INTO holder, holder_token, mine
    FROM (VALUES (1)) AS one LEFT JOIN {ns}.lock l ON l.key = k;
    IF holder IS NOT NULL THEN
        IF holder = sid THEN
            answer := 'own';
            granted := holder_token;
            SELECT CASE WHEN r.is_called THEN r.last_value ELSE 0 END INTO revision
            FROM {ns}.revision r;
            RETURN;
        END IF;
        SELECT h.expires_at > {ns}.db_now() INTO holder_live
        FROM {ns}.session h WHERE h.id = holder;
        answer := CASE WHEN holder_live THEN 'held' ELSE 'holder_expired' END;
        RETURN;
    END IF;
    IF NOT may_take THEN
        answer := 'behind';
        RETURN;
    END IF;
    held := mine;
    IF held >= max_locks THEN
        answer := 'too_many';
        RETURN;
    END IF;
    INSERT INTO {ns}.lock (key, session_id, token)
    VALUES (k, sid, nextval('{ns}.revision'))
    RETURNING token INTO granted;
    IF NOT batched THEN
        INSERT INTO {ns}.event (kind, session_id, key, token)
        VALUES ('lock_acquired', sid, k, granted);
    END IF;
    answer := 'granted';
    revision := granted;
END $$;

-- Version 2's form, for nodes of an older build still running beside newer ones.
CREATE OR REPLACE FUNCTION {ns}.acquire(lock_class integer, k text, sid uuid, may_take boolean,
                                        max_locks bigint,
                                        OUT answer text, OUT granted bigint,
                                        OUT revision bigint, OUT held bigint)
    LANGUAGE sql AS $$
    SELECT * FROM {ns}.acquire(lock_class, k, sid, may_take, max_locks, false)
$$;

-- The release of version 5 (see there for the answers and why the session row is not
-- locked). `batched`: an element of `release_many`, which must never wait and writes the
-- events of its elements itself: the key's lock row is only tried, and `busy` answered
-- when another transaction holds it (a concurrent end of its session, or release); no
-- event is written. The delete takes its row with `SKIP LOCKED` before checking holder and
-- token, and a key without a row has no row to wait for.
CREATE FUNCTION {ns}.release(k text, sid uuid, tok bigint, batched boolean,
                             OUT answer text, OUT revision bigint)
    LANGUAGE plpgsql AS $$
DECLARE
    live boolean;
BEGIN
    IF batched THEN
        DELETE FROM {ns}.lock l
        WHERE l.ctid = (SELECT t.ctid FROM {ns}.lock t WHERE t.key = k FOR UPDATE SKIP LOCKED)
          AND l.session_id = sid AND l.token = tok
          AND EXISTS (SELECT 1 FROM {ns}.session s
                      WHERE s.id = sid AND s.expires_at > {ns}.db_now());
    ELSE
        DELETE FROM {ns}.lock l
        WHERE l.key = k AND l.session_id = sid AND l.token = tok
          AND EXISTS (SELECT 1 FROM {ns}.session s
                      WHERE s.id = sid AND s.expires_at > {ns}.db_now());
    END IF;
    IF FOUND THEN
        revision := nextval('{ns}.revision');
        IF NOT batched THEN
            INSERT INTO {ns}.event (kind, session_id, key, token)
            VALUES ('lock_released', sid, k, tok);
        END IF;
        answer := 'released';
        RETURN;
    END IF;
    -- Nothing released: busy if the key's row is held elsewhere (tried again, since the
    -- delete does not say why it found nothing).
    IF batched THEN
        PERFORM 1 FROM {ns}.lock t WHERE t.key = k FOR UPDATE SKIP LOCKED;
        IF NOT FOUND AND EXISTS (SELECT 1 FROM {ns}.lock t WHERE t.key = k) THEN
            answer := 'busy';
            RETURN;
        END IF;
    END IF;
    SELECT s.expires_at > {ns}.db_now() INTO live FROM {ns}.session s WHERE s.id = sid;
    answer := CASE WHEN live IS NULL THEN 'gone'
                   WHEN live THEN 'not_holder'
                   ELSE 'expired' END;
END $$;

CREATE OR REPLACE FUNCTION {ns}.release(k text, sid uuid, tok bigint,
                                        OUT answer text, OUT revision bigint)
    LANGUAGE sql AS $$
    SELECT * FROM {ns}.release(k, sid, tok, false)
$$;

-- Writes one event of `kind` per element of `sids`, `keys` and `toks` (in step), in that
-- order, at the end of a batch's transaction: numbered after the committed backlog when the
-- numbering lock is free (held then to the commit), unnumbered otherwise. Never waits: the
-- reaper holds that lock while it waits for row locks a batch may hold.
CREATE FUNCTION {ns}.log_events(lock_class integer, kind text, sids uuid[], keys text[],
                                toks bigint[])
    RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    n integer := coalesce(array_length(sids, 1), 0);
    base bigint;
BEGIN
    IF n = 0 THEN
        RETURN;
    END IF;
    IF pg_try_advisory_xact_lock(lock_class, 3) THEN
        -- Already held here: number_events takes it again without waiting.
        PERFORM {ns}.number_events(lock_class, true, 10000);
        UPDATE {ns}.event_counter SET last = last + n RETURNING last - n INTO base;
        INSERT INTO {ns}.event (seq, kind, session_id, key, token)
        SELECT base + e.i, kind, e.sid, e.key, e.tok
        FROM unnest(sids, keys, toks) WITH ORDINALITY AS e (sid, key, tok, i)
        ORDER BY e.i;
    ELSE
        INSERT INTO {ns}.event (kind, session_id, key, token)
        SELECT kind, e.sid, e.key, e.tok
        FROM unnest(sids, keys, toks) WITH ORDINALITY AS e (sid, key, tok, i)
        ORDER BY e.i;
    END IF;
END $$;

-- As version 6's, each element by the batched `acquire`, the events written together at the
-- end (`log_events`).
CREATE OR REPLACE FUNCTION {ns}.acquire_many(lock_class integer, keys text[], sids uuid[],
                                             max_locks bigint)
    RETURNS TABLE (answer text, granted bigint, revision bigint, held bigint)
    LANGUAGE plpgsql AS $$
DECLARE
    ev_sids uuid[] := '{}';
    ev_keys text[] := '{}';
    ev_toks bigint[] := '{}';
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        SELECT a.answer, a.granted, a.revision, a.held
        INTO answer, granted, revision, held
        FROM {ns}.acquire(lock_class, keys[i], sids[i], true, max_locks, true) a;
        IF answer = 'granted' THEN
            ev_sids := ev_sids || sids[i];
            ev_keys := ev_keys || keys[i];
            ev_toks := ev_toks || granted;
        END IF;
        RETURN NEXT;
    END LOOP;
    PERFORM {ns}.log_events(lock_class, 'lock_acquired', ev_sids, ev_keys, ev_toks);
END $$;

-- As version 6's, each element by the batched `release`, the events written together at the
-- end (`log_events`). The old form had no lock class; the numbering lock needs it, hence the
-- new first argument. The old form stays for older nodes.
CREATE FUNCTION {ns}.release_many(lock_class integer, keys text[], sids uuid[],
                                  toks bigint[])
    RETURNS TABLE (answer text, revision bigint)
    LANGUAGE plpgsql AS $$
DECLARE
    ev_sids uuid[] := '{}';
    ev_keys text[] := '{}';
    ev_toks bigint[] := '{}';
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        SELECT r.answer, r.revision INTO answer, revision
        FROM {ns}.release(keys[i], sids[i], toks[i], true) r;
        IF answer = 'released' THEN
            ev_sids := ev_sids || sids[i];
            ev_keys := ev_keys || keys[i];
            ev_toks := ev_toks || toks[i];
        END IF;
        RETURN NEXT;
    END LOOP;
    PERFORM {ns}.log_events(lock_class, 'lock_released', ev_sids, ev_keys, ev_toks);
END $$;
"#;

/// Version 7: the references from grants to their session are kept by triggers instead of
/// foreign keys — a statement-level one for the cascade — with the same rules: deleting
/// sessions deletes their locks and seats, and is refused while a job still names one as its
/// claimant; a lock, seat or claim can only be written for a session that exists, whose row
/// it locks `FOR KEY SHARE` to the end of its transaction, as a foreign key's check does.
///
/// Why: PostgreSQL runs a foreign key's action once per deleted row, as its own query. With
/// three references to the session, a reaper pass of 10 000 ends ran 30 000 of them (the seat
/// cascade and the job check even for sessions holding neither), about half of the pass
/// (`reaper_pass_profile`). A statement-level trigger sees every deleted session at once in
/// its transition table and does each table's part as one set-based statement.
///
/// Same guarantees, case by case. The delete side: the trigger runs at the end of the
/// deleting statement, in its transaction, and each of its statements takes a fresh
/// snapshot, as a foreign key's cascade does, so a grant committed by a transaction the
/// delete waited for is removed too. The write side: a writer of a grant for a session
/// being deleted either locks the row first (the delete then waits for it, and its trigger
/// sees the committed grant) or waits for the delete and then finds no row, and is refused.
/// Rows already present satisfy the rules: version 6 enforced them with the keys dropped here.
const MIGRATION_CASCADE: &str = r#"
ALTER TABLE {ns}.lock DROP CONSTRAINT lock_session_id_fkey;
ALTER TABLE {ns}.seat DROP CONSTRAINT seat_session_id_fkey;
ALTER TABLE {ns}.job DROP CONSTRAINT job_claim_session_fkey;

-- The cascade: `gone` holds every session the statement deleted. A table with no row to
-- cascade to is skipped without a lookup per session (each would probe its index): seats
-- and claimed jobs are often none at all. Each check reads a fresh snapshot, so a grant
-- committed by a transaction this delete waited for is seen.
CREATE FUNCTION {ns}.sessions_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {ns}.lock l WHERE l.session_id = ANY (ARRAY(SELECT id FROM gone));
    IF EXISTS (SELECT 1 FROM {ns}.seat) THEN
        DELETE FROM {ns}.seat st WHERE st.session_id = ANY (ARRAY(SELECT id FROM gone));
    END IF;
    IF EXISTS (SELECT 1 FROM {ns}.job j WHERE j.claim_session IS NOT NULL)
       AND EXISTS (SELECT 1 FROM {ns}.job j
                   WHERE j.claim_session = ANY (ARRAY(SELECT id FROM gone)))
    THEN
        RAISE EXCEPTION 'a deleted session still claims a job'
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER sessions_deleted AFTER DELETE ON {ns}.session
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION {ns}.sessions_deleted();

-- The reference check of a lock, seat or claim written (AFTER, as a foreign key's): the
-- session it names exists, and stays until this transaction ends. Per row, where the
-- cascade is per statement: grants are written one at a time, and a row trigger costs about
-- what a foreign key's check does, where a statement trigger's transition table cost half as
-- much again. (PL/pgSQL compiles a trigger function once per table, so each table's branch
-- only names its own column.)
CREATE FUNCTION {ns}.holder_exists() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    holder uuid;
BEGIN
    IF TG_TABLE_NAME = 'job' THEN
        holder := NEW.claim_session;
    ELSE
        holder := NEW.session_id;
    END IF;
    PERFORM 1 FROM {ns}.session s WHERE s.id = holder FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION '% names session %, which does not exist', TG_TABLE_NAME, holder
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER lock_holder_exists AFTER INSERT ON {ns}.lock
    FOR EACH ROW EXECUTE FUNCTION {ns}.holder_exists();
CREATE TRIGGER seat_holder_exists AFTER INSERT ON {ns}.seat
    FOR EACH ROW EXECUTE FUNCTION {ns}.holder_exists();
-- A job's claimant only when one is written (a claim, not a settle or a finish).
CREATE TRIGGER job_claimant_inserted AFTER INSERT ON {ns}.job
    FOR EACH ROW WHEN (NEW.claim_session IS NOT NULL)
    EXECUTE FUNCTION {ns}.holder_exists();
CREATE TRIGGER job_claimant_updated AFTER UPDATE OF claim_session ON {ns}.job
    FOR EACH ROW WHEN (NEW.claim_session IS NOT NULL
                       AND NEW.claim_session IS DISTINCT FROM OLD.claim_session)
    EXECUTE FUNCTION {ns}.holder_exists();
"#;

/// Version 6: the batch calls of concurrent acquires and releases (see `batched`), each built
/// on the one-element function and answering each element as it answers. Self-contained: it
/// only adds functions.
///
/// Neither ever waits for a lock another transaction holds: an element whose key's advisory
/// lock, session row (acquire) or lock row (release) is held elsewhere is answered `busy`
/// and the node sends it alone, outside the batch. So a batch is never part of a deadlock,
/// whatever order concurrent batches (of this node or another) and other transactions take
/// their locks in, and one element never waits behind another's lock. Elements of one batch
/// run in order in one transaction and see each other's writes, as they would one after
/// the other; the locks one element takes are its own transaction's for the next.
const MIGRATION_MANY: &str = r#"
-- Attempts for `keys[i]` by `sids[i]`, as `acquire` with `may_take` true, one answer row per
-- element in order; `busy` when the key's advisory lock or the session's row is held by
-- another transaction (or the session has no row). Taking both first, without waiting,
-- leaves `acquire` nothing to wait for: it takes them again and holds them already.
CREATE FUNCTION {ns}.acquire_many(lock_class integer, keys text[], sids uuid[],
                                  max_locks bigint)
    RETURNS TABLE (answer text, granted bigint, revision bigint, held bigint)
    LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        answer := 'busy'; granted := NULL; revision := NULL; held := NULL;
        IF pg_try_advisory_xact_lock(lock_class, hashtext(keys[i])) THEN
            PERFORM 1 FROM {ns}.session s WHERE s.id = sids[i] FOR NO KEY UPDATE SKIP LOCKED;
            IF FOUND THEN
                SELECT a.answer, a.granted, a.revision, a.held
                INTO answer, granted, revision, held
                FROM {ns}.acquire(lock_class, keys[i], sids[i], true, max_locks) a;
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

-- Releases of `keys[i]` by `sids[i]` with `toks[i]`, as `release`, one answer row per element
-- in order; `busy` when the key's lock row is locked by another transaction (a concurrent
-- end of its session, or release). A key without a row has nothing for `release` to wait
-- for: its delete finds no row, and a row committed meanwhile carries a new token, which
-- the delete's condition refuses before it would lock it.
CREATE FUNCTION {ns}.release_many(keys text[], sids uuid[], toks bigint[])
    RETURNS TABLE (answer text, revision bigint)
    LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        answer := 'busy'; revision := NULL;
        PERFORM 1 FROM {ns}.lock l WHERE l.key = keys[i] FOR UPDATE SKIP LOCKED;
        IF FOUND OR NOT EXISTS (SELECT 1 FROM {ns}.lock l WHERE l.key = keys[i]) THEN
            SELECT r.answer, r.revision INTO answer, revision
            FROM {ns}.release(keys[i], sids[i], toks[i]) r;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;
"#;

/// Audit events name the API token of the operator or admin call that wrote them (never
/// its secret); NULL for clients, the background reaper, and events written before. Adding a
/// nullable column without a default rewrites no row, so it is quick on a long log.
const MIGRATION_ACTOR: &str = r#"
ALTER TABLE {ns}.event ADD COLUMN actor text;
"#;

/// `{ns}` stands for the quoted schema name.
const MIGRATION_1: &str = r#"
-- The one clock. Every statement takes time from here and never calls now() itself, so that
-- a test can move the database clock by redefining this function. A sql function is
-- inlined into the plans that call it; a redefinition still reaches plans already cached on
-- pooled connections, because a plan records the functions it inlined and is invalidated
-- when one changes (the postgres tests check this).
CREATE FUNCTION {ns}.db_now() RETURNS timestamptz
    LANGUAGE sql STABLE AS $$ SELECT now() $$;

CREATE FUNCTION {ns}.ms(t timestamptz) RETURNS bigint
    LANGUAGE sql STABLE STRICT AS $$ SELECT floor(extract(epoch FROM t) * 1000)::bigint $$;

-- Every mutation draws its revision here, and every grant's token is its revision. CACHE 1
-- (the default, stated because it matters): with a per-connection cache, values would not
-- be handed out in the order they are asked for across connections.
CREATE SEQUENCE {ns}.revision AS bigint CACHE 1;
-- Positions in a queue: new jobs at the tail (ascending), recovered and released jobs at
-- the head (the negated value of the second sequence, so the latest comes first).
CREATE SEQUENCE {ns}.job_tail AS bigint CACHE 1;
CREATE SEQUENCE {ns}.job_head AS bigint CACHE 1;

CREATE TABLE {ns}.session (
    id uuid PRIMARY KEY,
    owner text NOT NULL,
    metadata jsonb,
    ttl_ms bigint NOT NULL CHECK (ttl_ms > 0),
    created_at timestamptz NOT NULL DEFAULT {ns}.db_now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT {ns}.db_now(),
    expires_at timestamptz NOT NULL,
    CONSTRAINT session_ttl_ck CHECK (expires_at > created_at)
);
CREATE INDEX session_expires_idx ON {ns}.session (expires_at);
CREATE INDEX session_owner_idx ON {ns}.session (owner, id);

CREATE TABLE {ns}.lock (
    key text COLLATE "C" PRIMARY KEY,
    session_id uuid NOT NULL REFERENCES {ns}.session ON DELETE CASCADE,
    token bigint NOT NULL,
    acquired_at timestamptz NOT NULL DEFAULT {ns}.db_now()
);
CREATE INDEX lock_session_idx ON {ns}.lock (session_id);

CREATE TABLE {ns}.pool (
    name text COLLATE "C" PRIMARY KEY,
    capacity integer NOT NULL CHECK (capacity > 0),
    metadata jsonb,
    created_at timestamptz NOT NULL DEFAULT {ns}.db_now(),
    -- The revision of the last create or resize: every seat granted since (token above it)
    -- was granted under this capacity, which is what `check` verifies.
    revision bigint NOT NULL
);

CREATE TABLE {ns}.seat (
    pool text COLLATE "C" NOT NULL REFERENCES {ns}.pool,
    session_id uuid NOT NULL REFERENCES {ns}.session ON DELETE CASCADE,
    token bigint NOT NULL,
    metadata jsonb,
    acquired_at timestamptz NOT NULL DEFAULT {ns}.db_now(),
    PRIMARY KEY (pool, session_id)
);
CREATE INDEX seat_session_idx ON {ns}.seat (session_id);

CREATE TABLE {ns}.job (
    id uuid PRIMARY KEY,
    queue text COLLATE "C" NOT NULL,
    kind text NOT NULL DEFAULT '',
    payload json NOT NULL,
    idempotent boolean NOT NULL,
    max_recoveries integer NOT NULL,
    recovery_count integer NOT NULL DEFAULT 0,
    attempt integer NOT NULL DEFAULT 0,
    ord bigint NOT NULL,
    status text NOT NULL CHECK (status IN ('queued', 'claimed', 'done', 'failed')),
    -- No cascade: ending a session settles its jobs explicitly (recover or fail) in the same
    -- statement that deletes it, and this reference refuses a delete that did not.
    claim_session uuid REFERENCES {ns}.session,
    -- The token of the latest claim; current only while the job is claimed.
    token bigint,
    claimed_at timestamptz,
    result json,
    reason text,
    enqueued_at timestamptz NOT NULL DEFAULT {ns}.db_now(),
    updated_at timestamptz NOT NULL DEFAULT {ns}.db_now(),
    CONSTRAINT job_claim_ck CHECK ((status = 'claimed') = (claim_session IS NOT NULL)),
    CONSTRAINT job_recoveries_ck CHECK (recovery_count <= max_recoveries)
);
CREATE INDEX job_queued_idx ON {ns}.job (queue, ord) WHERE status = 'queued';
CREATE INDEX job_state_idx ON {ns}.job (queue, status, id);
CREATE INDEX job_session_idx ON {ns}.job (claim_session) WHERE claim_session IS NOT NULL;
CREATE INDEX job_finished_idx ON {ns}.job (updated_at) WHERE status IN ('done', 'failed');

-- The audit log. `id` is assigned at insert and may commit out of order; `seq`, the cursor,
-- is assigned after commit by number_events and only ever in commit order. `id` needs no
-- index of its own: only unnumbered events are looked up by it.
CREATE TABLE {ns}.event (
    id bigserial NOT NULL,
    seq bigint,
    at timestamptz NOT NULL DEFAULT {ns}.db_now(),
    kind text NOT NULL,
    session_id uuid,
    key text,
    token bigint,
    reason text,
    owner text,
    -- For a session's end: the locks released with it, keys and tokens in step.
    released_keys text[],
    released_tokens bigint[],
    pool text,
    queue text,
    job_id uuid,
    detail text
);
-- Both partial, so that an insert (unnumbered) touches only the second: inserting events is
-- on the path of every mutation and of the reaper, numbering them is not.
-- Numbering goes by id, so ids must follow causal order: an event committed before another
-- transaction began must get the smaller id. `nextval` gives that only without a
-- per-connection cache (with one, a later transaction on another connection can draw a
-- smaller id from its cached block, and its event is numbered ahead of one that happened
-- before it). So the sequence keeps the default CACHE 1.
CREATE UNIQUE INDEX event_seq_idx ON {ns}.event (seq) WHERE seq IS NOT NULL;
CREATE INDEX event_unnumbered_idx ON {ns}.event (id) WHERE seq IS NULL;
-- The last sequence number given. Kept apart from the events so that numbers never repeat
-- once old events are trimmed.
CREATE TABLE {ns}.event_counter (last bigint NOT NULL);
INSERT INTO {ns}.event_counter VALUES (0);

-- Numbers committed, unnumbered events in id order (causal: see event_id_seq), after every number already
-- given. Serialised by an advisory lock held to the end of the caller's transaction: a
-- numbering transaction becomes visible before the next one can take the lock, so each
-- sees every number given before it and a reader never sees a number before a smaller one.
-- `wait` false gives up (returns -1) when another numbering is under way.
CREATE FUNCTION {ns}.number_events(lock_class integer, wait boolean, batch integer)
    RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    base bigint;
    n bigint;
    total bigint := 0;
BEGIN
    IF wait THEN
        PERFORM pg_advisory_xact_lock(lock_class, 3);
    ELSIF NOT pg_try_advisory_xact_lock(lock_class, 3) THEN
        RETURN -1;
    END IF;
    LOOP
        SELECT last INTO base FROM {ns}.event_counter;
        UPDATE {ns}.event e SET seq = base + o.rn
        FROM (SELECT id, row_number() OVER (ORDER BY id) AS rn
              FROM {ns}.event WHERE seq IS NULL ORDER BY id LIMIT batch) o
        WHERE e.id = o.id;
        GET DIAGNOSTICS n = ROW_COUNT;
        UPDATE {ns}.event_counter SET last = base + n WHERE n > 0;
        total := total + n;
        EXIT WHEN n < batch;
    END LOOP;
    RETURN total;
END $$;
"#;

/// Safe retries: the answers kept for calls that carried a `request_id`, each written in the
/// transaction of the change it answers (see `requests`). Self-contained: it only adds a
/// table and its index.
const MIGRATION_REQUEST_IDS: &str = r#"
CREATE TABLE {ns}.request_id (
    -- `{scope}/{request_id}`: the digest of the calling token's name, and the client's id.
    key text COLLATE "C" PRIMARY KEY,
    fingerprint text NOT NULL,
    -- The first answer, as JSON; empty while the claiming transaction runs.
    answer text NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX request_id_expiry ON {ns}.request_id (expires_at);
"#;

/// Version 2: the lock acquire as one call, numbering that no longer scans the whole audit
/// log, and a cheaper guard on jobs' claiming sessions.
const MIGRATION_2: &str = r#"
-- A job's claiming session is settled by the end statement before the session row goes; the
-- reference only refuses a delete that did not. NO ACTION checked, per deleted session, that
-- no other row with its key had appeared before looking for referencing jobs; RESTRICT makes
-- the same refusal without that probe, and no session id is ever reused. NOT VALID then
-- VALIDATE: the check of existing rows takes no lock that blocks writers.
ALTER TABLE {ns}.job DROP CONSTRAINT job_claim_session_fkey;
ALTER TABLE {ns}.job ADD CONSTRAINT job_claim_session_fkey
    FOREIGN KEY (claim_session) REFERENCES {ns}.session ON DELETE RESTRICT NOT VALID;
ALTER TABLE {ns}.job VALIDATE CONSTRAINT job_claim_session_fkey;

-- Numbering, as before, with each batch's rows updated by their addresses. The first version
-- joined the batch to the event table by id, which has no index of its own but the partial
-- one of unnumbered events, so every batch scanned the whole audit log: numbering grew with
-- the log's length, not with the batch. The rows cannot move while this runs: nobody else
-- numbers (the lock), and only numbered events are ever deleted.
CREATE OR REPLACE FUNCTION {ns}.number_events(lock_class integer, wait boolean, batch integer)
    RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    base bigint;
    n bigint;
    total bigint := 0;
BEGIN
    IF wait THEN
        PERFORM pg_advisory_xact_lock(lock_class, 3);
    ELSIF NOT pg_try_advisory_xact_lock(lock_class, 3) THEN
        RETURN -1;
    END IF;
    LOOP
        SELECT last INTO base FROM {ns}.event_counter;
        UPDATE {ns}.event e SET seq = base + o.rn
        FROM (SELECT ctid AS at, row_number() OVER (ORDER BY id) AS rn
              FROM {ns}.event WHERE seq IS NULL ORDER BY id LIMIT batch) o
        WHERE e.ctid = o.at;
        GET DIAGNOSTICS n = ROW_COUNT;
        UPDATE {ns}.event_counter SET last = base + n WHERE n > 0;
        total := total + n;
        EXIT WHEN n < batch;
    END LOOP;
    RETURN total;
END $$;

-- One attempt to acquire key `k` for session `sid`, as one statement: the statements the
-- node used to send one by one in a transaction, run here in the same order under the same
-- locks. The key's advisory lock is taken first and held to the end of the caller's
-- transaction, and the token is drawn from the revision sequence only once it is held (see
-- the token order rule of the backend). The caller's row is locked FOR NO KEY UPDATE, so
-- two acquires of one session cannot both pass the per-session limit.
--
-- `answer` is one of: gone (no such session), expired (the caller is past its deadline),
-- own (it already holds the key: its token), held (a live holder), holder_expired (the
-- holder is past its deadline), behind (free, but `may_take` is false), too_many (`held`
-- locks already), granted (the new token). Nothing is written unless it is granted; on
-- expired and holder_expired the node ends the session in a transaction of its own and
-- asks again, so ending stays in the one end statement.
CREATE FUNCTION {ns}.acquire(lock_class integer, k text, sid uuid, may_take boolean,
                             max_locks bigint,
                             OUT answer text, OUT granted bigint, OUT revision bigint,
                             OUT held bigint)
    LANGUAGE plpgsql AS $$
DECLARE
    me_live boolean;
    holder uuid;
    holder_token bigint;
    holder_live boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(lock_class, hashtext(k));
    SELECT s.expires_at > {ns}.db_now() INTO me_live
    FROM {ns}.session s WHERE s.id = sid FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        answer := 'gone';
        RETURN;
    END IF;
    IF NOT me_live THEN
        answer := 'expired';
        RETURN;
    END IF;
    SELECT l.session_id, l.token INTO holder, holder_token FROM {ns}.lock l WHERE l.key = k;
    IF FOUND THEN
        IF holder = sid THEN
            answer := 'own';
            granted := holder_token;
            SELECT CASE WHEN r.is_called THEN r.last_value ELSE 0 END INTO revision
            FROM {ns}.revision r;
            RETURN;
        END IF;
        SELECT h.expires_at > {ns}.db_now() INTO holder_live
        FROM {ns}.session h WHERE h.id = holder;
        answer := CASE WHEN holder_live THEN 'held' ELSE 'holder_expired' END;
        RETURN;
    END IF;
    IF NOT may_take THEN
        answer := 'behind';
        RETURN;
    END IF;
    SELECT count(*) INTO held FROM {ns}.lock l WHERE l.session_id = sid;
    IF held >= max_locks THEN
        answer := 'too_many';
        RETURN;
    END IF;
    INSERT INTO {ns}.lock (key, session_id, token)
    VALUES (k, sid, nextval('{ns}.revision'))
    RETURNING token INTO granted;
    INSERT INTO {ns}.event (kind, session_id, key, token)
    VALUES ('lock_acquired', sid, k, granted);
    answer := 'granted';
    revision := granted;
END $$;
"#;

/// Version 5: the lock release as one call that also answers why nothing was released, and
/// without a row lock on the releasing session. Self-contained: it only adds a function.
const MIGRATION_RELEASE: &str = r#"
-- Releases key `k` held by session `sid` with token `tok`, if the session is live on the
-- database clock: the lock row goes, one revision is drawn and the lock_released event is
-- written, in the one statement the node sends.
--
-- `answer` is one of: released (`revision` is the new revision), not_holder (the session is
-- live and does not hold the key with that token), expired (the session is past its
-- deadline: the node ends it with the one end statement, then answers not_holder, since a
-- session past its deadline holds nothing), gone (no such session). Nothing is written
-- unless it is released.
--
-- The session row is read, not locked: what serialises a release with an end of the same
-- session (close, expiry, operator, a contender) is the lock row itself, which both delete
-- (the end by its cascade). Whichever deletes it second waits for the first to commit and
-- then finds nothing to delete. A row lock on the session served nothing more: an end's
-- statement still reads the session's locks from the snapshot it began with, lock or not.
-- It cost a WAL record and a write of the session's heap page on every release.
CREATE FUNCTION {ns}.release(k text, sid uuid, tok bigint,
                             OUT answer text, OUT revision bigint)
    LANGUAGE plpgsql AS $$
DECLARE
    live boolean;
BEGIN
    DELETE FROM {ns}.lock l
    WHERE l.key = k AND l.session_id = sid AND l.token = tok
      AND EXISTS (SELECT 1 FROM {ns}.session s
                  WHERE s.id = sid AND s.expires_at > {ns}.db_now());
    IF FOUND THEN
        revision := nextval('{ns}.revision');
        INSERT INTO {ns}.event (kind, session_id, key, token)
        VALUES ('lock_released', sid, k, tok);
        answer := 'released';
        RETURN;
    END IF;
    SELECT s.expires_at > {ns}.db_now() INTO live FROM {ns}.session s WHERE s.id = sid;
    answer := CASE WHEN live IS NULL THEN 'gone'
                   WHEN live THEN 'not_holder'
                   ELSE 'expired' END;
END $$;
"#;

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(
        "the schema {namespace:?} is at version {found}, newer than the newest this build knows ({VERSION}); upgrade this node before starting it"
    )]
    TooNew { namespace: String, found: i32 },
    #[error(transparent)]
    Db(#[from] PgError),
}

/// The quoted schema name: namespaces are validated as `[a-z_][a-z0-9_]*`, and quoting
/// lets even a reserved word (`user`) serve.
pub fn quoted(namespace: &str) -> String {
    format!("\"{namespace}\"")
}

/// The advisory lock class of a namespace: FNV-1a of its name, the same on every node and
/// every build.
pub fn lock_class(namespace: &str) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in b"leasehold.".iter().chain(namespace.as_bytes()) {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h as i32
}

/// Advisory lock ids within a namespace's class (the second key).
pub const LOCK_MIGRATE: i32 = 1;
pub const LOCK_REAP: i32 = 2;
/// Used inside `number_events`.
pub const LOCK_EVENTS: i32 = 3;

/// Brings the schema to [`VERSION`]; returns the version it found. Idempotent.
pub async fn migrate(
    client: &mut tokio_postgres::Client,
    namespace: &str,
) -> Result<i32, MigrateError> {
    migrate_to(client, namespace, VERSION).await
}

/// Brings the schema to `target` (at most [`VERSION`]); the tests use it to build a schema
/// as an older release left it.
pub(crate) async fn migrate_to(
    client: &mut tokio_postgres::Client,
    namespace: &str,
    target: i32,
) -> Result<i32, MigrateError> {
    let ns = quoted(namespace);
    let tx = client.transaction().await.map_err(PgError::from)?;
    tx.execute(
        "SELECT pg_advisory_xact_lock($1, $2)",
        &[&lock_class(namespace), &LOCK_MIGRATE],
    )
    .await
    .map_err(PgError::from)?;
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {ns};
         CREATE TABLE IF NOT EXISTS {ns}.schema_version (
             version integer PRIMARY KEY,
             applied_at timestamptz NOT NULL
         );"
    ))
    .await
    .map_err(PgError::from)?;
    let found = current_version(&tx, namespace).await?;
    if found > VERSION {
        return Err(MigrateError::TooNew {
            namespace: namespace.to_string(),
            found,
        });
    }
    let wanted = target.clamp(0, VERSION) as usize;
    for (i, sql) in MIGRATIONS
        .iter()
        .enumerate()
        .take(wanted)
        .skip(found as usize)
    {
        let version = i as i32 + 1;
        tx.batch_execute(&sql.replace("{ns}", &ns))
            .await
            .map_err(PgError::from)?;
        tx.execute(
            &format!("INSERT INTO {ns}.schema_version VALUES ($1, {ns}.db_now())"),
            &[&version],
        )
        .await
        .map_err(PgError::from)?;
        tracing::info!(namespace, version, "applied schema migration");
    }
    tx.commit().await.map_err(PgError::from)?;
    Ok(found)
}

/// The schema's version, 0 when it has none yet.
pub async fn current_version(client: &impl GenericClient, namespace: &str) -> Result<i32, PgError> {
    let ns = quoted(namespace);
    let exists: bool = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{ns}.schema_version")],
        )
        .await?
        .get(0);
    if !exists {
        return Ok(0);
    }
    let row = client
        .query_one(
            &format!("SELECT coalesce(max(version), 0) FROM {ns}.schema_version"),
            &[],
        )
        .await?;
    Ok(row.get(0))
}
