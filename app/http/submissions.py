"""Turning a validated request into a routed job; shared by the native API and the Khala-compatible one,
so both create the same records, metrics and log lines."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from celery import Celery
from pydantic import ValidationError

from app.adapters import tracing
from app.core.config import Settings
from app.core.joblog import job_event
from app.control.metrics import count_submission
from app.pipeline.music.lyrics import clean_lyrics
from app.pipeline.profiles import MusicProfile
from app.core.priority import DEFAULT_PRIORITY
from app.core.tenants import OPEN_TENANT, Tenant
from app.control.tenant_limits import check_request, tenant_admission
from app.control.quotas import admission
from app.control.routing import route_job
from app.pipeline.music.positions import longest_song_for
from app.http.schemas import MusicRequest, describe_validation_error, untokenizable
from app.control.services import Services

log = logging.getLogger("encore.web")


class RequestError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def music_limits(settings: Settings, profile: MusicProfile) -> dict[str, Any]:
    return {
        "min_duration_s": profile.min_duration_s,
        "max_duration_s": profile.max_duration_s,
        "default_duration_s": profile.default_duration_s,
        "max_tracks": settings.max_tracks,
        "max_lyrics_chars": settings.max_lyrics_chars,
        "max_text_chars": settings.max_text_chars,
        "profile": profile,
        "webhooks": bool(settings.webhook_secret),  # the OpenAPI document's: without a secret, no webhook is taken
    }


def longest_song(body: dict[str, Any], profile: MusicProfile) -> float:
    """The longest song a (not yet validated) native body's prompt leaves room for; text fields of the
    wrong type count as empty (validation refuses them afterwards)."""

    def text(name: str) -> str:
        value = body.get(name)
        return value if isinstance(value, str) and untokenizable(value) is None else ""

    requested = body.get("mode")
    mode = requested if isinstance(requested, str) and requested in ("vocal", "instrumental") else "vocal"
    return longest_song_for(profile, mode=mode, tags=text("tags"), description=text("prompt"), lyrics=text("lyrics"))


def validate_music(body: dict[str, Any], settings: Settings, profile: MusicProfile) -> MusicRequest:
    """MusicRequest from a JSON body; RequestError names the offending field."""
    try:
        return MusicRequest.model_validate(body, context=music_limits(settings, profile))
    except ValidationError as exc:
        raise RequestError(*describe_validation_error(exc)) from None


def submit_music(
    svc: Services,
    celery: Celery,
    req: MusicRequest,
    profile: MusicProfile,
    job_id: str | None = None,
    webhook: dict[str, Any] | None = None,
    tenant: Tenant = OPEN_TENANT,
    **extra: Any,
) -> str:
    """Create the job record (one track per requested track, seeds seed+i), owned by `tenant`, and route its
    tracks; `job_id` when the caller drew it (an idempotent submit); `webhook` as app/adapters/webhooks.check_target gives
    it."""
    if req.duration_s is None:  # validate_music sets it (the deployment's default when the body has none)
        raise ValueError("submit_music needs a validated MusicRequest: duration_s is unset")
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31 - req.num_tracks)
    params = {
        "mode": req.mode,
        "tags": req.tags or "",
        "prompt": req.prompt or "",
        "lyrics": clean_lyrics(req.lyrics) if req.mode == "vocal" and req.lyrics else "",
        "duration_s": req.duration_s,
        "num_tracks": req.num_tracks,
        "seed": seed,
        "temperature": req.temperature,
        "top_k": req.top_k,
        "profile": profile.name,
        "priority": req.priority,
        **extra,
    }
    tracks = [{"seed": (seed + i) % 2**31} for i in range(req.num_tracks)]
    job_id = create_job(
        svc,
        "music",
        params,
        tracks,
        float(req.duration_s),
        job_id=job_id,
        webhook=webhook,
        tenant=tenant,
        duration_s=req.duration_s,
    )
    route_job(svc, celery, job_id, req.num_tracks)
    return job_id


def create_job(
    svc: Services,
    kind: str,
    params: dict[str, Any],
    tracks: list[dict[str, Any]],
    cost: float,
    job_id: str | None = None,
    webhook: dict[str, Any] | None = None,
    tenant: Tenant = OPEN_TENANT,
    **log_fields: Any,
) -> str:
    """Write the record (owned by `tenant`, within its limits: app/control/tenant_limits.py, TenantLimitExceeded
    past one), count the submission and log it; the caller routes once the job's inputs exist. The
    job's priority is the one its params record (normal, recorded there, when they name none)."""
    params = {**params, "priority": params.get("priority", DEFAULT_PRIORITY)}
    priority = params["priority"]
    check_request(svc.settings, tenant, kind, params)  # 403: a priority or length the tenant may never ask for
    # 429 when the job would pass its tenant's cap on open tracks, or the service's (QueueFull)
    with tenant_admission(svc, tenant, len(tracks)), admission(svc, len(tracks)):
        job_id = svc.jobs.create(
            kind,
            params,
            tracks,
            cost=cost,
            job_id=job_id,
            webhook=webhook,
            priority=priority,
            tenant=tenant.name,
            trace=tracing.current_carrier(),
        )
    count_submission(svc, kind)
    job_event(
        log, "submitted", job_id, kind=kind, tracks=len(tracks), priority=priority, tenant=tenant.name, **log_fields
    )
    return job_id
