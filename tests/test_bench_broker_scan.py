"""bench/broker_scan.py --tiny: the bench of kombu's structures read a page at a time runs end to end, both
implementations answer alike, and its figures show what it measures (no read over a page on the paged side, whole
lists on the baseline's). Speeds are noise here; docs/performance.md has the 10,000-message run."""

from __future__ import annotations

import json

from app.control.broker import SCAN_PAGE
from bench.common import machine_facts
from harness.processes import run_bench

CALLS = {"find_oldest", "find_newest", "find_missing", "drop_messages", "drop_unacked", "messages_present"}


def test_broker_scan_bench_compares_paged_reads_with_whole_list_reads(tmp_path):
    out = tmp_path / "broker_scan.json"
    run = run_bench("broker_scan.py", "--tiny", "--out", str(out), timeout_s=180)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert json.loads(out.read_text()) == report
    assert report["page"] == SCAN_PAGE and report["messages"] > 3 * SCAN_PAGE and report["unacked"] > SCAN_PAGE
    assert report["agree"] == dict.fromkeys(CALLS, True)
    assert {k: v for k, v in report["machine"].items() if k != "load_average"} == machine_facts()
    assert len(report["machine"]["load_average"]) == 3
    assert set(report["calls"]) == CALLS
    for name, figures in report["calls"].items():
        paged, whole = figures["paged"], figures["whole_list_baseline"]
        assert len(figures["ms_per_round"]["paged"]) == len(figures["ms_per_round"]["whole_list"]) == report["rounds"]
        assert paged["ms"] > 0 and whole["ms"] > 0, name
        assert paged["largest_reply_items"] < 2 * SCAN_PAGE, name  # an HSCAN batch may pass COUNT by a bucket
        reply_items = report["unacked"] if name == "drop_unacked" else report["messages"]
        assert whole["largest_reply_items"] > reply_items - 10, name  # the whole list, or the whole hash
        assert paged["peak_python_kib"] < whole["peak_python_kib"], name
        assert figures["ratio_paged_to_baseline"]["largest_reply_kib"] < 1, name
    assert report["calls"]["find_oldest"]["paged"]["read_kib"] < report["calls"]["find_newest"]["paged"]["read_kib"]


def test_broker_scan_bench_refuses_too_few_messages_for_its_rounds():
    bad = run_bench("broker_scan.py", "--messages", "5", "--unacked", "5", timeout_s=60)
    assert bad.returncode != 0 and "at least" in bad.stderr
