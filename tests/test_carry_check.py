"""bench/carry_check.py: a Python here that sees only the GPU machine's packages (its image's and the carried
wheels), so that a bench that would stop at an import on the device stops here first, before device time is
spent (bench/gpu_song.py would have stopped at `import megatron.core`, and every bench's Celery worker at
click-repl's `import prompt_toolkit`). tests/test_bench_gpu_song.py and test_bench_gpu_lipsync.py run the
whole benches this way."""

from __future__ import annotations

from bench.carry_check import device_packages, failed_sections, run_as_on_device

WORKER_SIDE = (
    "import megatron.core, app.tasks.music, app.tasks.lipsync, app.adapters.celery_app, app.pipeline.music.stages;"
    "from dac.model.dac import DecoderBlock; import app.pipeline.lipsync.stages; print('imported')"
)


def test_a_package_off_the_list_cannot_be_imported_and_is_named():
    run, missing = run_as_on_device(
        ["python", "-c", "import flask"], timeout_s=120, packages=device_packages() - {"flask"}
    )
    assert run.returncode == 1
    assert missing == ["flask"]
    allowed, _ = run_as_on_device(["python", "-c", "import flask"], timeout_s=120)
    assert allowed.returncode == 0, allowed.stderr[-2000:]


def test_the_carry_holds_what_the_worker_side_imports():
    run, missing = run_as_on_device(["python", "-c", WORKER_SIDE], timeout_s=300)
    assert run.returncode == 0, (missing, run.stderr[-2000:])
    assert run.stdout.strip().endswith("imported")


def test_the_celery_command_starts_with_the_carry():
    run, missing = run_as_on_device(["python", "-m", "celery", "-A", "app", "worker", "--help"], timeout_s=300)
    assert run.returncode == 0, (missing, run.stderr[-2000:])
    assert "--queues" in run.stdout


def test_a_failed_bench_section_is_reported():
    out = '{"decode": {"ms": 1.0}}\n{"song_worker": {"error": "worker did not come up"}}\n{"summary": {}}\n'
    assert failed_sections(out) == {"song_worker": "worker did not come up"}
