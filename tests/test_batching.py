"""Tracks of one song on one worker share one batched backbone pass (without the in-flight engine:
ENCORE_BACKBONE_SLOTS=1), with real workers and the default engine."""

from __future__ import annotations

import time

import pytest

from harness.processes import wait_until

pytestmark = pytest.mark.slow  # batched backbone passes on a worker (~14 s here)


def test_two_tracks_on_one_worker_share_a_backbone_pass_and_sound_as_they_would_alone(make_stack):
    stack = make_stack(ENCORE_BACKBONE_SLOTS="1")
    stack.start_worker(0)
    together = stack.wait_job(stack.submit_music(duration_s=3.0, num_tracks=2, seed=11))
    assert together["state"] == "done", together
    first, second = (track["stages"]["backbone"] for track in together["tracks"])
    assert first["info"]["with_tracks"] == [1] and first["info"]["tracks_together"] == 2
    assert second["with_track"] == 0 and abs(second["finished_at"] - first["finished_at"]) < 1.0
    log = stack.worker_log(0).splitlines()
    assert any(
        f"job={together['job_id']} track=1 " in line
        and "event=stage_skipped" in line
        and "stage=backbone" in line
        and "with track 0" in line
        for line in log
    )

    alone = stack.wait_job(stack.submit_music(duration_s=3.0, num_tracks=1, seed=12))  # track 1 above: seed 12
    assert "with_tracks" not in alone["tracks"][0]["stages"]["backbone"]["info"]
    batched_wav = stack.client.get(f"/api/v1/jobs/{together['job_id']}/tracks/1.wav").data
    alone_wav = stack.client.get(f"/api/v1/jobs/{alone['job_id']}/tracks/0.wav").data
    assert len(batched_wav) > 44 and batched_wav == alone_wav


def test_cancel_during_a_batched_backbone_ends_both_tracks(make_stack):
    stack = make_stack()
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=150.0, num_tracks=2)
    wait_until(
        lambda: all(t["state"] == "backbone" and t["progress"] > 0.02 for t in stack.job(job_id)["tracks"]),
        60,
        0.05,
        "both tracks' shared backbone progress",
    )
    asked = time.monotonic()
    assert stack.client.delete(f"/api/v1/jobs/{job_id}").status_code == 200
    record = stack.wait_job(job_id, timeout=10, interval=0.05)
    assert time.monotonic() - asked < 5
    assert [t["state"] for t in record["tracks"]] == ["canceled", "canceled"], record
    assert stack.wait_job(stack.submit_music(duration_s=2.0))["state"] == "done"


def test_adopted_tracks_go_back_to_waiting_or_end_with_a_cancel(redis_base_url, tmp_path):
    """What a failed or killed batched run leaves behind (the child's list of adopted tracks may be gone)."""
    from app.core.ids import TrackRef
    from app.tasks.adoption import adopted_by_killed_run  # not app.tasks.music: see harness/stack.py
    from app.tasks.track_moves import release_adopted
    from harness.stack import unit_services

    svc = unit_services(redis_base_url, 507, tmp_path)
    owner = "gpu0@a|t0|1"
    job_id = svc.jobs.create("music", {}, [{"seed": 1}, {"seed": 2}, {"seed": 3}], cost=1.0)
    for track in range(3):
        svc.jobs.route(job_id, track, "gpu0", [f"t{track}"])
    assert svc.jobs.transition(
        "start", job_id, 0, stage="backbone", owner=owner, task_id="t0", worker="gpu0@a", lease_ms=60_000
    )

    def adopt(track: int, queue: str = "gpu0"):
        return svc.jobs.transition(
            "adopt",
            job_id,
            track,
            {"detail": "backbone together with track 0"},
            stage="backbone",
            queue_is=queue,
            owner=owner,
            worker="gpu0@a",
            lease_ms=60_000,
        )

    assert adopt(1)
    assert not adopt(1)  # already taken
    assert not adopt(2, "gpu1")  # on another queue
    assert svc.redis.zrange(svc.jobs.waiting_key("gpu0"), 0, -1) == [f"{job_id}:2"]
    assert svc.redis.hget(svc.jobs.keys.worker_current("gpu0@a"), "track") == "0"  # the run's own track

    assert adopted_by_killed_run(svc, "gpu0", TrackRef(job_id, 0), owner) == [TrackRef(job_id, 1)]
    release_adopted(svc, [TrackRef(job_id, 1)], "backbone", owner)
    track = svc.jobs.track(job_id, 1)
    assert (track["state"], track["status"], track["detail"]) == ("queued", "queued", "queued")
    assert svc.jobs.lease(job_id, 1) is None
    assert svc.redis.zrange(svc.jobs.waiting_key("gpu0"), 0, -1) == [f"{job_id}:1", f"{job_id}:2"]  # its place

    assert adopt(1)
    svc.jobs.request_cancel(job_id)
    assert svc.jobs.track(job_id, 1)["state"] == "backbone"  # its lease is live: the run sees the flag
    release_adopted(svc, [TrackRef(job_id, 1)], "backbone", owner)
    assert svc.jobs.track(job_id, 1)["state"] == "canceled"


def test_a_run_holds_tracks_of_other_jobs_as_it_holds_its_own(redis_base_url, tmp_path):
    """The worker side is job-agnostic: a run adopts a waiting track of another job, its lease thread renews that
    track's lease, the killed-run scan finds it, and a release hands it back (or ends it, its job canceled)."""
    from app.core.ids import TrackRef
    from app.tasks.adoption import adopt_waiting, adopted_by_killed_run  # not app.tasks.music: see stack.py
    from app.tasks.lease_watch import CancelWatch
    from app.tasks.track_moves import release_adopted
    from harness.stack import unit_services

    svc = unit_services(redis_base_url, 506, tmp_path)
    owner = "gpu0@a|t0|1"
    first = svc.jobs.create("music", {}, [{"seed": 1}], cost=1.0)
    second = svc.jobs.create("music", {}, [{"seed": 2}, {"seed": 3}], cost=1.0)
    for job_id, tracks in ((first, 1), (second, 2)):
        for track in range(tracks):
            svc.jobs.route(job_id, track, "gpu0", [f"{job_id}-{track}"])
    assert svc.jobs.transition(
        "start", first, 0, stage="backbone", owner=owner, task_id=f"{first}-0", worker="gpu0@a", lease_ms=60_000
    )
    others = [TrackRef(second, 0), TrackRef(second, 1)]
    adopted = adopt_waiting(
        svc, others, limit=1, stage="backbone", queue="gpu0", owner=owner, worker="gpu0@a", detail="together"
    )
    assert adopted == [TrackRef(second, 0)]  # at most `limit`, in the order given
    assert svc.jobs.lease(second, 0) == owner and svc.jobs.track(second, 0)["state"] == "backbone"

    svc.redis.pexpire(svc.jobs.lease_key(second, 0), 5_000)
    watch = CancelWatch(svc, first, 0, grace_s=5.0, adopted=list(adopted), lease_owner=owner, stage="backbone")
    assert watch.held() == [TrackRef(first, 0), TrackRef(second, 0)]
    assert watch._renew()  # every held lease, whatever its job
    assert svc.redis.pttl(svc.jobs.lease_key(second, 0)) > 5_000 + 1_000 * svc.settings.lease_s / 2  # renewed

    assert adopted_by_killed_run(svc, "gpu0", TrackRef(first, 0), owner) == [TrackRef(second, 0)]
    assert adopted_by_killed_run(svc, "gpu0", TrackRef(first, 0), "gpu0@b|t9|2") == []
    release_adopted(svc, adopted, "backbone", owner)
    track = svc.jobs.track(second, 0)
    assert (track["state"], svc.jobs.lease(second, 0)) == ("queued", None)

    assert (
        adopt_waiting(
            svc, others, limit=2, stage="backbone", queue="gpu0", owner=owner, worker="gpu0@a", detail="together"
        )
        == others
    )
    svc.jobs.request_cancel(second)
    release_adopted(svc, others, "backbone", owner)
    assert [svc.jobs.track(second, t)["state"] for t in (0, 1)] == ["canceled", "canceled"]
    assert svc.jobs.track(first, 0)["state"] == "backbone"  # the run's own job goes on
