"""Draining a queue for maintenance, with real workers: new tracks avoid it, its waiting tracks move."""

from __future__ import annotations

import pytest

from harness.processes import wait_until
from harness.stack import REFERENCE_ENGINE
from harness.cli import cli

pytestmark = pytest.mark.slow  # drain and resume with workers (~11 s here)


def queue_row(stack, name: str) -> dict:
    return next(q for q in stack.client.get("/api/v1/status").get_json()["queues"] if q["name"] == name)


def test_drain_moves_waiting_tracks_and_new_ones_avoid_the_queue_until_resumed(make_stack):
    stack = make_stack(**REFERENCE_ENGINE)
    stack.start_worker(0)
    stack.start_worker(1)
    # Both GPUs busy before a track waits: an idle GPU would take the waiting track at its next heartbeat by itself
    # (app/control/routing.py rebalance), and the drain would find nothing to move. gpu1's job is the longer, so
    # the waiting track goes to gpu0, where it would be done sooner.
    running = stack.submit_music(duration_s=120.0)
    other = stack.submit_music(duration_s=240.0)
    for job_id, queue in ((running, "gpu0"), (other, "gpu1")):
        assert stack.job(job_id)["tracks"][0]["queue"] == queue
        wait_until(lambda j=job_id: stack.job(j)["tracks"][0]["state"] == "backbone", 60, 0.1, "a long job to start")
    waiting = stack.submit_music(duration_s=2.0)
    assert stack.job(waiting)["tracks"][0]["queue"] == "gpu0"

    drained = cli(stack, "drain", "gpu0")
    assert drained.returncode == 0, drained.stderr
    assert "queue gpu0 draining: 1 waiting track(s) moved" in drained.stdout
    assert stack.job(waiting)["tracks"][0]["queue"] == "gpu1"
    stack.client.delete(f"/api/v1/jobs/{other}")  # gpu1 free: the moved track runs there
    moved = stack.wait_job(waiting)
    assert moved["state"] == "done" and moved["tracks"][0]["queue"] == "gpu1"
    assert queue_row(stack, "gpu0")["draining"] is True and queue_row(stack, "gpu1")["draining"] is False
    status = cli(stack, "status").stdout
    assert any(line.split()[:1] == ["gpu0"] and line.split()[-1] == "draining" for line in status.splitlines())

    stack.client.delete(f"/api/v1/jobs/{running}")  # gpu0 now idle with no load, and still avoided
    stack.wait_worker(0, "idle")
    avoided = stack.wait_job(stack.submit_music(duration_s=2.0))
    assert avoided["tracks"][0]["queue"] == "gpu1"

    resumed = cli(stack, "resume", "gpu0")
    assert resumed.returncode == 0 and "queue gpu0 takes new tracks again" in resumed.stdout
    again = stack.wait_job(stack.submit_music(duration_s=2.0))
    assert again["tracks"][0]["queue"] == "gpu0"  # both idle: the lowest index wins again
    assert queue_row(stack, "gpu0")["draining"] is False


def test_drain_of_an_unknown_queue_is_404_naming_it(make_stack):
    stack = make_stack()
    reply = stack.client.post("/api/v1/queues/gpu9/drain")
    assert reply.status_code == 404 and reply.get_json()["error"] == "queue gpu9 not found"
    assert stack.client.delete("/api/v1/queues/gpu9/drain").status_code == 404
