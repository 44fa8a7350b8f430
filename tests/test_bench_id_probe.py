"""bench/id_probe.py at smoke size: every route that names a job answers another tenant's real id and an unknown
one with the same Redis work (issue 36, item 14). Its timings (docs/performance.md) come from a 1,000-pair run."""

from __future__ import annotations

import json

from bench.id_probe import ROUTES
from harness.processes import run_bench


def test_another_tenants_real_job_id_costs_the_same_redis_work_as_an_unknown_one():
    run = run_bench("id_probe.py", "--tiny")
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout)
    assert set(figures["routes"]) == set(ROUTES) and figures["pairs"] == 50
    for route, measured in figures["routes"].items():
        assert measured["redis_commands_real"], route  # it asked Redis something
        assert measured["same_redis_work"], (route, measured)
