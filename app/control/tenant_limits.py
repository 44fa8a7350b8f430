"""Per-tenant limits and usage (app/core/tenants.py says who a tenant is).

Limits: a tenant's own (its `limits` in the tenants file), else the deployment's default (app/core/config.py):
open tracks at once (ENCORE_TENANT_MAX_OPEN_TRACKS; 429 `tracks` with Retry-After past it), the highest priority
(ENCORE_TENANT_MAX_PRIORITY for clients, `high` for admins; 403 `priority`), retries per track (ENCORE_MAX_RETRIES;
403 `retries`), the longest song (the profile's; 403 `duration_s`) and face video (ENCORE_MAX_VIDEO_S; 403
`video`), and the submit rate (ENCORE_SUBMIT_RATE_LIMIT; 429, app/http/ratelimit.py).

Open tracks are counted from a per-tenant sorted set the transition script keeps (a track enters it when it is
submitted or retried and leaves when it ends), scored by its job's expiry, so a job that expires open stops
counting by itself. The count and the job's write happen under the tenant's own short lock (quotas.short_lock), so two submits of
one tenant cannot both take its last room.

Usage: per tenant, the jobs and tracks it submitted (counted when the job is written) and the GPU-seconds its
stages ran (wall seconds of every finished stage run: every stage runs on a GPU queue), since Redis began.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from app.control.quotas import short_lock
from app.control.services import Services
from app.core.config import Settings
from app.core.priority import PRIORITIES
from app.core.tenants import ADMIN, PRIORITY_LEVELS, Tenant

OPEN_TRACKS_RETRY_S = 30  # Retry-After when a tenant's open tracks are at its cap: its tracks end at GPU pace
USAGE_FIELDS = ("jobs", "tracks", "gpu_seconds")


class TenantLimitExceeded(Exception):
    """A request past one of its tenant's limits: `status` 403 (never allowed) or 429 (not now), naming `field`."""

    def __init__(self, status: int, field: str, message: str, retry_after_s: int | None = None):
        super().__init__(f"{field}: {message}")
        self.status = status
        self.field = field
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Limits:
    """A tenant's limits as they apply: its own, else the deployment's."""

    max_open_tracks: int  # 0: no cap
    max_priority: str
    max_retries: int
    max_song_s: float | None  # None: the profile's own limit
    max_video_s: float
    submit_rate_limit: str  # empty: none


def limits_for(settings: Settings, tenant: Tenant) -> Limits:
    own = tenant.limits
    default_priority = "high" if tenant.role == ADMIN else settings.tenant_max_priority
    return Limits(
        max_open_tracks=_first(own.max_open_tracks, settings.tenant_max_open_tracks),
        max_priority=_first(own.max_priority, default_priority),
        max_retries=_first(own.max_retries, settings.max_retries),
        max_song_s=own.max_song_s,
        max_video_s=_first(own.max_video_s, settings.max_video_s),
        submit_rate_limit=_first(own.submit_rate_limit, settings.submit_rate_limit),
    )


def _first(own: Any, default: Any) -> Any:
    return default if own is None else own


def check_request(settings: Settings, tenant: Tenant, kind: str, params: dict[str, Any]) -> None:
    """TenantLimitExceeded (403) for a job its tenant may never submit: a priority above its highest, a song or a
    face video longer than it may ask for."""
    limits = limits_for(settings, tenant)
    priority = params.get("priority") or "normal"
    if priority in PRIORITIES and PRIORITY_LEVELS.index(priority) > PRIORITY_LEVELS.index(limits.max_priority):
        raise TenantLimitExceeded(
            403, "priority", f"this tenant's jobs may ask for priority {limits.max_priority} at most, not {priority}"
        )
    song = params.get("duration_s")
    if kind == "music" and limits.max_song_s is not None and song is not None and float(song) > limits.max_song_s:
        raise TenantLimitExceeded(
            403, "duration_s", f"this tenant's songs may last {limits.max_song_s:g} s at most, not {float(song):g}"
        )
    video = params.get("video_duration_s")
    if kind == "lipsync" and video is not None and float(video) > limits.max_video_s:
        raise TenantLimitExceeded(
            403, "video", f"this tenant's face videos may last {limits.max_video_s:g} s at most, not {float(video):.3g}"
        )


def open_tracks(svc: Services, tenant_name: str) -> int:
    """The tenant's tracks not ended yet (those of expired jobs no longer count)."""
    return int(svc.redis.zcount(svc.jobs.keys.tenant_open(tenant_name), f"({time.time()}", "+inf"))


@contextmanager
def tenant_admission(svc: Services, tenant: Tenant, num_tracks: int) -> Iterator[None]:
    """Check that `num_tracks` more fit under the tenant's cap on open tracks (TenantLimitExceeded 429 if not),
    holding the tenant's lock while the caller writes the job, so that its next submit counts them."""
    cap = limits_for(svc.settings, tenant).max_open_tracks
    if not cap:
        yield
        return
    busy = TenantLimitExceeded(429, "tracks", "other submissions of this tenant are being admitted; retry", 1)
    with short_lock(svc, f"admission-{tenant.name}", busy):
        svc.redis.zremrangebyscore(svc.jobs.keys.tenant_open(tenant.name), "-inf", time.time())
        held = open_tracks(svc, tenant.name)
        if held + num_tracks > cap:
            raise TenantLimitExceeded(
                429,
                "tracks",
                f"this tenant has {held} tracks open and may have {cap} at once; this job has {num_tracks}",
                OPEN_TRACKS_RETRY_S,
            )
        yield


def record_gpu_seconds(svc: Services, job_id: str, seconds: float) -> None:
    """Count a finished stage run's wall seconds as GPU-seconds of the tenant that owns its job."""
    owner = svc.jobs.owner(job_id)
    if owner is not None and seconds > 0:
        svc.redis.hincrbyfloat(svc.jobs.keys.tenant_usage(owner), "gpu_seconds", seconds)


def usage(svc: Services, tenant_names: list[str]) -> list[dict[str, Any]]:
    """Each tenant's usage: jobs and tracks submitted, GPU-seconds run, tracks open now (one round trip)."""
    now = time.time()
    pipe = svc.redis.pipeline(transaction=False)
    for name in tenant_names:
        pipe.hmget(svc.jobs.keys.tenant_usage(name), list(USAGE_FIELDS))
        pipe.zcount(svc.jobs.keys.tenant_open(name), f"({now}", "+inf")
    replies = pipe.execute()
    rows = []
    for index, name in enumerate(tenant_names):
        jobs, tracks, gpu_seconds = replies[2 * index]
        rows.append(
            {
                "tenant": name,
                "jobs": int(jobs or 0),
                "tracks": int(tracks or 0),
                "gpu_seconds": round(float(gpu_seconds or 0), 3),
                "open_tracks": int(replies[2 * index + 1]),
            }
        )
    return rows
