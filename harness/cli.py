"""The command-line client run exactly as a user runs it: `python -m app`, as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.processes import REPO
from harness.stack import Stack


def cli(stack: Stack, *args: str, cwd: Path = REPO, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """Run the CLI exactly as a user would; ENCORE_URL points at the stack unless overridden."""
    environ = {k: v for k, v in os.environ.items() if k != "ENCORE_API_TOKEN"}
    environ.update({"ENCORE_URL": stack.base_url, "PYTHONPATH": str(REPO), **env})
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        cwd=cwd,
        env=environ,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
