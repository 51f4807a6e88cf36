#!/usr/bin/env bash
# Redis's own cost per operation, without the node: for the library (src/backend/redis/
# leasehold.lua, loaded as `leasehold_cost`), alone and in batches of 64, an older one-script
# version called with EVALSHA, and the raw commands of the comparison. For each: Redis's
# usec_per_call (INFO commandstats: the time inside the command) and Redis's CPU per
# operation (utime+stime of redis-server from /proc over the run: the command, its network
# and append-only-file work). 16 clients, redis-benchmark.
#
#   benches/compare/redis-cost.sh PORT OLD_SCRIPT.lua
#   e.g. git show 1832284:src/backend/redis/leasehold.lua >/tmp/old.lua
#        redis-server --port 6393 --appendonly yes --appendfsync always --save "" --daemonize yes
#        benches/compare/redis-cost.sh 6393 /tmp/old.lua
#
# Writes keys under `cost-old:`, `cost-new:` and `cmp:`; use a Redis of its own.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
P=$1
old_script=$2
RP=$(redis-cli -p "$P" info server | sed -n 's/^process_id:\([0-9]*\).*/\1/p' | tr -d '\r')
cpu() { awk '{print $14+$15}' "/proc/$RP/stat"; }
tick=$(getconf CLK_TCK)
(printf '#!lua name=leasehold_cost\nlocal FUNCTION = "leasehold_cost"\n'
    cat "$root/src/backend/redis/leasehold.lua") | redis-cli -p "$P" -x function load replace >/dev/null
OLD=$(redis-cli -p "$P" -x script load <"$old_script")
ACQ=$(redis-cli -p "$P" script load "if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = redis.call('INCR', 'cmp:token')
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. t)
return t")
redis-cli -p "$P" set cmp:sess:0 1 >/dev/null
redis-cli -p "$P" evalsha "$OLD" 0 cost-old open s1 alice "" 600000000 >/dev/null
redis-cli -p "$P" fcall leasehold_cost 0 cost-new open s1 alice "" 600000000 >/dev/null
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
hb=()
for _ in $(seq 64); do hb+=(3 heartbeat s1 ""); done
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
run "one script (EVALSHA), heartbeat" 1 20000 evalsha "$OLD" 0 cost-old heartbeat s1 ""
run "library (FCALL), heartbeat" 1 20000 fcall leasehold_cost 0 cost-new heartbeat s1 ""
run "library (FCALL), heartbeats in batches of 64" 64 500 fcall leasehold_cost 0 cost-new '!batch' "${hb[@]}"
run "raw, heartbeat (PEXPIRE)" 1 20000 pexpire cmp:sess:0 600000
run "one script (EVALSHA), acquire of a key it holds" 1 20000 evalsha "$OLD" 0 cost-old acquire s1 k1 1 1000000
run "library (FCALL), acquire of a key it holds" 1 20000 fcall leasehold_cost 0 cost-new acquire s1 k1 1 1000000
run "raw, acquire script on a held key (EVALSHA)" 1 20000 evalsha "$ACQ" 2 cmp:lock:x cmp:sess:0 cmp:sess:0
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
