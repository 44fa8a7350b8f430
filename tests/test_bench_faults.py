"""bench/faults.py runs (one short scenario, quick settings): its harness submits, injects, waits and counts
with real workers, so the fault matrix recorded in docs/lifecycle.md can be re-run. The scenarios themselves are
tested one by one in tests/test_reliability.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.processes import LONGEST_WAIT_S, REPO

pytestmark = pytest.mark.slow  # bench/faults.py runs a fault scenario (~25 s here)


def test_fault_matrix_script_runs_a_scenario_and_reports_it():
    run = subprocess.run(
        [sys.executable, "bench/faults.py", "--quick", "--only", "worker_on_two_queues"],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=LONGEST_WAIT_S,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    [row] = report["rows"]
    assert report["settings"] == "quick" and row["scenario"] == "worker_on_two_queues"
    assert (row["submitted"], row["done"], row["stuck"], row["duplicated"], row["left_behind"]) == (4, 4, 0, 0, [])
    assert "| worker_on_two_queues | 4 | 4 | 0 | 0 | 0 | 0 | nothing |" in run.stdout
    bad = subprocess.run(
        [sys.executable, "bench/faults.py", "--only", "no_such"],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "unknown scenarios ['no_such']" in bad.stderr
