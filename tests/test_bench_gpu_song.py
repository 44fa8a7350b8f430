"""bench/gpu_song.py --tiny: every section a CPU can run comes back without error (a smoke run of the GPU
bench, so that the one device call it is made for does not fail on a typo). Its numbers are not checked:
they are noise on a CPU at tiny size; the parity flags are."""

from __future__ import annotations

import json
import pytest

from bench.carry_check import run_as_on_device
from harness.processes import LONGEST_WAIT_S

pytestmark = pytest.mark.slow  # the whole song bench at tiny size (~45 s here)


def test_gpu_song_bench_runs_every_section_at_tiny_size():
    # Under a Python holding only the GPU machine's packages and the carried wheels (bench/carry_check.py): what
    # would stop at an import on the device stops here.
    run, missing = run_as_on_device(["python", "bench/gpu_song.py", "--tiny"], timeout_s=LONGEST_WAIT_S)
    assert run.returncode == 0, (missing, run.stderr[-3000:])
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    sections = {name: value for line in lines[:-1] for name, value in line.items()}
    assert set(sections) == {"decode", "parity", "superres", "codec", "song_inprocess", "song_worker"}
    assert not [name for name, value in sections.items() if "error" in value], (missing, sections)
    decode = sections["decode"]
    assert all(
        decode[name]["ms_per_step_early"] > 0 and decode[name]["ms_per_step_late"] > 0
        for name in ("megatron", "reference_loop", "device_loop")
    )
    parity = sections["parity"]
    assert parity["device_loop_codes_equal_reference_loop"] is True
    assert parity["window_head_vs_full_head"]["argmax_agree"] == 1.0
    assert parity["torch_vs_megatron"]["max_abs_diff"] < 1e-4
    assert sections["song_worker"]["states"] == ["done", "done"]
    summary = lines[-1]["summary"]
    assert set(summary) == {
        "device",
        "decode_ms_per_step",
        "megatron_ms_per_step",
        "superres_s",
        "codec_s",
        "song_s_inprocess",
        "song_s_worker",
    }
    assert all(value is not None for value in summary.values()), summary
