"""Priorities (`high | normal | low`): first stages run by level, then in submission order; a started job's
later stages still run before any other job's first stage, whatever its priority (FIFO across stages).
Real Redis, the project's Celery app, real worker processes."""

from __future__ import annotations

from itertools import pairwise
import json

import pytest

from app.control.broker import broker_lists, find_message
from app.core.kinds import MUSIC
from app.core.priority import FIRST_STAGE_PRIORITY, LATER_STAGE_PRIORITY
from app.control.routing import build_chain, dispatch_unrouted, route_job
from app.http.submissions import create_job
from harness.processes import wait_until
from harness.stack import REFERENCE_ENGINE, project_celery_config, unit_services
from harness.media import face_video, tone, upload

pytestmark = pytest.mark.slow  # priority ordering over a busy worker (~15 s here)

BUSY_S = 30.0  # song seconds that keep the reference engine's backbone busy while the test submits three jobs


@pytest.fixture
def svc(redis_base_url, tmp_path):
    return unit_services(redis_base_url, 502, tmp_path)


@pytest.fixture
def celery_config(svc):
    return project_celery_config(svc.settings)


def test_a_first_stage_carries_its_level_and_later_stages_outrank_every_level(celery_app):
    ref = {"job_id": "x", "track": 0}
    for level in ("high", "normal", "low"):
        workflow, _ = build_chain(celery_app, MUSIC, ref, "gpu3", priority=level)
        assert [t.options["priority"] for t in workflow.tasks] == [FIRST_STAGE_PRIORITY[level]] + [0, 0, 0]
    assert LATER_STAGE_PRIORITY < min(FIRST_STAGE_PRIORITY.values())
    assert FIRST_STAGE_PRIORITY["high"] < FIRST_STAGE_PRIORITY["normal"] < FIRST_STAGE_PRIORITY["low"]  # 0: highest
    resumed, _ = build_chain(celery_app, MUSIC, ref, "gpu3", start=1, priority="low")  # a started track's chain
    assert [t.options["priority"] for t in resumed.tasks] == [0, 0, 0]


def _submit(svc, celery_app, level: str | None) -> str:
    params = {"mode": "instrumental"} | ({"priority": level} if level else {})
    job_id = create_job(svc, "music", params, [{"seed": 1}], cost=1.0)
    route_job(svc, celery_app, job_id, 1)
    return job_id


def test_parked_tracks_are_dispatched_and_queued_by_priority_then_submission(svc, celery_app):
    jobs = {
        name: _submit(svc, celery_app, level)
        for name, level in (("low", "low"), ("normal", None), ("high", "high"), ("normal2", "normal"))
    }  # None: the default
    expected = ["high", "normal", "normal2", "low"]
    members = {f"{job_id}:0": name for name, job_id in jobs.items()}
    assert [members[m] for m in svc.redis.zrange(svc.jobs.keys.unrouted, 0, -1)] == expected  # no worker: parked
    assert [svc.jobs.record(jobs[name])["queue_position"] for name in expected] == [1, 2, 3, 4]

    svc.workers.heartbeat("gpu9@a", {"queue": "gpu9"})
    assert dispatch_unrouted(svc, celery_app, limit=1) == 1
    assert svc.jobs.track(jobs["high"], 0)["queue"] == "gpu9", "the high job was not dispatched first"
    assert dispatch_unrouted(svc, celery_app) == 3
    assert [members[m] for m in svc.redis.zrange(svc.jobs.waiting_key("gpu9"), 0, -1)] == expected
    assert [svc.jobs.record(jobs[name])["queue_position"] for name in expected] == [1, 2, 3, 4]

    lists = broker_lists("gpu9", dict(celery_app.conf.broker_transport_options))
    for name, level in (("high", "high"), ("normal", "normal"), ("normal2", "normal"), ("low", "low")):
        key, _ = find_message(svc.redis, lists, svc.jobs.track(jobs[name], 0)["task_ids"][0])
        assert key == f"gpu9:{FIRST_STAGE_PRIORITY[level]}", (name, key)
        assert svc.redis.hget(svc.jobs.job_key(jobs[name]), "priority") == level  # what the transitions order by
    normal_list = f"gpu9:{FIRST_STAGE_PRIORITY['normal']}"
    popped = [json.loads(p)["headers"]["id"] for p in reversed(svc.redis.lrange(normal_list, 0, -1))]  # RPOP order
    assert popped == [svc.jobs.track(jobs[n], 0)["task_ids"][0] for n in ("normal", "normal2")]


def test_first_stages_run_by_priority_and_started_jobs_are_not_overtaken(make_stack):
    stack = make_stack(**REFERENCE_ENGINE)
    stack.start_worker(0)
    busy = stack.submit_music(duration_s=BUSY_S, priority="low")  # low, but started: nothing overtakes it
    wait_until(lambda: stack.job(busy)["tracks"][0]["state"] == "backbone", 60, what="the busy job's backbone")
    jobs = {level: stack.submit_music(priority=level, seed=i) for i, level in enumerate(("low", "high", "normal"))}
    queued = {level: stack.job(job_id) for level, job_id in jobs.items()}
    assert {level: r["queue_position"] for level, r in queued.items()} == {"high": 1, "normal": 2, "low": 3}
    assert {level: r["params"]["priority"] for level, r in queued.items()} == {l: l for l in jobs}

    records = {"busy": stack.wait_job(busy, timeout=240), **{level: stack.wait_job(j) for level, j in jobs.items()}}
    assert all(r["state"] == "done" for r in records.values()), records
    # No healthy track restarted (a reaper that took a finishing stage for dead restarted one, dropped its next
    # message and let the next job's first stage in: tests/test_recovery.py forces that interleaving).
    assert {name: r["tracks"][0]["restarts"] for name, r in records.items()} == dict.fromkeys(records, 0)
    stages = {name: r["tracks"][0]["stages"] for name, r in records.items()}
    last_submitted = max(r["created_at"] for r in queued.values())
    assert stages["busy"]["export"]["finished_at"] > last_submitted, "the busy job ended before all were queued"
    order = sorted(stages, key=lambda name: stages[name]["backbone"]["started_at"])
    assert order == ["busy", "high", "normal", "low"], order
    for earlier, later in pairwise(order):  # each job's later stages before the next job's first
        assert stages[earlier]["export"]["finished_at"] <= stages[later]["backbone"]["started_at"], (earlier, later)


def test_priority_is_validated_and_recorded_on_both_submit_routes(make_stack, tmp_path):
    stack = make_stack()
    for bad in ("urgent", 1, None):
        reply = stack.client.post("/api/v1/music", json={"mode": "instrumental", "tags": "piano", "priority": bad})
        assert reply.status_code == 400 and reply.get_json()["field"] == "priority", reply.get_json()
    assert stack.job(stack.submit_music())["params"]["priority"] == "normal"
    assert stack.job(stack.submit_music(priority="high"))["params"]["priority"] == "high"

    video, audio = face_video(tmp_path / "face.mp4", 3.2), tone(tmp_path / "voice.wav", 2.0)
    reply = upload(stack.client, video, audio, priority="urgent")
    assert reply.status_code == 400 and reply.get_json()["field"] == "priority", reply.get_json()
    for given, recorded in (({}, "normal"), ({"priority": ""}, "normal"), ({"priority": "low"}, "low")):
        reply = upload(stack.client, video, audio, **given)
        assert reply.status_code == 202, reply.get_json()
        assert stack.job(reply.get_json()["job_id"])["params"]["priority"] == recorded


def test_the_openapi_document_offers_priority_on_both_submit_routes(make_stack):
    spec = make_stack().client.get("/api/v1/openapi.json").get_json()
    music = spec["components"]["schemas"]["MusicRequest"]["properties"]["priority"]
    assert (music["enum"], music["default"]) == (["high", "normal", "low"], "normal")
    form = spec["paths"]["/api/v1/lipsync"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["priority"]["enum"] == ["high", "normal", "low"]
    assert "priority" not in form["required"]


def test_the_cli_sends_a_priority_only_when_given():
    from app.clients.cli import build_parser, music_body

    parser = build_parser()
    assert music_body(parser.parse_args(["submit", "music", "--tags", "x", "--priority", "low"]))["priority"] == "low"
    assert "priority" not in music_body(parser.parse_args(["submit", "music", "--tags", "x"]))
