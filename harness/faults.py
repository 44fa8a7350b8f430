"""The fault scenarios of the track lifecycle, written once.

Each scenario sets up workers and jobs on a Stack, injects its fault, and returns a `Fault`: the jobs it
submitted, when the fault was over, and what a test may want to check about it. tests/test_reliability.py runs
them one by one and asserts each outcome in detail; bench/faults.py runs them all against one throwaway
redis-server and counts (done, failed, stuck, duplicated, left behind, recovery seconds). The settings (leases,
reroute delays) are the caller's: they are the stack's environment. Scenarios that do not touch Redis take
`redis=None` too.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from harness.processes import RedisServer, wait_until
from harness.stack import Stack

ENDED = ("done", "failed", "canceled", "partial")


@dataclass
class Fault:
    """What a scenario did: its jobs, `cleared` (time.monotonic() when the fault was over), and `facts`, what
    it learnt on the way (which worker ran the track, what the cancel answered...)."""

    jobs: list[str]
    cleared: float
    facts: dict[str, Any] = field(default_factory=dict)


def backbone_running(stack: Stack, job_id: str) -> bool:
    """The job's first track has reported progress: its stage is running, not just taken."""
    return stack.job(job_id)["tracks"][0]["progress"] > 0


def wait_running(stack: Stack, job_id: str, timeout: float = 90) -> None:
    wait_until(lambda: backbone_running(stack, job_id), timeout, 0.1, f"job {job_id} running")


def idle_workers(stack: Stack) -> int:
    return sum(
        w["status"] == "idle" for w in stack.client.get("/api/v1/status", headers=stack.auth).get_json()["workers"]
    )


# -- scenarios: each sets up, injects its fault, and returns a Fault ------------------------------------------
def redis_crash(stack: Stack, redis: RedisServer, *, workers: int = 2, jobs: int = 2, down_s: float = 10.0) -> Fault:
    """redis-server kill -9 with stages running (one per worker), back `down_s` later on its AOF."""
    for gpu in range(workers):
        stack.start_worker(gpu)
    submitted = [stack.submit_music(duration_s=20.0, seed=seed) for seed in range(1, jobs + 1)]
    for job_id in submitted:
        wait_running(stack, job_id)
    redis.kill()
    time.sleep(down_s)  # the fault itself, not a wait for anything: Redis stays down
    redis.start()
    return Fault(submitted, time.monotonic())


def two_consumers_one_killed(stack: Stack, redis: RedisServer | None) -> Fault:
    """gpu0 consumed by two workers (gpu0 and gpu0b); the one running the track is killed (master and child).
    facts: `runner` (the killed worker's name), `survivor` (the index of the one left)."""
    stack.start_worker(0)
    stack.start_worker(1, wait=False, args=("-Q", "gpu0", "-n", "gpu0b@%h"))  # named gpu0b: wait below
    wait_until(lambda: idle_workers(stack) == 2, 90, 0.2, "both consumers of gpu0 idle")
    job_id = stack.submit_music(duration_s=20.0)
    wait_running(stack, job_id)
    runner = stack.job(job_id)["tracks"][0]["worker"]
    victim, survivor = (1, 0) if runner.startswith("gpu0b@") else (0, 1)
    stack.stop_worker(victim)
    return Fault([job_id], time.monotonic(), {"runner": runner, "survivor": survivor})


def cancel_while_worker_dead(stack: Stack, redis: RedisServer | None) -> Fault:
    """The running stage's worker (gpu0) is killed, then the job is canceled. gpu1 is live but drained: a
    worker for the reaper, not one to run the track. facts: `canceled` (the cancel's answer)."""
    stack.start_worker(1)
    stack.client.post("/api/v1/queues/gpu1/drain", headers=stack.auth)
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=30.0)
    wait_running(stack, job_id)
    queue = stack.job(job_id)["tracks"][0]["queue"]
    stack.stop_worker(0)
    answer = stack.client.delete(f"/api/v1/jobs/{job_id}", headers=stack.auth).get_json()
    return Fault([job_id], time.monotonic(), {"canceled": answer, "queue": queue})


def worker_on_two_queues(stack: Stack, redis: RedisServer | None) -> Fault:
    """One worker started with -Q gpu0,gpu1; four jobs."""
    stack.start_worker(0, args=("-Q", "gpu0,gpu1"))
    return Fault([stack.submit_music(duration_s=2.0, seed=seed) for seed in range(4)], time.monotonic())


def warm_shutdown_between_stages(stack: Stack, redis: RedisServer | None) -> Fault:
    """SIGTERM to gpu0 during the backbone (the running stage finishes first, then the worker stops); gpu1 is
    live (drained until then, so the track starts on gpu0)."""
    stack.start_worker(1)
    stack.client.post("/api/v1/queues/gpu1/drain", headers=stack.auth)
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=8.0)
    wait_running(stack, job_id)
    stack.client.delete("/api/v1/queues/gpu1/drain", headers=stack.auth)
    stack.workers[0].send_signal(signal.SIGTERM)
    stack.workers.pop(0).wait(120)
    return Fault([job_id], time.monotonic())


def cancel_storm(stack: Stack, redis: RedisServer | None) -> Fault:
    """60 jobs on two workers, all canceled within seconds while the first ones run."""
    stack.start_worker(0)
    stack.start_worker(1)
    jobs = [stack.submit_music(duration_s=3.0, seed=seed) for seed in range(60)]
    wait_until(lambda: any(stack.job(j)["tracks"][0]["state"] != "queued" for j in jobs[:2]), 90, 0.1, "a job running")
    for job_id in jobs:
        reply = stack.client.delete(f"/api/v1/jobs/{job_id}", headers=stack.auth)
        assert reply.status_code == 200, reply.get_json()
    return Fault(jobs, time.monotonic())


def child_killed(stack: Stack, redis: RedisServer | None) -> Fault:
    """kill -9 of the prefork child only (its master lives on). facts: `child` (the killed pid)."""
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=20.0)
    wait_running(stack, job_id)
    child = stack.child_pid(0)
    os.kill(child, signal.SIGKILL)
    return Fault([job_id], time.monotonic(), {"child": child})


def worker_killed_and_restarted(
    stack: Stack, redis: RedisServer | None, while_dead: Callable[[Stack, str], None] | None = None
) -> Fault:
    """kill -9 of master and child mid-stage, the worker started again (`while_dead(stack, job_id)` runs in
    between: a test's look at what the dead worker left)."""
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=30.0)
    wait_running(stack, job_id)
    stack.stop_worker(0)
    if while_dead is not None:
        while_dead(stack, job_id)
    stack.start_worker(0)
    return Fault([job_id], time.monotonic())


def worker_started_while_redis_down(stack: Stack, redis: RedisServer) -> Fault:
    """A job parked (no worker yet), Redis down, a worker started (it retries its broker connection), Redis
    back; then a second job. The fault clears when Redis is back."""
    parked = stack.submit_music(duration_s=2.0)
    redis.kill()
    stack.start_worker(0, wait=False)
    wait_until(
        lambda: "Cannot connect to redis://" in stack.worker_log(0),
        90,
        0.2,
        "the worker to fail to reach Redis and retry",
    )
    redis.start()
    cleared = time.monotonic()
    stack.wait_worker(0, "idle", timeout=120)
    return Fault([parked, stack.submit_music(duration_s=2.0)], cleared)


def lipsync_canceled_while_worker_dead(stack: Stack, redis: RedisServer | None) -> Fault:
    """Issue 36, item 1: a lip-sync job's worker is killed (master and child) mid-`lipsync`, the job canceled while
    it is dead, the worker started again: the track ends canceled and its scratch folder
    (`tracks/<job>-0`) goes with it (files_left_behind). facts: `scratch` (that folder)."""
    from harness.media import face_video, tone, upload

    media = stack.root / "media"
    media.mkdir(parents=True, exist_ok=True)
    video = face_video(media / "face.mp4", 8.0, 25)
    voice = tone(media / "voice.wav", 8.0)
    stack.start_worker(0)
    reply = upload(stack.client, video, voice, fps=25)
    assert reply.status_code == 202, reply.get_json()
    job_id = reply.get_json()["job_id"]
    wait_until(lambda: stack.job(job_id)["tracks"][0]["stage"] == "lipsync", 180, 0.1, "the lipsync stage")
    scratch = stack.settings.worker_cache_dir / "tracks" / f"{job_id}-0"
    stack.stop_worker(0)
    stack.client.delete(f"/api/v1/jobs/{job_id}", headers=stack.auth)
    stack.start_worker(0)
    return Fault([job_id], time.monotonic(), {"scratch": scratch})


def export_fails(stack: Stack, redis: RedisServer | None) -> Fault:
    """Issue 36, item 2: every export's encoder fails (ENCORE_FFMPEG=/bin/false): the job fails with a message, and
    nothing of the song is left in the worker's $TMPDIR (a folder of the stack's own: files_left_behind)."""
    temp = stack.root / "tmp"
    temp.mkdir(parents=True, exist_ok=True)
    stack.start_worker(0, ENCORE_FFMPEG="/bin/false", TMPDIR=str(temp))
    return Fault([stack.submit_music(duration_s=2.0)], time.monotonic(), {"tmpdir": temp})


def stage_killed_repeatedly(stack: Stack, redis: RedisServer | None) -> Fault:
    """Issue 36, item 4: the backbone's prefork child is killed each time the stage runs again, until the track
    gives up: it fails, naming every kill. facts: `kills`."""
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=30.0)
    killed: list[int] = []

    def next_run() -> int | None:
        """A live child running the backbone again (not one already killed), or 0 once the job has ended."""
        record = stack.job(job_id)
        if record["state"] in ENDED:
            return 0
        pid = stack.child_pid(0)
        running = record["tracks"][0]["stage"] == "backbone" and record["tracks"][0]["progress"] > 0
        return pid if running and pid and pid not in killed else None

    while len(killed) < 10:
        [pid] = wait_until(lambda: (found := next_run()) is not None and [found], 120, 0.1, "a run or the end")
        if not pid:
            break
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    return Fault([job_id], time.monotonic(), {"kills": len(killed)})


SCENARIOS: dict[str, Callable[..., Fault]] = {
    f.__name__: f
    for f in (
        redis_crash,
        two_consumers_one_killed,
        cancel_while_worker_dead,
        worker_on_two_queues,
        warm_shutdown_between_stages,
        cancel_storm,
        child_killed,
        worker_killed_and_restarted,
        worker_started_while_redis_down,
        lipsync_canceled_while_worker_dead,
        export_fails,
        stage_killed_repeatedly,
    )
}


# -- what a fault may leave behind ----------------------------------------------------------------------------
def left_behind(stack: Stack) -> list[str]:
    """Anything of the stack's jobs still in the broker lists, kombu's unacked hash, or the waiting / load /
    unrouted / created sets: empty once every job has ended and its bookkeeping is done."""
    r, p = stack.redis, stack.settings.key_prefix
    left = []
    for queue in sorted(r.smembers(f"{p}:queues") | {"gpu0", "gpu1"}):
        lists = [queue, *(f"{queue}:{step}" for step in range(1, 10))]
        if sum(r.llen(name) for name in lists):
            left.append(f"{queue} messages")
        for name in ("waiting", "load"):
            if r.zcard(f"{p}:queue:{queue}:{name}"):
                left.append(f"{queue} {name}")
    for name in ("unrouted", "created"):
        if r.zcard(f"{p}:{name}"):
            left.append(name)
    if r.hlen("unacked"):
        left.append("unacked")
    return left


def files_left_behind(stack: Stack) -> list[str]:
    """What a fault left on disk: lip-sync tracks' scratch folders and stage temp folders in the worker cache,
    and files in the stack's $TMPDIR (export_fails gives its worker one). Empty once every job has ended and its
    worker (a restarted one, if it was killed) has swept; a killed worker's folders stay until one starts there."""
    left = []
    for sub in ("tracks", "work"):
        folder = stack.settings.worker_cache_dir / sub
        if folder.is_dir() and any(folder.iterdir()):
            left.append(f"{sub}/: {', '.join(sorted(p.name for p in folder.iterdir()))}")
    temp = stack.root / "tmp"  # files only: a live worker keeps folders of its own there (pymp-*, torch's caches)
    files = sorted(p.name for p in temp.iterdir() if p.is_file()) if temp.is_dir() else []
    if files:
        left.append(f"$TMPDIR: {', '.join(files)}")
    return left


def assert_nothing_left(stack: Stack, timeout: float = 15) -> None:
    """Poll until nothing is left behind (the last stage's delivery is acked just after its record says done)."""
    try:
        wait_until(lambda: not left_behind(stack), timeout, 0.1, "the bookkeeping to empty")
    except AssertionError:
        raise AssertionError(f"left behind: {left_behind(stack)}") from None
