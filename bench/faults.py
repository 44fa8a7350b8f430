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
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from harness.faults import ENDED, SCENARIOS, files_left_behind, left_behind  # noqa: E402  (shared with tests/test_reliability.py)
from harness.processes import RedisServer, wait_until  # noqa: E402
from harness.stack import REFERENCE_ENGINE, Stack  # noqa: E402


def _duplicated(stack: Stack) -> int:
    """Stages whose finish was accepted more than once; their jobs' log lines go to stderr, to be read.
    (`stage_finished_too_late`, a finish refused because the lease was lost, is not one: the stage ran again
    elsewhere and only that run counts. It used to be counted here, by a substring match.)"""
    finished = Counter()
    lines = [
        line
        for path in sorted((stack.root / "logs").glob("worker_*.log"))
        for line in path.read_text(errors="replace").splitlines()
    ]
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
    return sum(
        path.read_text(errors="replace").count("event=stage_finished_too_late")
        for path in (stack.root / "logs").glob("worker_*.log")
    )


def run(name: str, redis: RedisServer, models: Path, root: Path, env: dict[str, str], deadline_s: float) -> dict:
    stack = Stack(redis.url, models, root / name, **env)
    try:
        fault = SCENARIOS[name](stack, redis)
        jobs, cleared = fault.jobs, fault.cleared
        states: dict[str, str] = {}
        last_end = cleared
        while time.monotonic() - cleared < deadline_s:
            for job_id in jobs:
                if job_id not in states and (state := stack.job(job_id)["state"]) in ENDED:
                    states[job_id], last_end = state, time.monotonic()
            if len(states) == len(jobs):
                break
            time.sleep(0.2)
        left: list[str] = []
        files: list[str] = []
        if len(states) == len(jobs):  # acks follow the records; give them a moment
            try:
                wait_until(lambda: not left_behind(stack), 15, 0.2, "the bookkeeping to empty")
            except AssertionError:
                left = left_behind(stack)
            try:  # scratch goes when its stage ends, or at the next heartbeat of a worker started again
                wait_until(lambda: not files_left_behind(stack), 30, 0.2, "the scratch to go")
            except AssertionError:
                files = files_left_behind(stack)
        counts = Counter(states.values())
        return {
            "scenario": name,
            "submitted": len(jobs),
            "done": counts["done"],
            "failed": counts["failed"],
            "canceled": counts["canceled"],
            "partial": counts["partial"],
            "stuck": len(jobs) - len(states),
            "duplicated": _duplicated(stack),
            "finished_too_late": _finished_too_late(stack),
            "left_behind": left,
            "files_left_behind": files,
            "recovery_s": round(max(0.0, last_end - cleared), 1),
        }
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
    env.update(
        {"ENCORE_LEASE_S": "4", "ENCORE_REROUTE_AFTER_S": "2", "ENCORE_HEARTBEAT_S": "0.5"}
        if args.quick
        else {"ENCORE_HEARTBEAT_S": "2"}
    )  # else the defaults of app/core/config.py
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "app.pipeline.tiny",
                "--out",
                str(root / "models" / "tiny"),
                "--lipsync-out",
                str(root / "models" / "lipsync-tiny"),
            ],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        redis = RedisServer(root / "aof")
        try:
            rows = [run(name, redis, root / "models" / "tiny", root, env, args.deadline) for name in names]
        finally:
            redis.kill()
    header = ["scenario", "submitted", "done", "failed", "canceled", "stuck", "duplicated", "left_behind", "recovery_s"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print(
            "| "
            + " | ".join(
                str(row[h]) if h != "left_behind" else (", ".join(row[h] + row["files_left_behind"]) or "nothing")
                for h in header
            )
            + " |"
        )
    print(json.dumps({"settings": "quick" if args.quick else "defaults", "rows": rows}))


if __name__ == "__main__":
    main()
