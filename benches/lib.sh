# Shared by the benchmark scripts that start a `leasehold serve` of their own: sourced, not run.

# wait_ready PORT PID LOG [TRIES]: waits, a tenth of a second a try (TRIES, default 100),
# until the server on PORT answers /readyz. If the process PID exits first, or is still not
# ready after the last try, prints its LOG and exits the script.
wait_ready() {
    local port="$1" pid="$2" log="$3" tries="${4:-100}"
    for _ in $(seq 1 "$tries"); do
        curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && return 0
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "the server (pid $pid) exited before it was ready:" >&2
            cat "$log" >&2
            exit 1
        fi
        sleep 0.1
    done
    echo "the server on port $port was not ready after $tries tries:" >&2
    cat "$log" >&2
    exit 1
}
