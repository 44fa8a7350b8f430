"""Backbone stage on the tiny Megatron model (and one scripted LM for exact token bookkeeping)."""

from __future__ import annotations

import pytest
import torch

from app.pipeline.music import megatron_backend as mb
from app.pipeline.music.backbone import generate_coarse
from app.pipeline.control import Canceled, StageControl

torch.set_num_threads(2)
PROMPT = [1, 42, 7, 300]
FRAMES = 12


@pytest.fixture(scope="module")
def lm(tiny_profile):
    return mb.load_causal_lm(tiny_profile.backbone, tiny_profile.backbone_dir, device="cpu")


def generate(lm, tiny_profile, seed=0, control=None, **overrides):
    args = dict(
        profile=tiny_profile,
        num_frames=FRAMES,
        temperature=1.0,
        top_k=tiny_profile.backbone_top_k,
        seed=seed,
        control=control or StageControl(),
    )
    args.update(overrides)
    return generate_coarse(lm, PROMPT, **args)


def test_shape_and_range(lm, tiny_profile):
    codes = generate(lm, tiny_profile)
    assert codes.shape == (2, FRAMES) and codes.dtype == torch.long
    assert codes.min() >= 0 and codes.max() < tiny_profile.codebook_size


def test_same_seed_same_tokens_different_seed_different(lm, tiny_profile):
    first, again, other = (
        generate(lm, tiny_profile, seed=5),
        generate(lm, tiny_profile, seed=5),
        generate(lm, tiny_profile, seed=6),
    )
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_top_k_one_is_greedy_and_ignores_seed(lm, tiny_profile):
    assert torch.equal(generate(lm, tiny_profile, seed=1, top_k=1), generate(lm, tiny_profile, seed=2, top_k=1))


def test_progress_is_per_frame_monotonic_and_ends_at_one(lm, tiny_profile):
    reports = []
    generate(lm, tiny_profile, control=StageControl(report=lambda f, d: reports.append((f, d))))
    fractions = [f for f, _ in reports]
    assert len(reports) == FRAMES
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert reports[0][1] == f"2/{2 * FRAMES} tokens" and reports[-1][1] == f"{2 * FRAMES}/{2 * FRAMES} tokens"


def test_cancel_stops_mid_loop(lm, tiny_profile):
    reports = []
    control = StageControl(report=lambda f, d: reports.append(f), cancel_requested=lambda: len(reports) >= 3)
    with pytest.raises(Canceled):
        generate(lm, tiny_profile, control=control)
    assert len(reports) == 3


class ScriptedLM:
    """A CausalLM whose logits strongly prefer text tokens, to check restriction and bookkeeping."""

    def __init__(self, vocab_size: int, favourite: int):
        self.vocab_size, self.device, self.favourite = vocab_size, torch.device("cpu"), favourite
        self.fed: list[int] = []
        self.max_len = 0

    def _logits(self) -> torch.Tensor:
        logits = torch.zeros(self.vocab_size)
        logits[:100] = 50.0  # text ids: would win if sampling were not restricted
        logits[self.favourite :: 32] = 20.0  # entry `favourite` of every codebook
        return logits

    def reset(self, max_len):
        self.max_len, self.fed = max_len, []

    def prefill(self, ids):
        self.fed = list(ids)
        return self._logits()

    def decode(self, token_id):
        self.fed.append(token_id)
        assert len(self.fed) <= self.max_len
        return self._logits()

    def logits(self, ids):
        raise NotImplementedError

    def release(self):
        pass


def test_sampling_stays_in_each_codebook_window_and_feeds_interleaved_ids(tiny_profile):
    stub = ScriptedLM(tiny_profile.backbone.vocab_size, favourite=9)
    codes = generate(stub, tiny_profile, top_k=3)
    assert torch.equal(codes, torch.full((2, FRAMES), 9))
    q0, q1 = tiny_profile.audio_token_offset(0), tiny_profile.audio_token_offset(1)
    assert stub.fed == PROMPT + [q0 + 9, q1 + 9] * (FRAMES - 1) + [q0 + 9]
    assert stub.max_len == len(PROMPT) + 2 * FRAMES


def test_rejects_empty_prompt(lm, tiny_profile):
    with pytest.raises(ValueError):
        generate_coarse(
            lm, [], profile=tiny_profile, num_frames=2, temperature=1.0, top_k=5, seed=0, control=StageControl()
        )
