"""The plain-PyTorch engine against Megatron-core's forward, the reference, on the same weights (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.pipeline.music.backbone import generate_coarse, generate_coarse_tracks
from app.pipeline.control import StageControl
from app.pipeline.music.engine import BatchedCausalLM, BidirectionalLM, CausalLM
from app.pipeline.music.stages import load_engine
from app.pipeline.music.superres import fill_fine
from app.pipeline.music import torch_engine
from app.pipeline.music.torch_engine import Linear, TorchBidirectionalLM, TorchCausalLM

torch.set_num_threads(2)
PROMPT = [1, 42, 7, 300, 5, 99]
TOLERANCE = 1e-5  # float32 rounding; a wrong head, group or half shows up as O(0.1)


@pytest.fixture(scope="module")
def backbones(tiny_profile):
    reference = load_engine(
        "megatron", tiny_profile.backbone, tiny_profile.backbone_dir, causal=True, device=torch.device("cpu")
    )
    fast = load_engine(
        "torch", tiny_profile.backbone, tiny_profile.backbone_dir, causal=True, device=torch.device("cpu")
    )
    return reference, fast


@pytest.fixture(scope="module")
def superres(tiny_profile):
    reference = load_engine(
        "megatron", tiny_profile.superres, tiny_profile.superres_dir, causal=False, device=torch.device("cpu")
    )
    fast = load_engine(
        "torch", tiny_profile.superres, tiny_profile.superres_dir, causal=False, device=torch.device("cpu")
    )
    return reference, fast


def test_engines_implement_the_protocols(backbones, superres):
    assert isinstance(backbones[1], TorchCausalLM) and isinstance(backbones[1], CausalLM)
    assert isinstance(superres[1], TorchBidirectionalLM) and isinstance(superres[1], BidirectionalLM)
    assert backbones[0].vocab_size == backbones[1].vocab_size


def test_full_forward_prefill_and_cached_decode_match_megatron(backbones):
    reference, fast = backbones
    assert fast.model.shape.groups < fast.model.shape.heads  # the tiny backbone uses grouped-query attention
    assert reference.logits(PROMPT).abs().max() > 0.1  # so TOLERANCE is small against the logits
    assert torch.allclose(fast.logits(PROMPT), reference.logits(PROMPT), atol=TOLERANCE)
    for lm in backbones:
        lm.reset(len(PROMPT) + 8)
    assert torch.allclose(fast.prefill(PROMPT), reference.prefill(PROMPT), atol=TOLERANCE)
    for token in (3, 250, 17, 17, 0):
        assert torch.allclose(fast.decode(token), reference.decode(token), atol=TOLERANCE)
    for lm in backbones:
        lm.release()


def test_same_seed_generates_the_same_coarse_codes_on_both_engines(backbones, tiny_profile):
    def generate(lm):
        return generate_coarse(
            lm, PROMPT, profile=tiny_profile, num_frames=10, temperature=1.0, top_k=50, seed=5, control=StageControl()
        )

    assert torch.equal(generate(backbones[0]), generate(backbones[1]))


def test_a_batch_of_sequences_decodes_like_each_sequence_alone(backbones):
    fast = backbones[1]
    assert isinstance(fast, BatchedCausalLM) and not isinstance(backbones[0], BatchedCausalLM)
    steps = [(3, 250), (17, 4), (0, 0)]
    fast.reset(len(PROMPT) + len(steps), batch=2)
    batched = [fast.prefill_batch(PROMPT)] + [fast.decode_batch(list(pair)) for pair in steps]
    for row in (0, 1):
        fast.reset(len(PROMPT) + len(steps))
        alone = [fast.prefill(PROMPT)] + [fast.decode(pair[row]) for pair in steps]
        for together, single in zip(batched, alone, strict=True):
            assert torch.allclose(together[row], single, atol=TOLERANCE)
    assert not torch.allclose(batched[1][0], batched[1][1])  # different tokens, different rows
    fast.reset(len(PROMPT) + 1, batch=2)
    with pytest.raises(RuntimeError, match="batch of 2"):
        fast.prefill(PROMPT)
    fast.prefill_batch(PROMPT)
    with pytest.raises(ValueError, match="batch of 2"):
        fast.decode_batch([1])
    fast.release()


def test_tracks_generated_together_get_the_codes_they_get_alone(backbones, tiny_profile):
    """Batched on the fast engine, one after the other on Megatron's: the same codes per seed either way."""
    args = dict(profile=tiny_profile, num_frames=8, temperature=1.0, top_k=50, control=StageControl())
    reference, fast = backbones
    together = generate_coarse_tracks(fast, PROMPT, seeds=[5, 6, 7], **args)
    alone = [generate_coarse(fast, PROMPT, seed=seed, **args) for seed in (5, 6, 7)]
    sequential = generate_coarse_tracks(reference, PROMPT, seeds=[5, 6, 7], **args)
    for a, b, c in zip(together, alone, sequential, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(together[0], together[1])


def test_superres_windows_and_codes_match_megatron(superres, tiny_profile):
    reference, fast = superres
    embeddings = torch.randn(12, fast.input_embeddings.shape[1], generator=torch.Generator().manual_seed(1))
    window = slice(tiny_profile.audio_token_offset(2), tiny_profile.audio_token_offset(2) + tiny_profile.codebook_size)
    assert torch.allclose(fast.logits(embeddings, window), reference.logits(embeddings, window), atol=TOLERANCE)
    assert torch.equal(fast.input_embeddings, reference.input_embeddings)
    coarse = torch.randint(0, tiny_profile.codebook_size, (2, 6), generator=torch.Generator().manual_seed(0))

    def fill(lm):
        return fill_fine(lm, coarse, profile=tiny_profile, seed=3, control=StageControl(), prompt_ids=PROMPT)

    assert torch.equal(fill(reference), fill(fast))


def test_cache_misuse_raises(backbones):
    fast = backbones[1]
    fast.release()
    with pytest.raises(RuntimeError, match="reset"):
        fast.prefill(PROMPT)
    fast.reset(len(PROMPT) + 1)
    with pytest.raises(RuntimeError, match="prefill"):
        fast.decode(1)
    fast.prefill(PROMPT)
    with pytest.raises(RuntimeError, match="fresh cache"):
        fast.prefill(PROMPT)
    fast.decode(1)
    with pytest.raises(ValueError, match="holds"):
        fast.decode(2)
    with pytest.raises(ValueError, match="exceed"):
        fast.reset(fast.model.shape.max_len + 1)
    fast.release()


def test_unknown_engine_is_refused(tiny_profile):
    with pytest.raises(ValueError, match="unknown engine"):
        load_engine(
            "tensorrt", tiny_profile.backbone, tiny_profile.backbone_dir, causal=True, device=torch.device("cpu")
        )


def test_cpu_linears_run_onednn_over_a_weight_packed_once_and_repacked_when_it_changes(backbones):
    """On a CPU in fp32 the engine's linears run oneDNN's product over a packed weight (app/pipeline/music/
    torch_engine.Linear): F.linear's result within float32 rounding, packed at load, made again after an in-place
    load of new weights; a row of a 16-row product (the batched slot decoder's tile) has the same bits wherever it
    lies and whatever the other rows hold."""
    layer = backbones[1].model.blocks[0].ffn.gate_up
    assert isinstance(layer, Linear) and layer._packed is not None  # packed when the model was loaded
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=TOLERANCE)
    fresh = Linear(8, 24)
    fresh.requires_grad_(False)
    first = fresh.packed_weight()
    with torch.no_grad():
        fresh.weight.copy_(torch.randn(24, 8, generator=torch.Generator().manual_seed(1)))
    rows = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(fresh(rows), F.linear(rows, fresh.weight, fresh.bias), atol=TOLERANCE)
    assert fresh.packed_weight() is not first
    differ = 0
    for trial in range(32):
        row = torch.randn(1, layer.in_features)
        alone = layer(torch.cat([row, torch.zeros(15, layer.in_features)]))[0]
        mixed = torch.randn(16, layer.in_features)
        mixed[trial % 16] = row[0]
        differ += not torch.equal(layer(mixed)[trial % 16], alone)
    assert differ == 0


def test_where_onednn_cannot_run_linear_is_f_linear(monkeypatch):
    """A build or CPU without oneDNN's packed linear (the import-time probe says so): every Linear is F.linear."""
    monkeypatch.setattr(torch_engine, "ONEDNN", False)
    layer = Linear(8, 4).requires_grad_(False)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    assert not layer.packs(x)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)) and layer._packed is None
