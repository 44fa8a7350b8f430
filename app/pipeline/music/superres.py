"""Super-resolution stage: fill codebooks q2..q63 from the backbone's q0/q1, one layer per pass.

Khala's layout, followed here: the sequence is the text prompt, then one position per audio frame.
A frame's input embedding is the sum of the embedding rows of its known codes
(offset(j) + code for every layer j < i); a prompt position embeds its own token. The prompt's last
token is replaced by a task marker naming the layer to predict (Khala: 128255 - i, i.e.
text_vocab_size - 1 - i). Pass i runs the whole sequence once with full (non-causal) attention,
projects the audio positions onto layer i's id window only and samples top-k (no temperature).
62 passes for 64 codebooks.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from app.pipeline.control import StageControl
from app.pipeline.music.engine import BidirectionalLM, sample_top_k
from app.pipeline.profiles import COARSE_CODEBOOKS, MusicProfile


def task_marker(profile: MusicProfile, layer: int) -> int:
    """Text-vocabulary id that tells the model which layer this pass predicts."""
    return profile.text_vocab_size - 1 - layer


@torch.inference_mode()
def check_coarse(coarse: Tensor, codebook_size: int) -> None:
    """ValueError unless `coarse` is [2, frames] codes within the codebook: what super-resolution takes."""
    if coarse.dim() != 2 or coarse.shape[0] != COARSE_CODEBOOKS:
        raise ValueError(f"coarse codes must be [{COARSE_CODEBOOKS}, frames], got {tuple(coarse.shape)}")
    if coarse.min() < 0 or coarse.max() >= codebook_size:
        raise ValueError(f"coarse codes must lie in 0..{codebook_size - 1}")


def fill_fine(
    lm: BidirectionalLM,
    coarse: Tensor,
    *,
    profile: MusicProfile,
    top_k: int | None = None,
    seed: int,
    control: StageControl,
    prompt_ids: Sequence[int] = (),
) -> Tensor:
    """Codes [num_codebooks, F] (int64): rows 0-1 are `coarse` [2, F], the rest sampled layer by layer.

    `prompt_ids` is the super-resolution text prompt (Khala: the backbone's prompt); without one the
    model gets no layer marker, as in Khala with an empty prompt. Reports "done/62 layers" per pass.
    """
    num_codebooks = profile.codec.num_codebooks
    size = profile.codebook_size
    top_k = profile.superres_top_k if top_k is None else top_k
    check_coarse(coarse, size)

    table = lm.input_embeddings
    device = table.device
    codes = torch.empty(num_codebooks, coarse.shape[1], dtype=torch.long)
    codes[:COARSE_CODEBOOKS] = coarse.cpu()
    # Running sum over known layers, kept in float32 and rounded once per pass like Khala's sum.
    audio = table[profile.audio_token_offset(0) + codes[0].to(device)].float()
    for j in range(1, COARSE_CODEBOOKS):
        audio = audio + table[profile.audio_token_offset(j) + codes[j].to(device)].float()
    prompt = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    generator = torch.Generator(device=lm.device).manual_seed(seed)
    passes = num_codebooks - COARSE_CODEBOOKS

    try:
        for layer in range(COARSE_CODEBOOKS, num_codebooks):
            sequence = audio.to(table.dtype)
            if len(prompt):
                prompt[-1] = task_marker(profile, layer)
                sequence = torch.cat([table[prompt], sequence])
            start = profile.audio_token_offset(layer)
            logits = lm.logits(sequence, slice(start, start + size))[len(prompt) :]
            sampled = sample_top_k(logits, top_k=top_k, generator=generator)
            codes[layer] = sampled.cpu()
            audio += table[start + sampled].float()
            control.step(layer - COARSE_CODEBOOKS + 1, passes, "layers")
    finally:
        lm.release()
    return codes
