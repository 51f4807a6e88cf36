"""Sessions, guards and the worker loop of the Leasehold client.

Two threads may touch a session: the caller's and the heartbeat thread (plus one short-lived
thread per heartbeat request, so that a request stuck on the network never delays the loss
signal past the local deadline). The state they share — the deadline and the loss — is
guarded by one lock, held only for reads and writes of those fields.
"""

import http.client
import json
import random
import socket
import ssl
import threading
import time
import urllib.parse
import uuid

__all__ = [
    "Client",
    "Job",
    "LeaseholdError",
    "LockGuard",
    "SeatGuard",
    "Session",
    "SessionLost",
    "TransportError",
    "Watch",
    "WatchEvent",
    "work",
]

#: Why a session was lost.
GONE = "gone"  # the server answered session_gone: expired, closed or ended by an operator
DEADLINE = "deadline"  # the local deadline passed without a successful heartbeat
REFUSED = "refused"  # a heartbeat was refused with an answer retrying cannot change
CLOSED = "closed"  # this client closed the session


class LeaseholdError(Exception):
    """The server answered with an error: ``status``, ``code`` (``lock_held``, …), ``message``."""

    def __init__(self, status, code, message, body=None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body or {}


class TransportError(LeaseholdError):
    """The server could not be reached, or the answer did not arrive in time."""

    def __init__(self, message):
        super().__init__(0, "transport", message)


class SessionLost(LeaseholdError):
    """The session is lost; ``reason`` is ``gone``, ``deadline``, ``refused`` or ``closed``."""

    def __init__(self, reason):
        super().__init__(0, "session_lost", f"the session is lost ({reason})")
        self.reason = reason


def segment(text):
    """Percent-encodes one path segment (a key, pool, queue or id), ``/`` included."""
    return urllib.parse.quote(text, safe="")


class Client:
    """One HTTP call, one answer, no retries.

    ``server`` is ``http://HOST:PORT`` or ``https://HOST:PORT`` (``ssl_context`` then sets the
    TLS options). ``token``, if given, is sent as ``Authorization: Bearer <token>``.
    ``timeout`` bounds each call and must exceed the longest ``wait`` asked for.
    """

    def __init__(self, server="http://127.0.0.1:7878", token=None, timeout=120.0, ssl_context=None):
        parsed = urllib.parse.urlsplit(server.rstrip("/"))
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"invalid server URL {server!r}: expected http://HOST:PORT or https://HOST:PORT")
        if token is not None and any(c in token for c in "\r\n"):
            raise ValueError("the API token holds a line break")
        self.server = server.rstrip("/")
        self._scheme = parsed.scheme
        self._host = parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._prefix = parsed.path
        self._token = token or None
        self._ssl = ssl_context if ssl_context is not None else (ssl.create_default_context() if parsed.scheme == "https" else None)
        self.timeout = timeout

    def request(self, method, path, body=None, timeout=None):
        """Sends one request; returns ``(status, decoded JSON body or None)``.

        Raises :class:`TransportError` when the server cannot be reached or does not answer
        within ``timeout`` (default the client's).
        """
        timeout = self.timeout if timeout is None else timeout
        if self._scheme == "https":
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        headers = {"content-type": "application/json"}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        data = None if body is None else json.dumps(body).encode()
        try:
            conn.request(method, self._prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            status = resp.status
        except (OSError, http.client.HTTPException) as e:
            raise TransportError(f"cannot reach {self.server}: {e}") from e
        finally:
            conn.close()
        if not raw:
            return status, None
        try:
            return status, json.loads(raw)
        except ValueError:
            raise LeaseholdError(status, "not_json", raw.decode("utf-8", "replace")) from None

    def get(self, path):
        return self.request("GET", path)

    def post(self, path, body=None):
        return self.request("POST", path, {} if body is None else body)

    def watch(self, session_id, timeout=None):
        """Opens ``GET /v1/sessions/{id}/watch``; returns a :class:`Watch` of its events.

        ``timeout`` bounds each read of the stream (default none: the server's keep-alive
        comments arrive every ``watch_keepalive_ms``). A refusal (``404 session_gone``,
        ``429``/``503 too_many_watches``, ...) raises :class:`LeaseholdError`.
        """
        if self._scheme == "https":
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        headers = {"accept": "text/event-stream"}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        try:
            conn.request("GET", f"{self._prefix}/v1/sessions/{segment(session_id)}/watch", headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise TransportError(f"cannot reach {self.server}: {e}") from e
        if resp.status != 200:
            raw = resp.read()
            conn.close()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            raise _error(resp.status, body)
        return Watch(conn, resp)

    def enqueue(self, queue, payload, idempotent=None, max_recoveries=None, kind=None, backoff=None):
        """Enqueues a job; returns the answer (``job_id``, ``queue``, ``revision``).

        Retried with ``backoff`` on transport errors and 503s under one ``request_id``, so a
        retry after a lost answer gets the first answer back and never enqueues twice.
        Raises :class:`LeaseholdError` for any other refusal.
        """
        body = {"payload": payload, "request_id": _request_id()}
        for name, value in (("idempotent", idempotent), ("max_recoveries", max_recoveries), ("kind", kind)):
            if value is not None:
                body[name] = value
        backoff = backoff or Backoff()
        path = f"/v1/queues/{segment(queue)}/jobs"
        for attempt in range(backoff.attempts):
            try:
                status, answer = self.post(path, body)
            except TransportError:
                if attempt + 1 == backoff.attempts:
                    raise
                time.sleep(backoff.delay(attempt))
                continue
            if _retryable(status) and attempt + 1 < backoff.attempts:
                time.sleep(backoff.delay(attempt))
                continue
            if status != 201:
                raise _error(status, answer)
            return answer
        raise AssertionError("unreachable")


class WatchEvent:
    """One event of a watch: ``event`` (its name), ``id`` (its number in the stream, from 1,
    or None) and ``data`` (the decoded JSON)."""

    #: Events after which the server ends the stream.
    FINAL = frozenset({"expired", "ended_by_admin", "closed", "gone", "shutting_down"})
    #: Events that say the session is gone.
    LOSS = frozenset({"expired", "ended_by_admin", "closed", "gone"})

    def __init__(self, event, id, data):
        self.event = event
        self.id = id
        self.data = data

    @property
    def is_final(self):
        return self.event in self.FINAL

    @property
    def is_loss(self):
        return self.event in self.LOSS

    def __repr__(self):
        return f"WatchEvent({self.event!r}, {self.id!r}, {self.data!r})"


class Watch:
    """An open watch: iterate it for :class:`WatchEvent` in order; iteration stops after the
    final event or when the stream ends. Keep-alive comments are skipped. ``close`` (or
    ``with``) drops the connection."""

    def __init__(self, conn, resp):
        self._conn = conn
        self._resp = resp
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        event, ident, data = "message", None, []
        while True:
            try:
                line = self._resp.readline()
            except (OSError, http.client.HTTPException) as e:
                self.close()
                raise TransportError(f"the watch broke: {e}") from e
            if not line:
                self.close()
                raise StopIteration
            line = line.decode("utf-8", "replace").rstrip("\r\n")
            if line == "":
                if not data:
                    event, ident = "message", None
                    continue
                try:
                    decoded = json.loads("\n".join(data))
                except ValueError:
                    decoded = "\n".join(data)
                e = WatchEvent(event, ident, decoded)
                if e.is_final:
                    self._done = True
                return e
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
            elif field == "id":
                ident = int(value) if value.isdigit() else None

    def close(self):
        self._done = True
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _request_id():
    """A fresh ``request_id`` for one logical call, sent again only by that call's retries."""
    return str(uuid.uuid4())


def _retryable(status):
    return status == 503


def _error(status, body):
    body = body or {}
    return LeaseholdError(status, body.get("error", "error"), body.get("message", ""), body)


class Backoff:
    """Exponential backoff: ``first`` seconds, doubling, at most ``maximum``, each delay cut
    by up to a half at random; ``attempts`` in all for calls other than heartbeats (which are
    retried until the local deadline)."""

    def __init__(self, first=0.05, maximum=2.0, attempts=5):
        self.first = first
        self.maximum = maximum
        self.attempts = attempts

    def delay(self, retry):
        full = min(self.first * (2 ** min(retry, 16)), self.maximum)
        return full - full * random.random() / 2


class Session:
    """A session on the server, heartbeating on a background thread while it is open.

    Use it as a context manager (``with Session(client, "owner") as s:``) or call
    :meth:`close`. Options: ``ttl`` (seconds, default 15), ``heartbeat_every`` (default a third
    of the TTL), ``margin`` (how much earlier than the server the client gives up; default a
    tenth of the TTL, at least 50 ms), ``metadata`` (a dict stored with the session),
    ``on_lost`` (called once, from the thread that notices, with the reason).
    """

    def __init__(self, client, owner, ttl=15.0, heartbeat_every=None, margin=None, metadata=None, on_lost=None, backoff=None):
        self.client = client
        self._backoff = backoff or Backoff()
        self._state = threading.Lock()
        self._lost = threading.Event()
        self._loss = None
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._inflight = None
        body = {"owner": owner, "ttl_ms": int(ttl * 1000), "request_id": _request_id()}
        if metadata is not None:
            body["metadata"] = metadata
        # Every attempt carries one request_id, so a retry after a lost answer gets the
        # session the first attempt opened, not a second one. Its deadline was set when the
        # first attempt arrived, so the local deadline counts from the first send.
        sent = time.monotonic()
        for attempt in range(self._backoff.attempts):
            try:
                status, answer = client.post("/v1/sessions", body)
            except TransportError:
                if attempt + 1 == self._backoff.attempts:
                    raise
                time.sleep(self._backoff.delay(attempt))
                continue
            if _retryable(status) and attempt + 1 < self._backoff.attempts:
                time.sleep(self._backoff.delay(attempt))
                continue
            break
        if status != 201:
            raise _error(status, answer)
        self.id = answer["session_id"]
        self.ttl = answer.get("ttl_ms", body["ttl_ms"]) / 1000.0
        self.margin = margin if margin is not None else max(self.ttl / 10, 0.05)
        self._deadline = sent + self.ttl - self.margin
        self._interval = heartbeat_every if heartbeat_every is not None else self.ttl / 3
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"leasehold-heartbeat-{self.id[:8]}", daemon=True)
        self._thread.start()

    # -- the loss signal -------------------------------------------------------------------

    @property
    def deadline(self):
        """The local deadline, on :func:`time.monotonic`."""
        with self._state:
            return self._deadline

    @property
    def loss(self):
        """Why the session was lost, or ``None`` while it is trusted."""
        self._notice_deadline()
        return self._loss

    def _lose(self, reason):
        with self._state:
            if self._loss is not None:
                return
            self._loss = reason
        self._lost.set()
        if self._on_lost is not None:
            self._on_lost(reason)

    def _notice_deadline(self):
        if self._loss is None and time.monotonic() >= self.deadline:
            self._lose(DEADLINE)

    def check(self):
        """Raises :class:`SessionLost` unless the session is trusted; call it right before a
        write that a token guards."""
        self._notice_deadline()
        if self._loss is not None:
            raise SessionLost(self._loss)

    def wait_lost(self, timeout=None):
        """Waits until the session is lost (at most ``timeout`` seconds); the reason, or
        ``None`` if it is still trusted."""
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            self._notice_deadline()
            if self._loss is not None:
                return self._loss
            now = time.monotonic()
            wait = self.deadline - now
            if until is not None:
                if now >= until:
                    return None
                wait = min(wait, until - now)
            self._lost.wait(max(wait, 0.001))

    # -- heartbeats ------------------------------------------------------------------------

    def _heartbeat_loop(self):
        next_beat = time.monotonic() + self._interval
        while True:
            now = time.monotonic()
            deadline = self.deadline
            if now >= deadline:
                self._lose(DEADLINE)
                return
            if self._stop.wait(max(0.0, min(next_beat, deadline) - now)) or self._loss is not None:
                return
            if time.monotonic() < next_beat:
                continue
            # The request runs on its own thread so that the deadline is kept even while it
            # is stuck; a late answer is then ignored.
            outcome = {}
            done = threading.Event()
            # close() sets it too, so that a heartbeat stuck on the network does not hold up
            # the close until the deadline.
            self._inflight = done
            threading.Thread(target=self._beat, args=(outcome, done), daemon=True).start()
            done.wait(max(0.0, deadline - time.monotonic()))
            if self._stop.is_set():
                return
            if not done.is_set():
                self._lose(DEADLINE)
                return
            if "loss" in outcome:
                self._lose(outcome["loss"])
                return
            next_beat = outcome["sent"] + self._interval

    def _beat(self, outcome, done):
        path = f"/v1/sessions/{segment(self.id)}/heartbeat"
        retry = 0
        try:
            while not self._stop.is_set() and self._loss is None:
                sent = time.monotonic()
                try:
                    status, body = self.client.request("POST", path, {}, timeout=max(0.05, self.deadline - sent))
                except TransportError:
                    status, body = None, None
                if status is None or _retryable(status):
                    time.sleep(self._backoff.delay(retry))
                    retry += 1
                    continue
                if status == 200:
                    # A server without safe_for_ms honours the session for the TTL from when it
                    # handled the heartbeat, which was after `sent`.
                    honoured = min(body.get("safe_for_ms", self.ttl * 1000) / 1000.0, self.ttl)
                    with self._state:
                        self._deadline = max(self._deadline, sent + honoured - self.margin)
                    outcome["sent"] = sent
                elif status == 404 and (body or {}).get("error") == "session_gone":
                    outcome["loss"] = GONE
                else:
                    outcome["loss"] = REFUSED
                return
        except LeaseholdError:
            outcome["loss"] = REFUSED
        finally:
            done.set()

    # -- calls -----------------------------------------------------------------------------

    def _call(self, path, body):
        """POSTs ``body``; retried on transport errors and 503s (every call made through here
        is safe to repeat: its body carries a ``request_id``). A ``session_gone`` answer marks
        the session lost and raises :class:`SessionLost`."""
        self.check()
        attempts = self._backoff.attempts
        for attempt in range(attempts):
            try:
                status, answer = self.client.post(path, body)
            except TransportError:
                if attempt + 1 == attempts or self._loss is not None:
                    raise
                time.sleep(self._backoff.delay(attempt))
                continue
            if _retryable(status) and attempt + 1 < attempts and self._loss is None:
                time.sleep(self._backoff.delay(attempt))
                continue
            if status == 404 and (answer or {}).get("error") == "session_gone":
                self._lose(GONE)
                raise SessionLost(GONE)
            return status, answer
        raise AssertionError("unreachable")

    def lock(self, key, wait=0.0):
        """Takes the lock ``key``, waiting in line up to ``wait`` seconds; a :class:`LockGuard`.
        Raises :class:`LeaseholdError` with code ``lock_held`` if it stays held."""
        body = {"session_id": self.id, "wait_ms": int(wait * 1000), "request_id": _request_id()}
        status, answer = self._call(f"/v1/locks/{segment(key)}/acquire", body)
        if status != 200:
            raise _error(status, answer)
        return LockGuard(self, key, answer["token"])

    def seat(self, pool, wait=0.0, metadata=None):
        """Takes a seat of ``pool``, waiting up to ``wait`` seconds; a :class:`SeatGuard`.
        Raises :class:`LeaseholdError` with code ``pool_exhausted`` if none frees up."""
        body = {"session_id": self.id, "wait_ms": int(wait * 1000), "request_id": _request_id()}
        if metadata is not None:
            body["metadata"] = metadata
        status, answer = self._call(f"/v1/pools/{segment(pool)}/acquire", body)
        if status != 200:
            raise _error(status, answer)
        return SeatGuard(self, pool, answer["seat_token"])

    def claim(self, queue, wait=0.0):
        """Claims the oldest job of ``queue``, waiting up to ``wait`` seconds; a :class:`Job`,
        or ``None`` when none came. Retried under one ``request_id``: a retry after a lost
        answer gets the job the first attempt claimed, never a second one."""
        body = {"session_id": self.id, "wait_ms": int(wait * 1000), "request_id": _request_id()}
        status, answer = self._call(f"/v1/queues/{segment(queue)}/claim", body)
        if status == 204:
            return None
        if status != 200:
            raise _error(status, answer)
        return Job(self, answer)

    def watch(self, timeout=None):
        """The server's watch of this session (:meth:`Client.watch`)."""
        return self.client.watch(self.id, timeout=timeout)

    def close(self):
        """Stops heartbeating and closes the session, which releases everything it holds."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._inflight is not None:
            self._inflight.set()
        self._thread.join()
        try:
            for attempt in range(self._backoff.attempts):
                try:
                    status, answer = self.client.request("DELETE", f"/v1/sessions/{segment(self.id)}")
                except TransportError:
                    if attempt + 1 == self._backoff.attempts:
                        raise
                    time.sleep(self._backoff.delay(attempt))
                    continue
                if _retryable(status) and attempt + 1 < self._backoff.attempts:
                    time.sleep(self._backoff.delay(attempt))
                    continue
                if status != 200:
                    raise _error(status, answer)
                return
        finally:
            self._lose(CLOSED)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _Guard:
    def __init__(self, session, token):
        self.session = session
        self.token = token
        self.held = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.held:
            try:
                self.release()
            except SessionLost:
                pass  # the session's end released it already
        return False

    def _give_back(self, path, body):
        """Releases through ``path``; nothing to do once the session is lost (its end
        released everything)."""
        self.held = False
        if self.session.loss is not None:
            return
        status, answer = self.session._call(path, body)
        if status != 200:
            raise _error(status, answer)


class LockGuard(_Guard):
    """A held lock: ``key`` and ``token`` (the fencing token). Given back on leaving ``with``."""

    def __init__(self, session, key, token):
        super().__init__(session, token)
        self.key = key

    def release(self):
        body = {"session_id": self.session.id, "token": self.token, "request_id": _request_id()}
        self._give_back(f"/v1/locks/{segment(self.key)}/release", body)


class SeatGuard(_Guard):
    """A held seat: ``pool`` and ``token`` (the seat token). Given back on leaving ``with``."""

    def __init__(self, session, pool, token):
        super().__init__(session, token)
        self.pool = pool

    def release(self):
        body = {"session_id": self.session.id, "seat_token": self.token, "request_id": _request_id()}
        self._give_back(f"/v1/pools/{segment(self.pool)}/release", body)


class Job(_Guard):
    """A claimed job: ``id``, ``token``, ``payload``, ``attempt``, ``kind``. Finish it with
    :meth:`complete` or :meth:`fail`; leaving ``with`` unfinished hands it back to the head of
    its queue."""

    def __init__(self, session, answer):
        super().__init__(session, answer["token"])
        self.id = answer["job_id"]
        self.queue = answer.get("queue")
        self.payload = answer.get("payload")
        self.attempt = answer.get("attempt", 1)
        self.kind = answer.get("kind")

    def _finish(self, verb, extra):
        self.held = False
        body = {"session_id": self.session.id, "token": self.token, "request_id": _request_id()}
        body.update(extra)
        status, answer = self.session._call(f"/v1/jobs/{segment(self.id)}/{verb}", body)
        if status != 200:
            raise _error(status, answer)

    def complete(self, result=None):
        """Marks the job done with ``result``. Retried under one ``request_id``: a retry after
        a lost answer gets the first answer, not ``stale_token``."""
        self._finish("complete", {"result": result})

    def fail(self, reason="failed by worker"):
        """Marks the job failed for good (a dead letter). Retried like :meth:`complete`."""
        self._finish("fail", {"reason": reason[:4096]})

    def release(self):
        """Hands the job back to the head of its queue."""
        self.held = False
        if self.session.loss is not None:
            return
        self._finish("release", {})


def work(session, queue, handler, stop=None, wait=10.0):
    """Runs ``handler(job)`` for each job claimed from ``queue`` until ``stop`` (a
    :class:`threading.Event`) is set or the session is lost; returns how many jobs it finished.

    The session heartbeats in the background while the handler runs; a long handler should
    call ``job.session.check()`` between steps. What the handler returns is the job's result
    (``complete``); an exception fails the job with the exception's text. On shutdown — a
    ``KeyboardInterrupt`` or ``SystemExit`` inside the handler — the job is handed back to the
    head of its queue and the exception raised again. A lost session raises
    :class:`SessionLost`: the server settles the job when it ends the session.
    """
    stop = stop or threading.Event()
    finished = 0
    while not stop.is_set():
        session.check()
        job = session.claim(queue, wait=wait)
        if job is None:
            continue
        try:
            result = handler(job)
        except (KeyboardInterrupt, SystemExit):
            job.release()
            raise
        except SessionLost:
            raise
        except Exception as e:  # the handler's failure is the job's, not the loop's
            session.check()
            job.fail(f"{type(e).__name__}: {e}")
        else:
            session.check()
            job.complete(result)
        finished += 1
    return finished
