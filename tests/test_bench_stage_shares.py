"""bench/stage_shares.py --profile tiny: the stage-shares probe runs end to end and its shares add up. Its
seconds are noise here; the shaped profile's figures are in docs/performance.md."""

from __future__ import annotations

import json

import pytest

from bench.common import machine_facts
from bench.stage_shares import h200_lipsync_per_song
from harness.processes import run_bench


def test_stage_shares_bench_times_every_stage_and_the_shares_add_up():
    run = run_bench("stage_shares.py", "--profile", "tiny", "--song-s", "2", "--clip-s", "1", "--repeats", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert set(report["seconds_median"]) == {"backbone", "superres", "decode"}
    assert all(seconds > 0 for seconds in report["seconds_median"].values())
    assert abs(sum(report["shares"].values()) - 1.0) < 0.01
    assert report["torch_threads"] == 1 and report["tracks"] == 2 and len(report["runs"]) == 1
    assert report["machine"] == machine_facts()
    lipsync, song_seconds = report["lipsync"], sum(report["seconds_median"].values())
    assert lipsync["profile"] == "tiny" and lipsync["clip_s"] == 1 and len(lipsync["runs"]) == 1
    assert lipsync["seconds_median"] > 0
    assert lipsync["per_song"] == pytest.approx(lipsync["seconds_median"] / song_seconds, rel=0.01, abs=2e-3)
    assert lipsync["h200_per_song"] == round(h200_lipsync_per_song(1.0, 2.0), 3)


def test_h200_lipsync_weight_comes_from_the_two_measured_figures():
    """A 2-second clip at 64 frames/s is 0.78 s; a 10-second song at 36.3 GPU-seconds per 180 s is 2.02 s."""
    assert h200_lipsync_per_song(2.0, 10.0) == pytest.approx((50 / 64) / (36.3 / 18), rel=1e-9)
    assert h200_lipsync_per_song(2.0, 10.0) == pytest.approx(0.387, abs=1e-3)
    assert h200_lipsync_per_song(4.0, 10.0) == pytest.approx(2 * h200_lipsync_per_song(2.0, 10.0))
