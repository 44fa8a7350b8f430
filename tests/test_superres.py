"""Super-resolution stage on the tiny Megatron model (and one recording LM for the input layout)."""

from __future__ import annotations

import pytest
import torch

from app.pipeline.music import megatron_backend as mb
from app.pipeline.control import Canceled, StageControl
from app.pipeline.music.superres import fill_fine, task_marker

torch.set_num_threads(2)
FRAMES = 10
PROMPT = [1, 42, 7, 300]


@pytest.fixture(scope="module")
def lm(tiny_profile):
    return mb.load_bidirectional_lm(tiny_profile.superres, tiny_profile.superres_dir, device="cpu")


@pytest.fixture(scope="module")
def coarse(tiny_profile):
    return torch.randint(0, tiny_profile.codebook_size, (2, FRAMES), generator=torch.Generator().manual_seed(0))


def fill(lm, tiny_profile, coarse, seed=0, control=None, **overrides):
    args = dict(profile=tiny_profile, seed=seed, control=control or StageControl(), prompt_ids=PROMPT)
    args.update(overrides)
    return fill_fine(lm, coarse, **args)


def test_shape_rows_and_range(lm, tiny_profile, coarse):
    codes = fill(lm, tiny_profile, coarse)
    assert codes.shape == (64, FRAMES) and codes.dtype == torch.long
    assert torch.equal(codes[:2], coarse)
    assert codes.min() >= 0 and codes.max() < tiny_profile.codebook_size
    assert len(torch.unique(codes[2:])) > 1


def test_same_seed_same_codes_different_seed_different(lm, tiny_profile, coarse):
    first, again, other = (
        fill(lm, tiny_profile, coarse, seed=3),
        fill(lm, tiny_profile, coarse, seed=3),
        fill(lm, tiny_profile, coarse, seed=4),
    )
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_works_without_prompt(lm, tiny_profile, coarse):
    codes = fill(lm, tiny_profile, coarse, prompt_ids=())
    assert codes.shape == (64, FRAMES) and torch.equal(codes[:2], coarse)


def test_progress_is_one_step_per_pass_ending_at_one(lm, tiny_profile, coarse):
    reports = []
    fill(lm, tiny_profile, coarse, control=StageControl(report=lambda f, d: reports.append((f, d))))
    fractions = [f for f, _ in reports]
    assert len(reports) == 62 and fractions == sorted(fractions) and fractions[-1] == 1.0
    assert reports[0][1] == "1/62 layers" and reports[-1][1] == "62/62 layers"


def test_cancel_stops_mid_loop(lm, tiny_profile, coarse):
    reports = []
    control = StageControl(report=lambda f, d: reports.append(f), cancel_requested=lambda: len(reports) >= 5)
    with pytest.raises(Canceled):
        fill(lm, tiny_profile, coarse, control=control)
    assert len(reports) == 5


def test_rejects_bad_coarse_codes(lm, tiny_profile, coarse):
    with pytest.raises(ValueError):
        fill(lm, tiny_profile, coarse[:1])
    with pytest.raises(ValueError):
        fill(lm, tiny_profile, coarse + tiny_profile.codebook_size)


class RecordingLM:
    """A BidirectionalLM that records its inputs and makes code (frame + layer) % size certain."""

    def __init__(self, tiny_profile):
        self.tiny_profile = tiny_profile
        self.vocab_size, self.device = tiny_profile.superres.vocab_size, torch.device("cpu")
        self.table = torch.randn(self.vocab_size, 8, generator=torch.Generator().manual_seed(1))
        self.calls: list[tuple[torch.Tensor, slice]] = []

    @property
    def input_embeddings(self):
        return self.table

    def logits(self, embeddings, vocab=None):
        self.calls.append((embeddings.clone(), vocab))
        layer = (vocab.start - self.tiny_profile.text_vocab_size) // self.tiny_profile.codebook_size
        logits = torch.zeros(embeddings.shape[0], vocab.stop - vocab.start)
        for position in range(embeddings.shape[0]):
            frame = position - len(PROMPT)
            logits[position, (frame + layer) % logits.shape[1]] = 30.0
        return logits

    def release(self):
        pass


def test_input_layout_follows_khala(tiny_profile, coarse):
    stub = RecordingLM(tiny_profile)
    codes = fill(stub, tiny_profile, coarse)
    size, frames = tiny_profile.codebook_size, torch.arange(FRAMES)
    for layer in range(2, 64):
        assert torch.equal(codes[layer], (frames + layer) % size)
    assert len(stub.calls) == 62
    for layer, (embeddings, vocab) in zip(range(2, 64), stub.calls, strict=True):
        start = tiny_profile.audio_token_offset(layer)
        assert (vocab.start, vocab.stop) == (start, start + size)
        prompt = PROMPT[:-1] + [task_marker(tiny_profile, layer)]
        torch.testing.assert_close(embeddings[: len(PROMPT)], stub.table[prompt])
        known = sum(stub.table[tiny_profile.audio_token_offset(j) + codes[j]] for j in range(layer))
        torch.testing.assert_close(embeddings[len(PROMPT) :], known)
    assert task_marker(tiny_profile, 2) == tiny_profile.text_vocab_size - 3
