"""Reading and acting on jobs: list, read, follow (server-sent events), cancel, retry, download results."""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any
from urllib.parse import urlencode

from flask import Blueprint, Response, jsonify, redirect, request, send_file
from flask.typing import ResponseReturnValue

from app.control.eta import polled_record
from app.control.streams import TICKET_S, make_ticket, ticket_secret
from app.http.events import (
    EVENT_ID_PATTERN,
    HEADERS as SSE_HEADERS,
    STREAMS_RETRY_S,
    client_gone_probe,
    job_events,
    released,
    valid_event_id,
)
from app.http.context import context
from app.http.guards import tenant
from app.control.tenant_limits import limits_for, tenant_admission
from app.http.replies import error, job_not_found
from app.core.joblog import job_event
from app.http.openapi import DOWNLOAD_REPLIES, documented
from app.control.recovery import RetryLimit, RetryRefused, retry_job
from app.http.schemas import JobList, JobReply, RetryReply
from app.control.services import Services
from app.core.tenants import Tenant

log = logging.getLogger("encore.web")
blueprint = Blueprint("jobs", __name__)

TRACK_FILE = re.compile(r"(0|[1-9][0-9]{0,2})\.(mp3|wav)", re.ASCII)  # matched whole: no "000.mp3", no "٠.mp3"
LIMIT = re.compile(r"[0-9]{1,6}", re.ASCII)
MAX_LISTED = 500
MAX_OFFSET = 10_000  # a page this deep reads offset + limit ids from the index
MAX_SEARCHED = 1000  # a search reads the records of the newest jobs, this many at most
MAX_QUERY = 100
MEDIA_TYPES = {"mp3": "audio/mpeg", "wav": "audio/wav", "mp4": "video/mp4"}
SSE_EVENT = {
    "type": "object",
    "description": "one server-sent event",
    "properties": {  # what clients parse
        "event": {"type": "string", "enum": ["message", "end"]},
        "id": {"type": "string"},
        "data": {"type": "string", "description": "a JSON object: the track event, or (end) the job's final state"},
        "retry": {"type": "integer"},
    },
}
LAST_EVENT_ID = {
    "Last-Event-ID": {
        "type": "string",
        "pattern": f"^({EVENT_ID_PATTERN})?$",  # empty: from the start; each part at most 2**64 - 1
        "description": "the `id:` of the last event received: only later ones are sent",
    }
}


@blueprint.get("/api/v1/jobs/<job_id>/video.mp4")
@documented(
    "Download a lip-sync job's video (Range requests honoured)",
    media=("video/mp4",),
    responses={**DOWNLOAD_REPLIES, 404: "unknown job, or not done"},
)
def download_video(job_id: str) -> ResponseReturnValue:
    """The lip-sync output."""
    return _serve_artifact(context().services, job_id, 0, "output.mp4", "mp4")


@blueprint.get("/api/v1/jobs")
@documented(
    "Recent jobs, newest first; a page of them (`offset`), or those matching a search (`q`)",
    responses={
        200: ("the jobs", JobList),
        400: (
            f"`limit` is not a whole number from 1 to {MAX_LISTED}, `offset` not one from 0 to {MAX_OFFSET}, "
            f"or `q` is longer than {MAX_QUERY} characters"
        ),
    },
    query={
        "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LISTED, "default": 50},
        "offset": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_OFFSET,
            "default": 0,
            "description": "jobs to skip (of those that match `q`, with one): the next page starts at offset + limit",
        },
        "q": {
            "type": "string",
            "maxLength": MAX_QUERY,
            "description": (
                "a search: every word (case-insensitive) matches the job id's start, the kind, the state, the "
                f"mode, or a part of the tags or prompt; among the newest {MAX_SEARCHED} jobs"
            ),
        },
    },
)
def list_jobs() -> ResponseReturnValue:
    """Recent jobs, newest first (?limit=50, at most 500; ?offset=N skips the newest N; ?q= searches): a value
    out of range is refused, not clamped. A client tenant lists its own jobs; an admin every tenant's."""
    svc = context().services
    viewer = tenant()
    raw = request.args.get("limit", "50")
    if not LIMIT.fullmatch(raw) or not 1 <= int(raw) <= MAX_LISTED:
        return error(400, f"limit: must be a whole number from 1 to {MAX_LISTED}, not {raw[:20]!r}", "limit")
    limit = int(raw)
    raw = request.args.get("offset", "0")
    if not LIMIT.fullmatch(raw) or int(raw) > MAX_OFFSET:
        return error(400, f"offset: must be a whole number from 0 to {MAX_OFFSET}, not {raw[:20]!r}", "offset")
    offset = int(raw)
    query = request.args.get("q", "")
    if len(query) > MAX_QUERY:
        return error(400, f"q: at most {MAX_QUERY} characters, not {len(query)}", "q")
    words = query.lower().split()
    owner = None if viewer.is_admin else viewer.name
    if not words:
        ids = svc.jobs.recent_job_ids(offset + limit, tenant=owner)[offset:]
    else:
        found = _search(svc, svc.jobs.recent_job_ids(MAX_SEARCHED, tenant=owner), viewer, words, offset + limit)
        ids = [record["job_id"] for record in found[offset:]]
    bodies = [body for body in (polled_record(svc, job_id, viewer) for job_id in ids) if body is not None]
    return Response('{"jobs":[' + ",".join(bodies) + "]}\n", mimetype="application/json")


def _search(svc: Services, ids: list[str], viewer: Tenant, words: list[str], wanted: int) -> list[dict[str, Any]]:
    """The records, newest first, that match every word, until `wanted` of them were found."""
    found: list[dict[str, Any]] = []
    for job_id in ids:
        record = svc.jobs.record(job_id, viewer=viewer)
        if record and all(_matches(record, word) for word in words):
            found.append(record)
            if len(found) >= wanted:
                break
    return found


def _matches(record: dict[str, Any], word: str) -> bool:
    """One search word against one job: its id's start, its kind, state or mode, or a part of its tags or prompt."""
    params = record.get("params") or {}
    if record["job_id"].startswith(word) or word in (record["kind"], record["state"], str(params.get("mode", ""))):
        return True
    return any(isinstance(text, str) and word in text.lower() for text in (params.get("tags"), params.get("prompt")))


@blueprint.get("/api/v1/jobs/<job_id>")
@documented("A job's record", responses={200: ("the record", JobReply), 404: "unknown job"})
def get_job(job_id: str) -> ResponseReturnValue:
    """A job's record: state, queue position, per-track stages and progress, downloads."""
    body = polled_record(context().services, job_id, tenant())
    if body is None:
        return job_not_found(job_id)
    # Built by the read itself (app/control/lua/read_job.lua): served as it is.
    return Response(body, mimetype="application/json")


@blueprint.get("/api/v1/jobs/<job_id>/events")
@documented(
    "The job's state and progress changes as server-sent events, until it ends",
    media=("text/event-stream",),
    headers=LAST_EVENT_ID,
    responses={
        200: (
            (
                "`retry:`, then per change `id:` + `data:` (the track's state, progress, detail and "
                "the job's `job_state`), a `: heartbeat` comment while nothing changes, and "
                "`event: end` when the job has ended"
            ),
            SSE_EVENT,
        ),
        307: ("to the events server (ENCORE_EVENTS_URL), with a ticket in the query", None),
        400: "Last-Event-ID is not an event id",
        404: "unknown job",
        429: "`streams`: this web process serves as many streams as it may, or the tenant holds its share (Retry-After)",
    },
)
def job_events_stream(job_id: str) -> ResponseReturnValue:
    """Every transition of the job's tracks as SSE; a reconnect with Last-Event-ID replays what it missed. Behind
    the events server (ENCORE_EVENTS_URL) the checks are made here and the stream is a 307 there, with a ticket
    that stands for the token (a redirect to another origin drops the Authorization header); otherwise this
    process serves it, at most half its threads' worth of streams at once and at most half of those for one tenant
    (429 `streams` past that)."""
    shared = context()
    viewer = tenant()
    record = shared.services.jobs.record(job_id, viewer=viewer)
    if record is None:
        return job_not_found(job_id)
    after = request.headers.get("Last-Event-ID", "").strip()
    if after and not valid_event_id(after):
        return error(400, "Last-Event-ID: expected an event id such as 1700000000000-0", "Last-Event-ID")
    if shared.settings.events_url:
        return _to_events_server(shared.settings.events_url, job_id, viewer.name)
    leave = shared.streams.enter(viewer.name)
    if leave is None:
        why = shared.streams.refusal(viewer.name) or "no event stream place is free"
        reply, status = error(429, f"streams: {why}; retry later, or poll the job", "streams")
        reply.headers["Retry-After"] = str(STREAMS_RETRY_S)
        return reply, status
    stream = job_events(
        shared.services.jobs,
        job_id,
        after or "0-0",
        job_state=record["state"],
        heartbeat_s=shared.settings.sse_heartbeat_s,
        max_s=shared.settings.sse_max_s,
        reader=shared.stream_redis,
        client_gone=client_gone_probe(request.environ),
    )
    response = Response(released(stream, leave), mimetype="text/event-stream", headers=SSE_HEADERS)
    response.call_on_close(leave)  # the server closes the body when it ends or its client is gone
    return response


def _to_events_server(events_url: str, job_id: str, tenant_name: str) -> ResponseReturnValue:
    """307 (the method and headers, Last-Event-ID among them, are kept) to the events server, with a ticket."""
    shared = context()
    svc = shared.services
    # A browser's EventSource reconnects to the redirected URL, not to this one (Chromium, tests/test_web_page.py),
    # sending Last-Event-ID there: the ticket outlives the longest stream, so its reconnect is still admitted.
    ttl_s = shared.settings.sse_max_s + TICKET_S
    ticket = make_ticket(ticket_secret(svc.redis, svc.jobs.keys), job_id, tenant_name, time.time(), ttl_s)
    response = redirect(f"{events_url}/api/v1/jobs/{job_id}/events?{urlencode({'ticket': ticket})}", 307)
    response.headers["Cache-Control"] = "no-store"  # a ticket is a credential: never cache the redirect
    return response


@blueprint.delete("/api/v1/jobs/<job_id>")
@documented("Cancel a job", responses={200: ("the record, cancel requested", JobReply), 404: "unknown job"})
def cancel_job(job_id: str) -> ResponseReturnValue:
    """Cancel a job: queued stages never start, a running stage stops within seconds."""
    shared = context()
    svc = shared.services
    if not svc.jobs.visible(job_id, tenant()):
        return job_not_found(job_id)
    task_ids = svc.jobs.request_cancel(job_id)
    if task_ids:
        shared.celery.control.revoke(task_ids)
    job_event(log, "cancel_requested", job_id)
    body = polled_record(svc, job_id)
    if body is None:  # expired since the check above
        return job_not_found(job_id)
    return Response(body, mimetype="application/json")


@blueprint.post("/api/v1/jobs/<job_id>/retry")
@documented(
    "Re-run a job's failed or canceled tracks from their first unfinished stage (same seed)",
    responses={
        200: ("the record, the tracks queued again (each counts it in `retries`)", RetryReply),
        403: "a track was retried ENCORE_MAX_RETRIES (or its tenant's limit) times already (`field`: retries)",
        404: "unknown job",
        429: "its tenant has as many tracks open as it may (`field`: tracks; Retry-After)",
        409: "the job is still running, or no track failed or was canceled",
    },
)
def retry(job_id: str) -> ResponseReturnValue:
    """Queue a failed or canceled job's unfinished tracks again (the recovery module decides which)."""
    shared = context()
    record = shared.services.jobs.record(job_id, viewer=tenant())
    if record is None:
        return job_not_found(job_id)
    owner = shared.settings.tenants.named(shared.services.jobs.owner(job_id) or "")  # an admin's retry: the owner's
    reopened = sum(t["status"] in ("failed", "canceled") for t in record["tracks"])
    try:
        with tenant_admission(shared.services, owner, reopened):  # retried tracks count as open again
            retried = retry_job(shared.services, shared.celery, job_id, limits_for(shared.settings, owner).max_retries)
    except KeyError:
        return job_not_found(job_id)
    except RetryLimit as exc:
        return error(403, f"retries: {exc}", "retries")
    except RetryRefused as exc:
        return error(409, f"job: {exc}", "job")
    body = polled_record(shared.services, job_id)
    if body is None:  # expired since the retry
        return job_not_found(job_id)
    return jsonify({**json.loads(body), "retried": retried})


@blueprint.get("/api/v1/jobs/<job_id>/tracks/<file_name>")
@documented(
    "Download a music track as <i>.mp3 or <i>.wav (Range requests honoured)",
    media=("audio/mpeg", "audio/wav"),
    responses={**DOWNLOAD_REPLIES, 404: "unknown job, track or file name, or not done"},
)
def download_track(job_id: str, file_name: str) -> ResponseReturnValue:
    """A music track's file, named <track>.mp3 or <track>.wav."""
    match = TRACK_FILE.fullmatch(file_name)
    if not match:
        return error(404, "file: expected <track>.mp3 or <track>.wav", "file")
    index, fmt = int(match.group(1)), match.group(2)
    return _serve_artifact(context().services, job_id, index, f"track{index}.{fmt}", fmt)


def _serve_artifact(svc: Services, job_id: str, index: int, name: str, fmt: str) -> ResponseReturnValue:
    """A finished track's file (Range requests honoured); 404 until the track is done."""
    record = svc.jobs.record(job_id, viewer=tenant())
    if record is None:
        return job_not_found(job_id)
    if index >= record["num_tracks"]:
        return error(404, f"track: job has {record['num_tracks']} tracks", "track")
    track = record["tracks"][index]
    if track["state"] != "done":
        return error(404, f"track {index} is {track['state']}, not done", "track")
    if name not in track["artifacts"]:
        hint = (
            f" (a lip-sync job: its result is /api/v1/jobs/{job_id}/video.mp4)" if record["kind"] == "lipsync" else ""
        )
        return error(404, f"track {index} has no file {name}{hint}", "file")
    download_name = f"encore-{job_id[:8]}-{name}"
    presigned = svc.artifacts.presigned_url(job_id, name, download_name)
    if presigned:  # the object store serves it (and its Range requests) itself
        return redirect(presigned, code=302)
    path = svc.artifacts.local_path(job_id, name)
    return send_file(path, mimetype=MEDIA_TYPES[fmt], conditional=True, download_name=download_name)
