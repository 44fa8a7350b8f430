"""Operating the service: liveness and readiness probes, Prometheus metrics, the workers and queues, and
draining a queue for GPU maintenance."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from flask import Blueprint, Response, jsonify
from flask.typing import ResponseReturnValue
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.http.context import context
from app.http.guards import admin_refusal
from app.http.replies import error
from app.http.openapi import documented
from app.control.readiness import readiness
from app.control.routing import drain_queue, known_queues, resume_queue
from app.http.schemas import DrainReply, HealthReply, ReadyReply, StatusReply
from app.control.snapshot import take_snapshot

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
    """Prometheus exposition: jobs by kind/state, stage durations, queue depths, workers (no auth)."""
    return Response(generate_latest(context().metrics), content_type=CONTENT_TYPE_LATEST)  # it names its charset


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
    snapshot = take_snapshot(shared.services, shared.transport_options)
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
