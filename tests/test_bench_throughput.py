"""bench/throughput.py: the offered-load bench through a real worker (issue 23's in-run baseline), at tiny size,
and its arithmetic on intervals. Speeds are noise here and not checked; what the figures are made of is."""

from __future__ import annotations

import json

import pytest

import argparse

from app.pipeline.profiles import load_profile
from bench.common import machine_facts
from bench.throughput import covered_less, eta_errors, schedule, summarize, union_seconds
from harness.processes import run_bench


def test_union_counts_a_shared_interval_once_and_gaps_not_at_all():
    assert union_seconds([(0, 2), (0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)
    assert union_seconds([]) == 0.0


def _record(job_id: str, kind: str, stages: dict[str, tuple[float, float]], tracks: int = 1) -> dict:
    run = {name: {"started_at": a, "finished_at": b, "worker": "gpu0@h"} for name, (a, b) in stages.items()}
    return {"job_id": job_id, "kind": kind, "state": "done", "tracks": [{"stages": run} for _ in range(tracks)]}


def test_occupancy_is_gpu_time_over_the_window_gpu_work_waits_in():
    records = [
        _record("a", "music", {"backbone": (0, 4), "superres": (4, 6), "decode": (6, 7), "export": (7, 10)}),
        _record("b", "lipsync", {"prepare": (10, 12), "lipsync": (12, 20), "mux": (20, 21)}),
    ]
    figures = summarize(records, {"a": 0.0, "b": 0.0})
    assert figures["gpu_stage_occupancy"] == pytest.approx(15 / 20)  # 5 s of CPU stages inside the 20 s window
    assert figures["makespan_s"] == 21
    assert figures["job_latency_s"]["lipsync"]["p50"] == 21


def test_occupancy_leaves_out_a_cpu_stage_run_while_the_engine_holds_other_tracks():
    """In the engine one track's export runs in the GPU child while another track's backbone interval is open:
    that time is not the GPU's."""
    records = [
        _record("a", "music", {"backbone": (0, 4), "superres": (4, 5), "decode": (5, 6), "export": (6, 8)}),
        _record("b", "music", {"backbone": (1, 10), "superres": (10, 11), "decode": (11, 12), "export": (12, 13)}),
    ]
    figures = summarize(records, {"a": 0.0, "b": 0.0})
    assert figures["gpu_stage_occupancy"] == round(10 / 12, 3)  # 12 s of GPU intervals, 2 of them export
    assert covered_less([(0, 4), (2, 6)], [(3, 4), (5, 9)]) == pytest.approx(4.0)


def test_eta_error_is_the_distance_from_the_submitted_eta_over_the_latency():
    def record(job_id: str, kind: str, end: float) -> dict:
        stages = {"backbone": {"started_at": 0.5, "finished_at": end, "worker": "gpu0@h"}}
        return {"job_id": job_id, "kind": kind, "state": "done", "tracks": [{"stages": stages}]}

    records = [record("a", "music", 10.0), record("b", "music", 20.0), record("c", "lipsync", 4.0)]
    errors = eta_errors(records, {"a": 0.0, "b": 0.0, "c": 0.0}, {"a": 5.0, "b": 20.0, "c": None})
    assert errors["music"] == {"p50": 0.5, "p90": 0.5}  # |10 - 5| / 10 and 0: sorted [0, 0.5]
    assert errors["lipsync"] == {"p50": None, "p90": None}  # no ETA was given


def test_every_mode_is_offered_the_same_jobs_at_the_same_times():
    args = argparse.Namespace(music=3, lipsync=1, arrivals="poisson", per_hour=3600.0, seed=5)
    spread = schedule(args)
    assert spread == schedule(args)  # seeded: the same schedule for `today` and `engine`
    assert [job for job, _ in spread] == [("music", 0), ("lipsync", 0), ("music", 1), ("music", 2)]
    offsets = [offset for _, offset in spread]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] > 0
    args.arrivals = "burst"
    assert {offset for _, offset in schedule(args)} == {0.0}


@pytest.mark.slow  # a real worker per mode, 3 songs and a video at tiny size each (~4 min here)
def test_throughput_bench_runs_every_job_through_a_real_worker_in_each_mode(tmp_path):
    """Tiny songs beside the `shaped` lip-sync (--lipsync-profile): the workers load the profile the bench names."""
    run = run_bench("throughput.py", "--tiny", "--lipsync-profile", "shaped", "--records", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert [result["mode"] for result in report["results"]] == ["today", "engine"]
    assert report["machine"] == machine_facts()
    assert (report["profile"], report["lipsync_profile"]) == ("tiny", "shaped")
    for mode in ("today", "engine"):
        records = json.loads((tmp_path / f"{mode}.json").read_text())["records"]
        served = [
            t["stages"]["lipsync"]["info"]["profile"] for r in records if r["kind"] == "lipsync" for t in r["tracks"]
        ]
        assert served == ["shaped"]
    for result in report["results"]:
        assert result["jobs"] == result["jobs_done"] == 4
        assert 0 < result["gpu_stage_occupancy"] <= 1
        assert set(result["stage_seconds"]) == {"backbone", "superres", "decode", "export", "prepare", "lipsync", "mux"}
        assert result["songs_per_hour"] > 0 and result["videos_per_hour"] > 0
        assert all(error["p50"] is not None and error["p50"] >= 0 for error in result["eta_error"].values())
    today, engine = report["results"]
    assert today["cpu_worker_stage_runs"] == 0  # export, prepare and mux in the GPU child, as before issue 35
    assert engine["cpu_worker_stage_runs"] == 3 * 2 + 2  # each track's export, the video's prepare and mux
    # the engine's tally, from the GPU worker's heartbeat over the measured jobs only (the warm-up's run is not in it)
    assert today["engine"] is None
    tally = engine["engine"]
    assert tally["runs"] >= 1 and tally["blocks"] >= 1 and tally["block_s"] > 0
    song_frames = load_profile("tiny", "/nonexistent").frames_for(report["song_s"])  # what each track writes
    assert tally["frames"] >= song_frames and 0 < tally["slot_fill"] <= 1  # it stepped at least one whole track
    assert tally["ms_per_frame"] > 0 and tally["boundary_s"] > 0


@pytest.mark.slow  # tenant B's song alone and amid tenant A's 3 songs, engine mode only (~2 min here)
def test_fairness_scenario_runs_a_second_tenants_song_alone_and_amid_a_backlog():
    run = run_bench("throughput.py", "--tiny", "--scenario", "fairness", "--modes", "engine")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["benchmark"] == "fairness"
    (result,) = report["results"]
    assert result["a_songs"] == 3
    assert result["b_latency_alone_s"] > 0 and result["b_latency_amid_s"] > 0
    assert result["b_queue_position_at_submit"] >= 1  # A's songs held the GPU when B came
    assert result["b_backbone_wait_s"] >= 0 and isinstance(result["b_started_before_a_slot_freed"], bool)
