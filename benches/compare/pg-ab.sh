#!/usr/bin/env bash
# Leasehold on PostgreSQL, two builds, beside the raw PostgreSQL tables, in one run on one
# machine: for each workload (lock-churn, heartbeat, mass-expiry) the raw tables, then each
# `leasehold` binary serving `--backend postgres` on a fresh namespace of the same database,
# all driven by the same driver (`leasehold-compare`, as `run.sh` does). A fresh namespace per
# run, so no run inherits the dead rows or the audit log of another (the raw tables are
# recreated per run too). Prints one JSON line per run with "name", "binary" and "loadavg"
# (1, 5 and 15 minutes, as the run ends) fields, and for lock churn the CPU the
# database ("pg_cpu_us_per_op") and the node ("node_cpu_us_per_op") spent per pair (the
# heartbeat run opens its 100 000 sessions inside the measured process, so no such figure).
#
#   benches/compare/pg-ab.sh OLD_BINARY NEW_BINARY
#
# CLIENTS (64), SECONDS_PER_RUN (10), MASS_SESSIONS (100000), MASS_CLIENTS (8) and
# MASS_TTL_MS (3000) size the runs, as in run.sh; PG and PG_URL name the database; WORKLOADS
# (default "lock-churn heartbeat mass-expiry") picks some. POOL_SIZE (default: CLIENTS) is
# the servers' `--postgres-pool-size`: the raw tables get one connection per client, and with
# `synchronous_commit = on` throughput is the commits in flight over the time of a WAL flush,
# so a pool smaller than the clients measures the pool. Not part of CI: a run takes minutes.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/../lib.sh"
old="$(realpath "$1")"
new="$(realpath "$2")"
clients="${CLIENTS:-64}"
seconds="${SECONDS_PER_RUN:-10}"
mass_sessions="${MASS_SESSIONS:-100000}"
mass_clients="${MASS_CLIENTS:-8}"
mass_ttl_ms="${MASS_TTL_MS:-3000}"
pg="${PG:-host=127.0.0.1 user=postgres dbname=test}"
pg_url="${PG_URL:-postgres://postgres@127.0.0.1:5432/test}"
pool_size="${POOL_SIZE:-$clients}"
workloads="${WORKLOADS:-lock-churn heartbeat mass-expiry}"
port=7896
ns=bench_pg_ab
work="$(mktemp -d)"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; psql "$pg_url" -qc "DROP SCHEMA IF EXISTS $ns CASCADE" >/dev/null 2>&1; rm -rf "$work"' EXIT

# CARGO_TARGET_DIR, when set (for example to the product's own target directory), is where the
# driver is built: it compiles the product as a library, so sharing the product's build cache
# saves a second copy of it.
target="${CARGO_TARGET_DIR:-$here/target}"
(cd "$here" && CARGO_TARGET_DIR="$target" cargo build --release --quiet)
compare="$target/release/leasehold-compare"

start() {
    psql "$pg_url" -qc "DROP SCHEMA IF EXISTS $ns CASCADE" >/dev/null 2>&1
    "$1" serve --backend postgres --postgres-url "$pg_url" --namespace "$ns" \
        --postgres-pool-size "$pool_size" --listen "127.0.0.1:$port" --log-level warn \
        >"$work/server.log" 2>&1 &
    pid=$!
    wait_ready "$port" "$pid" "$work/server.log"
}
stop() {
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=""
}
# CPU seconds the PostgreSQL cluster has used: its live processes and the children its
# postmaster has reaped.
pg_cpu() {
    python3 - <<'PY'
import os
tck = os.sysconf("SC_CLK_TCK")
total = 0
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        if open(f"/proc/{p}/comm").read().strip() != "postgres":
            continue
        f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        total += int(f[11]) + int(f[12])
        if open(f"/proc/{f[1]}/comm").read().strip() != "postgres":
            total += int(f[13]) + int(f[14])
    except OSError:
        pass
print(total / tck)
PY
}
# CPU seconds of process $1.
proc_cpu() {
    python3 -c "import os,sys; f=open(f'/proc/{sys.argv[1]}/stat').read().rsplit(')',1)[1].split(); print((int(f[11])+int(f[12]))/os.sysconf('SC_CLK_TCK'))" "$1"
}
label() {
    # The load average as the run ends: on a shared machine it says how far to trust a ratio.
    # $3 and $4: the database's and the node's CPU seconds over the run (warm-up included),
    # reported per operation over the warm-up and the measured seconds alike.
    python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
r['name'], r['binary'] = sys.argv[1], sys.argv[2]
r['loadavg'] = open('/proc/loadavg').read().split()[:3]
ops = r.get('ops_per_s', 0) * (r.get('seconds', 0) + 2)
for field, cpu in (('pg_cpu_us_per_op', sys.argv[3]), ('node_cpu_us_per_op', sys.argv[4])):
    if cpu != '-' and ops > 0 and r.get('workload') == 'lock-churn':
        r[field] = round(float(cpu) / ops * 1e6, 1)
print(json.dumps(r))" "$1" "$2" "$3" "$4"
}
args() {
    case "$1" in
    mass-expiry) echo "$mass_clients $mass_sessions $mass_ttl_ms" ;;
    *) echo "$clients $seconds" ;;
    esac
}

for workload in $workloads; do
    echo "== $workload: raw PostgreSQL tables" >&2
    before="$(pg_cpu)"
    # shellcheck disable=SC2046
    out="$("$compare" "postgres=$pg" "$workload" $(args "$workload"))"
    label "PostgreSQL" "-" "$(python3 -c "print($(pg_cpu) - $before)")" "-" <<<"$out"
    for which in old new; do
        bin="$old"
        [ "$which" = new ] && bin="$new"
        echo "== $workload: Leasehold on PostgreSQL, $which" >&2
        start "$bin"
        before="$(pg_cpu)"
        node_before="$(proc_cpu "$pid")"
        # shellcheck disable=SC2046
        out="$("$compare" "leasehold=http://127.0.0.1:$port" "$workload" $(args "$workload"))"
        label "Leasehold on PostgreSQL" "$which" "$(python3 -c "print($(pg_cpu) - $before)")" \
            "$(python3 -c "print($(proc_cpu "$pid") - $node_before)")" <<<"$out"
        stop
    done
done
