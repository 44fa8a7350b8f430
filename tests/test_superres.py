"""Super-resolution stage on the tiny Megatron model (and one recording LM for the input layout)."""
from __future__ import annotations

import pytest
import torch

from app.pipeline import megatron_backend as mb
from app.pipeline.control import Canceled, StageControl
from app.pipeline.profiles import load_profile
from app.pipeline.superres import fill_fine, task_marker

torch.set_num_threads(2)
FRAMES = 10
PROMPT = [1, 42, 7, 300]


@pytest.fixture(scope="module")
def profile(tiny_models):
    """The tiny models written once per session by the real writer (tests/conftest.py)."""
    return load_profile("tiny", tiny_models)


@pytest.fixture(scope="module")
def lm(profile):
    return mb.load_bidirectional_lm(profile.superres, profile.superres_dir, device="cpu")


@pytest.fixture(scope="module")
def coarse(profile):
    return torch.randint(0, profile.codebook_size, (2, FRAMES), generator=torch.Generator().manual_seed(0))


def fill(lm, profile, coarse, seed=0, control=None, **overrides):
    args = dict(profile=profile, seed=seed, control=control or StageControl(), prompt_ids=PROMPT)
    args.update(overrides)
    return fill_fine(lm, coarse, **args)


def test_shape_rows_and_range(lm, profile, coarse):
    codes = fill(lm, profile, coarse)
    assert codes.shape == (64, FRAMES) and codes.dtype == torch.long
    assert torch.equal(codes[:2], coarse)
    assert codes.min() >= 0 and codes.max() < profile.codebook_size
    assert len(torch.unique(codes[2:])) > 1


def test_same_seed_same_codes_different_seed_different(lm, profile, coarse):
    first, again, other = fill(lm, profile, coarse, seed=3), fill(lm, profile, coarse, seed=3), fill(lm, profile, coarse, seed=4)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_works_without_prompt(lm, profile, coarse):
    codes = fill(lm, profile, coarse, prompt_ids=())
    assert codes.shape == (64, FRAMES) and torch.equal(codes[:2], coarse)


def test_progress_is_one_step_per_pass_ending_at_one(lm, profile, coarse):
    reports = []
    fill(lm, profile, coarse, control=StageControl(report=lambda f, d: reports.append((f, d))))
    fractions = [f for f, _ in reports]
    assert len(reports) == 62 and fractions == sorted(fractions) and fractions[-1] == 1.0
    assert reports[0][1] == "1/62 layers" and reports[-1][1] == "62/62 layers"


def test_cancel_stops_mid_loop(lm, profile, coarse):
    reports = []
    control = StageControl(report=lambda f, d: reports.append(f), cancel_requested=lambda: len(reports) >= 5)
    with pytest.raises(Canceled):
        fill(lm, profile, coarse, control=control)
    assert len(reports) == 5


def test_rejects_bad_coarse_codes(lm, profile, coarse):
    with pytest.raises(ValueError):
        fill(lm, profile, coarse[:1])
    with pytest.raises(ValueError):
        fill(lm, profile, coarse + profile.codebook_size)


class RecordingLM:
    """A BidirectionalLM that records its inputs and makes code (frame + layer) % size certain."""

    def __init__(self, profile):
        self.profile = profile
        self.vocab_size, self.device = profile.superres.vocab_size, torch.device("cpu")
        self.table = torch.randn(self.vocab_size, 8, generator=torch.Generator().manual_seed(1))
        self.calls: list[tuple[torch.Tensor, slice]] = []

    @property
    def input_embeddings(self):
        return self.table

    def logits(self, embeddings, vocab=None):
        self.calls.append((embeddings.clone(), vocab))
        layer = (vocab.start - self.profile.text_vocab_size) // self.profile.codebook_size
        logits = torch.zeros(embeddings.shape[0], vocab.stop - vocab.start)
        for position in range(embeddings.shape[0]):
            frame = position - len(PROMPT)
            logits[position, (frame + layer) % logits.shape[1]] = 30.0
        return logits

    def release(self):
        pass


def test_input_layout_follows_khala(profile, coarse):
    stub = RecordingLM(profile)
    codes = fill(stub, profile, coarse)
    size, frames = profile.codebook_size, torch.arange(FRAMES)
    for layer in range(2, 64):
        assert torch.equal(codes[layer], (frames + layer) % size)
    assert len(stub.calls) == 62
    for layer, (embeddings, vocab) in zip(range(2, 64), stub.calls):
        start = profile.audio_token_offset(layer)
        assert (vocab.start, vocab.stop) == (start, start + size)
        prompt = PROMPT[:-1] + [task_marker(profile, layer)]
        torch.testing.assert_close(embeddings[:len(PROMPT)], stub.table[prompt])
        known = sum(stub.table[profile.audio_token_offset(j) + codes[j]] for j in range(layer))
        torch.testing.assert_close(embeddings[len(PROMPT):], known)
    assert task_marker(profile, 2) == profile.text_vocab_size - 3
