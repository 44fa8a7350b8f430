"""Readiness: can this deployment take work now? (`GET /readyz`; `/healthz` stays liveness.)

Ready means Redis answers and at least one live worker has the models of every job kind it serves loaded:
each worker's heartbeat lists the kinds it serves (`kinds`) and its pool child, once its preload
(ENCORE_PRELOAD=1) has loaded a kind's models, adds it to `models_loaded` in the same registry entry
(app/control/workers.py). A load balancer sends traffic, and an orchestrator counts a worker up, only then.

`python -m app.control.readiness <worker name>` exits 0 when that one worker is ready (docker-compose's worker
healthcheck); without a name, when the deployment is.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import redis

from app.core.kinds import KINDS
from app.control.services import Services


def _names(value: Any) -> list[str]:
    return sorted(name for name in str(value or "").split(",") if name)


def worker_readiness(worker: dict[str, Any]) -> dict[str, Any]:
    """One live worker: the kinds it serves, those whose models it has loaded, and whether that is all. A host's
    CPU-stage worker (`role` cpu) loads no model: it is ready while live, and serves no kind on its own."""
    if worker.get("role") == "cpu":
        return {"name": worker["name"], "role": "cpu", "kinds": [], "models_loaded": [], "ready": True, "missing": []}
    kinds = _names(worker.get("kinds")) or sorted(KINDS)  # a worker from before `kinds` serves them all
    loaded = _names(worker.get("models_loaded"))
    missing = [kind for kind in kinds if kind not in loaded]
    return {"name": worker["name"], "kinds": kinds, "models_loaded": loaded, "ready": not missing, "missing": missing}


def readiness(svc: Services) -> tuple[bool, dict[str, Any]]:
    """(ready, the reply body); a 503's body says why in `error`."""
    try:
        svc.redis.ping()
        workers = [w for w in svc.workers.workers() if w["status"] != "offline"]
    except redis.RedisError as exc:
        return False, {"ready": False, "redis": f"down: {exc}", "workers": [], "error": f"redis: down ({exc})"}
    entries = [worker_readiness(w) for w in workers]
    serving = [e for e in entries if e.get("role") != "cpu"]  # a CPU-stage worker alone runs no job
    body: dict[str, Any] = {"ready": any(e["ready"] for e in serving), "redis": "ok", "workers": entries}
    if not body["ready"]:
        body["error"] = _reason(serving)
    return body["ready"], body


def _reason(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "workers: no live worker"
    loading = "; ".join(f"{e['name']} has not loaded {', '.join(e['missing'])}" for e in entries)
    return f"workers: no live worker has its models loaded ({loading})"


def main(argv: Sequence[str] | None = None) -> int:
    from app.control.services import services

    args = list(sys.argv[1:] if argv is None else argv)
    svc = services()
    ready, body = readiness(svc)
    if args:
        mine = [e for e in body["workers"] if e["name"] == args[0]]
        ready = bool(mine) and mine[0]["ready"]
        body = mine[0] if mine else {"error": f"{args[0]} is not live"}
    print(("ready: " if ready else "not ready: ") + str(body.get("error") or body.get("name") or "ok"))
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
