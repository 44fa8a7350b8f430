"""GET /readyz (issue 14, item 5) over real HTTP against real workers: 503 with the reason while no live worker
has its models loaded (none at all, or one that loads lazily), 200 once a worker's preload has loaded the
models of every kind it serves; /healthz stays liveness. `python -m app.control.readiness` is the compose check."""

from __future__ import annotations

import os
import subprocess
import sys

import requests
import pytest

from harness.processes import REPO, wait_until

pytestmark = pytest.mark.slow  # waits for a worker to load its models (~15 s here)


def readyz(url: str) -> tuple[int, dict]:
    reply = requests.get(f"{url}/readyz", timeout=10)
    assert reply.headers["Content-Type"] == "application/json"
    return reply.status_code, reply.json()


def readiness_check(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.control.readiness", *args],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **stack.env},
        timeout=60,
    )


def test_readyz_is_503_until_a_worker_has_loaded_its_models(make_stack):
    stack = make_stack(API_TOKEN="tok")  # probes need no token
    url = stack.base_url
    status, body = readyz(url)
    assert status == 503 and body == {"ready": False, "redis": "ok", "workers": [], "error": "workers: no live worker"}
    assert requests.get(f"{url}/healthz", timeout=10).status_code == 200  # alive, just not ready
    assert readiness_check(stack).returncode == 1

    stack.start_worker(0, ENCORE_PRELOAD="0")  # live, but its models load on first use
    status, body = readyz(url)
    assert status == 503, body
    [worker] = body["workers"]
    assert worker["kinds"] == ["lipsync", "music"] and worker["models_loaded"] == [] and not worker["ready"]
    assert body["error"] == (
        f"workers: no live worker has its models loaded ({worker['name']} has not loaded lipsync, music)"
    )
    stack.stop_worker(0)
    wait_until(lambda: not readyz(url)[1]["workers"], 15, 0.1, "the killed worker to drop out")

    stack.start_worker(0, wait=False, ENCORE_PRELOAD="1")
    status, body = wait_until(
        lambda: (lambda r: r if r[0] == 200 else None)(readyz(url)), 120, 0.2, "/readyz to answer 200"
    )
    [worker] = body["workers"]
    assert body["ready"] and body["redis"] == "ok" and "error" not in body
    assert worker["models_loaded"] == worker["kinds"] == ["lipsync", "music"] and worker["missing"] == []
    assert worker["name"].startswith("gpu0@")
    assert readiness_check(stack).returncode == 0
    assert readiness_check(stack, worker["name"]).returncode == 0
    assert readiness_check(stack, "gpu7@nowhere").returncode == 1
    # The worker took the models from its registry entry, where its status shows too.
    entry = stack.redis.hgetall(f"encore:worker:{worker['name']}")
    assert entry["models_loaded"] == "lipsync,music" and int(entry["models_pid"]) != int(entry["pid"])
