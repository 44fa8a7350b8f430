"""Queue behaviour with real workers: FIFO across stages, cancel (queued and running), parked jobs."""
from __future__ import annotations

import time

from tests.conftest import wait_until

LONG_S = 120.0  # the tiny backbone needs several seconds for this many tokens on a CPU


def test_fifo_across_stages_on_one_worker(make_stack):
    stack = make_stack()
    stack.start_worker(0)
    jobs = [stack.submit_music(duration_s=2.0, seed=i) for i in range(3)]
    records = [stack.wait_job(job_id) for job_id in jobs]
    assert all(r["state"] == "done" for r in records), records
    stages = [r["tracks"][0]["stages"] for r in records]
    for earlier, later in zip(stages, stages[1:]):
        assert earlier["export"]["finished_at"] <= later["backbone"]["started_at"], (earlier, later)


def test_cancel_queued_and_running_jobs(make_stack):
    stack = make_stack()
    stack.start_worker(0)
    running = stack.submit_music(duration_s=LONG_S)
    waiting = stack.submit_music(duration_s=2.0)
    wait_until(lambda: (lambda t: t["state"] == "backbone" and t["progress"] > 0.02)(stack.job(running)["tracks"][0]),
               60, what="backbone progress")
    assert stack.job(waiting)["queue_position"] == 1

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
