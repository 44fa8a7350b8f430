"""Megatron backend on the CPU: process group, Khala GPT, torch_dist checkpoints, both engines."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.distributed as dist

from app.pipeline import megatron_backend as mb
from app.pipeline.engine import BidirectionalLM, CausalLM
from app.pipeline.profiles import load_profile

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    p = load_profile("tiny", tmp_path_factory.mktemp("models"))
    mb.write_tiny_checkpoint(p.backbone, p.backbone_dir, causal=True, seed=1)
    mb.write_tiny_checkpoint(p.superres, p.superres_dir, causal=False, seed=2)
    return p


@pytest.fixture(scope="module")
def backbone(profile):
    return mb.load_gpt(profile.backbone, profile.backbone_dir, causal=True, device="cpu")


def reference_model(spec, seed, causal=True):
    model = mb.build_gpt(spec, causal=causal, device="cpu")
    mb.init_random_weights(model, seed)
    return model


def test_init_parallel_state_is_idempotent():
    mb.init_parallel_state()
    mb.init_parallel_state()
    assert dist.is_initialized() and dist.get_world_size() == 1


def test_checkpoint_layout_is_megatron_training_layout(profile):
    root = profile.backbone_dir
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    iteration = root / "iter_0000001"
    for name in ("metadata.json", ".metadata", "common.pt"):
        assert (iteration / name).is_file()
    assert list(iteration.glob("*.distcp"))
    from megatron.core import dist_checkpointing
    assert dist_checkpointing.load_content_metadata(str(iteration))["singleton_local_shards"] is True


def test_round_trip_is_exact(profile, backbone):
    reference = reference_model(profile.backbone, seed=1)
    loaded = dict(backbone.named_parameters())
    for name, param in reference.named_parameters():
        assert torch.equal(param, loaded[name]), name
    ids = [3, 17, 512, 540, 513, 575]
    assert torch.equal(mb.MegatronCausalLM(reference).logits(ids), mb.MegatronCausalLM(backbone).logits(ids))


def test_weights_depend_on_seed_only(profile, backbone):
    same = reference_model(profile.backbone, seed=1).output_layer.weight
    other = reference_model(profile.backbone, seed=3).output_layer.weight
    assert torch.equal(same, backbone.output_layer.weight)
    assert not torch.equal(other, backbone.output_layer.weight)


def test_release_tracker_and_bare_iteration_dir_load(profile, backbone, tmp_path):
    release = tmp_path / "release_layout"
    shutil.copytree(profile.backbone_dir / "iter_0000001", release / "release")
    (release / "latest_checkpointed_iteration.txt").write_text("release\n")
    for directory in (release, release / "release"):
        model = mb.load_gpt(profile.backbone, directory, causal=True, device="cpu")
        assert torch.equal(model.embedding.word_embeddings.weight, backbone.embedding.word_embeddings.weight)


def test_load_casts_to_model_dtype(profile, backbone):
    model = mb.load_gpt(profile.backbone, profile.backbone_dir, causal=True, device="cpu",
                        dtype=torch.bfloat16)
    weight = model.decoder.layers[1].mlp.linear_fc1.weight
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, backbone.decoder.layers[1].mlp.linear_fc1.weight.to(torch.bfloat16))


def test_mismatched_checkpoints_are_refused(profile, tmp_path):
    with pytest.raises(ValueError, match="rotary_base"):
        mb.load_gpt(dataclasses.replace(profile.backbone, rotary_base=10_000), profile.backbone_dir,
                    causal=True, device="cpu")
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        mb.load_gpt(dataclasses.replace(profile.backbone, ffn_hidden_size=192), profile.backbone_dir,
                    causal=True, device="cpu")
    with pytest.raises(FileNotFoundError):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")


def test_kv_cached_decode_matches_full_forward(backbone):
    lm = mb.MegatronCausalLM(backbone)
    assert isinstance(lm, CausalLM)
    ids = [1, 7, 99, 512, 544, 530, 560, 515, 549]
    full = lm.logits(ids)
    lm.reset(len(ids))
    steps = [lm.prefill(ids[:4])] + [lm.decode(token) for token in ids[4:]]
    torch.testing.assert_close(torch.stack(steps), full[3:], rtol=0, atol=1e-5)
    assert full.shape == (len(ids), backbone.vocab_size) and full.std() > 0.05


def test_cache_misuse_raises(backbone):
    lm = mb.MegatronCausalLM(backbone)
    with pytest.raises(RuntimeError):
        lm.prefill([1, 2])
    lm.reset(8)
    with pytest.raises(RuntimeError):
        lm.decode(3)
    lm.prefill([1, 2])
    with pytest.raises(RuntimeError):
        lm.prefill([1, 2])
    with pytest.raises(ValueError):
        lm.reset(backbone.max_sequence_length + 1)


def test_superres_model_is_non_causal_and_backbone_causal(profile, backbone):
    superres = mb.MegatronBidirectionalLM(
        mb.load_gpt(profile.superres, profile.superres_dir, causal=False, device="cpu"))
    assert isinstance(superres, BidirectionalLM)
    ids = torch.tensor([5, 600, 700, 800, 900, 1000])
    changed = ids.clone()
    changed[-1] = 1100
    table = superres.input_embeddings
    before, after = superres.logits(table[ids]), superres.logits(table[changed])
    assert not torch.allclose(before[0], after[0])

    causal = mb.MegatronCausalLM(backbone)
    before, after = causal.logits([5, 520, 530, 540, 550, 560]), causal.logits([5, 520, 530, 540, 550, 570])
    torch.testing.assert_close(before[:-1], after[:-1], rtol=0, atol=0)
    assert not torch.allclose(before[-1], after[-1])


def test_bidirectional_path_matches_gpt_forward_where_masks_agree(profile, tmp_path):
    """One layer: the last position sees everything under either mask, so both paths must agree."""
    spec = dataclasses.replace(profile.superres, num_layers=1)
    mb.write_tiny_checkpoint(spec, tmp_path, causal=False, seed=5)
    bidirectional = mb.MegatronBidirectionalLM(mb.load_gpt(spec, tmp_path, causal=False, device="cpu"))
    causal = mb.MegatronCausalLM(mb.load_gpt(spec, tmp_path, causal=True, device="cpu"))
    ids = torch.tensor([9, 513, 600, 1300, 2000, 2559])
    full = bidirectional.logits(bidirectional.input_embeddings[ids])
    torch.testing.assert_close(full[-1], causal.logits(ids.tolist())[-1], rtol=0, atol=1e-5)
    window = slice(600, 632)
    torch.testing.assert_close(bidirectional.logits(bidirectional.input_embeddings[ids], window),
                               full[:, window], rtol=0, atol=1e-5)


def test_two_processes_initialize_at_once_without_colliding():
    """Two workers on one machine: the in-process store needs no port, so both must come up."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch.distributed as dist; from app.pipeline.megatron_backend import init_parallel_state;"
            "init_parallel_state(); init_parallel_state(); print(dist.get_world_size())")
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == "1"


def test_process_group_inherited_through_fork_is_refused():
    import multiprocessing

    mb.init_parallel_state()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def child():
        try:
            mb.init_parallel_state()
            queue.put("initialized")
        except RuntimeError as error:
            queue.put(str(error))

    proc = context.Process(target=child)
    proc.start()
    message = queue.get(timeout=60)
    proc.join(timeout=60)
    assert "worker child" in message
