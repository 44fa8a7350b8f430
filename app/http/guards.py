"""Hooks that run before every view: who the request is (its tenant, from the bearer token) and the read timeout
on request bodies; and the checks views make with that tenant."""

from __future__ import annotations

from flask import Response, g, request

from app.core.tenants import Tenant
from app.http.context import context
from app.http.replies import error

# Open without a token, for browsers, probes and Prometheus; every other route needs one when tokens are configured.
PUBLIC_ENDPOINTS = frozenset({"pages.index", "static", "ops.healthz", "ops.readyz", "ops.metrics"})


def authenticate() -> tuple[Response, int] | None:
    """The request's tenant (app/core/tenants.py), kept for the views (`tenant()`): from its
    `Authorization: Bearer <token>`, or the implicit admin tenant when no token is configured at all. Every
    route but the public ones answers 401 without a known token: the native /api/v1 routes and the
    Khala-compatible ones."""
    found = context().settings.tenants.for_authorization(request.headers.get("Authorization", ""))
    g.tenant = found
    if found is not None or request.endpoint in PUBLIC_ENDPOINTS:
        return None
    reply, status = error(
        401, "authorization: a valid 'Authorization: Bearer <token>' header is required", "authorization"
    )
    reply.headers["WWW-Authenticate"] = 'Bearer realm="encore"'
    return reply, status


def tenant() -> Tenant:
    """The tenant of the request being served (a protected route has one: `authenticate` refused it otherwise)."""
    found: Tenant | None = g.get("tenant")
    if found is None:
        raise LookupError("no tenant: the route is public, or authenticate did not run")
    return found


def admin_refusal() -> tuple[Response, int] | None:
    """403 naming the role unless the request's tenant is an admin: the operator routes (drain, resume, the
    worker table) and every-tenant views are theirs."""
    if tenant().is_admin:
        return None
    return error(403, "role: this route is for admin tenants (ENCORE_ADMIN_TOKENS or the tenants file)", "role")


def arm_body_timeout() -> None:
    """Under gunicorn, a request that carries a body gets a read timeout on its socket: a client that sends
    nothing for ENCORE_BODY_IDLE_S is answered 408 (errors.body_stalled) and dropped (its unread body cannot
    be drained) instead of holding a thread forever."""
    client = request.environ.get("gunicorn.socket")
    if client is not None and (request.content_length or request.headers.get("Transfer-Encoding")):
        client.settimeout(context().settings.body_idle_s)
