"""The backbone's decode without the engine, a slot decoder of one slot per track (slots.decode_song), against
the reference loop (backbone.py), tiny profile, fp32.

Same codes, bitwise, one track and several, fixed-length and ended by the model, on the plain-PyTorch engine and
against Megatron's; the slot decoder's frame step traces with torch.compile(fullgraph=True), which refuses host
syncs and generator arguments, i.e. it is what a CUDA graph can capture.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from app.pipeline.music.backbone import generate_coarse_tracks
from app.pipeline.control import Canceled, StageControl
from app.pipeline.music.slots import SlotDecoder, SongPlan, TrackRequest, decode_song
from app.pipeline.music.stages import load_engine
from app.pipeline.music.torch_engine import TorchCausalLM

torch.set_num_threads(2)
PROMPT = [1, 42, 7, 300, 5, 99]


@pytest.fixture(scope="module")
def engines(tiny_profile):
    cpu = torch.device("cpu")
    return {
        name: load_engine(name, tiny_profile.backbone, tiny_profile.backbone_dir, causal=True, device=cpu)
        for name in ("torch", "megatron")
    }


def generate(lm, profile, seeds, loop, **overrides):
    args = dict(
        profile=profile,
        num_frames=24,
        temperature=1.0,
        top_k=profile.backbone_top_k,
        seeds=seeds,
        control=StageControl(),
        loop=loop,
    )
    args.update(overrides)
    return generate_coarse_tracks(lm, PROMPT, **args)


def same(first, second) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("seeds", [[5], [5, 6, 7]])
@pytest.mark.parametrize("sampler", [dict(), dict(temperature=0.7, top_k=9), dict(top_k=1)])
def test_fixed_length_codes_equal_the_reference_loop(engines, tiny_profile, seeds, sampler):
    fast = generate(engines["torch"], tiny_profile, seeds, "auto", **sampler)
    assert same(fast, generate(engines["torch"], tiny_profile, seeds, "reference", **sampler))
    assert same(fast, generate(engines["megatron"], tiny_profile, seeds, "reference", **sampler))
    assert all(codes.shape == (2, 24) for codes in fast)


@pytest.mark.parametrize("seeds", [[0], [0, 1, 2, 3]])
def test_songs_the_model_ends_equal_the_reference_loop(ending, tiny_profile, end_id, seeds):
    args = dict(end_id=end_id, max_frames=300, min_frames=2)
    fast = generate(ending["torch"], tiny_profile, seeds, "auto", **args)
    assert same(fast, generate(ending["torch"], tiny_profile, seeds, "reference", **args))
    assert same(fast, generate(ending["megatron"], tiny_profile, seeds, "reference", **args))
    assert all(2 <= codes.shape[1] < 300 for codes in fast)
    if len(seeds) > 1:
        assert len({codes.shape[1] for codes in fast}) > 1  # tracks of one batch end on their own


def test_blocks_straddling_min_frames_and_the_cap(ending, tiny_profile, end_id):
    """Block boundaries (check_every) fall anywhere against the phase change and the cap: codes unchanged."""
    args = dict(end_id=end_id, min_frames=7, max_frames=11)
    reference = generate(ending["torch"], tiny_profile, [3, 4], "reference", **args)
    plan = SongPlan(
        window_starts=(tiny_profile.audio_token_offset(0), tiny_profile.audio_token_offset(1)),
        codebook_size=tiny_profile.codebook_size,
        end_id=end_id,
        limit=11,
        min_frames=7,
        expected_frames=24,
        top_k=tiny_profile.backbone_top_k,
        temperature=1.0,
    )
    for check_every in (1, 3, 5, 64):
        codes = decode_song(ending["torch"], PROMPT, plan, [3, 4], check_every=check_every)
        assert same(codes, reference), check_every


def test_the_head_is_window_only_after_the_prompt(engines, tiny_profile):
    """One full-vocabulary projection per track (its prompt, as the engine's prefill); every token after it
    projects onto its codebook's window (+ end-of-text) only."""
    lm = engines["torch"]
    assert isinstance(lm, TorchCausalLM) and not isinstance(engines["megatron"], TorchCausalLM)
    calls = []
    handle = lm.model.output.register_forward_hook(lambda module, args, out: calls.append(tuple(out.shape)))
    try:
        generate(lm, tiny_profile, [1, 2], "auto", num_frames=10)
    finally:
        handle.remove()
    assert calls == [(1, len(PROMPT), tiny_profile.backbone.vocab_size)] * 2


def test_progress_once_per_block_and_cancel_within_one(engines, tiny_profile, monkeypatch):
    plan = SongPlan(
        window_starts=(tiny_profile.audio_token_offset(0), tiny_profile.audio_token_offset(1)),
        codebook_size=tiny_profile.codebook_size,
        end_id=None,
        limit=20,
        min_frames=20,
        expected_frames=20,
        top_k=50,
        temperature=1.0,
    )
    reports: list[int] = []
    decode_song(engines["torch"], PROMPT, plan, [1], reports.append, check_every=8)
    assert reports == [8, 16, 20]
    fractions: list[float] = []
    control = StageControl(report=lambda fraction, detail: fractions.append(fraction))
    generate(engines["torch"], tiny_profile, [1], "auto", num_frames=70, control=control)
    assert fractions == [32 / 70, 64 / 70, 1.0]  # one report per block of 32 frames

    control = StageControl(cancel_requested=lambda: True)
    closed: list[SlotDecoder] = []
    close = SlotDecoder.close
    reports.clear()

    def report(frames: int) -> None:
        reports.append(frames)
        control.check()

    monkeypatch.setattr(SlotDecoder, "close", lambda decoder: (closed.append(decoder), close(decoder)))
    with pytest.raises(Canceled):
        decode_song(engines["torch"], PROMPT, plan, [1], report, check_every=8)
    assert reports == [8] and len(closed) == 1 and closed[0].keys == []  # stopped at the first block, freed


class OpLog(TorchDispatchMode):
    """Every ATen op run while active, and (`shapes`) each with the shapes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        flat = [*args, *(kwargs or {}).values()]
        self.shapes.append((str(func), *(tuple(a.shape) for a in flat if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


# What reads a device value on the host (.item(), int(), .tolist(), bool()) or makes a tensor of host values
# (torch.tensor(list)): each one is a host round trip on a GPU, and a CUDA graph cannot hold it.
HOST_ROUND_TRIPS = ("aten._local_scalar_dense", "aten.lift_fresh", "aten.item")


def may_end_from_the_start(profile, end_id: int, limit: int) -> SongPlan:
    """A song of at most `limit` frames, top-k 50, that the model may end from its first frame."""
    return SongPlan(
        window_starts=(profile.audio_token_offset(0), profile.audio_token_offset(1)),
        codebook_size=profile.codebook_size,
        end_id=end_id,
        limit=limit,
        min_frames=0,
        expected_frames=limit,
        top_k=50,
        temperature=1.0,
    )


def test_frame_step_is_capture_safe(engines, tiny_profile, end_id):
    """One frame has no host round trip (no op that reads a device value back or uploads host values), and
    torch.compile(fullgraph=True) traces it (it breaks on a Python branch on a tensor value or a Generator
    argument); the traced frame changes the state exactly as the eager one. Two tracks of other samplers (two
    sampling groups) and an empty slot, as the engine has them."""
    lm = engines["torch"]
    plan = may_end_from_the_start(tiny_profile, end_id, 6)
    greedy = SongPlan(**{**plan.__dict__, "top_k": 1})
    requests = [TrackRequest(tuple(PROMPT), plan, 1), TrackRequest(tuple(PROMPT[:4]), greedy, 2)]
    states = []
    for compiled in (False, True):
        decoder = SlotDecoder(lm, 3, requests[0].positions, check_every=4)
        live = [decoder.admit(request) for request in requests]
        with torch.inference_mode():
            samplers = decoder._begin_block(live, 4)
            step = (
                torch.compile(decoder.frame_step, backend="eager", fullgraph=True) if compiled else decoder.frame_step
            )
            for _ in range(3):
                step(live, samplers)
            if compiled:
                step(live, samplers)
            else:
                log = OpLog()
                with log:
                    decoder.frame_step(live, samplers)
                assert not [op for op in log.ops if op.startswith(HOST_ROUND_TRIPS)], log.ops
                per_token = len(log.ops) / 2  # 222 ATen ops here (2 layers, 2 live rows of 3), on the CPU
                assert per_token < 250, log.ops  # a guard against per-token work creeping in
        states.append(
            [
                t.clone()
                for t in (
                    decoder.codes,
                    decoder.tokens,
                    decoder.position,
                    decoder.logits,
                    decoder.ended,
                    decoder.lengths,
                    decoder.keys[0],
                )
            ]
        )
        decoder.close()
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
    assert states[0][2].tolist() == [len(PROMPT) + 2 * 4, 4 + 2 * 4, 0]


def test_cuda_graphs_need_a_cuda_device(engines):
    with pytest.raises(ValueError, match="CUDA device"):
        SlotDecoder(engines["torch"], 1, 40, use_graphs=True)


def frame_trace(decoder: SlotDecoder, live: list[int]) -> tuple[list[tuple], tuple]:
    """The ops (with their arguments' shapes) one frame runs for the slots in `live`, and what a capture of it
    holds fixed (its configuration)."""
    with torch.inference_mode():
        samplers = decoder._begin_block(live, 1)
        log = OpLog()
        with log:
            decoder.frame_step(live, samplers)
        assert not [op for op in log.ops if op.startswith(HOST_ROUND_TRIPS)], log.ops
        return log.shapes, decoder._configuration(live, samplers)


@pytest.mark.parametrize(("whole_frame", "fused_attention"), [(True, False), (True, True), (False, False)])
def test_a_whole_frame_is_the_same_kernels_whatever_the_slots_hold(
    engines, tiny_profile, end_id, whole_frame, fused_attention
):
    """What a CUDA graph at a fixed slot count needs: in batched_matmul mode a whole frame runs the same ops on
    the same shapes, and holds the same configuration, whichever slots are occupied, by tracks of any prompt
    length and frame, so one capture serves tracks that join and leave. The batched frame that is not whole
    (rows and keys cut to the tracks in use, a candidate logit per occupied slot) is the contrast: its ops change.
    With the blocked attention (the CPU's) and the fused one (CUDA's)."""
    lm = engines["torch"]
    plan = may_end_from_the_start(tiny_profile, end_id, 20)
    decoder = SlotDecoder(
        lm, 3, 80, check_every=4, batched_matmul=True, whole_frame=whole_frame, fused_attention=fused_attention
    )
    first = decoder.admit(TrackRequest(tuple(PROMPT), plan, 1))
    second = decoder.admit(TrackRequest(tuple(PROMPT[:2]), plan, 2))
    traces = [frame_trace(decoder, [first, second])]
    decoder.cancel(first)  # one leaves: the other alone, in slot 1
    traces.append(frame_trace(decoder, [second]))
    third = decoder.admit(TrackRequest(tuple(range(3, 40)), plan, 3))  # a longer prompt joins, in slot 0
    fourth = decoder.admit(TrackRequest((9,), plan, 4))
    traces.append(frame_trace(decoder, sorted([second, third, fourth])))
    same = all(trace == traces[0] for trace in traces)
    assert same == whole_frame
    if whole_frame:
        assert decoder.rows_stepped == 0 and decoder.row_reach == 3 and decoder.key_cut == decoder.cache_len
    decoder.close()


def test_a_whole_frame_needs_batched_matmul(engines):
    with pytest.raises(ValueError, match="batched_matmul"):
        SlotDecoder(engines["torch"], 2, 40, whole_frame=True)
