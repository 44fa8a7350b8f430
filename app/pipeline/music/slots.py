"""The backbone's decode on the engine's device, in slots: tracks of any songs join and leave between blocks.

backbone.py's reference loop samples on the host side of the engine protocol (ids in, logits out, `int()` on
every code). A SlotDecoder does the same arithmetic with every per-token value kept on the device, so that on a
GPU one frame (two tokens) is a fixed sequence of kernels that a CUDA graph can replay:
  - token ids, positions, frame indices, the codes, which tracks have ended and where, all live in device
    tensors allocated once and updated in place;
  - the output head computes only the rows that can be sampled: the next codebook's window, plus end-of-text
    when the model may end the song (2,049 of 130,304 rows for Khala);
  - sampling is torch.multinomial's own algorithm written out: for one draw without replacement it takes
    `argmax(probs / q)` with `q ~ Exp(1)` drawn from the track's generator. Each track's noise for the next
    block of frames is drawn ahead, in one call on its own generator (the same values, in the same order, as
    one call per token on the CPU), so a track's codes are those the reference loop gives it;
  - progress, cancels and "which tracks have ended?" are read once per block (`check_every` frames);
  - with `use_graphs` (on CUDA) each block's frame is captured once as a CUDA graph and replayed; in batched_matmul
    mode the frame is whole (below), so one capture serves tracks that join and leave.

It holds up to N tracks of any songs at once, each at its own place: its own prompt (of its own length), seed,
sampler, frame limit and end id (its own SongPlan), its own positions and RNG generator. The in-flight engine
(inflight.py) drives it block by block:

    decoder = SlotDecoder(lm, slots=8, max_len=...)
    slot = decoder.admit(TrackRequest(prompt_ids, plan, seed))   # at a block boundary; prefills that slot only
    for update in decoder.step_block():                         # up to check_every frames for every slot
        if update.finished: save(update.codes)                   # the slot is free again: admit the next track
    decoder.cancel(slot)                                         # drop one track; the others go on

Without the engine, `decode_song` runs the tracks of one song in a decoder of their own, one slot per track.

**A seed still means a song.** A track's codes are bitwise those it gets alone (a SlotDecoder of one slot, or
backbone.generate_coarse_tracks' reference loop), whatever it is batched with. That holds by
construction, not by luck:
  - each slot draws its sampling noise from its own generator, the same values in the same order as alone (a
    block never straddles a slot's phase change, so every token draws as many values as it does alone);
  - each slot attends only to its own cache row, with its own mask, over exactly the key length it has alone;
  - no value of one row ever enters a reduction of another row.
Each kernel either is batch-invariant (computes a row from that row alone, the same way at any batch size) or is
called once per row with the shapes the track has alone. What this CPU's kernels do (measured, torch 2.13, MKL,
AVX-512; tests/test_slots.py checks the result end to end):
  - a linear layer's product is NOT batch-invariant: MKL computes a 1-row product (what a track alone runs) with
    a gemv-like kernel whose summation order differs from the gemm it uses for 2+ rows, so a batched row differs
    from the same row alone in the last bits, for every layer shape here (and F.linear's x @ W^T differs even
    between 2 and 3+ rows for half of them); oneDNN's packed product, which the engine's linears run on a CPU
    since (torch_engine.Linear), is the same way (a row of 16 against its 1-row product: 50 of 200 differ,
    bench/cpu_products.py). A `bmm` over a broadcast weight matches the 1-row product for most
    shapes but not all (1024 -> 33). So, by default, every linear layer and the output head run once per
    occupied row, each exactly the call the track makes alone (`_linear`);
  - scaled_dot_product_attention is batch-invariant across its batch, but its result depends on the key length
    (the CPU flash kernel splits keys in blocks of up to 512, and the last block's size changes the summation
    order, masked keys or not), and on the strides of q (a transposed projection output reads differently).
    Alone, a track's cache holds len(prompt) + 2 x limit positions, so each slot attends over exactly that
    many keys of its row, once per row, with projections laid out as nn.Linear lays them out;
  - F.silu's vectorized and scalar paths differ in the last bit, so which elements of a row fall in the
    scalar tail must not depend on the batch: SiLU runs once per row (with batched_matmul: x / (1 + exp(-x)),
    whose paths agree, for all rows at once);
  - RMSNorm, RoPE (multiplications and additions of tables whose values do not depend on the table's length),
    the embedding, residual additions, cache writes, topk, softmax and argmax are batch-invariant and run
    batched over all slots (sampling batched per group of slots with the same sampler and phase).

The price of the per-row matmuls: each row reads every weight again, so on a CPU the batch only saves the
per-op cost of the rest (bench/slots.py). `batched_matmul=True` trades the engine's exact bits for speed: one
product per tile of ROW_TILE rows over all slots (on a CPU oneDNN's packed product of the tile, torch_engine.Linear;
elsewhere written (W @ x^T)^T), and SiLU batched: the kernel sees one shape
whatever the row count, and computes a row the same way wherever it lies (tests/test_slots.py on Intel and AMD EPYC
CPUs; one bare product of all rows, which an earlier version used, was batch-invariant on Intel, not on the AMD).
Its attention is one call for all slots per layer (`_attention_blocks`): keys in blocks of KEY_BLOCK from position
0, each block's sums of one shape, the blocks added in position order, so a row's bits do not depend on the other
rows or on how many keys the call reads (it reads up to the furthest slot's position in whole blocks, not each
track's full length). A track's codes are then bitwise the same whatever it is batched with and in a decoder of
one slot, but that is not the 1-row product of the reference loop: their logits differ in the last bits, so their
codes may differ where the sampler meets a near-tie (none seen in the tests). A deployment picks one mode for
every track, so that a retry of a seed gives the same song.

Shapes: the state of every slot lives in [N, ...] tensors allocated once (the KV cache for N x max_len
positions); an empty slot keeps running through the batched ops on its zeros (its row is masked out of the
per-row kernels and of sampling) so the batched part of a step has one shape whatever the occupancy. In
batched_matmul mode without CUDA graphs a frame runs the model only on the rows up to the last occupied slot's
ROW_TILE (`row_reach`): on a CPU, where a 16-row product costs about three 1-row ones, more slots then cost
nothing until they fill.

A whole frame (`whole_frame`, batched_matmul only; what `use_graphs` captures there) is the CUDA graph's frame at a
fixed slot count: every slot's row, over the whole cache, every frame, whichever slots are occupied, with each
slot's sampler (`sampler_of`) and candidate set (`head_of`) picked by device data. Its kernels and their shapes
are then the same for any occupancy (tests/test_decode_loop.py records them), so the graph is captured again only
when the set of samplers or candidate sets in use changes, not when a track joins or leaves; and a track's codes
are those the batched mode gives it (tests/test_slots.py), since every row is computed as in the cut frame. The
price: empty rows and unused keys run too, where the cut frame skips them (bench/slots.py's `whole_frame_slots_N`
against `batched_matmul_slots_N`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.pipeline.music.options import DEFAULT_SLOT_CAP
from app.pipeline.music.torch_engine import (
    Attention,
    Block,
    FeedForward,
    Linear,
    TorchCausalLM,
    apply_rope,
    rope_tables,
)
from app.pipeline.profiles import COARSE_CODEBOOKS, MusicProfile

T = TypeVar("T")
_Key = TypeVar("_Key", bound=Hashable)
DEFAULT_CHECK_EVERY = 32  # frames between host reads: ~1.5 s of audio, well under a second of GPU time


@dataclass(frozen=True)
class SongPlan:
    """What to generate: the codebook windows (first id of each), which id ends a song (None: fixed length),
    the frame limit, the first frame that may end, the expected frames (for progress), the sampler."""

    window_starts: tuple[int, ...]
    codebook_size: int
    end_id: int | None
    limit: int
    min_frames: int
    expected_frames: int
    top_k: int
    temperature: float

    @staticmethod
    def frame_limit(num_frames: int, end_id: int | None, max_frames: int | None) -> int:
        """The most frames a song may take: exactly `num_frames` without an end id, else `max_frames` (or
        `num_frames` when there is no cap)."""
        return num_frames if end_id is None else (max_frames or num_frames)

    @classmethod
    def for_song(
        cls,
        profile: MusicProfile,
        *,
        num_frames: int,
        end_id: int | None,
        max_frames: int | None,
        min_frames: int,
        top_k: int,
        temperature: float,
    ) -> SongPlan:
        """The plan of one song in `profile`'s two coarse windows: `num_frames` expected, ended by `end_id` (once
        `min_frames` are written) or at `frame_limit`: what backbone.generate_coarse_tracks decodes."""
        return cls(
            window_starts=tuple(profile.audio_token_offset(q) for q in range(COARSE_CODEBOOKS)),
            codebook_size=profile.codebook_size,
            end_id=end_id,
            limit=cls.frame_limit(num_frames, end_id, max_frames),
            min_frames=min_frames,
            expected_frames=num_frames,
            top_k=top_k,
            temperature=temperature,
        )

    @classmethod
    def fixed_length(cls, profile: MusicProfile, frames: int, top_k: int, temperature: float = 1.0) -> SongPlan:
        """A song of exactly `frames` frames (no end-of-text): what the benches and the parity tests decode."""
        return cls.for_song(
            profile,
            num_frames=frames,
            end_id=None,
            max_frames=None,
            min_frames=frames,
            top_k=top_k,
            temperature=temperature,
        )

    def may_end(self, frame: int) -> bool:
        return self.end_id is not None and frame >= self.min_frames

    def candidates(self, may_end: bool) -> int:
        return self.codebook_size + (1 if may_end else 0)

    def candidate_ids(self, q: int) -> list[int]:
        """The vocabulary ids codebook q's tokens are sampled from: its window, then end-of-text if any."""
        start = self.window_starts[q]
        return [*range(start, start + self.codebook_size), *([] if self.end_id is None else [self.end_id])]

    def drawn(self, may_end: bool) -> int:
        """Noise values one sampled token takes: the top-k set's size (0 when greedy)."""
        return 0 if self.top_k == 1 else min(self.top_k, self.candidates(may_end))


@dataclass(frozen=True)
class TrackRequest:
    """One track to decode: its prompt, what to generate (its SongPlan), its seed; `tag` is the caller's."""

    prompt_ids: tuple[int, ...]
    plan: SongPlan
    seed: int
    tag: object = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a track needs a non-empty prompt")
        if self.plan.limit < 1:
            raise ValueError(f"a track needs a frame limit >= 1, got {self.plan.limit}")

    @property
    def positions(self) -> int:
        """The cache positions this track uses, and the key length it attends over, alone: the prompt, then
        two tokens per frame (what the reference loop resets the engine's cache to)."""
        return len(self.prompt_ids) + COARSE_CODEBOOKS * self.plan.limit


@dataclass(frozen=True)
class SlotUpdate:
    """What one block did to one slot: frames written so far, and the codes [2, frames] once it finished."""

    slot: int
    request: TrackRequest
    frames: int
    finished: bool
    codes: Tensor | None = None


@dataclass
class _Occupant:
    """Host-side bookkeeping of an occupied slot (its device state lives in the decoder's [N, ...] tensors)."""

    request: TrackRequest
    generator: torch.Generator
    heads: tuple[Tensor, ...]  # per codebook, the output rows its tokens are sampled from
    frame: int = 0

    @property
    def candidate_key(self) -> tuple:
        """What its heads are made of (their candidate ids follow from it): slots with equal keys share heads."""
        plan = self.request.plan
        return plan.window_starts, plan.codebook_size, plan.end_id

    def may_end(self) -> bool:
        return self.request.plan.may_end(self.frame)

    def sampler(self) -> _Sampler:
        """How it samples now (its plan's sampler in its current phase)."""
        plan, may_end = self.request.plan, self.may_end()
        return _Sampler(plan.top_k, plan.temperature, plan.candidates(may_end), plan.drawn(may_end))

    def frames_to_next_phase(self) -> int:
        """Frames until this track's sampling changes (end-of-text becomes a candidate) or it hits its limit."""
        plan = self.request.plan
        stop = plan.limit
        if plan.end_id is not None and not self.may_end():
            stop = min(stop, plan.min_frames)
        return stop - self.frame


@dataclass
class PausedTrack:
    """A track taken out of its slot mid-song with everything it needs to go on (SlotDecoder.pause): its host-side
    bookkeeping and a copy of its rows of the device state, in host memory (the KV cache up to its position)."""

    occupant: _Occupant
    keys: list[Tensor]  # per layer, [groups, position, head_dim]
    values: list[Tensor]
    state: dict[str, Tensor]  # its row of each per-slot tensor (PAUSED_ROWS)
    logits: Tensor  # its next token's candidate logits, already run (as wide as the buffer was then)

    @property
    def request(self) -> TrackRequest:
        return self.occupant.request


# the per-slot device tensors a paused track takes along (the KV cache aside; `end_choice` and `noise` are set
# afresh at each block's start)
PAUSED_ROWS = (
    "visible",
    "tokens",
    "position",
    "frame",
    "choice",
    "ended",
    "lengths",
    "codes",
    "window_start",
    "end_token",
)


@dataclass(frozen=True)
class _Sampler:
    """How a slot samples during a block (top-k, temperature, candidate count, noise values drawn): the slots that
    sample alike share one batched topk/softmax/argmax. A frame computes each sampler in use over every row and
    keeps it for the rows whose `sampler_of` names it, so which slots use which sampler is device data, not the
    frame's structure."""

    top_k: int
    temperature: float
    candidates: int
    drawn: int


ROW_TILE = 16  # rows per product in batched_matmul mode (see _linear)
KEY_BLOCK = 64  # keys per block of batched_matmul mode's attention (see _attention_blocks)
ALL_ROWS = -1  # the key of `masks` holding one mask for every row (batched_matmul's decode)
# captured frames a decoder keeps: a whole frame's configurations come and go as its tracks' samplers change phase
# (e.g. a song's set goes {window} -> {window, window + end} -> {window + end} and back as tracks join)
GRAPHS_KEPT = 8


class RecentlyUsed(Generic[T]):
    """Values made on demand by key, the `kept` most recently used of them kept (a decoder's captured frames: a
    whole frame's configuration comes back as its tracks' samplers change phase, and a capture costs frames)."""

    def __init__(self, kept: int):
        self.kept = kept
        self._values: dict[Hashable, T] = {}  # least recently used first

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        value = self._values.pop(key, None)
        if value is None:
            while len(self._values) >= self.kept:
                del self._values[next(iter(self._values))]
            value = make()
        self._values[key] = value
        return value

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)


def whole_key_blocks(positions: int) -> int:
    """`positions` rounded up to whole KEY_BLOCKs."""
    return -(-positions // KEY_BLOCK) * KEY_BLOCK


class SlotDecoder:
    """Up to `slots` tracks decoding together on a TorchCausalLM's model, each joining and leaving on its own.

    `max_len` bounds the positions of one track (prompt + 2 x frame limit); the KV cache holds slots x max_len.
    The engine's own cache is not used (the reference loop on the same engine may run before or after).
    `batched_matmul`: one batch-invariant matmul for all slots instead of the engine's own per-row call (module
    docstring: faster, bitwise equal across batches, but not bitwise the engine's alone logits).
    `use_graphs` (CUDA only): each block's frame runs as a CUDA graph, captured when the slots' configuration
    (who runs, each one's key length, candidates and sampler) differs from the last block's: no per-kernel launch
    cost, at the price of a capture (about two frames) per configuration. With batched_matmul the frame is whole
    (`whole_frame`, which a CPU may run without graphs), and the configuration only the samplers and candidate
    sets in use.
    """

    def __init__(
        self,
        lm: TorchCausalLM,
        slots: int,
        max_len: int,
        *,
        check_every: int = DEFAULT_CHECK_EVERY,
        batched_matmul: bool = False,
        use_graphs: bool = False,
        whole_frame: bool | None = None,
        fused_attention: bool | None = None,
    ):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if use_graphs and lm.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {lm.device}")
        cuda = lm.device.type == "cuda"
        whole_frame = batched_matmul and (use_graphs or cuda) if whole_frame is None else whole_frame
        if whole_frame and not batched_matmul:
            raise ValueError("a whole frame needs batched_matmul (the exact mode runs its linears per occupied row)")
        fused_attention = whole_frame and cuda if fused_attention is None else fused_attention
        if fused_attention and not whole_frame:
            raise ValueError("fused attention needs a whole frame (its key count must not change with the slots)")
        shape = lm.model.shape
        if not 1 <= max_len <= shape.max_len:
            raise ValueError(f"max_len must be in 1..{shape.max_len} (the model's positions), got {max_len}")
        self.lm, self.model, self.shape = lm, lm.model, shape
        self.slots, self.max_len = slots, max_len
        # the cache in whole KEY_BLOCKs (batched_matmul's attention reads blocks; the positions past max_len are
        # never visible)
        self.cache_len = whole_key_blocks(max_len)
        self.key_cut = self.cache_len  # keys batched attention reads this block (_begin_block sets it)
        self.row_reach = slots  # rows a frame runs the model on this block (_begin_block sets it)
        self.check_every = max(1, check_every)
        self.frames_stepped = 0  # frames run by every block so far, whatever the slots held (the engine's tally)
        self.rows_stepped = 0  # rows the model ran on, over those frames (row_reach x frames: the engine's tally)
        self.batched_matmul = batched_matmul
        self.use_graphs = use_graphs
        self.whole_frame = whole_frame
        self.fused_attention = fused_attention
        self.device, self.dtype = lm.device, lm.dtype
        # captured frames by configuration (at most GRAPHS_KEPT), in one memory pool
        self._graphs: RecentlyUsed[torch.cuda.CUDAGraph] = RecentlyUsed(GRAPHS_KEPT)
        self._graph_pool = torch.cuda.graph_pool_handle() if use_graphs else None
        # whole_frame: this block's distinct candidate sets (`head_of` indexes them in this order), a head per codebook
        self._frame_heads: dict[tuple, tuple[Tensor, ...]] = {}
        self._occupants: dict[int, _Occupant] = {}
        self._head_cache: dict[tuple[int, ...], Tensor] = {}
        self._views: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}
        self._masks: dict[tuple[int, int], Tensor] = {}
        self._allocate()

    # -- state, allocated once ------------------------------------------------------------------------
    def _allocate(self) -> None:
        n, s, device = self.slots, self.shape, self.device
        cache = (n, s.groups, self.cache_len, s.head_dim)
        self.keys = [torch.zeros(cache, device=device, dtype=self.dtype) for _ in range(s.num_layers)]
        self.values = [torch.zeros(cache, device=device, dtype=self.dtype) for _ in range(s.num_layers)]
        # which cache positions each slot's next token sees, already repeated per query head of a group (the
        # layout Attention gives its mask)
        self.visible = torch.zeros(n, 1, s.heads // s.groups, self.cache_len, dtype=torch.bool, device=device)
        # True, as a device tensor: what a token writes into `visible` (a Python True is a host value)
        self.seen = torch.ones((), dtype=torch.bool, device=device)
        self.cos, self.sin = rope_tables(s, self.max_len, device)
        self.rows = torch.arange(n, device=device)
        self.occupied = self._longs(n)  # 1 where a track sits: positions and frames advance by it
        self.tokens = self._longs(n, 1)
        self.position = self._longs(n)
        self.frame = self._longs(n)
        self.choice = self._longs(n)
        self.ended = torch.zeros(n, dtype=torch.bool, device=device)
        self.lengths = self._longs(n)
        self.codes = self._longs(n, COARSE_CODEBOOKS, self.max_len // COARSE_CODEBOOKS)
        self.window_start = self._longs(n, COARSE_CODEBOOKS)
        self.end_token = self._longs(n)  # what an ended track feeds: its end id
        self.end_choice = self._longs(n).fill_(-1)  # the choice that ends a track this block (-1: none)
        self.logits = torch.zeros(n, 1, device=device)  # widened on admission to the largest candidate count
        self.noise = torch.ones(n, COARSE_CODEBOOKS * self.check_every, 1, device=device)
        self.noise_step = self._longs(1)
        self.sampler_of = self._longs(n)  # each slot's index in this block's samplers (_samplers)
        self.head_of = self._longs(n)  # whole_frame: each slot's index in this block's candidate sets

    def _longs(self, *size: int) -> Tensor:
        return torch.zeros(*size, dtype=torch.long, device=self.device)

    def _widen(self, candidates: int, drawn: int) -> None:
        """Grow the logits and noise buffers to a newcomer's needs (their contents are rewritten before use)."""
        n = self.slots
        if candidates > self.logits.shape[1]:
            wider = torch.zeros(n, candidates, device=self.device)
            wider[:, : self.logits.shape[1]] = self.logits
            self.logits = wider
            self._graphs.clear()  # they read the old buffer
        if drawn > self.noise.shape[2]:
            self.noise = torch.ones(n, COARSE_CODEBOOKS * self.check_every, drawn, device=self.device)
            self._graphs.clear()

    # -- occupancy --------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> list[int]:
        return [slot for slot in range(self.slots) if slot not in self._occupants]

    @property
    def occupants(self) -> dict[int, TrackRequest]:
        return {slot: occupant.request for slot, occupant in self._occupants.items()}

    def admit(self, request: TrackRequest) -> int:
        """Put a track in a free slot (between blocks) and prefill its prompt there; returns the slot.

        Only that slot's cache row and state change: the prefill runs on its row alone, with the shapes the
        track has alone, so the running slots and the newcomer's own codes are as if each were alone."""
        if request.positions > self.max_len:
            raise ValueError(f"a track of {request.positions} positions does not fit in slots of {self.max_len}")
        free = self.free_slots
        if not free:
            raise RuntimeError("no free slot: wait for a track to finish")
        slot, plan = free[0], request.plan
        occupant = _Occupant(
            request,
            torch.Generator(device=self.device).manual_seed(request.seed),
            tuple(self._head(plan, q) for q in range(COARSE_CODEBOOKS)),
        )
        self._widen(len(plan.candidate_ids(0)), max(plan.drawn(False), plan.drawn(True), 1))
        with torch.inference_mode():
            self._reset_row(slot, request)
            first = self._prefill(slot, request)
            self.logits[slot, : first.shape[0]] = first
        self._occupants[slot] = occupant
        return slot

    def pause(self, slot: int) -> PausedTrack:
        """Take a running track out of its slot between blocks, keeping all it needs to go on (for a newcomer that
        should not wait for the slots to free: preemption without recomputation). Its slot is free. `resume`
        puts it back in any free slot, and it goes on as if it had never left: a row's result depends on that row
        alone, wherever it lies (module docstring), so its codes stay those it gets alone."""
        occupant = self._occupants.get(slot)
        if occupant is None:
            raise KeyError(f"slot {slot} is empty")
        host = torch.device("cpu")
        seen = int(self.position[slot])
        paused = PausedTrack(
            occupant,
            [keys[slot, :, :seen].to(host, copy=True) for keys in self.keys],
            [values[slot, :, :seen].to(host, copy=True) for values in self.values],
            {name: getattr(self, name)[slot].to(host, copy=True) for name in PAUSED_ROWS},
            self.logits[slot].to(host, copy=True),
        )
        self.cancel(slot)
        return paused

    def resume(self, paused: PausedTrack) -> int:
        """Put a paused track back, in the first free slot (between blocks); returns the slot."""
        free = self.free_slots
        if not free:
            raise RuntimeError("no free slot: wait for a track to finish")
        slot = free[0]
        with torch.inference_mode():
            for keys, values, kept_keys, kept_values in zip(
                self.keys, self.values, paused.keys, paused.values, strict=True
            ):
                keys[slot].zero_()  # as its own row held them: zeros past its position
                values[slot].zero_()
                keys[slot, :, : kept_keys.shape[1]] = kept_keys.to(self.device)
                values[slot, :, : kept_values.shape[1]] = kept_values.to(self.device)
            for name in PAUSED_ROWS:
                getattr(self, name)[slot] = paused.state[name].to(self.device)
            self.logits[slot] = 0  # the buffer may have widened meanwhile; its first columns are the track's
            self.logits[slot, : paused.logits.shape[0]] = paused.logits.to(self.device)
            self.end_choice[slot] = -1
            self.occupied[slot] = 1
        self._forget_views(slot)
        self._occupants[slot] = paused.occupant
        return slot

    def cancel(self, slot: int) -> TrackRequest:
        """Drop a track (canceled, or failed elsewhere) and free its slot; the other slots go on unchanged."""
        occupant = self._occupants.pop(slot, None)
        if occupant is None:
            raise KeyError(f"slot {slot} is empty")
        self.occupied[slot] = 0
        self.position[slot] = 0  # an empty row keeps running on position 0 and frame 0 of its own row
        self.frame[slot] = 0
        self.ended[slot] = False
        return occupant.request

    def close(self) -> None:
        """Free the cache; the decoder is unusable after this."""
        self._occupants.clear()
        self._views.clear()
        self._masks.clear()
        self._graphs.clear()
        self.keys, self.values = [], []

    def _reset_row(self, slot: int, request: TrackRequest) -> None:
        """A clean row for a newcomer: zeros in its cache (as alone: a fresh cache), its plan's constants."""
        plan, prompt = request.plan, len(request.prompt_ids)
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[slot].zero_()
            values[slot].zero_()
        self._forget_views(slot)
        self.visible[slot] = False
        self.visible[slot, ..., :prompt] = True
        self.position[slot] = prompt
        self.frame[slot] = 0
        self.tokens[slot] = 0
        self.choice[slot] = 0
        self.ended[slot] = False
        self.lengths[slot] = plan.limit
        self.codes[slot] = 0
        self.window_start[slot] = torch.tensor(plan.window_starts, device=self.device)
        self.end_token[slot] = plan.end_id if plan.end_id is not None else 0
        self.end_choice[slot] = -1
        self.logits[slot] = 0
        self.occupied[slot] = 1

    def _forget_views(self, slot: int) -> None:
        """Drop the cache and mask views made for the slot's last occupant (of its key length, not the next's)."""
        self._views = {key: view for key, view in self._views.items() if key[1] != slot}
        self._masks = {key: mask for key, mask in self._masks.items() if key[0] != slot}

    def _decode_mask(self, slot: int, seen: int) -> Tensor:
        """A slot's mask [1, 1, heads per group, seen] for its next token: a view of `visible`, made once."""
        mask = self._masks.get((slot, seen))
        if mask is None:
            mask = self._masks[(slot, seen)] = self.visible[slot : slot + 1, :, :, :seen]
        return mask

    def _head(self, plan: SongPlan, q: int) -> Tensor:
        """The output rows codebook q's tokens are sampled from (its window, then end-of-text), shared by slots."""
        ids = tuple(plan.candidate_ids(q))
        head = self._head_cache.get(ids)
        if head is None:
            rows = torch.tensor(ids, device=self.device)
            head = self._head_cache[ids] = self.model.output.weight.index_select(0, rows).contiguous()
        return head

    # -- the model, per row where a kernel is not batch-invariant (module docstring) -----------------
    def _prefill(self, slot: int, request: TrackRequest) -> Tensor:
        """Run the prompt through slot `slot`'s cache row, as the engine's prefill does for a track alone; the
        candidate logits of codebook 0 for its first token."""
        ids = torch.tensor(request.prompt_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(ids.numel(), device=self.device)
        keys = torch.arange(request.positions, device=self.device)
        visible = (keys[None, :] <= positions[:, None])[None, None]  # [1, 1, T, keys], as TorchCausalLM builds it
        per_group = self.shape.heads // self.shape.groups
        masks = {0: visible.repeat(1, 1, per_group, 1)}
        if self.batched_matmul:  # the same mask over whole key blocks (none visible past the prompt)
            cut = self._blocks_of(ids.numel())
            block_mask = torch.zeros(1, 1, masks[0].shape[-2], cut, dtype=torch.bool, device=self.device)
            seen = min(cut, masks[0].shape[-1])
            block_mask[..., :seen] = masks[0][..., :seen]
            masks = {0: block_mask}
        row = self.rows[slot : slot + 1]
        hidden = self._hidden(self.model.embedding(ids[None]), [slot], row, [0], positions[None], masks)
        full = self.model.output(hidden).float()[:, -1]  # the full head over the prompt, as the engine's prefill
        return full[0].index_select(0, torch.tensor(request.plan.candidate_ids(0), device=self.device))

    def _hidden(
        self,
        x: Tensor,
        slot_of_row: Sequence[int],
        slots: Tensor,
        live: Sequence[int],
        positions: Tensor,
        masks: dict[int, Tensor],
    ) -> Tensor:
        """Final-norm hidden states [R, T, hidden] of input embeddings x [R, T, hidden]: row r is slot
        slot_of_row[r] (`slots`: the same on the device, made once: a CUDA graph cannot upload host values) at
        positions[r]; the per-row kernels run for the rows in `live` only (the others are empty slots: zeros).
        `masks[r]` is row r's attention mask [1, 1, heads per group x T, its key length]."""
        for layer, block in enumerate(self.model.blocks):
            assert isinstance(block, Block)
            h = block.attention_norm(x)
            x = x + self._attention(block.attention, h, layer, slot_of_row, slots, live, positions, masks)
            x = x + self._feed_forward(block.ffn, block.ffn_norm(x), live)
        return self.model.norm(x)

    def _attention(
        self,
        attention: Attention,
        x: Tensor,
        layer: int,
        slot_of_row: Sequence[int],
        slots: Tensor,
        live: Sequence[int],
        positions: Tensor,
        masks: dict[int, Tensor],
    ) -> Tensor:
        """Attention.forward with per-row positions and cache rows: projections per row, RoPE and the cache
        write batched, then each live row attends over its own cache row's first `key length` positions."""
        s = self.shape
        rows, length, _ = x.shape
        qkv = self._linear(attention.qkv, x, live)
        q, k, v = qkv.split([s.heads * s.head_dim, s.groups * s.head_dim, s.groups * s.head_dim], dim=-1)
        q = q.view(rows, length, s.heads, s.head_dim).transpose(1, 2)
        k = k.view(rows, length, s.groups, s.head_dim).transpose(1, 2)
        v = v.view(rows, length, s.groups, s.head_dim).transpose(1, 2)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [R, 1, T, head_dim]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = self.keys[layer], self.values[layer]
        keys[slots[:, None], :, positions] = k.transpose(1, 2)  # [R, T, groups, head_dim] into each row's own positions
        values[slots[:, None], :, positions] = v.transpose(1, 2)
        q = q.reshape(rows, s.groups, (s.heads // s.groups) * length, s.head_dim)
        if self.batched_matmul:
            if self.fused_attention and ALL_ROWS in masks:
                y = self._attention_fused(q, layer, masks[ALL_ROWS]).view(rows, s.heads, length, s.head_dim)
            else:
                y = self._attention_blocks(q, layer, slots, masks).view(rows, s.heads, length, s.head_dim)
            return self._linear(attention.out, y.transpose(1, 2).reshape(rows, length, s.heads * s.head_dim), live)
        outs: dict[int, Tensor] = {}
        for r in live:
            mask = masks[r]
            keys_r, values_r = self._cache_row(layer, slot_of_row[r], mask.shape[-1])
            outs[r] = F.scaled_dot_product_attention(q[r : r + 1], keys_r, values_r, attn_mask=mask)
        y = self._stack(outs, rows).view(rows, s.heads, length, s.head_dim)
        return self._linear(attention.out, y.transpose(1, 2).reshape(rows, length, s.heads * s.head_dim), live)

    def _attention_fused(self, q: Tensor, layer: int, mask: Tensor) -> Tensor:
        """A whole frame's attention on CUDA: one masked scaled_dot_product_attention over every slot's whole cache
        row, q [R, groups, queries, head_dim] (rows: every slot). Its key count and row count never change in an
        engine, so the kernel runs on the same shapes every frame, whichever slots are occupied: a row's bits depend
        on its own row only (an output row of attention reads its own query and cache row), without the key blocks
        that make `_attention_blocks` independent of a changing key count (two kernels per block of 64 keys: some
        800 a layer at Khala's 25,600 positions, where this is one call). Not the bits of `_attention_blocks`: a
        deployment's engines share one device kind and one slot count."""
        rows = q.shape[0]
        keys, values = self.keys[layer][:rows], self.values[layer][:rows]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        # an empty slot's row: 0, as the other paths leave it (whatever it saw)
        return torch.where(self.occupied[:rows].bool()[:, None, None, None], out, out.new_zeros(()))

    def _attention_blocks(self, q: Tensor, layer: int, slots: Tensor, masks: dict[int, Tensor]) -> Tensor:
        """batched_matmul's attention: one call for every row, q [R, groups, queries, head_dim] over the cache rows
        of `slots`, masked by `masks` (every slot's [R, 1, queries, cut] under ALL_ROWS, or a prefill's row 0), whose
        bits depend neither on the other rows nor on how many keys are read past a row's own (the CPU's fused
        kernel sums keys in an order set by the key count). Keys are read in whole KEY_BLOCKs from position 0:
        - the scores are one product per (row, group) over the cut's keys: each a dot of head_dim, and the key
          count always a multiple of KEY_BLOCK (measured invariant; a broadcast matmul over blocks was not);
        - the max is exact; the exp-sum is one reduction of KEY_BLOCK per block, then the blocks' sums added one
          after the other in position order (cumsum);
        - the weighted values are one product per block (KEY_BLOCK long, batched over rows and groups: the cache's
          own memory, no copy), added one after the other in position order.
        A block past a row's last visible key adds exact zeros, so the cut may be anything past it."""
        every_slot = ALL_ROWS in masks  # rows are the first slots (row_reach of them), in order
        mask = masks[ALL_ROWS if every_slot else 0]
        rows, groups, queries, dim = q.shape
        cut = mask.shape[-1]
        keys, values = self.keys[layer][:, :, :cut], self.values[layer][:, :, :cut]
        if every_slot:
            keys, values = keys[:rows], values[:rows]
        else:  # a prefill's row: a copy of its slot's
            keys, values = keys.index_select(0, slots), values.index_select(0, slots)
        scores = torch.matmul(q * dim**-0.5, keys.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # [R, G, Q, cut]
        total = weights.view(rows, groups, queries, cut // KEY_BLOCK, KEY_BLOCK).sum(dim=-1).cumsum(dim=-1)[..., -1]
        flat_weights = weights.view(rows * groups, queries, cut)
        flat_values = values.reshape(rows * groups, cut, dim)  # a view: rows and groups merge in the cache
        summed = torch.bmm(flat_weights[:, :, :KEY_BLOCK], flat_values[:, :KEY_BLOCK])
        for start in range(KEY_BLOCK, cut, KEY_BLOCK):
            block = slice(start, start + KEY_BLOCK)
            summed = summed + torch.bmm(flat_weights[:, :, block], flat_values[:, block])
        out = summed.view(rows, groups, queries, dim) / total[..., None]
        if every_slot:  # an empty slot sees no key (0 / 0): its row is 0, as the per-row path leaves it
            out = torch.where(self.occupied[:rows].bool()[:, None, None, None], out, out.new_zeros(()))
        return out

    def _cache_row(self, layer: int, slot: int, seen: int) -> tuple[Tensor, Tensor]:
        """Keys and values [1, groups, seen, head_dim] of one slot's cache row: views, made once."""
        key = (layer, slot, seen)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = (
                self.keys[layer][slot : slot + 1, :, :seen],
                self.values[layer][slot : slot + 1, :, :seen],
            )
        return view

    def _feed_forward(self, ffn: FeedForward, x: Tensor, live: Sequence[int]) -> Tensor:
        """FeedForward.forward. F.silu's vectorized and scalar paths differ in the last bit, so which elements
        of a row take which path must not depend on the batch: it runs once per row, as alone. With
        batched_matmul, SiLU is x / (1 + exp(-x)) for all rows at once instead: exp and the arithmetic give the
        same bits on both paths (measured), so the result of an element does not depend on where it lies."""
        gate, up = self._linear(ffn.gate_up, x, live).split(ffn.ffn, dim=-1)
        if self.batched_matmul:
            act = gate / (1 + torch.exp(-gate)) * up
        else:
            act = self._stack({r: F.silu(gate[r : r + 1]) * up[r : r + 1] for r in live}, x.shape[0])
        return self._linear(ffn.down, act, live)

    def _linear(self, layer: nn.Linear, x: Tensor, live: Sequence[int]) -> Tensor:
        """`layer`(x) for x [R, T, in]. Default: once per live row, the very call a track alone makes ([1, T, in]:
        a 1-row product), zeros for empty slots. `batched_matmul`: products over tiles of exactly ROW_TILE rows
        (zeros pad the last): on a CPU the layer's own oneDNN product of the tile (torch_engine.Linear), elsewhere
        (W @ x^T)^T; either way the kernel and its blocking are the same whatever the row count, so a row's bits
        do not depend on its neighbours (tests/test_slots.py, tests/test_torch_engine.py; with one bare product of
        all rows they did on the AMD EPYC): batch-invariant, but not the bits of the 1-row product the engine
        alone computes."""
        if not self.batched_matmul:
            return self._stack({r: layer(x[r : r + 1]) for r in live}, x.shape[0])
        rows, length, width = x.shape
        flat = x.reshape(rows * length, width)
        pad = -flat.shape[0] % ROW_TILE
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, width)])
        tiles = flat.split(ROW_TILE)  # one product per tile: the kernel sees one shape whatever the number of slots
        if isinstance(layer, Linear) and layer.packs(flat):  # oneDNN's packed product (a CPU): invariant in its tile
            out = torch.cat([layer(tile) for tile in tiles])
        else:
            bias = layer.bias[:, None] if layer.bias is not None else torch.zeros(1, 1, device=x.device, dtype=x.dtype)
            # torch.cat gives a contiguous [rows, out] as nn.Linear returns it: the strides of a transposed result
            # would change how attention's kernel reads q, and with it the last bits
            out = torch.cat([torch.addmm(bias, layer.weight, tile.t()).t() for tile in tiles])
        return out[: rows * length].view(rows, length, layer.out_features)

    @staticmethod
    def _stack(outs: dict[int, Tensor], rows: int) -> Tensor:
        """Rows [1, T, width] (at least one) back into one [rows, T, width] tensor, zeros for the rows not
        computed (empty slots)."""
        if rows == 1 and len(outs) == 1:  # one slot: its row already is the tensor (a copy would be the same bits)
            return outs[0]
        if len(outs) == rows:
            return torch.cat([outs[r] for r in range(rows)])
        zeros = torch.zeros_like(next(iter(outs.values())))
        return torch.cat([outs.get(r, zeros) for r in range(rows)])

    # -- one block ----------------------------------------------------------------------------------------
    def step_block(self, most: int | None = None) -> list[SlotUpdate]:
        """Decode up to check_every frames (or `most`, if fewer) for every occupied slot; what happened to each.
        A finished slot is free when this returns (its codes are in its update). The block is cut short where a
        slot's sampling changes phase or it reaches its limit, so each slot draws its noise as it does alone; a
        block's length never changes a track's codes (its noise is a stream: tests/test_slots.py)."""
        live = sorted(self._occupants)
        if not live:
            return []
        longest = self.check_every if most is None else max(1, min(most, self.check_every))
        frames = min(longest, *(self._occupants[slot].frames_to_next_phase() for slot in live))
        with torch.inference_mode():
            samplers = self._begin_block(live, frames)
            self.frames_stepped += frames
            self.rows_stepped += frames * self.row_reach
            for _ in range(frames):
                self._run_frame(live, samplers)
            ended, lengths = self.ended.tolist(), self.lengths.tolist()  # the one host read per block
        return [self._after_block(slot, frames, ended[slot], lengths[slot]) for slot in live]

    def _begin_block(self, live: Sequence[int], frames: int) -> list[_Sampler]:
        """Set up a block of `frames` frames: each slot's noise, the choice that ends each track (end-of-text,
        once it is a candidate; -1: none), which sampler (and, whole_frame, which candidate set) each slot uses;
        the samplers its frames run."""
        self._draw_noise(live, frames)
        for slot in live:
            occupant = self._occupants[slot]
            self.end_choice[slot] = occupant.request.plan.codebook_size if occupant.may_end() else -1
        if self.batched_matmul and not self.whole_frame:  # a whole frame keeps its shapes: it reads the whole cache
            reach = max(
                len(self._occupants[slot].request.prompt_ids)
                + COARSE_CODEBOOKS * (self._occupants[slot].frame + frames)
                for slot in live
            )
            self.key_cut = self._blocks_of(reach)
            self.row_reach = self._tiles_up_to(max(live))
        if self.whole_frame:
            self._frame_heads = self._index_candidate_sets(live)
        return self._samplers(live)

    def _tiles_up_to(self, slot: int) -> int:
        """Rows from 0 through whole ROW_TILEs to `slot` (within the slots): batched_matmul's frame runs the model on
        these rows only, so the tiles past the last occupied slot cost nothing. Admission takes the lowest free slot,
        so the tracks gather in the first tiles. A row's bits do not depend on how many rows run with it (the
        products go tile by tile; the rest is batch-invariant: module docstring), so the reach never changes a
        track's codes (tests/test_slots.py)."""
        return min(self.slots, (slot // ROW_TILE + 1) * ROW_TILE)

    def _blocks_of(self, positions: int) -> int:
        """`positions` keys rounded up to whole KEY_BLOCKs, within the cache."""
        return min(self.cache_len, whole_key_blocks(positions))

    def frame_step(self, live: Sequence[int], samplers: Sequence[_Sampler]) -> None:
        """One frame (q0 then q1) for every occupied slot; capture-safe: tensors only, no host reads. A whole frame
        ignores `live`: it runs every slot's row the same way, whichever are occupied."""
        rows = range(self.slots) if self.whole_frame else live
        for q in range(COARSE_CODEBOOKS):
            self._token(q, rows, samplers)
        self.frame.add_(self.occupied)

    def _run_frame(self, live: Sequence[int], samplers: list[_Sampler]) -> None:
        if not self.use_graphs:
            self.frame_step(live, samplers)
            return
        configuration = self._configuration(live, samplers)
        self._graphs.get(configuration, lambda: self._capture(live, samplers)).replay()

    def _configuration(self, live: Sequence[int], samplers: Sequence[_Sampler]) -> tuple:
        """What a captured frame holds fixed. A whole frame: only the samplers and candidate sets in use (which
        slot uses which is device data), so tracks join and leave without a new capture. Otherwise: which slots
        run, and each one's key length (its mask and cache views), candidate rows (its heads) and sampler."""
        if self.whole_frame:
            return tuple(samplers), tuple(self._frame_heads)
        occupants = [(slot, self._occupants[slot]) for slot in live]
        return tuple((slot, o.request.positions, o.candidate_key, o.sampler()) for slot, o in occupants)

    def _capture(self, live: Sequence[int], samplers: Sequence[_Sampler]) -> torch.cuda.CUDAGraph:
        """Capture one frame as a CUDA graph. Warm-up runs a real frame on a side stream, so the state it
        changes is put back before capturing (the KV entries it wrote are rewritten by the replay)."""
        state = [
            self.logits,
            self.tokens,
            self.position,
            self.frame,
            self.choice,
            self.noise_step,
            self.codes,
            self.ended,
            self.lengths,
            self.visible,
        ]
        saved = [tensor.clone() for tensor in state]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.frame_step(live, samplers)
        torch.cuda.current_stream().wait_stream(stream)
        for tensor, value in zip(state, saved, strict=True):
            tensor.copy_(value)
        graph = torch.cuda.CUDAGraph()
        # the graphs share one pool: a frame's temporaries are dead when it ends (its results are written into the
        # decoder's own buffers, never read from a graph's), and frames never run at once
        with torch.cuda.graph(graph, pool=self._graph_pool):  # records the kernels without running them
            self.frame_step(live, samplers)
        return graph

    def _after_block(self, slot: int, frames: int, ended: bool, length: int) -> SlotUpdate:
        occupant = self._occupants[slot]
        occupant.frame += frames
        request = occupant.request
        if not (ended or occupant.frame >= request.plan.limit):
            return SlotUpdate(slot, request, occupant.frame, finished=False)
        codes = self.codes[slot, :, :length].cpu().clone()
        self.cancel(slot)
        return SlotUpdate(slot, request, length, finished=True, codes=codes)

    def _samplers(self, live: Iterable[int]) -> list[_Sampler]:
        """The distinct samplers of the occupied slots this block, in a fixed order (the same set gives the same
        list, so a captured whole frame is replayed), and each slot's index among them into `sampler_of`."""
        return self._index_distinct(self.sampler_of, {slot: self._occupants[slot].sampler() for slot in live})

    def _index_candidate_sets(self, live: Iterable[int]) -> dict[tuple, tuple[Tensor, ...]]:
        """whole_frame: the distinct candidate sets of the occupied slots (their heads, by their candidate ids), in
        a fixed order, and each slot's index among them into `head_of`. A deployment's tracks share one (its
        profile's windows and end id), so a frame usually computes one head per row."""
        key_of = {slot: self._occupants[slot].candidate_key for slot in live}
        heads = {key_of[slot]: self._occupants[slot].heads for slot in key_of}
        return {key: heads[key] for key in self._index_distinct(self.head_of, key_of)}

    def _index_distinct(self, target: Tensor, value_of: dict[int, _Key]) -> list[_Key]:
        """The distinct values of the slots in `value_of`, sorted by their repr (a fixed order for any values: an
        end id may be None, which does not compare with an int), so the same set always gives the same list; each
        slot's index in it written into the per-slot device tensor `target` in one upload (empty slots get 0: any
        index serves them, their rows are never read)."""
        distinct = sorted(set(value_of.values()), key=repr)
        indices = [distinct.index(value_of[slot]) if slot in value_of else 0 for slot in range(self.slots)]
        target.copy_(torch.tensor(indices, dtype=torch.long))
        return distinct

    def _draw_noise(self, live: Iterable[int], frames: int) -> None:
        """Each slot's Exp(1) noise for the next `frames` frames from its own generator: the values its track
        draws alone for these tokens, in the same order (the generator is a stream; block sizes do not matter)."""
        self.noise_step.zero_()
        for slot in live:
            occupant = self._occupants[slot]
            drawn = occupant.sampler().drawn
            if drawn:
                self.noise[slot, : COARSE_CODEBOOKS * frames, :drawn].exponential_(1, generator=occupant.generator)

    def _sample(self, samplers: Sequence[_Sampler]) -> None:
        """One code per row into self.choice: temperature, top-k, then the exponential race with the slot's own
        noise (the code multinomial would draw). Each sampler runs over every row the model ran on (topk, softmax
        and argmax compute a row from that row alone) and a row keeps the choice of its own (`sampler_of`)."""
        reach = self.row_reach
        logits_all, noise_all, choice = self.logits[:reach], self.noise[:reach], self.choice[:reach]
        for index, sampler in enumerate(samplers):
            logits = logits_all[:, : sampler.candidates]
            if sampler.top_k == 1:
                picked = logits.argmax(dim=-1)
            else:
                values, indices = torch.topk(logits / sampler.temperature, sampler.drawn, dim=-1)
                probs = torch.softmax(values, dim=-1)
                noise = noise_all.index_select(1, self.noise_step)[:, 0, : sampler.drawn]
                picked = indices.gather(-1, (probs / noise).argmax(dim=-1, keepdim=True)).view(-1)
            if len(samplers) > 1:
                picked = torch.where(self.sampler_of[:reach] == index, picked, choice)
            choice.copy_(picked)
        self.noise_step.add_(1)

    def _token(self, q: int, rows: Sequence[int], samplers: Sequence[_Sampler]) -> None:
        """Codebook q for every slot: sample, record, feed, and leave the next token's candidate logits. `rows`: the
        slots whose candidate logits are computed (the occupied ones; a whole frame: all)."""
        self._sample(samplers)
        ending = (self.choice == self.end_choice) & ~self.ended
        self.lengths.copy_(torch.where(ending, self.frame, self.lengths))
        self.ended.logical_or_(ending)
        self.codes[self.rows, q, self.frame] = self.choice
        fed = torch.where(self.ended, self.end_token, self.window_start[:, q] + self.choice)
        self.tokens.copy_(fed.view(-1, 1))
        self.visible[self.rows, 0, :, self.position] = self.seen  # each slot now sees its new position
        reach = self.row_reach  # the rows the model runs on: every slot, or (batched_matmul) the tiles in use
        if self.batched_matmul:  # each row's `visible`, up to this block's key cut (_attention_blocks)
            masks = {ALL_ROWS: self.visible[:reach, :, :, : self.key_cut]}
        else:
            masks = {slot: self._decode_mask(slot, self._occupants[slot].request.positions) for slot in rows}
        tokens = self.model.embedding(self.tokens[:reach])
        hidden = self._hidden(tokens, range(reach), self.rows[:reach], rows, self.position[:reach, None], masks)
        self._candidate_logits((q + 1) % COARSE_CODEBOOKS, hidden, rows)
        self.position.add_(self.occupied)

    def _candidate_logits(self, q: int, hidden: Tensor, rows: Sequence[int]) -> None:
        """The logits of codebook q's candidates for each of `rows`: one 1-row product per row with its own head
        (the product a track alone makes). A whole frame takes each row's head from `head_of` (device data): every
        candidate set in use for every row, each row keeping its own."""
        if not self.whole_frame:
            for slot in rows:
                head = self._occupants[slot].heads[q]
                self.logits[slot, : head.shape[0]] = (hidden[slot : slot + 1, 0] @ head.t()).float()[0]
            return
        for index, heads in enumerate(self._frame_heads.values()):
            head = heads[q]
            width = head.shape[0]
            for row in rows:
                logits = (hidden[row : row + 1, 0] @ head.t()).float()[0]
                if len(self._frame_heads) > 1:
                    logits = torch.where(self.head_of[row] == index, logits, self.logits[row, :width])
                self.logits[row, :width] = logits


# -- sizing ---------------------------------------------------------------------------------------------


def kv_bytes_per_track(lm: TorchCausalLM, max_len: int) -> int:
    """Bytes of KV cache one slot of `max_len` positions takes (keys and values, every layer; the cache holds whole
    KEY_BLOCKs)."""
    s, positions = lm.model.shape, whole_key_blocks(max_len)
    return 2 * s.num_layers * s.groups * s.head_dim * positions * torch.empty(0, dtype=lm.dtype).element_size()


def default_slots(
    free_memory_bytes: int, kv_bytes_per_track: int, cap: int = DEFAULT_SLOT_CAP, *, usable: float = 0.8
) -> int:
    """How many slots fit: `usable` of the free device memory over one track's KV cache at max length, at most
    `cap`; 0 when not even one fits (the caller then decodes alone or waits). The rest of free memory is left
    for activations and the allocator's slack."""
    if kv_bytes_per_track < 1:
        raise ValueError(f"kv_bytes_per_track must be >= 1, got {kv_bytes_per_track}")
    return max(0, min(cap, int(free_memory_bytes * usable) // kv_bytes_per_track))


def open_slot_decoder(
    lm: TorchCausalLM,
    max_len: int,
    slots: int,
    *,
    memory_bytes: int | None = None,
    check_every: int = DEFAULT_CHECK_EVERY,
    batched_matmul: bool = False,
    use_graphs: bool = False,
) -> SlotDecoder:
    """A SlotDecoder of `slots` slots, or fewer (halving) when its cache does not fit: on a real out-of-memory
    error, or, when `memory_bytes` is given, when the cache would take more than that (a budget: e.g. what the
    worker leaves the backbone once the other stages' models are loaded). Raises when one slot does not fit."""
    per_track = kv_bytes_per_track(lm, max_len)
    while True:
        try:
            if memory_bytes is not None and slots * per_track > memory_bytes:
                raise torch.OutOfMemoryError(
                    f"{slots} slots need {slots * per_track} bytes of KV cache; the budget is {memory_bytes}"
                )
            return SlotDecoder(
                lm, slots, max_len, check_every=check_every, batched_matmul=batched_matmul, use_graphs=use_graphs
            )
        except torch.OutOfMemoryError:
            if slots <= 1:
                raise
            slots //= 2
            if lm.device.type == "cuda":
                torch.cuda.empty_cache()


def decode_queue(
    decoder: SlotDecoder,
    requests: Iterable[TrackRequest],
    on_update: Callable[[SlotUpdate], None] | None = None,
    block_frames: Iterator[int] | None = None,
) -> list[Tensor]:
    """Decode every request through `decoder`, admitting the next one whenever a slot frees (what a worker's
    loop does); codes [2, frames] per request, in request order. `block_frames`: each block's most frames."""
    pending = list(enumerate(requests))
    pending.reverse()
    order: dict[int, int] = {}  # slot -> index of the request in it
    codes: dict[int, Tensor] = {}
    while pending or decoder.occupants:
        while pending and decoder.free_slots:
            index, request = pending.pop()
            order[decoder.admit(request)] = index
        for update in decoder.step_block(None if block_frames is None else next(block_frames)):
            if on_update is not None:
                on_update(update)
            if update.finished:
                assert update.codes is not None
                codes[order.pop(update.slot)] = update.codes
    return [codes[index] for index in range(len(codes))]


def decode_song(
    lm: TorchCausalLM,
    prompt_ids: Sequence[int],
    plan: SongPlan,
    seeds: Sequence[int],
    report: Callable[[int], None] | None = None,
    *,
    check_every: int = DEFAULT_CHECK_EVERY,
    use_graphs: bool | None = None,
) -> list[Tensor]:
    """Codes [2, frames] of the tracks of one song (one prompt and plan, a seed each), through a SlotDecoder of
    one slot per track sized for them: what the backbone stage runs without the in-flight engine. Each track's
    codes are those the reference loop gives it alone.

    After each block `report(frames)` gets the frames written so far (it may raise, e.g. Canceled: the decoder
    is freed), except after the block in which the last track ended by sampling end-of-text: its length, not a
    count, is the news then. `use_graphs` None: CUDA graphs on a CUDA device."""
    requests = [TrackRequest(tuple(prompt_ids), plan, seed) for seed in seeds]
    graphs = lm.device.type == "cuda" if use_graphs is None else use_graphs
    decoder = SlotDecoder(lm, len(requests), requests[0].positions, check_every=check_every, use_graphs=graphs)
    codes: dict[int, Tensor] = {}
    try:
        slots = [decoder.admit(request) for request in requests]
        while decoder.occupants:
            updates = decoder.step_block()
            for update in updates:
                if update.finished:
                    assert update.codes is not None
                    codes[update.slot] = update.codes
            running = [update.frames for update in updates if not update.finished]  # in step: one song's tracks
            ended_by_model = all(track.shape[1] < plan.limit for track in codes.values())
            if plan.end_id is not None and not running and ended_by_model:
                break
            if report is not None:
                report(running[0] if running else plan.limit)
    finally:
        decoder.close()
    return [codes[slot] for slot in slots]
