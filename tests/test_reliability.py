"""Time limits, crash redelivery caps and runtime modes, with real worker processes."""
from __future__ import annotations

import os
import signal

from tests.conftest import REFERENCE_ENGINE, wait_until

LONG_S = 120.0


def test_hard_time_limit_fails_the_track_and_worker_goes_on(make_stack):
    stack = make_stack(ENCORE_TIME_LIMITS="backbone=/3", ENCORE_PRELOAD="1", **REFERENCE_ENGINE)
    stack.start_worker(0)
    slow = stack.submit_music(duration_s=LONG_S)
    record = stack.wait_job(slow, timeout=60)
    track = record["tracks"][0]
    assert record["state"] == "failed"
    assert "hard time limit of 3 s" in track["error"] and "backbone" in track["error"]
    quick = stack.submit_music(duration_s=2.0)
    assert stack.wait_job(quick)["state"] == "done"


def test_soft_time_limit_fails_with_timeout_message(make_stack):
    stack = make_stack(ENCORE_TIME_LIMITS="backbone=2/60", ENCORE_PRELOAD="1", **REFERENCE_ENGINE)
    stack.start_worker(0)
    record = stack.wait_job(stack.submit_music(duration_s=LONG_S), timeout=60)
    assert record["state"] == "failed"
    assert record["tracks"][0]["error"] == "timed out: backbone ran past its 2 s limit"
    assert stack.wait_job(stack.submit_music(duration_s=2.0))["state"] == "done"


def test_stage_that_keeps_killing_its_worker_is_given_up(make_stack):
    stack = make_stack(ENCORE_MAX_DELIVERIES="2", **REFERENCE_ENGINE)
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=LONG_S)
    killed: set[int] = set()
    for attempt in (1, 2):
        def running_child():
            track = stack.job(job_id)["tracks"][0]
            pid = stack.child_pid(0)
            return pid if track["state"] == "backbone" and track["attempts"] == attempt and pid not in killed \
                else None
        pid = wait_until(running_child, 60, 0.1, f"delivery {attempt} running")
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
    record = stack.wait_job(job_id, timeout=60)
    assert record["state"] == "failed"
    assert "interrupted 2 times" in record["tracks"][0]["error"]
    assert stack.wait_job(stack.submit_music(duration_s=2.0))["state"] == "done"


def _loads(record: dict) -> dict[str, list[str]]:
    return {stage: info["loaded"] for stage, info in record["tracks"][0]["stages"].items()}


def test_keep_loaded_loads_nothing_again_and_one_shot_reloads_stage_models(make_stack):
    stack = make_stack()
    stack.start_worker(0, ENCORE_RUNTIME_MODE="keep_loaded")
    first = _loads(stack.wait_job(stack.submit_music(duration_s=2.0)))
    second = _loads(stack.wait_job(stack.submit_music(duration_s=2.0)))
    assert sorted(m for ms in first.values() for m in ms) == ["backbone", "codec", "superres", "tokenizer"]
    assert second == {"backbone": [], "superres": [], "decode": [], "export": []}
    stack.stop_worker(0)
    wait_until(lambda: stack.worker_status(0)["status"] == "offline", 10, what="gpu0 offline")

    stack.start_worker(1, ENCORE_RUNTIME_MODE="one_shot")
    first = _loads(stack.wait_job(stack.submit_music(duration_s=2.0)))
    second = _loads(stack.wait_job(stack.submit_music(duration_s=2.0)))
    assert sorted(m for ms in first.values() for m in ms) == ["backbone", "codec", "superres", "tokenizer"]
    assert second == {"backbone": [], "superres": ["superres"], "decode": ["codec"], "export": []}


def test_restarted_worker_requeues_the_stage_its_crashed_predecessor_was_running(make_stack):
    """Without the start-up check the message would wait in `unacked` for the ~1 h visibility timeout."""
    stack = make_stack(ENCORE_PRELOAD="1", **REFERENCE_ENGINE)
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=30.0)

    def backbone_running():
        track = stack.job(job_id)["tracks"][0]
        return track["state"] == "backbone" and track["progress"] > 0
    wait_until(backbone_running, 60, 0.1, "backbone progress")
    stack.stop_worker(0)  # SIGKILL to master and child: nobody acks or restores the delivery
    assert stack.redis.hlen("unacked") == 1
    assert stack.job(job_id)["tracks"][0]["state"] == "backbone"

    stack.start_worker(0)
    record = stack.wait_job(job_id, timeout=120)
    track = record["tracks"][0]
    assert record["state"] == "done"
    assert track["stages"]["backbone"]["attempt"] == 2 and track["stages"]["superres"]["attempt"] == 1
    assert stack.redis.hlen("unacked") == 0
    assert any(f"job={job_id} track=0 queue=gpu0 " in line and "event=requeued_after_crash" in line
               for line in stack.worker_log(0).splitlines())


def test_waiting_tracks_move_off_a_dead_workers_queue_and_the_started_one_stays(make_stack):
    """gpu0 dies with one job running and one waiting: the waiting one runs on gpu1 once gpu0 has been offline
    ENCORE_REROUTE_AFTER_S; the started one is neither moved nor duplicated, and finishes when gpu0 returns."""
    stack = make_stack(ENCORE_REROUTE_AFTER_S="1", ENCORE_PRELOAD="1", **REFERENCE_ENGINE)
    stack.start_worker(0)
    running = stack.submit_music(duration_s=30.0)
    waiting = stack.submit_music(duration_s=2.0)
    wait_until(lambda: stack.job(running)["tracks"][0]["progress"] > 0, 60, 0.1, "the first job's backbone")
    assert stack.job(waiting)["tracks"][0]["queue"] == "gpu0" and stack.job(waiting)["queue_position"] == 1
    stack.stop_worker(0)

    stack.start_worker(1)
    moved = stack.wait_job(waiting, timeout=120)
    assert moved["state"] == "done" and moved["tracks"][0]["queue"] == "gpu1"
    assert moved["tracks"][0]["stages"]["backbone"]["worker"].startswith("gpu1@")
    assert any(f"job={waiting} track=0 queue=gpu0 " in line and "event=rerouting" in line
               for line in stack.worker_log(1).splitlines())
    stuck = stack.job(running)["tracks"][0]
    assert (stuck["queue"], stuck["state"]) == ("gpu0", "backbone")  # started: not moved
    # The moved job's message left gpu0's broker lists; the started job's delivery is still unacked there.
    assert [stack.redis.llen(name) for name in ("gpu0", "gpu0:9")] == [0, 0] and stack.redis.hlen("unacked") == 1

    stack.start_worker(0)
    record = stack.wait_job(running, timeout=120)
    assert record["state"] == "done" and record["tracks"][0]["stages"]["backbone"]["worker"].startswith("gpu0@")
    assert "event=stale_delivery" not in stack.worker_log(0) + stack.worker_log(1)
