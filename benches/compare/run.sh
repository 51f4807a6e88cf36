#!/usr/bin/env bash
# Side by side, in one run on one machine: Leasehold (release build, default settings: every
# acknowledged write fsynced), Leasehold on PostgreSQL (`--backend postgres`, the same
# database as the raw tables, its own schema), Leasehold on Redis (`--backend redis` on a Redis
# of its own with appendfsync always), Redis with appendfsync always, Redis with its default
# persistence, PostgreSQL (the session and lock tables, synchronous_commit on) and etcd. Same
# driver, same clients (64; 8 live ones for mass-expiry), same workloads. Writes
# docs/benchmarks-compare.md (through report.py) and keeps the JSON lines in $RESULTS
# (default target/compare-results.jsonl).
#
# Needs: redis-server on the PATH, PostgreSQL at $PG (default: host=127.0.0.1 user=postgres
# dbname=test); installs Debian's etcd-server when etcd is missing. Takes a few minutes; not
# part of CI.
#
# CLIENTS and SECONDS_PER_RUN set lock-churn, session-churn and heartbeat; MASS_SESSIONS (dying
# sessions), MASS_CLIENTS (live clients, which also open Leasehold's sessions) and MASS_TTL_MS
# set mass-expiry. PIN=1 pins servers and driver (below); WORKLOADS, TARGETS and MASS_TARGETS
# pick what runs (MASS_TARGETS= with nothing skips mass-expiry). Leasehold on Redis against the
# raw Redis scripts, 100 000 sessions in the mass expiry:
#   TARGETS="leasehold_redis redis_always" WORKLOADS="lock-churn heartbeat" REPORT=0 \
#       benches/compare/run.sh
# BUILD=0 skips the two release builds and runs the binaries as they are. The target
# leasehold_redis_old runs the binary OLD_LEASEHOLD (an earlier build) the same way, so
# TARGETS="leasehold_redis_old leasehold_redis redis_always" compares old, new and raw.
set -euo pipefail
# A relative CARGO_TARGET_DIR means the caller's directory: the builds below run in two others.
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
    export CARGO_TARGET_DIR="$(realpath -m "$CARGO_TARGET_DIR")"
fi
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
    redis-cli -p 6392 shutdown nosave >/dev/null 2>&1 || true
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

# Leasehold on a Redis of its own, crash-durable like the raw one (AOF, appendfsync always).
# Leasehold on Redis from the binary $1, named $2 in the tables.
leasehold_on_redis() {
    mkdir -p "$work/redis-leasehold"
    $server_cpu redis-server --port 6392 --bind 127.0.0.1 --dir "$work/redis-leasehold" \
        --appendonly yes --appendfsync always --save "" --daemonize yes \
        --logfile "$work/redis-leasehold.log"
    for _ in $(seq 1 100); do redis-cli -p 6392 ping >/dev/null 2>&1 && break; sleep 0.1; done
    $server_cpu "$1" serve --backend redis \
        --redis-url redis://127.0.0.1:6392/0 --namespace bench_compare --listen 127.0.0.1:7893 \
        --log-level warn >"$work/leasehold-redis.log" 2>&1 &
    server_pid=$!
    pids+=("$server_pid")
    ready http://127.0.0.1:7893/readyz
    target="leasehold=http://127.0.0.1:7893"
    label="$2"
}
target_leasehold_redis() {
    leasehold_on_redis "$root/target/release/leasehold" "Leasehold on Redis (AOF always)"
}
# The same from an earlier build, OLD_LEASEHOLD (a path), for old against new in one run.
target_leasehold_redis_old() {
    leasehold_on_redis "${OLD_LEASEHOLD:?OLD_LEASEHOLD names the earlier binary}" \
        "Leasehold on Redis (AOF always), earlier build"
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
    case "$label" in
    "Leasehold on Redis"*) redis-cli -p 6392 shutdown nosave >/dev/null 2>&1 ;;
    esac
    true
    [ "$label" = PostgreSQL ] && [ "$pin" = 1 ] && unpin_postgres
    rm -rf "$work/leasehold" "$work/etcd" "$work/redis-always" "$work/redis-default" \
        "$work/redis-leasehold"
}

TARGETS="${TARGETS:-leasehold leasehold_pg leasehold_redis redis_always redis_default postgres etcd}"

# BUILD=0 runs the binaries already built (the release server and the driver) as they are.
if [ "${BUILD:-1}" = 1 ]; then
    (cd "$root" && cargo build --release --quiet)
    (cd "$here" && cargo build --release --quiet)
fi
# CARGO_TARGET_DIR (e.g. the product's own target/) builds the driver beside the product.
compare="${CARGO_TARGET_DIR:-$here/target}/release/leasehold-compare"
# Each run's line is appended at once, so what a run measured survives a later failure.
out="${RESULTS:-$root/target/compare-results.jsonl}"
: >"$out"
export PGOPTIONS="${PGOPTIONS:---client-min-messages=warning}"

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
for t in ${MASS_TARGETS-${TARGETS// etcd/}}; do
    run_one "$t" mass-expiry "$mass_clients" "$mass_sessions" "$mass_ttl_ms"
done

# REPORT=0 keeps the comparison page as it is (a run of a few targets only leaves its lines).
[ "${REPORT:-1}" = 0 ] && exit 0
python3 "$here/report.py" "$out" "$root/docs/benchmarks-compare.md" "$clients" "$seconds" \
    "$mass_clients" "$mass_ttl_ms" "$mass_sessions"
