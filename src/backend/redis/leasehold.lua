-- Leasehold's rules over Redis: one library of Redis Functions, loaded once with
-- `FUNCTION LOAD` and called with `FCALL`, that carries every operation. The node prepends
-- the `#!lua name=...` line and `local FUNCTION = '...'`, both naming this text's version, so
-- nodes of different versions never call each other's code. Each call runs one operation
-- (ARGV[2]) whole, atomically: Redis runs a function to its end before any other command,
-- so nothing here needs a lock. Loading runs this chunk once; a call runs only `dispatch`
-- and the operation it names, never the definitions below again.
--
-- ARGV[1] is the namespace; every key starts with it and a colon. Keys that carry a name a
-- client chose (a pool, a queue) end in a fixed suffix of their kind, so no two names can
-- make the same key, and none can make a key of the supported seat layout
-- (`{ns}:{pool}:active_sessions`, `{ns}:{pool}:session_metadata`), which ends differently.
--
-- Rules every operation follows:
-- * One clock: `NOW`, Redis's own `TIME` in milliseconds, read once per call. Only when the
--   key `{ns}:!clock` exists (the test harness sets it, nothing else does) is its value the
--   time instead, so tests can pin the clock as they pin PostgreSQL's `db_now()`.
-- * No resurrection: a session hash is written whole only by `open`; every other write to
--   it first checks that it exists and is live.
-- * Ending a session (`end_one`) releases its locks and seats, settles its jobs, writes its
--   events and deletes it, all in the calling operation.
-- * Every mutation draws its revision from `INCR {ns}:!rev` (a batch: the first with `INCR`,
--   the rest in memory, the last written back when the call finishes); a grant's token is its
--   revision, so tokens only grow, across nodes and (with append-only persistence)
--   restarts.
-- * Audit events go to the stream `{ns}:!events`, numbered by `INCR {ns}:!evseq` in the
--   order the operations ran. A call's events are written when it finishes (a batch's
--   when its last operation has run, or before an operation that reads the log): one
--   event as the entry `{seq}-1` with the field `e`; several (an end, a reap pass, a
--   batch) as entries of up to EVENTS_PER_ENTRY consecutive events each, id
--   `{last seq}-1`, field `b`, the events' JSON joined by newlines (JSON as cjson writes it
--   has none). The counter is drawn once a call and written back once. So an
--   entry's id is the number of its last event, and a cursor `(after-1` finds every
--   entry that holds an event after `after`.
-- * What frees a key, a seat or a job is published on `{ns}:!free` when the call finishes,
--   so other nodes wake their waiters: the names (`lock:K`, `pool:P`, `queue:Q`), each once,
--   up to NOTIFY_EACH_MAX a message joined by newlines; or `*` for more than can be listed.
--   A call that frees one name publishes exactly that name, as before batches shared one.

-- The call being run: its arguments, its namespace's key names, its time. Set by `dispatch`
-- at the start of every call (Redis runs one call at a time, so they are never shared).
local ARGV, NOW, NOW_S
local ns, P
local K_REV, K_CLOCK, K_EVSEQ, K_EVENTS, K_SESSIONS, K_DEADLINES, K_LOCKS, K_LOCKIDX
local K_POOLS, K_QUEUES, K_FINISHED, K_JOB_HEAD, K_JOB_TAIL, K_REAPER, CHANNEL
local K_STALE_S, K_STALE_L
-- >>> actor: an operator's or admin's call passes `op name`, the name of its API token
-- (never the secret; names have no spaces). `event` writes it as `actor` into the events of
-- the kinds in ACTOR_KINDS (those of EventKind::names_actor), and into no other. `run` sets
-- it for each operation.
local ACTOR = nil
local ACTOR_KINDS = {
    session_ended_by_admin = true, session_expired = true, seat_reclaimed = true,
    job_recovered = true, job_failed = true, pool_put = true, pool_deleted = true,
    job_requeued = true, token_floor_raised = true,
}
-- <<< actor
local NOTIFY_EACH_MAX = 64
local EVENTS_PER_ENTRY = 256

-- Names the keys of namespace `name`; a call in the namespace of the one before reuses them.
local function bind(name)
    if name == ns then return end
    ns = name
    P = ns .. ':'
    K_REV = P .. '!rev'
    K_CLOCK = P .. '!clock'
    K_EVSEQ = P .. '!evseq'
    K_EVENTS = P .. '!events'
    K_SESSIONS = P .. '!sessions'
    K_DEADLINES = P .. '!deadlines'
    K_LOCKS = P .. '!locks'
    K_LOCKIDX = P .. '!lockidx'
    K_POOLS = P .. '!pools'
    K_QUEUES = P .. '!queues'
    K_FINISHED = P .. '!finished'
    K_JOB_HEAD = P .. '!job_head'
    K_JOB_TAIL = P .. '!job_tail'
    K_REAPER = P .. '!reaper'
    K_STALE_S = P .. '!stale:sessions'
    K_STALE_L = P .. '!stale:locks'
    CHANNEL = P .. '!free'
end

local function k_session(id) return P .. '!s:' .. id end
local function k_job(id) return P .. '!j:' .. id end
local function k_seats(pool) return P .. pool .. ':!seats' end
local function k_active(pool) return P .. pool .. ':active_sessions' end
local function k_layout(pool) return P .. pool .. ':session_metadata' end
-- A queue's queued jobs by order (score), and its jobs in each state by id (lex).
local function k_order(queue) return P .. queue .. ':!order' end
local function k_state(queue, state) return P .. queue .. ':!' .. state end

local function now_ms()
    local pinned = redis.call('GET', K_CLOCK)
    if pinned then return tonumber(pinned) end
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The counters a call draws from, the revision (`{ns}:!rev`) and the event number
-- (`{ns}:!evseq`): a call's first draw from one takes its number with one `INCR`; its later
-- draws number on in memory (`n`), and `finish` writes the last back once (`dirty`), so a
-- batch of hundreds or a reap of thousands does not `INCR` either for each. Redis runs one
-- call at a time, so no other call sees a counter in between. `dispatch` forgets both at
-- the start of every call.
local REV, EVSEQ = { n = nil, dirty = false }, { n = nil, dirty = false }
local function draw_from(c, key)
    if c.n then
        c.n = c.n + 1
        c.dirty = true
    else
        c.n = redis.call('INCR', key)
    end
    return c.n
end
local function write_back(c, key)
    if c.dirty then redis.call('SET', key, string.format('%d', c.n)) end
    c.dirty = false
end
local function draw() return draw_from(REV, K_REV) end
local function revision() return REV.n or tonumber(redis.call('GET', K_REV) or '0') end

-- The events not yet written: their JSON in order, numbered up to EVSEQ.n.
local evbuf, evn = {}, 0
-- What the call freed, published by `finish`: the names in order, each once, or `*`.
local pubbuf, pubseen, pubany = {}, {}, false
local function event(e)
    e.seq = draw_from(EVSEQ, K_EVSEQ)
    e.at = NOW
    if ACTOR and ACTOR_KINDS[e.kind] then e.actor = ACTOR end -- actor (see above)
    evn = evn + 1
    evbuf[evn] = cjson.encode(e)
end
-- Writes the call's events (see the rules above), both counters and what it freed; run at
-- the end of every call, failed or not, so each event it numbered is in the log once. A
-- second run writes nothing.
local function finish()
    local last = EVSEQ.n
    if evn == 1 then
        redis.call('XADD', K_EVENTS, string.format('%d-1', last), 'e', evbuf[1])
    elseif evn > 1 then
        local first = last - evn + 1
        local i = 1
        while i <= evn do
            local j = math.min(i + EVENTS_PER_ENTRY - 1, evn)
            redis.call('XADD', K_EVENTS, string.format('%d-1', first + j - 1), 'b',
                table.concat(evbuf, '\n', i, j))
            i = j + 1
        end
    end
    evbuf, evn = {}, 0
    write_back(EVSEQ, K_EVSEQ)
    write_back(REV, K_REV)
    if pubany then
        redis.call('PUBLISH', CHANNEL, '*')
    else
        local i = 1
        while i <= #pubbuf do
            local j = math.min(i + NOTIFY_EACH_MAX - 1, #pubbuf)
            redis.call('PUBLISH', CHANNEL, table.concat(pubbuf, '\n', i, j))
            i = j + 1
        end
    end
    pubbuf, pubseen, pubany = {}, {}, false
end

-- The events of a stream entry, oldest first, and the number of the first of them.
local function entry_events(entry)
    local last = tonumber(string.match(entry[1], '^(%d+)-'))
    local fields = entry[2]
    if fields[1] == 'e' then return { fields[2] }, last end
    local out = {}
    for text in string.gmatch(fields[2], '[^\n]+') do out[#out + 1] = text end
    return out, last - #out + 1
end

-- Notes that what `list` names was freed. The call publishes the names when it finishes
-- (`finish`), each once, in messages of up to NOTIFY_EACH_MAX names joined by newlines; more
-- than a message holds in one list is published as `*`.
local function publish(list)
    if #list == 0 then return end
    if #list > NOTIFY_EACH_MAX then
        pubany = true
        return
    end
    for _, p in ipairs(list) do
        if not pubseen[p] then
            pubseen[p] = true
            pubbuf[#pubbuf + 1] = p
        end
    end
end

local function hash(key)
    local flat = redis.call('HGETALL', key)
    if #flat == 0 then return nil end
    local t = {}
    for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
    return t
end

local function answer(t) return cjson.encode(t) end

-- The seed's seat layout, kept in step with the seats: one entry per holder of a pool.
-- Times in Unix seconds, as the tools that read it expect; the holder's metadata (the
-- seat's, else the session's) is merged in beside them, the layout's own fields winning.
local function layout_entry(meta, acquired_ms, heartbeat_ms, session_id, token)
    local entry = {}
    if meta and meta ~= '' then
        local ok, decoded = pcall(cjson.decode, meta)
        if ok and type(decoded) == 'table' then
            for key, v in pairs(decoded) do entry[key] = v end
        end
    end
    entry.acquired_at = math.floor(acquired_ms / 1000)
    entry.last_heartbeat = math.floor(heartbeat_ms / 1000)
    entry.session_id = session_id
    entry.token = token
    return cjson.encode(entry)
end

local function live(s) return s ~= nil and tonumber(s.x) > NOW end

---------------------------------------------------------------------------------------
-- Ending sessions

-- What ending sessions did so far; `gone_*` are the deletions an end defers to `flush`,
-- made in a few variadic commands per batch rather than several per session.
local function new_acc()
    return { closed = 0, expired = 0, admin = 0, locks = 0, seats = 0, recovered = 0,
        failed = {}, keys = {}, pools = {}, recovered_q = {}, failed_q = {}, free = {},
        nfree = 0, gone_keys = {}, gone_ids = {}, gone_locks = {} }
end

-- Notes that `kind .. name` was freed. Only the first NOTIFY_EACH_MAX are kept: past that
-- the end publishes `*`, so a pass of thousands builds no names it would not send.
local function freed(acc, kind, name)
    local n = acc.nfree + 1
    acc.nfree = n
    if n <= NOTIFY_EACH_MAX then acc.free[n] = kind .. name end
end

local function in_chunks(cmd, key, list)
    local n = #list
    local i = 1
    while i <= n do
        local j = math.min(i + 999, n)
        if key then
            redis.call(cmd, key, unpack(list, i, j))
        else
            redis.call(cmd, unpack(list, i, j))
        end
        i = j + 1
    end
end

-- Makes the deletions the ended sessions deferred; run before anything reads them.
local function flush(acc)
    in_chunks('DEL', nil, acc.gone_keys)
    in_chunks('ZREM', K_DEADLINES, acc.gone_ids)
    in_chunks('HDEL', K_LOCKS, acc.gone_locks)
    -- The listing indexes are swept later (`OPS.sweep`): taking a random entry out of a
    -- sorted set of many costs more than the rest of an end, and an index entry without its
    -- record is only skipped by the listings meanwhile.
    in_chunks('RPUSH', K_STALE_S, acc.gone_ids)
    in_chunks('RPUSH', K_STALE_L, acc.gone_locks)
    acc.gone_keys, acc.gone_ids, acc.gone_locks = {}, {}, {}
end

local function end_kind(reason)
    if reason == 'closed' then return 'session_closed' end
    if reason == 'expired' then return 'session_expired' end
    return 'session_ended_by_admin'
end

-- Settles job `jid` claimed by the ending session `sid`: back to the head of its queue
-- when idempotent and under its recovery cap, failed otherwise.
local function settle_job(jid, sid, acc)
    local jk = k_job(jid)
    local j = redis.call('HMGET', jk, 'q', 'idem', 'maxr', 'rc', 'tok', 'st', 'cs')
    if j[6] ~= 'claimed' or j[7] ~= sid then return end
    local q, rc, maxr, tok = j[1], tonumber(j[4]), tonumber(j[3]), tonumber(j[5])
    redis.call('ZREM', k_state(q, 'claimed'), jid)
    if j[2] == '1' and rc < maxr then
        local ord = -redis.call('INCR', K_JOB_HEAD)
        redis.call('HSET', jk, 'st', 'queued', 'rc', rc + 1, 'ord', ord, 'rsn', '',
            'cs', '', 'ca', '', 'upd', NOW)
        redis.call('ZADD', k_order(q), ord, jid)
        redis.call('ZADD', k_state(q, 'queued'), 0, jid)
        event({ kind = 'job_recovered', sid = sid, token = tok, queue = q, job = jid })
        acc.recovered = acc.recovered + 1
        acc.recovered_q[#acc.recovered_q + 1] = q
        freed(acc, 'queue:', q)
    else
        local reason = (j[2] == '1') and 'max_recoveries_exceeded' or 'not_idempotent'
        redis.call('HSET', jk, 'st', 'failed', 'rsn', reason, 'cs', '', 'ca', '', 'upd', NOW)
        redis.call('ZADD', k_state(q, 'failed'), 0, jid)
        redis.call('ZADD', K_FINISHED, NOW, jid)
        event({ kind = 'job_failed', sid = sid, token = tok, queue = q, job = jid,
            detail = reason })
        acc.failed[#acc.failed + 1] = reason
        acc.failed_q[#acc.failed_q + 1] = q
    end
end

-- Orders of `{name, token}` pairs: by name, by token.
local function by_first(a, b) return a[1] < b[1] end
local function by_second(a, b) return a[2] < b[2] end

-- Ends session `id` for `reason`: its seats reclaimed, its jobs settled, then its end
-- with the locks it released in token order; the events in that order. False when it does
-- not exist.
local function end_one(id, reason, acc)
    local sk = k_session(id)
    -- One count for three keys, the record named twice (EXISTS counts each naming): below
    -- 2 there is no session; 2, a session that holds neither seats nor jobs (the common
    -- case, read no further); above, one with seats or jobs or both.
    local n = redis.call('EXISTS', sk, sk, sk .. ':seats', sk .. ':jobs')
    if n < 2 then return false end
    local more = n > 2
    local seats = more and redis.call('HGETALL', sk .. ':seats') or {}
    local pools = {}
    for i = 1, #seats, 2 do pools[#pools + 1] = { seats[i], tonumber(seats[i + 1]) } end
    table.sort(pools, by_first)
    for _, st in ipairs(pools) do
        local pool = st[1]
        redis.call('HDEL', k_seats(pool), id)
        redis.call('SREM', k_active(pool), id)
        redis.call('HDEL', k_layout(pool), id)
        event({ kind = 'seat_reclaimed', sid = id, token = st[2], reason = reason, pool = pool })
        acc.seats = acc.seats + 1
        acc.pools[#acc.pools + 1] = pool
        freed(acc, 'pool:', pool)
    end
    if more then
        local jobs = redis.call('SMEMBERS', sk .. ':jobs')
        table.sort(jobs)
        for _, jid in ipairs(jobs) do settle_job(jid, id, acc) end
    end
    local lk = sk .. ':locks'
    local flat = redis.call('HGETALL', lk)
    local nlocks = #flat / 2
    -- The locks in token order: keys and tokens side by side (one lock, the common case,
    -- needs no sorting and no pairs).
    local keys, tokens = {}, {}
    if nlocks == 1 then
        keys[1], tokens[1] = flat[1], tonumber(flat[2])
    elseif nlocks > 1 then
        local locks = {}
        for i = 1, #flat, 2 do locks[#locks + 1] = { flat[i], tonumber(flat[i + 1]) } end
        table.sort(locks, by_second)
        for i, l in ipairs(locks) do keys[i], tokens[i] = l[1], l[2] end
    end
    local gl, listed = acc.gone_locks, acc.nfree + nlocks <= NOTIFY_EACH_MAX
    for i = 1, nlocks do
        gl[#gl + 1] = keys[i]
        -- Named one by one only while the end can still list them (see `ended`).
        if listed then acc.keys[#acc.keys + 1] = keys[i] end
        freed(acc, 'lock:', keys[i])
    end
    acc.locks = acc.locks + nlocks
    event({ kind = end_kind(reason), sid = id, reason = reason, rk = keys, rt = tokens })
    -- Only the keys that exist: a seat hash or job set emptied earlier is gone already.
    local g = acc.gone_keys
    g[#g + 1] = sk
    if nlocks > 0 then g[#g + 1] = lk end
    if more then
        g[#g + 1] = sk .. ':seats'
        g[#g + 1] = sk .. ':jobs'
    end
    acc.gone_ids[#acc.gone_ids + 1] = id
    acc[reason] = acc[reason] + 1
    return true
end

-- What an end did, for the node: counts for its metrics and what to wake. Lists are left
-- out (`listed` false) when more was freed than a notification lists one by one.
local function ended(acc, rev)
    flush(acc)
    local listed = acc.nfree <= NOTIFY_EACH_MAX
    if listed then publish(acc.free) else pubany = true end
    local out = { by = { acc.closed, acc.expired, acc.admin }, revision = rev,
        locks = acc.locks, seats = acc.seats, recovered = acc.recovered, failed = acc.failed,
        listed = listed }
    if listed then
        out.keys = acc.keys
        out.pools = acc.pools
        out.recovered_q = acc.recovered_q
        out.failed_q = acc.failed_q
    end
    return out
end

local function total(acc) return acc.closed + acc.expired + acc.admin end

-- Ends `id` when it exists and is past its deadline; returns the end's summary or nil.
local function end_if_expired(id)
    local x = redis.call('HGET', k_session(id), 'x')
    if not x or tonumber(x) > NOW then return nil end
    local acc = new_acc()
    local rev = draw()
    end_one(id, 'expired', acc)
    return ended(acc, rev)
end

-- Whether `id` is live; a session past its deadline is ended on the way.
local function live_or_end(id)
    local x = redis.call('HGET', k_session(id), 'x')
    if not x then return false, nil end
    if tonumber(x) > NOW then return true, nil end
    return false, end_if_expired(id)
end

---------------------------------------------------------------------------------------
-- Operations

local OPS = {}

function OPS.now() return answer({ now = NOW }) end

function OPS.revision() return answer({ revision = revision() }) end

-- open(id, owner, metadata, ttl)
function OPS.open()
    local id, owner, meta, ttl = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
    local sk = k_session(id)
    if redis.call('EXISTS', sk) == 1 then return answer({ err = 'exists' }) end
    local rev = draw()
    local x = NOW + ttl
    redis.call('HSET', sk, 'o', owner, 'm', meta, 'ttl', ttl, 'c', NOW, 'x', x, 'h', NOW)
    redis.call('ZADD', K_DEADLINES, x, id)
    redis.call('ZADD', K_SESSIONS, 0, id)
    event({ kind = 'session_opened', sid = id, owner = owner })
    -- The id is in the answer so that a replay (see `!rid` below) names the first session.
    return answer({ revision = rev, expires_at = x, session = id })
end

-- heartbeat(id, ttl or ''): one conditional extension; a session past its deadline is
-- ended, never extended.
function OPS.heartbeat()
    local id, ttl = ARGV[3], ARGV[4]
    local sk = k_session(id)
    local s = redis.call('HMGET', sk, 'x', 'ttl')
    if not s[1] then return answer({ err = 'gone' }) end
    if tonumber(s[1]) <= NOW then
        return answer({ err = 'gone', ended = end_if_expired(id) })
    end
    if ttl == '' then ttl = tonumber(s[2]) else ttl = tonumber(ttl) end
    local x = NOW + ttl
    local x_s = string.format('%d', x)
    redis.call('HSET', sk, 'ttl', string.format('%d', ttl), 'x', x_s, 'h', NOW_S)
    redis.call('ZADD', K_DEADLINES, x_s, id)
    local seats = redis.call('HGETALL', sk .. ':seats')
    for i = 1, #seats, 2 do
        local pool = seats[i]
        local raw = redis.call('HGET', k_seats(pool), id)
        if raw then
            local seat = cjson.decode(raw)
            local meta = seat.m
            -- The session's metadata, read only for a seat that has none of its own.
            if meta == '' then meta = redis.call('HGET', sk, 'm') end
            redis.call('HSET', k_layout(pool), id, layout_entry(meta, seat.at, NOW, id, seat.t))
        end
    end
    return string.format('{"expires_at":%d,"ttl":%d}', x, ttl)
end

-- live(id): whether the session is live, ending it when past its deadline.
function OPS.live()
    local is_live, e = live_or_end(ARGV[3])
    return answer({ live = is_live, ended = e })
end

-- end(id, reason): a client closing a session already past its deadline is recorded as
-- what happened first: it expired.
OPS['end'] = function()
    local id, reason = ARGV[3], ARGV[4]
    local x = redis.call('HGET', k_session(id), 'x')
    if not x then return answer({ ended = ended(new_acc(), 0) }) end
    if reason == 'closed' and tonumber(x) <= NOW then reason = 'expired' end
    local acc = new_acc()
    local rev = draw()
    end_one(id, reason, acc)
    return answer({ ended = ended(acc, rev) })
end

local function session_info(id, s)
    local sk = k_session(id)
    local flat = redis.call('HGETALL', sk .. ':locks')
    local locks = {}
    for i = 1, #flat, 2 do locks[#locks + 1] = { flat[i], tonumber(flat[i + 1]) } end
    table.sort(locks, function(a, b) return a[1] < b[1] end)
    flat = redis.call('HGETALL', sk .. ':seats')
    local seats = {}
    for i = 1, #flat, 2 do seats[#seats + 1] = { flat[i], tonumber(flat[i + 1]) } end
    table.sort(seats, function(a, b) return a[1] < b[1] end)
    local jobs = redis.call('SMEMBERS', sk .. ':jobs')
    table.sort(jobs)
    local ttl = tonumber(s.ttl)
    return { id = id, owner = s.o, metadata = s.m, ttl = ttl, created_at = tonumber(s.c),
        expires_at = tonumber(s.x), last_heartbeat_at = tonumber(s.h), live = live(s),
        grace = NOW - tonumber(s.h) > math.floor(ttl / 3), locks = locks, seats = seats,
        jobs = jobs }
end

-- session(id): a live session and what it holds; one past its deadline is ended first.
function OPS.session()
    local id = ARGV[3]
    local s = hash(k_session(id))
    if not s then return answer({}) end
    if not live(s) then return answer({ ended = end_if_expired(id) }) end
    return answer({ session = session_info(id, s) })
end

-- sessions(after, limit, owner or ''): up to limit+1 sessions in id order after `after`
-- (of `owner` when given), live or not; the node leaves out the ones past their deadline.
function OPS.sessions()
    local after, limit, owner = ARGV[3], tonumber(ARGV[4]), ARGV[5]
    local out = {}
    local from = (after == '') and '-' or ('(' .. after)
    while #out < limit + 1 do
        local ids = redis.call('ZRANGEBYLEX', K_SESSIONS, from, '+', 'LIMIT', 0, 256)
        if #ids == 0 then break end
        for _, id in ipairs(ids) do
            local s = hash(k_session(id))
            if s and (owner == '' or s.o == owner) then
                out[#out + 1] = session_info(id, s)
                if #out >= limit + 1 then break end
            end
        end
        from = '(' .. ids[#ids]
    end
    return answer({ page = out })
end

-- acquire(sid, key, may_take, max_locks)
function OPS.acquire()
    local sid, key, may_take, max = ARGV[3], ARGV[4], ARGV[5] == '1', tonumber(ARGV[6])
    local me = redis.call('HGET', k_session(sid), 'x')
    if not me then return answer({ err = 'gone' }) end
    if tonumber(me) <= NOW then return answer({ err = 'gone', ended = end_if_expired(sid) }) end
    local raw = redis.call('HGET', K_LOCKS, key)
    local e = nil
    if raw then
        local holder, tok = string.match(raw, '^([^|]+)|(%d+)|')
        if holder == sid then
            return answer({ own = tonumber(tok), revision = revision() })
        end
        local hx = redis.call('HGET', k_session(holder), 'x')
        if hx and tonumber(hx) > NOW then return answer({ held = true }) end
        -- Past its deadline: ended here, so a contender never waits for the reaper.
        e = end_if_expired(holder)
        if redis.call('HEXISTS', K_LOCKS, key) == 1 then
            return answer({ held = true, ended = e })
        end
    end
    if not may_take then return answer({ behind = true, ended = e }) end
    local held = redis.call('HLEN', k_session(sid) .. ':locks')
    if held >= max then return answer({ err = 'too_many', n = held, ended = e }) end
    local tok = draw()
    local tok_s = string.format('%d', tok)
    redis.call('HSET', K_LOCKS, key, sid .. '|' .. tok_s .. '|' .. NOW_S)
    redis.call('ZADD', K_LOCKIDX, 0, key)
    redis.call('HSET', k_session(sid) .. ':locks', key, tok_s)
    event({ kind = 'lock_acquired', sid = sid, key = key, token = tok })
    return answer({ granted = tok, ended = e })
end

-- release(sid, key, token)
function OPS.release()
    local sid, key, token = ARGV[3], ARGV[4], tonumber(ARGV[5])
    local is_live, e = live_or_end(sid)
    if not is_live then return answer({ err = 'not_holder', ended = e }) end
    local raw = redis.call('HGET', K_LOCKS, key)
    if not raw then return answer({ err = 'not_holder' }) end
    local holder, tok = string.match(raw, '^([^|]+)|(%d+)|')
    if holder ~= sid or tonumber(tok) ~= token then return answer({ err = 'not_holder' }) end
    local rev = draw()
    redis.call('HDEL', K_LOCKS, key)
    redis.call('ZREM', K_LOCKIDX, key)
    redis.call('HDEL', k_session(sid) .. ':locks', key)
    event({ kind = 'lock_released', sid = sid, key = key, token = token })
    publish({ 'lock:' .. key })
    return answer({ revision = rev })
end

local function lock_record(raw)
    local holder, tok, at = string.match(raw, '^([^|]+)|(%d+)|(%d+)$')
    return { sid = holder, token = tonumber(tok), at = tonumber(at) }
end

function OPS.lock()
    local raw = redis.call('HGET', K_LOCKS, ARGV[3])
    if not raw then return answer({}) end
    return answer({ lock = lock_record(raw) })
end

-- locks(prefix, after, limit): up to limit+1 keys starting with prefix, after `after`.
function OPS.locks()
    local prefix, after, limit = ARGV[3], ARGV[4], tonumber(ARGV[5])
    local from = '[' .. prefix
    if after ~= '' and after >= prefix then from = '(' .. after end
    -- 0xff never occurs in UTF-8, so it bounds every key that starts with the prefix.
    local to = '[' .. prefix .. '\255'
    local out = {}
    -- Entries whose lock is gone (not swept yet) are skipped, so read on until the page is
    -- full or the index ends.
    while #out < limit + 1 do
        local keys = redis.call('ZRANGEBYLEX', K_LOCKIDX, from, to, 'LIMIT', 0,
            math.max(limit + 1 - #out, 64))
        if #keys == 0 then break end
        for _, key in ipairs(keys) do
            local raw = redis.call('HGET', K_LOCKS, key)
            if raw then
                local r = lock_record(raw)
                r.key = key
                out[#out + 1] = r
                if #out >= limit + 1 then break end
            end
        end
        from = '(' .. keys[#keys]
    end
    return answer({ page = out })
end

-- fence(key, token): current only while token is the holder's and the holder is live.
function OPS.fence()
    local raw = redis.call('HGET', K_LOCKS, ARGV[3])
    if not raw then return answer({ current = false }) end
    local r = lock_record(raw)
    local hx = redis.call('HGET', k_session(r.sid), 'x')
    local current = hx ~= false and hx ~= nil and tonumber(hx) > NOW and
        r.token == tonumber(ARGV[4])
    return answer({ current = current, latest = r.token })
end

---------------------------------------------------------------------------------------
-- Pools

local function pool_record(name)
    local raw = redis.call('HGET', K_POOLS, name)
    if not raw then return nil end
    return cjson.decode(raw)
end

-- Ends every holder of `pool` past its deadline.
local function end_expired_holders(pool, acc)
    local holders = redis.call('HKEYS', k_seats(pool))
    table.sort(holders)
    local n = 0
    for _, id in ipairs(holders) do
        local x = redis.call('HGET', k_session(id), 'x')
        if x and tonumber(x) <= NOW then
            end_one(id, 'expired', acc)
            n = n + 1
        end
    end
    return n
end

-- put_pool(name, capacity, metadata or '', metadata given '1'|'0')
function OPS.put_pool()
    local name, cap, meta, given = ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6] == '1'
    local p = pool_record(name)
    local rev = draw()
    local created = p == nil
    local grew = p ~= nil and p.cap < cap
    if created then
        p = { cap = cap, meta = meta, created = NOW, rev = rev }
    else
        p.cap = cap
        p.rev = rev
        if given then p.meta = meta end
    end
    redis.call('HSET', K_POOLS, name, cjson.encode(p))
    event({ kind = 'pool_put', pool = name, detail = 'capacity ' .. cap })
    if created or grew then publish({ 'pool:' .. name }) end
    return answer({ revision = rev, created = created })
end

-- delete_pool(name): only with no seat in use; holders past their deadline are ended
-- first and do not keep it alive.
function OPS.delete_pool()
    local name = ARGV[3]
    if not pool_record(name) then return answer({ err = 'no_pool' }) end
    local acc = new_acc()
    local e = nil
    if end_expired_holders(name, acc) > 0 then e = ended(acc, draw()) end
    local in_use = redis.call('HLEN', k_seats(name))
    if in_use > 0 then return answer({ err = 'in_use', n = in_use, ended = e }) end
    local rev = draw()
    redis.call('HDEL', K_POOLS, name)
    redis.call('DEL', k_seats(name), k_active(name), k_layout(name))
    event({ kind = 'pool_deleted', pool = name })
    -- Waiters learn on their next try that the pool is gone.
    publish({ 'pool:' .. name })
    return answer({ revision = rev, ended = e })
end

-- Raises the revision counter to at least the floor (ARGV[3]) and draws the raise's own
-- revision above it, in one script: a grant's draw runs wholly before or wholly after it.
-- The counter only ratchets up; a floor at or below it moves nothing.
function OPS.raise_floor()
    local floor = tonumber(ARGV[3])
    local previous = revision()
    if floor > previous then
        -- Written by `finish` with the draw below.
        REV.n, REV.dirty = floor, true
    end
    local rev = draw()
    -- The same detail as `floor_detail` writes on the other backends.
    event({ kind = 'token_floor_raised',
        detail = 'floor ' .. ARGV[3] .. ', counter was ' .. string.format('%d', previous) })
    return answer({ previous = previous, revision = rev })
end

function OPS.pool()
    local name = ARGV[3]
    local p = pool_record(name)
    if not p then return answer({}) end
    local flat = redis.call('HGETALL', k_seats(name))
    local holders = {}
    for i = 1, #flat, 2 do
        local id, seat = flat[i], cjson.decode(flat[i + 1])
        local s = redis.call('HMGET', k_session(id), 'o', 'x', 'h', 'ttl')
        local h = { sid = id, owner = s[1] or '', token = seat.t, at = seat.at, meta = seat.m }
        if s[2] and tonumber(s[2]) > NOW then
            h.hb = tonumber(s[3])
            h.grace = NOW - tonumber(s[3]) > math.floor(tonumber(s[4]) / 3)
        end
        holders[#holders + 1] = h
    end
    table.sort(holders, function(a, b) return a.sid < b.sid end)
    return answer({ pool = { cap = p.cap, meta = p.meta, created = p.created,
        holders = holders } })
end

function OPS.pools()
    local flat = redis.call('HGETALL', K_POOLS)
    local out = {}
    for i = 1, #flat, 2 do
        local p = cjson.decode(flat[i + 1])
        out[#out + 1] = { flat[i], p.cap, redis.call('HLEN', k_seats(flat[i])) }
    end
    return answer({ pools = out })
end

-- seat(sid, pool, metadata, may_take)
function OPS.seat()
    local sid, name, meta, may_take = ARGV[3], ARGV[4], ARGV[5], ARGV[6] == '1'
    local p = pool_record(name)
    if not p then return answer({ err = 'no_pool' }) end
    local me = redis.call('HMGET', k_session(sid), 'x', 'm')
    if not me[1] then return answer({ err = 'gone' }) end
    if tonumber(me[1]) <= NOW then
        return answer({ err = 'gone', ended = end_if_expired(sid) })
    end
    local own = redis.call('HGET', k_session(sid) .. ':seats', name)
    if own then return answer({ own = tonumber(own), revision = revision() }) end
    local in_use = redis.call('HLEN', k_seats(name))
    local e = nil
    if in_use >= p.cap or not may_take then
        -- Holders past their deadline are ended here, so a contender never waits for the
        -- reaper.
        local acc = new_acc()
        if end_expired_holders(name, acc) > 0 then
            e = ended(acc, draw())
            in_use = redis.call('HLEN', k_seats(name))
        end
    end
    if in_use >= p.cap then return answer({ full = true, cap = p.cap, n = in_use, ended = e }) end
    if not may_take then return answer({ behind = true, cap = p.cap, n = in_use, ended = e }) end
    local tok = draw()
    redis.call('HSET', k_seats(name), sid, cjson.encode({ t = tok, at = NOW, m = meta }))
    redis.call('HSET', k_session(sid) .. ':seats', name, tok)
    local holder_meta = meta
    if holder_meta == '' then holder_meta = me[2] end
    redis.call('SADD', k_active(name), sid)
    redis.call('HSET', k_layout(name), sid, layout_entry(holder_meta, NOW, NOW, sid, tok))
    event({ kind = 'seat_acquired', sid = sid, pool = name, token = tok })
    return answer({ granted = tok, ended = e })
end

-- release_seat(sid, pool, token)
function OPS.release_seat()
    local sid, name, token = ARGV[3], ARGV[4], tonumber(ARGV[5])
    local is_live, e = live_or_end(sid)
    local own = is_live and redis.call('HGET', k_session(sid) .. ':seats', name)
    if not own or tonumber(own) ~= token then
        if not pool_record(name) then return answer({ err = 'no_pool', ended = e }) end
        return answer({ err = 'not_holder', ended = e })
    end
    local rev = draw()
    redis.call('HDEL', k_seats(name), sid)
    redis.call('HDEL', k_session(sid) .. ':seats', name)
    redis.call('SREM', k_active(name), sid)
    redis.call('HDEL', k_layout(name), sid)
    event({ kind = 'seat_released', sid = sid, pool = name, token = token })
    publish({ 'pool:' .. name })
    return answer({ revision = rev })
end

---------------------------------------------------------------------------------------
-- Jobs

-- enqueue(id, queue, kind, payload, idempotent '1'|'0', max_recoveries)
function OPS.enqueue()
    local id, q, kind, payload, idem, maxr =
        ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], tonumber(ARGV[8])
    local rev = draw()
    local ord = redis.call('INCR', K_JOB_TAIL)
    redis.call('HSET', k_job(id), 'q', q, 'k', kind, 'p', payload, 'idem', idem, 'maxr', maxr,
        'rc', 0, 'att', 0, 'ord', ord, 'st', 'queued', 'cs', '', 'tok', '', 'ca', '', 'res', '',
        'rsn', '', 'enq', NOW, 'upd', NOW)
    redis.call('ZADD', k_order(q), ord, id)
    redis.call('ZADD', k_state(q, 'queued'), 0, id)
    redis.call('SADD', K_QUEUES, q)
    event({ kind = 'job_enqueued', job = id, queue = q })
    publish({ 'queue:' .. q })
    return answer({ revision = rev, job = id })
end

-- claim(sid, queue, may_take): the queued job first in order.
function OPS.claim()
    local sid, q, may_take = ARGV[3], ARGV[4], ARGV[5] == '1'
    local is_live, e = live_or_end(sid)
    if not is_live then return answer({ err = 'gone', ended = e }) end
    local first = redis.call('ZRANGE', k_order(q), 0, 0)
    if #first == 0 then return answer({ none = true }) end
    if not may_take then return answer({ behind = true }) end
    local jid = first[1]
    local jk = k_job(jid)
    local tok = draw()
    local att = redis.call('HINCRBY', jk, 'att', 1)
    redis.call('HSET', jk, 'st', 'claimed', 'cs', sid, 'tok', tok, 'ca', NOW, 'upd', NOW)
    redis.call('ZREM', k_order(q), jid)
    redis.call('ZREM', k_state(q, 'queued'), jid)
    redis.call('ZADD', k_state(q, 'claimed'), 0, jid)
    redis.call('SADD', k_session(sid) .. ':jobs', jid)
    event({ kind = 'job_claimed', sid = sid, job = jid, queue = q, token = tok })
    local j = redis.call('HMGET', jk, 'rc', 'k')
    return answer({ job = jid, token = tok, attempt = att, rc = tonumber(j[1]), kind = j[2] })
end

-- finish(sid, job, token, status, result, reason, event kind): only the current claim,
-- by a live session, may finish a job; a claimant past its deadline is ended first, which
-- settles the job.
function OPS.finish()
    local sid, jid, token, status, result, reason, kind =
        ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8], ARGV[9]
    local jk = k_job(jid)
    if redis.call('EXISTS', jk) == 0 then return answer({ err = 'no_job' }) end
    local _, e = live_or_end(sid)
    local j = redis.call('HMGET', jk, 'st', 'cs', 'tok', 'q')
    if j[1] ~= 'claimed' or j[2] ~= sid or tonumber(j[3]) ~= token then
        return answer({ err = 'stale', ended = e })
    end
    local q = j[4]
    local rev = draw()
    redis.call('ZREM', k_state(q, 'claimed'), jid)
    redis.call('SREM', k_session(sid) .. ':jobs', jid)
    redis.call('HSET', jk, 'st', status, 'cs', '', 'ca', '', 'upd', NOW)
    if status == 'done' then
        redis.call('HSET', jk, 'res', result)
        redis.call('ZADD', K_FINISHED, NOW, jid)
    elseif status == 'failed' then
        redis.call('HSET', jk, 'rsn', reason)
        redis.call('ZADD', K_FINISHED, NOW, jid)
    else
        local ord = -redis.call('INCR', K_JOB_HEAD)
        redis.call('HSET', jk, 'ord', ord)
        redis.call('ZADD', k_order(q), ord, jid)
        publish({ 'queue:' .. q })
    end
    redis.call('ZADD', k_state(q, status), 0, jid)
    local ev = { kind = kind, sid = sid, job = jid, queue = q, token = token }
    if status == 'failed' then ev.detail = reason end
    event(ev)
    return answer({ revision = rev, queue = q })
end

-- requeue(job): a failed job back to the tail of its queue, its recovery count reset.
function OPS.requeue()
    local jid = ARGV[3]
    local jk = k_job(jid)
    local j = redis.call('HMGET', jk, 'st', 'q')
    if not j[1] then return answer({ err = 'no_job' }) end
    if j[1] ~= 'failed' then return answer({ err = 'not_failed' }) end
    local q = j[2]
    local rev = draw()
    local ord = redis.call('INCR', K_JOB_TAIL)
    redis.call('HSET', jk, 'st', 'queued', 'ord', ord, 'rc', 0, 'rsn', '', 'upd', NOW)
    redis.call('ZREM', k_state(q, 'failed'), jid)
    redis.call('ZREM', K_FINISHED, jid)
    redis.call('ZADD', k_state(q, 'queued'), 0, jid)
    redis.call('ZADD', k_order(q), ord, jid)
    event({ kind = 'job_requeued', job = jid, queue = q })
    publish({ 'queue:' .. q })
    return answer({ revision = rev, queue = q })
end

local function job_record(jid, with_payload)
    local j = hash(k_job(jid))
    if not j then return nil end
    local r = { id = jid, queue = j.q, kind = j.k, idem = j.idem == '1', maxr = tonumber(j.maxr),
        rc = tonumber(j.rc), att = tonumber(j.att), ord = tonumber(j.ord), st = j.st,
        res = j.res, rsn = j.rsn, enq = tonumber(j.enq), upd = tonumber(j.upd) }
    if j.st == 'claimed' then
        r.cs = j.cs
        r.tok = tonumber(j.tok)
        r.ca = tonumber(j.ca)
    end
    if with_payload then r.payload = j.p end
    return r
end

function OPS.job()
    local r = job_record(ARGV[3], true)
    if not r then return answer({}) end
    return answer({ job = r })
end

local STATES = { 'queued', 'claimed', 'done', 'failed' }

local function counts(q)
    local c = {}
    for _, st in ipairs(STATES) do c[#c + 1] = redis.call('ZCARD', k_state(q, st)) end
    return c
end

function OPS.queue() return answer({ counts = counts(ARGV[3]) }) end

-- queue_jobs(queue, state, after, limit): up to limit+1 jobs in id order.
function OPS.queue_jobs()
    local q, st, after, limit = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
    local from = (after == '') and '-' or ('(' .. after)
    local ids = redis.call('ZRANGEBYLEX', k_state(q, st), from, '+', 'LIMIT', 0, limit + 1)
    local out = {}
    for _, id in ipairs(ids) do
        local r = job_record(id, false)
        if r then out[#out + 1] = r end
    end
    return answer({ page = out })
end

-- What the gauges show: live and unreaped sessions, locks, each pool's capacity and seats,
-- each queue's counts.
function OPS.stats()
    local pools = {}
    local flat = redis.call('HGETALL', K_POOLS)
    for i = 1, #flat, 2 do
        local p = cjson.decode(flat[i + 1])
        pools[#pools + 1] = { flat[i], p.cap, redis.call('HLEN', k_seats(flat[i])) }
    end
    local queues = {}
    for _, q in ipairs(redis.call('SMEMBERS', K_QUEUES)) do
        queues[#queues + 1] = { q, counts(q) }
    end
    return answer({ sessions = redis.call('ZCARD', K_DEADLINES),
        locks = redis.call('HLEN', K_LOCKS), pools = pools, queues = queues })
end

---------------------------------------------------------------------------------------
-- Audit log, reaper, retention

-- events(after, limit)
function OPS.events()
    local after, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
    local entries = redis.call('XRANGE', K_EVENTS, string.format('(%d-1', after), '+', 'COUNT',
        limit)
    local out = {}
    for _, entry in ipairs(entries) do
        local texts, first = entry_events(entry)
        for k, text in ipairs(texts) do
            if #out >= limit then break end
            if first + k - 1 > after then out[#out + 1] = text end
        end
    end
    return answer({ events = out })
end

-- Microseconds of Redis's real clock (never the pinned one) since `started`, a `TIME`
-- reading: how long a pass held Redis, so the node can size the next to its time budget.
local function since_us(started)
    local stopped = redis.call('TIME')
    return (tonumber(stopped[1]) - tonumber(started[1])) * 1000000 +
        tonumber(stopped[2]) - tonumber(started[2])
end

-- reap(batch, node, exclusive '1'|'0'): ends up to `batch` due sessions, earliest deadline
-- first. Exclusive (the background reaper): only while this node holds the reaper lock,
-- taken or kept here for `ARGV[6]` ms; another node's lock means `skipped`.
function OPS.reap()
    local batch, node, exclusive, ttl = tonumber(ARGV[3]), ARGV[4], ARGV[5] == '1',
        tonumber(ARGV[6])
    if exclusive then
        local holder = redis.call('GET', K_REAPER)
        if holder and holder ~= node then return answer({ skipped = true }) end
        redis.call('SET', K_REAPER, node, 'PX', ttl)
    end
    local started = redis.call('TIME')
    local due = redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', NOW, 'LIMIT', 0, batch)
    local acc = new_acc()
    if #due == 0 then return answer({ ended = ended(acc, 0), us = 0 }) end
    local rev = draw()
    for _, id in ipairs(due) do end_one(id, 'expired', acc) end
    local out = ended(acc, rev)
    -- The pass's events written inside the time measured.
    finish()
    return answer({ ended = out, us = since_us(started) })
end

-- next_due(): milliseconds until the earliest deadline (0 when one has passed), -1 with no
-- session.
function OPS.next_due()
    local first = redis.call('ZRANGE', K_DEADLINES, 0, 0, 'WITHSCORES')
    if #first == 0 then return answer({ ms = -1 }) end
    return answer({ ms = math.max(0, tonumber(first[2]) - NOW) })
end

-- Takes up to `n` entries off the front of `list` and, of those `gone(entry)` still says
-- are gone, off the sorted set `index`; returns how many it took off the list.
local function sweep_list(list, index, n, gone)
    local entries = redis.call('LPOP', list, n) or {}
    local off = {}
    for _, e in ipairs(entries) do
        if gone(e) then off[#off + 1] = e end
    end
    in_chunks('ZREM', index, off)
    return #entries
end

local function session_gone(id) return redis.call('EXISTS', k_session(id)) == 0 end
local function lock_gone(key) return redis.call('HEXISTS', K_LOCKS, key) == 0 end

-- sweep(batch): takes up to `batch` ended sessions and released locks off the listing
-- indexes (see `flush`), each only while it is still gone: an id or key used again since is
-- listed rightly. Says how many it took, how many wait, and whether a session is due, so
-- the node goes back to reaping first.
function OPS.sweep()
    local batch = tonumber(ARGV[3])
    local started = redis.call('TIME')
    local swept = sweep_list(K_STALE_S, K_SESSIONS, batch, session_gone)
    if swept < batch then
        swept = swept + sweep_list(K_STALE_L, K_LOCKIDX, batch - swept, lock_gone)
    end
    local due = #redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', NOW, 'LIMIT', 0, 1) > 0
    return answer({ swept = swept,
        left = redis.call('LLEN', K_STALE_S) + redis.call('LLEN', K_STALE_L), due = due,
        us = since_us(started) })
end

-- retention(job_retention_ms, job_batch, event_retention_ms, event_batch): purges
-- finished jobs past their retention and trims the oldest events past theirs, one bounded
-- batch each, from the start of the log: trimming never leaves a hole behind a cursor.
function OPS.retention()
    local job_ms, job_batch, ev_ms, ev_batch =
        tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
    local old = redis.call('ZRANGEBYSCORE', K_FINISHED, '-inf', '(' .. (NOW - job_ms), 'LIMIT', 0,
        job_batch)
    local purged = {}
    for _, jid in ipairs(old) do
        local j = redis.call('HMGET', k_job(jid), 'q', 'st')
        if j[1] then
            redis.call('ZREM', k_state(j[1], j[2]), jid)
            purged[#purged + 1] = j[1]
        end
        redis.call('DEL', k_job(jid))
        redis.call('ZREM', K_FINISHED, jid)
    end
    -- Read in small pages and stop at the first event inside its retention: a pass over a
    -- log with nothing to trim reads one event, not a whole batch.
    local trimmed, from, young = 0, '-', false
    while not young and trimmed < ev_batch do
        local entries = redis.call('XRANGE', K_EVENTS, from, '+', 'COUNT',
            math.min(256, ev_batch - trimmed))
        if #entries == 0 then break end
        local ids = {}
        for _, entry in ipairs(entries) do
            -- The events of one entry were written by one call, at one time.
            local texts = entry_events(entry)
            if cjson.decode(texts[1]).at >= NOW - ev_ms then
                young = true
                break
            end
            ids[#ids + 1] = entry[1]
            trimmed = trimmed + #texts
        end
        if #ids > 0 then redis.call('XDEL', K_EVENTS, unpack(ids)) end
        from = '(' .. entries[#entries][1]
    end
    return answer({ purged = #old, trimmed = trimmed })
end

local function due_session(id)
    local sk = k_session(id)
    local flat = redis.call('HGETALL', sk .. ':locks')
    local locks = {}
    for i = 1, #flat, 2 do locks[#locks + 1] = { flat[i], tonumber(flat[i + 1]) } end
    table.sort(locks, function(a, b) return a[2] < b[2] end)
    local seats = redis.call('HKEYS', sk .. ':seats')
    table.sort(seats)
    local ids = redis.call('SMEMBERS', sk .. ':jobs')
    table.sort(ids)
    local jobs = {}
    for _, jid in ipairs(ids) do
        local j = redis.call('HMGET', k_job(jid), 'idem', 'rc', 'maxr')
        jobs[#jobs + 1] = { jid, j[1] == '1', tonumber(j[2]), tonumber(j[3]) }
    end
    return { id = id, x = tonumber(redis.call('HGET', sk, 'x')), locks = locks, seats = seats,
        jobs = jobs }
end

-- dry_run(limit): what a reap now would end, changing nothing.
function OPS.dry_run()
    local due = redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', NOW, 'LIMIT', 0,
        tonumber(ARGV[3]))
    local out = {}
    for _, id in ipairs(due) do out[#out + 1] = due_session(id) end
    return answer({ due = out })
end

-- check(): every invariant of the stored state, in words.
function OPS.check()
    local problems = {}
    local function problem(text)
        if #problems < 1000 then problems[#problems + 1] = text end
    end
    local rev = revision()
    -- Ended sessions and released locks still in a listing index wait in these lists for
    -- the sweep; an index entry without its record is a problem only when it is not there.
    local pending_s, pending_l = {}, {}
    for _, id in ipairs(redis.call('LRANGE', K_STALE_S, 0, -1)) do pending_s[id] = true end
    for _, key in ipairs(redis.call('LRANGE', K_STALE_L, 0, -1)) do pending_l[key] = true end
    local ids = redis.call('ZRANGE', K_SESSIONS, 0, -1)
    local listed = 0
    for _, id in ipairs(ids) do
        local s = hash(k_session(id))
        if not s then
            if not pending_s[id] then
                problem('session ' .. id .. ' is listed but has no record')
            end
        else
            listed = listed + 1
            if tonumber(s.x) <= tonumber(s.c) then
                problem('session ' .. id .. ' expires before it was created')
            end
            if redis.call('ZSCORE', K_DEADLINES, id) ~= tostring(s.x) and
                tonumber(redis.call('ZSCORE', K_DEADLINES, id) or '-1') ~= tonumber(s.x) then
                problem('session ' .. id .. ' has a deadline that its record does not show')
            end
            local flat = redis.call('HGETALL', k_session(id) .. ':locks')
            for i = 1, #flat, 2 do
                local raw = redis.call('HGET', K_LOCKS, flat[i])
                if not raw or lock_record(raw).sid ~= id then
                    problem('session ' .. id .. ' lists lock ' .. flat[i] .. ' which it does not hold')
                end
            end
            flat = redis.call('HGETALL', k_session(id) .. ':seats')
            for i = 1, #flat, 2 do
                if redis.call('HEXISTS', k_seats(flat[i]), id) == 0 then
                    problem('session ' .. id .. ' lists a seat in ' .. flat[i] .. ' which it does not hold')
                end
            end
        end
    end
    if redis.call('ZCARD', K_DEADLINES) ~= listed then
        problem('the deadline set has ' .. redis.call('ZCARD', K_DEADLINES) ..
            ' sessions, the session index ' .. listed)
    end
    local locks = redis.call('HGETALL', K_LOCKS)
    for i = 1, #locks, 2 do
        local r = lock_record(locks[i + 1])
        if redis.call('EXISTS', k_session(r.sid)) == 0 then
            problem('lock ' .. locks[i] .. ' is held by session ' .. r.sid .. ' which does not exist')
        elseif tonumber(redis.call('HGET', k_session(r.sid) .. ':locks', locks[i]) or '-1') ~= r.token then
            problem('lock ' .. locks[i] .. ' is not listed by its holder ' .. r.sid)
        end
        if r.token > rev then
            problem('lock ' .. locks[i] .. ' has token ' .. r.token .. ' above the revision counter ' .. rev)
        end
        if not redis.call('ZSCORE', K_LOCKIDX, locks[i]) then
            problem('lock ' .. locks[i] .. ' is missing from the lock index')
        end
    end
    local indexed = 0
    for _, key in ipairs(redis.call('ZRANGE', K_LOCKIDX, 0, -1)) do
        if redis.call('HEXISTS', K_LOCKS, key) == 1 then
            indexed = indexed + 1
        elseif not pending_l[key] then
            problem('the lock index lists ' .. key .. ' which no one holds')
        end
    end
    if indexed ~= #locks / 2 then
        problem('the lock index has ' .. indexed .. ' keys, the lock table ' .. (#locks / 2))
    end
    local pools = redis.call('HGETALL', K_POOLS)
    for i = 1, #pools, 2 do
        local name, p = pools[i], cjson.decode(pools[i + 1])
        local seats = redis.call('HGETALL', k_seats(name))
        local since = 0
        for s = 1, #seats, 2 do
            local id, seat = seats[s], cjson.decode(seats[s + 1])
            if redis.call('EXISTS', k_session(id)) == 0 then
                problem('seat in ' .. name .. ' is held by session ' .. id .. ' which does not exist')
            end
            if seat.t > rev then
                problem('seat in ' .. name .. ' of ' .. id .. ' has token ' .. seat.t .. ' above the revision counter ' .. rev)
            end
            if seat.t > p.rev then since = since + 1 end
            if redis.call('SISMEMBER', k_active(name), id) == 0 or
                redis.call('HEXISTS', k_layout(name), id) == 0 then
                problem('seat in ' .. name .. ' of ' .. id .. ' is missing from the seat layout')
            end
        end
        if since > p.cap then
            problem('pool ' .. name .. ' granted ' .. since .. ' seats since its capacity was set to ' .. p.cap)
        end
        if redis.call('SCARD', k_active(name)) ~= #seats / 2 or
            redis.call('HLEN', k_layout(name)) ~= #seats / 2 then
            problem('the seat layout of ' .. name .. ' does not match its ' .. (#seats / 2) .. ' seats')
        end
    end
    local jobs = 0
    for _, q in ipairs(redis.call('SMEMBERS', K_QUEUES)) do
        for _, st in ipairs(STATES) do
            for _, jid in ipairs(redis.call('ZRANGE', k_state(q, st), 0, -1)) do
                jobs = jobs + 1
                local j = redis.call('HMGET', k_job(jid), 'st', 'cs', 'rc', 'maxr', 'tok')
                if j[1] ~= st then
                    problem('job ' .. jid .. ' is listed as ' .. st .. ' but is ' .. tostring(j[1]))
                elseif st == 'claimed' then
                    if redis.call('SISMEMBER', k_session(j[2]) .. ':jobs', jid) == 0 then
                        problem('job ' .. jid .. ' is claimed by session ' .. j[2] .. ' which does not exist or does not list it')
                    end
                    if tonumber(j[5]) > rev then
                        problem('job ' .. jid .. ' has token ' .. j[5] .. ' above the revision counter ' .. rev)
                    end
                elseif j[2] ~= '' then
                    problem('job ' .. jid .. ' is ' .. st .. ' but names a claiming session')
                end
                if j[3] and tonumber(j[3]) > tonumber(j[4]) then
                    problem('job ' .. jid .. ' was recovered more often than its cap')
                end
            end
        end
        if redis.call('ZCARD', k_order(q)) ~= redis.call('ZCARD', k_state(q, 'queued')) then
            problem('queue ' .. q .. ' orders ' .. redis.call('ZCARD', k_order(q)) .. ' jobs but lists ' .. redis.call('ZCARD', k_state(q, 'queued')) .. ' queued')
        end
    end
    local evseq = tonumber(redis.call('GET', K_EVSEQ) or '0')
    local last = redis.call('XREVRANGE', K_EVENTS, '+', '-', 'COUNT', 1)
    -- Events are numbered without gaps and trimmed only from the start, so the log holds
    -- those from its first entry's first event to its last entry's.
    local events = 0
    if #last > 0 then
        local seq = tonumber(string.match(last[1][1], '^(%d+)-'))
        if seq > evseq then
            problem('event ' .. seq .. ' is numbered above the event counter ' .. evseq)
        end
        local _, first = entry_events(redis.call('XRANGE', K_EVENTS, '-', '+', 'COUNT', 1)[1])
        events = seq - first + 1
    end
    return answer({ sessions = listed, locks = #locks / 2, events = events,
        revision = rev, jobs = jobs, problems = problems })
end

---------------------------------------------------------------------------------------
-- The one dispatch point: every operation runs through `run`.

-- Runs one operation: `args` is [namespace, op, its arguments...]. An operation that fails
-- fails alone: its error is its answer, and the event counter it moved is written back, so
-- the next event's number is still above every one in the log.
--
-- Safe retries (see `crate::backend::requests`): an operation called `{op}!rid` carries
-- four more arguments after its own: the request key, the call's fingerprint, the
-- retention in ms, and the answer fields (comma-separated) whose presence means it acted.
-- The record `{ns}:!rid:{key}` is read and written in this same call, so the check, the
-- change and the record are one atomic step; its expiry is judged on `NOW` and it is also
-- given a PX so Redis drops it. Failures are not recorded: they changed nothing.
-- Operations that read the audit log: in a batch, the events of the operations before
-- them are written first, so they read the log as it stands after those.
local READS_LOG = { events = true, retention = true, check = true }

-- Runs one operation. Its events wait in `evbuf` for `finish`, which the caller runs.
local function run(args)
    ARGV = args
    local op = args[2]
    -- >>> actor
    ACTOR = nil
    do
        local o, a = string.match(op, '^(%S+) (%S+)$')
        if o then op, ACTOR = o, a end
    end
    -- <<< actor
    local rid = nil
    local rid_op = string.match(op, '^(.-)!rid$')
    if rid_op then
        local n = #ARGV
        rid = { key = P .. '!rid:' .. ARGV[n - 3], fp = ARGV[n - 2], px = tonumber(ARGV[n - 1]),
            ok = ARGV[n] }
        op = rid_op
    end
    local f = OPS[op]
    if not f then return redis.error_reply('unknown operation ' .. tostring(op)) end
    if READS_LOG[op] then finish() end
    if rid then
        local stored = redis.call('GET', rid.key)
        if stored then
            local rec = cjson.decode(stored)
            if rec.at > NOW then
                if rec.fp ~= rid.fp then return answer({ err = 'request_id_reused' }) end
                return rec.out
            end
        end
    end
    local ok, out = pcall(f)
    if not ok then
        if type(out) == 'table' and out.err then return redis.error_reply(out.err) end
        return redis.error_reply(tostring(out))
    end
    if rid then
        local t = cjson.decode(out)
        for field in string.gmatch(rid.ok, '[^,]+') do
            if t[field] ~= nil then
                -- What the first call ended on the way, and what it did, was counted then: a
                -- replay says it is one, so it is not counted again.
                t.ended = nil
                t.replayed = true
                redis.call('SET', rid.key, cjson.encode({ fp = rid.fp, at = NOW + rid.px,
                    out = cjson.encode(t) }), 'PX', rid.px)
                break
            end
        end
    end
    return out
end

-- One operation's answer: what it returned, or what it raised as an error reply (the call
-- goes on, so its other operations and its `finish` still run).
local function answer_of(args)
    local ok, out = pcall(run, args)
    if ok then return out end
    return redis.error_reply(tostring(out))
end

-- A call is one operation, `[namespace, op, args...]`, or a batch of them sent together by
-- a node, `[namespace, '!batch', n, op, args..., n, op, args...]` (each `n` counting its op
-- and arguments), answered by a list of their answers in order. Every operation of a call
-- shares its clock reading.
local function dispatch(_, args)
    bind(args[1])
    NOW = now_ms()
    -- Written as text where stored: Lua would otherwise format the number afresh ('%.14g')
    -- at every command that takes it.
    NOW_S = string.format('%d', NOW)
    REV.n, REV.dirty, EVSEQ.n, EVSEQ.dirty = nil, false, nil, false
    evbuf, evn = {}, 0
    pubbuf, pubseen, pubany = {}, {}, false
    if args[2] ~= '!batch' then
        local out = answer_of(args)
        finish()
        return out
    end
    -- Each operation fails alone, and the events of every one that ran are written.
    local answers, i = {}, 3
    while i <= #args do
        local n = tonumber(args[i])
        local one = { args[1] }
        for j = 1, n do one[j + 1] = args[i + j] end
        answers[#answers + 1] = answer_of(one)
        i = i + n + 1
    end
    finish()
    return answers
end

redis.register_function(FUNCTION, dispatch)
