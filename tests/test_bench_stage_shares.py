"""bench/stage_shares.py --profile tiny: the stage-shares probe runs end to end and its shares add up. Its
seconds are noise here; the shaped profile's figures are in docs/performance.md."""

from __future__ import annotations

import json

from bench.common import machine_facts
from harness.processes import run_bench


def test_stage_shares_bench_times_every_stage_and_the_shares_add_up():
    run = run_bench("stage_shares.py", "--profile", "tiny", "--song-s", "2", "--repeats", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert set(report["seconds_median"]) == {"backbone", "superres", "decode"}
    assert all(seconds > 0 for seconds in report["seconds_median"].values())
    assert abs(sum(report["shares"].values()) - 1.0) < 0.01
    assert report["torch_threads"] == 1 and report["tracks"] == 2 and len(report["runs"]) == 1
    assert report["machine"] == machine_facts()
