"""Super-resolution and codec decoding across tracks: batch 1 (one track after the other, today's stage code)
against 2, 4 and 8 tracks stacked on the batch dimension (app/pipeline/music/stage_batching.py), same run.

Each round processes the same `--tracks` tracks (random coarse/fine codes, one seed each) once per mode, in a
rotated order (interleaved, so drift on a shared machine hits every mode); medians over `--rounds`. Batch 1 is
`superres.fill_fine` / `codec.decode_codes` per track; batch N is `fill_fine_tracks` / `decode_tracks` on
groups of N tracks. Exactness: every batched track's output against its batch-1 output (superres: codes equal,
torch.equal; codec: max |diff| of the float audio and of the 16-bit PCM the WAV would hold, in LSBs).
`superres_padded` also runs tracks of different lengths (padding masked), against their own batch-1 run.

    python bench/stage_batching.py --tiny            # the tests' tiny profile sizes
    python bench/stage_batching.py --size small      # a larger CPU shape (bench/music_engines.py's "small")
    --threads 1 on a shared machine: torch's threads spin-wait when another process holds a core.

Random weights, built in memory (no files read); JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from app.pipeline.control import StageControl
    from app.pipeline.music import codec, export, superres
    from app.pipeline.music import megatron_backend as mb
    from app.pipeline.music.stage_batching import decode_tracks, fill_fine_tracks
    from app.pipeline.music.torch_engine import TorchBidirectionalLM, from_megatron
    from app.pipeline.profiles import CodecSpec, MusicProfile, TransformerSpec, load_profile
    from bench.common import machine_facts

BATCHES = (1, 2, 4, 8)
PROMPT = list(range(1, 33))  # a 32-token super-resolution prompt (text ids of the tiny vocabulary)


def bench_profile(size: str) -> MusicProfile:
    """The tiny profile, or the tiny vocabulary with a larger superres transformer and codec ("small")."""
    profile = load_profile("tiny", "/nonexistent")  # sizes only: no file is read
    if size == "tiny":
        return profile
    spec = profile.superres
    return replace(
        profile,
        name="small",
        superres=TransformerSpec(
            num_layers=4,
            hidden_size=256,
            num_attention_heads=8,
            num_query_groups=2,
            ffn_hidden_size=704,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_sequence_length,
        ),
        codec=CodecSpec(codebook_size=profile.codebook_size, codebook_dim=64, decoder_channels=256),
    )


def build_models(profile: MusicProfile) -> tuple[TorchBidirectionalLM, codec.KhalaCodecDecoder]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = mb.build_gpt(profile.superres, causal=False, device="cpu", dtype=torch.float32)
        mb.init_random_weights(gpt, seed=1)
        lm = TorchBidirectionalLM(from_megatron(gpt, mb.model_spec(gpt)))
        decoder = codec.random_decoder(profile.codec, seed=2)
    return lm, decoder


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def superres_alone(lm, profile, coarse, seeds, prompts):
    return [
        superres.fill_fine(lm, c, profile=profile, seed=s, control=StageControl(), prompt_ids=p)
        for c, s, p in zip(coarse, seeds, prompts, strict=True)
    ]


def superres_batched(lm, profile, coarse, seeds, prompts, batch):
    out = []
    for i in range(0, len(coarse), batch):
        part = slice(i, i + batch)
        out += fill_fine_tracks(lm, coarse[part], profile=profile, seeds=seeds[part], prompts=prompts[part])
    return out


def decode_alone(decoder, fine):
    return [codec.decode_codes(decoder, codes) for codes in fine]


def decode_batched(decoder, fine, batch):
    out = []
    for i in range(0, len(fine), batch):
        out += decode_tracks(decoder, fine[i : i + batch], max_chunks=batch)
    return out


def codes_exactness(reference, batched) -> dict:
    equal = sum(torch.equal(a, b) for a, b in zip(reference, batched, strict=True))
    agree = sum(int((a == b).sum()) for a, b in zip(reference, batched, strict=True))
    total = sum(a.numel() for a in reference)
    return {"tracks_identical": f"{equal}/{len(reference)}", "codes_agreeing": round(agree / total, 6)}


def audio_exactness(reference, batched) -> dict:
    equal = sum(torch.equal(a, b) for a, b in zip(reference, batched, strict=True))
    diff = max(float((a - b).abs().max()) for a, b in zip(reference, batched, strict=True))
    pcm = [
        abs(export.to_pcm16(a).astype("int32") - export.to_pcm16(b).astype("int32"))
        for a, b in zip(reference, batched, strict=True)
    ]
    return {
        "tracks_identical": f"{equal}/{len(reference)}",
        "max_abs_diff": diff,
        "peak_abs": max(float(a.abs().max()) for a in reference),
        "pcm16_max_lsb_diff": max(int(d.max()) for d in pcm),
        "pcm16_samples_differing": round(sum(int((d > 0).sum()) for d in pcm) / sum(d.size for d in pcm), 7),
    }


def summarise(seconds: dict[str, list[float]], tracks: int, audio_s: float) -> dict:
    """Per mode: median and best time over the rounds, throughput at the median, and two ratios to batch 1
    (> 1: faster than one track after the other): of the medians, and the median of each round's own ratio
    (paired: a burst of load on a shared machine hits the modes of one round alike)."""
    base = seconds["batch_1"]
    section = {}
    for mode, values in seconds.items():
        median = statistics.median(values)
        section[mode] = {
            "median_s": round(median, 4),
            "min_s": round(min(values), 4),
            "tracks_per_hour": round(tracks * 3600 / median, 1),
            "audio_s_per_s": round(tracks * audio_s / median, 3),
            "ratio_to_batch_1": round(statistics.median(base) / median, 3),
            "paired_ratio_to_batch_1": round(statistics.median(b / v for b, v in zip(base, values, strict=True)), 3),
            "min_ratio_to_batch_1": round(min(base) / min(values), 3),
            "all_s": [round(v, 4) for v in values],
        }
    return section


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny profile (same as --size tiny)")
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--seconds", type=float, default=None, help="song length (default: tiny 10, small 4)")
    parser.add_argument("--tracks", type=int, default=8, help="tracks per round (a multiple of 8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--sections", default="superres,codec,superres_padded")
    args = parser.parse_args(argv)
    size = "tiny" if args.tiny else args.size
    if args.threads:
        torch.set_num_threads(args.threads)
    seconds_of_song = args.seconds or (10.0 if size == "tiny" else 4.0)
    profile = bench_profile(size)
    lm, decoder = build_models(profile)
    frames = profile.frames_for(seconds_of_song)
    audio_s = frames / profile.frames_per_second
    gen = torch.Generator().manual_seed(0)
    n = args.tracks
    coarse = [torch.randint(0, profile.codebook_size, (2, frames), generator=gen) for _ in range(n)]
    fine = [torch.randint(0, profile.codebook_size, (64, frames), generator=gen) for _ in range(n)]
    # mixed lengths (different songs on the queue): frames and prompt lengths vary by up to ~20 %
    mixed = [torch.randint(0, profile.codebook_size, (2, frames - (i * frames) // 40), generator=gen) for i in range(n)]
    mixed_prompts = [PROMPT[: 32 - 2 * (i % 4)] for i in range(n)]
    seeds = list(range(100, 100 + n))
    prompts = [PROMPT] * n
    sections = args.sections.split(",")
    result: dict = {
        "bench": "stage_batching",
        "size": size,
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "machine": machine_facts(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "song_s": round(audio_s, 3),
        "frames": frames,
        "tracks_per_round": n,
        "rounds": args.rounds,
        "superres_params_m": round(sum(p.numel() for p in lm.model.parameters()) / 1e6, 2),
        "codec_params_m": round(sum(p.numel() for p in decoder.parameters()) / 1e6, 2),
        "codec_chunks_per_track": len(
            codec.plan_chunks(frames, profile.codec.chunk_frames, profile.codec.overlap_frames)
        ),
    }

    runs: dict[str, dict] = {}
    if "superres" in sections:
        runs["superres"] = {
            "batch_1": lambda: superres_alone(lm, profile, coarse, seeds, prompts),
            **{
                f"batch_{b}": (lambda b=b: superres_batched(lm, profile, coarse, seeds, prompts, b))
                for b in BATCHES[1:]
            },
        }
    if "codec" in sections:
        runs["codec"] = {
            "batch_1": lambda: decode_alone(decoder, fine),
            **{f"batch_{b}": (lambda b=b: decode_batched(decoder, fine, b)) for b in BATCHES[1:]},
        }
    if "superres_padded" in sections:
        runs["superres_padded"] = {
            "batch_1": lambda: superres_alone(lm, profile, mixed, seeds, mixed_prompts),
            f"batch_{BATCHES[-1]}": lambda: superres_batched(lm, profile, mixed, seeds, mixed_prompts, BATCHES[-1]),
        }
    # warm-up: one short call of each code path (allocator, oneDNN kernels for batch 1 and batch 2)
    superres_alone(lm, profile, coarse[:1], seeds[:1], prompts[:1])
    superres_batched(lm, profile, coarse[:2], seeds[:2], prompts[:2], 2)
    decode_alone(decoder, fine[:1])
    decode_batched(decoder, fine[:2], 2)
    seconds: dict[str, dict[str, list[float]]] = {name: {mode: [] for mode in modes} for name, modes in runs.items()}
    outputs: dict[str, dict] = {name: {} for name in runs}
    for r in range(args.rounds):
        for name, modes in runs.items():
            order = list(modes)
            order = order[r % len(order) :] + order[: r % len(order)]  # rotate who goes first
            for mode in order:
                out, elapsed = timed(modes[mode])
                seconds[name][mode].append(elapsed)
                outputs[name].setdefault(mode, out)
    for name in runs:
        section = summarise(seconds[name], n, audio_s)
        exact = codes_exactness if name.startswith("superres") else audio_exactness
        reference = outputs[name]["batch_1"]
        for mode in section:
            if mode != "batch_1":
                section[mode]["exactness"] = exact(reference, outputs[name][mode])
        result[name] = section
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
