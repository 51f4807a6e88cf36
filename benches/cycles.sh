#!/usr/bin/env bash
# Whether the data file stays bounded through repeated open-and-expire cycles: one server on
# one data directory (embedded backend), audit events kept EVENT_RETENTION_MS (default
# 60 000), and CYCLES (default 4) runs of `leasehold bench --workload mass-expiry` with
# SESSIONS (default 1 000 000) sessions each holding a lock. After each cycle, once the end
# log is applied, prints one JSON line: the data file's apparent size and the bytes the file
# system holds for it, the events trimmed so far and the cycle's own figures. Space freed by
# applied ends and trimmed events must be reused, so the size levels off after the first
# cycles instead of growing by a cycle's worth each time. Not part of CI: a cycle of a
# million took about seven minutes on 2 cores.
#
#   benches/cycles.sh [CYCLES]      BINARY (default target/release/leasehold)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
cycles="${1:-4}"
binary="$(realpath "${BINARY:-target/release/leasehold}")"
sessions="${SESSIONS:-1000000}"
retention="${EVENT_RETENTION_MS:-60000}"
port=7897
work="$(mktemp -d)"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT

# Trimming keeps up with a million sessions' events in a few reaper passes.
LEASEHOLD_EVENT_RETENTION_MS="$retention" LEASEHOLD_EVENT_TRIM_BATCH=500000 \
    "$binary" serve --data-dir "$work/data" --listen "127.0.0.1:$port" --log-level warn \
    >"$work/server.log" 2>&1 &
pid=$!
wait_ready "$port" "$pid" "$work/server.log"
metric() {
    curl -fsS "http://127.0.0.1:$port/metrics" | awk -v m="$1" '$1 == m { print $2 }'
}
file="$work/data/leasehold.redb"
for cycle in $(seq 1 "$cycles"); do
    echo "== cycle $cycle of $cycles" >&2
    "$binary" bench --server "http://127.0.0.1:$port" --server-pid "$pid" --json --quiet \
        --workload mass-expiry --sessions "$sessions" --clients 8 --ttl-ms 10000 \
        >"$work/cycle.json"
    while [ "$(metric leasehold_end_log_sessions)" != 0 ]; do
        kill -0 "$pid" 2>/dev/null || { echo "the server exited:" >&2; cat "$work/server.log" >&2; exit 1; }
        sleep 1
    done
    python3 - "$cycle" "$file" "$(metric leasehold_events_trimmed_total)" "$work/cycle.json" <<'EOF'
import json, os, sys
cycle, path, trimmed, bench = sys.argv[1:]
st = os.stat(path)
run = json.load(open(bench))
print(json.dumps({
    "cycle": int(cycle),
    "file_bytes": st.st_size,
    "allocated_bytes": st.st_blocks * 512,
    "events_trimmed": int(float(trimmed)),
    "free_after_ms": run.get("free_after_ms"),
    "sessions": run.get("sessions"),
}))
EOF
done
