"""Stack: a Redis database of its own, real `celery worker` subprocesses started through worker_entrypoint.sh,
and the Flask app (test client or a live HTTP server), configured like a deployment. Each Stack gets its own
Redis database, so stacks never see each other's queues. Also the unit tests' services and Celery settings on
the test redis-server."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import redis
import requests
from werkzeug.serving import make_server

from harness.processes import PYTHON, REPO, free_port, wait_until

_databases = itertools.count(1)

S3_ENV = {
    "ENCORE_ARTIFACT_BACKEND": "s3",
    "ENCORE_S3_BUCKET": "encore",
    "AWS_ACCESS_KEY_ID": "encore",
    "AWS_SECRET_ACCESS_KEY": "encore-secret",
}


def project_celery_config(settings) -> dict[str, Any]:
    """The project's Celery settings (celeryconfig.py) with broker and result backend at `settings.redis_url`.

    Unit tests that need a Celery app to send or route with return this from a `celery_config` fixture, and
    take pytest-celery's `celery_app` (its plugin loads celery.contrib.pytest): an app configured as the
    deployment's, on the test redis-server, neither eager nor in memory. No worker runs with it; tests that
    need one start real `celery worker` processes (Stack)."""
    import inspect

    import celeryconfig

    config = {
        name: value
        for name, value in vars(celeryconfig).items()
        if name.islower() and not name.startswith("_") and not callable(value) and not inspect.ismodule(value)
    }
    return {**config, "broker_url": settings.redis_url, "result_backend": settings.redis_url}


def unit_services(redis_base_url: str, db: int, root: Path):
    """Services on one of the unit tests' Redis databases (500+), emptied first."""
    from app.core.config import Settings
    from app.control.services import build_services

    services = build_services(Settings(redis_url=f"{redis_base_url}/{db}", artifact_dir=root))
    services.redis.flushdb()
    return services


# The test process never imports the task modules (app.tasks.music, app.tasks.lipsync): Celery registers their
# tasks on every app made afterwards, and a sender that knows a task puts ITS time limits into the message,
# overriding the worker's (the web, like these tests, sends stages by name only).

# Tests that need a music stage still running seconds after it starts (cancel, kill, time limits) use the
# reference engine: Megatron's forward is ~2.4x slower per token than the default plain-PyTorch engine, which
# would finish those tiny songs before the test acts. Everything else runs the default engine.
REFERENCE_ENGINE = {"ENCORE_MUSIC_ENGINE": "megatron"}


class Stack:
    """Redis database + workers + web app, configured like a deployment."""

    def __init__(self, redis_base_url: str, models: Path, root: Path, **env: str):
        self.db = next(_databases)
        assert self.db < 500, "out of Redis databases for test stacks (500+ are reserved for unit tests)"
        self.redis_url = f"{redis_base_url}/{self.db}"
        self.root = root
        self.env = {
            "REDIS_URL": self.redis_url,
            "ENCORE_MODEL_DIR": str(models),
            "ENCORE_MUSIC_PROFILE": "tiny",
            "ENCORE_LIPSYNC_MODEL_DIR": str(models.parent / "lipsync-tiny"),
            "ENCORE_LIPSYNC_PROFILE": "tiny",
            "ENCORE_UPLOAD_DIR": str(root / "uploads"),
            "ENCORE_ARTIFACT_DIR": str(root / "artifacts"),
            "ENCORE_WORKER_CACHE_DIR": str(root / "cache"),
            "ENCORE_LOG_DIR": str(root / "logs"),
            "ENCORE_TORCH_THREADS": "1",
            "ENCORE_HEARTBEAT_S": "0.5",
            # the GPU worker alone unless a test asks for its CPU-stage worker too (tests/test_cpu_worker.py)
            "ENCORE_WORKER_ROLE": "gpu",
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.workers: dict[int, subprocess.Popen] = {}
        self.redis = redis.Redis.from_url(self.redis_url, decode_responses=True)
        self.redis.flushdb()
        self._server = None
        self._gunicorns: list[subprocess.Popen] = []
        self.events_servers: dict[str, subprocess.Popen] = {}
        self.app = self._make_app()
        self.client = self.app.test_client()
        token = self.env.get("API_TOKEN", "").split(",")[0].strip()
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}  # what the helpers below send

    def _make_app(self):
        from app.core.config import Settings
        from app.web import create_app

        old = dict(os.environ)
        os.environ.update(self.env)
        try:
            self.settings = Settings()
        finally:
            os.environ.clear()
            os.environ.update(old)
        return create_app(self.settings)

    # -- workers ------------------------------------------------------------------------------------
    def start_worker(self, gpu: int, wait: bool = True, args: tuple[str, ...] = (), **env: str) -> subprocess.Popen:
        """worker_entrypoint.sh <gpu> [args: extra celery worker options, e.g. ("-Q", "gpu0,gpu1")]."""
        proc = subprocess.Popen(
            ["bash", str(REPO / "worker_entrypoint.sh"), str(gpu), *args],
            cwd=REPO,
            env={**os.environ, **self.env, **env},
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.workers[gpu] = proc
        if wait:
            self.wait_worker(gpu, "idle")
        return proc

    def start_webhook_worker(self, **env: str) -> subprocess.Popen:
        """The webhook worker as deployed (celery -Q webhooks -P threads), logging to logs/webhooks.log; returns
        once its pump has started."""
        log = self.root / "logs" / "webhooks.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [
                    PYTHON,
                    "-m",
                    "celery",
                    "-A",
                    "app",
                    "worker",
                    "-Q",
                    "webhooks",
                    "-P",
                    "threads",
                    "-c",
                    "4",
                    "-n",
                    f"webhooks{self.db}@%h",
                    "--loglevel",
                    "INFO",
                ],
                cwd=REPO,
                env={**os.environ, **self.env, **env},
                start_new_session=True,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._gunicorns.append(proc)  # stopped with the stack, as the web servers are

        def pumping() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the webhook worker exited: {log.read_text(errors='replace')[-3000:]}")
            return "role=webhooks" in log.read_text(errors="replace")

        wait_until(pumping, 60, 0.2, "the webhook worker")
        return proc

    def worker_status(self, gpu: int) -> dict | None:
        for worker in self.client.get("/api/v1/status", headers=self.auth).get_json()["workers"]:
            if worker["name"].startswith(f"gpu{gpu}@"):
                return worker
        return None

    def wait_worker(self, gpu: int, status: str, timeout: float = 90) -> dict:
        def check():
            if self.workers[gpu].poll() is not None and status != "offline":
                raise AssertionError(f"worker gpu{gpu} exited: {self.worker_log(gpu)[-3000:]}")
            worker = self.worker_status(gpu)
            return worker if worker and worker["status"] == status else None

        return wait_until(check, timeout, interval=0.2, what=f"worker gpu{gpu} {status}")

    def worker_log(self, gpu: int) -> str:
        path = self.root / "logs" / f"worker_{gpu}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def child_pid(self, gpu: int) -> int | None:
        worker = self.worker_status(gpu)
        name = worker["name"] if worker else None
        pid = self.redis.hget(f"encore:worker:{name}:current", "pid") if name else None
        return int(pid) if pid else None

    def stop_worker(self, gpu: int) -> None:
        proc = self.workers.pop(gpu)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    # -- HTTP -----------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """A live HTTP server in a thread, for tests that must go over a socket."""
        if self._server is None:
            self._server = make_server("127.0.0.1", 0, self.app, threaded=True)
            threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_port}"

    def start_gunicorn(self, *args: str, **env: str) -> str:
        """The web tier as deployed (gunicorn -c gunicorn.conf.py) on a free port; its base URL once healthy."""
        port = free_port()
        proc = subprocess.Popen(
            [PYTHON, "-m", "gunicorn", "-c", "gunicorn.conf.py", "-b", f"127.0.0.1:{port}", *args],
            cwd=REPO,
            env={**os.environ, **self.env, **env},
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._gunicorns.append(proc)
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, "gunicorn exited"
            try:
                return requests.get(f"{url}/healthz", timeout=2).ok
            except requests.RequestException:
                return False

        wait_until(healthy, 60, 0.2, "gunicorn")
        return url

    def start_events_server(self, port: int | None = None, **env: str) -> str:
        """The events server as deployed (`python -m app events`) on `port` (a free one by default), logging to
        logs/events-<port>.log; its base URL once its /healthz answers (its process: `events_servers[url]`)."""
        port = port or free_port()
        log = self.root / "logs" / f"events-{port}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [PYTHON, "-m", "app", "events", "--bind", f"127.0.0.1:{port}"],
                cwd=REPO,
                env={**os.environ, **self.env, **env},
                start_new_session=True,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._gunicorns.append(proc)  # stopped with the stack, as the web servers are
        url = f"http://127.0.0.1:{port}"
        self.events_servers[url] = proc

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the events server exited: {log.read_text(errors='replace')[-3000:]}")
            try:
                return requests.get(f"{url}/healthz", timeout=2).ok
            except requests.RequestException:
                return False

        wait_until(healthy, 60, 0.1, "the events server")
        return url

    def submit_music(self, **fields: Any) -> str:
        body = {"mode": "instrumental", "tags": "lo-fi, piano", "duration_s": 2.0, "num_tracks": 1, "seed": 7, **fields}
        reply = self.client.post("/api/v1/music", json=body, headers=self.auth)
        assert reply.status_code == 202, reply.get_json()
        return reply.get_json()["job_id"]

    def job(self, job_id: str) -> dict:
        reply = self.client.get(f"/api/v1/jobs/{job_id}", headers=self.auth)
        assert reply.status_code == 200, reply.get_json()
        return reply.get_json()

    def wait_job(
        self, job_id: str, states=("done", "failed", "canceled", "partial"), timeout: float = 120, interval: float = 0.1
    ) -> dict:
        return wait_until(
            lambda: (lambda r: r if r["state"] in states else None)(self.job(job_id)),
            timeout,
            interval,
            what=f"job {job_id} to reach {states}",
        )

    def close(self) -> None:
        for gpu in list(self.workers):
            self.stop_worker(gpu)
        if self._server is not None:
            self._server.shutdown()
        for proc in self._gunicorns:
            if proc.poll() is not None:
                continue  # a test killed it
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
