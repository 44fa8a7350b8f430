"""Routing decisions from the real worker registry and job records in Redis."""

from __future__ import annotations

import pytest

from app.adapters.celery_app import make_celery
from app.control.routing import build_chain, pick_queue, queue_loads
from harness.stack import project_celery_config, unit_services


@pytest.fixture
def svc(redis_base_url, tmp_path):
    return unit_services(redis_base_url, 511, tmp_path)


@pytest.fixture
def celery_config(svc):
    """pytest-celery's `celery_app` is the project's Celery app on this module's Redis database."""
    return project_celery_config(svc.settings)


def test_the_celery_app_fixture_is_configured_as_the_project_app(svc, celery_app):
    """What the unit tests send with (pytest-celery's `celery_app`) is what the web sends with."""
    project, keys = make_celery(svc.settings).conf, project_celery_config(svc.settings)
    assert {key: celery_app.conf[key] for key in keys} == {key: project[key] for key in keys}
    assert celery_app.conf.broker_url == svc.settings.redis_url and not celery_app.conf.task_always_eager


def test_least_outstanding_work_wins_and_offline_queues_are_skipped(svc):
    assert pick_queue(svc) is None
    for name, queue in (("gpu0@a", "gpu0"), ("gpu1@a", "gpu1"), ("gpu2@b", "gpu2")):
        svc.workers.heartbeat(name, {"queue": queue})
    assert pick_queue(svc) == "gpu0"  # tie: lowest index
    heavy = svc.jobs.create("music", {}, [{"seed": 0}], cost=120.0)
    svc.jobs.route(heavy, 0, "gpu0", ["h"])
    light = svc.jobs.create("music", {}, [{"seed": 0}], cost=30.0)
    svc.jobs.route(light, 0, "gpu1", ["l"])
    assert queue_loads(svc, ["gpu0", "gpu1", "gpu2"]) == {"gpu0": 120.0, "gpu1": 30.0, "gpu2": 0.0}
    assert pick_queue(svc) == "gpu2"
    svc.workers.forget("gpu2@b")
    svc.redis.sadd("encore:workers", "gpu2@b")  # known but no heartbeat: offline
    assert pick_queue(svc) == "gpu1"
    svc.jobs.cancel(heavy, 0, "canceled")
    assert pick_queue(svc) == "gpu0"


def test_every_signature_carries_queue_and_first_stage_has_lowest_priority(celery_app):
    from app.core.kinds import MUSIC

    workflow, task_ids = build_chain(celery_app, MUSIC, {"job_id": "x", "track": 0}, "gpu3")
    tasks = workflow.tasks
    assert [t.task for t in tasks] == [s.task for s in MUSIC.stages]
    assert all(t.options["queue"] == "gpu3" for t in tasks)
    assert [t.options["priority"] for t in tasks] == [6, 0, 0, 0]  # a normal job's first stage, then above every level
    assert [t.options["task_id"] for t in tasks] == task_ids and len(set(task_ids)) == 4


def test_routing_weighs_learned_seconds_so_a_slow_card_gets_less_work(svc):
    """gpu0 learned that it takes three times as long per song second as gpu1 (what its stages' finishes teach,
    app/control/eta.py): of four like tracks it gets one; a card that learned nothing yet borrows the fleet's mean."""
    from app.control import eta
    from app.core.kinds import MUSIC

    for name, queue in (("gpu0@a", "gpu0"), ("gpu1@a", "gpu1")):
        svc.workers.heartbeat(name, {"queue": queue})
    for stage in MUSIC.stages:
        eta.learn(svc, "gpu0", "music", stage.name, seconds=3.0, cost=10.0)
        eta.learn(svc, "gpu1", "music", stage.name, seconds=1.0, cost=10.0)
    placed = []
    for seed in range(4):
        job = svc.jobs.create("music", {}, [{"seed": seed}], cost=10.0)
        queue = pick_queue(svc, work=("music", 10.0))
        assert svc.jobs.route(job, 0, queue, [f"t{seed}"])
        placed.append(queue)
    assert placed == ["gpu1", "gpu1", "gpu0", "gpu1"]  # done soonest: 4 s, 8 s, then 12 s on either (the tie)
    assert queue_loads(svc, ["gpu0", "gpu1"]) == {"gpu0": 12.0, "gpu1": 12.0}  # seconds, not song seconds
    assert eta.new_track_seconds(svc, "gpu2", "music", 10.0) == pytest.approx(8.0)
