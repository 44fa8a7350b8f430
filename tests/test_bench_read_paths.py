"""bench/read_paths.py runs at tiny size: two sizes of filled Redis, each with Encore's real gunicorn web on it,
the baselines beside them, every path answered, the ratios paired per round. Its figures (docs/performance.md)
come from full-size runs; this keeps the script itself working (it once failed to boot its baseline unnoticed)."""

from __future__ import annotations

import json

import pytest

from bench.read_paths import TARGETS, flatness, paired, summary
from harness.processes import run_bench

pytestmark = pytest.mark.slow  # two redis-servers, three gunicorns and 20 one-second wrk runs (~30 s here)


def test_ratios_pair_each_round_with_its_own_baseline():
    runs = {"hello": [1000.0, 500.0], "one_get": [800.0, 400.0]}
    runs |= {f"{name}@10": [600.0, 100.0] for name in TARGETS} | {f"{name}@99": [300.0, 150.0] for name in TARGETS}
    assert paired(runs, "job_poll@10", "hello") == [0.6, 0.2]
    figures = summary(runs, 10)
    assert figures["ratio_to_hello_world"]["job_poll"] == 0.4  # median of 0.6 and 0.2, not 350 / 750
    assert figures["ratio_to_one_get"]["job_poll"] == 0.5  # 0.75 and 0.25
    assert figures["meets_targets"] == {"job_poll": False, "status": True, "metrics": True, "khala_status": True}
    assert flatness(runs, 10, 99)["job_poll"] == 1.0  # 0.5 and 1.5


def test_read_paths_bench_measures_two_sizes_in_one_run():
    run = run_bench("read_paths.py", "--jobs", "20,60", "--seconds", "1", "--rounds", "2", "--connections", "10")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["jobs"] == [20, 60] and set(report["sizes"]) == {"20", "60"}
    expected_paths = {"hello", "one_get"} | {f"{name}@{size}" for name in TARGETS for size in (20, 60)}
    assert set(report["runs"]) == expected_paths
    assert all(len(rates) == 2 and min(rates) > 0 for rates in report["runs"].values()), report["runs"]
    assert all(sum(errors) == 0 for errors in report["failed_requests"].values()), report["failed_requests"]
    for size in ("20", "60"):
        ratios = report["sizes"][size]["per_round_ratio_to_hello_world"]
        assert set(ratios) == set(TARGETS) and all(len(pair) == 2 for pair in ratios.values())
        assert all(us > 0 for us in report["sizes"][size]["redis_us_per_request"].values())  # each reads Redis
    assert set(report["largest_over_smallest"]) == set(TARGETS)
    bad = run_bench("read_paths.py", "--jobs", "ten", timeout_s=60)
    assert bad.returncode != 0 and "--jobs: numbers separated by commas" in bad.stderr
