"""Per-token rate limits on the submit routes (POST /api/v1/music, /api/v1/lipsync and the Khala-compatible
/generate): Flask-Limiter, its windows counted in Redis, so every web process shares them.

One limit (ENCORE_SUBMIT_RATE_LIMIT, e.g. "10/minute;100/hour") is shared by all submit routes, per tenant
(app/core/tenants.py; per client address when no token is configured). It is checked before the body is read: a refused upload is never parsed. A
refusal is 429 with Retry-After and X-RateLimit-Limit/-Remaining/-Reset, which every rate-limited reply also
carries. Unset: no limiter at all.
"""

from __future__ import annotations

import functools
from typing import Any

from flask import Flask, Response, g, request
from flask_limiter import Limiter

from app.control.tenant_limits import limits_for
from app.core.config import Settings
from app.core.keys import Layout
from app.adapters.redis_conn import limits_storage

SUBMIT_ENDPOINTS = frozenset({"submit.submit_music", "submit.submit_lipsync", "khala.generate", "khala_api.generate"})


def install(app: Flask, settings: Settings) -> Limiter | None:
    """The limiter on `app`'s submit routes, or None when neither ENCORE_SUBMIT_RATE_LIMIT nor any tenant sets a
    rate. Each tenant's own rate (its tenants-file limit, else the deployment's) is read per request. Register it
    after the token check, so that a request without a valid token is 401 and counts against nobody."""
    if not settings.submit_rate_limit and not any(t.limits.submit_rate_limit for t in settings.tenants.tenants):
        return None
    app.after_request(_retry_after_at_least_one_second)  # registered first: runs after the limiter's own
    uri, options = storage(settings)
    limiter = Limiter(
        key_func=lambda: _client(settings),
        app=app,
        storage_uri=uri,
        storage_options=options,
        strategy=settings.rate_limit_strategy,
        headers_enabled=True,
        application_limits=[lambda: _rate(settings) or UNLIMITED],
        application_limits_exempt_when=lambda: not _rate(settings),
    )
    submits_only(app, limiter)
    return limiter


def submits_only(app: Flask, limiter: Limiter) -> int:
    """Run the limiter's request hooks (its check, its headers, its bookkeeping) for the submit routes only: it
    resolves its limits on every request it sees, which cost a job poll ~60 µs (~10 %) for nothing. Returns how
    many hooks were wrapped (tests/test_backpressure.py checks that none is left running everywhere)."""
    wrapped = 0
    for table, wrap in (
        (app.before_request_funcs, _before),
        (app.after_request_funcs, _after),
        (app.teardown_request_funcs, _teardown),
    ):
        hooks: list[Any] = table.get(None, [])
        for index, hook in enumerate(hooks):
            if _belongs_to(hook, limiter):
                hooks[index] = wrap(hook)
                wrapped += 1
    return wrapped


def _belongs_to(hook: Any, limiter: Limiter) -> bool:
    """A hook the limiter registered: one of its bound methods, or a partial of one of its functions over it."""
    if isinstance(hook, functools.partial):
        return any(arg is limiter for arg in hook.args)
    return getattr(hook, "__self__", None) is limiter


def _before(hook: Any) -> Any:
    def before() -> Any:
        return hook() if request.endpoint in SUBMIT_ENDPOINTS else None

    return before


def _after(hook: Any) -> Any:
    def after(response: Response) -> Response:
        return hook(response) if request.endpoint in SUBMIT_ENDPOINTS else response

    return after


def _teardown(hook: Any) -> Any:
    def teardown(error: BaseException | None = None) -> None:
        if request.endpoint in SUBMIT_ENDPOINTS:
            hook(error)

    return teardown


UNLIMITED = "1000000/second"  # never applied: a request whose tenant has no rate is exempt


def _rate(settings: Settings) -> str:
    """The submit rate of the request's tenant ("" for none); the deployment's for a request with no tenant."""
    found = g.get("tenant")
    return limits_for(settings, found).submit_rate_limit if found is not None else settings.submit_rate_limit


def storage(settings: Settings) -> tuple[str, dict[str, Any]]:
    """The limiter's storage URI and options: the same Redis as every client (app/adapters/redis_conn.py, Sentinel
    included), its keys under ours."""
    uri, options = limits_storage(settings)
    return uri, {**options, "key_prefix": Layout(settings.key_prefix).rate_limits}


def _client(settings: Settings) -> str:
    """Whose window a request counts in: its tenant's (every token of a tenant shares one), else, where no
    token is configured and so nobody is told apart, its address."""
    if settings.tenants.open or g.get("tenant") is None:
        return f"addr-{request.remote_addr or 'unknown'}"
    return "tenant-" + g.tenant.name


def _retry_after_at_least_one_second(response: Response) -> Response:
    """The library writes whole seconds left in the window, which reads 0 in its last second: a 429 says 1."""
    if response.status_code == 429 and response.headers.get("Retry-After", "").strip() in ("0", "-0", ""):
        response.headers["Retry-After"] = "1"
    return response
