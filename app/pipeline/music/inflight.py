"""The runner half of a GPU worker's in-flight backbone engine: one SlotDecoder that tracks of any jobs join and
leave between blocks, each with its own song plan, output file and share of the engine's time.

The split is vLLM's: a scheduler decides who joins, who leaves and what happens to a finished track (the worker
side, app/tasks/engine.py, with Redis, leases and cancels), and a runner steps the model (this). Nothing here
knows about jobs or Celery: a track is a caller's key and a BackboneTrack.

    runner = InFlightBackbone(models, slots=8)
    runner.admit(key, BackboneTrack(params, seed, out))   # between blocks; prefills that slot only
    block = runner.step()                                 # up to check_every frames for every slot
    for done in block.finished: ...                       # codes saved to its `out`; its slot is free
    runner.drop(key)                                      # a canceled track leaves; the others go on

A track's codes are bitwise the same whatever joins or leaves around it (SlotDecoder's guarantee), so a seed still
means a song: with `batched_matmul` (products over fixed 16-row tiles) the same in every engine of the deployment;
without it (per-row products) also the same as the reference loop alone, at the price of reading every weight once
per track (slots.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

from app.pipeline.music.options import DEFAULT_SLOT_CAP
from app.pipeline.music.slots import PausedTrack, SlotDecoder, default_slots, kv_bytes_per_track, open_slot_decoder
from app.pipeline.music.stages import BackboneTrack, MusicModels, SongLength, _save_codes, backbone_request
from app.pipeline.music.torch_engine import TorchCausalLM
from app.pipeline.profiles import COARSE_CODEBOOKS


@dataclass
class _Seat:
    """What the runner keeps of a track in a slot."""

    slot: int
    track: BackboneTrack
    length: SongLength
    prompt_tokens: int
    share_s: float = 0.0  # its share of the engine's time so far: each block's seconds over the tracks in it
    wall_s: float = 0.0  # the seconds of the blocks it was in: how long its backbone took beside the others


@dataclass(frozen=True)
class FinishedTrack:
    """A track whose coarse codes are written (to its BackboneTrack's `out`); its slot is free again."""

    key: Hashable
    song: dict[str, Any]  # frames, duration_s, ended_by (SongLength.describe)
    prompt_tokens: int
    share_s: float  # what it cost: its share of each block (its owner is charged this)
    wall_s: float  # how long it took: the blocks it was in (what the ETA learns: app/control/backlog.py)


@dataclass(frozen=True)
class Block:
    """What one block did: each running track's (frames written, frames expected), and the finished ones."""

    seconds: float
    frames: int = 0  # frames every track in it ran (fewer than the decoder's check_every where one changed phase)
    rows: int = 0  # rows the model ran on over those frames (SlotDecoder.rows_stepped: tiles in use, or every slot)
    progress: dict[Hashable, tuple[int, int]] = field(default_factory=dict)
    finished: list[FinishedTrack] = field(default_factory=list)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of `device`: the CUDA allocator's view on a GPU, MemAvailable of the host otherwise."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def engine_slots(lm: TorchCausalLM, setting: int, cap: int = DEFAULT_SLOT_CAP) -> int:
    """How many slots a worker's engine gets: `setting` when it names a number (>= 1), else (0: auto) as many as a
    track's KV cache at the model's full length fits in the device's free memory, at most `cap`, at least 1."""
    if setting >= 1:
        return setting
    per_track = kv_bytes_per_track(lm, lm.model.shape.max_len)
    return max(1, default_slots(free_memory_bytes(lm.device), per_track, cap))


class InFlightBackbone:
    """Tracks of any songs decoding together in up to `slots` slots of the backbone (a TorchCausalLM), each
    joining and leaving between blocks. Slots are sized for the model's full length, so any track fits; on an
    out-of-memory error at the start the slot count halves (open_slot_decoder). `cuda_graphs`: with batched_matmul
    on a CUDA device, each frame replays one CUDA graph of the whole frame (slots.py), captured once for any
    occupancy."""

    def __init__(
        self,
        models: MusicModels,
        slots: int,
        loaded: list[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        batched_matmul: bool = False,
        cuda_graphs: bool = False,
    ):
        lm = models.backbone(loaded)
        if not isinstance(lm, TorchCausalLM):
            raise TypeError("the in-flight engine needs the torch backbone engine (ENCORE_MUSIC_ENGINE=torch)")
        self.models, self.loaded, self.clock = models, loaded, clock
        # a CUDA graph per frame where it serves tracks that come and go: a whole frame (batched_matmul) on CUDA
        graphs = cuda_graphs and batched_matmul and lm.device.type == "cuda"
        self.decoder: SlotDecoder = open_slot_decoder(
            lm, lm.model.shape.max_len, slots, batched_matmul=batched_matmul, use_graphs=graphs
        )
        self._seats: dict[Hashable, _Seat] = {}  # in the order they took their slots
        self._paused: dict[Hashable, tuple[_Seat, PausedTrack]] = {}  # in the order they left them

    @property
    def slots(self) -> int:
        return self.decoder.slots

    @property
    def free(self) -> int:
        return len(self.decoder.free_slots)

    @property
    def keys(self) -> list[Hashable]:
        """The tracks in the slots, in the order they took them."""
        return list(self._seats)

    @property
    def paused(self) -> list[Hashable]:
        """The tracks taken out of their slots mid-song (`pause`), in the order they left."""
        return list(self._paused)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seats or key in self._paused

    def admit(self, key: Hashable, track: BackboneTrack) -> None:
        """Put `track` in a free slot (between blocks) and prefill its prompt there."""
        if key in self._seats:
            raise KeyError(f"{key!r} is already in the engine")
        request, length = backbone_request(self.models, track, self.loaded, tag=key)
        slot = self.decoder.admit(request)
        self._seats[key] = _Seat(slot, track, length, len(request.prompt_ids))

    def drop(self, key: Hashable) -> None:
        """Take a track out (canceled, or no longer this engine's); its slot is free for the next block."""
        if self._paused.pop(key, None) is not None:
            return
        seat = self._seats.pop(key)
        self.decoder.cancel(seat.slot)

    def pause(self, key: Hashable) -> None:
        """Take a running track out of its slot, its state kept aside (SlotDecoder.pause): the slot is free for
        another track; `resume` goes on where it left."""
        seat = self._seats.pop(key)
        self._paused[key] = (seat, self.decoder.pause(seat.slot))

    def resume(self, key: Hashable) -> None:
        """A paused track back into a free slot (between blocks)."""
        seat, paused = self._paused.pop(key)
        seat.slot = self.decoder.resume(paused)
        self._seats[key] = seat

    def step(self, most_frames: int | None = None) -> Block:
        """One block (of at most `most_frames` frames, if given) for every track in the engine; a finished track's
        codes are saved and its slot freed."""
        started, before, rows_before = self.clock(), self.decoder.frames_stepped, self.decoder.rows_stepped
        updates = self.decoder.step_block(most_frames)
        seconds, frames = self.clock() - started, self.decoder.frames_stepped - before
        rows = self.decoder.rows_stepped - rows_before
        share = seconds / len(updates) if updates else 0.0
        progress: dict[Hashable, tuple[int, int]] = {}
        finished: list[FinishedTrack] = []
        for update in updates:
            key = update.request.tag
            seat = self._seats[key]
            seat.share_s += share
            seat.wall_s += seconds
            if not update.finished:
                progress[key] = (update.frames, seat.length.expected_frames)
                continue
            assert update.codes is not None
            _save_codes(update.codes, seat.track.out)
            del self._seats[key]
            song = seat.length.describe(int(update.codes.shape[1]), self.models.profile)
            finished.append(FinishedTrack(key, song, seat.prompt_tokens, seat.share_s, seat.wall_s))
        return Block(seconds, frames, rows, progress, finished)

    def close(self) -> None:
        self._seats.clear()
        self._paused.clear()
        self.decoder.close()


def tokens_detail(frames: int, expected: int) -> tuple[float, str]:
    """A running track's progress as the backbone reports it alone: (fraction, "done/expected tokens"), held
    below 1 (the model, or the cap, ends the song; its stage's finish says 1)."""
    done, total = COARSE_CODEBOOKS * frames, COARSE_CODEBOOKS * max(expected, 1)
    return min(done / total, 0.99), f"{done}/{total} tokens"
