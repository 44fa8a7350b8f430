"""Backbone stage: autoregressively generate the coarse codes (q0, q1) of one track.

Khala's backbone continues the text prompt with audio tokens interleaved two per frame,
q0 then q1, each codebook in its own id window (profile.audio_token_offset). Khala samples the whole
vocabulary and stops at end-of-text; here every position samples inside the window of the codebook due
there, plus, when the model may end the song (`end_id`), the end-of-text id: the output is always a
well-formed [2, frames] grid, and the song ends where the model ends it (or at `max_frames`). With no
`end_id` the length is fixed (num_frames): the tiny random-weight models, which would end at random.
Sampling otherwise matches Megatron's sampler Khala uses: temperature, then top-k, then multinomial.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from app.pipeline.control import StageControl
from app.pipeline.music.engine import BatchedCausalLM, CausalLM, sample_top_k
from app.pipeline.music.slots import SongPlan, decode_song
from app.pipeline.music.torch_engine import TorchCausalLM
from app.pipeline.profiles import COARSE_CODEBOOKS, MusicProfile


def generate_coarse(
    lm: CausalLM,
    prompt_ids: Sequence[int],
    *,
    profile: MusicProfile,
    num_frames: int,
    temperature: float,
    top_k: int,
    seed: int,
    control: StageControl,
    end_id: int | None = None,
    max_frames: int | None = None,
    min_frames: int = 1,
    loop: str = "auto",
) -> Tensor:
    """Codes [2, frames] (int64, values 0..codebook_size-1) for q0 and q1, reproducible per seed.

    Reports "done/expected tokens" through `control` (per frame, or per block in the slot decoder), which
    raises Canceled to stop.
    """
    return generate_coarse_tracks(
        lm,
        prompt_ids,
        profile=profile,
        num_frames=num_frames,
        temperature=temperature,
        top_k=top_k,
        seeds=[seed],
        control=control,
        end_id=end_id,
        max_frames=max_frames,
        min_frames=min_frames,
        loop=loop,
    )[0]


def generate_coarse_tracks(
    lm: CausalLM,
    prompt_ids: Sequence[int],
    *,
    profile: MusicProfile,
    num_frames: int,
    temperature: float,
    top_k: int,
    seeds: Sequence[int],
    control: StageControl,
    end_id: int | None = None,
    max_frames: int | None = None,
    min_frames: int = 1,
    loop: str = "auto",
) -> list[Tensor]:
    """Coarse codes of several tracks of one song (same prompt, one seed each), in one batch when the engine
    batches (a track's codes are those it gets alone: each track samples from its own seeded generator), else
    one track after the other.

    `end_id` None: exactly `num_frames` frames each. Otherwise a track ends when it samples `end_id` (a
    candidate once `min_frames` frames are written; an unfinished frame is dropped) or after `max_frames`
    frames; `num_frames` is then only the expected length progress is reported against.

    `loop="auto"` runs the plain-PyTorch engine's tracks through a slot decoder of their own, one slot per track
    (slots.decode_song: each track's codes are those the loop below gives it alone, with no host round trip per
    token, progress once per block); "reference", and any other engine, run the loop below.
    """
    if not prompt_ids:
        raise ValueError("the backbone needs a non-empty prompt")
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if not seeds:
        raise ValueError("no seeds: nothing to generate")
    limit = SongPlan.frame_limit(num_frames, end_id, max_frames)
    if limit < 1:
        raise ValueError(f"max_frames must be >= 1, got {limit}")
    if loop not in ("auto", "reference"):
        raise ValueError(f"loop must be 'auto' or 'reference', not {loop!r}")
    if len(seeds) > 1 and not isinstance(lm, BatchedCausalLM):
        return [
            generate_coarse_tracks(
                lm,
                prompt_ids,
                profile=profile,
                num_frames=num_frames,
                temperature=temperature,
                top_k=top_k,
                seeds=[seed],
                control=control.part(i / len(seeds), (i + 1) / len(seeds), f"track {i + 1}"),
                end_id=end_id,
                max_frames=max_frames,
                min_frames=min_frames,
                loop=loop,
            )[0]
            for i, seed in enumerate(seeds)
        ]
    if loop == "auto" and isinstance(lm, TorchCausalLM):
        plan = SongPlan.for_song(
            profile,
            num_frames=num_frames,
            end_id=end_id,
            max_frames=max_frames,
            min_frames=min_frames,
            top_k=top_k,
            temperature=temperature,
        )
        expected = COARSE_CODEBOOKS * num_frames
        open_ended = end_id is not None
        tracks = decode_song(
            lm,
            prompt_ids,
            plan,
            seeds,
            report=lambda frames: _report(control, COARSE_CODEBOOKS * frames, expected, open_ended=open_ended),
        )
    else:
        tracks = _reference_loop(
            lm, prompt_ids, profile, limit, num_frames, temperature, top_k, seeds, control, end_id, min_frames
        )
    if end_id is not None:  # the song's length is known now: report it whole
        done = COARSE_CODEBOOKS * max(track.shape[1] for track in tracks)
        _report(control, done, done, open_ended=False)
    return tracks


def _reference_loop(
    lm: CausalLM,
    prompt_ids: Sequence[int],
    profile: MusicProfile,
    limit: int,
    num_frames: int,
    temperature: float,
    top_k: int,
    seeds: Sequence[int],
    control: StageControl,
    end_id: int | None,
    min_frames: int,
) -> list[Tensor]:
    """Token by token on the host side of the engine protocol: what every engine can run."""
    batch = len(seeds)
    batched: BatchedCausalLM | None = None  # the engine when it runs several tracks at once, None for one track
    if batch > 1:
        if not isinstance(lm, BatchedCausalLM):  # generate_coarse_tracks runs such tracks one by one
            raise TypeError(f"{type(lm).__name__} does not batch: generate {batch} tracks one at a time")
        batched = lm
    size = profile.codebook_size
    windows = [
        slice(profile.audio_token_offset(q), profile.audio_token_offset(q) + size) for q in range(COARSE_CODEBOOKS)
    ]
    generators = [torch.Generator(device=lm.device).manual_seed(seed) for seed in seeds]
    codes = torch.zeros(batch, COARSE_CODEBOOKS, limit, dtype=torch.long)
    lengths: list[int | None] = [None] * batch  # frames of each track that has ended
    try:
        if batched is None:
            lm.reset(len(prompt_ids) + COARSE_CODEBOOKS * limit)
            logits = lm.prefill(prompt_ids)[None]
        else:
            batched.reset(len(prompt_ids) + COARSE_CODEBOOKS * limit, batch=batch)
            logits = batched.prefill_batch(prompt_ids)
        for frame in range(limit):
            may_end = end_id is not None and frame >= min_frames
            for q, window in enumerate(windows):
                following: list[int] = []
                for row in range(batch):
                    if lengths[row] is not None:  # ended: its row keeps pace with the batch, its logits unused
                        assert end_id is not None  # a track ends only by sampling end-of-text
                        following.append(end_id)
                        continue
                    candidates = _candidates(logits[row], window, end_id if may_end else None)
                    choice = int(
                        sample_top_k(candidates, top_k=top_k, temperature=temperature, generator=generators[row])
                    )
                    if choice == size:  # end-of-text
                        assert end_id is not None  # a candidate only when end_id is set
                        lengths[row] = frame
                        following.append(end_id)
                    else:
                        codes[row, q, frame] = choice
                        following.append(window.start + choice)
                if all(length is not None for length in lengths):
                    break
                if frame < limit - 1 or q < COARSE_CODEBOOKS - 1:
                    logits = lm.decode(following[0])[None] if batched is None else batched.decode_batch(following)
            if all(length is not None for length in lengths):
                break
            _report(
                control, COARSE_CODEBOOKS * (frame + 1), COARSE_CODEBOOKS * num_frames, open_ended=end_id is not None
            )
    finally:
        lm.release()
    return [codes[row, :, : limit if length is None else length] for row, length in enumerate(lengths)]


def _candidates(logits: Tensor, window: slice, end_id: int | None) -> Tensor:
    """The logits a position samples from: its codebook's window, then end-of-text when the song may end."""
    if end_id is None:
        return logits[window]
    return torch.cat([logits[window], logits[end_id : end_id + 1]])


def _report(control: StageControl, done: int, expected: int, *, open_ended: bool) -> None:
    """Progress against the expected token count; held below 1 while the model, not a count, ends the song."""
    if open_ended:
        control.report(min(done / expected, 0.99), f"{done}/{expected} tokens")
        control.check()
    else:
        control.step(done, expected, "tokens")
