"""Where a song's "GPU" time goes, stage by stage, as a worker without the engine spends it (ENCORE_BACKBONE_SLOTS=1).

One song of 2 tracks (instrumental, "ambient", the length of `--song-s`, as bench/throughput.py submits them),
through the stage code the worker calls: the backbone for both tracks together (run_backbone_tracks, as
batched_backbone_work runs a song's tracks), then super-resolution and codec decoding per track (run_superres,
run_decode). The profile's models are the worker's (MusicModels, torch engine, keep_loaded, on the CPU), written to
models/<profile> on first use by bench/throughput.py's helper; loads and a warm-up song are left out. torch on one
thread, as the bench's "GPU" child. `--repeats` songs, medians per stage; shares of their sum.

Then the lip-sync stage of bench/throughput.py's video (its `--clip-s` clip, the same synthetic face and voice; the
profile's MuseTalk models, prepared once; the source cache warm, as for the bench's videos after its warm-up job):
`--repeats` runs, the median, and that median over a song's median GPU time (`lipsync.per_song`) beside the same
ratio on an H200 at real sizes (`lipsync.h200_per_song`, from two measured figures: run_lipsync at 64 frames/s,
bench/results/h200_gpu_lipsync_check.jsonl, and a 3-minute 2-track song's 36.3 GPU-seconds, DESIGN.md's probe).
It says how much the bench's lip-sync weighs against its songs, against what it weighs on the GPU. JSON on stdout.

    python bench/stage_shares.py [--profile shaped] [--song-s 10] [--clip-s 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import machine_facts  # noqa: E402
from bench.gpu_lipsync import FPS as CLIP_FPS  # noqa: E402  (the clip's rate, which a job without `fps` keeps)
from bench.throughput import music_models  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from app.pipeline.control import StageControl
    from app.pipeline.music.stages import MusicModels, run_backbone_tracks, run_decode, run_superres
    from app.pipeline.profiles import load_profile

STAGES = ("backbone", "superres", "decode")
TRACKS = 2
# An H200 at real sizes: run_lipsync at 64 frames/s (real-size MuseTalk, batch 32), and a 3-minute 2-track song's
# backbone 31.6 + superres 3.9 + codec 0.8 GPU-seconds (Khala sizes, CUDA graphs)
H200_LIPSYNC_FPS = 64.0
H200_SONG_GPU_S_PER_SONG_S = (31.6 + 3.9 + 0.8) / 180.0


def song(models: MusicModels, params: dict[str, Any], seed: int, work: Path) -> dict[str, float]:
    """Seconds per stage of one song: backbone for both tracks together, superres and decode summed over tracks."""
    control = StageControl()
    seeds = [seed + track for track in range(TRACKS)]
    coarse = [work / f"track{track}.coarse.pt" for track in range(TRACKS)]
    started = time.perf_counter()
    run_backbone_tracks(models, params, seeds, coarse, control)
    seconds = {"backbone": time.perf_counter() - started, "superres": 0.0, "decode": 0.0}
    for track in range(TRACKS):
        fine, wav = work / f"track{track}.fine.pt", work / f"track{track}.wav"
        started = time.perf_counter()
        run_superres(models, params, seeds[track], coarse[track], fine, control)
        seconds["superres"] += time.perf_counter() - started
        started = time.perf_counter()
        run_decode(models, fine, wav, control)
        seconds["decode"] += time.perf_counter() - started
    return seconds


def lipsync_seconds(profile_name: str, clip_s: float, repeats: int, work: Path) -> list[float]:
    """Seconds of `repeats` lip-sync stages on a `clip_s` clip (prepared once; one warm-up run fills the source
    cache and is left out)."""
    from app.pipeline.lipsync.source_cache import SourceCache
    from app.pipeline.lipsync.stages import LipsyncModels, run_lipsync_stage, run_prepare
    from app.pipeline.profiles import load_lipsync_profile
    from bench.gpu_lipsync import write_clip, write_voice
    from bench.throughput import lipsync_models

    video, audio = write_clip(work / "face.mp4", clip_s), write_voice(work / "voice.wav", clip_s)
    scratch, cache = work / "scratch", SourceCache(work / "sources", 2**30)
    scratch.mkdir()
    run_prepare(video, audio, CLIP_FPS, scratch, StageControl(), 120.0, cache=cache)
    models = LipsyncModels(load_lipsync_profile(profile_name, lipsync_models(profile_name)), "keep_loaded", "cpu")
    params = {"fps": CLIP_FPS, "extra_margin": models.profile.default_extra_margin}
    seconds = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        run_lipsync_stage(models, params, scratch, StageControl(), cache=cache)
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def h200_lipsync_per_song(clip_s: float, song_s: float) -> float:
    """A `clip_s` lip-sync's GPU time over a `song_s` song's on an H200 at real sizes (the measured figures above)."""
    return (clip_s * CLIP_FPS / H200_LIPSYNC_FPS) / (song_s * H200_SONG_GPU_S_PER_SONG_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="shaped", choices=("tiny", "shaped"))
    parser.add_argument("--song-s", type=float, default=10.0)
    parser.add_argument("--clip-s", type=float, default=2.0, help="the lip-sync clip (bench/throughput.py's)")
    parser.add_argument("--lipsync-profile", default=None, choices=("tiny", "shaped"), help="default: --profile's")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lipsync_profile = args.lipsync_profile or args.profile
    torch.set_num_threads(1)
    profile = load_profile(args.profile, music_models(args.profile))
    models = MusicModels(profile, "keep_loaded", device=torch.device("cpu"), engine="torch")
    params = {
        "mode": "instrumental",
        "tags": "ambient",
        "prompt": "",
        "lyrics": "",
        "duration_s": args.song_s,
        "temperature": 1.0,
        "top_k": profile.backbone_top_k,
    }
    runs = []
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        song(models, {**params, "duration_s": 1.0}, 0, Path(tmp))  # loads every model, warms every stage
        for repeat in range(args.repeats):
            runs.append(song(models, params, 100 * (repeat + 1), Path(tmp)))
        lipsync_runs = lipsync_seconds(lipsync_profile, args.clip_s, args.repeats, Path(tmp))
    median = {stage: statistics.median(run[stage] for run in runs) for stage in STAGES}
    total, lipsync_median = sum(median.values()), statistics.median(lipsync_runs)
    print(
        json.dumps(
            {
                "profile": args.profile,
                "song_s": args.song_s,
                "tracks": TRACKS,
                "frames": profile.frames_for(args.song_s),
                "repeats": args.repeats,
                "machine": machine_facts(),
                "torch_threads": torch.get_num_threads(),
                "seconds_median": {stage: round(value, 3) for stage, value in median.items()},
                "shares": {stage: round(value / total, 3) for stage, value in median.items()},
                "runs": [{stage: round(run[stage], 3) for stage in STAGES} for run in runs],
                "backbone": str(profile.backbone),
                "superres": str(profile.superres),
                "codec": str(profile.codec),
                "lipsync": {
                    "profile": lipsync_profile,
                    "clip_s": args.clip_s,
                    "seconds_median": round(lipsync_median, 3),
                    "runs": [round(value, 3) for value in lipsync_runs],
                    "per_song": round(lipsync_median / total, 3),
                    "h200_per_song": round(h200_lipsync_per_song(args.clip_s, args.song_s), 3),
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
