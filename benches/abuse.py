#!/usr/bin/env python3
"""The well-behaved client's latency while a misbehaving one attacks the server.

Starts a `leasehold serve` binary on a fresh data directory (embedded backend, default
settings, no tokens, loopback) and, for each abuse case, measures the latency of every
request of one well-behaved client (one kept-alive connection from 127.0.0.1, in a closed loop:
heartbeat, read its session, acquire a lock, release it) for SECONDS before the abuse and
SECONDS during it. The abuse runs in a process of its own (so it never holds this one's
interpreter lock) from another address, 127.0.0.2, as a second host would:

  drip          200 connections each sending a body one byte every 100 ms
  huge-length   `Content-Length: 1000000000000` on a fresh connection, RATE times a second
  expect-100    the same with `Expect: 100-continue`
  methods       8 kept-alive connections sending random made-up methods: 3 000 at once
                before measuring, then RATE a second
  idle-10k      10 000 connections, each sending one request and then idling kept-alive
                (the server keeps its per-address cap of them and refuses the rest), and
                refused ones knocking again, RATE a second
  waiters       1 020 sessions waiting on one held key (1 000 are let wait, the rest are
                refused 429 and ask again, RATE times a second between them)

RATE (`--rate`, default 200 a second) paces the cases that are floods of requests: the abuse
runs on the same machine, and unpaced it would measure how much CPU the attacking process
takes from the server, not what the server lets a client do to others (a remote attacker's
CPU is not the server's).

Prints one line per case: p50 and p99 before and during, the p99 ratio, how many requests each
side measured and how many answers were wrong (the well-behaved client checks every status),
and the abuse's own counts. `--json` prints JSON lines instead.

    benches/abuse.py BINARY [--seconds 10] [--rate 200] [--cases drip,methods,...] [--json]

Not part of CI: timings depend on the machine; the tests in tests/security_input.rs assert
that the answers stay correct during each case. Needs Python 3.8+ only.
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time

HOST = "127.0.0.1"
ABUSER = "127.0.0.2"
RATE = 200


# ------------------------------------------------------------------------------------------
# The well-behaved client: one kept-alive connection, raw HTTP/1.1.
# ------------------------------------------------------------------------------------------


class Conn:
    def __init__(self, port):
        self.port = port
        self.sock = None
        self.buf = b""

    def connect(self):
        self.sock = socket.create_connection((HOST, self.port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def request(self, method, path, body=None):
        """Sends one request and reads its answer: (status, body bytes)."""
        data = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: l\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        self.sock.sendall(head.encode() + b"\r\n" + data)
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v.strip())
        while len(self.buf) < length:
            self._more()
        payload, self.buf = self.buf[:length], self.buf[length:]
        return status, payload

    def _more(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the well-behaved connection")
        self.buf += chunk


def well_behaved(port, seconds):
    """Runs the closed loop for `seconds`; returns (latencies in ms, wrong answers)."""
    c = Conn(port)
    c.connect()
    status, body = c.request("POST", "/v1/sessions", {"owner": "good", "ttl_ms": 60000})
    assert status == 201, (status, body)
    sid = json.loads(body)["session_id"]
    key = "good-" + sid[:8]
    lat = []
    wrong = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for method, path, body, want in (
            ("POST", f"/v1/sessions/{sid}/heartbeat", {}, 200),
            ("GET", f"/v1/sessions/{sid}", None, 200),
            ("POST", f"/v1/locks/{key}/acquire", {"session_id": sid}, 200),
        ):
            t = time.perf_counter()
            status, answer = c.request(method, path, body)
            lat.append((time.perf_counter() - t) * 1000)
            wrong += status != want
        token = json.loads(answer).get("token", 0) if status == 200 else 0
        t = time.perf_counter()
        status, _ = c.request(
            "POST", f"/v1/locks/{key}/release", {"session_id": sid, "token": token}
        )
        lat.append((time.perf_counter() - t) * 1000)
        wrong += status != 200
    c.request("DELETE", f"/v1/sessions/{sid}")
    c.sock.close()
    return lat, wrong


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))]


# ------------------------------------------------------------------------------------------
# The abuses, each an asyncio program run in a child process until it is terminated.
# ------------------------------------------------------------------------------------------


async def connect(port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((ABUSER, 0))
    await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    return await asyncio.open_connection(sock=sock)


async def read_answer(reader, limit=30):
    """Reads until the server closes or an answer's head and body have come."""
    data = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), limit)
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data and data.rstrip().endswith(b"}"):
                break
    except (asyncio.TimeoutError, ConnectionError):
        pass
    return data


async def drip(port, stats, ready):
    async def one():
        while True:
            try:
                r, w = await connect(port)
                w.write(b"POST /v1/sessions HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{")
                await w.drain()
                answer = asyncio.ensure_future(r.read())
                while not answer.done():
                    await asyncio.sleep(0.1)
                    w.write(b" ")
                    await w.drain()
                    stats["bytes"] += 1
                stats["408" if answer.result().startswith(b"HTTP/1.1 408") else "other"] += 1
                w.close()
            except (ConnectionError, OSError):
                stats["errors"] += 1

    tasks = [asyncio.ensure_future(one()) for _ in range(200)]
    ready.set()
    await asyncio.gather(*tasks)


def refused_body(extra):
    async def run(port, stats, ready):
        async def one():
            while True:
                try:
                    r, w = await connect(port)
                    w.write(
                        b"POST /v1/sessions HTTP/1.1\r\nHost: a\r\n"
                        + extra
                        + b"Content-Length: 1000000000000\r\n\r\n"
                    )
                    await w.drain()
                    answer = await read_answer(r)
                    stats["413" if answer.startswith(b"HTTP/1.1 413") else "other"] += 1
                    stats["100_continue"] += b"100 Continue" in answer
                    w.close()
                except (ConnectionError, OSError):
                    stats["errors"] += 1
                await asyncio.sleep(8 / RATE)

        tasks = [asyncio.ensure_future(one()) for _ in range(8)]
        ready.set()
        await asyncio.gather(*tasks)

    return run


async def methods(port, stats, ready):
    letters = string.ascii_uppercase

    async def one(first):
        r, w = await connect(port)
        n = 0
        while True:
            m = "".join(random.choice(letters) for _ in range(8))
            w.write(f"{m} /healthz HTTP/1.1\r\nHost: a\r\n\r\n".encode())
            await w.drain()
            head = await r.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await r.readexactly(length)
            stats["405" if head.startswith(b"HTTP/1.1 405") else "other"] += 1
            n += 1
            if n == first:
                ready_count.append(1)
                if len(ready_count) == 8:
                    ready.set()
            if n >= first:
                await asyncio.sleep(8 / RATE)

    ready_count = []
    # 3 000 methods between the eight connections before measuring, then on.
    await asyncio.gather(*(one(375) for _ in range(8)))


async def idle(port, stats, ready):
    """10 000 connections, each sending one request and then idling kept-alive (so neither
    the header-read timeout nor anything but `idle_timeout_ms` ends it); those the per-address
    cap refuses are knocked on again, RATE a second, for as long as the case runs."""
    loop = asyncio.get_running_loop()

    async def opened():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.bind((ABUSER, 0))
        try:
            await loop.sock_connect(sock, (HOST, port))
            await loop.sock_sendall(sock, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
            return sock
        except (ConnectionError, OSError):
            stats["connect_errors"] += 1
            sock.close()
            return None

    def kept(sock):
        try:
            return sock.recv(64, socket.MSG_PEEK).startswith(b"HTTP/1.1 200")
        except OSError:
            return False

    held = [await opened() for _ in range(10_000)]
    await asyncio.sleep(2)
    for sock in held:
        if sock is not None and kept(sock):
            stats["kept_open"] += 1
        else:
            stats["refused"] += 1
            if sock is not None:
                sock.close()
    ready.set()
    while True:
        sock = await opened()
        if sock is not None:
            await asyncio.sleep(1 / RATE)
            stats["knocks_kept" if kept(sock) else "knocks_refused"] += 1
            sock.close()


async def waiters(port, stats, ready):
    async def call(r, w, method, path, body):
        data = json.dumps(body).encode()
        w.write(
            f"{method} {path} HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await w.drain()
        head = await r.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        payload = await r.readexactly(length)
        return int(head.split(b" ")[1]), payload

    r, w = await connect(port)
    status, body = await call(r, w, "POST", "/v1/sessions", {"owner": "holder", "ttl_ms": 600000})
    holder = json.loads(body)["session_id"]
    await call(r, w, "POST", "/v1/locks/hot/acquire", {"session_id": holder})
    # 1 020 waiters: the server lets 1 000 (max_waiters_per_key) wait. More connections than
    # that would meet the per-address connection cap (1 024) before the waiter cap.
    ids = []
    for i in range(1020):
        status, body = await call(r, w, "POST", "/v1/sessions", {"owner": f"w{i}", "ttl_ms": 600000})
        ids.append(json.loads(body)["session_id"])

    async def one(sid):
        try:
            r, w = await connect(port)
            while True:
                status, _ = await call(
                    r, w, "POST", "/v1/locks/hot/acquire", {"session_id": sid, "wait_ms": 60000}
                )
                stats[str(status)] += 1
                if status == 429:
                    await asyncio.sleep(20 / RATE)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            stats["errors"] += 1

    tasks = [asyncio.ensure_future(one(s)) for s in ids]
    await asyncio.sleep(2)
    ready.set()
    await asyncio.gather(*tasks)


CASES = {
    "drip": drip,
    "huge-length": refused_body(b""),
    "expect-100": refused_body(b"Expect: 100-continue\r\n"),
    "methods": methods,
    "idle-10k": idle,
    "waiters": waiters,
}


class Stats(dict):
    def __missing__(self, k):
        return 0


def abuse_main(case, port, ready, out):
    # Stopped from outside: leave at once, mid-update or not.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    stats = Stats()

    async def run():
        task = asyncio.ensure_future(CASES[case](port, stats, ready))
        while True:
            await asyncio.sleep(0.25)
            out.update(stats)
            if task.done():
                task.result()

    try:
        asyncio.run(run())
    except Exception as e:  # the abuse dying must be visible
        out["abuse_error"] = repr(e)
        ready.set()


# ------------------------------------------------------------------------------------------


def serve(binary, work, port):
    data = os.path.join(work, "data")
    shutil.rmtree(data, ignore_errors=True)
    log = open(os.path.join(work, "server.log"), "w")
    proc = subprocess.Popen(
        [binary, "serve", "--data-dir", data, "--listen", f"{HOST}:{port}", "--log-level", "warn"],
        stdout=log,
        stderr=log,
    )
    for _ in range(200):
        try:
            c = Conn(port)
            c.connect()
            if c.request("GET", "/readyz")[0] == 200:
                c.sock.close()
                return proc
        except OSError:
            pass
        time.sleep(0.05)
    proc.kill()
    sys.exit("the server did not become ready; see " + os.path.join(work, "server.log"))


def main():
    global RATE
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--port", type=int, default=7897)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rate", type=float, default=RATE)
    args = ap.parse_args()
    RATE = args.rate
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 12_000:
        sys.exit(f"idle-10k needs 12 000 file descriptors; the hard limit is {hard}")
    work = tempfile.mkdtemp(prefix="leasehold-abuse-")
    ctx = mp.get_context("fork")
    manager = ctx.Manager()
    if not args.json:
        print(f"{'case':<12} {'p50 before':>10} {'p99 before':>10} {'p50 during':>10} "
              f"{'p99 during':>10} {'p99 ratio':>9} {'n before':>8} {'n during':>8} wrong  abuse")
    try:
        for case in args.cases.split(","):
            # A fresh server per case: one abuse's leftovers (held connections, waiters)
            # never weigh on the next.
            proc = serve(args.binary, work, args.port)
            try:
                before, wrong_before = well_behaved(args.port, args.seconds)
                ready = ctx.Event()
                out = manager.dict()
                child = ctx.Process(target=abuse_main, args=(case, args.port, ready, out))
                child.start()
                if not ready.wait(120):
                    sys.exit(f"{case}: the abuse never got under way")
                during, wrong_during = well_behaved(args.port, args.seconds)
                abuse = dict(out)
                child.terminate()
                child.join()
            finally:
                proc.terminate()
                proc.wait()
            row = {
                "case": case,
                "p50_before_ms": round(pct(before, 0.50), 3),
                "p99_before_ms": round(pct(before, 0.99), 3),
                "p50_during_ms": round(pct(during, 0.50), 3),
                "p99_during_ms": round(pct(during, 0.99), 3),
                "p99_ratio": round(pct(during, 0.99) / pct(before, 0.99), 2),
                "requests_before": len(before),
                "requests_during": len(during),
                "wrong_answers": wrong_before + wrong_during,
                "abuse": abuse,
            }
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{case:<12} {row['p50_before_ms']:>10} {row['p99_before_ms']:>10} "
                      f"{row['p50_during_ms']:>10} {row['p99_during_ms']:>10} "
                      f"{row['p99_ratio']:>9} {len(before):>8} {len(during):>8} "
                      f"{row['wrong_answers']:>5}  {json.dumps(abuse, sort_keys=True)}",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
