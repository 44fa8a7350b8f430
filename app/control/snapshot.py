"""One consistent read of what an operator view shows (GET /api/v1/status, GET /metrics, Khala's GET /status): a
single Lua round trip (app/control/lifecycle.Lifecycle.snapshot), whatever the number of jobs. Each view names the
parts it shows, and the script reads only those: the status table does not pay for /metrics' histograms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.control.broker import broker_lists
from app.control.jobs import JOB_STATES
from app.core.kinds import KINDS
from app.control.services import Services
from app.control.workers import worker_entry


PARTS = frozenset({"workers", "queues", "jobs", "submitted", "stages", "rates"})
STATUS_PARTS = frozenset({"workers", "queues"})  # GET /api/v1/status
KHALA_STATUS_PARTS = frozenset({"workers", "jobs"})  # Khala's GET /status


@dataclass(frozen=True)
class Snapshot:
    """A part not asked for is empty (no workers, no queues, zero unrouted, no counts)."""

    workers: list[dict[str, Any]]  # as WorkerRegistry.workers() gives them
    queues: list[dict[str, Any]]  # name, waiting, outstanding, estimated_load, broker_messages, draining
    unrouted: int
    jobs: dict[tuple[str, str], int]  # (kind, overall state) -> jobs held in Redis
    submitted: dict[str, int]  # kind -> jobs accepted since Redis was created
    stages: dict[tuple[str, str], dict[str, str]]  # (kind, stage) -> its duration histogram's raw counters
    rates: dict[str, str]  # the learned seconds per cost unit, raw (app/control/eta.py)


def take_snapshot(
    svc: Services,
    transport_options: dict[str, Any],
    parts: frozenset[str] = PARTS,
    job_states: tuple[str, ...] = JOB_STATES,
) -> Snapshot:
    """The `parts` of the snapshot (all by default: /metrics shows them all); job counts only of `job_states`."""
    if unknown := parts - PARTS:
        raise ValueError(f"unknown snapshot parts {sorted(unknown)}")
    states = [(kind, state) for kind in sorted(KINDS) for state in job_states] if "jobs" in parts else []
    stages = [(kind, stage.name) for kind in sorted(KINDS) for stage in KINDS[kind].stages] if "stages" in parts else []
    raw = svc.jobs.lifecycle.snapshot(parts, states, stages, broker_lists("", transport_options))
    workers = [worker_entry(w["name"], _dict(w["info"]), _dict(w["current"])) for w in _list(raw["workers"])]
    queues = [
        {
            "name": q["name"],
            "waiting": q["waiting"],
            "outstanding": q["outstanding"],
            "estimated_load": q["cost"] / 1000,
            "broker_messages": q["broker_messages"],
            "draining": q["draining"],
        }
        for q in _list(raw["queues"])
    ]
    return Snapshot(
        workers=workers,
        queues=queues,
        unrouted=raw.get("unrouted", 0),
        jobs=dict(zip(states, _list(raw["jobs"]), strict=True)),
        submitted={kind: int(n) for kind, n in _dict(raw.get("submitted")).items()},
        stages={pair: _dict(h) for pair, h in zip(stages, _list(raw["stages"]), strict=True)},
        rates=_dict(raw.get("rates")),
    )


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []  # cjson writes an empty table as {}


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}
