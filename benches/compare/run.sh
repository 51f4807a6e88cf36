#!/usr/bin/env bash
# Side by side, in one run on one machine: Leasehold (release build, default settings: every
# acknowledged write fsynced), Leasehold on PostgreSQL (`--backend postgres`, the same
# database as the raw tables, its own schema), Leasehold on Redis (`--backend redis` on a Redis
# of its own with appendfsync always, like the raw one), Redis with appendfsync always, Redis with its default
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
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; redis-cli -p 6390 shutdown nosave >/dev/null 2>&1 || true; redis-cli -p 6391 shutdown nosave >/dev/null 2>&1 || true; redis-cli -p 6392 shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

(cd "$root" && cargo build --release --quiet)
(cd "$here" && cargo build --release --quiet)
compare="$here/target/release/leasehold-compare"

"$root/target/release/leasehold" serve --data-dir "$work/leasehold" --listen 127.0.0.1:7890 \
    --log-level warn >"$work/leasehold.log" 2>&1 &
mkdir -p "$work/redis-always" "$work/redis-default"
redis-server --port 6390 --bind 127.0.0.1 --dir "$work/redis-always" --appendonly yes \
    --appendfsync always --save "" --daemonize yes --logfile "$work/redis-always.log"
redis-server --port 6391 --bind 127.0.0.1 --dir "$work/redis-default" --daemonize yes \
    --logfile "$work/redis-default.log"
pg_url="${PG_URL:-postgres://postgres@127.0.0.1:5432/test}"
psql "$pg_url" -qc "DROP SCHEMA IF EXISTS bench_compare CASCADE" >/dev/null
"$root/target/release/leasehold" serve --backend postgres --postgres-url "$pg_url" \
    --namespace bench_compare --listen 127.0.0.1:7892 --log-level warn \
    >"$work/leasehold-pg.log" 2>&1 &
# Leasehold on Redis: a Redis of its own, persisted exactly as the raw "appendfsync always" one.
start_leasehold_on_redis() {
    mkdir -p "$work/redis-leasehold"
    redis-server --port 6392 --bind 127.0.0.1 --dir "$work/redis-leasehold" --appendonly yes \
        --appendfsync always --save "" --daemonize yes --logfile "$work/redis-leasehold.log"
    for _ in $(seq 1 100); do redis-cli -p 6392 ping >/dev/null 2>&1 && break; sleep 0.1; done
    "$root/target/release/leasehold" serve --backend redis --redis-url redis://127.0.0.1:6392/0 \
        --namespace bench_compare --listen 127.0.0.1:7893 --log-level warn \
        >"$work/leasehold-redis.log" 2>&1 &
    for _ in $(seq 1 100); do curl -fsS http://127.0.0.1:7893/readyz >/dev/null 2>&1 && break; sleep 0.1; done
}
start_leasehold_on_redis
for _ in $(seq 1 100); do
    curl -fsS http://127.0.0.1:7892/readyz >/dev/null 2>&1 && curl -fsS http://127.0.0.1:7890/readyz >/dev/null 2>&1 && break
    sleep 0.1
done

targets=(
    "leasehold=http://127.0.0.1:7890"
    "leasehold=http://127.0.0.1:7892"
    "leasehold=http://127.0.0.1:7893"
    "redis=redis://127.0.0.1:6390"
    "redis=redis://127.0.0.1:6391"
    "postgres=$pg"
)
names=("Leasehold" "Leasehold on PostgreSQL" "Leasehold on Redis (AOF always)" "Redis, appendfsync always" "Redis, default persistence" "PostgreSQL")
out="$work/results.jsonl"
named() {
    python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['name']=sys.argv[1]; print(json.dumps(r))" "$1" >>"$out"
}
for workload in lock-churn heartbeat; do
    for i in "${!targets[@]}"; do
        echo "== $workload: ${names[$i]}" >&2
        "$compare" "${targets[$i]}" "$workload" "$clients" "$seconds" | named "${names[$i]}"
    done
done
for i in "${!targets[@]}"; do
    echo "== mass-expiry: ${names[$i]}" >&2
    "$compare" "${targets[$i]}" mass-expiry "$mass_clients" "$mass_sessions" "$mass_ttl_ms" |
        named "${names[$i]}"
done

python3 - "$out" "$root/docs/benchmarks-compare.md" "$clients" "$seconds" "$mass_clients" "$mass_ttl_ms" <<'PY'
import json, platform, subprocess, sys, datetime
rows = [json.loads(l) for l in open(sys.argv[1])]
out, clients, seconds, mass_clients, mass_ttl_ms = sys.argv[2:7]
mass = [r for r in rows if r["workload"] == "mass-expiry"]
mass_sessions = mass[0]["sessions"]
cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
lines = [
    "# Leasehold beside Redis and PostgreSQL",
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
    "- **heartbeat**: 100 000 live sessions heartbeated round-robin. Redis: `PEXPIRE`.",
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
for workload in ["lock-churn", "heartbeat"]:
    rs = [r for r in rows if r["workload"] == workload]
    base = next(r for r in rs if r["name"] == "Leasehold")
    lines += [f"## {workload}", "", "| system | ops/s | p50 | p99 | p99.9 | errors | Leasehold ÷ it |", "|---|---|---|---|---|---|---|"]
    for r in rs:
        ratio = base["ops_per_s"] / r["ops_per_s"] if r["ops_per_s"] else float("nan")
        lines.append(
            f"| {r['name']} | {r['ops_per_s']:,.0f} | {r['p50_us']/1000:.2f} ms | {r['p99_us']/1000:.2f} ms "
            f"| {r['p999_us']/1000:.2f} ms | {r['errors']} | {ratio:.2f}× |"
        )
    on_pg = next((r for r in rs if r["name"] == "Leasehold on PostgreSQL"), None)
    raw_pg = next((r for r in rs if r["name"] == "PostgreSQL"), None)
    if on_pg and raw_pg and raw_pg["ops_per_s"]:
        lines += ["", f"Leasehold on PostgreSQL ÷ the raw PostgreSQL tables: {on_pg['ops_per_s'] / raw_pg['ops_per_s']:.2f}× the throughput."]
    on_redis = next((r for r in rs if r["name"] == "Leasehold on Redis (AOF always)"), None)
    raw_redis = next((r for r in rs if r["name"] == "Redis, appendfsync always"), None)
    if on_redis and raw_redis and raw_redis["ops_per_s"]:
        lines += ["", f"Leasehold on Redis (AOF always) ÷ the raw Redis scripts (appendfsync always): {on_redis['ops_per_s'] / raw_redis['ops_per_s']:.2f}× the throughput."]
    lines.append("")
base = next(r for r in mass if r["name"] == "Leasehold")
lines += [
    "## mass-expiry",
    "",
    "Leasehold ÷ it: the system's time to all free over Leasehold's, so above 1 means Leasehold",
    "frees the locks sooner.",
    "",
    "| system | sessions | all free after the deadline | live p99 before | live p99 during | Leasehold ÷ it |",
    "|---|---|---|---|---|---|",
]
for r in mass:
    ratio = max(r["free_after_ms"], 1) / max(base["free_after_ms"], 1)
    lines.append(
        f"| {r['name']} | {r['sessions']:,} | {r['free_after_ms']:,} ms | {r['baseline_p99_us']/1000:.2f} ms "
        f"| {r['storm_p99_us']/1000:.2f} ms | {ratio:.2f}× |"
    )
lines.append("")
on_pg = next((r for r in mass if r["name"] == "Leasehold on PostgreSQL"), None)
raw_pg = next((r for r in mass if r["name"] == "PostgreSQL"), None)
if on_pg and raw_pg:
    lines.append(
        f"- Leasehold on PostgreSQL took {max(on_pg['free_after_ms'], 1) / max(raw_pg['free_after_ms'], 1):.2f}× "
        "as long as the raw batched cascading `DELETE` to free every lock."
    )
on_redis = next((r for r in mass if r["name"] == "Leasehold on Redis (AOF always)"), None)
raw_redis = next((r for r in mass if r["name"] == "Redis, appendfsync always"), None)
if on_redis and raw_redis:
    lines.append(
        f"- Leasehold on Redis (AOF always) freed every lock in {on_redis['free_after_ms']:,} ms, the raw Redis "
        f"cleaner in {raw_redis['free_after_ms']:,} ms: {max(raw_redis['free_after_ms'], 1) / max(on_redis['free_after_ms'], 1):.2f}× as fast."
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
