"""Backbone decode speed: plain-PyTorch engine vs Megatron-core's forward on the same weights, one run.

Both engines get the same random-weight Khala-shaped model (built by megatron_backend, converted once by
torch_engine.from_megatron) and generate the same coarse tokens with backbone.generate_coarse_tracks; the
Megatron engine is the in-run baseline, so the ratio is what to read (machines here are noisy). The torch
engine runs its device-side loop (a slot decoder of one slot per track, slots.decode_song) and, as
`torch_reference_loop`, the reference loop. The codes must come out identical (fp32) or the run reports it.
Also: two tracks in one decoder (two slots) on the torch engine against twice one track (the slots' per-row
products read the weights once per track; a CPU is compute-bound).

    python bench/music_engines.py [--size small|medium|khala] [--frames 64] [--repeats 3]

On CUDA the model runs in bf16 (identical codes are then not expected; `codes_equal` says what happened).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from app.pipeline.music import megatron_backend as mb  # noqa: E402
from app.pipeline.music.backbone import generate_coarse_tracks  # noqa: E402
from app.pipeline.control import StageControl  # noqa: E402
from app.pipeline.profiles import MusicProfile, TransformerSpec, load_profile  # noqa: E402
from app.pipeline.music.torch_engine import TorchCausalLM, from_megatron  # noqa: E402

SIZES = {  # (layers, hidden, heads, groups, ffn) with the tiny profile's vocabulary; "khala" is the real shape
    "small": (4, 256, 8, 2, 704),
    "medium": (12, 1024, 16, 4, 2816),
    "khala": None,  # the khala profile's backbone (GPU only)
}
PROMPT = list(range(1, 33))


def spec_for(size: str, profile: MusicProfile) -> TransformerSpec:
    if SIZES[size] is None:
        return profile.backbone
    layers, hidden, heads, groups, ffn = SIZES[size]
    return TransformerSpec(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        vocab_size=profile.backbone.vocab_size,
        max_sequence_length=4096,
    )


def timed_generation(
    lm, profile: MusicProfile, frames: int, device: torch.device, seeds: tuple[int, ...] = (1,), loop: str = "auto"
) -> tuple[list[torch.Tensor], float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    codes = generate_coarse_tracks(
        lm,
        PROMPT,
        profile=profile,
        num_frames=frames,
        temperature=1.0,
        top_k=50,
        seeds=list(seeds),
        control=StageControl(),
        loop=loop,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return codes, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # only the profile's shapes and token layout are used; no files are read
    profile = load_profile("khala" if args.size == "khala" else "tiny", "/nonexistent")
    spec = spec_for(args.size, profile)
    model = mb.build_gpt(spec, causal=True, device=device)
    mb.init_random_weights(model, seed=0)
    engines = {"megatron": mb.MegatronCausalLM(model), "torch": TorchCausalLM(from_megatron(model, spec))}
    seconds: dict[str, list[float]] = {
        name: [] for name in (*engines, "torch_reference_loop", "torch_2_tracks_batched")
    }
    codes = {}
    for lm in engines.values():
        timed_generation(lm, profile, 4, device)  # warm-up
    for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits all
        for name, lm in engines.items():
            codes[name], elapsed = timed_generation(lm, profile, args.frames, device)
            seconds[name].append(elapsed)
        codes["torch_reference_loop"], elapsed = timed_generation(
            engines["torch"], profile, args.frames, device, loop="reference"
        )
        seconds["torch_reference_loop"].append(elapsed)
        _, elapsed = timed_generation(engines["torch"], profile, args.frames, device, seeds=(1, 2))
        seconds["torch_2_tracks_batched"].append(elapsed)
    tokens = 2 * args.frames
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(
        json.dumps(
            {
                "device": str(device),
                "dtype": str(next(model.parameters()).dtype),
                "size": args.size,
                "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                "tokens": tokens,
                "tokens_per_s": {
                    name: round(tokens * (2 if "2_tracks" in name else 1) / value, 1) for name, value in median.items()
                },
                "speedup_torch_over_megatron": round(median["megatron"] / median["torch"], 2),
                "speedup_device_loop_over_reference_loop": round(median["torch_reference_loop"] / median["torch"], 2),
                "two_tracks_batched_vs_one_after_the_other": round(
                    2 * median["torch"] / median["torch_2_tracks_batched"], 2
                ),
                "codes_equal": bool(
                    torch.equal(codes["megatron"][0], codes["torch"][0])
                    and torch.equal(codes["torch"][0], codes["torch_reference_loop"][0])
                ),
                "seconds": seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
