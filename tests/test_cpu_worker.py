"""The host's CPU-stage worker (worker_entrypoint.sh starts `cpu<n>@host` on queue `gpu<n>.cpu` beside `gpu<n>@host`):
music export and lip-sync prepare and mux run there, the GPU child runs GPU stages only; with no CPU-stage worker
live they run in place; a CPU-stage worker killed mid-export is replaced and the track ends done (issue 35 item 5).
Real workers, Redis, ffmpeg and the tiny models."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from app.control.readiness import worker_readiness
from app.core.kinds import LIPSYNC, MUSIC
from app.core.queues import cpu_queue_of, is_cpu_queue
from harness.media import face_video, tone, upload
from harness.processes import REPO, wait_until

GPU_STAGES = {"backbone", "superres", "decode", "lipsync"}


def test_the_stages_that_need_no_gpu_are_named_and_their_queue_is_never_a_gpu_queue():
    assert [s.name for s in (*MUSIC.stages, *LIPSYNC.stages) if s.cpu] == ["export", "prepare", "mux"]
    assert cpu_queue_of("gpu3") == "gpu3.cpu" and is_cpu_queue("gpu3.cpu") and not is_cpu_queue("gpu3")
    cpu = worker_readiness({"name": "cpu0@h", "role": "cpu", "kinds": "", "models_loaded": ""})
    assert cpu["ready"] and cpu["kinds"] == []


def _worker_of(stack, name_prefix: str) -> dict | None:
    workers = stack.client.get("/api/v1/status", headers=stack.auth).get_json()["workers"]
    return next((w for w in workers if w["name"].startswith(name_prefix)), None)


def _cpu_worker_idle(stack) -> bool:
    worker = _worker_of(stack, "cpu0@")
    return bool(worker) and worker["status"] == "idle"


def _where(record: dict) -> dict[str, str]:
    return {name: run["worker"].split("@")[0] for name, run in record["tracks"][0]["stages"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("slots", ["1", "16"])  # without and with the backbone engine
def test_cpu_stages_run_on_the_cpu_worker_and_gpu_stages_in_the_gpu_child(make_stack, tmp_path, slots):
    stack = make_stack(ENCORE_BACKBONE_SLOTS=slots, ENCORE_WORKER_ROLE="both")  # as worker_entrypoint.sh deploys
    stack.start_worker(0)
    wait_until(lambda: _cpu_worker_idle(stack), 60, 0.1, "the CPU-stage worker")
    assert sorted(q for w in [_worker_of(stack, "cpu0@")] for q in w["queue"].split(",")) == ["gpu0.cpu"]

    song = stack.wait_job(stack.submit_music(duration_s=3.0, num_tracks=2), timeout=120)
    assert song["state"] == "done", song
    for track in song["tracks"]:
        where = {name: run["worker"].split("@")[0] for name, run in track["stages"].items()}
        assert where == {"backbone": "gpu0", "superres": "gpu0", "decode": "gpu0", "export": "cpu0"}, where
    # its child imported the stage code before its first stage (not in the first export, which the ETA learns from)
    cpu_lines = [line for line in stack.worker_log(0).splitlines() if "worker=cpu0@" in line]
    first = next(i for i, line in enumerate(cpu_lines) if "event=stage_started" in line)
    assert any("event=stage_code_imported" in line for line in cpu_lines[:first]), cpu_lines[: first + 1]

    video, audio = face_video(tmp_path / "face.mp4", 3.0), tone(tmp_path / "voice.wav", 2.0)
    reply = upload(stack.client, video, audio)
    assert reply.status_code == 202, reply.get_json()
    clip = stack.wait_job(reply.get_json()["job_id"], timeout=180)
    assert clip["state"] == "done", clip
    assert _where(clip) == {"prepare": "cpu0", "lipsync": "gpu0", "mux": "cpu0"}
    assert stack.client.get(f"/api/v1/jobs/{clip['job_id']}/video.mp4", headers=stack.auth).status_code == 200
    # the status page and /readyz list both workers; the CPU-stage worker is never a place to route a track
    ready = stack.client.get("/readyz").get_json()
    assert {w["name"].split("@")[0] for w in ready["workers"]} == {"gpu0", "cpu0"}
    assert set(stack.redis.smembers(f"{stack.settings.key_prefix}:queues")) == {"gpu0"}


@pytest.mark.slow
def test_with_no_cpu_worker_live_the_cpu_stages_run_in_place(make_stack):
    stack = make_stack(ENCORE_WORKER_ROLE="gpu")  # `celery -A app worker -Q gpu0` alone
    stack.start_worker(0)
    song = stack.wait_job(stack.submit_music(duration_s=2.0), timeout=120)
    assert song["state"] == "done" and _where(song)["export"] == "gpu0", song
    assert _worker_of(stack, "cpu0@") is None


def _start_cpu_worker(stack) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(REPO / "worker_entrypoint.sh"), "0"],
        cwd=REPO,
        env={**os.environ, **stack.env, "ENCORE_WORKER_ROLE": "cpu"},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_a_cpu_worker_killed_mid_export_is_replaced_and_the_track_ends_done(make_stack):
    stack = make_stack(ENCORE_LEASE_S="4", ENCORE_WORKER_ROLE="gpu")
    stack.start_worker(0)
    cpu = _start_cpu_worker(stack)
    try:
        wait_until(lambda: _cpu_worker_idle(stack), 60, 0.1, "the CPU-stage worker")
        job_id = stack.submit_music(duration_s=300.0)  # five minutes of audio: an export of seconds

        def exporting() -> bool:
            track = stack.job(job_id)["tracks"][0]
            return track["state"] == "exporting" and track["worker"].startswith("cpu0@")

        wait_until(exporting, 300, 0.02, "the export on the CPU-stage worker")
        os.killpg(cpu.pid, signal.SIGKILL)
        cpu.wait(10)
        cpu = _start_cpu_worker(stack)
        record = stack.wait_job(job_id, timeout=240)
        track = record["tracks"][0]
        assert record["state"] == "done" and track["restarts"] == 1, track
        assert _where(record)["export"] == "cpu0" and track["stages"]["decode"]["worker"].startswith("gpu0@")
    finally:
        try:
            os.killpg(cpu.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        cpu.wait(10)
