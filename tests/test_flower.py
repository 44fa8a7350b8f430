"""Flower against a real worker: basic auth on the API, Prometheus metrics, the worker visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import requests
import pytest

from tests.support.processes import REPO, free_port, wait_until

pytestmark = pytest.mark.slow  # Flower against a live worker (~9 s here)


def test_flower_requires_auth_and_sees_the_worker(make_stack, tmp_path):
    stack = make_stack()
    stack.start_worker(0)
    port = free_port()
    env = {
        **os.environ,
        **stack.env,
        "ENCORE_FLOWER_BASIC_AUTH": "ops:pa55word",
        "ENCORE_FLOWER_PORT": str(port),
        "ENCORE_FLOWER_ADDRESS": "127.0.0.1",
        "ENCORE_FLOWER_DB": str(tmp_path / "flower.db"),
    }
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "app", "flower"],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def up():
            try:
                return requests.get(f"{base}/healthcheck", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        wait_until(up, 60, 0.2, "flower")
        assert requests.get(f"{base}/api/workers", timeout=10).status_code == 401
        assert requests.get(f"{base}/", timeout=10).status_code == 401
        assert requests.get(f"{base}/api/workers", auth=("ops", "wrong"), timeout=10).status_code == 401

        def event_stream_live():
            # Worker events are fan-out: Flower sees only those sent after its receiver subscribed. A worker
            # heartbeat reaching Flower's metrics proves the receiver is live before the job's events flow.
            metrics_text = requests.get(f"{base}/metrics", timeout=10).text
            return any(
                line.startswith('flower_worker_online{worker="gpu0@') and line.endswith(" 1.0")
                for line in metrics_text.splitlines()
            )

        wait_until(event_stream_live, 60, 0.5, "a gpu0 heartbeat event in Flower")
        assert stack.wait_job(stack.submit_music(duration_s=2.0))["state"] == "done"

        def worker_listed():
            reply = requests.get(f"{base}/api/workers?refresh=1", auth=("ops", "pa55word"), timeout=15)
            return reply.status_code == 200 and any(name.startswith("gpu0@") for name in reply.json())

        wait_until(worker_listed, 30, 0.5, "gpu0 in Flower's workers")

        def tasks_listed():
            reply = requests.get(f"{base}/api/tasks", auth=("ops", "pa55word"), timeout=10)
            names = {task.get("name") for task in reply.json().values()} if reply.ok else set()
            return {"encore.music.backbone", "encore.music.export"} <= names

        wait_until(tasks_listed, 30, 0.5, "stage tasks in Flower (worker events)")
        metrics = requests.get(f"{base}/metrics", timeout=10)
        assert metrics.status_code == 200 and 'type="task-succeeded"' in metrics.text
    finally:
        os.killpg(flower.pid, signal.SIGTERM)
        flower.wait(15)
