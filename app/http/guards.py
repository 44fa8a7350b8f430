"""Hooks that run before every view: the bearer-token check and the read timeout on request bodies."""

from __future__ import annotations

import hmac

from flask import Response, request

from app.http.context import context
from app.http.replies import error

# Open without a token, for browsers, probes and Prometheus; every other route needs one when API_TOKEN is set.
PUBLIC_ENDPOINTS = frozenset({"pages.index", "static", "ops.healthz", "ops.readyz", "ops.metrics"})


def check_token() -> tuple[Response, int] | None:
    """With API_TOKEN set (create_app installs this hook only then), every route but the public ones needs
    `Authorization: Bearer <token>`: the native /api/v1 routes and the Khala-compatible ones."""
    if request.endpoint in PUBLIC_ENDPOINTS:
        return None
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    offered = given.strip().encode("latin-1", "replace")  # header bytes as sent; any non-ASCII never matches
    tokens = context().settings.api_tokens
    if scheme.lower() == "bearer" and any(hmac.compare_digest(offered, t.encode()) for t in tokens):
        return None
    reply, status = error(
        401, "authorization: a valid 'Authorization: Bearer <token>' header is required", "authorization"
    )
    reply.headers["WWW-Authenticate"] = 'Bearer realm="encore"'
    return reply, status


def arm_body_timeout() -> None:
    """Under gunicorn, a request that carries a body gets a read timeout on its socket: a client that sends
    nothing for ENCORE_BODY_IDLE_S is answered 408 (errors.body_stalled) and dropped (its unread body cannot
    be drained) instead of holding a thread forever."""
    client = request.environ.get("gunicorn.socket")
    if client is not None and (request.content_length or request.headers.get("Transfer-Encoding")):
        client.settimeout(context().settings.body_idle_s)
