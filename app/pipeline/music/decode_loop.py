"""The backbone's decode loop on the engine's device: no host round trip per token (the fast path).

backbone.generate_coarse_tracks is the reference loop: per token it samples on the host side of the engine
protocol (ids in, logits out, `int()` on every code). This loop does the same arithmetic with every per-token
value kept on the device, so that on a GPU one frame (two tokens) is a fixed sequence of kernels that a CUDA
graph can replay:
  - token ids, the position, the frame index, the codes, which tracks have ended and where, all live in
    device tensors allocated once and updated in place;
  - the output head computes only the rows that can be sampled: the next codebook's window, plus
    end-of-text when the model may end the song (2,049 of 130,304 rows for Khala);
  - sampling is torch.multinomial's own algorithm written out: for one draw without replacement it takes
    `argmax(probs / q)` with `q ~ Exp(1)` drawn from the track's generator. Here each track's noise for
    the next block of frames is drawn ahead, in one call on its own generator (the same values, in the same
    order, as one call per token on the CPU), so a track's codes are those the reference loop gives it;
  - progress, the cancel flag and "have all tracks ended?" are read once per block (`check_every` frames).
On a CUDA device each phase's frame is captured once as a CUDA graph and replayed (`use_graphs`); on the CPU
the same frame function runs eagerly. tests/test_decode_loop.py holds the parity and capture-safety tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from app.pipeline.control import StageControl
from app.pipeline.profiles import COARSE_CODEBOOKS, MusicProfile

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
        `min_frames` are written) or at `frame_limit`; what generate_coarse_tracks and the slot decoder's
        requests decode."""
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


class DeviceDecoder:
    """Decodes a batch of tracks that share a prompt on a TorchCausalLM, state on the device.

    One instance per song: `run()` resets the engine's cache, prefills, then decodes block by block.
    """

    def __init__(
        self,
        lm,
        prompt_ids: Sequence[int],
        plan: SongPlan,
        seeds: Sequence[int],
        *,
        check_every: int = DEFAULT_CHECK_EVERY,
        use_graphs: bool | None = None,
    ):
        self.lm, self.plan, self.prompt_ids = lm, plan, list(prompt_ids)
        self.device = lm.device
        self.batch = len(seeds)
        self.check_every = max(1, check_every)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.generators = [torch.Generator(device=self.device).manual_seed(seed) for seed in seeds]
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self._heads = self._head_weights()

    # -- state ----------------------------------------------------------------------------------------
    def _candidate_rows(self, q: int) -> Tensor:
        return torch.tensor(self.plan.candidate_ids(q), device=self.device)

    def _head_weights(self) -> list[Tensor]:
        """Per codebook, the output rows its tokens can be sampled from: the window, then end-of-text."""
        weight = self.lm.model.output.weight
        return [weight.index_select(0, self._candidate_rows(q)).contiguous() for q in range(COARSE_CODEBOOKS)]

    def _allocate(self, first_logits: Tensor) -> None:
        plan, batch, device = self.plan, self.batch, self.device
        long = dict(dtype=torch.long, device=device)
        self.logits = first_logits.contiguous()  # [B, candidates of q0] for the next token to sample
        self.tokens = torch.zeros(batch, 1, **long)
        self.position = torch.tensor([len(self.prompt_ids)], **long)
        self.frame = torch.zeros(1, **long)
        self.noise_step = torch.zeros(1, **long)
        self.codes = torch.zeros(batch, COARSE_CODEBOOKS, plan.limit, **long)
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)
        self.lengths = torch.full((batch,), plan.limit, **long)
        width = max(plan.drawn(False), plan.drawn(True), 1)
        self.noise = torch.ones(batch, COARSE_CODEBOOKS * self.check_every, width, device=device)

    # -- one frame: two tokens, all on the device ------------------------------------------------------
    def _sample(self, logits: Tensor, may_end: bool) -> Tensor:
        """One code per track [B] from candidate logits [B, n]: temperature, top-k, then the exponential race
        with this step's noise (multinomial's own method, so the same code multinomial would draw)."""
        plan = self.plan
        logits = logits[:, : plan.candidates(may_end)]
        if plan.top_k == 1:
            return logits.argmax(dim=-1)
        k = plan.drawn(may_end)
        values, indices = torch.topk(logits / plan.temperature, k, dim=-1)
        probs = torch.softmax(values, dim=-1)
        noise = self.noise.index_select(1, self.noise_step).view(self.batch, -1)[:, :k]
        self.noise_step.add_(1)
        return indices.gather(-1, (probs / noise).argmax(dim=-1, keepdim=True)).view(-1)

    def _token(self, q: int, may_end: bool) -> None:
        """Sample codebook q's code for every track, record it, feed it, and leave the next token's logits."""
        plan = self.plan
        choice = self._sample(self.logits, may_end)
        if may_end:
            ending = (choice == plan.codebook_size) & ~self.ended
            self.lengths.copy_(torch.where(ending, self.frame, self.lengths))
            self.ended.logical_or_(ending)
        self.codes[:, q].index_copy_(1, self.frame, choice.view(-1, 1))
        fed = plan.window_starts[q] + choice
        if plan.end_id is not None:
            fed = torch.where(self.ended, plan.end_id, fed)
        self.tokens.copy_(fed.view(-1, 1))
        hidden = self.lm.cached_hidden(self.tokens, self.position)[:, 0]
        head = self._heads[(q + 1) % COARSE_CODEBOOKS]
        self.logits.copy_((hidden @ head.t()).float())
        self.position.add_(1)

    def frame_step(self, may_end: bool) -> None:
        """One frame (q0 then q1) for every track; capture-safe: tensors only, no host reads."""
        for q in range(COARSE_CODEBOOKS):
            self._token(q, may_end)
        self.frame.add_(1)

    # -- the host loop ---------------------------------------------------------------------------------
    def run(
        self, control: StageControl, report: Callable[[StageControl, int, int], None] | None = None
    ) -> list[Tensor]:
        """Codes [2, frames] per track (frames <= plan.limit), reporting once per block."""
        plan, lm = self.plan, self.lm
        lm.reset(len(self.prompt_ids) + COARSE_CODEBOOKS * plan.limit, batch=self.batch)
        try:
            with torch.inference_mode():
                full = lm.prefill_batch(self.prompt_ids)
                self._allocate(full.index_select(1, self._candidate_rows(0)))
                frame = 0
                while frame < plan.limit:
                    may_end = plan.may_end(frame)
                    block_end = min(frame + self.check_every, plan.limit)
                    if plan.end_id is not None and not may_end:
                        block_end = min(block_end, plan.min_frames)  # a block never straddles the phases
                    self._draw_noise(block_end - frame, may_end)
                    for _ in range(frame, block_end):
                        self._run_frame(may_end)
                    frame = block_end
                    if plan.end_id is not None and bool(self.ended.all()):  # the one host read per block
                        break
                    if report is not None:
                        report(control, COARSE_CODEBOOKS * frame, COARSE_CODEBOOKS * plan.expected_frames)
                lengths = self.lengths.tolist()
                codes = self.codes.cpu()
        finally:
            self._graphs.clear()
            lm.release()
        return [codes[row, :, :length] for row, length in enumerate(lengths)]

    def _draw_noise(self, frames: int, may_end: bool) -> None:
        """Each track's Exp(1) noise for the next `frames` frames, from its own generator, in one call."""
        self.noise_step.zero_()
        drawn = self.plan.drawn(may_end)
        if not drawn:
            return
        for row, generator in enumerate(self.generators):
            self.noise[row, : COARSE_CODEBOOKS * frames, :drawn].exponential_(1, generator=generator)

    def _run_frame(self, may_end: bool) -> None:
        if not self.use_graphs:
            self.frame_step(may_end)
            return
        graph = self._graphs.get(may_end)
        if graph is None:
            graph = self._graphs[may_end] = self._capture(may_end)
        graph.replay()

    def _capture(self, may_end: bool) -> "torch.cuda.CUDAGraph":
        """Capture one frame as a CUDA graph. Warm-up runs a real frame on a side stream, so the state it
        changes is put back before capturing (the KV entries it wrote are rewritten by the replay)."""
        state = [
            self.logits,
            self.tokens,
            self.position,
            self.frame,
            self.noise_step,
            self.codes,
            self.ended,
            self.lengths,
        ]
        saved = [tensor.clone() for tensor in state]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.frame_step(may_end)
        torch.cuda.current_stream().wait_stream(stream)
        for tensor, value in zip(state, saved, strict=True):
            tensor.copy_(value)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the kernels without running them
            self.frame_step(may_end)
        return graph
