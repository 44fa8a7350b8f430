"""bench/slots.py --tiny: the in-flight batching bench runs end to end (so that the device call it is made for
does not fail on a typo), and every configuration's codes are those alone. Speeds are noise here."""

from __future__ import annotations

import json

import pytest

from app.pipeline.profiles import load_profile
from bench.common import machine_facts
from harness.processes import run_bench


def test_slots_bench_runs_and_every_configuration_decodes_each_track_as_alone():
    run = run_bench("slots.py", "--tiny", "--repeats", "1", "--slots", "1,4", "--tracks", "5")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    expected = {"one_after_the_other", "slots_1", "slots_4", "batched_matmul_slots_1", "batched_matmul_slots_4"}
    expected |= {"whole_frame_slots_1", "whole_frame_slots_4"}
    assert set(report["tracks_per_hour"]) == expected
    assert all(report["codes_equal_alone"].values()), report["codes_equal_alone"]
    assert set(report["code_agreement_with_alone"].values()) == {1.0}
    modes = ("exact", "batched", "whole")
    assert set(report["step_ms"]) == {f"{mode}_slots_{n}" for mode in modes for n in (1, 4)}
    assert report["step_ratio_to_one_slot"]["batched_slots_1"] == 1.0
    assert report["whole_frame_codes_equal_alone_in_as_many_slots"] is True
    assert all(value > 0 for value in report["projected_tracks_per_hour_3min_songs"].values())
    assert report["machine"] == machine_facts()


def test_slots_bench_steps_the_shaped_profiles_own_backbone():
    """--profile shaped: the backbone bench/throughput.py --profile shaped runs (its spec, not a music_engines size)."""
    run = run_bench(
        "slots.py",
        "--profile",
        "shaped",
        "--batched-only",
        "--slots",
        "1,2",
        "--tracks",
        "2",
        "--frames",
        "4",
        "--repeats",
        "1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["size"] == "shaped"
    spec = load_profile("shaped", "/nonexistent").backbone
    attention = spec.hidden_size * spec.head_dim * 2 * (spec.num_attention_heads + spec.num_query_groups)
    feed_forward = 3 * spec.hidden_size * spec.ffn_hidden_size
    weights = spec.num_layers * (attention + feed_forward) + 2 * spec.vocab_size * spec.hidden_size  # + embedding, head
    assert report["params_m"] == pytest.approx(weights / 1e6, rel=0.02)  # its spec's model (norms and biases aside)
    assert all(report["codes_equal_alone"].values()), report["codes_equal_alone"]
