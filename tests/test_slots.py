"""In-flight batching of the backbone's decode (slots.py) on the tiny profile's real model code, fp32, no mocks.

A seed still means a song: every track's codes, batched with others of other prompts, lengths, seeds, samplers,
joining and leaving at other blocks, are bitwise the codes it gets alone (the reference loop, a one-slot
decoder); its candidate logits are bitwise the same at every frame too (equal by construction, not by luck of the
sampler). A canceled slot frees its place and disturbs no one.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from app.pipeline.control import StageControl
from app.pipeline.music.backbone import generate_coarse_tracks
from app.pipeline.music.slots import (
    RecentlyUsed,
    SlotDecoder,
    SongPlan,
    TrackRequest,
    decode_queue,
    default_slots,
    kv_bytes_per_track,
    open_slot_decoder,
)

torch.set_num_threads(2)
MAX_LEN = 160  # positions per slot: the longest request below (prompt + 2 x limit) fits


@pytest.fixture(scope="module")
def lm(ending):
    """The plain-PyTorch engine over a tiny backbone that ends a song on cue (conftest.ending)."""
    return ending["torch"]


@pytest.fixture(scope="module")
def make_request(tiny_profile, end_id):
    def make(
        prompt: range | tuple[int, ...],
        seed: int,
        *,
        limit: int = 20,
        top_k: int = 50,
        temperature: float = 1.0,
        ends: bool = False,
        min_frames: int = 2,
    ) -> TrackRequest:
        plan = SongPlan(
            window_starts=(tiny_profile.audio_token_offset(0), tiny_profile.audio_token_offset(1)),
            codebook_size=tiny_profile.codebook_size,
            end_id=end_id if ends else None,
            limit=limit,
            min_frames=min_frames if ends else limit,
            expected_frames=limit,
            top_k=top_k,
            temperature=temperature,
        )
        return TrackRequest(tuple(prompt), plan, seed)

    return make


@pytest.fixture(scope="module")
def mix(make_request):
    """Tracks that differ in everything a track has: prompt length, seed, top-k (1 included), temperature,
    length, fixed-length or ended by the model (then with its own first frame that may end)."""
    return [
        make_request(range(1, 7), 5),
        make_request(range(3, 20), 6, limit=27, top_k=9, temperature=0.7),
        make_request(range(2, 5), 7, limit=13, top_k=1),
        make_request(range(9, 40), 8, limit=50, top_k=80, temperature=1.3, ends=True, min_frames=3),
        make_request(range(1, 11), 9, limit=60, ends=True),
        make_request((5,), 10, limit=9, temperature=0.9),
        make_request(range(40, 51), 11, limit=40, top_k=20, ends=True, min_frames=11),
        make_request(range(7, 9), 12, limit=70, top_k=1, ends=True),
    ]


def alone(lm, profile, request: TrackRequest) -> torch.Tensor:
    """The track's codes from the reference loop (backbone.py), alone: the parity anchor."""
    plan = request.plan
    (codes,) = generate_coarse_tracks(
        lm,
        list(request.prompt_ids),
        profile=profile,
        num_frames=plan.expected_frames,
        temperature=plan.temperature,
        top_k=plan.top_k,
        seeds=[request.seed],
        control=StageControl(),
        end_id=plan.end_id,
        max_frames=plan.limit,
        min_frames=plan.min_frames,
        loop="reference",
    )
    return codes


@pytest.fixture(scope="module")
def alone_codes(lm, tiny_profile, mix):
    return [alone(lm, tiny_profile, request) for request in mix]


def equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_the_mix_covers_what_it_claims(alone_codes, mix):
    ended_by_model = [codes.shape[1] < request.plan.limit for codes, request in zip(alone_codes, mix, strict=True)]
    assert any(ended_by_model) and not all(ended_by_model)
    assert len({len(request.prompt_ids) for request in mix}) == len(mix)
    assert all(codes.shape[0] == 2 for codes in alone_codes)


@pytest.mark.parametrize(("slots", "check_every"), [(1, 32), (3, 4), (5, 5)])
def test_codes_batched_equal_codes_alone(lm, mix, alone_codes, slots, check_every):
    """Fewer slots than tracks: later tracks join at later blocks, into slots others left, beside tracks at
    other frames; every track's codes are its alone codes."""
    decoder = SlotDecoder(lm, slots, MAX_LEN, check_every=check_every)
    finished_while_others_ran = []

    def note(update) -> None:
        if update.finished:
            finished_while_others_ran.append(len(decoder.occupants) > 0)

    assert equal(decode_queue(decoder, mix, on_update=note), alone_codes)
    assert decoder.free_slots == list(range(slots))
    if slots > 1:
        assert any(finished_while_others_ran)


@pytest.mark.parametrize("batched", [False, True])
def test_block_lengths_do_not_change_codes(lm, mix, alone_codes, batched_alone_codes, batched):
    """Blocks of 1..7 frames in an irregular sequence (the engine runs short blocks while slots are free): every
    track's codes are those it gets alone in its mode."""
    decoder = SlotDecoder(lm, 3, MAX_LEN, check_every=8, batched_matmul=batched)
    lengths = itertools.cycle([1, 5, 2, 7, 3, 6, 4])
    codes = decode_queue(decoder, mix, block_frames=lengths)
    assert equal(codes, batched_alone_codes if batched else alone_codes)


def alone_logits(lm, request: TrackRequest, frames: int) -> list[torch.Tensor]:
    """The candidate logits a one-slot decoder (whose codes are the reference loop's: above) holds before each
    of a fixed-length track's first frames."""
    decoder = SlotDecoder(lm, 1, MAX_LEN, check_every=1)
    decoder.admit(request)
    trace = []
    for _ in range(frames):
        trace.append(decoder.logits[0, : request.plan.candidates(False)].clone())
        decoder.step_block()
    decoder.close()
    return trace


def test_logits_are_bitwise_those_alone_at_every_frame(lm, make_request):
    """Not only the codes: every slot's candidate logits are bitwise the alone ones, frame by frame, while a
    neighbour joins (prefilling its own row) and another leaves."""
    requests = [
        make_request(range(1, 30), 1, limit=12, top_k=9, temperature=0.8),
        make_request(range(4, 8), 2, limit=30, top_k=1),
        make_request(range(100, 160), 3, limit=30),
    ]
    traces = [alone_logits(lm, request, 12) for request in requests]
    decoder = SlotDecoder(lm, 3, MAX_LEN, check_every=1)
    slots = [decoder.admit(requests[0]), decoder.admit(requests[1])]
    frames = [0, 0, 0]
    for block in range(12):
        if block == 5:  # a newcomer joins mid-song of the others
            slots.append(decoder.admit(requests[2]))
        for index, slot in enumerate(slots):
            if frames[index] < 12 and slot in decoder.occupants:
                width = traces[index][frames[index]].shape[0]
                assert torch.equal(decoder.logits[slot, :width], traces[index][frames[index]]), (index, block)
                frames[index] += 1
        decoder.step_block()
    assert frames == [12, 12, 7]


@pytest.fixture(scope="module")
def batched_alone_codes(lm, mix):
    """Each track decoded by a one-slot decoder in batched_matmul mode: what it must get batched in that mode."""
    return [decode_queue(SlotDecoder(lm, 1, MAX_LEN, batched_matmul=True), [request])[0] for request in mix]


@pytest.mark.parametrize(("slots", "check_every"), [(4, 3), (8, 5)])
def test_batched_matmul_codes_equal_one_slot(lm, mix, batched_alone_codes, alone_codes, slots, check_every):
    """One matmul for all slots: the codes of a track do not depend on its company either."""
    decoder = SlotDecoder(lm, slots, MAX_LEN, check_every=check_every, batched_matmul=True)
    assert equal(decode_queue(decoder, mix), batched_alone_codes)
    assert equal(batched_alone_codes, alone_codes)  # not promised (last bits of the logits differ), but here so


@pytest.mark.parametrize(("slots", "check_every"), [(3, 4), (5, 3)])
def test_a_whole_frame_gives_the_codes_of_the_batched_mode(lm, mix, batched_alone_codes, slots, check_every):
    """The whole frame, what a CUDA graph at a fixed slot count replays (every slot's row over the whole cache;
    each slot's sampler and candidate set picked by device data, not by the frame's structure), gives every track
    the codes the batched mode gives it alone: tracks of three candidate sets (with and without an end id, and other
    windows) and five samplers, joining and leaving, some ended by the model."""
    base = mix[0].plan
    shifted = TrackRequest(  # a third candidate set: windows 3 ids lower, so its heads' rows are other rows
        tuple(range(2, 9)), replace(base, window_starts=tuple(start - 3 for start in base.window_starts)), 13
    )
    shifted_alone = decode_queue(SlotDecoder(lm, 1, MAX_LEN, batched_matmul=True), [shifted])[0]
    decoder = SlotDecoder(lm, slots, MAX_LEN, check_every=check_every, batched_matmul=True, whole_frame=True)
    assert equal(
        decode_queue(decoder, [*mix[:3], shifted, *mix[3:]]),
        [*batched_alone_codes[:3], shifted_alone, *batched_alone_codes[3:]],
    )
    assert decoder.rows_stepped == slots * decoder.frames_stepped  # every row ran, every frame


def test_fused_attention_keeps_a_seed_a_song_in_an_engine_of_fixed_shapes(lm, mix):
    """The whole frame's fused attention (the CUDA path, run here on the CPU): one masked attention call over every
    slot's whole cache. Its shapes never change in a decoder, so each track's codes amid the others are those it
    gets alone in a decoder of the same slots (a row's bits depend on its own row only); its logits are those of
    the blocked attention to rounding, not bitwise (module docstring)."""
    tracks = mix[:5]

    def fused() -> SlotDecoder:
        return SlotDecoder(lm, 3, MAX_LEN, check_every=4, batched_matmul=True, whole_frame=True, fused_attention=True)

    alone_in_three = [decode_queue(fused(), [request])[0] for request in tracks]
    assert equal(decode_queue(fused(), tracks), alone_in_three)
    blocked = SlotDecoder(lm, 3, MAX_LEN, check_every=2, batched_matmul=True, whole_frame=True)
    together = fused()
    for request in tracks[:3]:
        blocked.admit(request)
        together.admit(request)
    bitwise = []
    for _ in range(6):  # frame by frame: the logits after each
        blocked.step_block(1)
        together.step_block(1)
        assert torch.allclose(blocked.logits, together.logits, rtol=1e-5, atol=1e-6)
        bitwise.append(torch.equal(blocked.logits, together.logits))
    assert not all(bitwise)  # another kernel: other last bits (so the fused path is what ran)
    assert torch.equal(blocked.codes, together.codes)


def test_fused_attention_needs_a_whole_frame(lm):
    with pytest.raises(ValueError, match="whole frame"):
        SlotDecoder(lm, 2, MAX_LEN, batched_matmul=True, fused_attention=True)


def test_batched_matmul_logits_are_bitwise_those_of_one_slot(lm, make_request):
    requests = [
        make_request(range(1, 30), 1, limit=12, top_k=9, temperature=0.8),
        make_request(range(4, 8), 2, limit=30, top_k=1),
        make_request(range(100, 160), 3, limit=30),
    ]
    one = SlotDecoder(lm, 1, MAX_LEN, check_every=2, batched_matmul=True)
    many = SlotDecoder(lm, 4, MAX_LEN, check_every=2, batched_matmul=True)
    one.admit(requests[0])
    slot = many.admit(requests[0])
    for block in range(6):
        if block in (1, 3):
            many.admit(requests[block // 2 + 1])  # neighbours join mid-song
        assert torch.equal(one.logits[0], many.logits[slot, : one.logits.shape[1]]), block
        one.step_block()
        many.step_block()


def test_batched_matmul_runs_only_the_tiles_up_to_the_last_track_and_keeps_its_bits(lm, make_request):
    """A frame runs the model on the rows up to the last occupied slot's 16-row tile: a track's logits stay
    bitwise those of a one-slot decoder while that reach grows from 16 rows to all 40 (the third tile, cut at the
    last slot) and falls back to 16."""
    watched = make_request(range(1, 30), 1, limit=40, top_k=9, temperature=0.8)
    one = SlotDecoder(lm, 1, MAX_LEN, check_every=2, batched_matmul=True)
    many = SlotDecoder(lm, 40, MAX_LEN, check_every=2, batched_matmul=True)
    one.admit(watched)
    assert many.admit(watched) == 0  # the lowest free slot
    fillers: list[int] = []
    expected_rows = 0
    for block in range(8):
        if block == 2:  # 35 neighbours: slots 1..35, the last in the third tile
            fillers = [many.admit(make_request(range(5, 9 + n % 7), 100 + n, limit=60)) for n in range(35)]
            assert max(fillers) == 35
        if block == 5:  # they leave: the watched track alone in the first tile again
            for slot in fillers:
                many.cancel(slot)
        assert torch.equal(one.logits[0], many.logits[0, : one.logits.shape[1]]), block
        before = many.rows_stepped
        one.step_block()
        many.step_block()
        reach = 40 if 2 <= block < 5 else 16
        assert many.rows_stepped - before == 2 * reach, block  # two frames a block
        expected_rows += 2 * reach
    assert many.rows_stepped == expected_rows and many.frames_stepped == 16


def test_a_canceled_slot_frees_its_place_and_disturbs_no_one(lm, tiny_profile, mix, alone_codes, make_request):
    decoder = SlotDecoder(lm, 3, MAX_LEN, check_every=4)
    slots = {decoder.admit(mix[i]): i for i in (0, 1, 3)}
    decoder.step_block()
    canceled = next(slot for slot, index in slots.items() if index == 1)
    assert decoder.cancel(canceled) == mix[1]
    assert decoder.free_slots == [canceled]
    with pytest.raises(KeyError):
        decoder.cancel(canceled)
    decoder.step_block()
    newcomer = make_request(range(20, 33), 99, limit=15, top_k=5)
    assert decoder.admit(newcomer) == canceled  # at the next block boundary, into the freed slot
    slots[canceled] = -1
    codes: dict[int, torch.Tensor] = {}
    while decoder.occupants:
        for update in decoder.step_block():
            if update.finished:
                assert update.codes is not None
                codes[slots[update.slot]] = update.codes
    assert torch.equal(codes[0], alone_codes[0]) and torch.equal(codes[3], alone_codes[3])
    assert torch.equal(codes[-1], alone(lm, tiny_profile, newcomer))


@pytest.mark.parametrize(("batched", "whole_frame"), [(False, False), (True, False), (True, True)])
def test_a_paused_track_resumes_in_another_slot_and_ends_as_alone(
    lm, mix, alone_codes, batched_alone_codes, make_request, batched, whole_frame
):
    """Paused mid-song (its slot given to a newcomer), kept aside while the others go on, resumed in another slot:
    its codes and everyone else's are those alone; a track that may end pauses past the frame it may end at."""
    expected = batched_alone_codes if batched else alone_codes
    decoder = SlotDecoder(lm, 3, MAX_LEN, check_every=4, batched_matmul=batched, whole_frame=whole_frame)
    assert [decoder.admit(mix[i]) for i in (4, 3, 1)] == [0, 1, 2]
    for _ in range(3):  # 12 frames: mix[3] may end from frame 3 on
        decoder.step_block()
    paused = [decoder.pause(slot) for slot in (0, 1)]
    assert [p.request for p in paused] == [mix[4], mix[3]] and decoder.free_slots == [0, 1]
    assert paused[0].keys[0].device.type == "cpu"
    with pytest.raises(KeyError):
        decoder.pause(0)
    newcomer = make_request(range(20, 33), 99, limit=15, top_k=5)
    assert decoder.admit(newcomer) == 0
    index_of = {mix[i]: i for i in (1, 3, 4)} | {newcomer: -1}
    codes: dict[int, torch.Tensor] = {}

    def step() -> None:
        for update in decoder.step_block():
            if update.finished:
                assert update.codes is not None
                codes[index_of[update.request]] = update.codes

    step()
    step()
    assert decoder.resume(paused[0]) == 1  # mix[4], paused from slot 0, goes on in slot 1
    while not decoder.free_slots:
        step()
    free = decoder.free_slots
    assert decoder.resume(paused[1]) == free[0]
    while decoder.occupants:
        step()
    assert all(torch.equal(codes[i], expected[i]) for i in (1, 3, 4)), "a paused track or a neighbour changed"
    alone_newcomer = decode_queue(SlotDecoder(lm, 1, MAX_LEN, batched_matmul=batched), [newcomer])[0]
    assert torch.equal(codes[-1], alone_newcomer)


def test_updates_report_progress_then_the_codes(lm, make_request):
    decoder = SlotDecoder(lm, 2, MAX_LEN, check_every=8)
    slot = decoder.admit(make_request(range(1, 5), 1, limit=20))
    updates = [decoder.step_block() for _ in range(3)]
    assert [(u.slot, u.frames, u.finished) for (u,) in updates] == [
        (slot, 8, False),
        (slot, 16, False),
        (slot, 20, True),
    ]
    assert updates[-1][0].codes is not None and updates[-1][0].codes.shape == (2, 20)
    assert decoder.step_block() == [] and decoder.free_slots == [0, 1]


def test_admission_checks(lm, make_request):
    decoder = SlotDecoder(lm, 1, 40)
    with pytest.raises(ValueError, match="does not fit"):
        decoder.admit(make_request(range(1, 5), 1, limit=20))  # 4 + 40 positions > 40
    decoder.admit(make_request(range(1, 5), 1, limit=10))
    with pytest.raises(RuntimeError, match="no free slot"):
        decoder.admit(make_request(range(1, 5), 2, limit=10))


def test_slot_count_from_memory_and_fewer_slots_when_it_does_not_fit(lm, tiny_profile):
    shape = tiny_profile.backbone
    per_track = kv_bytes_per_track(lm, 1000)
    # fp32, in whole 64-key blocks (the batched mode's attention reads blocks): 1,000 positions take 1,024
    assert per_track == 2 * shape.num_layers * shape.num_query_groups * shape.head_dim * 1024 * 4
    assert default_slots(100 * per_track, per_track, cap=16) == 16
    assert default_slots(int(6.25 * per_track), per_track, cap=16) == 5  # 80 % of it usable
    assert default_slots(per_track // 2, per_track) == 0
    with pytest.raises(ValueError):
        default_slots(10**9, 0)
    decoder = open_slot_decoder(lm, 1000, 16, memory_bytes=3 * per_track)
    assert decoder.slots == 2  # 16, 8 and 4 do not fit the budget; halving stops at 2
    assert decoder.keys[0].shape[0] == 2 and decoder.keys[0].shape[2] == 1024  # what the budget was counted in
    with pytest.raises(torch.OutOfMemoryError):
        open_slot_decoder(lm, 1000, 4, memory_bytes=per_track // 2)


def test_captured_frames_are_kept_by_configuration_the_least_recently_used_dropped():
    """A decoder's captured frames (RecentlyUsed; the graphs need a device, the bookkeeping does not): a
    configuration that comes back is replayed, not captured again, until more configurations than kept came since."""
    made: list[str] = []
    graphs: RecentlyUsed[str] = RecentlyUsed(2)

    def get(key: str) -> str:
        return graphs.get(key, lambda: made.append(key) or f"graph {key}")

    assert [get(key) for key in "ABABAB"] == ["graph A", "graph B"] * 3
    assert made == ["A", "B"]  # toggling between two phases: two captures
    get("C")  # a third: A, the least recently used, goes
    get("B")  # kept
    get("A")  # made again; C goes
    assert made == ["A", "B", "C", "A"] and len(graphs) == 2
    get("B")
    assert made == ["A", "B", "C", "A"]
    graphs.clear()
    get("A")
    assert made[-1] == "A" and len(graphs) == 1
