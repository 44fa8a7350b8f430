"""Backbone stage: autoregressively generate the coarse codes (q0, q1) of one track.

Khala's backbone continues the text prompt with audio tokens interleaved two per frame,
q0 then q1, each codebook in its own id window (profile.audio_token_offset). Khala samples the whole
vocabulary and stops at EOD; here the length is fixed (num_frames) and every position samples only
inside the window of the codebook due there, so the output is always a well-formed [2, frames] grid.
Sampling otherwise matches Megatron's sampler Khala uses: temperature, then top-k, then multinomial.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .control import StageControl
from .engine import BatchedCausalLM, CausalLM, sample_top_k
from .profiles import COARSE_CODEBOOKS, MusicProfile


def generate_coarse(lm: CausalLM, prompt_ids: Sequence[int], *, profile: MusicProfile,
                    num_frames: int, temperature: float, top_k: int, seed: int,
                    control: StageControl) -> torch.LongTensor:
    """Codes [2, num_frames] (values 0..codebook_size-1) for q0 and q1, reproducible per seed.

    Reports "done/total tokens" once per frame through `control`, which raises Canceled to stop.
    """
    return generate_coarse_tracks(lm, prompt_ids, profile=profile, num_frames=num_frames, temperature=temperature,
                                  top_k=top_k, seeds=[seed], control=control)[0]


def generate_coarse_tracks(lm: CausalLM, prompt_ids: Sequence[int], *, profile: MusicProfile, num_frames: int,
                           temperature: float, top_k: int, seeds: Sequence[int],
                           control: StageControl) -> list[torch.LongTensor]:
    """Coarse codes of several tracks of one song (same prompt, one seed each), in one batch when the engine
    batches (a track's codes are those it gets alone: each track samples from its own seeded generator), else
    one track after the other."""
    if not prompt_ids:
        raise ValueError("the backbone needs a non-empty prompt")
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if not seeds:
        raise ValueError("no seeds: nothing to generate")
    if len(seeds) > 1 and not isinstance(lm, BatchedCausalLM):
        return [generate_coarse_tracks(lm, prompt_ids, profile=profile, num_frames=num_frames,
                                       temperature=temperature, top_k=top_k, seeds=[seed],
                                       control=control.part(i / len(seeds), (i + 1) / len(seeds), f"track {i + 1}"))[0]
                for i, seed in enumerate(seeds)]
    batch = len(seeds)
    total = COARSE_CODEBOOKS * num_frames
    size = profile.codebook_size
    windows = [slice(profile.audio_token_offset(q), profile.audio_token_offset(q) + size)
               for q in range(COARSE_CODEBOOKS)]
    generators = [torch.Generator(device=lm.device).manual_seed(seed) for seed in seeds]
    codes = torch.empty(batch, COARSE_CODEBOOKS, num_frames, dtype=torch.long)
    try:
        if batch == 1:
            lm.reset(len(prompt_ids) + total)
            logits = lm.prefill(prompt_ids)[None]
        else:
            lm.reset(len(prompt_ids) + total, batch=batch)
            logits = lm.prefill_batch(prompt_ids)
        for frame in range(num_frames):
            for q, window in enumerate(windows):
                chosen = [int(sample_top_k(logits[row, window], top_k=top_k, temperature=temperature,
                                           generator=generators[row])) for row in range(batch)]
                codes[:, q, frame] = torch.tensor(chosen)
                if frame < num_frames - 1 or q < COARSE_CODEBOOKS - 1:
                    following = [window.start + code for code in chosen]
                    logits = lm.decode(following[0])[None] if batch == 1 else lm.decode_batch(following)
            control.step(COARSE_CODEBOOKS * (frame + 1), total, "tokens")
    finally:
        lm.release()
    return list(codes)
