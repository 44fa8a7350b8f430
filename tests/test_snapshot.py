"""The operator views' snapshot (app/control/snapshot.py): a view that asks for some parts gets exactly what the
full snapshot holds for those parts, and nothing of the others (the script skips their reads)."""

from __future__ import annotations

import os

import pytest

from app.control.snapshot import KHALA_STATUS_PARTS, PARTS, STATUS_PARTS, take_snapshot
from harness.stack import unit_services


@pytest.fixture
def svc(redis_base_url, tmp_path):
    services = unit_services(redis_base_url, 503, tmp_path)
    for name, queue in (("gpu0@snap", "gpu0"), ("gpu1@snap", "gpu1")):
        services.workers.heartbeat(name, {"queue": queue, "pid": os.getpid()})
    for index in range(6):
        job_id = services.jobs.create("music", {"mode": "instrumental"}, [{"seed": 1}], cost=10.0)
        services.jobs.route(job_id, 0, f"gpu{index % 2}", [f"{job_id}-0-{s}" for s in range(4)])
        if index % 3 == 0:
            owner = f"gpu{index % 2}@snap|{job_id}-0-0|1"
            services.jobs.transition(
                "start",
                job_id,
                0,
                stage="backbone",
                owner=owner,
                task_id=f"{job_id}-0-0",
                worker=f"gpu{index % 2}@snap",
                lease_ms=600_000,
            )
    services.redis.hincrby(services.jobs.keys.submitted, "music", 6)
    return services


def test_each_part_equals_the_full_snapshots_and_parts_not_asked_for_are_empty(svc):
    full = take_snapshot(svc, {})
    assert len(full.workers) == 2 and [q["name"] for q in full.queues] == ["gpu0", "gpu1"]
    assert full.jobs[("music", "running")] == 2 and full.jobs[("music", "queued")] == 4
    assert full.submitted == {"music": 6}

    status = take_snapshot(svc, {}, STATUS_PARTS)
    assert (status.workers, status.queues, status.unrouted) == (full.workers, full.queues, full.unrouted)
    assert (status.jobs, status.submitted, status.stages, status.rates) == ({}, {}, {}, {})

    khala = take_snapshot(svc, {}, KHALA_STATUS_PARTS, job_states=("running", "queued"))
    assert khala.workers == full.workers and khala.queues == []
    assert khala.jobs == {pair: n for pair, n in full.jobs.items() if pair[1] in ("running", "queued")}
    assert (khala.submitted, khala.stages) == ({}, {})

    for part in PARTS:  # every part alone reads what the full snapshot holds for it
        alone = take_snapshot(svc, {}, frozenset({part}))
        assert getattr(alone, part) == getattr(full, part), part


def test_an_unknown_part_is_refused(svc):
    with pytest.raises(ValueError, match="unknown snapshot parts"):
        take_snapshot(svc, {}, frozenset({"workers", "everything"}))
