"""bench/faults.py runs (one short scenario, quick settings): its harness submits, injects, waits and counts
with real workers, so the fault matrix recorded in docs/lifecycle.md can be re-run. The scenarios themselves are
tested one by one in tests/test_reliability.py."""

from __future__ import annotations

import json

import pytest

from harness.processes import run_bench

pytestmark = pytest.mark.slow  # bench/faults.py runs a fault scenario (~25 s here)


def test_fault_matrix_script_runs_a_scenario_and_reports_it():
    run = run_bench("faults.py", "--quick", "--only", "worker_on_two_queues")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    [row] = report["rows"]
    assert report["settings"] == "quick" and row["scenario"] == "worker_on_two_queues"
    assert (row["submitted"], row["done"], row["stuck"], row["duplicated"], row["left_behind"]) == (4, 4, 0, 0, [])
    assert "| worker_on_two_queues | 4 | 4 | 0 | 0 | 0 | 0 | nothing |" in run.stdout
    bad = run_bench("faults.py", "--only", "no_such", timeout_s=120)
    assert bad.returncode != 0 and "unknown scenarios ['no_such']" in bad.stderr
