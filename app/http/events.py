"""Server-sent events of one job (GET /api/v1/jobs/<id>/events), read from the job's event stream in Redis.

The lifecycle appends every transition to that stream in the same atomic step as it publishes it
(app/control/lifecycle.py), so a client that reconnects with `Last-Event-ID` is replayed exactly what it missed; the
pub/sub channel could not do that. Under gunicorn's gthread workers an open response holds one thread, so a
stream is bounded: it ends when the job ends (`event: end`), after ENCORE_SSE_MAX_S (the client resumes with
the last id it saw), or when a heartbeat comment finds its client gone (the write fails and the server closes
the generator).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable, Iterator

import redis

from app.control.jobs import JobStore
from app.core.kinds import JOB_END_STATES

EVENT_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}", re.ASCII)  # a Redis Stream entry id, matched whole
RETRY_MS = 2000  # how long an EventSource waits before it reconnects (with Last-Event-ID)
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer the stream
FIRST = "0-0"


def valid_event_id(value: str) -> bool:
    return bool(EVENT_ID.fullmatch(value))


def frame(data: dict[str, Any], event_id: str | None = None, event: str | None = None) -> str:
    """One SSE message: its optional event name and id, and the JSON on a single data line."""
    head = (f"event: {event}\n" if event else "") + (f"id: {event_id}\n" if event_id else "")
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n"


def end_frame(job_id: str, state: str) -> str:
    """The last message: the job's final state (an EventSource must close on it, or it reconnects)."""
    return frame({"job_id": job_id, "state": state}, event="end")


def job_events(
    jobs: JobStore,
    job_id: str,
    after: str,
    *,
    job_state: str,
    heartbeat_s: float,
    max_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[str]:
    """The SSE body: the job's events after `after` (all kept ones from "0-0"), then every new one as it is
    appended, a comment every `heartbeat_s`, and `event: end` once the job has ended."""
    yield f"retry: {RETRY_MS}\n\n"
    deadline = clock() + max_s
    last = after
    ended = job_state in JOB_END_STATES
    try:
        while True:
            remaining = deadline - clock()
            if remaining <= 0:
                return  # bounded: the client resumes from `last`
            wait = None if ended else max(1, int(min(heartbeat_s, remaining) * 1000))
            entries = jobs.events_after(job_id, last, block_ms=wait)
            for entry_id, event in entries:
                last = entry_id
                yield frame(event, entry_id)
                if event.get("job_state") in JOB_END_STATES:
                    ended, job_state = True, event["job_state"]
            if ended and not entries:
                yield end_frame(job_id, job_state)
                return
            if not entries:
                current = _current_state(jobs, job_id)
                if current is None:
                    yield end_frame(job_id, "expired")
                    return
                job_state = current
                ended = job_state in JOB_END_STATES  # its last event was trimmed away: drained next round
                yield ": heartbeat\n\n"  # a gone client makes this write fail, which ends the stream
    except redis.RedisError:
        return  # the client reconnects and resumes once Redis answers again


def _current_state(jobs: JobStore, job_id: str) -> str | None:
    record = jobs.record(job_id)
    return record["state"] if record else None
