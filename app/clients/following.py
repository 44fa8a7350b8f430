"""Following a job to its end: through its server-sent events (GET /api/v1/jobs/<id>/events, reopened with
Last-Event-ID when a stream drops), or by polling its record when the server has no stream for it; transient
failures (a web restart, a network blip) are ridden out for RETRY_WINDOW_S. Each record goes to a Reporter."""

from __future__ import annotations

import json
import time
from typing import Any, Iterator, cast

import requests

from app.clients.http_client import ApiError, Client, failure_reason, sse_messages
from app.clients.reporters import Reporter
from app.core.kinds import JOB_END_STATES

RETRY_WINDOW_S = 30.0  # while following a job, ride out a web restart or a network blip this long


def fetch_record(client: Client, job_id: str) -> dict[str, Any]:
    """GET the job record, retrying transient failures (server down, 5xx) for RETRY_WINDOW_S."""
    deadline = time.monotonic() + RETRY_WINDOW_S
    while True:
        try:
            return client.json("GET", f"/api/v1/jobs/{job_id}")
        except ApiError as exc:
            if not exc.transient or time.monotonic() > deadline:
                raise
        time.sleep(1.0)


def follow(client: Client, job_id: str, reporter: Reporter, interval_s: float, events: bool = True) -> dict[str, Any]:
    """Follow the job until it ends, feeding records to the reporter: through its server-sent events, or by
    polling when the server has none (an older Encore, a proxy that refuses streams) or `events` is off."""
    if events:
        try:
            return follow_events(client, job_id, reporter, interval_s)
        except StreamUnavailable as exc:
            reporter.note(f"following job {job_id[:8]} by polling ({exc})")
    return poll(client, job_id, reporter, interval_s)


def poll(client: Client, job_id: str, reporter: Reporter, interval_s: float) -> dict[str, Any]:
    """Poll the job until it ends, feeding every record to the reporter."""
    while True:
        record = fetch_record(client, job_id)
        reporter.update(record)
        if record["state"] in JOB_END_STATES:
            return record
        time.sleep(interval_s)


class StreamUnavailable(Exception):
    """The server answers no event stream for the job (or it keeps failing): poll instead."""


EVENT_STREAM_READ_S = 60.0  # several heartbeats: a stream silent this long is dead, and is reopened
EVENT_STREAM_RETRIES = 3


def follow_events(client: Client, job_id: str, reporter: Reporter, interval_s: float) -> dict[str, Any]:
    """Follow GET /api/v1/jobs/<id>/events to `event: end`: each event updates its track in the last record
    (a full record is fetched at most every `interval_s`, and at the end); a dropped stream is reopened with
    Last-Event-ID, so nothing is missed."""
    record = fetch_record(client, job_id)
    reporter.update(record)
    if record["state"] in JOB_END_STATES:
        return record
    reporter.note(f"following job {job_id[:8]} via server-sent events")
    last_id: str | None = None
    fetched, failures = time.monotonic(), 0
    while True:
        headers = {"Accept": "text/event-stream", **({"Last-Event-ID": last_id} if last_id else {})}
        try:
            with client.session.get(
                client.url(f"/api/v1/jobs/{job_id}/events"),
                headers=headers,
                stream=True,
                timeout=(client.timeout_s, EVENT_STREAM_READ_S),
            ) as reply:
                if reply.status_code != 200 or not reply.headers.get("Content-Type", "").startswith(
                    "text/event-stream"
                ):
                    raise StreamUnavailable(f"events answered HTTP {reply.status_code}")
                # chunk_size=None: each line as soon as it arrives (requests allows it; its stubs do not)
                lines = cast(Iterator[str], reply.iter_lines(chunk_size=None, decode_unicode=True))  # type: ignore[call-overload]
                for event, event_id, data in sse_messages(lines):
                    if event == "end":
                        record = fetch_record(client, job_id)
                        reporter.update(record)
                        return record
                    last_id, failures = event_id or last_id, 0
                    if time.monotonic() - fetched >= interval_s:
                        record, fetched = fetch_record(client, job_id), time.monotonic()
                    else:
                        record = with_event(record, json.loads(data))
                    reporter.update(record)
        except requests.RequestException as exc:
            failures += 1
            if failures > EVENT_STREAM_RETRIES:
                raise StreamUnavailable(f"the event stream kept failing: {failure_reason(exc)}") from exc
            time.sleep(1.0)
        # the stream ended without `end` (its server-side bound, a restart): reopen it where it stopped


def with_event(record: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """The record with one track event applied (its state, progress, detail, error, version), and the job's
    state. An event no newer than what the record shows of its track (the track's `version`) changes nothing: a
    stream opened from its start replays the job's history, and what a client shows only moves forward."""
    track = next((t for t in record["tracks"] if t["track"] == event.get("track")), None)
    if track is None or int(event.get("version") or 0) <= int(track.get("version") or 0):
        return record
    fields = ("state", "status", "stage", "progress", "detail", "error", "version")
    tracks = [dict(t, **{k: event[k] for k in fields if k in event}) if t is track else t for t in record["tracks"]]
    return {**record, "tracks": tracks, "state": event.get("job_state", record["state"])}
