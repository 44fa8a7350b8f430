"""Operating the service: liveness and readiness probes, Prometheus metrics, the workers and queues, and
draining a queue for GPU maintenance."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from flask import Blueprint, Response, g, jsonify, request
from flask.typing import ResponseReturnValue
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.http.context import context
from app.http.guards import admin_refusal, tenant
from app.control.metrics import tenant_registry
from app.control.tenant_limits import usage as tenant_usage
from app.core.config import Settings
from app.core.tenants import DEFAULT_TENANT
from app.http.replies import error
from app.http.openapi import documented
from app.control.readiness import readiness
from app.control.routing import drain_queue, known_queues, resume_queue
from app.http.schemas import DrainReply, HealthReply, ReadyReply, StatusReply, UsageReply
from app.control.snapshot import STATUS_PARTS, take_snapshot

log = logging.getLogger("encore.web")
ADMIN_ONLY = "the token's tenant is not an admin (`field`: role)"
blueprint = Blueprint("ops", __name__)


@blueprint.get("/metrics")
@documented(
    "Prometheus exposition: jobs by kind/state, stage durations, queue depths, workers",
    responses={200: ("the metrics, text format 0.0.4", None)},
    media=("text/plain",),
)
def metrics() -> ResponseReturnValue:
    """Prometheus exposition: jobs by kind/state, stage durations, queue depths, workers (no auth). Where tokens
    are configured, a scrape with an admin token also gets each tenant's usage, labelled by tenant names from
    the configuration only (a bounded set); with none configured the one implicit tenant's usage is the totals."""
    shared = context()
    text = generate_latest(shared.metrics)
    viewer = g.get("tenant")
    if shared.settings.authenticated and viewer is not None and viewer.is_admin:
        text += generate_latest(tenant_registry(shared.services, known_tenants(shared.settings)))
    return Response(text, content_type=CONTENT_TYPE_LATEST)  # it names its charset


@blueprint.get("/api/v1/usage")
@documented(
    "Usage per tenant: jobs, tracks, GPU-seconds, open tracks (a client: its own; an admin: any or all)",
    responses={200: ("usage", UsageReply), 403: ADMIN_ONLY + " (another tenant's usage)", 404: "unknown tenant"},
    query={"tenant": {"type": "string", "description": "admin: a tenant's name, or `all`"}},
)
def usage() -> ResponseReturnValue:
    """What the request's tenant has used (`?tenant=`: for admins, another tenant's, or `all`)."""
    shared = context()
    viewer = tenant()
    asked = request.args.get("tenant", viewer.name)
    if asked != viewer.name:
        if refused := admin_refusal():
            return refused
        names = known_tenants(shared.settings)
        if asked != "all" and asked not in names:
            return error(404, f"tenant {asked[:64]!r} not found", "tenant")
        if asked != "all":
            names = [asked]
    else:
        names = [viewer.name]
    return jsonify({"tenants": tenant_usage(shared.services, names)})


def known_tenants(settings: Settings) -> list[str]:
    """Every configured tenant's name, and `default` (the implicit tenant, and owner of jobs older than tenants)."""
    return sorted({DEFAULT_TENANT, *(t.name for t in settings.tenants.tenants)})


@blueprint.get("/healthz")
@documented("Liveness of the web and its Redis", responses={200: ("both up", HealthReply), 503: "Redis is down"})
def healthz() -> ResponseReturnValue:
    """Liveness of the web and its Redis."""
    try:
        context().services.redis.ping()
    except redis.RedisError as exc:
        return jsonify({"web": "ok", "redis": f"down: {exc}", "error": f"redis: down ({exc})"}), 503
    return jsonify({"web": "ok", "redis": "ok"})


@blueprint.get("/readyz")
@documented(
    "Readiness: Redis answers and a live worker has the models of every kind it serves loaded",
    responses={200: ("ready", ReadyReply), 503: "not ready (why in `error`)"},
)
def readyz() -> ResponseReturnValue:
    """Readiness for load balancers and orchestrators; liveness is /healthz."""
    ready, body = readiness(context().services)
    return jsonify(body), 200 if ready else 503


@blueprint.post("/api/v1/queues/<queue>/drain")
@documented(
    "Drain a queue (GPU maintenance; admin)",
    responses={200: ("drained", DrainReply), 403: ADMIN_ONLY, 404: "unknown queue"},
)
def drain(queue: str) -> ResponseReturnValue:
    """Drain a queue (GPU maintenance): no new tracks go there and its tracks not started move to other
    queues; its running stage and started tracks finish there."""
    if refused := admin_refusal():
        return refused
    shared = context()
    if queue not in known_queues(shared.services):
        return error(404, f"queue {queue} not found", "queue")
    moved = drain_queue(shared.services, shared.celery, queue)
    log.info("queue=%s event=drained moved=%d", queue, moved)
    return jsonify({"queue": queue, "draining": True, "moved": moved})


@blueprint.delete("/api/v1/queues/<queue>/drain")
@documented(
    "Route tracks to a drained queue again (admin)",
    responses={200: ("resumed", DrainReply), 403: ADMIN_ONLY, 404: "unknown queue"},
)
def resume(queue: str) -> ResponseReturnValue:
    """Route tracks to a drained queue again."""
    if refused := admin_refusal():
        return refused
    shared = context()
    if queue not in known_queues(shared.services):
        return error(404, f"queue {queue} not found", "queue")
    resume_queue(shared.services, shared.celery, queue)
    log.info("queue=%s event=resumed", queue)
    return jsonify({"queue": queue, "draining": False})


@blueprint.get("/api/v1/status")
@documented(
    "Every worker and every queue (admin)", responses={200: ("workers and queues", StatusReply), 403: ADMIN_ONLY}
)
def status() -> ResponseReturnValue:
    """Every worker (idle/busy/offline, current job and stage, device) and every queue's depth: the operator's
    table, which names the jobs running (of every tenant)."""
    if refused := admin_refusal():
        return refused
    shared = context()
    snapshot = take_snapshot(shared.services, shared.transport_options, STATUS_PARTS)
    return jsonify(
        {
            "workers": [_public_worker(w) for w in snapshot.workers],
            "queues": snapshot.queues,
            "unrouted": snapshot.unrouted,
            "time": time.time(),
        }
    )


def _public_worker(worker: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "name",
        "status",
        "queue",
        "pinned_to",
        "device",
        "runtime_mode",
        "gpu_free_bytes",
        "gpu_total_bytes",
        "pid",
        "last_seen",
        "current",
        "hostname",
        "profile",
        "music_engine",
    )
    return {k: worker.get(k) for k in keys if k in worker}
