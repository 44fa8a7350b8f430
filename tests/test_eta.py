"""ETA in seconds (issue 14, item 6) with real workers and the tiny models on this CPU: each finished stage
teaches its queue its rate; a job's `eta_s` (in the submit answer and the record) counts the work queued ahead
of it and lands within a stated factor of the real time; routing sends a track to the queue whose learned rate
is faster, even when the slower one would win the tie."""

from __future__ import annotations

import time

import pytest

from app.control import eta
from app.core.kinds import MUSIC
from app.control.routing import pick_queue
from harness.processes import wait_until
from harness.stack import REFERENCE_ENGINE

pytestmark = pytest.mark.slow  # learns rates from real jobs on two queues (~35 s here)

FACTOR = 2.5  # the stated bound: the estimate is within real/FACTOR .. real*FACTOR
SONG = {"mode": "instrumental", "tags": "lo-fi", "duration_s": 20.0, "num_tracks": 1}  # seconds of work each


def learned_stages(stack, queue: str) -> dict[str, float]:
    return {
        stage: rate
        for (q, kind, stage), rate in eta.learned(stack.app.config["SERVICES"]).items()
        if q == queue and kind == "music"
    }


def test_eta_of_the_second_job_on_a_queue_is_within_a_factor_of_the_real_time(make_stack):
    stack = make_stack(ENCORE_PRELOAD="1")
    stack.start_worker(0)
    assert stack.wait_job(stack.submit_music(**SONG, seed=1))["state"] == "done"  # the queue learns its rates
    rates = learned_stages(stack, "gpu0")
    assert set(rates) == {stage.name for stage in MUSIC.stages} and all(r > 0 for r in rates.values())

    first = stack.client.post("/api/v1/music", json={**SONG, "seed": 2}).get_json()
    submitted = time.monotonic()
    second = stack.client.post("/api/v1/music", json={**SONG, "seed": 3}).get_json()
    assert 0 < first["eta_s"] < second["eta_s"], (first, second)  # the second waits for the first
    polled = stack.job(second["job_id"])["eta_s"]
    assert 0 < polled <= second["eta_s"] + 0.5  # the record carries it too, and it does not grow

    done = stack.wait_job(second["job_id"], interval=0.05)
    real = time.monotonic() - submitted
    assert done["state"] == "done" and done["eta_s"] == 0
    print(f"eta {second['eta_s']:.2f} s, real {real:.2f} s, ratio {second['eta_s'] / real:.2f}")
    assert real / FACTOR <= second["eta_s"] <= real * FACTOR, (second["eta_s"], real)
    assert stack.job(first["job_id"])["eta_s"] == 0


def _run_on(stack, queue: str, other: str, seed: int) -> None:
    """One job on `queue` alone (the other queue drained meanwhile), so that `queue` learns its rates."""
    assert stack.client.post(f"/api/v1/queues/{other}/drain").status_code == 200
    job_id = stack.submit_music(**SONG, seed=seed)
    record = stack.wait_job(job_id)
    assert record["state"] == "done" and record["tracks"][0]["queue"] == queue, record
    assert stack.client.delete(f"/api/v1/queues/{other}/drain").status_code == 200


def test_routing_prefers_the_queue_whose_learned_rate_is_faster(make_stack):
    stack = make_stack()
    stack.start_worker(0, ENCORE_PRELOAD="1", **REFERENCE_ENGINE)  # the slow card: Megatron's forward
    stack.start_worker(1, ENCORE_PRELOAD="1")
    svc = stack.app.config["SERVICES"]
    assert pick_queue(svc, work=("music", 20.0)) == "gpu0"  # nothing learned: a tie, to the lowest name

    _run_on(stack, "gpu0", "gpu1", seed=1)
    _run_on(stack, "gpu1", "gpu0", seed=2)
    slow, fast = learned_stages(stack, "gpu0"), learned_stages(stack, "gpu1")
    print(
        f"learned s per song s: gpu0 {sum(slow.values()):.4f} (backbone {slow['backbone']:.4f}), "
        f"gpu1 {sum(fast.values()):.4f} (backbone {fast['backbone']:.4f})"
    )
    assert slow["backbone"] > fast["backbone"], (slow, fast)
    wait_until(lambda: all(stack.worker_status(g)["status"] == "idle" for g in (0, 1)), 30, what="idle workers")

    assert pick_queue(svc, work=("music", 20.0)) == "gpu1"  # both idle: the faster card is done first
    job_id = stack.submit_music(**SONG, seed=3)
    assert stack.job(job_id)["tracks"][0]["queue"] == "gpu1"
    assert stack.wait_job(job_id)["state"] == "done"
