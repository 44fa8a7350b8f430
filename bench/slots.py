"""In-flight batching of the backbone's decode (app/pipeline/music/slots.py): tracks per hour at 1..16 slots.

One queue of tracks (different seeds, prompt lengths and lengths, so they join and leave at different blocks)
goes through a SlotDecoder of 1, 2, 4, 8 and 16 slots (`slots_N`: linears once per row, the engine's own
bits; `batched_matmul_slots_N`: one batch-invariant matmul for all slots; `whole_frame_slots_N`: the batched mode's
whole frame, every slot over the whole cache whichever are occupied, on CUDA one graph replayed every frame, what
the engine runs there with ENCORE_ENGINE_GRAPHS=1), and one track after the other
as the backbone stage runs it without the engine (`one_after_the_other`: slots.decode_song, a decoder of one
slot per track, made anew for each), interleaved round by round in one run, so that drift on a noisy machine
hits every configuration; the medians are what to read, the ratios against one slot above all
(`cpu_vs_one_slot`: the same from this process's CPU time, steadier when other work loads the machine). Every
track must get the codes it gets alone: `codes_equal_alone` says, per configuration, whether it did (against
`one_after_the_other` for `slots_N`, against one batched_matmul slot for `batched_matmul_slots_N` and
`whole_frame_slots_N`).

    python bench/slots.py --tiny                   # the tiny profile's backbone: a few seconds
    python bench/slots.py --profile small          # bench/music_engines.py's sizes: small, medium
    python bench/slots.py --profile shaped         # the backbone bench/throughput.py --profile shaped runs
    python bench/slots.py --profile small --tracks 16 --frames 64 --repeats 3

JSON on stdout. The model has random weights (fixed seed) in fp32, on the CPU unless CUDA is there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from app.pipeline.music import megatron_backend as mb  # noqa: E402
from app.pipeline.music.slots import SlotDecoder, SongPlan, TrackRequest, decode_queue, decode_song  # noqa: E402
from app.pipeline.music.torch_engine import TorchCausalLM, from_megatron  # noqa: E402
from app.pipeline.profiles import MusicProfile, TransformerSpec, load_profile  # noqa: E402
from bench.common import machine_facts  # noqa: E402
from bench.music_engines import SIZES, spec_for  # noqa: E402

SLOT_COUNTS = (1, 2, 4, 8, 16)
PROFILE_BACKBONES = ("tiny", "shaped", "khala")  # sizes that are a profile's own backbone, not music_engines' shapes


def build_engine(
    size: str, profile: MusicProfile, max_len: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> TorchCausalLM:
    spec: TransformerSpec = profile.backbone if size in PROFILE_BACKBONES else spec_for(size, profile)
    model = mb.build_gpt(spec, causal=True, device=device, dtype=dtype)
    mb.init_random_weights(model, seed=0)
    return TorchCausalLM(from_megatron(model, spec))


def make_queue(profile: MusicProfile, tracks: int, frames: int) -> list[TrackRequest]:
    """Tracks of 24..40-token prompts and 75..125 % of `frames` frames, the sampler Khala uses (top-k 80)."""
    queue = []
    for index in range(tracks):
        limit = max(1, frames * (75 + (index * 37) % 51) // 100)
        plan = SongPlan.fixed_length(profile, limit, top_k=80)
        prompt = tuple(range(1 + index, 25 + index + (index * 5) % 17))
        queue.append(TrackRequest(prompt, plan, seed=1000 + index))
    return queue


def timed(run, device: torch.device) -> tuple[list[torch.Tensor], float, float]:
    """The run's codes, its wall seconds and this process's CPU seconds (less sensitive to other load)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started, cpu_started = time.perf_counter(), time.process_time()
    codes = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return codes, time.perf_counter() - started, time.process_time() - cpu_started


def same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def agreement(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    """The share of code positions equal in both (a track that came out another length counts what it shares):
    where a platform's kernels are not batch-invariant (bf16 on a GPU) codes can part after a near-tie."""
    equal = total = 0
    for a, b in zip(first, second, strict=True):
        shared = min(a.shape[-1], b.shape[-1])
        equal += int((a[..., :shared] == b[..., :shared]).sum())
        total += max(a.numel(), b.numel())
    return round(equal / max(total, 1), 6)


def open_decoder(lm: TorchCausalLM, slots: int, max_len: int, mode: str, check_every: int) -> SlotDecoder:
    """A decoder in one of MODES: `exact` (linears per row), `batched` (batched_matmul), `whole` (batched_matmul's
    whole frame: every slot over the whole cache; on CUDA a graph of it, captured once, replayed every frame)."""
    whole = mode == "whole"
    return SlotDecoder(  # on CUDA a whole frame's attention is the fused one (SlotDecoder's default there)
        lm,
        slots,
        max_len,
        check_every=check_every,
        batched_matmul=mode != "exact",
        whole_frame=whole,
        use_graphs=whole and lm.device.type == "cuda",
    )


MODES = {"exact": "slots", "batched": "batched_matmul_slots", "whole": "whole_frame_slots"}  # mode: runs' prefix


def step_ms(lm: TorchCausalLM, request: TrackRequest, slots: int, max_len: int, mode: str, device) -> float:
    """Milliseconds per decode step (one frame: two tokens for every slot) with `slots` slots all busy: the
    first block warms up (and on a GPU allocates, and captures a whole frame's graph), the next two are timed."""
    decoder = open_decoder(lm, slots, max_len, mode, 16)
    for _ in range(slots):
        decoder.admit(request)
    decoder.step_block()
    _, elapsed, _ = timed(lambda: [decoder.step_block(), decoder.step_block()], device)
    decoder.close()
    return round(1000 * elapsed / 32, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny profile's backbone (a few seconds)")
    parser.add_argument(
        "--profile",
        choices=sorted({*SIZES, "shaped"}),
        default="small",
        help="khala: the real backbone (GPU); shaped: the throughput bench's CPU backbone",
    )
    parser.add_argument("--slots", default=",".join(map(str, SLOT_COUNTS)), help="slot counts, comma-separated")
    parser.add_argument("--batched-only", action="store_true", help="skip the exact (per-row) configurations")
    parser.add_argument("--tracks", type=int, default=16)
    parser.add_argument("--frames", type=int, default=None, help="mean frames per track (default: 48, tiny 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-every", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: OpenMP's spinning barriers make 2 unsteady under load)",
    )
    parser.add_argument("--exact-only", action="store_true", help="skip the batched_matmul configurations")
    parser.add_argument(
        "--no-whole", action="store_true", help="skip the whole-frame configurations (CUDA graphs on a GPU)"
    )
    parser.add_argument(
        "--full-cache",
        action="store_true",
        help="slots sized for the model's full length, as a worker's engine sizes them (a whole frame reads it all)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = "tiny" if args.tiny else args.profile
    frames = args.frames or (64 if args.tiny else 48)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if size == "khala" and device.type != "cuda":
        parser.error("--profile khala needs a CUDA device")
    # shapes and token layout only; no files are read
    profile = load_profile(size if size in PROFILE_BACKBONES else "tiny", "/nonexistent")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    counts = [int(n) for n in args.slots.split(",") if n]
    queue = make_queue(profile, args.tracks, frames)
    max_len = max(request.positions for request in queue)
    lm = build_engine(size, profile, max_len, device, dtype)

    def one_after_the_other() -> list[torch.Tensor]:
        return [decode_song(lm, r.prompt_ids, r.plan, [r.seed], check_every=args.check_every)[0] for r in queue]

    cache = lm.model.shape.max_len if args.full_cache else max_len  # positions per slot of the decoders

    def through_slots(slots: int, mode: str):
        return lambda: decode_queue(open_decoder(lm, slots, cache, mode, args.check_every), queue)

    modes = [] if args.batched_only else ["exact"]
    modes += [] if args.exact_only else ["batched"] + ([] if args.no_whole else ["whole"])
    runs = {"one_after_the_other": one_after_the_other}
    runs |= {f"{MODES[mode]}_{n}": through_slots(n, mode) for mode in modes for n in counts}
    for mode in modes:
        timed(through_slots(2, mode), device)
    timed(lambda: decode_song(lm, queue[0].prompt_ids, queue[0].plan, [1]), device)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in runs}
    codes: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.repeats):  # interleaved: drift on a noisy machine hits every configuration alike
        for name, run in runs.items():
            codes[name], elapsed, cpu = timed(run, device)
            seconds[name].append(elapsed)
            cpu_seconds[name].append(cpu)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    cpu_median = {name: statistics.median(values) for name, values in cpu_seconds.items()}
    per_hour = {name: round(len(queue) * 3600 / value, 1) for name, value in median.items()}
    reference = codes["one_after_the_other"]
    batched_reference = codes.get(f"batched_matmul_slots_{counts[0]}", reference)
    one = f"batched_matmul_slots_{counts[0]}" if args.batched_only else f"slots_{counts[0]}"  # the ratios' base

    def anchor(name: str) -> list[torch.Tensor]:
        """What a run's codes must equal: the batched modes' one slot, or the engine's alone."""
        if name.startswith("whole") and f"whole_frame_slots_{counts[0]}" in codes:
            return codes[f"whole_frame_slots_{counts[0]}"]  # on CUDA its fused attention has bits of its own
        return batched_reference if name.startswith("batched") else reference

    steps = {f"{mode}_slots_{n}": step_ms(lm, queue[-1], n, cache, mode, device) for mode in modes for n in counts}
    most = counts[-1]
    # a whole frame's promise: a track's codes amid others are those it gets alone in an engine of as many slots
    whole_alone = None
    if "whole" in modes:
        alone = [decode_queue(open_decoder(lm, most, cache, "whole", args.check_every), [r])[0] for r in queue]
        whole_alone = same(codes[f"whole_frame_slots_{most}"], alone)
    song_frames = profile.frames_for(180.0)
    print(
        json.dumps(
            {
                "device": str(device),
                "size": size,
                "params_m": round(sum(p.numel() for p in lm.model.parameters()) / 1e6, 2),
                "machine": machine_facts(),
                "threads": torch.get_num_threads(),
                "load_average": [round(load, 2) for load in os.getloadavg()],
                "tracks": len(queue),
                "frames_per_track": [request.plan.limit for request in queue],
                "tracks_per_hour": per_hour,
                "dtype": str(dtype),
                "vs_one_slot": {name: round(median[one] / value, 2) for name, value in median.items()},
                "vs_one_after_the_other": {
                    name: round(median["one_after_the_other"] / value, 2) for name, value in median.items()
                },
                "cpu_vs_one_slot": {name: round(cpu_median[one] / value, 2) for name, value in cpu_median.items()},
                "codes_equal_alone": {name: same(got, anchor(name)) for name, got in codes.items()},
                "code_agreement_with_alone": {name: agreement(got, anchor(name)) for name, got in codes.items()},
                "batched_matmul_codes_equal_alone_engine": same(batched_reference, reference),
                # each track alone in a whole-frame decoder of the most slots: what its codes amid the others must be
                "whole_frame_codes_equal_alone_in_as_many_slots": whole_alone,
                "cache_positions_per_slot": cache,
                # issue 23's GPU targets: a step at 16 slots <= 2x the step at 1; 16 concurrent 3-minute songs
                "step_ms": steps,
                "step_ratio_to_one_slot": {
                    name: round(value / steps[name.rsplit("_", 1)[0] + "_" + str(counts[0])], 2)
                    for name, value in steps.items()
                },
                "projected_tracks_per_hour_3min_songs": {
                    name: round(int(name.rsplit("_", 1)[1]) * 3600 / (value / 1000 * song_frames), 1)
                    for name, value in steps.items()
                },
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
