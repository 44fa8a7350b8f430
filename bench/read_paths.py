"""Requests/s of the read paths clients and scrapers hit, with many jobs in Redis, as ratios to two baselines
served by the same gunicorn command in the same run: a Flask hello-world and a route making one Redis GET.

Paths: a job poll (GET /api/v1/jobs/<id>), GET /api/v1/status, GET /metrics and the Khala frontend's
GET /status. Load: wrk (Debian's `wrk`), 200 connections. Jobs: --jobs two-track music jobs in a private
redis-server, spread over queued / running / done / failed / canceled, on two queues with two live workers.
Targets (issue 10): poll >= 0.5x hello-world, /api/v1/status >= 0.4x, /metrics and Khala /status >= 0.3x.
Only answered requests count (a 5xx, e.g. a Redis call timing out under load, or a socket error does not; their
number is reported). Between two wrk runs the bench waits until the path just measured answers as fast as it did
unloaded: gunicorn still serves the requests wrk left queued when it stopped, and a slow path's backlog would
otherwise be charged to the next one. Prints JSON (and writes it to --out).

    python bench/read_paths.py [--jobs 10000 | --jobs 100,10000] [--seconds 10] [--rounds 3] [--connections 200]
                               [--workers 2] [--out bench/results/read_paths_10000.json]

Several sizes (`--jobs 100,10000`) are measured in one run, each on its own Redis and web, every path of every size
interleaved in each round with the baselines (every other round in reverse order). Ratios are paired per round (a
path's rate over hello-world's in the same round); `largest_over_smallest` gives each path's rate at the largest
size over its rate at the smallest (1.0: flat); `redis_us_per_request` is the Redis command time per answered
request, per path and size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import requests
from flask import Flask

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import free_port, start_redis  # noqa: E402

TARGETS = {"job_poll": 0.5, "status": 0.4, "metrics": 0.3, "khala_status": 0.3}


def baseline_app() -> Flask:
    """gunicorn 'bench.read_paths:baseline_app()': the two baselines on one app."""
    from app.core.config import load_settings

    client = redis.Redis.from_url(load_settings().redis_url, decode_responses=True)
    app = Flask("baseline")

    @app.get("/hello")
    def hello():
        return "hello"

    @app.get("/one-get")
    def one_get():
        return {"value": client.get("bench:one")}

    return app


def fill(url: str, jobs: int) -> str:
    """`jobs` two-track music jobs in every overall state; returns a running job's id (the one polled)."""
    from app.core.config import Settings
    from app.control.services import build_services

    svc = build_services(Settings(redis_url=url, heartbeat_s=3600))  # the two workers stay live all run
    svc.redis.set("bench:one", "1")
    for name, queue in (("gpu0@bench", "gpu0"), ("gpu1@bench", "gpu1")):
        svc.workers.heartbeat(name, {"queue": queue, "pid": os.getpid()})
    polled = ""
    for index in range(jobs):
        job_id = svc.jobs.create("music", {"mode": "instrumental"}, [{"seed": 1}, {"seed": 2}], cost=10.0)
        queue = f"gpu{index % 2}"
        for track in (0, 1):
            svc.jobs.route(job_id, track, queue, [f"{job_id}-{track}-{s}" for s in range(4)])
        phase = index % 5
        if phase == 0:
            continue  # queued
        owner = f"gpu{index % 2}@bench|{job_id}-0-0|1"
        svc.jobs.transition(
            "start",
            job_id,
            0,
            stage="backbone",
            owner=owner,
            task_id=f"{job_id}-0-0",
            worker=f"gpu{index % 2}@bench",
            lease_ms=3_600_000,
        )
        if phase == 1:
            polled = polled or job_id  # running
        elif phase == 2:
            svc.jobs.cancel(job_id, 0, "canceled", owner=owner)
            svc.jobs.cancel(job_id, 1, "canceled")
        else:
            end = "fail" if phase == 3 else "cancel"
            svc.jobs.transition(end, job_id, 0, {"detail": "x"}, owner=owner)
            svc.jobs.transition("fail", job_id, 1, {"error": "x"})
    return polled


def wrk(url: str, seconds: int, connections: int) -> tuple[float, int]:
    """(answered requests/s, requests that failed) of one wrk run: a 5xx or a socket error is not counted as
    served (a path so slow that Redis calls time out under load answers 503s fast)."""
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--timeout", "30s", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    total, took = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out).group(1, 2)
    unit = re.search(r"\d+ requests in [\d.]+(m?s)", out).group(1)
    elapsed = float(took) / (1000 if unit == "ms" else 1)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = int(bad.group(1)) if bad else 0
    sockets = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors += sum(map(int, sockets.groups())) if sockets else 0
    return max(int(total) - errors, 0) / elapsed, errors


def latency(url: str) -> float:
    """Seconds one request to `url` takes, sequentially."""
    started = time.perf_counter()
    requests.get(url, timeout=60)  # an error answer counts too: settling waits for a fast one of either
    return time.perf_counter() - started


def settle(url: str, unloaded_s: float, limit_s: float = 120.0) -> float:
    """Wait (at most `limit_s`) until `url` answers within 3x its unloaded latency again (the backlog wrk left
    is served); returns the seconds waited."""
    started = time.monotonic()
    while latency(url) > max(3 * unloaded_s, 0.02) and time.monotonic() - started < limit_s:
        time.sleep(0.2)
    return round(time.monotonic() - started, 1)


def serve(app_spec: str, env: dict[str, str], workers: int) -> tuple[subprocess.Popen, str]:
    """`app_spec` under the deployment's gunicorn.conf.py (gthread), with `workers` processes."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            "gunicorn.conf.py",
            "-w",
            str(workers),
            "-b",
            f"127.0.0.1:{port}",
            "--log-level",
            "warning",
            app_spec,
        ],
        cwd=REPO,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            requests.get(f"{base}/healthz" if "create_app" in app_spec else f"{base}/hello", timeout=2)
            return proc, base
        except requests.RequestException:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{app_spec} did not start") from None
            time.sleep(0.2)


def sizes(text: str) -> list[int]:
    """--jobs: one number of jobs, or several separated by commas (each gets its own Redis and web)."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--jobs: numbers separated by commas, not {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("--jobs: at least one job per size")
    return values


def encore_paths(base: str, polled: str) -> dict[str, str]:
    return {
        "job_poll": f"{base}/api/v1/jobs/{polled}",
        "status": f"{base}/api/v1/status",
        "metrics": f"{base}/metrics",
        "khala_status": f"{base}/status",
    }


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def paired(runs: dict[str, list[float]], name: str, over: str) -> list[float]:
    """Per round, `name`'s rate over `over`'s rate in the same round: a noisy moment hits both alike, where a
    ratio of two medians may pair a quiet round of one with a busy round of the other."""
    return [round(a / b, 3) if b else 0.0 for a, b in zip(runs[name], runs[over], strict=True)]


def summary(runs: dict[str, list[float]], size: int) -> dict[str, object]:
    """One size's figures: medians, and the median of the paired per-round ratios to both baselines."""
    ratios = {name: median(paired(runs, f"{name}@{size}", "hello")) for name in TARGETS}
    return {
        "requests_per_s": {name: median(runs[f"{name}@{size}"]) for name in TARGETS},
        "ratio_to_hello_world": ratios,
        "ratio_to_one_get": {name: median(paired(runs, f"{name}@{size}", "one_get")) for name in TARGETS},
        "per_round_ratio_to_hello_world": {name: paired(runs, f"{name}@{size}", "hello") for name in TARGETS},
        "meets_targets": {name: ratios[name] >= TARGETS[name] for name in TARGETS},
    }


def redis_time_per_request(client: redis.Redis, answered: float) -> float:
    """Microseconds of Redis command time (`INFO commandstats`, reset before the wrk run) per answered request:
    the part of a path's cost that would grow with the jobs if a read scanned them."""
    used = sum(int(stat["usec"]) for stat in client.info("commandstats").values())
    return round(used / answered, 1) if answered else 0.0


def redis_side(redis_us: dict[str, list[float]], size: int) -> dict[str, object]:
    return {"redis_us_per_request": {name: median(redis_us[f"{name}@{size}"]) for name in TARGETS}}


def flatness(runs: dict[str, list[float]], small: int, large: int) -> dict[str, float]:
    """Per path, the median over rounds of (rate at the largest size / rate at the smallest), paired per round:
    1.0 when a path's cost does not grow with the number of jobs."""
    return {name: median(paired(runs, f"{name}@{large}", f"{name}@{small}")) for name in TARGETS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=sizes, default=[10_000], help="e.g. 10000, or 100,10000 in one run")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (the demo's command uses 2)")
    parser.add_argument("--rounds", type=int, default=3, help="wrk runs per path, interleaved; the median counts")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("wrk is needed: apt-get install wrk")
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as scratch:
        try:
            paths: dict[str, str] = {}
            fill_s: dict[str, float] = {}
            env: dict[str, str] = {}
            redis_of: dict[str, redis.Redis] = {}  # each Encore path's Redis, to read its server-side time
            for size in args.jobs:  # each size: its own redis-server, filled, and its own Encore web on it
                server, url = start_redis(Path(scratch))
                procs.append(server)
                started = time.perf_counter()
                polled = fill(url, size)
                fill_s[str(size)] = round(time.perf_counter() - started, 1)
                env = {
                    **os.environ,
                    "REDIS_URL": url,
                    "ENCORE_ARTIFACT_DIR": str(Path(scratch) / f"artifacts-{size}"),
                    "ENCORE_UPLOAD_DIR": str(Path(scratch) / f"uploads-{size}"),
                    "PYTHONPATH": str(REPO),
                }
                encore, encore_url = serve("app.web:create_app()", env, args.workers)
                procs.append(encore)
                client = redis.Redis.from_url(url)
                for name, target in encore_paths(encore_url, polled).items():
                    paths[f"{name}@{size}"] = target
                    redis_of[f"{name}@{size}"] = client
            baseline, base_url = serve("bench.read_paths:baseline_app()", env, args.workers)  # on the last Redis
            procs.append(baseline)
            paths = {"hello": f"{base_url}/hello", "one_get": f"{base_url}/one-get", **paths}
            for target in paths.values():
                requests.get(target, timeout=60).raise_for_status()
            unloaded = {name: min(latency(target) for _ in range(3)) for name, target in paths.items()}
            runs: dict[str, list[float]] = {name: [] for name in paths}
            failed: dict[str, list[int]] = {name: [] for name in paths}
            settled: dict[str, list[float]] = {name: [] for name in paths}
            redis_us: dict[str, list[float]] = {name: [] for name in redis_of}
            for round_index in range(args.rounds):  # interleaved, so a noisy moment hits every path alike
                order = list(paths.items())  # every other round backwards: no path always runs late in a round
                for name, target in order if round_index % 2 == 0 else reversed(order):
                    if name in redis_of:
                        redis_of[name].config_resetstat()
                    rate, errors = wrk(target, args.seconds, args.connections)
                    if name in redis_of:
                        redis_us[name].append(redis_time_per_request(redis_of[name], rate * args.seconds))
                    runs[name].append(round(rate, 1))
                    failed[name].append(errors)
                    settled[name].append(settle(target, unloaded[name]))
            result: dict[str, object] = {
                "jobs": args.jobs,
                "connections": args.connections,
                "gunicorn_workers": args.workers,
                "seconds_each": args.seconds,
                "rounds": args.rounds,
                "fill_s": fill_s,
                "targets": TARGETS,
                "baselines_requests_per_s": {name: median(runs[name]) for name in ("hello", "one_get")},
                "sizes": {str(size): summary(runs, size) | redis_side(redis_us, size) for size in args.jobs},
            }
            if len(args.jobs) > 1:
                result["largest_over_smallest"] = flatness(runs, args.jobs[0], args.jobs[-1])
            result |= {
                "unloaded_latency_ms": {k: round(v * 1000, 2) for k, v in unloaded.items()},
                "settle_s": settled,
                "runs": runs,
                "failed_requests": failed,
            }
            report = json.dumps(result, indent=2)
            print(report)
            if args.out:
                args.out.write_text(report + "\n")
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
