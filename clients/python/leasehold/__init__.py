"""Client for Leasehold, standard library only.

- :class:`Client`: one HTTP call, one answer, no retries.
- :class:`Session`: a session that heartbeats on a background thread and keeps a *local
  deadline* — the send time of the last successful heartbeat, plus what the server said it
  honours (``safe_for_ms``, at most the TTL), minus a margin — which always falls before the
  server's own deadline. When it passes without a good heartbeat, or a heartbeat answers
  ``session_gone``, the session is lost: :meth:`Session.check` raises, :meth:`Session.wait_lost`
  returns, and the ``on_lost`` callback runs.
- Guards, used as context managers: :meth:`Session.lock`, :meth:`Session.seat`,
  :meth:`Session.claim` (a :class:`Job`), each given back on leaving the ``with`` block, also
  on an exception.
- :func:`work`: a worker loop for job leases.

Heartbeats, acquires, releases, claims, completes, fails, hand backs, :meth:`Client.enqueue`
and the close are retried with backoff on transport errors and ``503`` answers;
``session_gone`` is terminal and never retried. Every one that changes something sends a
``request_id`` that its retries repeat, so a retry after a lost answer gets the first answer
instead of acting twice.
"""

from .client import (
    Client,
    Job,
    LeaseholdError,
    LockGuard,
    SeatGuard,
    Session,
    SessionLost,
    TransportError,
    Watch,
    WatchEvent,
    work,
)

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
