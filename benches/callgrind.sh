#!/usr/bin/env bash
# Instructions a request costs the server, counted by valgrind's callgrind: the figure that
# does not drift with the machine's load or clock. For each binary and workload, the server
# runs under callgrind twice, driven by `leasehold bench` (of the last binary given) for a
# short and a long window; the difference of the two totals over the difference of the
# operations is the cost of one operation, free of start-up, set-up and shutdown.
#
#   benches/callgrind.sh BINARY... 
#
# Also prints the same difference for the connection tasks alone
# (`request_path_instructions_per_op`): the HTTP layer and the handlers, without the writer
# thread and the background tasks, whose idle ticks swamp the whole-process figure when the
# machine is loaded and the server under valgrind serves few requests a second.
#
# PORT (7897) lets two runs share a machine. WORKLOADS (default "heartbeat lock-churn healthz"), CLIENTS (16), SHORT and LONG (seconds, 3
# and 9). `healthz` is `GET /healthz`, 200 requests per second of the window sent by curl on one
# connection: the cost of the HTTP layer alone, with no rule and no store behind it. Prints one JSON line per
# binary and workload. Needs valgrind and curl. Not part of CI.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -ge 1 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
workloads="${WORKLOADS:-heartbeat lock-churn healthz}"
clients="${CLIENTS:-16}"
short="${SHORT:-3}"
long="${LONG:-9}"
driver="$(realpath "${!#}")"
port="${PORT:-7897}"
work="$(mktemp -d)"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT

# Runs `bin` under callgrind for one window of `secs`; prints "instructions ops".
measure() {
    local bin="$1" workload="$2" secs="$3"
    rm -rf "$work/data" "$work"/callgrind.out*
    valgrind --tool=callgrind --callgrind-out-file="$work/callgrind.out" \
        "$bin" serve --data-dir "$work/data" --listen "127.0.0.1:$port" --log-level warn \
        >"$work/server.log" 2>&1 &
    pid=$!
    # Up to a minute: the server starts slowly under valgrind.
    wait_ready "$port" "$pid" "$work/server.log" 600
    local ops
    if [ "$workload" = healthz ]; then
        # 200 requests a second of the window, one after another on one kept-alive
        # connection (curl's URL range; the query string is ignored by the route).
        ops="$(curl -s -o /dev/null -w '%{http_code}\n' \
            "http://127.0.0.1:$port/healthz?n=[1-$((secs * 200))]" | grep -c '^200$')"
    else
        ops="$("$driver" bench --server "http://127.0.0.1:$port" --workload "$workload" \
            --clients "$clients" --sessions 1000 --keys 1000 --warmup 1 --duration "$secs" \
            --json --quiet | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["ops"])')"
    fi
    kill -TERM "$pid" 2>/dev/null || { echo "server $bin exited early:" >&2; tail -5 "$work/server.log" >&2; }
    wait "$pid" 2>/dev/null || true
    pid=""
    local ir conn
    ir="$(sed -n 's/^summary: *//p;s/^totals: *//p' "$work/callgrind.out" | head -1 | awk '{print $1}')"
    # The connection tasks alone (accept, parse, route, handle, answer), without the writer
    # thread, the reaper or timers: the request path, which idle time under a slow server
    # does not dilute.
    conn="$(callgrind_annotate --inclusive=yes "$work/callgrind.out" 2>/dev/null |
        awk '!n && /leasehold::server::run::\{\{closure\}\}::\{\{closure\}\}/ {gsub(",", "", $1); print $1; n = 1}')"
    echo "$ir $ops ${conn:-0}"
}

for bin in "$@"; do
    for workload in $workloads; do
        read -r ir1 ops1 conn1 < <(measure "$bin" "$workload" "$short")
        read -r ir2 ops2 conn2 < <(measure "$bin" "$workload" "$long")
        python3 -c '
import json, sys
b, w, ir1, ops1, conn1, ir2, ops2, conn2 = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
print(json.dumps({"binary": b, "workload": w, "instructions_per_op": round((ir2 - ir1) / (ops2 - ops1)),
                  "request_path_instructions_per_op": round((conn2 - conn1) / (ops2 - ops1)),
                  "ops": [ops1, ops2], "instructions": [ir1, ir2], "request_path_instructions": [conn1, conn2]}))' \
            "$bin" "$workload" "$ir1" "$ops1" "$conn1" "$ir2" "$ops2" "$conn2"
    done
done
