"""The Python client against a real Leasehold server.

The server is ``LEASEHOLD_TEST_SERVER`` if set; otherwise the binary ``LEASEHOLD_BIN``
(default ``leasehold`` on the PATH) is started on a free port with a fresh data directory
and its reaper running every 50 ms, and stopped at the end.
"""

import http.server
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import unittest

import leasehold
from leasehold.client import segment

PATIENCE = 30.0  # seconds; only a broken build waits this long
SERVER = None
_process = None
_data_dir = None


def setUpModule():
    global SERVER, _process, _data_dir
    SERVER = os.environ.get("LEASEHOLD_TEST_SERVER")
    if SERVER:
        return
    binary = os.environ.get("LEASEHOLD_BIN") or shutil.which("leasehold")
    if not binary:
        raise unittest.SkipTest("set LEASEHOLD_BIN or LEASEHOLD_TEST_SERVER to run against a server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _data_dir = tempfile.mkdtemp(prefix="leasehold-py-")
    _process = subprocess.Popen(
        [binary, "serve", "--listen", f"127.0.0.1:{port}", "--data-dir", _data_dir, "--reaper-interval-ms", "50", "--log-level", "warn"],
    )
    SERVER = f"http://127.0.0.1:{port}"
    client = leasehold.Client(SERVER, timeout=1)
    until = time.monotonic() + PATIENCE
    while True:
        try:
            if client.get("/readyz")[0] == 200:
                return
        except leasehold.TransportError:
            pass
        if time.monotonic() > until or _process.poll() is not None:
            raise RuntimeError(f"the server at {SERVER} did not start")
        time.sleep(0.02)


def tearDownModule():
    if _process is not None:
        _process.terminate()
        _process.wait(timeout=PATIENCE)
    if _data_dir is not None:
        shutil.rmtree(_data_dir, ignore_errors=True)


def unique(name):
    return f"{name}-{os.urandom(4).hex()}"


def eventually(ready, what):
    until = time.monotonic() + PATIENCE
    while not ready():
        if time.monotonic() > until:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.01)


class Guards(unittest.TestCase):
    def setUp(self):
        self.plain = leasehold.Client(SERVER)

    def lock_status(self, key):
        return self.plain.get(f"/v1/locks/{segment(key)}")[0]

    def test_a_lock_is_given_back_when_the_block_ends_even_by_an_exception(self):
        key = unique("db/migrate")
        with leasehold.Session(leasehold.Client(SERVER), "py-test", ttl=10) as s:
            with s.lock(key) as lock:
                self.assertEqual(self.lock_status(key), 200)
                self.assertGreater(lock.token, 0)
            self.assertEqual(self.lock_status(key), 404)
            with self.assertRaises(ZeroDivisionError):
                with s.lock(key):
                    1 / 0
            self.assertEqual(self.lock_status(key), 404)

    def test_a_held_lock_or_full_pool_is_refused_with_its_code(self):
        key, pool = unique("k"), unique("pool")
        self.assertEqual(self.plain.request("PUT", f"/v1/pools/{segment(pool)}", {"capacity": 1})[0], 201)
        with leasehold.Session(leasehold.Client(SERVER), "a", ttl=10) as a, leasehold.Session(leasehold.Client(SERVER), "b", ttl=10) as b:
            with a.lock(key), a.seat(pool) as seat:
                self.assertGreater(seat.token, 0)
                with self.assertRaises(leasehold.LeaseholdError) as held:
                    b.lock(key)
                self.assertEqual(held.exception.code, "lock_held")
                with self.assertRaises(leasehold.LeaseholdError) as full:
                    b.seat(pool)
                self.assertEqual(full.exception.code, "pool_exhausted")
            with b.seat(pool):
                pass

    def test_closing_the_session_releases_everything(self):
        key = unique("k")
        s = leasehold.Session(leasehold.Client(SERVER), "py-test", ttl=10)
        s.lock(key)
        s.close()
        self.assertEqual(self.lock_status(key), 404)
        self.assertEqual(s.loss, "closed")
        with self.assertRaises(leasehold.SessionLost):
            s.lock(key)


class Loss(unittest.TestCase):
    def test_an_operator_ending_the_session_is_noticed_and_stops_every_call(self):
        seen = []
        s = leasehold.Session(leasehold.Client(SERVER), "py-test", ttl=3, on_lost=seen.append)
        s.lock(unique("k"))
        status, _ = leasehold.Client(SERVER).post(f"/v1/admin/sessions/{s.id}/end")
        self.assertEqual(status, 200)
        self.assertEqual(s.wait_lost(PATIENCE), "gone")
        self.assertEqual(seen, ["gone"])
        with self.assertRaises(leasehold.SessionLost) as lost:
            s.check()
        self.assertEqual(lost.exception.reason, "gone")
        s.close()

    def test_the_local_deadline_passes_while_the_server_still_honours_the_session(self):
        proxy = StallingProxy(SERVER)
        try:
            s = leasehold.Session(leasehold.Client(proxy.url, timeout=5), "py-stall", ttl=1.5, margin=0.3)
            key = unique("guarded")
            lock = s.lock(key)
            first = s.deadline
            eventually(lambda: s.deadline > first, "a heartbeat succeeds")
            proxy.stall()
            self.assertEqual(s.wait_lost(PATIENCE), "deadline")
            direct = leasehold.Client(SERVER)
            status, _ = direct.get(f"/v1/sessions/{s.id}")
            self.assertEqual(status, 200, "the server ended the session before the client gave up")
            _, fence = direct.get(f"/v1/fence/{segment(key)}?token={lock.token}")
            self.assertTrue(fence["current"])
            eventually(lambda: direct.get(f"/v1/sessions/{s.id}")[0] == 404, "the server ends the session")
        finally:
            proxy.close()


class Watches(unittest.TestCase):
    def test_a_watch_reports_the_snapshot_then_each_lock_lost_and_the_end(self):
        key = unique("watched")
        s = leasehold.Session(leasehold.Client(SERVER), "py-watch", ttl=10)
        lock = s.lock(key)
        with s.watch(timeout=PATIENCE) as w:
            snap = next(w)
            self.assertEqual(snap.event, "snapshot")
            self.assertEqual(snap.id, 1)
            self.assertEqual(snap.data["session_id"], s.id)
            self.assertEqual(snap.data["state"], "active")
            s.close()
            rest = list(w)
        self.assertEqual([e.event for e in rest], ["lock_lost", "closed"], rest)
        self.assertEqual(rest[0].data, {"key": key, "token": lock.token})
        self.assertTrue(rest[1].is_final and rest[1].is_loss)
        self.assertEqual(rest[1].data["released"], 1)


class Retries(unittest.TestCase):
    def test_503s_are_retried_session_gone_is_not_and_the_token_is_sent(self):
        overloaded = (503, {"error": "overloaded", "message": "busy"})
        gone = (404, {"error": "session_gone", "message": "gone"})
        fake = Scripted([overloaded, overloaded, gone])
        try:
            client = leasehold.Client(fake.url, token="secret-token")
            s = leasehold.Session(client, "scripted", ttl=1, heartbeat_every=0.05)
            self.assertEqual(s.wait_lost(PATIENCE), "gone")
            self.assertEqual(fake.heartbeats(), 3)
            time.sleep(0.3)  # several heartbeat intervals: nothing more is sent
            self.assertEqual(fake.heartbeats(), 3)
            self.assertTrue(fake.authorization)
            self.assertEqual(set(fake.authorization), {"Bearer secret-token"})
            s.close()
        finally:
            fake.close()

    def test_a_heartbeat_refused_for_good_is_a_loss(self):
        fake = Scripted([(401, {"error": "unauthorized", "message": "no"})])
        try:
            s = leasehold.Session(leasehold.Client(fake.url), "scripted", ttl=1, heartbeat_every=0.05)
            self.assertEqual(s.wait_lost(PATIENCE), "refused")
            self.assertEqual(fake.heartbeats(), 1)
        finally:
            fake.close()

    def test_an_enqueue_whose_answer_was_lost_is_retried_and_enqueued_once(self):
        queue = unique("retried")
        proxy = LosingProxy(SERVER, lose=1)
        try:
            answer = leasehold.Client(proxy.url).enqueue(queue, {"n": 1}, kind="k")
            # The first answer was lost after the server acted; the retry got it.
            self.assertEqual((proxy.forwarded, proxy.lost), (2, 1))
            status, counts = leasehold.Client(SERVER).get(f"/v1/queues/{segment(queue)}")
            self.assertEqual(status, 200)
            self.assertEqual(counts["queued"], 1)
            status, job = leasehold.Client(SERVER).get(f"/v1/jobs/{answer['job_id']}")
            self.assertEqual((status, job["payload"], job["kind"]), (200, {"n": 1}, "k"))
        finally:
            proxy.close()

    def test_a_lock_acquire_and_release_whose_answers_were_lost_act_once(self):
        key = unique("retried")
        direct = leasehold.Client(SERVER)
        proxy = LosingProxy(SERVER, lose=0)
        try:
            with leasehold.Session(leasehold.Client(proxy.url), "retried") as s:
                proxy.lose_next(1)
                lock = s.lock(key)
                self.assertEqual(direct.get(f"/v1/locks/{segment(key)}")[1]["token"], lock.token)
                proxy.lose_next(1)
                lock.release()  # its retry is answered 200, not not_holder
                self.assertEqual(direct.get(f"/v1/locks/{segment(key)}")[0], 404)
            self.assertEqual(proxy.lost, 2)
            status, page = direct.get("/v1/events?limit=1000")
            self.assertEqual(status, 200)
            mine = [e for e in page["events"] if e.get("key") == key]
            self.assertEqual([e["kind"] for e in mine], ["lock_acquired", "lock_released"])
        finally:
            proxy.close()

    def test_bad_urls_and_tokens_are_refused_up_front(self):
        with self.assertRaises(ValueError):
            leasehold.Client("ftp://x")
        with self.assertRaises(ValueError):
            leasehold.Client(SERVER, token="a\r\nX-Evil: 1")
        with self.assertRaises(leasehold.TransportError):
            leasehold.Session(leasehold.Client("http://127.0.0.1:1"), "nobody", backoff=leasehold.client.Backoff(attempts=2))


class Worker(unittest.TestCase):
    def enqueue(self, queue, payload):
        status, body = leasehold.Client(SERVER).post(f"/v1/queues/{segment(queue)}/jobs", {"payload": payload, "idempotent": True})
        self.assertEqual(status, 201)
        return body["job_id"]

    def job(self, job_id):
        return leasehold.Client(SERVER).get(f"/v1/jobs/{job_id}")[1]

    def test_the_worker_completes_fails_and_stops(self):
        queue = unique("thumbs")
        ids = [self.enqueue(queue, {"n": n}) for n in range(3)]
        stop = threading.Event()
        seen = []

        def handler(job):
            seen.append(job.payload["n"])
            if len(seen) == 3:
                stop.set()
            if job.payload["n"] == 1:
                raise ValueError("bad image")
            return {"done": job.payload["n"]}

        with leasehold.Session(leasehold.Client(SERVER), "worker", ttl=5) as s:
            self.assertEqual(leasehold.work(s, queue, handler, stop=stop, wait=0.2), 3)
        self.assertEqual(seen, [0, 1, 2])
        states = [self.job(i) for i in ids]
        self.assertEqual([j["state"] for j in states], ["done", "failed", "done"])
        self.assertEqual(states[0]["result"], {"done": 0})
        self.assertEqual(states[1]["failure_reason"], "ValueError: bad image")

    def test_the_worker_hands_the_job_back_on_shutdown(self):
        queue = unique("q")
        job_id = self.enqueue(queue, None)

        def handler(job):
            raise KeyboardInterrupt

        with leasehold.Session(leasehold.Client(SERVER), "worker", ttl=5) as s:
            with self.assertRaises(KeyboardInterrupt):
                leasehold.work(s, queue, handler, wait=0.2)
        self.assertEqual(self.job(job_id)["state"], "queued")

    def test_a_job_left_unfinished_in_a_block_goes_back(self):
        queue = unique("q")
        job_id = self.enqueue(queue, {"x": 1})
        with leasehold.Session(leasehold.Client(SERVER), "worker", ttl=5) as s:
            with s.claim(queue) as job:
                self.assertEqual(job.id, job_id)
                self.assertEqual(self.job(job_id)["state"], "claimed")
            self.assertEqual(self.job(job_id)["state"], "queued")
            self.assertIsNone(s.claim(unique("empty")))


# ---------------------------------------------------------------------------------------------
# Test doubles: a proxy whose traffic can be stalled, and a scripted server
# ---------------------------------------------------------------------------------------------


class StallingProxy:
    """Forwards TCP to the server; after :meth:`stall` it holds every byte."""

    def __init__(self, server):
        host, port = server.split("//")[1].split(":")
        self._upstream = (host, int(port))
        self._stalled = threading.Event()
        self._closed = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.url = "http://127.0.0.1:%d" % self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self):
        self._stalled.set()

    def close(self):
        self._closed.set()
        self._listener.close()

    def _accept(self):
        while not self._closed.is_set():
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return
            outbound = socket.create_connection(self._upstream)
            for a, b in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source, sink):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                while self._stalled.is_set() and not self._closed.is_set():
                    time.sleep(0.01)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


class LosingProxy:
    """Forwards each POST to the server and relays its answer, except that the next ``lose``
    answers are dropped after the server has acted (the connection is closed unanswered), as a
    timeout on the way back would."""

    def __init__(self, server, lose=0):
        self.forwarded = 0
        self.lost = 0
        self._lose = lose
        self._lock = threading.Lock()
        upstream = leasehold.Client(server)
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                status, answer = upstream.post(self.path, body)
                with owner._lock:
                    owner.forwarded += 1
                    lose = owner._lose > 0 and not self.path.endswith("/heartbeat")
                    if lose:
                        owner._lose -= 1
                        owner.lost += 1
                if lose:
                    self.close_connection = True
                    return
                self.reply(status, answer)

            def do_DELETE(self):
                status, answer = upstream.request("DELETE", self.path)
                self.reply(status, answer)

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def lose_next(self, n):
        with self._lock:
            self._lose = n

    def close(self):
        self._server.shutdown()
        self._server.server_close()


class Scripted:
    """Opens sessions with TTL 1 s and answers the n-th heartbeat with ``script[n]`` (the
    last entry for every later one); records the ``Authorization`` headers it was sent."""

    def __init__(self, script):
        self.script = script
        self.count = 0
        self.authorization = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                if self.headers.get("authorization"):
                    owner.authorization.append(self.headers["authorization"])
                if self.path == "/v1/sessions":
                    status, body = 201, {"session_id": "s1", "ttl_ms": 1000, "expires_at": 0, "revision": 1}
                elif self.path.endswith("/heartbeat"):
                    owner.count += 1
                    status, body = owner.script[min(owner.count, len(owner.script)) - 1]
                else:
                    status, body = 200, {}
                self.reply(status, body)

            def do_DELETE(self):
                self.reply(200, {"released": 0, "seats_released": 0, "jobs_settled": 0, "revision": 1})

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def heartbeats(self):
        return self.count

    def close(self):
        self._server.shutdown()
        self._server.server_close()


if __name__ == "__main__":
    unittest.main()
