"""HTTP API: validates requests, writes job records, routes tracks to GPU queues, serves results.

Speaks HTTP and job records only; no model code is imported here.
"""
from __future__ import annotations

import hmac
import logging
import re
import time
from typing import Any, Callable

import redis
from flask import Flask, Response, has_request_context, jsonify, redirect, request, send_file
from flask_limiter.errors import RateLimitExceeded
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import ClientDisconnected, HTTPException, MethodNotAllowed, RequestEntityTooLarge

from app.celery_app import make_celery
from app import idempotency
from app.config import Settings, load_settings
from app.eta import job_etas, record_with_eta
from app.events import HEADERS as SSE_HEADERS, JOB_END_STATES, job_events, valid_event_id
from app.http_input import BodyError, json_object
from app.joblog import job_event
from app.khala_api import make_blueprint
from app.metrics import make_registry
from app.openapi import DOWNLOAD_REPLIES, TOO_MANY, build_spec, documented
from app.pipeline.profiles import load_lipsync_profile
from app.routing import drain_queue, known_queues, resume_queue, route_job
from app.quotas import QueueFull
from app.ratelimit import install as install_rate_limits
from app.readiness import readiness
from app.recovery import RetryRefused, retry_job
from app.tracing import instrument_flask
from app.webhooks import WebhookRefused, check_target, split_events
from app.schemas import (Accepted, DrainReply, HealthReply, JobList, JobReply, MusicRequest, ReadyReply, RetryReply,
                         StatusReply)
from app.services import Services, build_services
from app.snapshot import take_snapshot
from app.submissions import (RequestError, create_job, longest_song, music_limits,
                             submit_music as submit_music_job, validate_music)
from app.uploads import LipsyncForm, UploadError, receive_lipsync

log = logging.getLogger("encore.web")

TRACK_FILE = re.compile(r"(0|[1-9][0-9]{0,2})\.(mp3|wav)", re.ASCII)  # matched whole: no "000.mp3", no "٠.mp3"
MEDIA_TYPES = {"mp3": "audio/mpeg", "wav": "audio/wav", "mp4": "video/mp4"}
IDEMPOTENCY_HEADER = idempotency.OPENAPI_HEADER
IDEMPOTENT_REPLIES: dict[int, Any] = {
    200: ("an earlier request with this Idempotency-Key made this job", Accepted),
    409: "the Idempotency-Key was used with a different body (or its first request is still running)",
    429: TOO_MANY}
SSE_EVENT = {"type": "object", "description": "one server-sent event", "properties": {  # what clients parse
    "event": {"type": "string", "enum": ["message", "end"]}, "id": {"type": "string"},
    "data": {"type": "string", "description": "a JSON object: the track event, or (end) the job's final state"},
    "retry": {"type": "integer"}}}
LAST_EVENT_ID = {"Last-Event-ID": {"type": "string", "pattern": r"^[0-9]{1,20}-[0-9]{1,20}$",
                                   "description": "the `id:` of the last event received: only later ones are sent"}}


KHALA_BLUEPRINTS = ("khala", "khala_api")
# A lip-sync form has two files and three short fields: a body with more parts, or a text field longer than
# this (Werkzeug also holds its read buffer to it, so it stays well above the 64 KiB chunk), is refused (413)
# while it is parsed.
MAX_FORM_PARTS = 16
MAX_FORM_MEMORY_BYTES = 500_000


def error(status: int, message: str, field: str | None = None):
    """A JSON error body naming the field; on the Khala-compatible routes also `"status": "error"`, which its
    frontend checks (without it a 401 or 5xx reads as accepted, and it polls /job/undefined forever)."""
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    if has_request_context() and request.blueprint in KHALA_BLUEPRINTS:
        body["status"] = "error"
    return jsonify(body), status


def _configure_logging() -> None:
    """Job events (`job=… event=…`) go to stderr at INFO unless the host process configured logging."""
    logger = logging.getLogger("encore")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or load_settings()
    _configure_logging()
    svc = build_services(settings)
    celery_app = make_celery(settings)
    profile = settings.music()
    lipsync_profile = load_lipsync_profile(settings.lipsync_profile, settings.lipsync_model_dir)
    app = Flask(__name__)
    app.json.sort_keys = False  # records keep their field order; sorting every reply costs a poll ~5 %
    app.config["SERVICES"] = svc
    # Bodies larger than both upload limits together are refused before they are read (413).
    app.config["MAX_CONTENT_LENGTH"] = int((settings.max_video_mb + settings.max_audio_mb + 1) * 2**20)
    app.config["MAX_FORM_PARTS"] = MAX_FORM_PARTS
    app.config["MAX_FORM_MEMORY_SIZE"] = MAX_FORM_MEMORY_BYTES
    instrument_flask(app, settings)  # first: the request span wraps the other hooks
    _register_errors(app)
    _time_out_idle_bodies(app, settings.body_idle_s)
    _require_token(app, settings.api_tokens)
    install_rate_limits(app, settings)  # after the token check: an unauthenticated request counts against nobody
    _register_khala_contract(app, svc, celery_app, settings, profile)
    registry = make_registry(svc, dict(celery_app.conf.broker_transport_options or {}))

    @app.get("/metrics")
    @documented("Prometheus exposition: jobs by kind/state, stage durations, queue depths, workers",
                responses={200: ("the metrics, text format 0.0.4", None)}, media=("text/plain",))
    def metrics():
        """Prometheus exposition: jobs by kind/state, stage durations, queue depths, workers (no auth)."""
        return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)  # it names its charset

    @app.get("/")
    @documented("The operator/user page", responses={200: ("the page", None)}, media=("text/html",))
    def index():
        """The operator/user page (static; it talks to the JSON API like any other client)."""
        return app.send_static_file("index.html")

    @app.get("/healthz")
    @documented("Liveness of the web and its Redis", responses={200: ("both up", HealthReply),
                                                               503: "Redis is down"})
    def healthz():
        """Liveness of the web and its Redis."""
        try:
            svc.redis.ping()
        except redis.RedisError as exc:
            return jsonify({"web": "ok", "redis": f"down: {exc}", "error": f"redis: down ({exc})"}), 503
        return jsonify({"web": "ok", "redis": "ok"})

    @app.get("/readyz")
    @documented("Readiness: Redis answers and a live worker has the models of every kind it serves loaded",
                responses={200: ("ready", ReadyReply), 503: "not ready (why in `error`)"})
    def readyz():
        """Readiness for load balancers and orchestrators; liveness is /healthz."""
        ready, body = readiness(svc)
        return jsonify(body), 200 if ready else 503

    @app.post("/api/v1/music")
    @documented("Submit a music job (one chain of stages per track)", json_body=MusicRequest,
                headers=IDEMPOTENCY_HEADER, responses={202: ("accepted", Accepted), **IDEMPOTENT_REPLIES,
                                                       400: "invalid field (named in `field`)"})
    def submit_music():
        key = _idempotency_key()
        try:
            body = json_object(request)
            req = validate_music(body, settings, profile)
        except BodyError as exc:
            return error(400, str(exc), exc.field)
        except RequestError as exc:
            return error(400, str(exc), exc.field)
        try:
            webhook = check_target(req.webhook, req.webhook_events, settings)
        except WebhookRefused as exc:
            return error(400, str(exc), exc.field)
        job_id, replayed = _submit_once(svc, settings, key, lambda: idempotency.json_digest(body),
                                        lambda new_id: submit_music_job(svc, celery_app, req, profile, job_id=new_id,
                                                                        webhook=webhook))
        return _accepted(svc, job_id, replayed)

    @app.post("/api/v1/lipsync")
    @documented("Submit a lip-sync job (face video + driving audio)", form=LipsyncForm, files=("video", "audio"),
                headers=IDEMPOTENCY_HEADER,
                responses={202: ("accepted", Accepted), **IDEMPOTENT_REPLIES,
                           400: "invalid field or media (named in `field`)", 413: "a file, or the whole body, is too large"})
    def submit_lipsync():
        key = _idempotency_key()
        if not request.mimetype == "multipart/form-data":
            return error(400, "body: expected multipart/form-data with video and audio files", "body")
        try:
            form, files = request.form.to_dict(), request.files.to_dict()
        except RequestEntityTooLarge:
            if (request.content_length or 0) > app.config["MAX_CONTENT_LENGTH"]:
                raise
            return error(413, f"body: at most {MAX_FORM_PARTS} form parts, and form fields (besides the files) "
                              f"of at most {MAX_FORM_MEMORY_BYTES} bytes", "body")
        try:
            webhook = check_target(form.get("webhook"), split_events(form.get("webhook_events")), settings)
            upload = receive_lipsync(form, files, settings, lipsync_profile)
        except WebhookRefused as exc:
            return error(400, str(exc), exc.field)
        except UploadError as exc:
            return error(exc.status, str(exc), exc.field)
        def create(new_id: str | None) -> str:
            job_id = create_job(svc, "lipsync", upload.params, [{}], float(upload.params["audio_duration_s"]),
                                job_id=new_id, webhook=webhook, frames=upload.params["output_frames"],
                                audio_s=round(upload.params["audio_duration_s"], 3))
            for path in upload.files.values():
                svc.artifacts.put(job_id, path.name, path, settings.job_ttl_s)
            route_job(svc, celery_app, job_id, 1)
            return job_id

        try:
            job_id, replayed = _submit_once(svc, settings, key, lambda: idempotency.form_digest(
                form, upload.files.items()), create)
        finally:
            upload.discard()
        return _accepted(svc, job_id, replayed)

    @app.get("/api/v1/jobs/<job_id>/video.mp4")
    @documented("Download a lip-sync job's video (Range requests honoured)", media=("video/mp4",),
                responses={**DOWNLOAD_REPLIES, 404: "unknown job, or not done"})
    def download_video(job_id: str):
        """The lip-sync output."""
        return _serve_artifact(svc, job_id, 0, "output.mp4", "mp4")

    @app.get("/api/v1/jobs")
    @documented("Recent jobs, newest first", responses={200: ("the jobs", JobList)},
                query={"limit": {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}})
    def list_jobs():
        """Recent jobs, newest first (?limit=50, at most 500)."""
        limit = min(max(request.args.get("limit", 50, type=int) or 50, 1), 500)
        records = [svc.jobs.record(job_id) for job_id in svc.jobs.recent_job_ids(limit)]
        return jsonify({"jobs": _with_eta(svc, [r for r in records if r])})

    @app.get("/api/v1/jobs/<job_id>")
    @documented("A job's record", responses={200: ("the record", JobReply), 404: "unknown job"})
    def get_job(job_id: str):
        """A job's record: state, queue position, per-track stages and progress, downloads."""
        record, eta_s = record_with_eta(svc, job_id)
        if record is None:
            return error(404, f"job {job_id} not found")
        return jsonify({**_public(record), "eta_s": eta_s})

    @app.get("/api/v1/jobs/<job_id>/events")
    @documented("The job's state and progress changes as server-sent events, until it ends",
                media=("text/event-stream",), headers=LAST_EVENT_ID,
                responses={200: ("`retry:`, then per change `id:` + `data:` (the track's state, progress, detail and "
                                 "the job's `job_state`), a `: heartbeat` comment while nothing changes, and "
                                 "`event: end` when the job has ended", SSE_EVENT),
                           400: "Last-Event-ID is not an event id", 404: "unknown job"})
    def job_events_stream(job_id: str):
        """Every transition of the job's tracks as SSE; a reconnect with Last-Event-ID replays what it missed."""
        record = svc.jobs.record(job_id)
        if record is None:
            return error(404, f"job {job_id} not found")
        after = request.headers.get("Last-Event-ID", "").strip()
        if after and not valid_event_id(after):
            return error(400, "Last-Event-ID: expected an event id such as 1700000000000-0", "Last-Event-ID")
        stream = job_events(svc.jobs, job_id, after or "0-0", job_state=record["state"],
                            heartbeat_s=settings.sse_heartbeat_s, max_s=settings.sse_max_s)
        return Response(stream, mimetype="text/event-stream", headers=SSE_HEADERS)

    @app.delete("/api/v1/jobs/<job_id>")
    @documented("Cancel a job", responses={200: ("the record, cancel requested", JobReply), 404: "unknown job"})
    def cancel_job(job_id: str):
        """Cancel a job: queued stages never start, a running stage stops within seconds."""
        if svc.jobs.job(job_id) is None:
            return error(404, f"job {job_id} not found")
        task_ids = svc.jobs.request_cancel(job_id)
        if task_ids:
            celery_app.control.revoke(task_ids)
        job_event(log, "cancel_requested", job_id)
        return jsonify(_with_eta(svc, [svc.jobs.record(job_id)])[0])

    @app.post("/api/v1/jobs/<job_id>/retry")
    @documented("Re-run a job's failed or canceled tracks from their first unfinished stage (same seed)",
                responses={200: ("the record, the tracks queued again (each counts it in `retries`)", RetryReply),
                           404: "unknown job", 409: "the job is still running, or no track failed or was canceled"})
    def retry(job_id: str):
        try:
            retried = retry_job(svc, celery_app, job_id)
        except KeyError:
            return error(404, f"job {job_id} not found")
        except RetryRefused as exc:
            return error(409, f"job: {exc}", "job")
        reply = _with_eta(svc, [svc.jobs.record(job_id)])[0]
        return jsonify({**reply, "retried": retried})

    @app.get("/api/v1/jobs/<job_id>/tracks/<file_name>")
    @documented("Download a music track as <i>.mp3 or <i>.wav (Range requests honoured)",
                media=("audio/mpeg", "audio/wav"),
                responses={**DOWNLOAD_REPLIES, 404: "unknown job, track or file name, or not done"})
    def download_track(job_id: str, file_name: str):
        match = TRACK_FILE.fullmatch(file_name)
        if not match:
            return error(404, "file: expected <track>.mp3 or <track>.wav", "file")
        index, fmt = int(match.group(1)), match.group(2)
        return _serve_artifact(svc, job_id, index, f"track{index}.{fmt}", fmt)

    @app.post("/api/v1/queues/<queue>/drain")
    @documented("Drain a queue (GPU maintenance)", responses={200: ("drained", DrainReply), 404: "unknown queue"})
    def drain(queue: str):
        """Drain a queue (GPU maintenance): no new tracks go there and its tracks not started move to other
        queues; its running stage and started tracks finish there."""
        if queue not in known_queues(svc):
            return error(404, f"queue {queue} not found", "queue")
        moved = drain_queue(svc, celery_app, queue)
        log.info("queue=%s event=drained moved=%d", queue, moved)
        return jsonify({"queue": queue, "draining": True, "moved": moved})

    @app.delete("/api/v1/queues/<queue>/drain")
    @documented("Route tracks to a drained queue again", responses={200: ("resumed", DrainReply),
                                                                  404: "unknown queue"})
    def resume(queue: str):
        """Route tracks to a drained queue again."""
        if queue not in known_queues(svc):
            return error(404, f"queue {queue} not found", "queue")
        resume_queue(svc, celery_app, queue)
        log.info("queue=%s event=resumed", queue)
        return jsonify({"queue": queue, "draining": False})

    @app.get("/api/v1/openapi.json")
    @documented("This API's OpenAPI 3.1 document", responses={200: ("the document", {"type": "object"})})
    def openapi():
        """This API's OpenAPI 3.1 document, generated from the routes and the request and reply models."""
        if "OPENAPI" not in app.config:
            app.config["OPENAPI"] = build_spec(app, music_limits(settings, profile),
                                               lambda endpoint: bool(settings.api_tokens) and
                                               endpoint not in PUBLIC_ENDPOINTS)
        return jsonify(app.config["OPENAPI"])

    @app.get("/api/v1/status")
    @documented("Every worker and every queue", responses={200: ("workers and queues", StatusReply)})
    def status():
        """Every worker (idle/busy/offline, current job and stage, device) and every queue's depth."""
        snapshot = take_snapshot(svc, dict(celery_app.conf.broker_transport_options or {}))
        return jsonify({
            "workers": [_public_worker(w) for w in snapshot.workers],
            "queues": snapshot.queues,
            "unrouted": snapshot.unrouted,
            "time": time.time(),
        })

    return app


def _serve_artifact(svc: Services, job_id: str, index: int, name: str, fmt: str):
    """A finished track's file (Range requests honoured); 404 until the track is done."""
    record = svc.jobs.record(job_id)
    if record is None:
        return error(404, f"job {job_id} not found")
    if index >= record["num_tracks"]:
        return error(404, f"track: job has {record['num_tracks']} tracks", "track")
    track = record["tracks"][index]
    if track["state"] != "done":
        return error(404, f"track {index} is {track['state']}, not done")
    if name not in track["artifacts"]:
        hint = f" (a lip-sync job: its result is /api/v1/jobs/{job_id}/video.mp4)" if record["kind"] == "lipsync" else ""
        return error(404, f"track {index} has no file {name}{hint}")
    download_name = f"encore-{job_id[:8]}-{name}"
    presigned = svc.artifacts.presigned_url(job_id, name, download_name)
    if presigned:  # the object store serves it (and its Range requests) itself
        return redirect(presigned, code=302)
    path = svc.artifacts.local_path(job_id, name)
    return send_file(path, mimetype=MEDIA_TYPES[fmt], conditional=True, download_name=download_name)


def _accepted(svc: Services, job_id: str, replayed: bool = False):
    """202 for a new job; 200 (same body) for the job an earlier request with the same Idempotency-Key made."""
    record = svc.jobs.record(job_id)
    body = {"job_id": job_id, "status_url": f"/api/v1/jobs/{job_id}",
            "queue_position": record["queue_position"], "state": record["state"],
            "eta_s": job_etas(svc, [record])[0]}
    if any(not t["queue"] for t in record["tracks"]) and record["state"] not in JOB_END_STATES:
        body["note"] = "no worker is live: the job waits until one starts"
    reply = jsonify(body)
    if replayed:
        reply.headers["Idempotent-Replayed"] = "true"
    return reply, 200 if replayed else 202


def _idempotency_key() -> str | None:
    """The request's Idempotency-Key, checked (400 naming the header when malformed), or None."""
    key = request.headers.get(idempotency.HEADER)
    return None if key is None else idempotency.checked_key(key)


def _submit_once(svc: Services, settings: Settings, key: str | None, body_hash: Callable[[], str],
                 create: Callable[[str | None], str]) -> tuple[str, bool]:
    """(job id, replayed): `create` runs unless an earlier request with the same key (and owner) made the job."""
    if key is None:
        return create(None), False
    owner = idempotency.scope(request.headers.get("Authorization", ""), settings.api_tokens)
    return idempotency.submit_once(svc, owner, key, body_hash(), create)


def _with_eta(svc: Services, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as clients see them, each with its `eta_s` (one read of their queues for all of them)."""
    return [{**_public(record), "eta_s": eta} for record, eta in zip(records, job_etas(svc, records))]


def _public(record: dict[str, Any]) -> dict[str, Any]:
    """The record as clients see it: internal bookkeeping (Celery ids, costs) left out; a track whose stage
    runs (or last ran) on a worker has that worker's status (read with the record), so a client sees
    `offline` when it died."""
    tracks = []
    for track in record["tracks"]:
        public = {k: v for k, v in track.items() if k not in ("task_ids", "cost", "seq", "params")}
        public["seed"] = track["params"].get("seed")
        public["downloads"] = _download_urls(record["job_id"], track)
        tracks.append(public)
    return {**record, "tracks": tracks}


def _download_urls(job_id: str, track: dict[str, Any]) -> dict[str, str]:
    urls = {}
    for name in track["artifacts"]:
        if name == "output.mp4":
            urls["mp4"] = f"/api/v1/jobs/{job_id}/video.mp4"
        elif TRACK_FILE.fullmatch(name.removeprefix("track")):
            urls[name.rsplit(".", 1)[1]] = f"/api/v1/jobs/{job_id}/tracks/{name.removeprefix('track')}"
    return urls


def _public_worker(worker: dict[str, Any]) -> dict[str, Any]:
    keys = ("name", "status", "queue", "pinned_to", "device", "runtime_mode", "gpu_free_bytes", "gpu_total_bytes",
            "pid", "last_seen", "current", "hostname", "profile", "music_engine")
    return {k: worker.get(k) for k in keys if k in worker}


PUBLIC_ENDPOINTS = {"index", "static", "healthz", "readyz", "metrics"}


def _register_khala_contract(app: Flask, svc: Services, celery_app, settings: Settings, profile) -> None:
    """The reference backend's routes, at ENCORE_COMPAT_PREFIX (none by default) and under /api."""
    def submit(req, body: dict[str, Any]) -> tuple[str, bool]:
        return _submit_once(svc, settings, _idempotency_key(), lambda: idempotency.json_digest(body),
                            lambda new_id: submit_music_job(svc, celery_app, req, profile, job_id=new_id, api="khala"))

    def validate(body):
        return validate_music(body, settings, profile)

    for name, prefix in (("khala", settings.compat_prefix), ("khala_api", "/api")):
        if name == "khala_api" and prefix == settings.compat_prefix:
            continue
        app.register_blueprint(make_blueprint(name, svc, submit, validate, settings.tags_file,
                                              lambda body: longest_song(body, profile),
                                              dict(celery_app.conf.broker_transport_options or {})),
                               url_prefix=prefix or None)


def _require_token(app: Flask, tokens: tuple[str, ...]) -> None:
    """With API_TOKEN set, every route but the page, health and metrics (open for probes and Prometheus)
    needs `Authorization: Bearer <token>`: the native /api/v1 routes and the Khala-compatible ones."""
    if not tokens:
        return

    @app.before_request
    def check_token():
        if request.endpoint in PUBLIC_ENDPOINTS:
            return None
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        offered = given.strip().encode("latin-1", "replace")  # header bytes as sent; any non-ASCII never matches
        if scheme.lower() == "bearer" and any(hmac.compare_digest(offered, t.encode()) for t in tokens):
            return None
        reply, status = error(401, "authorization: a valid 'Authorization: Bearer <token>' header is required",
                              "authorization")
        reply.headers["WWW-Authenticate"] = 'Bearer realm="encore"'
        return reply, status


def _time_out_idle_bodies(app: Flask, idle_s: float) -> None:
    """Under gunicorn, a request that carries a body gets a read timeout on its socket: a client that sends
    nothing for `idle_s` is answered 408 and dropped (its unread body cannot be drained) instead of holding a thread forever."""
    @app.before_request
    def arm_body_timeout():
        client = request.environ.get("gunicorn.socket")
        if client is not None and (request.content_length or request.headers.get("Transfer-Encoding")):
            client.settimeout(idle_s)

    @app.errorhandler(ClientDisconnected)  # Werkzeug's body reader turns the socket timeout into this
    def body_stalled(exc: ClientDisconnected):
        if isinstance(exc.__context__, TimeoutError):
            return error(408, f"body: nothing received for {idle_s:g} s", "body")  # gunicorn then drops it
        return error(400, "body: the connection closed before the whole body arrived", "body")


def _register_errors(app: Flask) -> None:
    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        reply, status = error(exc.code or 500, exc.description or exc.name)
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
            reply.headers["Allow"] = ", ".join(sorted(exc.valid_methods))
        return reply, status

    @app.errorhandler(QueueFull)
    def queue_full(exc: QueueFull):
        reply, status = error(429, str(exc), "queue")
        reply.headers["Retry-After"] = str(exc.retry_after_s)
        return reply, status

    @app.errorhandler(RateLimitExceeded)
    def rate_limited(exc: RateLimitExceeded):
        return error(429, f"rate limit: this token's submissions are limited to {exc.description}; retry after "
                          "Retry-After seconds", "authorization")

    @app.errorhandler(idempotency.IdempotencyError)
    def idempotency_refused(exc: idempotency.IdempotencyError):
        return error(exc.status, str(exc), exc.field)

    @app.errorhandler(redis.RedisError)
    def redis_down(exc: redis.RedisError):
        log.exception("redis error")
        return error(503, f"job store unavailable: {exc}")

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        log.exception("unhandled error")
        return error(500, f"internal error ({type(exc).__name__})")
