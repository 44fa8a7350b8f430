"""Lip-sync on one GPU (issue 13): where a job's time goes, the fast path against today's, end to end.

ONE script for one device call (about 5 minutes on an H200 at MuseTalk v1.5's sizes, random weights),
printing JSON lines, one per section; each section runs in its own child process with its own time limit:
  bare      the in-run baseline: the UNet step + VAE decode alone on random latents, frames/s at the batch size
  phases    per-phase seconds per frame of a sequential, synchronised loop over the first batches, for each
            path (reference: OpenCV crops and blend on the CPU; device: tensor ops on the GPU): read frames,
            crops + VAE encode, UNet, VAE decode, blend, copy back, encode/write; plus whisper features
            for the whole clip, decode of the video and face finding (1 thread and the default)
  stage     the three stages as the worker runs them (run_prepare, run_lipsync_stage, run_mux) on a
            1280x720 25 fps face video of --seconds (60): frames/s of the lipsync stage per path, the
            encoder that ran, peak GPU memory at a third of the clip and at all of it (flat in length)
  cached    the same two stages again on the same video with the source cache warm (the avatar case)
  parity    the tiny models on the GPU: device path vs reference path from the same latents (within 2
            levels) and end to end (the test suite's bounds), GPU vs CPU
  job       upload -> MP4 through the Flask app and a real prefork Celery worker: a warm-up job on another
            video (model load, untimed), a job on the clip, then a second job on the same video with new audio
The last line is {"summary": {"device", "lipsync_fps", "bare_fps", "ratio_to_bare", "job_60s_s",
"job_60s_cached_s", ...}}. Ratios to the bare rate are what to read.

    python bench/gpu_lipsync.py [--tiny] [--seconds 60] [--batch-size N] [--sections bare,phases,...]
`--tiny` runs every section on a CPU at the tiny profile's sizes (the test suite runs it); its output is noise.
The device machine lacks some packages and tools: bench/device_carry.sh lists and gathers them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SECTIONS = ("bare", "phases", "stage", "cached", "parity", "job")
LIMITS_S = {"bare": 90, "phases": 120, "stage": 180, "cached": 120, "parity": 60, "job": 240}
WIDTH, HEIGHT, FPS, MARGIN = 1280, 720, 25.0, 10


def _torch():
    import torch

    return torch


def _device() -> str:
    return "cuda" if _torch().cuda.is_available() else "cpu"


def _sync() -> None:
    torch = _torch()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profile(args, root: Path):
    """The lip-sync profile whose random-weight files the sections load: tiny, or MuseTalk's real sizes."""
    from app.pipeline.lipsync.musetalk import write_random_musetalk
    from app.pipeline.profiles import load_lipsync_profile

    name = "tiny" if args.tiny else "musetalk"
    profile = load_lipsync_profile(name, root / f"lipsync-{name}")
    if not profile.unet_path.exists():
        write_random_musetalk(
            profile, seed=7, real_size=not args.tiny, dtype=_torch().float16 if not args.tiny else _torch().float32
        )
    return profile


def _models(args, root: Path, device: str | None = None):
    from app.pipeline.lipsync.stages import LipsyncModels

    return LipsyncModels(_profile(args, root), "keep_loaded", device=device or _device())


def _batch(args, models) -> int:
    return args.batch_size or models.batch_size()


# --- media ---------------------------------------------------------------------------------------------


def face_frame(i: int) -> np.ndarray:
    """Frame i of the clip: the astronaut's face (scikit-image's photo, 400 px) drifting over a backdrop."""
    import cv2
    from skimage import data

    face = getattr(face_frame, "face", None)
    if face is None:
        face = face_frame.face = cv2.resize(data.astronaut(), (400, 400), interpolation=cv2.INTER_AREA)
    frame = np.full((HEIGHT, WIDTH, 3), 60, np.uint8)
    frame[:, :, 2] = 90 + (i % 50)
    dx, dy = int(40 * np.sin(i / 40)), int(12 * np.sin(i / 23))
    frame[150 + dy : 550 + dy, 440 + dx : 840 + dx] = face
    return frame


def write_clip(path: Path, seconds: float, first: int = 0) -> Path:
    from app.pipeline.media.encode import VideoWriter

    with VideoWriter(path, width=WIDTH, height=HEIGHT, fps=FPS) as writer:
        for i in range(first, first + int(seconds * FPS)):
            writer.write(face_frame(i))
    return path


def write_voice(path: Path, seconds: float, seed: int = 0) -> Path:
    """A 16 kHz mono WAV of a gliding tone with noise bursts (speech-like energy changes)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    signal = envelope * (0.3 * np.sin(2 * np.pi * (180 + 60 * np.sin(t)) * t) + 0.05 * rng.standard_normal(t.size))
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((np.clip(signal, -1, 1) * 32767).astype(np.int16).tobytes())
    return path


def _media(args, root: Path) -> tuple[Path, Path]:
    video, audio = root / "face.mp4", root / "voice.wav"
    if not video.exists():
        write_clip(video, args.seconds)
        write_voice(audio, args.seconds)
    return video, audio


def _root(args) -> Path:
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    return root


# --- sections ------------------------------------------------------------------------------------------


def section_bare(args) -> dict:
    """UNet + VAE decode alone on random inputs: the rate nothing around the model can beat."""
    torch = _torch()
    holder = _models(args, _root(args))
    models, batch = holder.musetalk(), _batch(args, holder)
    latents = torch.randn(
        batch, 8, models.crop_size // 8, models.crop_size // 8, device=models.device, dtype=models.dtype
    )
    prompts = torch.randn(batch, 10 * models.audio_layers, models.audio_dim, device=models.device, dtype=models.dtype)
    from app.pipeline.lipsync.inference import redraw_faces

    rounds = 3 if args.tiny else 20
    with torch.inference_mode():
        redraw_faces(models, latents, prompts)
        _sync()
        started = time.perf_counter()
        for _ in range(rounds):
            redraw_faces(models, latents, prompts)
        _sync()
    seconds = time.perf_counter() - started
    return {
        "device": _device_name(),
        "batch_size": batch,
        "dtype": str(models.dtype).replace("torch.", ""),
        "bare_fps": round(rounds * batch / seconds, 1),
        "unet_params_m": round(sum(p.numel() for p in models.unet.parameters()) / 1e6),
    }


def _device_name() -> str:
    torch = _torch()
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def section_phases(args) -> dict:
    """Seconds per output frame of each phase in a sequential loop with a sync after every phase."""
    torch = _torch()
    from app.pipeline.lipsync import faces, inference
    from app.pipeline.media.decode import decode_frames
    from app.pipeline.media.encode import VideoWriter

    root = _root(args)
    video, audio = _media(args, root)
    holder = _models(args, root)
    models, batch = holder.musetalk(), _batch(args, holder)
    out: dict = {"batch_size": batch, "unit": "ms per output frame"}
    started = time.perf_counter()
    frames = decode_frames(video, root / "phases.u8")
    out["decode_video_ms_per_frame"] = round((time.perf_counter() - started) / len(frames) * 1000, 3)
    sample = [frames[i] for i in range(min(len(frames), 100))]
    for threads in sorted({1, faces.default_threads()}):
        started = time.perf_counter()
        track = faces.find_faces(sample, threads=threads)
        out[f"faces_{threads}_threads_ms_per_frame"] = round((time.perf_counter() - started) / len(sample) * 1000, 3)
    out["faces_method"] = track.method
    started = time.perf_counter()
    windows = inference.audio_windows(models, audio, fps=FPS, num_frames=len(frames), padding_left=2, padding_right=2)
    _sync()
    out["whisper_ms_per_frame"] = round((time.perf_counter() - started) / len(frames) * 1000, 3)
    count = min(len(frames), batch * (4 if args.tiny else 8))
    boxes = [track.boxes[i % len(track.boxes)] for i in range(count)]
    landmarks = None if track.landmarks is None else [track.landmarks[i % len(track.boxes)] for i in range(count)]
    with torch.inference_mode():
        for path in ("reference", "device"):
            spent = {
                name: 0.0 for name in ("read", "crops_encode", "unet", "vae_decode", "blend", "copy_back", "write")
            }
            with VideoWriter(root / f"phases-{path}.mp4", width=frames.width, height=frames.height, fps=FPS) as sink:
                for start in range(0, count, batch):  # the first batch is a warm-up, not counted
                    _phase_batch(
                        models,
                        frames,
                        boxes,
                        landmarks,
                        windows,
                        start,
                        min(start + batch, count),
                        path,
                        spent if start else dict.fromkeys(spent, 0.0),
                        sink,
                    )
            timed = count - batch
            out[path] = {name: round(value / max(timed, 1) * 1000, 3) for name, value in spent.items()}
            out[path]["total_ms_per_frame"] = round(sum(spent.values()) / max(timed, 1) * 1000, 3)
    frames.close()
    return out


def _phase_batch(models, frames, boxes, landmarks, windows, start, stop, path, spent, sink) -> None:
    torch = _torch()
    from app.pipeline.lipsync import inference
    from app.pipeline.lipsync.faces import crop_box

    def timed(name, work):
        began = time.perf_counter()
        result = work()
        _sync()
        spent[name] += time.perf_counter() - began
        return result

    originals = timed("read", lambda: [np.asarray(frames[i]) for i in range(start, stop)])
    regions = [crop_box(boxes[i], originals[0].shape, MARGIN) for i in range(start, stop)]
    masks = [
        inference.mouth_mask(r[3] - r[1], r[2] - r[0]) if landmarks is None else inference.jaw_mask(landmarks[i], r)
        for i, r in zip(range(start, stop), regions, strict=True)
    ]
    prompts = windows[start:stop]
    if path == "reference":
        latents = timed(
            "crops_encode",
            lambda: inference.SourceLatents(models, keep=False)(list(range(start, stop)), originals, regions),
        )
    else:
        on_device = timed("read", lambda: torch.from_numpy(np.stack(originals)).to(models.device))
        latents = timed(
            "crops_encode",
            lambda: inference.encode_pixels(models, inference.device_crops(on_device, regions, models.crop_size)),
        )
    audio = prompts.to(models.device, models.dtype) + models.positional_encoding(prompts.shape[1])
    timestep = torch.tensor([0], device=models.device)
    predicted = timed("unet", lambda: models.unet(latents, timestep, encoder_hidden_states=audio).sample)
    images = timed(
        "vae_decode",
        lambda: (
            ((models.vae.decode(predicted / models.scaling_factor).sample.float() / 2 + 0.5).clamp(0, 1) * 255)
            .round()
            .to(torch.uint8)
        ),
    )
    if path == "reference":
        faces = timed("copy_back", lambda: images.permute(0, 2, 3, 1).cpu().numpy())
        done = timed(
            "blend",
            lambda: [
                inference.blend_mouth(f, c, r, m) for f, c, r, m in zip(originals, faces, regions, masks, strict=True)
            ],
        )
    else:
        blended = timed("blend", lambda: inference.blend_on_device(on_device, images, regions, masks))
        done = timed("copy_back", lambda: list(blended.cpu().numpy()))
    timed("write", lambda: [sink.write(frame) for frame in done])


def _stage_run(args, root: Path, holder, scratch: Path, path: str, cache=None) -> dict:
    """prepare, lipsync and mux as the worker runs them; seconds of each and the lipsync stage's rate."""
    torch = _torch()
    from app.pipeline.control import StageControl
    from app.pipeline.lipsync import faces, stages

    video, audio = _media(args, root)
    scratch.mkdir(parents=True, exist_ok=True)
    params = {"fps": FPS, "extra_margin": MARGIN, "batch_size": _batch(args, holder)}
    times: dict = {"path": path}
    started = time.perf_counter()
    prepared = stages.run_prepare(
        video, audio, FPS, scratch, StageControl(), 600, cache=cache, face_threads=faces.default_threads()
    )
    times["prepare_s"] = round(time.perf_counter() - started, 2)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    info = stages.run_lipsync_stage(holder, params, scratch, StageControl(), path=path, cache=cache)
    _sync()
    times["lipsync_s"] = round(time.perf_counter() - started, 2)
    times["lipsync_fps"] = round(info["frames_generated"] / times["lipsync_s"], 1)
    started = time.perf_counter()
    stages.run_mux(scratch, audio, scratch / "out.mp4", StageControl(), 600)
    times["mux_s"] = round(time.perf_counter() - started, 2)
    times["frames"] = info["frames_generated"]
    times["encoder"], times["faces"], times["cache"] = (
        info["encoder"],
        prepared["faces"],
        (prepared["cache"], info["cache"]),
    )
    if torch.cuda.is_available():
        times["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return times


def section_stage(args) -> dict:
    root = _root(args)
    holder = _models(args, root)
    if not args.tiny:
        holder.warm_up()
    out = {}
    for path in ("reference", "device"):
        out[path] = _stage_run(args, root, holder, root / f"stage-{path}", path)
    third = argparse.Namespace(**{**vars(args), "seconds": max(1.0, args.seconds / 3)})
    short_root = root / "third"
    short_root.mkdir(exist_ok=True)
    out["device_third_of_the_clip"] = _stage_run(third, short_root, holder, short_root / "stage", "device")
    out["ratio_device_to_reference"] = round(out["device"]["lipsync_fps"] / out["reference"]["lipsync_fps"], 3)
    return out


def section_cached(args) -> dict:
    from app.pipeline.lipsync.source_cache import SourceCache

    root = _root(args)
    holder = _models(args, root)
    holder.warm_up()
    cache = SourceCache(root / "source-cache", 4 << 30)
    first = _stage_run(args, root, holder, root / "cached-1", "device", cache)
    second = _stage_run(args, root, holder, root / "cached-2", "device", cache)
    return {
        "first": first,
        "second": second,
        "prepare_ratio": round(second["prepare_s"] / max(first["prepare_s"], 1e-6), 3),
        "lipsync_ratio": round(second["lipsync_s"] / max(first["lipsync_s"], 1e-6), 3),
    }


def section_parity(args) -> dict:
    """The tiny models on this device: the device path from the reference path's latents (<= 2 levels),
    and end to end against the reference on this device and on the CPU."""
    from app.pipeline.control import StageControl
    from app.pipeline.lipsync import faces, inference
    from app.pipeline.lipsync.faces import crop_box

    torch = _torch()
    tiny = argparse.Namespace(**{**vars(args), "tiny": True})
    root = _root(args) / "parity"
    root.mkdir(exist_ok=True)
    frames = [face_frame(i)[100:600, 340:940].copy() for i in range(8)]
    track = faces.find_faces(frames)
    out = {}
    for device in sorted({_device(), "cpu"}):
        models = _models(tiny, root, device).musetalk()
        prompts = torch.randn(
            11, 10 * models.audio_layers, models.audio_dim, generator=torch.Generator().manual_seed(3)
        )
        results = {}
        kept = inference.SourceLatents(models, keep=True)
        for path, latents in (("reference", kept), ("device_same_latents", None), ("device", None)):
            if path == "device_same_latents":
                latents = inference.SourceLatents(models, keep=True, kept=dict(kept.kept))
            frames_out: list = []
            inference.run_lipsync(
                models,
                frames,
                track.boxes,
                prompts,
                num_frames=11,
                batch_size=4,
                extra_margin=MARGIN,
                sink=frames_out.append,
                control=StageControl(),
                landmarks=track.landmarks,
                path=path.split("_")[0],
                latents=latents,
            )
            results[path] = frames_out
        out[device] = results
    summary = {}
    shown = [0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5]
    for device, results in out.items():
        for name in ("device_same_latents", "device"):
            diffs = []
            for i, (a, b) in enumerate(zip(results[name], results["reference"], strict=True)):
                x1, y1, x2, y2 = crop_box(track.boxes[shown[i]], frames[0].shape, MARGIN)
                diffs.append(np.abs(a[y1:y2, x1:x2].astype(int) - b[y1:y2, x1:x2]))
            stacked = np.concatenate([d.ravel() for d in diffs])
            summary[f"{device}_{name}_vs_reference"] = {
                "mean": round(float(stacked.mean()), 3),
                "max": int(stacked.max()),
                "share_over_32": round(float((stacked > 32).mean()), 4),
            }
    if "cuda" in out:
        gpu_vs_cpu = np.abs(np.stack(out["cuda"]["device"]).astype(int) - np.stack(out["cpu"]["reference"]))
        summary["cuda_device_vs_cpu_reference"] = {
            "mean": round(float(gpu_vs_cpu.mean()), 3),
            "max": int(gpu_vs_cpu.max()),
        }
    same = [v for k, v in summary.items() if k.endswith("device_same_latents_vs_reference")]
    summary["same_latents_within_2_levels"] = all(v["max"] <= 2 for v in same)
    return summary


def section_job(args) -> dict:
    """Upload -> MP4 through the web app and a real worker: a warm-up job on another video (loads the models
    and the kernels, untimed), then a job on the clip, then one on the same video with other audio (the
    source cache makes it the avatar case)."""
    from bench.common import start_redis

    root = _root(args) / "job"
    root.mkdir(exist_ok=True)
    profile = _profile(args, _root(args))
    redis_proc, redis_url = start_redis(root)
    video, audio = _media(args, _root(args))
    warm_video = write_clip(root / "warm.mp4", 1.2, first=1000)
    warm_audio = write_voice(root / "warm.wav", 1.2, seed=2)
    second_audio = write_voice(root / "voice2.wav", args.seconds, seed=1)
    env = {
        "REDIS_URL": redis_url,
        "ENCORE_LIPSYNC_PROFILE": profile.name,
        "ENCORE_LIPSYNC_MODEL_DIR": str(profile.model_dir),
        "ENCORE_ARTIFACT_DIR": str(root / "artifacts"),
        "ENCORE_LOG_DIR": str(root / "logs"),
        "ENCORE_UPLOAD_DIR": str(root / "uploads"),
        "ENCORE_WORKER_CACHE_DIR": str(root / "cache"),
        "ENCORE_HEARTBEAT_S": "0.5",
        "ENCORE_PYTHON": sys.executable,
        "ENCORE_PRELOAD": "0",
        "ENCORE_MAX_AUDIO_S": "900",
        "ENCORE_MAX_VIDEO_MB": "1000",
        "ENCORE_MAX_AUDIO_MB": "200",
        "ENCORE_MIN_VIDEO_S": "1",
    }
    os.environ.update(env)
    from app.core.config import load_settings
    from app.control.services import build_services
    from app.web import create_app

    settings = load_settings()
    svc = build_services(settings)  # the worker registry: when the worker is up
    client = create_app(settings).test_client()
    worker = subprocess.Popen(
        ["bash", str(REPO / "worker_entrypoint.sh"), "0"],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + LIMITS_S["job"] * (3 if args.tiny else 1) - 30

    def run_job(face: Path, sound: Path) -> dict:
        started = time.monotonic()
        with open(face, "rb") as v, open(sound, "rb") as a:
            reply = client.post(
                "/api/v1/lipsync",
                data={"video": (v, "face.mp4"), "audio": (a, "voice.wav"), "fps": str(FPS)},
                content_type="multipart/form-data",
            )
        if reply.status_code != 202:
            return {"error": f"submit answered {reply.status_code}", "body": reply.get_json()}
        job_id = reply.get_json()["job_id"]
        while True:
            record = client.get(f"/api/v1/jobs/{job_id}").get_json()
            if record["state"] in ("done", "failed", "canceled") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        track = record["tracks"][0]
        return {
            "state": record["state"],
            "error": track.get("error"),
            "seconds": round(time.monotonic() - started, 2),
            "stages": {
                name: {
                    "duration_s": stage.get("duration_s"),
                    "cache": stage.get("info", {}).get("cache"),
                    "encoder": stage.get("info", {}).get("encoder"),
                    "faces": stage.get("info", {}).get("faces"),
                }
                for name, stage in track["stages"].items()
            },
        }

    try:
        while not any(w.get("status") == "idle" for w in svc.workers.workers()):
            if time.monotonic() > deadline or worker.poll() is not None:
                log = root / "logs" / "worker_0.log"
                return {"error": "worker did not come up", "log": log.read_text()[-2000:] if log.exists() else ""}
            time.sleep(0.2)
        warm = run_job(warm_video, warm_audio)
        first, second = run_job(video, audio), run_job(video, second_audio)
        return {"clip_s": args.seconds, "warm_up": warm, "first": first, "second": second}
    finally:
        os.killpg(worker.pid, 9)
        redis_proc.terminate()


# --- driver ------------------------------------------------------------------------------------------


def _run_section(name: str, argv: list[str], limit: float) -> dict:
    from bench.common import run_section

    return run_section(__file__, name, argv, limit, REPO)


def _summary(results: dict) -> dict:
    bare = results.get("bare", {}).get("bare_fps")
    device = results.get("stage", {}).get("device", {})
    job = results.get("job", {})
    fps = device.get("lipsync_fps")
    return {
        "device": results.get("bare", {}).get("device"),
        "lipsync_fps": fps,
        "bare_fps": bare,
        "ratio_to_bare": round(fps / bare, 3) if fps and bare else None,
        "reference_fps": results.get("stage", {}).get("reference", {}).get("lipsync_fps"),
        "encoder": device.get("encoder"),
        "faces": device.get("faces"),
        "job_60s_s": job.get("first", {}).get("seconds"),
        "job_60s_cached_s": job.get("second", {}).get("seconds"),
        "clip_s": job.get("clip_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny profile sizes (CPU smoke run; output is noise)")
    parser.add_argument("--seconds", type=float, default=None, help="clip length (default 60; tiny 1.2)")
    parser.add_argument("--batch-size", type=int, default=0, help="frames per UNet batch (default: the device's)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--workdir", default=None, help="models and media, shared by the sections")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seconds = args.seconds or (1.2 if args.tiny else 60.0)
    if args.section:
        print(json.dumps(globals()[f"section_{args.section}"](args), default=str), flush=True)
        return
    workdir = args.workdir or tempfile.mkdtemp(prefix="encore-gpu-lipsync-")
    argv = [
        *(["--tiny"] if args.tiny else []),
        "--seconds",
        str(args.seconds),
        "--workdir",
        workdir,
        *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
    ]
    results = {}
    for name in filter(None, args.sections.split(",")):
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        results[name] = _run_section(name, argv, LIMITS_S[name] * (3 if args.tiny else 1))
        print(json.dumps({name: results[name]}, default=str), flush=True)
    print(json.dumps({"summary": _summary(results)}), flush=True)


if __name__ == "__main__":
    main()
