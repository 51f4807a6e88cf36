#!/usr/bin/env bash
# Redis's own cost per operation, without the node: for the library (src/backend/redis/
# leasehold.lua, loaded as `leasehold_new`) against an older version of it (loaded as
# `leasehold_old`), alone and in batches of 64, and the raw commands of the comparison;
# then a mass expiry through each library. For each: Redis's usec_per_call (INFO
# commandstats: the time inside the command) and Redis's CPU per operation (utime+stime of
# redis-server from /proc over the run: the command, its network and append-only-file
# work). 16 clients, redis-benchmark. Old and new run alternately, ROUNDS times.
#
#   benches/compare/redis-cost.sh PORT OLD_LIBRARY.lua
#   e.g. git show main:src/backend/redis/leasehold.lua >/tmp/old.lua
#        redis-server --port 6393 --appendonly yes --appendfsync always --save "" --daemonize yes
#        MASS_SESSIONS=20000 REAP_BATCH=1000 benches/compare/redis-cost.sh 6393 /tmp/old.lua
#
# The mass expiry opens MASS_SESSIONS sessions each holding one lock (redis-cli --pipe, the
# clock pinned), moves the pinned clock past their deadlines and ends them with `reap`
# passes of REAP_BATCH; it reports Redis's CPU and the passes' time per ended session.
# Writes keys under `cost-old`, `cost-new`, `mass-old-*`, `mass-new-*` and `cmp:`; use a
# Redis of its own.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
P=$1
old_library=$2
ROUNDS=${ROUNDS:-2}
MASS_SESSIONS=${MASS_SESSIONS:-20000}
REAP_BATCH=${REAP_BATCH:-1000}
OPS=${OPS:-1} # 0: the mass expiry only
RP=$(redis-cli -p "$P" info server | sed -n 's/^process_id:\([0-9]*\).*/\1/p' | tr -d '\r')
cpu() { awk '{print $14+$15}' "/proc/$RP/stat"; }
tick=$(getconf CLK_TCK)
load() { # name file
    (printf '#!lua name=%s\nlocal FUNCTION = "%s"\n' "$1" "$1"
        cat "$2") | redis-cli -p "$P" -x function load replace >/dev/null
}
load leasehold_old "$old_library"
load leasehold_new "$root/src/backend/redis/leasehold.lua"
ACQ=$(redis-cli -p "$P" script load "if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = redis.call('INCR', 'cmp:token')
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. t)
return t")
redis-cli -p "$P" set cmp:sess:0 1 >/dev/null
for v in old new; do
    redis-cli -p "$P" fcall "leasehold_$v" 0 "cost-$v" open s1 alice "" 600000000 >/dev/null
    redis-cli -p "$P" fcall "leasehold_$v" 0 "cost-$v" acquire s1 k1 1 1000000 >/dev/null
done
run() { # label ops-per-call calls command...
    local label=$1 per=$2 n=$3
    shift 3
    local name
    name=$(echo "$1" | tr '[:upper:]' '[:lower:]')
    redis-cli -p "$P" config resetstat >/dev/null
    local c0 c1
    c0=$(cpu)
    redis-benchmark -p "$P" -n "$n" -c 16 --csv "$@" >/dev/null 2>&1
    c1=$(cpu)
    local u
    u=$(redis-cli -p "$P" info commandstats | sed -n "s/^cmdstat_$name:.*usec_per_call=\([0-9.]*\).*/\1/p")
    python3 -c "import sys; c0,c1,n,per,tick,u=map(float,sys.argv[1:7]); print(f'{sys.argv[7]}: {u/per:.1f} us in Redis per op, {(c1-c0)/tick*1e6/(n*per):.1f} us of Redis CPU per op')" \
        "$c0" "$c1" "$n" "$per" "$tick" "$u" "$label"
}
# RESP for redis-cli --pipe: one FCALL per line of arguments read from stdin.
resp() {
    python3 -c '
import sys
out = sys.stdout.buffer
for line in sys.stdin:
    args = line.rstrip("\n").split("\t")
    out.write(b"*%d\r\n" % len(args))
    for a in args:
        b = a.encode()
        out.write(b"$%d\r\n%s\r\n" % (len(b), b))
'
}
mass() { # version round
    local v=$1 ns="mass-$1-$2" f="leasehold_$1"
    redis-cli -p "$P" set "$ns:!clock" 1000000 >/dev/null
    for i in $(seq "$MASS_SESSIONS"); do
        printf 'FCALL\t%s\t0\t%s\topen\tm%d\towner\t\t60000\n' "$f" "$ns" "$i"
        printf 'FCALL\t%s\t0\t%s\tacquire\tm%d\tkey%d\t1\t1000\n' "$f" "$ns" "$i" "$i"
    done | resp | redis-cli -p "$P" --pipe >/dev/null
    redis-cli -p "$P" set "$ns:!clock" 2000000 >/dev/null
    redis-cli -p "$P" config resetstat >/dev/null
    local c0 c1 passes=0 t0 t1
    c0=$(cpu)
    t0=$(date +%s%N)
    while true; do
        local out
        out=$(redis-cli -p "$P" fcall "$f" 0 "$ns" reap "$REAP_BATCH" cost 0 1000)
        passes=$((passes + 1))
        case $out in *'"us":0}'* | *'"us":0,'*) break ;; esac
    done
    t1=$(date +%s%N)
    c1=$(cpu)
    local u calls left
    u=$(redis-cli -p "$P" info commandstats | sed -n "s/^cmdstat_fcall:.*usec=\([0-9]*\),.*/\1/p")
    left=$(redis-cli -p "$P" fcall "$f" 0 "$ns" check)
    python3 -c "import sys; c0,c1,n,tick,u,t0,t1=map(float,sys.argv[1:8]); print(f'library {sys.argv[8]}, mass expiry of {n:.0f} sessions in {sys.argv[9]} passes of {sys.argv[10]}: {u/n:.1f} us in Redis per session, {(c1-c0)/tick*1e6/n:.1f} us of Redis CPU per session, {(t1-t0)/1e6:.0f} ms wall for all')" \
        "$c0" "$c1" "$MASS_SESSIONS" "$tick" "$u" "$t0" "$t1" "$v" "$passes" "$REAP_BATCH"
    echo "  after: $left"
    redis-cli -p "$P" --scan --pattern "$ns:*" | xargs -r -n 1000 redis-cli -p "$P" unlink >/dev/null
}
hb_old=()
hb_new=()
for _ in $(seq 64); do
    hb_old+=(3 heartbeat s1 "")
    hb_new+=(3 heartbeat s1 "")
done
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$ROUNDS"); do
    echo "round $round"
    if [ "$OPS" != 0 ]; then
        for v in old new; do
            run "library $v, heartbeat" 1 20000 fcall "leasehold_$v" 0 "cost-$v" heartbeat s1 ""
        done
        run "library old, heartbeats in batches of 64" 64 500 fcall leasehold_old 0 cost-old '!batch' "${hb_old[@]}"
        run "library new, heartbeats in batches of 64" 64 500 fcall leasehold_new 0 cost-new '!batch' "${hb_new[@]}"
        run "raw, heartbeat (PEXPIRE)" 1 20000 pexpire cmp:sess:0 600000
        for v in old new; do
            run "library $v, acquire of a key it holds" 1 20000 fcall "leasehold_$v" 0 "cost-$v" acquire s1 k1 1 1000000
        done
        run "raw, acquire script on a held key (EVALSHA)" 1 20000 evalsha "$ACQ" 2 cmp:lock:x cmp:sess:0 cmp:sess:0
    fi
    if [ "$MASS_SESSIONS" -gt 0 ]; then
        mass old "$round"
        mass new "$round"
    fi
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
