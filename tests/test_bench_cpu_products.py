"""bench/cpu_products.py: the kernel probe runs end to end; its figures are what they say (every row count, both
kernels, per-row and relative costs derived from the frame times). Its milliseconds are noise here; the measured
figures are in docs/performance.md."""

from __future__ import annotations

import json

import pytest

from bench.common import machine_facts
from harness.processes import run_bench


def test_cpu_products_times_both_kernels_at_every_row_count_and_checks_the_tile():
    run = run_bench("cpu_products.py", "--repeats", "1", "--layers", "1", "--trials", "8")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    rows = ["1", "2", "4", "8", "16", "32"]
    for kernel in ("torch", "onednn"):
        frame = report["frame_ms"][kernel]
        assert list(frame) == rows and all(ms > 0 for ms in frame.values())
        assert report["vs_one_row"][kernel]["1"] == 1.0
        for count in rows:
            assert report["row_ms"][kernel][count] == pytest.approx(
                frame[count] / int(count), abs=0.006
            )  # both rounded
    assert report["onednn_16_rows_vs_torch"] == pytest.approx(
        report["frame_ms"]["torch"]["16"] / report["frame_ms"]["onednn"]["16"], rel=0.02
    )
    assert report["onednn_tile_rows_moved_differ"].endswith(" of 8")
    assert report["threads"] == 1 and report["layers"] == 1
    assert report["machine"] == machine_facts()  # the core it ran on, said in its output
