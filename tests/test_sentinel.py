"""Redis Sentinel (issue 15, item 2) with real processes: a primary, a replica and three sentinels
(`redis-server --sentinel`). Encore's own clients (redis-py's Sentinel.master_for), Celery's broker and
result backend (sentinel:// URLs, master_name) follow the primary the sentinels name. Then the primary is
killed (-9) in the middle of a running job: after the failover the job ends done (or failed with a message),
nothing is stuck, and the web answered only 200 or 503, each within seconds, during the switch."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest
import redis
import requests

from harness.processes import free_port, redis_server_binary, wait_until
from harness.stack import REFERENCE_ENGINE, Stack

pytestmark = pytest.mark.slow  # three sentinels, a failover and jobs through it (~50 s here)

MASTER = "encore-primary"


class SentinelSet:
    """Primary + replica + 3 sentinels on loopback ports, in `root`; `password` protects the two servers,
    `sentinel_password` the sentinels (each its own, as in a hardened deployment)."""

    def __init__(self, root, password: str = "", sentinel_password: str = ""):
        self.root = root
        self.password, self.sentinel_password = password or None, sentinel_password or None
        self.procs: dict[str, subprocess.Popen] = {}
        self.primary_port, self.replica_port = free_port(), free_port()
        auth = ("--requirepass", password, "--masterauth", password) if password else ()
        self._server("primary", self.primary_port, *auth)
        self._server("replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.primary_port), *auth)
        self.sentinel_ports = [free_port() for _ in range(3)]
        for index, port in enumerate(self.sentinel_ports):
            config = root / f"sentinel{index}.conf"
            secured = (f"sentinel auth-pass {MASTER} {password}\n" if password else "") + (
                f"requirepass {sentinel_password}\nsentinel sentinel-pass {sentinel_password}\n"
                if sentinel_password
                else ""
            )
            config.write_text(
                f"port {port}\nbind 127.0.0.1\nsentinel monitor {MASTER} 127.0.0.1 {self.primary_port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\nsentinel parallel-syncs {MASTER} 1\n{secured}"
            )
            self.procs[f"sentinel{index}"] = subprocess.Popen(
                [redis_server_binary(), str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        wait_until(
            lambda: self.replica_synced() and self.sentinels_agree(self.primary_port),
            60,
            0.2,
            "the replica and the sentinels",
        )

    def _server(self, name: str, port: int, *args: str) -> None:
        folder = self.root / name
        folder.mkdir()
        self.procs[name] = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(folder),
                "--databases",
                "512",
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def replica_synced(self) -> bool:
        try:
            info = redis.Redis(port=self.replica_port, password=self.password).info("replication")
        except redis.ConnectionError:
            return False
        return info.get("master_link_status") == "up"

    def named_primary(self, port: int) -> tuple[str, int] | None:
        try:
            reply = redis.Redis(port=port, socket_timeout=1, password=self.sentinel_password).execute_command(
                "SENTINEL", "get-master-addr-by-name", MASTER
            )
        except redis.RedisError:
            return None
        return (reply[0].decode(), int(reply[1])) if reply else None

    def sentinels_agree(self, primary: int) -> bool:
        return all(self.named_primary(port) == ("127.0.0.1", primary) for port in self.sentinel_ports)

    @property
    def env(self) -> dict[str, str]:
        return {
            "REDIS_SENTINELS": ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports),
            "REDIS_SENTINEL_MASTER": MASTER,
        }

    def kill_primary(self) -> None:
        self.procs["primary"].send_signal(signal.SIGKILL)
        self.procs["primary"].wait(10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def sentinels(tmp_path):
    group = SentinelSet(tmp_path)
    yield group
    group.close()


@pytest.fixture
def sentinel_stack(sentinels, tiny_models, tmp_path):
    stack = Stack(
        f"redis://127.0.0.1:{sentinels.primary_port}",
        tiny_models,
        tmp_path / "stack",
        ENCORE_LEASE_S="3",
        ENCORE_PRELOAD="1",
        **sentinels.env,
        **REFERENCE_ENGINE,
    )
    yield stack
    stack.close()


def test_jobs_run_through_sentinel_and_survive_a_failover(sentinels, sentinel_stack):
    stack = sentinel_stack
    stack.start_worker(0)
    assert stack.wait_job(stack.submit_music(duration_s=2.0), timeout=120)["state"] == "done"  # through Sentinel

    url = stack.start_gunicorn()
    job_id = stack.submit_music(duration_s=30.0)
    waiting = stack.submit_music(duration_s=2.0)  # queued behind it when the primary dies
    wait_until(lambda: stack.job(job_id)["tracks"][0]["progress"] > 0, 60, 0.1, "the job's backbone")
    answers: list[tuple[float, int | str, float]] = []
    stop = threading.Event()

    def probe() -> None:  # the web, read all through the switch: status or error, and how long it took
        while not stop.is_set():
            began = time.monotonic()
            try:
                status: int | str = requests.get(f"{url}/api/v1/jobs/{job_id}", timeout=15).status_code
            except requests.RequestException as exc:
                status = type(exc).__name__
            answers.append((began, status, time.monotonic() - began))
            stop.wait(0.1)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()

    killed_at = time.monotonic()
    sentinels.kill_primary()
    wait_until(lambda: sentinels.sentinels_agree(sentinels.replica_port), 60, 0.2, "the replica's promotion")
    promoted_s = time.monotonic() - killed_at

    def ended():
        try:
            record = stack.job(job_id)
        except (redis.RedisError, OSError, AssertionError):  # Redis errors, or a 503, while the failover settles
            return None
        return record if record["state"] in ("done", "failed") else None

    record = wait_until(ended, 240, 0.5, "the job to end after the failover")
    stop.set()
    prober.join(20)
    track = record["tracks"][0]
    assert record["state"] == "done", record  # a failover never fails the job: its stage starts again
    statuses = {status for _, status, _ in answers}
    assert statuses <= {200, 503}, statuses  # never a 500 or a connection error from the web
    assert max(took for _, _, took in answers) < 10, max(took for _, _, took in answers)  # never a hang
    back = [began for began, status, _ in answers if began > killed_at and status == 200]
    recovered_s = (back[0] - killed_at) if back else None
    print(
        f"failover: promoted after {promoted_s:.1f} s, web answering 200 again after {recovered_s} s, "
        f"{sum(status == 503 for _, status, _ in answers)} answers 503, job {record['state']} "
        f"(restarts {track['restarts']})"
    )
    starts = [
        line
        for line in stack.worker_log(0).splitlines()
        if f"job={job_id} track=0 " in line and "event=stage_started" in line and "stage=backbone" in line
    ]
    assert len(starts) == track["restarts"] + 1  # one start per run: the restart never overlapped a live one
    assert stack.wait_job(waiting, timeout=120)["state"] == "done"  # the queued job was not lost
    assert stack.wait_job(stack.submit_music(duration_s=2.0), timeout=120)["state"] == "done"  # and new work runs


def test_every_client_is_configured_for_sentinel():
    """Celery's URLs and transport options, and the rate limiter's storage, name the sentinels, not REDIS_URL;
    the limiter's carries the database and both passwords, each where it belongs."""
    from app.core.config import Settings
    from app.http.ratelimit import storage
    from app.adapters.redis_conn import SENTINEL_CONNECT_TIMEOUT_S, celery_connection

    settings = Settings(
        redis_url="redis://:pw@ignored:1/7",
        redis_sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26380)),
        redis_sentinel_master="prod",
        redis_sentinel_password="spw",
    )
    celery = celery_connection(settings)
    assert celery["broker_url"] == "sentinel://:pw@10.0.0.1:26379/7;sentinel://:pw@10.0.0.2:26380/7"
    assert celery["result_backend"] == celery["broker_url"]
    assert celery["broker_transport_options"] == {"master_name": "prod", "sentinel_kwargs": {"password": "spw"}}
    timeouts = {"socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S}
    assert storage(settings) == (
        "redis+sentinel://10.0.0.1:26379,10.0.0.2:26380/prod",
        {
            "db": 7,
            "password": "pw",
            **timeouts,
            "key_prefix": "encore:ratelimit",
            "use_replicas": False,  # a replica's window lags the primary's
            "sentinel_kwargs": {"password": "spw", **timeouts, "socket_timeout": SENTINEL_CONNECT_TIMEOUT_S},
        },
    )
    open_sentinels = Settings(redis_url="redis://ignored:1", redis_sentinels=(("10.0.0.1", 26379),))
    uri, options = storage(open_sentinels)  # no password at all: none sent to the sentinels or the primary
    assert (options["db"], options["password"], options["sentinel_kwargs"]["password"]) == (0, None, None)
    plain = Settings(redis_url="redis://127.0.0.1:6379/3")
    assert celery_connection(plain) == {"broker_url": plain.redis_url, "result_backend": plain.redis_url}
    assert storage(plain) == (plain.redis_url, {"key_prefix": "encore:ratelimit"})


@pytest.mark.parametrize(
    "password,sentinel_password", [("", ""), ("primary-pw", "sentinel-pw")], ids=["open", "passwords"]
)
def test_the_rate_limiter_counts_in_encores_database_through_sentinel(
    tiny_models, tmp_path, password, sentinel_password
):
    """Encore on a database of its own (not 0), open or with the servers and the sentinels each under their own
    password: the limiter finds the primary through the sentinels, refuses the third submit of a 2/minute
    window, and its window lives in Encore's database, beside the jobs (it used to count in database 0, and
    to send the primary's password to the sentinels, which refused it)."""
    (tmp_path / "sentinels").mkdir()
    group = SentinelSet(tmp_path / "sentinels", password=password, sentinel_password=sentinel_password)
    auth = f":{password}@" if password else ""
    stack = None
    try:
        stack = Stack(
            f"redis://{auth}127.0.0.1:{group.primary_port}",
            tiny_models,
            tmp_path / "stack",
            REDIS_SENTINEL_PASSWORD=sentinel_password,
            API_TOKEN="alpha",
            ENCORE_SUBMIT_RATE_LIMIT="2/minute",
            **group.env,
        )
        assert stack.db != 0
        submit = {"mode": "instrumental", "tags": "x", "duration_s": 2.0, "num_tracks": 1}
        replies = [stack.client.post("/api/v1/music", json=submit, headers=stack.auth) for _ in range(3)]
        assert [reply.status_code for reply in replies] == [202, 202, 429], [r.get_json() for r in replies]
        assert replies[1].headers["X-RateLimit-Remaining"] == "0"
        encores, zero = (redis.Redis(port=group.primary_port, password=password or None, db=db) for db in (stack.db, 0))
        windows = list(encores.scan_iter("encore:ratelimit:*"))
        assert windows and [int(encores.get(key)) for key in windows] == [3]  # every attempt, the refused one too
        assert list(encores.scan_iter("encore:job:*"))  # the jobs' database, reached through the sentinels too
        assert not list(zero.scan_iter("encore:*"))
    finally:
        if stack is not None:
            stack.close()
        group.close()
