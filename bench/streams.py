"""Open event streams must not starve the web (issue 22, item 3): the latency of /healthz and of a job poll on the
gunicorn web (the deployment's gunicorn.conf.py, gthread) with 0 streams open, then with N streams open at once
(default 1,000), in the same run on the same machine.

Deployment as documented: a private redis-server, the web with ENCORE_EVENTS_URL, and the events server
(`python -m app events`). Tenants: N / 100 client tenants (a tenants file), each holding 100 streams, the default
ENCORE_MAX_STREAMS_PER_TENANT; each stream follows one of their open jobs through the web's 307. While the streams
are open, --event-rate events per second are appended to the jobs' event streams (as the lifecycle appends
progress), so the events server is sending, not only holding. The streams are held by a child process (an aiohttp
client on one asyncio loop) so that its work does not share the measuring process's interpreter. Latency: p50,
p99 and max over --requests sequential requests per path, on one keep-alive connection. Target: p99 <= 100 ms with
the streams open. `--web-only` runs the same without the events server: the web serves the streams itself, as
many as half its threads, and refuses the rest (429 `streams`). Prints JSON (and writes it to --out).

    python bench/streams.py [--streams 1000] [--requests 200] [--spread-s 20] [--event-rate 20]
                            [--out bench/results/streams_1000.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import free_port, machine_facts, start_redis  # noqa: E402

TARGET_P99_MS = 100.0
PER_TENANT = 100  # ENCORE_MAX_STREAMS_PER_TENANT's default
OPEN_AT_ONCE = 100  # streams being opened concurrently while the bench ramps up


def tenants(streams: int) -> list[tuple[str, str]]:
    """(tenant name, token) pairs: enough client tenants for `streams` at PER_TENANT each."""
    return [(f"bench{i}", f"bench-token-{i}") for i in range(max(1, -(-streams // PER_TENANT)))]


def write_tenants_file(path: Path, pairs: list[tuple[str, str]]) -> None:
    from app.core.tenants import token_digest

    doc = {"tenants": {name: {"role": "client", "token_sha256": [token_digest(token)]} for name, token in pairs}}
    doc["tenants"]["ops"] = {"role": "admin", "token_sha256": [token_digest("bench-admin")]}
    path.write_text(json.dumps(doc))


def fill(url: str, pairs: list[tuple[str, str]], jobs_per_tenant: int) -> dict[str, list[str]]:
    """Open (parked) music jobs for each tenant; their ids by tenant."""
    from app.control.services import build_services
    from app.core.config import Settings

    svc = build_services(Settings(redis_url=url))
    return {
        name: [
            svc.jobs.create("music", {"mode": "instrumental"}, [{"seed": 1}], cost=1.0, tenant=name)
            for _ in range(jobs_per_tenant)
        ]
        for name, _ in pairs
    }


def serve(argv: list[str], env: dict[str, str], health: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(health, timeout=2).ok:
                return proc
        except requests.RequestException:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{argv} did not start")
        time.sleep(0.2)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(took: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(took), 2),
        "p99_ms": round(percentile(took, 0.99), 2),
        "max_ms": round(max(took), 2),
    }


def measure_web(web: str, poll_job: str, token: str, count: int, spread_s: float) -> dict[str, dict[str, float]]:
    """p50 / p99 / max in ms of `count` GETs of /healthz and of the job poll, one of each in turn, paced over
    `spread_s` seconds (so that every stream's heartbeat falls inside the window); each must answer 200."""
    paths = {
        "healthz": (f"{web}/healthz", {}),
        "job_poll": (f"{web}/api/v1/jobs/{poll_job}", {"Authorization": f"Bearer {token}"}),
    }
    took: dict[str, list[float]] = {name: [] for name in paths}
    with requests.Session() as session:
        for url, headers in paths.values():  # warm the connection and the web's first-request paths
            session.get(url, headers=headers, timeout=30).raise_for_status()
        next_at = time.monotonic()
        for _ in range(count):
            for name, (url, headers) in paths.items():
                started = time.perf_counter()
                reply = session.get(url, headers=headers, timeout=30)
                took[name].append((time.perf_counter() - started) * 1000)
                reply.raise_for_status()
            next_at += spread_s / count
            time.sleep(max(0.0, next_at - time.monotonic()))
    return {name: summary(values) for name, values in took.items()}


# -- the stream holder (a child process) -------------------------------------------------------------------------
async def hold(web: str, plan: list[tuple[str, str]], ready: str) -> None:
    """Open one stream per (token, job) through the web's 307, print `ready` with the count open, then keep reading
    every stream until standard input closes; print what was received."""
    import aiohttp

    received = {"bytes": 0, "ended": 0}
    refusals: dict[int, str] = {}  # one body per refused status
    gate = asyncio.Semaphore(OPEN_AT_ONCE)
    opened: list[asyncio.Future[int]] = []

    async def one(session: aiohttp.ClientSession, token: str, job_id: str, started: asyncio.Future[int]) -> None:
        async with gate:
            reply = await session.get(
                f"{web}/api/v1/jobs/{job_id}/events", headers={"Authorization": f"Bearer {token}"}
            )
            started.set_result(reply.status)
        if reply.status != 200:
            refusals.setdefault(reply.status, (await reply.text())[:300])
            return
        async for chunk in reply.content.iter_any():
            received["bytes"] += len(chunk)
        received["ended"] += 1

    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = []
        for token, job_id in plan:
            started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            opened.append(started)
            tasks.append(asyncio.create_task(one(session, token, job_id, started)))
        statuses = await asyncio.gather(*opened)
        report = {ready: sum(s == 200 for s in statuses), "statuses": sorted(set(statuses)), "refusals": refusals}
        print(json.dumps(report), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
        print(json.dumps({"received_bytes": received["bytes"], "ended_early": received["ended"]}), flush=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def start_holder(web: str, plan: list[tuple[str, str]]) -> tuple[subprocess.Popen, dict]:
    holder = subprocess.Popen(
        [sys.executable, __file__, "--hold", web],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write(json.dumps(plan) + "\n")
    holder.stdin.flush()
    line = holder.stdout.readline()
    if not line:
        raise RuntimeError("the stream holder exited before its streams were open")
    return holder, json.loads(line)


def append_events(url: str, jobs: list[str], rate: float, stop: threading.Event) -> list[int]:
    """`rate` events a second spread over `jobs`, appended to their event streams as the lifecycle appends progress."""
    import redis

    from app.core.keys import Layout

    client, layout, sent = redis.Redis.from_url(url), Layout(), [0]
    if rate <= 0:
        return sent
    period, index = 1.0 / rate, 0

    def run() -> None:
        nonlocal index
        next_at = time.monotonic()
        while not stop.is_set():
            job_id = jobs[index % len(jobs)]
            event = {"track": 0, "job_id": job_id, "event": "report", "state": "queued", "job_state": "queued"}
            client.xadd(layout.event_stream(job_id), {"data": json.dumps(event)}, maxlen=1000, approximate=True)
            index += 1
            sent[0] += 1
            next_at += period
            stop.wait(max(0.0, next_at - time.monotonic()))

    threading.Thread(target=run, daemon=True).start()
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per path and phase")
    parser.add_argument("--event-rate", type=float, default=20.0, help="events appended per second while measuring")
    parser.add_argument("--spread-s", type=float, default=20.0, help="each phase's requests paced over this long")
    parser.add_argument("--jobs-per-tenant", type=int, default=10)
    parser.add_argument(
        "--web-only",
        action="store_true",
        help="no events server: the web serves the streams itself (at most half its threads; the rest are 429)",
    )
    parser.add_argument("--heartbeat-s", type=float, default=15.0, help="ENCORE_SSE_HEARTBEAT_S (the default)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--logs", type=Path, help="keep the web's and the events server's logs in this folder")
    parser.add_argument("--hold", help=argparse.SUPPRESS)  # the child: hold streams against this web
    args = parser.parse_args()
    if args.hold:
        plan = [tuple(pair) for pair in json.loads(sys.stdin.readline())]
        asyncio.run(hold(args.hold, plan, "open"))  # type: ignore[arg-type]
        return
    pairs = tenants(args.streams)
    with tempfile.TemporaryDirectory() as scratch:
        redis_proc, url = start_redis(Path(scratch))
        procs = [redis_proc]
        try:
            tenants_path = Path(scratch) / "tenants.json"
            write_tenants_file(tenants_path, pairs)
            jobs = fill(url, pairs, args.jobs_per_tenant)
            web_port, events_port = free_port(), free_port()
            web, events = f"http://127.0.0.1:{web_port}", f"http://127.0.0.1:{events_port}"
            env = {
                **os.environ,
                "REDIS_URL": url,
                "ENCORE_TENANTS_FILE": str(tenants_path),
                **({} if args.web_only else {"ENCORE_EVENTS_URL": events}),
                "ENCORE_SSE_HEARTBEAT_S": str(args.heartbeat_s),
                "ENCORE_ARTIFACT_DIR": str(Path(scratch) / "artifacts"),
                "ENCORE_UPLOAD_DIR": str(Path(scratch) / "uploads"),
                "PYTHONPATH": str(REPO),
            }
            gunicorn = [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "-b", f"127.0.0.1:{web_port}"]
            logs = args.logs or Path(scratch)
            logs.mkdir(parents=True, exist_ok=True)
            procs.append(serve([*gunicorn, "--log-level", "warning"], env, f"{web}/healthz", logs / "web.log"))
            if not args.web_only:
                events_cmd = [sys.executable, "-m", "app", "events", "--bind", f"127.0.0.1:{events_port}"]
                procs.append(serve(events_cmd, env, f"{events}/healthz", logs / "events.log"))
            poll_token, poll_job = pairs[0][1], jobs[pairs[0][0]][0]

            idle = measure_web(web, poll_job, poll_token, args.requests, args.spread_s)

            plan = [
                (token, jobs[name][i % args.jobs_per_tenant])
                for name, token in pairs
                for i in range(min(PER_TENANT, args.streams - PER_TENANT * pairs.index((name, token))))
            ]
            started = time.perf_counter()
            holder, opened = start_holder(web, plan)
            procs.append(holder)
            open_s = time.perf_counter() - started
            stop = threading.Event()
            sent = append_events(url, [j for ids in jobs.values() for j in ids], args.event_rate, stop)
            loaded = measure_web(web, poll_job, poll_token, args.requests, args.spread_s)
            stop.set()
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.close()
            received = json.loads(holder.stdout.readline() or "{}")
            holder.wait(30)
            worst = max(loaded["healthz"]["p99_ms"], loaded["job_poll"]["p99_ms"])
            report = json.dumps(
                {
                    "streams": args.streams,
                    "streams_open": opened["open"],
                    "open_statuses": opened["statuses"],
                    "refusals": opened["refusals"],
                    "tenants": len(pairs),
                    "seconds_to_open_all": round(open_s, 1),
                    "requests_each": args.requests,
                    "spread_s": args.spread_s,
                    "heartbeat_s": args.heartbeat_s,
                    "events_appended": sent[0],
                    "stream_bytes_received": received.get("received_bytes"),
                    "streams_ended_early": received.get("ended_early"),
                    "web": "gunicorn -c gunicorn.conf.py (gthread, ENCORE_WEB_WORKERS x ENCORE_WEB_THREADS: 2 x 32)",
                    "machine": machine_facts(),
                    "zero_streams": idle,
                    "with_streams": loaded,
                    "target_p99_ms": TARGET_P99_MS,
                    "served_by": "the web itself (--web-only)" if args.web_only else "the events server",
                    "meets_target": worst <= TARGET_P99_MS and (args.web_only or opened["open"] == args.streams),
                },
                indent=2,
            )
            print(report)
            if args.out:
                args.out.write_text(report + "\n")
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.terminate()  # gunicorn waits for its open streams up to its graceful_timeout (30 s)
                    try:
                        proc.wait(40)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(10)


if __name__ == "__main__":
    main()
