"""Error handlers: every failure a request can meet becomes a JSON error body (app/http/replies.py) with its
status, never an HTML page; Redis down is 503, anything unforeseen 500 (and logged)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import redis
from flask import Response
from werkzeug.exceptions import ClientDisconnected, HTTPException, MethodNotAllowed, RequestEntityTooLarge

from app.control import idempotency
from app.http.context import context
from app.http.replies import error
from app.control.quotas import QueueFull
from app.control.tenant_limits import TenantLimitExceeded

log = logging.getLogger("encore.web")

Reply = tuple[Response, int]


def http_error(exc: HTTPException) -> Reply:
    """Werkzeug's refusals; one of a body too large (wherever it is read) names `body`, as Encore's own do."""
    if isinstance(exc, RequestEntityTooLarge):
        return error(413, f"body: {exc.description or exc.name}", "body")
    reply, status = error(exc.code or 500, exc.description or exc.name)
    if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
        reply.headers["Allow"] = ", ".join(sorted(exc.valid_methods))
    return reply, status


def body_stalled(exc: ClientDisconnected) -> Reply:
    """Werkzeug's body reader turns the socket timeout (guards.arm_body_timeout) into ClientDisconnected."""
    if isinstance(exc.__context__, TimeoutError):
        idle_s = context().settings.body_idle_s
        return error(408, f"body: nothing received for {idle_s:g} s", "body")  # gunicorn then drops it
    return error(400, "body: the connection closed before the whole body arrived", "body")


def queue_full(exc: QueueFull) -> Reply:
    reply, status = error(429, str(exc), "queue")
    reply.headers["Retry-After"] = str(exc.retry_after_s)
    return reply, status


def tenant_limit(exc: TenantLimitExceeded) -> Reply:
    reply, status = error(exc.status, str(exc), exc.field)
    if exc.retry_after_s is not None:
        reply.headers["Retry-After"] = str(exc.retry_after_s)
    return reply, status


def idempotency_refused(exc: idempotency.IdempotencyError) -> Reply:
    return error(exc.status, str(exc), exc.field)


def redis_down(exc: redis.RedisError) -> Reply:
    log.exception("redis error")
    return error(503, f"job store unavailable: {exc}")


def unexpected(exc: Exception) -> Reply:
    log.exception("unhandled error")
    return error(500, f"internal error ({type(exc).__name__})")


# What create_app registers (Flask picks the handler of the most specific class, whatever the order).
HANDLERS: tuple[tuple[type[Exception], Callable[[Any], Reply]], ...] = (
    (HTTPException, http_error),
    (ClientDisconnected, body_stalled),
    (QueueFull, queue_full),
    (TenantLimitExceeded, tenant_limit),
    (idempotency.IdempotencyError, idempotency_refused),
    (redis.RedisError, redis_down),
    (Exception, unexpected),
)
