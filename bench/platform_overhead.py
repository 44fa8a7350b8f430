"""What the job platform costs on top of the model work, measured in one run (prints JSON).

Baseline: the four music stage functions called in this process with warm models.
Platform: the same song submitted over HTTP to the Flask app, through Redis and a real prefork Celery
worker (keep_loaded, models preloaded and warmed by one job first), until the record says `done`.
The ratio platform/baseline and the absolute overhead per job are reported; machines here are noisy, so
each side is run `--repeats` times and the medians are compared.

    python bench/platform_overhead.py [--duration-s 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import start_redis  # noqa: E402

PARAMS = {"mode": "instrumental", "tags": "ambient", "prompt": "", "lyrics": "", "temperature": 1.0, "top_k": 80}


def baseline(models_dir: Path, duration_s: float, repeats: int) -> list[float]:
    import torch
    from app.pipeline.music import stages as music
    from app.pipeline.control import StageControl
    from app.pipeline.profiles import load_profile

    torch.set_num_threads(1)
    models = music.MusicModels(load_profile("tiny", models_dir), "keep_loaded")
    params = {**PARAMS, "duration_s": duration_s}
    work = Path(tempfile.mkdtemp())
    control = StageControl()

    def one_job() -> float:
        started = time.perf_counter()
        music.run_backbone(models, params, 1, work / "c.pt", control)
        music.run_superres(models, params, 1, work / "c.pt", work / "f.pt", control)
        music.run_decode(models, work / "f.pt", work / "a.wav", control)
        music.run_export(work / "a.wav", work / "a.mp3", work / "a.json", {}, control)
        return time.perf_counter() - started

    one_job()  # warm-up: loads every model
    return [one_job() for _ in range(repeats)]


def platform(models_dir: Path, redis_url: str, root: Path, duration_s: float, repeats: int) -> list[float]:
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "ENCORE_MODEL_DIR": str(models_dir),
        "ENCORE_ARTIFACT_DIR": str(root / "artifacts"),
        "ENCORE_LOG_DIR": str(root / "logs"),
        "ENCORE_TORCH_THREADS": "1",
        "ENCORE_PRELOAD": "1",
        "ENCORE_HEARTBEAT_S": "0.5",
    }
    os.environ.update(env)
    from app.core.config import load_settings
    from app.web import create_app

    client = create_app(load_settings()).test_client()
    worker = subprocess.Popen(
        ["bash", str(REPO / "worker_entrypoint.sh"), "0"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while not any(w["status"] == "idle" for w in client.get("/api/v1/status").get_json()["workers"]):
            if worker.poll() is not None:
                raise SystemExit("worker exited; see " + str(root / "logs"))
            time.sleep(0.1)

        def one_job() -> float:
            started = time.perf_counter()
            reply = client.post(
                "/api/v1/music",
                json={"mode": "instrumental", "tags": "ambient", "duration_s": duration_s, "num_tracks": 1, "seed": 1},
            )
            job_id = reply.get_json()["job_id"]
            while (state := client.get(f"/api/v1/jobs/{job_id}").get_json()["state"]) in ("queued", "running"):
                time.sleep(0.005)
            if state != "done":
                raise SystemExit(f"job ended {state}")
            return time.perf_counter() - started

        one_job()  # warm-up
        return [one_job() for _ in range(repeats)]
    finally:
        os.killpg(worker.pid, 9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="encore-bench-"))
    redis_proc, redis_url = start_redis(root)
    try:
        models_dir = root / "models"
        subprocess.run(
            [sys.executable, "-m", "app.pipeline.tiny", "--out", str(models_dir)],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        direct = baseline(models_dir, args.duration_s, args.repeats)
        served = platform(models_dir, redis_url, root, args.duration_s, args.repeats)
    finally:
        redis_proc.terminate()
    direct_s, served_s = statistics.median(direct), statistics.median(served)
    print(
        json.dumps(
            {
                "benchmark": "platform_overhead",
                "profile": "tiny",
                "song_seconds": args.duration_s,
                "baseline_in_process_s": [round(x, 3) for x in direct],
                "through_platform_s": [round(x, 3) for x in served],
                "median_ratio_platform_to_baseline": round(served_s / direct_s, 3),
                "median_overhead_s_per_job": round(served_s - direct_s, 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
