"""The fault matrix of the track lifecycle: every scenario against a throwaway stack (a private redis-server
on its AOF, real `celery worker` processes started by worker_entrypoint.sh, the Flask app), one after the
other, with the default lease, reroute and stall settings unless --quick. Prints a table and JSON.

Per scenario: jobs submitted / done / failed / canceled / stuck (not ended by the deadline) / duplicated
(a stage of a track finished twice, from the workers' logs) / left behind (anything in the broker lists,
kombu's unacked hash, or the waiting/load/unrouted/created sets once it is over) / recovery seconds (from
the moment the fault cleared to the last job ending).

    python bench/faults.py [--quick] [--only NAME[,NAME]] [--deadline 120]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.conftest import REFERENCE_ENGINE, Stack, free_port, redis_server_binary, wait_until  # noqa: E402

ENDED = ("done", "failed", "canceled", "partial")


class Redis:
    """The private redis-server all scenarios share (one database each); killable and restartable."""

    def __init__(self, root: Path):
        self.port = free_port()
        (root / "aof").mkdir()
        self.argv = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "yes", "--appendfsync", "always", "--dir", str(root / "aof"),
                     "--databases", "512"]
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.answers, 10, what="redis-server")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def answers(self) -> bool:
        import redis
        try:
            return redis.Redis(port=self.port, socket_timeout=1).ping()
        except redis.RedisError:
            return False


def _running(stack: Stack, job_id: str) -> bool:
    return stack.job(job_id)["tracks"][0]["progress"] > 0


def _wait_running(stack: Stack, job_id: str) -> None:
    wait_until(lambda: _running(stack, job_id), 90, 0.1, f"job {job_id} running")


# -- scenarios: each sets up, injects its fault, and returns (job ids, when the fault cleared) ---------------
def redis_crash(stack: Stack, redis: Redis) -> tuple[list[str], float]:
    """redis-server kill -9 with two stages running, back 10 s later on its AOF."""
    stack.start_worker(0)
    stack.start_worker(1)
    jobs = [stack.submit_music(duration_s=20.0, seed=s) for s in (1, 2)]
    for job_id in jobs:
        _wait_running(stack, job_id)
    redis.kill()
    time.sleep(10)  # the fault itself: Redis stays down 10 s
    redis.start()
    return jobs, time.monotonic()


def two_consumers_one_killed(stack: Stack, redis: Redis) -> tuple[list[str], float]:
    """gpu0 consumed by two workers; the one running the track is killed (master and child)."""
    stack.start_worker(0)
    stack.start_worker(1, wait=False, args=("-Q", "gpu0", "-n", "gpu0b@%h"))
    wait_until(lambda: sum(w["status"] == "idle" for w in stack.client.get("/api/v1/status").get_json()["workers"])
               == 2, 90, 0.2, "both consumers idle")
    job_id = stack.submit_music(duration_s=20.0)
    _wait_running(stack, job_id)
    runner = stack.job(job_id)["tracks"][0]["worker"]
    stack.stop_worker(1 if runner.startswith("gpu0b@") else 0)
    return [job_id], time.monotonic()


def cancel_while_worker_dead(stack: Stack, redis: Redis) -> tuple[list[str], float]:
    """The running stage's worker is killed, then the job is canceled."""
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=30.0)
    _wait_running(stack, job_id)
    stack.start_worker(1)
    stack.stop_worker(0)
    stack.client.delete(f"/api/v1/jobs/{job_id}")
    return [job_id], time.monotonic()


def worker_on_two_queues(stack: Stack, redis: Redis) -> tuple[list[str], float]:
    """One worker started with -Q gpu0,gpu1; four jobs."""
    stack.start_worker(0, args=("-Q", "gpu0,gpu1"))
    return [stack.submit_music(duration_s=2.0, seed=s) for s in range(4)], time.monotonic()


def warm_shutdown_between_stages(stack: Stack, redis: Redis) -> tuple[list[str], float]:
    """SIGTERM to gpu0 during the backbone; gpu1 is live."""
    stack.start_worker(1)
    stack.client.post("/api/v1/queues/gpu1/drain")
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=8.0)
    _wait_running(stack, job_id)
    stack.client.delete("/api/v1/queues/gpu1/drain")
    stack.workers[0].send_signal(signal.SIGTERM)
    stack.workers.pop(0).wait(120)
    return [job_id], time.monotonic()


def cancel_storm(stack: Stack, redis: Redis) -> tuple[list[str], float]:
    """60 jobs on two workers, all canceled within seconds."""
    stack.start_worker(0)
    stack.start_worker(1)
    jobs = [stack.submit_music(duration_s=3.0, seed=s) for s in range(60)]
    wait_until(lambda: any(stack.job(j)["tracks"][0]["state"] != "queued" for j in jobs[:2]), 90, 0.1, "a job running")
    for job_id in jobs:
        stack.client.delete(f"/api/v1/jobs/{job_id}")
    return jobs, time.monotonic()


def child_killed(stack: Stack, redis: Redis) -> tuple[list[str], float]:
    """kill -9 of the prefork child only."""
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=20.0)
    _wait_running(stack, job_id)
    os.kill(stack.child_pid(0), signal.SIGKILL)
    return [job_id], time.monotonic()


def worker_killed_and_restarted(stack: Stack, redis: Redis) -> tuple[list[str], float]:
    """kill -9 of master and child mid-stage, the worker started again."""
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=20.0)
    _wait_running(stack, job_id)
    stack.stop_worker(0)
    stack.start_worker(0)
    return [job_id], time.monotonic()


def worker_started_while_redis_down(stack: Stack, redis: Redis) -> tuple[list[str], float]:
    """A job parked (no worker), Redis down, a worker started, Redis back."""
    parked = stack.submit_music(duration_s=2.0)
    redis.kill()
    stack.start_worker(0, wait=False)
    wait_until(lambda: "Cannot connect to redis://" in stack.worker_log(0), 90, 0.2, "the worker retrying")
    redis.start()
    cleared = time.monotonic()
    stack.wait_worker(0, "idle", timeout=120)
    return [parked, stack.submit_music(duration_s=2.0)], cleared


SCENARIOS: dict[str, Callable[[Stack, Redis], tuple[list[str], float]]] = {
    f.__name__: f for f in (redis_crash, two_consumers_one_killed, cancel_while_worker_dead, worker_on_two_queues,
                            warm_shutdown_between_stages, cancel_storm, child_killed, worker_killed_and_restarted,
                            worker_started_while_redis_down)}


def _duplicated(stack: Stack) -> int:
    """Stages whose finish was accepted more than once; their jobs' log lines go to stderr, to be read.
    (`stage_finished_too_late`, a finish refused because the lease was lost, is not one: the stage ran again
    elsewhere and only that run counts. It used to be counted here, by a substring match.)"""
    finished = Counter()
    lines = [line for path in sorted((stack.root / "logs").glob("worker_*.log"))
             for line in path.read_text(errors="replace").splitlines()]
    for line in lines:
        if "event=stage_finished " in line or line.endswith("event=stage_finished"):
            job, track, stage = (re.search(rf"{k}=(\S+)", line) for k in ("job", "track", "stage"))
            if job and track and stage:
                finished[(job.group(1), track.group(1), stage.group(1))] += 1
    twice = [key for key, n in finished.items() if n > 1]
    for job, track, stage in twice:
        print(f"[faults] {job} track {track}: {stage} finished {finished[(job, track, stage)]} times", file=sys.stderr)
        for line in lines:
            if f"job={job}" in line:
                print(f"[faults]   {line}", file=sys.stderr)
    return sum(finished[key] - 1 for key in twice)


def _finished_too_late(stack: Stack) -> int:
    """Stage runs whose work was thrown away: they finished after their lease had gone to another run."""
    return sum(path.read_text(errors="replace").count("event=stage_finished_too_late")
               for path in (stack.root / "logs").glob("worker_*.log"))


def _left_behind(stack: Stack) -> list[str]:
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


def run(name: str, redis: Redis, models: Path, root: Path, env: dict[str, str], deadline_s: float) -> dict:
    stack = Stack(redis.url, models, root / name, **env)
    try:
        jobs, cleared = SCENARIOS[name](stack, redis)
        states: dict[str, str] = {}
        last_end = cleared
        while time.monotonic() - cleared < deadline_s:
            for job_id in jobs:
                if job_id not in states and (state := stack.job(job_id)["state"]) in ENDED:
                    states[job_id], last_end = state, time.monotonic()
            if len(states) == len(jobs):
                break
            time.sleep(0.2)
        left = []
        if len(states) == len(jobs):  # acks follow the records; give them a moment
            try:
                wait_until(lambda: not _left_behind(stack), 15, 0.2, "the bookkeeping to empty")
            except AssertionError:
                left = _left_behind(stack)
        counts = Counter(states.values())
        return {"scenario": name, "submitted": len(jobs), "done": counts["done"], "failed": counts["failed"],
                "canceled": counts["canceled"], "partial": counts["partial"], "stuck": len(jobs) - len(states),
                "duplicated": _duplicated(stack), "finished_too_late": _finished_too_late(stack), "left_behind": left,
                "recovery_s": round(max(0.0, last_end - cleared), 1)}
    finally:
        stack.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 s leases, 2 s reroute, 0.5 s heartbeats")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds after the fault clears")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        sys.exit(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    env = {"ENCORE_PRELOAD": "1", **REFERENCE_ENGINE}
    env.update({"ENCORE_LEASE_S": "4", "ENCORE_REROUTE_AFTER_S": "2", "ENCORE_HEARTBEAT_S": "0.5"} if args.quick
               else {"ENCORE_HEARTBEAT_S": "2"})  # else the defaults of app/core/config.py
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        subprocess.run([sys.executable, "-m", "app.pipeline.tiny", "--out", str(root / "models" / "tiny"),
                        "--lipsync-out", str(root / "models" / "lipsync-tiny")], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
        redis = Redis(root)
        try:
            rows = [run(name, redis, root / "models" / "tiny", root, env, args.deadline) for name in names]
        finally:
            redis.kill()
    header = ["scenario", "submitted", "done", "failed", "canceled", "stuck", "duplicated", "left_behind",
              "recovery_s"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[h]) if h != "left_behind" else (", ".join(row[h]) or "nothing")
                                for h in header) + " |")
    print(json.dumps({"settings": "quick" if args.quick else "defaults", "rows": rows}))


if __name__ == "__main__":
    main()
