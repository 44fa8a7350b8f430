"""Per-tenant rate limits on the submit routes (POST /api/v1/music, /api/v1/lipsync and the Khala-compatible
/generate): the `limits` library's windows, counted in Redis, so every web process shares them.

One limit (ENCORE_SUBMIT_RATE_LIMIT, e.g. "10/minute;100/hour") is shared by all submit routes, per tenant
(app/core/tenants.py; per client address when no token is configured). Each submit view calls
`check_submit_rate` first, before it reads the body: a refused upload is never parsed, and a request refused 401
(guards.authenticate, which runs before any view) counts against nobody. No other route runs any of it, so a job
poll pays nothing for it. A refusal is 429 naming `authorization`; it and every reply the limit counted carry
Retry-After and X-RateLimit-Limit/-Remaining/-Reset. Unset: no limiter at all.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, after_this_request, current_app, g, request
from limits import RateLimitItem, parse_many
from limits.storage import storage_from_string
from limits.strategies import STRATEGIES, RateLimiter

from app.adapters.redis_conn import limits_storage
from app.control.tenant_limits import TenantLimitExceeded, limits_for
from app.core.config import Settings
from app.core.keys import Layout

EXTENSION = "encore.ratelimit"  # the key in app.extensions
SCOPE = "submit"  # the submit routes share one window per client


@dataclass(frozen=True)
class SubmitLimiter:
    """One application's submit limit: its settings (whose rate applies) and its windows."""

    settings: Settings
    windows: RateLimiter  # ENCORE_RATE_LIMIT_STRATEGY's, over the shared Redis


class SubmitRateExceeded(TenantLimitExceeded):
    """A submit past its tenant's rate: 429 naming `authorization` (errors.tenant_limit answers it)."""

    def __init__(self, limit: RateLimitItem):
        self.message = f"rate limit: this tenant's submissions are limited to {limit}; retry after Retry-After seconds"
        super().__init__(429, "authorization", self.message)

    def __str__(self) -> str:
        return self.message  # the reply names the field apart, in `field`


def install(app: Flask, settings: Settings) -> SubmitLimiter | None:
    """The limiter the submit views of `app` consult, or None when neither ENCORE_SUBMIT_RATE_LIMIT nor any
    tenant sets a rate. Each tenant's own rate (its tenants-file limit, else the deployment's) is read per
    request."""
    if not settings.submit_rate_limit and not any(t.limits.submit_rate_limit for t in settings.tenants.tenants):
        return None
    uri, options = storage(settings)
    limiter = SubmitLimiter(settings, STRATEGIES[settings.rate_limit_strategy](storage_from_string(uri, **options)))
    app.extensions[EXTENSION] = limiter
    return limiter


def check_submit_rate() -> None:
    """Count this submit in its client's windows, shortest first, stopping at the first one that is spent
    (SubmitRateExceeded). Call it first in a submit view, before the body is read. The reply, whatever it
    turns out to be, carries the spent window, else the shortest."""
    limiter: SubmitLimiter | None = current_app.extensions.get(EXTENSION)
    if limiter is None:
        return
    rate = _rate(limiter.settings)
    if not rate:  # a tenant with no rate is exempt
        return
    client = _client(limiter.settings)
    windows = _windows(rate)
    for window in windows:
        if not limiter.windows.hit(window, client, SCOPE):
            after_this_request(functools.partial(_rate_headers, limiter.windows, window, client))
            raise SubmitRateExceeded(window)
    after_this_request(functools.partial(_rate_headers, limiter.windows, windows[0], client))


@functools.lru_cache(maxsize=64)
def _windows(rate: str) -> tuple[RateLimitItem, ...]:
    """A rate's windows, shortest first (the rate was checked at start: app/core/tenants.check_rate)."""
    return tuple(sorted(parse_many(rate)))


def _rate_headers(windows: RateLimiter, window: RateLimitItem, client: str, response: Response) -> Response:
    """X-RateLimit-Limit, -Remaining and -Reset (Unix seconds) of `window`, and Retry-After: the whole seconds
    until it resets, or the reply's own Retry-After where that is longer (a full queue's); a 429 says at least 1."""
    stats = windows.get_window_stats(window, client, SCOPE)
    reset_at = int(stats.reset_time + 1)
    wait_s = int(reset_at - time.time())
    own = response.headers.get("Retry-After", "")
    if own.isdigit():
        wait_s = max(wait_s, int(own))
    response.headers["X-RateLimit-Limit"] = str(window.amount)
    response.headers["X-RateLimit-Remaining"] = str(stats.remaining)
    response.headers["X-RateLimit-Reset"] = str(reset_at)
    response.headers["Retry-After"] = str(max(wait_s, 1 if response.status_code == 429 else 0))
    return response


def _rate(settings: Settings) -> str:
    """The submit rate of the request's tenant ("" for none); the deployment's for a request with no tenant."""
    found = g.get("tenant")
    return limits_for(settings, found).submit_rate_limit if found is not None else settings.submit_rate_limit


def storage(settings: Settings) -> tuple[str, dict[str, Any]]:
    """The windows' storage URI and options: the same Redis as every client (app/adapters/redis_conn.py,
    Sentinel included), its keys under ours."""
    uri, options = limits_storage(settings)
    return uri, {**options, "key_prefix": Layout(settings.key_prefix).rate_limits}


def _client(settings: Settings) -> str:
    """Whose window a request counts in: its tenant's (every token of a tenant shares one), else, where no
    token is configured and so nobody is told apart, its address."""
    if settings.tenants.open or g.get("tenant") is None:
        return f"addr-{request.remote_addr or 'unknown'}"
    return "tenant-" + g.tenant.name
