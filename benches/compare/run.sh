#!/usr/bin/env bash
# Side by side, in one run on one machine: Leasehold (release build, default settings: every
# acknowledged write fsynced), Leasehold on PostgreSQL (`--backend postgres`, the same
# database as the raw tables, its own schema), Redis with appendfsync always, Redis with its default
# persistence, and PostgreSQL (the session and lock tables, synchronous_commit on). Same
# driver, same clients (64; 8 live ones for mass-expiry), same workloads. Writes
# docs/benchmarks-compare.md.
#
# Needs: redis-server on the PATH, PostgreSQL at $PG (default: host=127.0.0.1 user=postgres
# dbname=test). Takes a few minutes; not part of CI.
#
# CLIENTS and SECONDS_PER_RUN set lock-churn and heartbeat; MASS_SESSIONS (dying sessions),
# MASS_CLIENTS (live clients, which also open Leasehold's sessions) and MASS_TTL_MS set
# mass-expiry.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
clients="${CLIENTS:-64}"
seconds="${SECONDS_PER_RUN:-10}"
mass_sessions="${MASS_SESSIONS:-100000}"
mass_clients="${MASS_CLIENTS:-8}"
mass_ttl_ms="${MASS_TTL_MS:-3000}"
pg="${PG:-host=127.0.0.1 user=postgres dbname=test}"
pg_url="${PG_URL:-postgres://postgres@127.0.0.1:5432/test}"
# PIN=1: every server on core 0 (`taskset -c 0`), the driver on core 1, so that neither
# steals the other's core and server CPU per operation is measured alone. PIN=0 (default):
# everything shares every core, as on a small machine in service.
pin="${PIN:-0}"
workloads="${WORKLOADS:-lock-churn session-churn heartbeat}"
work="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    redis-cli -p 6390 shutdown nosave >/dev/null 2>&1 || true
    redis-cli -p 6391 shutdown nosave >/dev/null 2>&1 || true
    [ "$pin" = 1 ] && unpin_postgres
    rm -rf "$work"
}
trap cleanup EXIT

server_cpu=""
driver_cpu=""
if [ "$pin" = 1 ]; then
    server_cpu="taskset -c 0"
    driver_cpu="taskset -c 1"
fi

# Each target is a function that starts its server (when the script owns it) and sets
# `target` (the driver's address), `server_pid` (the process whose CPU is counted, or empty)
# and `label` (its name in the tables). `stop_all` stops what the targets started.

ready() {
    for _ in $(seq 1 200); do
        curl -fsS "$1" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "not ready: $1" >&2
    exit 1
}

target_leasehold() {
    $server_cpu "$root/target/release/leasehold" serve --data-dir "$work/leasehold" \
        --listen 127.0.0.1:7890 --log-level warn >"$work/leasehold.log" 2>&1 &
    server_pid=$!
    pids+=("$server_pid")
    ready http://127.0.0.1:7890/readyz
    target="leasehold=http://127.0.0.1:7890"
    label="Leasehold"
}

target_leasehold_pg() {
    psql "$pg_url" -qc "DROP SCHEMA IF EXISTS bench_compare CASCADE" >/dev/null
    # As many connections as the raw tables' driver opens (one per client): under synchronous
    # commit throughput is the commits in flight over a WAL flush's time.
    $server_cpu "$root/target/release/leasehold" serve --backend postgres --postgres-url "$pg_url" \
        --namespace bench_compare --postgres-pool-size "$clients" --listen 127.0.0.1:7892 --log-level warn \
        >"$work/leasehold-pg.log" 2>&1 &
    server_pid=$!
    pids+=("$server_pid")
    ready http://127.0.0.1:7892/readyz
    target="leasehold=http://127.0.0.1:7892"
    label="Leasehold on PostgreSQL"
}

redis_pid() {
    redis-cli -p "$1" info server | sed -n 's/^process_id:\([0-9]*\).*/\1/p'
}

target_redis_always() {
    mkdir -p "$work/redis-always"
    $server_cpu redis-server --port 6390 --bind 127.0.0.1 --dir "$work/redis-always" \
        --appendonly yes --appendfsync always --save "" --daemonize yes \
        --logfile "$work/redis-always.log"
    sleep 0.3
    server_pid="$(redis_pid 6390)"
    target="redis=redis://127.0.0.1:6390"
    label="Redis, appendfsync always"
}

target_redis_default() {
    mkdir -p "$work/redis-default"
    $server_cpu redis-server --port 6391 --bind 127.0.0.1 --dir "$work/redis-default" \
        --daemonize yes --logfile "$work/redis-default.log"
    sleep 0.3
    server_pid="$(redis_pid 6391)"
    target="redis=redis://127.0.0.1:6391"
    label="Redis, default persistence"
}

# PostgreSQL is the machine's own server: pinned by moving its processes (and so the
# backends it forks) to core 0 for the run, and back afterwards. Its CPU is spread over a
# backend per connection, so no single process stands for it: not counted.
postgres_pids() {
    pgrep -x postgres || pgrep -f 'postgres:' || true
}
pin_postgres() {
    for p in $(postgres_pids); do taskset -a -p -c 0 "$p" >/dev/null 2>&1 || true; done
}
unpin_postgres() {
    for p in $(postgres_pids); do
        taskset -a -p -c "0-$(($(nproc) - 1))" "$p" >/dev/null 2>&1 || true
    done
}

target_postgres() {
    [ "$pin" = 1 ] && pin_postgres
    server_pid=""
    target="postgres=$pg"
    label="PostgreSQL"
}

# etcd from Debian's `etcd-server` package, one member, its data on the same disk; the
# driver speaks to its JSON gateway (the v3 API over HTTP/1.1: leases and transactions).
target_etcd() {
    if ! command -v etcd >/dev/null; then
        apt-get install -y etcd-server >/dev/null
    fi
    $server_cpu etcd --name compare --data-dir "$work/etcd" \
        --listen-client-urls http://127.0.0.1:2391 --advertise-client-urls http://127.0.0.1:2391 \
        --listen-peer-urls http://127.0.0.1:2392 --initial-advertise-peer-urls http://127.0.0.1:2392 \
        --initial-cluster compare=http://127.0.0.1:2392 --log-level error \
        >"$work/etcd.log" 2>&1 &
    server_pid=$!
    pids+=("$server_pid")
    ready http://127.0.0.1:2391/health
    target="etcd=http://127.0.0.1:2391"
    label="etcd"
}

stop_target() {
    if [ -n "${server_pid:-}" ]; then
        case "$label" in
        Redis*) redis-cli -p "${target##*:}" shutdown nosave >/dev/null 2>&1 || true ;;
        PostgreSQL) ;;
        *) kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true ;;
        esac
    fi
    [ "$label" = PostgreSQL ] && [ "$pin" = 1 ] && unpin_postgres
    rm -rf "$work/leasehold" "$work/etcd" "$work/redis-always" "$work/redis-default"
}

TARGETS="${TARGETS:-leasehold leasehold_pg redis_always redis_default postgres etcd}"

(cd "$root" && cargo build --release --quiet)
(cd "$here" && cargo build --release --quiet)
compare="$here/target/release/leasehold-compare"
out="$work/results.jsonl"

# One fresh server per target and workload, so no run inherits another's data.
run_one() {
    local t="$1" workload="$2"
    shift 2
    "target_$t"
    echo "== $workload: $label" >&2
    COMPARE_SERVER_PID="$server_pid" $driver_cpu "$compare" "$target" "$workload" "$@" |
        python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['name']=sys.argv[1]; r['pinned']=sys.argv[2]=='1'; print(json.dumps(r))" "$label" "$pin" >>"$out"
    stop_target
}
for workload in $workloads; do
    for t in $TARGETS; do
        run_one "$t" "$workload" "$clients" "$seconds"
    done
done
# etcd is left out of mass-expiry: the driver has no storm for it yet.
for t in ${MASS_TARGETS:-${TARGETS// etcd/}}; do
    run_one "$t" mass-expiry "$mass_clients" "$mass_sessions" "$mass_ttl_ms"
done
cp "$out" "${RESULTS:-$root/target/compare-results.jsonl}"

python3 - "$out" "$root/docs/benchmarks-compare.md" "$clients" "$seconds" "$mass_clients" "$mass_ttl_ms" <<'PY'
import json, platform, subprocess, sys, datetime
rows = [json.loads(l) for l in open(sys.argv[1])]
out, clients, seconds, mass_clients, mass_ttl_ms = sys.argv[2:7]
mass = [r for r in rows if r["workload"] == "mass-expiry"]
mass_sessions = mass[0]["sessions"]
cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
lines = [
    "# Leasehold beside Redis, PostgreSQL and etcd",
    "",
    f"Generated by `benches/compare/run.sh` on {datetime.date.today()}: lock-churn and heartbeat with",
    f"{clients} clients, {seconds} s measured after 2 s of warm-up; mass-expiry as described below;",
    f"client and servers on the same machine ({cpu}, "
    f"{subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores, Linux {platform.release()}).",
    "Every figure below comes from that one run; compare ratios, not absolutes.",
    "",
    "- **lock-churn**: each client holds a session and loops acquire (a key of 10 000) + release;",
    "  the unit is a pair, latency is the acquire's. Redis: a Lua script checks the session key,",
    "  `INCR`s the token and sets the lock; release compares holder and token, then deletes.",
    "  PostgreSQL: `INSERT … ON CONFLICT DO NOTHING RETURNING token` (token from a sequence, the",
    "  session by foreign key with `ON DELETE CASCADE`), release `DELETE … WHERE` holder and token.",
    "- **session-churn**: each client opens a session, heartbeats it three times and closes it;",
    "  the unit is the five requests, latency each request's. Redis: `SET … NX PX`, three",
    "  `PEXPIRE`, `DEL`. PostgreSQL: `INSERT`, three conditional `UPDATE`s, `DELETE`. etcd: lease",
    "  grant, three keep-alives, revoke.",
    "- **heartbeat**: 100 000 live sessions heartbeated round-robin. Redis: `PEXPIRE`.",
    "  etcd: a lease keep-alive (`/v3/lease/keepalive`). etcd's lock-churn: a transaction that",
    "  puts the key with the client's lease if its create revision is 0 (the revision is the",
    "  token), and one that deletes it if its create revision is still the token.",
    "  PostgreSQL: the conditional `UPDATE lock_session SET expires_at = … WHERE … AND expires_at > now()`.",
    f"- **mass-expiry**: {mass_sessions:,} sessions, each holding one lock on its own key, are given",
    f"  deadlines at one instant (at least {int(mass_ttl_ms):,} ms ahead, once all are open) and never",
    "  heartbeated again. The figure is the time from the last deadline until every one of those",
    "  locks is observed free through the system's own client API, polled every 2 ms; meanwhile",
    f"  {mass_clients} live clients run lock-churn on other keys, and their acquire p99 before the",
    "  deadline is set against the one during the storm (deadline to all free). The reaper or",
    "  cleaner runs throughout, so its steady-state cost is in the \"before\" figure too.",
    "  Leasehold: `leasehold bench --workload mass-expiry` (the server's own reaper with its",
    "  default settings: passes sized to hold the writer about `reaper_pass_ms` = 2 ms each;",
    "  each deadline set by one heartbeat, so they spread over a few ms; polled with",
    "  `GET /v1/locks?prefix=…&limit=1`).",
    "  Redis: sessions are keys given one `PEXPIREAT` each; a lock is a key holding",
    "  `session:token` with no TTL, so it outlives its session until a cleaner deletes it. The",
    "  cleaner, a task of the driver on its own connection standing in for a reaper process, makes",
    "  passes over the whole keyspace: `SCAN` with `MATCH cmp:lock:*` and `COUNT 1000`; for each",
    "  batch one `MGET` reads the holders, pipelined `EXISTS` check their session keys (an expired",
    "  key counts as gone even before Redis evicts it), and every lock whose session is gone is",
    "  deleted by a pipelined Lua compare-and-delete (still that holder, session still absent).",
    "  Passes run back to back while they delete something, then it sleeps 50 ms. Polled with",
    "  multi-key `EXISTS` over the dying lock keys, 1 000 a command, in one pipeline.",
    "  PostgreSQL: the tables filled by multi-row `INSERT … SELECT … FROM unnest(…)` and analyzed,",
    "  then one `UPDATE` sets every deadline. A reaper task on its own connection repeats",
    "  `DELETE FROM lock_session WHERE session_id IN (SELECT session_id FROM lock_session WHERE",
    "  expires_at < now() LIMIT 10000)` (the locks go by the cascade), each its own transaction,",
    "  until one deletes nothing, then sleeps 50 ms. Polled with",
    "  `SELECT count(*) FROM lock_entry WHERE lock_key LIKE 'cmp/mx/%'`.",
    "",
]
def cpu(r, field):
    v = r.get(field)
    return "—" if v is None else f"{v:,.1f} µs"
pinned = all(r.get("pinned") for r in rows)
lines += [
    "Placement: " + ("pinned — each server on core 0 (`taskset -c 0`), the driver on core 1." if pinned
                    else "unpinned — servers and driver share every core."),
    "Server CPU per operation is the server process's user + system time (`/proc/PID/stat`) over",
    "the measured window divided by the operations in it (for PostgreSQL, whose work is spread",
    "over a backend process per connection, it is not counted); driver CPU likewise for the",
    "driver itself.",
    "",
]
for workload in [w for w in ["lock-churn", "session-churn", "heartbeat"] if any(r["workload"] == w for r in rows)]:
    rs = [r for r in rows if r["workload"] == workload]
    base = next(r for r in rs if r["name"] == "Leasehold")
    lines += [f"## {workload}", "", "| system | ops/s | p50 | p99 | p99.9 | errors | server CPU/op | driver CPU/op | Leasehold ÷ it |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        ratio = base["ops_per_s"] / r["ops_per_s"] if r["ops_per_s"] else float("nan")
        lines.append(
            f"| {r['name']} | {r['ops_per_s']:,.0f} | {r['p50_us']/1000:.2f} ms | {r['p99_us']/1000:.2f} ms "
            f"| {r['p999_us']/1000:.2f} ms | {r['errors']} | {cpu(r, 'server_cpu_us_per_op')} | {cpu(r, 'driver_cpu_us_per_op')} | {ratio:.2f}× |"
        )
    on_pg = next((r for r in rs if r["name"] == "Leasehold on PostgreSQL"), None)
    raw_pg = next((r for r in rs if r["name"] == "PostgreSQL"), None)
    if on_pg and raw_pg and raw_pg["ops_per_s"]:
        lines += ["", f"Leasehold on PostgreSQL ÷ the raw PostgreSQL tables: {on_pg['ops_per_s'] / raw_pg['ops_per_s']:.2f}× the throughput."]
    lines.append("")
base = next(r for r in mass if r["name"] == "Leasehold")
lines += [
    "## mass-expiry",
    "",
    "Leasehold ÷ it: the system's time to all free over Leasehold's, so above 1 means Leasehold",
    "frees the locks sooner.",
    "",
    "Server CPU per ended session: the server's CPU from the first deadline to all free, over the",
    "dying sessions (it includes the live clients' churn and the polling meanwhile).",
    "",
    "| system | sessions | all free after the deadline | live p99 before | live p99 during | server CPU / ended session | Leasehold ÷ it |",
    "|---|---|---|---|---|---|---|",
]
for r in mass:
    ratio = max(r["free_after_ms"], 1) / max(base["free_after_ms"], 1)
    lines.append(
        f"| {r['name']} | {r['sessions']:,} | {r['free_after_ms']:,} ms | {r['baseline_p99_us']/1000:.2f} ms "
        f"| {r['storm_p99_us']/1000:.2f} ms | {cpu(r, 'server_cpu_us_per_op')} | {ratio:.2f}× |"
    )
lines.append("")
on_pg = next((r for r in mass if r["name"] == "Leasehold on PostgreSQL"), None)
raw_pg = next((r for r in mass if r["name"] == "PostgreSQL"), None)
if on_pg and raw_pg:
    lines.append(
        f"- Leasehold on PostgreSQL took {max(on_pg['free_after_ms'], 1) / max(raw_pg['free_after_ms'], 1):.2f}× "
        "as long as the raw batched cascading `DELETE` to free every lock."
    )
lines.append(f"- Leasehold's deadlines spread over {base['deadline_spread_ms']} ms; the peers' fall on one instant.")
for r in mass:
    if "cleaner_passes" in r:
        lines.append(
            f"- {r['name']}: the cleaner made {r['cleaner_passes']:,} passes, {r['cleaner_pass_ms']:,} ms each on average, "
            f"and deleted {r['cleaner_deleted']:,} locks."
        )
    if "reaper_rounds" in r:
        lines.append(
            f"- {r['name']}: the reaper deleted {r['reaper_deleted']:,} sessions; "
            f"rounds that deleted some: {r['reaper_rounds']}."
        )
lines.append("")
lines += [
    "Durability differs: Leasehold fsyncs every acknowledged grant and release (heartbeats are",
    "memory-only by design, with a restart grace); Leasehold on PostgreSQL commits every",
    "operation, heartbeats included, to the database (`synchronous_commit = on`); Redis with `appendfsync always` fsyncs every",
    "write, with its default persistence it snapshots now and then and loses recent writes on a",
    "crash; PostgreSQL with `synchronous_commit = on` fsyncs (group-committed) every transaction.",
    "",
]
open(out, "w").write("\n".join(lines))
print(open(out).read())
PY
