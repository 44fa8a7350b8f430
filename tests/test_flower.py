"""Flower against a real worker: basic auth on the API, Prometheus metrics, the worker visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import requests
import pytest

from harness.processes import REPO, free_port, wait_until
from harness.stack import REFERENCE_ENGINE

pytestmark = pytest.mark.slow  # Flower against a live worker (~9 s here)


def test_flower_requires_auth_and_sees_the_worker(make_stack, tmp_path):
    stack = make_stack(**REFERENCE_ENGINE)  # a 30 s song runs long enough to be canceled mid-stage
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

        # A stage ended by a cancel is ignored by Celery (no final event of its own): the stage says it was
        # revoked, so Flower does not show it STARTED for good (issue 24 item 3).
        canceled = stack.submit_music(duration_s=30.0)
        wait_until(lambda: stack.job(canceled)["state"] == "running", 60, 0.1, "the long job to run")
        assert stack.client.delete(f"/api/v1/jobs/{canceled}", headers=stack.auth).status_code == 200
        assert stack.wait_job(canceled, timeout=60)["state"] == "canceled"

        def its_backbone():
            reply = requests.get(f"{base}/api/tasks", auth=("ops", "pa55word"), timeout=10)
            return [
                task
                for task in (reply.json().values() if reply.ok else ())
                if task.get("name") == "encore.music.backbone" and canceled in str(task.get("args"))
            ]

        wait_until(lambda: [t["state"] for t in its_backbone()] == ["REVOKED"], 30, 0.5, "the stage REVOKED")
    finally:
        os.killpg(flower.pid, signal.SIGTERM)
        flower.wait(15)
