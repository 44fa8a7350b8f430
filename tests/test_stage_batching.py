"""Super-resolution and codec across tracks (app/pipeline/music/stage_batching.py): each track's output in a batch
against its output alone, on the tiny profile's real models (written by the real writer, loaded by the real
loaders). Superres: identical codes (torch.equal). Codec: within 1e-5 of alone when chunks stack (oneDNN picks
its convolution kernels by batch size), identical when they do not (max_chunks=1: only the stitching differs
from decode_codes)."""

from __future__ import annotations

import pytest
import torch

from app.pipeline.control import StageControl
from app.pipeline.music import codec, superres
from app.pipeline.music.stage_batching import decode_tracks, fill_fine_tracks
from app.pipeline.music.stages import load_engine

CODEC_BOUND = 1e-5  # max |diff| of batched vs alone audio (measured ~6e-7 on the tiny decoder, peak ~0.4)


@pytest.fixture(scope="module")
def superres_lm(tiny_profile):
    return load_engine(
        "torch", tiny_profile.superres, tiny_profile.superres_dir, causal=False, device=torch.device("cpu")
    )


@pytest.fixture(scope="module")
def decoder(tiny_profile):
    return codec.load_codec(tiny_profile.codec, tiny_profile.codec_path, "cpu")


def coarse_tracks(profile, frames: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, profile.codebook_size, (2, f), generator=gen) for f in frames]


def alone(lm, profile, coarse, seeds, prompts) -> list[torch.Tensor]:
    return [
        superres.fill_fine(lm, c, profile=profile, seed=s, control=StageControl(), prompt_ids=p)
        for c, s, p in zip(coarse, seeds, prompts, strict=True)
    ]


def test_superres_tracks_of_one_length_are_identical_to_alone(tiny_profile, superres_lm):
    coarse = coarse_tracks(tiny_profile, [40, 40, 40])
    seeds, prompts = [3, 4, 5], [[5, 6, 7, 8]] * 3
    reports: list[str] = []
    batched = fill_fine_tracks(
        superres_lm,
        coarse,
        profile=tiny_profile,
        seeds=seeds,
        prompts=prompts,
        control=StageControl(report=lambda fraction, detail: reports.append(detail)),
    )
    for one, many in zip(alone(superres_lm, tiny_profile, coarse, seeds, prompts), batched, strict=True):
        assert one.shape == (64, 40)
        assert torch.equal(one, many)
    assert reports[-1] == "62/62 layers" and len(reports) == 62
    assert not torch.equal(batched[0], batched[1])  # different seeds and codes: different tracks


def test_superres_tracks_of_different_lengths_match_alone(tiny_profile, superres_lm):
    """Padded at the end and masked: the hidden states differ by float rounding only; on the tiny model the
    sampled codes come out identical (a top-k draw could flip only on a near tie)."""
    coarse = coarse_tracks(tiny_profile, [40, 33, 51], seed=1)
    seeds, prompts = [7, 8, 9], [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    batched = fill_fine_tracks(superres_lm, coarse, profile=tiny_profile, seeds=seeds, prompts=prompts)
    for one, many in zip(alone(superres_lm, tiny_profile, coarse, seeds, prompts), batched, strict=True):
        assert one.shape == many.shape
        assert torch.equal(one, many)


def test_superres_on_an_engine_that_does_not_stack_runs_tracks_in_turn(tiny_profile):
    lm = load_engine(
        "megatron", tiny_profile.superres, tiny_profile.superres_dir, causal=False, device=torch.device("cpu")
    )
    coarse = coarse_tracks(tiny_profile, [12, 12], seed=2)
    seeds, prompts = [1, 2], [[5, 6], [5, 6]]
    batched = fill_fine_tracks(lm, coarse, profile=tiny_profile, seeds=seeds, prompts=prompts)
    for one, many in zip(alone(lm, tiny_profile, coarse, seeds, prompts), batched, strict=True):
        assert torch.equal(one, many)


def test_superres_tracks_need_a_seed_and_a_prompt_each(tiny_profile, superres_lm):
    coarse = coarse_tracks(tiny_profile, [8, 8])
    with pytest.raises(ValueError, match="one seed and one prompt per track"):
        fill_fine_tracks(superres_lm, coarse, profile=tiny_profile, seeds=[1], prompts=[[5], [5]])
    with pytest.raises(ValueError, match="coarse codes must be"):
        fill_fine_tracks(superres_lm, [coarse[0][:1]], profile=tiny_profile, seeds=[1], prompts=[[5]])


def test_codec_tracks_match_decode_codes(tiny_profile, decoder):
    """Tracks of several chunks (64-frame chunks, 16 overlapping) and of one, equal and unequal lengths."""
    gen = torch.Generator().manual_seed(3)
    codes = [torch.randint(0, tiny_profile.codebook_size, (64, f), generator=gen) for f in (200, 200, 70, 30)]
    reference = [codec.decode_codes(decoder, c) for c in codes]
    reports: list[str] = []
    batched = decode_tracks(
        decoder, codes, StageControl(report=lambda fraction, detail: reports.append(detail)), max_chunks=8
    )
    for one, many in zip(reference, batched, strict=True):
        assert one.shape == many.shape
        assert float((one - many).abs().max()) <= CODEC_BOUND
    assert reports[-1] == "11/11 chunks"  # 4 + 4 + 2 + 1
    unstacked = decode_tracks(decoder, codes, max_chunks=1)
    for one, many in zip(reference, unstacked, strict=True):
        assert torch.equal(one, many)


def test_codec_tracks_reject_bad_codes(tiny_profile, decoder):
    with pytest.raises(ValueError, match="codes must lie in"):
        decode_tracks(decoder, [torch.full((64, 4), tiny_profile.codebook_size)])
    with pytest.raises(ValueError, match="max_chunks"):
        decode_tracks(decoder, [torch.zeros(64, 4, dtype=torch.long)], max_chunks=0)
