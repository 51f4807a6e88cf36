#!/usr/bin/env bash
# Instructions a request costs the server, counted by valgrind's callgrind: the figure that
# does not drift with the machine's load or clock. For each binary and workload, the server
# runs under callgrind twice, driven by `leasehold bench` (of the last binary given) for a
# short and a long window; the difference of the two totals over the difference of the
# operations is the cost of one operation, free of start-up, set-up and shutdown.
#
#   benches/callgrind.sh BINARY... 
#
# WORKLOADS (default "heartbeat lock-churn healthz"), CLIENTS (16), SHORT and LONG (seconds, 3
# and 9). `healthz` is `GET /healthz` driven by `wrk` (CLIENTS connections, one thread): the
# cost of the HTTP layer alone, with no rule and no store behind it. Prints one JSON line per
# binary and workload. Needs valgrind (and wrk for healthz). Not part of CI.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
workloads="${WORKLOADS:-heartbeat lock-churn healthz}"
clients="${CLIENTS:-16}"
short="${SHORT:-3}"
long="${LONG:-9}"
driver="$(realpath "${!#}")"
port=7897
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
    for _ in $(seq 1 600); do
        curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
        kill -0 "$pid" 2>/dev/null || { echo "server $bin exited:" >&2; cat "$work/server.log" >&2; exit 1; }
        sleep 0.1
    done
    local ops
    if [ "$workload" = healthz ]; then
        ops="$(wrk -t1 -c"$clients" -d"${secs}s" "http://127.0.0.1:$port/healthz" |
            awk '/requests in/ {print $1}')"
    else
        ops="$("$driver" bench --server "http://127.0.0.1:$port" --workload "$workload" \
            --clients "$clients" --sessions 1000 --keys 1000 --warmup 1 --duration "$secs" \
            --json --quiet | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["ops"])')"
    fi
    kill -TERM "$pid" 2>/dev/null || { echo "server $bin exited early:" >&2; tail -5 "$work/server.log" >&2; }
    wait "$pid" 2>/dev/null || true
    pid=""
    local ir
    ir="$(sed -n 's/^summary: *//p;s/^totals: *//p' "$work/callgrind.out" | head -1 | awk '{print $1}')"
    echo "$ir $ops"
}

for bin in "$@"; do
    for workload in $workloads; do
        read -r ir1 ops1 < <(measure "$bin" "$workload" "$short")
        read -r ir2 ops2 < <(measure "$bin" "$workload" "$long")
        python3 -c '
import json, sys
b, w, ir1, ops1, ir2, ops2 = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
print(json.dumps({"binary": b, "workload": w, "instructions_per_op": round((ir2 - ir1) / (ops2 - ops1)),
                  "ops": [ops1, ops2], "instructions": [ir1, ir2]}))' "$bin" "$workload" "$ir1" "$ops1" "$ir2" "$ops2"
    done
done
