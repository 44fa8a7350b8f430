"""Server-sent events of one job (GET /api/v1/jobs/<id>/events), read from the job's event stream in Redis.

The lifecycle appends every transition to that stream in the same atomic step as it publishes it
(app/control/lifecycle.py), so a client that reconnects with `Last-Event-ID` is replayed exactly what it missed; the
pub/sub channel could not do that. A stream is bounded: it ends when the job ends (`event: end`), after
ENCORE_SSE_MAX_S (the client resumes with the last id it saw), or when a heartbeat comment finds its client gone
(the write fails and the server closes the stream).

Two servers send the same body: the gunicorn web (`job_events`, one thread per open stream, capped per process) and
the asyncio events server (app/http/events_server.py, where a stream costs a coroutine). Both drive one
`EventCursor`, which holds every rule of the body and does no I/O, so they cannot drift apart.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator

import redis

from app.control.jobs import JobStore
from app.core.kinds import JOB_END_STATES


def decimal_at_most(limit: int) -> str:
    """A regular expression that matches exactly the decimal numerals (leading zeros allowed, as many digits as
    `limit` has at most) whose value is at most `limit`: every shorter numeral, and of the full-width ones those
    that fall below `limit` at their first differing digit, or are `limit` itself. One expression, so that the
    server and the OpenAPI document (which has only a pattern to say it) refuse the same ids."""
    digits = str(limit)
    width = len(digits)
    alternatives = [f"[0-9]{{1,{width - 1}}}"] if width > 1 else []
    for index, digit in enumerate(digits):
        if digit != "0":
            rest = width - index - 1
            alternatives.append(f"{digits[:index]}[0-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(digits)
    return "(?:" + "|".join(alternatives) + ")"


EVENT_ID_PART_MAX = 2**64 - 1  # each part of a Redis Stream id is an unsigned 64-bit number
EVENT_ID_PATTERN = f"{decimal_at_most(EVENT_ID_PART_MAX)}-{decimal_at_most(EVENT_ID_PART_MAX)}"
EVENT_ID = re.compile(EVENT_ID_PATTERN, re.ASCII)  # a Redis Stream entry id, matched whole
RETRY_MS = 2000  # how long an EventSource waits before it reconnects (with Last-Event-ID)
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer the stream
FIRST = "0-0"
OPENING = f"retry: {RETRY_MS}\n\n"
HEARTBEAT = ": heartbeat\n\n"  # a gone client makes this write fail, which ends the stream


STREAMS_RETRY_S = 5  # Retry-After of a 429 `streams`: streams end (and free their slots) all the time


class StreamGate:
    """The most event streams one web process serves at once: each holds a gthread thread for as long as it is
    open, so past `limit` a stream is refused (429) rather than let streams take the threads /healthz and the
    polls need. Not needed behind the events server (ENCORE_EVENTS_URL), where the web only redirects.

    The places are shared between tenants: one tenant holds at most `per_tenant` of them (half, where the
    deployment has tenants), so another tenant's first stream still finds a place however many one tenant opens."""

    def __init__(self, limit: int, per_tenant: int | None = None):
        self.limit = limit
        self.per_tenant = limit if per_tenant is None else per_tenant
        self.open = 0
        self.held: Counter[str] = Counter()
        self._lock = threading.Lock()

    @classmethod
    def for_threads(cls, threads: int, shared: bool = True) -> "StreamGate":
        """At most half of a process's threads (and at least one stream); when `shared` (several tenants), at most
        half of those for one tenant."""
        limit = max(1, threads // 2)
        return cls(limit, max(1, limit // 2) if shared else limit)

    def refusal(self, tenant: str) -> str | None:
        """Why `tenant` would be refused a place now (None: it would get one)."""
        if self.open >= self.limit:
            return f"this web process already serves {self.limit} event streams (half its threads)"
        if self.held[tenant] >= self.per_tenant:
            return f"tenant {tenant} already holds {self.per_tenant} of this web process's event streams (its share)"
        return None

    def enter(self, tenant: str = "default") -> Callable[[], None] | None:
        """A place for one of `tenant`'s streams, or None when all are taken or the tenant holds its share. The
        place is given back by the function returned, which may be called any number of times (the body's end and
        the server's close both call it)."""
        with self._lock:
            if self.refusal(tenant) is not None:
                return None
            self.open += 1
            self.held[tenant] += 1
        left = threading.Event()

        def leave() -> None:
            with self._lock:
                if not left.is_set():
                    left.set()
                    self.open -= 1
                    self.held[tenant] -= 1
                    if not self.held[tenant]:
                        del self.held[tenant]

        return leave


def released(body: Iterator[str], leave: Callable[[], None]) -> Iterator[str]:
    """`body`, giving its place back when it ends or is closed (a test client may never close the response)."""
    try:
        yield from body
    finally:
        leave()


def read_timeout_s(heartbeat_s: float) -> float:
    """The read timeout of a Redis client that serves streams: a stream's XREAD blocks up to `heartbeat_s`, and
    redis-py's default timeout (5 s) would end every stream quieter than that with a TimeoutError."""
    return heartbeat_s + 5


def valid_event_id(value: str) -> bool:
    """A Redis Stream entry id: `<ms>-<seq>`, each part at most 2**64 - 1 (Redis refuses more)."""
    return bool(EVENT_ID.fullmatch(value))


def frame(data: dict[str, Any], event_id: str | None = None, event: str | None = None) -> str:
    """One SSE message: its optional event name and id, and the JSON on a single data line."""
    head = (f"event: {event}\n" if event else "") + (f"id: {event_id}\n" if event_id else "")
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n"


def end_frame(job_id: str, state: str) -> str:
    """The last message: the job's final state (an EventSource must close on it, or it reconnects)."""
    return frame({"job_id": job_id, "state": state}, event="end")


class EventCursor:
    """Where one stream stands, without I/O. Its driver loops while not `over`: reads the job's events after `last`
    waiting up to `block_ms()` (None: do not wait), sends what `take` returns, and when `needs_state` sends what
    `idle` returns for the job's current state (None: the job is gone). The rules: replay from `after`, every new
    event as it is appended, a heartbeat comment every `heartbeat_s` while nothing happens, and `event: end` once
    the job has ended (also when its last event was trimmed away, or the job expired) and nothing came after:
    an end that a later event undoes (a retry replayed after the cancel it follows) ends nothing; the body ends
    after `max_s` without `end`, and the client resumes from the last id it saw."""

    def __init__(
        self,
        job_id: str,
        after: str,
        *,
        job_state: str,
        heartbeat_s: float,
        max_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.job_id = job_id
        self.last = after
        self.job_state = job_state
        self.ended = job_state in JOB_END_STATES
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.deadline = clock() + max_s
        self.done = False
        self.needs_state = False

    @property
    def over(self) -> bool:
        return self.done or self.clock() >= self.deadline

    def block_ms(self) -> int | None:
        """How long the next read may wait for an event: not at all once the job has ended (what is left is drained)."""
        if self.ended:
            return None
        return max(1, int(min(self.heartbeat_s, self.deadline - self.clock()) * 1000))

    def take(self, entries: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """The frames of what one read returned (`end` after a drained ended job)."""
        frames = []
        for entry_id, event in entries:
            self.last = entry_id
            frames.append(frame(event, entry_id))
            if event.get("job_state"):  # the latest event decides: a retry opens an ended job again
                self.job_state = event["job_state"]
                self.ended = self.job_state in JOB_END_STATES
        if self.ended and not entries:
            frames.append(end_frame(self.job_id, self.job_state))
            self.done = True
        self.needs_state = not entries and not self.done
        return frames

    def idle(self, current: str | None) -> list[str]:
        """After a read that waited in vain: the job's current state decides (gone: `end` as expired; ended with its
        last event trimmed away: drained next round), and a heartbeat shows the stream is alive."""
        self.needs_state = False
        if current is None:
            self.done = True
            return [end_frame(self.job_id, "expired")]
        self.job_state = current
        self.ended = current in JOB_END_STATES
        return [HEARTBEAT]


CLIENT_CHECK_S = 1.0  # how often a stream the web serves looks whether its client is still there


def client_gone_probe(environ: dict[str, Any]) -> Callable[[], bool]:
    """Whether the client of this request has gone (closed its end), asked without reading or blocking: a peek at
    the connection's socket (gunicorn's and werkzeug's servers put it in the environ) reads end-of-file. A server
    that gives no socket, or a TLS socket (no peeking), leaves it to the heartbeat's failed write."""
    sock = environ.get("gunicorn.socket") or environ.get("werkzeug.socket")
    if type(sock) is not socket.socket:  # (an ssl.SSLSocket refuses flags)
        return lambda: False

    def gone() -> bool:
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read: the client is there, waiting
        except OSError:
            return True  # reset, or closed under us

    return gone


def job_events(
    jobs: JobStore,
    job_id: str,
    after: str,
    *,
    job_state: str,
    heartbeat_s: float,
    max_s: float,
    clock: Callable[[], float] = time.monotonic,
    reader: redis.Redis | None = None,
    client_gone: Callable[[], bool] = lambda: False,
    check_s: float = CLIENT_CHECK_S,
) -> Iterator[str]:
    """The SSE body, read with the web's blocking client (see EventCursor for what it holds); `reader`: the client
    of the blocking reads (one whose read timeout outlasts them, `read_timeout_s`), by default the store's. A read
    waits at most `check_s` at a time, and the body ends as soon as `client_gone` says so: the stream's thread
    and place serve another client within about `check_s` of a tab closing, not at the next heartbeat's failed
    write (up to two heartbeats later)."""
    yield OPENING
    cursor = EventCursor(job_id, after, job_state=job_state, heartbeat_s=heartbeat_s, max_s=max_s, clock=clock)
    try:
        while not cursor.over:
            entries = _events_or_gone(jobs, job_id, cursor, reader, client_gone, check_s, clock)
            if entries is None:
                return
            yield from cursor.take(entries)
            if cursor.needs_state:
                yield from cursor.idle(_current_state(jobs, job_id))
    except redis.RedisError:
        return  # the client reconnects and resumes once Redis answers again


def _events_or_gone(
    jobs: JobStore,
    job_id: str,
    cursor: EventCursor,
    reader: redis.Redis | None,
    client_gone: Callable[[], bool],
    check_s: float,
    clock: Callable[[], float],
) -> list[tuple[str, dict[str, Any]]] | None:
    """The next events after the cursor, waiting as long as the cursor allows in reads of at most `check_s`, and
    looking after each empty one whether the client is gone (None then)."""
    block_ms = cursor.block_ms()
    if block_ms is None:
        return jobs.events_after(job_id, cursor.last, block_ms=None, client=reader)
    until = clock() + block_ms / 1000
    while True:
        wait_ms = max(1, int(min(check_s, until - clock()) * 1000))
        entries = jobs.events_after(job_id, cursor.last, block_ms=wait_ms, client=reader)
        if client_gone():
            return None
        if entries or clock() >= until:
            return entries


def _current_state(jobs: JobStore, job_id: str) -> str | None:
    record = jobs.record(job_id)
    return record["state"] if record else None
