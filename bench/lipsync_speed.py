"""Lip-sync frames per second around the model: run_lipsync vs the plain sequential loop, one run.

Baseline (in the same run, same models and inputs): every output frame's crop VAE-encoded, UNet, decode, then
blend and write in the same thread, batch after batch (run_lipsync before it kept source latents and moved
the blend and the sink to a thread). Case `cycle`: a short clip under longer audio (the avatar case: the
output ping-pongs over the source); case `straight`: as many output frames as source frames. Frames are
1280x720 with a ~300 px face box and go to a real ffmpeg H.264 writer. Prints JSON.

    python bench/lipsync_speed.py [--frames 96] [--source-frames 12] [--batch-size 8]

On a CPU the tiny models' convolutions dominate either way; the GPU numbers are what matter (on an H200
the model part ran at 208 fps, so per-frame CPU work and repeated encodes are a large share there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from app.pipeline.control import StageControl  # noqa: E402
from app.pipeline.lipsync.faces import crop_box  # noqa: E402
from app.pipeline.lipsync.frames import pingpong_index  # noqa: E402
from app.pipeline.lipsync.inference import SourceLatents, blend_mouth, generate_faces, run_lipsync  # noqa: E402
from app.pipeline.lipsync.musetalk import load_musetalk, write_tiny_musetalk  # noqa: E402
from app.pipeline.media.encode import VideoWriter  # noqa: E402
from app.pipeline.profiles import load_lipsync_profile  # noqa: E402

WIDTH, HEIGHT, BOX, MARGIN = 1280, 720, (490, 160, 790, 460), 10


def clip(count: int) -> list[np.ndarray]:
    from skimage import data

    face = cv2.resize(data.astronaut(), (600, 600))
    frames = []
    for i in range(count):
        frame = np.full((HEIGHT, WIDTH, 3), 80 + i, np.uint8)
        frame[60:660, 340 + i : 940 + i] = face
        frames.append(frame)
    return frames


def sequential(models, frames, features, num_frames: int, batch_size: int, sink) -> None:
    """The loop without kept latents or a blend thread (the in-run baseline)."""
    encode = SourceLatents(models, keep=False)
    for start in range(0, num_frames, batch_size):
        stop = min(start + batch_size, num_frames)
        sources = [pingpong_index(i, len(frames)) for i in range(start, stop)]
        originals = [frames[s] for s in sources]
        regions = [crop_box(BOX, frame.shape, MARGIN) for frame in originals]
        faces = generate_faces(models, encode(sources, originals, regions), features[start:stop])
        for frame, face, region in zip(originals, faces, regions, strict=True):
            sink(blend_mouth(frame, face, region))


def measure(work, out: Path) -> float:
    with VideoWriter(out, width=WIDTH, height=HEIGHT, fps=25) as writer:
        started = time.perf_counter()
        work(writer.write)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=96)
    parser.add_argument("--source-frames", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scratch = Path(tempfile.mkdtemp())
    profile = load_lipsync_profile("tiny", scratch / "lipsync-tiny")
    write_tiny_musetalk(profile, seed=0)
    models = load_musetalk(profile, device)
    config = models.whisper.config
    features = torch.randn(args.frames, 10 * (config.encoder_layers + 1), config.d_model, dtype=models.dtype)
    results = {"device": device, "frames": args.frames, "batch_size": args.batch_size}
    for case, sources in (("cycle", args.source_frames), ("straight", args.frames)):
        frames = clip(sources)
        boxes = [BOX] * sources
        run_lipsync(
            models,
            frames,
            boxes,
            features,
            num_frames=args.batch_size,
            batch_size=args.batch_size,
            extra_margin=MARGIN,
            sink=lambda f: None,
            control=StageControl(),
        )  # warm-up
        baselines, currents = [], []

        def baseline_run(sink, frames=frames):
            return sequential(models, frames, features, args.frames, args.batch_size, sink)

        def current_run(sink, frames=frames, boxes=boxes):
            return run_lipsync(
                models,
                frames,
                boxes,
                features,
                num_frames=args.frames,
                batch_size=args.batch_size,
                extra_margin=MARGIN,
                sink=sink,
                control=StageControl(),
            )

        for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits both
            baselines.append(measure(baseline_run, scratch / f"{case}_baseline.mp4"))
            currents.append(measure(current_run, scratch / f"{case}_current.mp4"))
        baseline, current = statistics.median(baselines), statistics.median(currents)
        results[case] = {
            "source_frames": sources,
            "baseline_fps": round(args.frames / baseline, 1),
            "run_lipsync_fps": round(args.frames / current, 1),
            "speedup": round(baseline / current, 2),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
