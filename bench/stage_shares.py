"""Where a song's "GPU" time goes, stage by stage, as a worker without the engine spends it (ENCORE_BACKBONE_SLOTS=1).

One song of 2 tracks (instrumental, "ambient", the length of `--song-s`, as bench/throughput.py submits them),
through the stage code the worker calls: the backbone for both tracks together (run_backbone_tracks, as
batched_backbone_work runs a song's tracks), then super-resolution and codec decoding per track (run_superres,
run_decode). The profile's models are the worker's (MusicModels, torch engine, keep_loaded, on the CPU), written to
models/<profile> on first use by bench/throughput.py's helper; loads and a warm-up song are left out. torch on one
thread, as the bench's "GPU" child. `--repeats` songs, medians per stage; shares of their sum. JSON on stdout.

    python bench/stage_shares.py [--profile shaped] [--song-s 10] [--repeats 3]
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
from bench.throughput import music_models  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from app.pipeline.control import StageControl
    from app.pipeline.music.stages import MusicModels, run_backbone_tracks, run_decode, run_superres
    from app.pipeline.profiles import load_profile

STAGES = ("backbone", "superres", "decode")
TRACKS = 2


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="shaped", choices=("tiny", "shaped"))
    parser.add_argument("--song-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
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
    median = {stage: statistics.median(run[stage] for run in runs) for stage in STAGES}
    total = sum(median.values())
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
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
