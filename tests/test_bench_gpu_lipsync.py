"""bench/gpu_lipsync.py --tiny: every section comes back without error on a CPU at tiny size (a smoke run
of the GPU bench, so that the one device call it is made for does not fail on a typo). Its speed figures
are noise here and are not checked; its parity flags, cache states and job states are."""

from __future__ import annotations

import json
import pytest

from bench.carry_check import run_as_on_device
from harness.processes import LONGEST_WAIT_S

pytestmark = pytest.mark.slow  # the whole lip-sync bench at tiny size (~170 s here)


def test_gpu_lipsync_bench_runs_every_section_at_tiny_size():
    # Under a Python holding only the GPU machine's packages and the carried wheels (bench/carry_check.py): what
    # would stop at an import on the device stops here.
    run, missing = run_as_on_device(["python", "bench/gpu_lipsync.py", "--tiny"], timeout_s=LONGEST_WAIT_S)
    assert run.returncode == 0, (missing, run.stderr[-3000:])
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    sections = {name: value for line in lines[:-1] for name, value in line.items()}
    assert set(sections) == {"bare", "phases", "stage", "cached", "parity", "job"}
    assert not [name for name, value in sections.items() if "error" in value], (missing, sections)
    phases = sections["phases"]
    assert all(phases[path]["total_ms_per_frame"] > 0 for path in ("reference", "device"))
    assert {"unet", "vae_decode", "crops_encode", "blend", "write"} <= set(phases["device"])
    stage = sections["stage"]
    assert stage["device"]["frames"] == stage["reference"]["frames"] == 30  # floor(1.2 s x 25 fps)
    assert sections["cached"]["first"]["cache"] == ["miss", "miss"]
    assert sections["cached"]["second"]["cache"] == ["hit", "hit"]
    assert sections["parity"]["same_latents_within_2_levels"] is True
    job = sections["job"]
    assert (job["first"]["state"], job["second"]["state"]) == ("done", "done"), job
    assert job["first"]["stages"]["prepare"]["cache"] == "miss"
    assert job["second"]["stages"]["prepare"]["cache"] == job["second"]["stages"]["lipsync"]["cache"] == "hit"
    summary = lines[-1]["summary"]
    assert {"device", "lipsync_fps", "bare_fps", "job_60s_s", "job_60s_cached_s"} <= set(summary)
    assert all(summary[k] is not None for k in ("lipsync_fps", "bare_fps", "job_60s_s", "job_60s_cached_s")), summary
