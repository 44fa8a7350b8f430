"""Submitting jobs: POST /api/v1/music and /api/v1/lipsync, each at most once per Idempotency-Key."""

from __future__ import annotations

from typing import Any, Callable

from flask import Blueprint, Response, current_app, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from app.control import idempotency
from app.control.eta import job_etas
from app.core.kinds import JOB_END_STATES
from app.http.context import WebContext, context
from app.http.guards import tenant
from app.http.replies import error
from app.http.http_input import BodyError, json_object
from app.http.openapi import TOO_MANY, documented, forbidden_to_tenant
from app.http.ratelimit import check_submit_rate
from app.control.routing import route_job
from app.http.schemas import Accepted, MusicRequest
from app.http.submissions import RequestError, create_job, submit_music as submit_music_job, validate_music
from app.http.uploads import LipsyncForm, UploadError, receive_lipsync
from app.adapters.webhooks import WebhookRefused, check_target, split_events

blueprint = Blueprint("submit", __name__)

IDEMPOTENCY_HEADER = idempotency.OPENAPI_HEADER
IDEMPOTENT_REPLIES: dict[int, Any] = {
    200: ("an earlier request with this Idempotency-Key made this job", Accepted),
    409: "the Idempotency-Key was used with a different body (or its first request is still running)",
    429: TOO_MANY,
}
# A lip-sync form has two files and three short fields: a body with more parts, or a text field longer than
# this (Werkzeug also holds its read buffer to it, so it stays well above the 64 KiB chunk), is refused (413)
# while it is parsed.
MAX_FORM_PARTS = 16
MAX_FORM_MEMORY_BYTES = 500_000


@blueprint.post("/api/v1/music")
@documented(
    "Submit a music job (one chain of stages per track)",
    json_body=MusicRequest,
    headers=IDEMPOTENCY_HEADER,
    responses={
        202: ("accepted", Accepted),
        **IDEMPOTENT_REPLIES,
        400: "invalid field (named in `field`)",
        403: forbidden_to_tenant("song", "duration_s"),
    },
)
def submit_music() -> tuple[Response, int]:
    """A music job: the body checked against the profile's limits, one chain of stages per track."""
    check_submit_rate()  # first: a refused submit is not read
    shared = context()
    key = idempotency_key()
    owner = tenant()
    try:
        body = json_object(request)
        req = validate_music(body, shared.settings, shared.profile)
    except BodyError as exc:
        return error(400, str(exc), exc.field)
    except RequestError as exc:
        return error(400, str(exc), exc.field)
    try:
        webhook = check_target(req.webhook, req.webhook_events, shared.settings)
    except WebhookRefused as exc:
        return error(400, str(exc), exc.field)
    job_id, replayed = submit_once(
        shared,
        key,
        lambda: idempotency.json_digest(body),
        lambda new_id: submit_music_job(
            shared.services, shared.celery, req, shared.profile, job_id=new_id, webhook=webhook, tenant=owner
        ),
    )
    return accepted(shared, job_id, replayed)


@blueprint.post("/api/v1/lipsync")
@documented(
    "Submit a lip-sync job (face video + driving audio)",
    form=LipsyncForm,
    files=("video", "audio"),
    headers=IDEMPOTENCY_HEADER,
    responses={
        202: ("accepted", Accepted),
        **IDEMPOTENT_REPLIES,
        400: "invalid field or media (named in `field`)",
        403: forbidden_to_tenant("face video", "video"),
        413: "a file (`field`: video or audio), or the whole body (`body`), is too large",
    },
)
def submit_lipsync() -> tuple[Response, int]:
    """A lip-sync job: the two files staged and probed, stored as the job's inputs, one stage routed."""
    check_submit_rate()  # first: a refused upload is not parsed
    shared = context()
    key = idempotency_key()
    owner = tenant()
    if not request.mimetype == "multipart/form-data":
        return error(400, "body: expected multipart/form-data with video and audio files", "body")
    try:
        form, files = request.form.to_dict(), request.files.to_dict()
    except RequestEntityTooLarge:
        most = current_app.config["MAX_CONTENT_LENGTH"]
        # a body whose length says more than the limit, or a chunked one (no length) read up to the limit
        if (request.content_length or 0) > most or getattr(request.stream, "is_exhausted", False):
            return error(
                413,
                f"body: larger than {most / 2**20:g} MiB, the most both files and the fields may take "
                "(ENCORE_MAX_VIDEO_MB + ENCORE_MAX_AUDIO_MB + 1)",
                "body",
            )
        return error(
            413,
            f"body: at most {MAX_FORM_PARTS} form parts, and form fields (besides the files) "
            f"of at most {MAX_FORM_MEMORY_BYTES} bytes",
            "body",
        )
    try:
        # an empty form field is an absent one, as for every other field of the form (app/http/uploads.py)
        url, events = form.get("webhook") or None, form.get("webhook_events") or None
        if url is None and events is not None:  # whatever it holds (" , " too): events need a URL to go to
            raise WebhookRefused("webhook_events", "given without a webhook URL")
        webhook = check_target(url, split_events(events), shared.settings)
        upload = receive_lipsync(form, files, shared.settings, shared.lipsync_profile)
    except WebhookRefused as exc:
        return error(400, str(exc), exc.field)
    except UploadError as exc:
        return error(exc.status, str(exc), exc.field)

    def create(new_id: str | None) -> str:
        svc = shared.services
        job_id = create_job(
            svc,
            "lipsync",
            upload.params,
            [{}],
            float(upload.params["audio_duration_s"]),
            job_id=new_id,
            webhook=webhook,
            tenant=owner,
            frames=upload.params["output_frames"],
            audio_s=round(upload.params["audio_duration_s"], 3),
        )
        for path in upload.files.values():
            svc.artifacts.put(job_id, path.name, path, shared.settings.job_ttl_s)
        route_job(svc, shared.celery, job_id, 1)
        return job_id

    try:
        job_id, replayed = submit_once(shared, key, lambda: idempotency.form_digest(form, upload.files.items()), create)
    finally:
        upload.discard()
    return accepted(shared, job_id, replayed)


def accepted(shared: WebContext, job_id: str, replayed: bool = False) -> tuple[Response, int]:
    """202 for a new job; 200 (same body) for the job an earlier request with the same Idempotency-Key made."""
    record = shared.services.jobs.existing_record(job_id)  # just written
    body = {
        "job_id": job_id,
        "status_url": f"/api/v1/jobs/{job_id}",
        "queue_position": record["queue_position"],
        "state": record["state"],
        "eta_s": job_etas(shared.services, [record])[0],
    }
    if any(not t["queue"] for t in record["tracks"]) and record["state"] not in JOB_END_STATES:
        body["note"] = "no worker is live: the job waits until one starts"
    reply = jsonify(body)
    if replayed:
        reply.headers["Idempotent-Replayed"] = "true"
    return reply, 200 if replayed else 202


def idempotency_key() -> str | None:
    """The request's Idempotency-Key, checked (400 naming the header when malformed), or None."""
    key = request.headers.get(idempotency.HEADER)
    return None if key is None else idempotency.checked_key(key)


def submit_once(
    shared: WebContext, key: str | None, body_hash: Callable[[], str], create: Callable[[str | None], str]
) -> tuple[str, bool]:
    """(job id, replayed): `create` runs unless an earlier request with the same key (and owner) made the job."""
    if key is None:
        return create(None), False
    owner = "tenant-" + tenant().name  # a tenant's keys are its own, shared by its tokens
    return idempotency.submit_once(shared.services, owner, key, body_hash(), create)
