#!/usr/bin/env bash
# Old against new, in one run on one machine: starts each `leasehold` binary in turn on a fresh
# data directory (embedded backend, default settings) and drives it with the same load
# generator (`leasehold bench` of the NEW binary) through the same workloads, alternating
# old, new, old, new so that drift of the machine falls on both. Prints one JSON line per run
# with a "binary" field.
#
#   benches/ab.sh OLD_BINARY NEW_BINARY [ROUNDS]
#
# SECONDS_PER_RUN (default 10), CLIENTS (64), HEARTBEAT_SESSIONS (100000) and MASS_SESSIONS
# (100000) size the runs; WORKLOADS (default "lock-churn session-churn heartbeat mass-expiry")
# picks them. LOG_LEVEL (default warn; the shipped default is info) is the servers' log level.
# PIN=1 puts the server on core 0 and the driver on core 1. Each line carries the
# server's CPU per operation (`server_cpu_us_per_op`, split into `server_user_us_per_op` and
# `server_system_us_per_op`; for mass-expiry, per dying session from the first deadline to all
# free) and the driver's. Not part of CI: a full run takes several
# minutes.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
old="$(realpath "$1")"
new="$(realpath "$2")"
rounds="${3:-2}"
seconds="${SECONDS_PER_RUN:-10}"
clients="${CLIENTS:-64}"
hb_sessions="${HEARTBEAT_SESSIONS:-100000}"
mass_sessions="${MASS_SESSIONS:-100000}"
workloads="${WORKLOADS:-lock-churn session-churn heartbeat mass-expiry}"
log_level="${LOG_LEVEL:-warn}"
server_cpu=""
driver_cpu=""
if [ "${PIN:-0}" = 1 ]; then
    server_cpu="taskset -c 0"
    driver_cpu="taskset -c 1"
fi
port=7895
work="$(mktemp -d)"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT

start() {
    rm -rf "$work/data"
    $server_cpu "$1" serve --data-dir "$work/data" --listen "127.0.0.1:$port" --log-level "$log_level" \
        >"$work/server.log" 2>&1 &
    pid=$!
    wait_ready "$port" "$pid" "$work/server.log"
}
stop() {
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=""
}
label() {
    python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['binary']=sys.argv[1]; print(json.dumps(r))" "$1"
}
drive() {
    $driver_cpu "$new" bench --server "http://127.0.0.1:$port" --server-pid "$pid" --json --quiet "$@"
}

for round in $(seq 1 "$rounds"); do
    for which in old new; do
        bin="$old"
        [ "$which" = new ] && bin="$new"
        for workload in $workloads; do
            echo "== round $round, $which, $workload" >&2
            start "$bin"
            case "$workload" in
            lock-churn | session-churn)
                drive --workload "$workload" --clients "$clients" --duration "$seconds"
                ;;
            heartbeat)
                drive --workload heartbeat --clients "$clients" --sessions "$hb_sessions" \
                    --duration "$seconds"
                ;;
            mass-expiry) drive --workload mass-expiry --sessions "$mass_sessions" --clients 8 ;;
            esac | label "$which"
            stop
        done
    done
done
