"""Orphaned deliveries (a worker's master died mid-stage) against a real Redis broker and kombu channel."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from app.celery_app import make_celery
from app.recovery import (detach_waiting_tracks, restart_started_tracks, restore, stranded, unacked_before,
                          why_not_safe)
from app.routing import enqueue_track
from tests.conftest import unit_services


@pytest.fixture
def svc(redis_base_url, tmp_path):
    return unit_services(redis_base_url, 509, tmp_path)


def _deliver_without_ack(svc, queue: str, ref: dict) -> tuple[object, object]:
    """Publish a stage message the way the web does, then take it like a worker that never acks."""
    app = make_celery(svc.settings)
    app.signature("encore.music.backbone", args=(ref,)).set(queue=queue, priority=0).apply_async()
    connection = app.connection_for_write()
    channel = connection.default_channel
    message = channel.basic_get(queue, no_ack=False)
    assert message is not None
    return connection, channel


def test_unacked_delivery_is_found_and_restored_to_the_head_of_its_queue(svc):
    connection, channel = _deliver_without_ack(svc, "gpu7", {"job_id": "j1", "track": 1})
    try:
        assert svc.redis.hlen("unacked") == 1
        assert unacked_before(channel, {"gpu3"}, time.time()) == []  # another queue's delivery is left alone
        assert unacked_before(channel, {"gpu7"}, time.time() - 3600) == []  # delivered after the cut-off
        [orphan] = unacked_before(channel, {"gpu7"}, time.time())
        assert (orphan.task_name, orphan.queue, orphan.args) == ("encore.music.backbone", "gpu7",
                                                                  ({"job_id": "j1", "track": 1},))
        restore(channel, orphan)
        assert svc.redis.hlen("unacked") == 0 and svc.redis.zcard("unacked_index") == 0
        again = channel.basic_get("gpu7", no_ack=True)
        assert again is not None and again.headers["id"] == orphan.task_id
    finally:
        connection.release()


def test_not_safe_while_a_predecessor_lives_or_another_worker_shares_the_queue(svc):
    me = "gpu0@host"
    assert why_not_safe(svc.workers, me, {"gpu0"}, os.getpid()) is None  # nobody else: safe
    svc.workers.heartbeat(me, {"queue": "gpu0", "pid": os.getpid()})  # my own earlier heartbeat: safe
    assert why_not_safe(svc.workers, me, {"gpu0"}, os.getpid()) is None

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        svc.workers.heartbeat(me, {"queue": "gpu0", "pid": sleeper.pid})  # a living process under my name
        assert "still running" in why_not_safe(svc.workers, me, {"gpu0"}, os.getpid())
    finally:
        sleeper.kill()
        sleeper.wait()
    assert why_not_safe(svc.workers, me, {"gpu0"}, os.getpid()) is None  # it died: safe again

    svc.workers.heartbeat("other@host", {"queue": "gpu1,gpu0", "pid": 1})
    assert why_not_safe(svc.workers, me, {"gpu0"}, os.getpid()) == "other@host also consumes gpu0"
    assert why_not_safe(svc.workers, me, {"gpu2"}, os.getpid()) is None
    svc.workers.forget("other@host")
    assert why_not_safe(svc.workers, me, {"gpu0"}, os.getpid()) is None


def test_waiting_tracks_are_detached_only_while_their_message_is_still_queued(svc):
    app = make_celery(svc.settings)
    options = dict(app.conf.broker_transport_options)
    first, second = (svc.jobs.create("music", {}, [{"seed": s}], cost=1.0) for s in (1, 2))
    for job_id in (first, second):
        enqueue_track(svc, app, job_id, 0, "gpu5")
    svc.workers.heartbeat("gpu5@host", {"queue": "gpu5", "pid": 1})
    now = time.time()
    assert stranded(svc, ["gpu5"], set(svc.workers.live_queues()), after_s=60, now=now) == []  # its worker is live
    svc.workers.forget("gpu5@host")
    assert stranded(svc, ["gpu5"], set(svc.workers.live_queues()), after_s=60, now=now) == []  # offline for less than 60 s
    assert stranded(svc, ["gpu5"], set(svc.workers.live_queues()), after_s=60, now=now + 120) == ["gpu5"]

    taken = svc.redis.rpop("gpu5:9")  # a worker took the first job's message (kombu pops from the right)
    assert taken is not None
    moved = detach_waiting_tracks(svc, "gpu5", options, "test:parked")
    assert moved == [f"{second}:0"] and svc.redis.lrange("test:parked", 0, -1) == moved
    assert svc.redis.llen("gpu5:9") == 0
    assert svc.jobs.record(second)["tracks"][0]["queue"] == "" and svc.jobs.record(second)["tracks"][0]["task_ids"] == []
    assert svc.jobs.record(first)["tracks"][0]["queue"] == "gpu5"  # its message was taken: it stays
    assert svc.redis.zrange(svc.jobs.waiting_key("gpu5"), 0, -1) == [f"{first}:0"]
    assert detach_waiting_tracks(svc, "gpu5", options, "test:parked") == []  # idempotent


def test_a_track_restarted_too_often_fails_instead_of_moving_again(svc):
    job_id = svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    svc.jobs.assign_queue(job_id, 0, "gpu3", ["t1", "t2", "t3", "t4"], 1.0)
    for restart in range(1, svc.settings.max_deliveries + 1):
        svc.jobs.mark_started(job_id, 0, "gpu3")
        svc.jobs.update(job_id, 0, state="superres", stage="superres", running="1", worker="gpu3@dead")
        assert restart_started_tracks(svc, "gpu3", "test:parked") == ([f"{job_id}:0"], [])
        track = svc.jobs.track(job_id, 0)
        assert (track["state"], track["queue"], track["task_ids"], track["restarts"]) == ("queued", "", [], restart)
        assert track["detail"] == "restarting from its first stage: gpu3@dead went offline during superres"
        svc.jobs.assign_queue(job_id, 0, "gpu3", [f"t{restart}"], 1.0)
    svc.jobs.mark_started(job_id, 0, "gpu3")
    svc.jobs.update(job_id, 0, state="backbone", stage="backbone", running="1", worker="gpu3@dead")
    assert restart_started_tracks(svc, "gpu3", "test:parked") == ([], [f"{job_id}:0"])
    track = svc.jobs.track(job_id, 0)
    assert track["state"] == "failed" and "its stage died 4 times (gpu3@dead went offline" in track["error"]
    assert svc.redis.zcard(svc.jobs.load_key("gpu3")) == 0


def test_a_music_track_resumes_after_its_finished_stages_a_lipsync_one_starts_over(svc):
    """Music intermediates are in the shared artifact store: a moved track keeps its finished stages (the new
    chain skips them) and drops the one that was running. Lip-sync's are in the dead worker's scratch."""
    finished = {"backbone": {"started_at": 1.0, "finished_at": 2.0, "worker": "gpu3@dead"},
                "superres": {"started_at": 2.0, "worker": "gpu3@dead"}}
    ids = {}
    for kind in ("music", "lipsync"):
        ids[kind] = job_id = svc.jobs.create(kind, {}, [{"seed": 1}], cost=1.0)
        svc.jobs.assign_queue(job_id, 0, "gpu3", ["t1", "t2"], 1.0)
        svc.jobs.mark_started(job_id, 0, "gpu3")
        svc.jobs.update(job_id, 0, state="superres", stage="superres", running="1", worker="gpu3@dead",
                        stages=finished)
    restarted, failed = restart_started_tracks(svc, "gpu3", "test:parked")
    assert sorted(restarted) == sorted(f"{job_id}:0" for job_id in ids.values()) and failed == []
    music, lipsync = svc.jobs.track(ids["music"], 0), svc.jobs.track(ids["lipsync"], 0)
    assert music["stages"] == {"backbone": finished["backbone"]} and music["state"] == "queued"
    assert music["detail"] == "restarting after backbone: gpu3@dead went offline during superres"
    assert lipsync["stages"] == {} and lipsync["detail"].startswith("restarting from its first stage")


def test_leases_are_taken_only_by_a_current_delivery_and_renewed_only_by_their_owner(svc):
    job_id = svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    svc.jobs.assign_queue(job_id, 0, "gpu3", ["t1", "t2"], 1.0)
    assert not svc.jobs.take_lease(job_id, 0, "gpu3@a|old|1", "t0", 5)  # not of the track's current chain
    assert svc.jobs.take_lease(job_id, 0, "gpu3@a|t1|1", "t1", 5) and svc.jobs.has_lease(job_id, 0)
    assert svc.jobs.renew_lease(job_id, 0, "gpu3@a|t1|1", 5)
    assert not svc.jobs.renew_lease(job_id, 0, "gpu3@b|t1|2", 5)  # someone else's
    svc.jobs.release_lease(job_id, 0, "gpu3@b|t1|2")  # not its own: no effect
    assert svc.jobs.has_lease(job_id, 0)
    svc.jobs.release_lease(job_id, 0, "gpu3@a|t1|1")
    assert not svc.jobs.has_lease(job_id, 0) and not svc.jobs.renew_lease(job_id, 0, "gpu3@a|t1|1", 5)
    svc.jobs.fail(job_id, 0, "x")
    assert not svc.jobs.take_lease(job_id, 0, "gpu3@a|t2|1", "t2", 5)  # ended


def test_the_reaper_restarts_running_tracks_without_a_lease_cancels_canceled_ones_and_spares_live_ones(svc):
    """No worker is live here, so a restarted track is parked (unrouted), with its old chain's messages gone
    from the broker list and from kombu's unacked hash."""
    from app.routing import reap_dead_stages
    app = make_celery(svc.settings)
    jobs = {name: svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0) for name in ("dead", "live", "canceled")}
    for name, job_id in jobs.items():
        svc.jobs.assign_queue(job_id, 0, "gpu4", [f"{name}-1", f"{name}-2"], 1.0)
        svc.jobs.mark_started(job_id, 0, "gpu4")
        svc.jobs.update(job_id, 0, state="superres", stage="superres", running="1", worker="gpu4@x",
                        stages={"backbone": {"started_at": 1.0, "finished_at": 2.0}, "superres": {"started_at": 2.0}})
    assert svc.jobs.take_lease(jobs["live"], 0, "gpu4@x|live-2|1", "live-2", 30)
    svc.redis.set(svc.jobs.cancel_key(jobs["canceled"]), "1")
    connection, channel = _deliver_without_ack(svc, "gpu4", {"job_id": jobs["dead"], "track": 0})
    unacked = svc.redis.hgetall("unacked")
    tag = next(iter(unacked))
    svc.redis.hset("unacked", tag, unacked[tag].replace(
        json.loads(unacked[tag])[0]["headers"]["id"], "dead-2"))  # make it the dead track's running delivery
    try:
        assert reap_dead_stages(svc, app) == 1
    finally:
        connection.release()
    dead, live, canceled = (svc.jobs.track(jobs[name], 0) for name in ("dead", "live", "canceled"))
    assert (dead["state"], dead["queue"], dead["restarts"], list(dead["stages"])) == ("queued", "", 1, ["backbone"])
    assert dead["detail"] == "restarting after backbone: the lease of gpu4@x expired during superres"
    assert svc.redis.lrange(f"{svc.settings.key_prefix}:unrouted", 0, -1) == [f"{jobs['dead']}:0"]
    assert svc.redis.hlen("unacked") == 0
    assert (live["state"], live["running"]) == ("superres", "1")
    assert canceled["state"] == "canceled" and "its stage had stopped" in canceled["detail"]
    assert svc.redis.zrange(svc.jobs.load_key("gpu4"), 0, -1) == [f"{jobs['live']}:0"]
