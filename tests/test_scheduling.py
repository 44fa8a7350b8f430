"""Queue behaviour with real workers: FIFO across stages, cancel (queued and running), parked jobs."""

from __future__ import annotations

from itertools import pairwise
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.processes import REPO, wait_until
from harness.stack import REFERENCE_ENGINE

pytestmark = pytest.mark.slow  # six stacks with workers: FIFO, cancel, kills (~50 s here)

LONG_S = 120.0  # the tiny backbone needs several seconds for this many tokens on a CPU


def test_fifo_across_stages_on_one_worker_without_the_engine(make_stack):
    stack = make_stack(ENCORE_BACKBONE_SLOTS="1")
    stack.start_worker(0)
    jobs = [stack.submit_music(duration_s=2.0, seed=i) for i in range(3)]
    records = [stack.wait_job(job_id) for job_id in jobs]
    assert all(r["state"] == "done" for r in records), records
    stages = [r["tracks"][0]["stages"] for r in records]
    for earlier, later in pairwise(stages):
        assert earlier["export"]["finished_at"] <= later["backbone"]["started_at"], (earlier, later)


def test_fifo_across_stages_in_the_engine(make_stack):
    """The engine decodes the three songs together; each finished song's later stages run in the order the
    songs were submitted, and none waits for a later song's."""
    stack = make_stack()
    stack.start_worker(0)
    jobs = [stack.submit_music(duration_s=2.0, seed=i) for i in range(3)]
    records = [stack.wait_job(job_id) for job_id in jobs]
    assert all(r["state"] == "done" for r in records), records
    stages = [r["tracks"][0]["stages"] for r in records]
    assert all(s[name]["in_engine"] for s in stages for name in ("superres", "decode", "export"))
    for earlier, later in pairwise(stages):
        assert earlier["backbone"]["started_at"] <= later["backbone"]["started_at"], (earlier, later)
        assert earlier["export"]["finished_at"] <= later["superres"]["started_at"], (earlier, later)


def test_cancel_queued_and_running_jobs(make_stack):
    stack = make_stack(**REFERENCE_ENGINE)
    stack.start_worker(0)
    running = stack.submit_music(duration_s=LONG_S)
    waiting = stack.submit_music(duration_s=2.0)
    wait_until(
        lambda: (lambda t: t["state"] == "backbone" and t["progress"] > 0.02)(stack.job(running)["tracks"][0]),
        60,
        what="backbone progress",
    )
    assert stack.job(waiting)["queue_position"] == 1
    gpu0 = next(q for q in stack.client.get("/api/v1/status").get_json()["queues"] if q["name"] == "gpu0")
    # the waiting job's first stage sits in the broker; the running one's delivery is unacked, not listed
    assert (gpu0["waiting"], gpu0["outstanding"], gpu0["broker_messages"]) == (1, 2, 1)

    reply = stack.client.delete(f"/api/v1/jobs/{waiting}")
    assert reply.status_code == 200 and reply.get_json()["state"] == "canceled"

    asked = time.monotonic()
    assert stack.client.delete(f"/api/v1/jobs/{running}").status_code == 200
    record = stack.wait_job(running, timeout=5, interval=0.05)
    assert time.monotonic() - asked < 5
    assert record["state"] == "canceled" and record["tracks"][0]["detail"] == "canceled during backbone"
    assert record["tracks"][0]["progress"] < 1.0
    assert stack.job(waiting)["tracks"][0]["stages"] == {}, "a canceled queued job started a stage"

    after = stack.submit_music(duration_s=2.0)
    assert stack.wait_job(after)["state"] == "done"
    assert stack.job(waiting)["tracks"][0]["stages"] == {}
    assert stack.wait_worker(0, "idle")["current"] is None


def test_job_submitted_without_workers_runs_when_one_starts(make_stack):
    stack = make_stack()
    job_id = stack.submit_music(duration_s=2.0, num_tracks=2)
    assert stack.client.get("/api/v1/status").get_json()["unrouted"] == 2
    stack.start_worker(0)
    record = stack.wait_job(job_id)
    assert record["state"] == "done"
    assert {t["queue"] for t in record["tracks"]} == {"gpu0"}
    assert stack.client.get("/api/v1/status").get_json()["unrouted"] == 0


def test_plain_celery_command_serves_jobs_with_redis_artifacts(make_stack):
    """`celery -A app worker -Q gpu0` exactly as documented, with the Redis artifact backend."""
    stack = make_stack(ENCORE_ARTIFACT_BACKEND="redis")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "app", "worker", "-Q", "gpu0"],
        cwd=REPO,
        env={**os.environ, **stack.env},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        worker = wait_until(
            lambda: next(
                (w for w in stack.client.get("/api/v1/status").get_json()["workers"] if w["status"] == "idle"), None
            ),
            90,
            0.2,
            "plain celery worker",
        )
        assert worker["queue"] == "gpu0"
        job_id = stack.submit_music(duration_s=2.0)
        record = stack.wait_job(job_id)
        assert record["state"] == "done" and record["tracks"][0]["queue"] == "gpu0"
        assert not (stack.root / "artifacts" / job_id).exists(), "redis backend wrote to the shared dir"
        assert stack.redis.exists(f"encore:artifact:{job_id}:track0.mp3")
        ttl = stack.redis.ttl(f"encore:artifact:{job_id}:track0.mp3")
        assert 0 < ttl <= stack.settings.job_ttl_s
        mp3 = stack.client.get(f"/api/v1/jobs/{job_id}/tracks/0.mp3")
        assert mp3.status_code == 200 and mp3.data[:3] in (b"ID3", b"\xff\xfb", b"\xff\xf3")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_cancel_falls_back_to_killing_a_stage_that_does_not_stop(make_stack):
    """With no grace the watcher kills the child at once: the hard-kill fallback path."""
    stack = make_stack(ENCORE_CANCEL_GRACE_S="0", **REFERENCE_ENGINE)
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=LONG_S)
    wait_until(
        lambda: stack.job(job_id)["tracks"][0]["state"] == "backbone" and stack.child_pid(0),
        60,
        what="backbone running",
    )
    child = stack.child_pid(0)
    asked = time.monotonic()
    stack.client.delete(f"/api/v1/jobs/{job_id}")
    record = stack.wait_job(job_id, timeout=5, interval=0.05)
    assert time.monotonic() - asked < 5
    assert record["state"] == "canceled"
    assert record["tracks"][0]["detail"] == "canceled during backbone (stopped by force)"
    wait_until(lambda: not _alive(child), 10, what="killed child to be gone")
    assert stack.wait_job(stack.submit_music(duration_s=2.0))["state"] == "done"
    log = stack.worker_log(0)
    assert any(f"job={job_id} track=0 " in line and "event=cancel_hard_kill" in line for line in log.splitlines())
    assert any("event=stage_finished" in line and "stage=export" in line for line in log.splitlines())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_a_worker_consuming_two_queues_gets_tracks_on_each_not_on_their_joined_name(make_stack):
    """`-Q gpu0,gpu1`: the heartbeat lists both; routing, status and metrics see two queues, never "gpu0,gpu1"."""
    stack = make_stack()
    stack.start_worker(0, args=("-Q", "gpu0,gpu1"))
    job_id = stack.submit_music(duration_s=2.0, num_tracks=2)
    record = stack.wait_job(job_id)
    assert record["state"] == "done", record
    assert sorted(t["queue"] for t in record["tracks"]) == ["gpu0", "gpu1"]  # least-loaded routing spreads them
    status = stack.client.get("/api/v1/status").get_json()
    assert {q["name"] for q in status["queues"]} == {"gpu0", "gpu1"}
    assert "gpu0,gpu1" not in stack.client.get("/metrics").get_data(as_text=True)


def test_a_track_waiting_behind_a_running_one_moves_to_a_queue_that_falls_idle(make_stack):
    """Issue 24, item 2: gpu1 is drained (or its worker not back yet) while job B is routed: B waits on gpu0
    behind job A's running backbone. Once gpu1 takes work again, and idles, a heartbeat moves B there with its
    message (B runs once, on gpu1), and B starts while A still runs instead of waiting for A's every stage."""
    stack = make_stack(ENCORE_PRELOAD="1", **REFERENCE_ENGINE)
    stack.start_worker(1)
    stack.client.post("/api/v1/queues/gpu1/drain", headers=stack.auth)
    stack.start_worker(0)
    wait_until(lambda: _ready(stack, 0) and _ready(stack, 1), 180, 0.2, "both workers' models loaded")
    first = stack.submit_music(duration_s=60.0)
    wait_until(lambda: stack.job(first)["tracks"][0]["state"] == "backbone", 90, 0.1, "A running on gpu0")
    second = stack.submit_music(duration_s=2.0, seed=8)
    waiting = stack.job(second)["tracks"][0]
    assert (waiting["queue"], waiting["state"]) == ("gpu0", "queued")

    stack.client.delete("/api/v1/queues/gpu1/drain", headers=stack.auth)  # gpu1 takes work again: idle
    wait_until(lambda: stack.job(second)["tracks"][0]["queue"] == "gpu1", 30, 0.1, "B moved to gpu1")
    record = stack.wait_job(second, timeout=120)
    assert record["state"] == "done" and record["tracks"][0]["worker"].startswith("gpu1")
    assert not any(f"job={second}" in line and "stage_started" in line for line in stack.worker_log(0).splitlines())
    done = stack.wait_job(first, timeout=300)
    assert done["state"] == "done"
    a_ended = max(stage["finished_at"] for stage in done["tracks"][0]["stages"].values())
    assert record["tracks"][0]["stages"]["backbone"]["started_at"] < a_ended  # B did not wait for A


def _ready(stack, gpu: int) -> bool:
    """The worker of gpu<n> has its models loaded (GET /readyz lists each live worker)."""
    workers = stack.client.get("/readyz").get_json()["workers"]
    return any(w["name"].startswith(f"gpu{gpu}@") and w["ready"] for w in workers)


@pytest.mark.slow
def test_an_idle_gpu_takes_a_dead_workers_running_track_before_the_tracks_waiting_behind_it(make_stack):
    """Issue 35, item 6: gpu0's worker runs song 0 with songs 1-3 waiting behind it and is killed (not
    restarted); gpu1 takes work again once gpu0's worker is offline but before song 0's lease ends. gpu1 runs
    song 0 first (when the reaper restarts it), then 1, 2, 3: it does not take the waiting songs past it (the
    order was 1, 2, 0, 3). Before the dead worker's heartbeat lapses nothing can tell it from a live one."""
    stack = make_stack(ENCORE_LEASE_S="24")
    stack.start_worker(1)
    stack.client.post("/api/v1/queues/gpu1/drain", headers=stack.auth)
    stack.start_worker(0, ENCORE_BACKBONE_SLOTS="1", ENCORE_BATCH_TRACKS="1")
    songs = [stack.submit_music(duration_s=20.0, num_tracks=1, seed=i + 1) for i in range(4)]
    wait_until(lambda: stack.job(songs[0])["tracks"][0]["progress"] > 0.02, 120, 0.05, "song 0's backbone")
    behind = [stack.job(song)["tracks"][0] for song in songs[1:]]
    assert [(t["queue"], t["state"]) for t in behind] == [("gpu0", "queued")] * 3
    stack.stop_worker(0)  # kill -9 of master and child
    wait_until(lambda: (stack.worker_status(0) or {}).get("status") == "offline", 30, 0.2, "gpu0's worker offline")
    assert stack.job(songs[0])["tracks"][0]["state"] == "backbone"  # its lease still holds it
    stack.client.delete("/api/v1/queues/gpu1/drain", headers=stack.auth)  # gpu1 idle, gpu0's worker gone
    records = [stack.wait_job(song, timeout=300) for song in songs]
    assert [r["state"] for r in records] == ["done"] * 4, records
    tracks = [r["tracks"][0] for r in records]
    assert [t["restarts"] for t in tracks] == [1, 0, 0, 0]
    assert all(t["worker"].startswith("gpu1@") for t in tracks)
    started = [t["stages"]["backbone"]["started_at"] for t in tracks]
    assert started == sorted(started), started
