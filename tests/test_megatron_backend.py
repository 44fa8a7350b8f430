"""Megatron backend on the CPU: process group, Khala GPT, torch_dist checkpoints, both engines."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.distributed as dist

from app.pipeline.music import megatron_backend as mb
from app.pipeline.music.engine import BidirectionalLM, CausalLM
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
    model = mb.load_gpt(profile.backbone, profile.backbone_dir, causal=True, device="cpu", dtype=torch.bfloat16)
    weight = model.decoder.layers[1].mlp.linear_fc1.weight
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, backbone.decoder.layers[1].mlp.linear_fc1.weight.to(torch.bfloat16))


def with_saved_args(source, target, **changes):
    """A copy of checkpoint `source` whose saved training args differ by `changes` (None deletes a field)."""
    shutil.copytree(source, target)
    common_path = mb.resolve_checkpoint_dir(target) / "common.pt"
    common = torch.load(common_path, weights_only=False)
    for name, value in changes.items():
        if value is None:
            delattr(common["args"], name)
        else:
            setattr(common["args"], name, value)
    torch.save(common, common_path)
    return target


def test_architecture_comes_from_the_checkpoint_args(profile, tmp_path):
    """A checkpoint of another shape (layers, width, heads, groups, head size, FFN, RoPE base) is built as its
    args say, whatever the profile's spec; both engines run it alike."""
    from app.pipeline.music.torch_engine import TorchCausalLM, from_megatron

    other = dataclasses.replace(
        profile.backbone,
        num_layers=3,
        hidden_size=96,
        num_attention_heads=6,
        num_query_groups=3,
        kv_channels=24,
        ffn_hidden_size=128,
        rotary_base=10_000,
    )
    mb.write_tiny_checkpoint(other, tmp_path, causal=True, seed=4)
    model = mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")
    assert mb.model_spec(model) == other
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.shape == ((6 + 2 * 3) * 24, 96)
    reference = reference_model(other, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))
    ids = [3, 17, 512, 540, 513, 575]
    megatron_logits = mb.MegatronCausalLM(model).logits(ids)
    torch.testing.assert_close(
        TorchCausalLM(from_megatron(model, mb.model_spec(model))).logits(ids), megatron_logits, rtol=0, atol=1e-4
    )


def test_profile_supplies_what_the_reference_never_reads_from_a_checkpoint(profile, tmp_path):
    """Norm epsilon (forced to 1e-6 on the reference's command line), RoPE scaling, QK layernorm and the
    saved vocabulary size are not read by the reference: a checkpoint saying otherwise still loads, as there."""
    directory = with_saved_args(
        profile.backbone_dir,
        tmp_path / "ckpt",
        norm_epsilon=1e-5,
        use_rope_scaling=True,
        qk_layernorm=True,
        padded_vocab_size=130_432,
        vocab_size=130_304,
        max_position_embeddings=4096,
    )
    model = mb.load_gpt(profile.backbone, directory, causal=True, device="cpu")
    assert model.config.layernorm_epsilon == profile.backbone.norm_epsilon == 1e-6
    assert model.vocab_size == profile.backbone.vocab_size and model.max_sequence_length == 25_600
    assert mb.model_spec(model) == profile.backbone


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("rotary_interleaved", True, "rotary_interleaved=True"),
        ("apply_layernorm_1p", True, "apply_layernorm_1p=True"),
        ("normalization", "LayerNorm", "normalization='LayerNorm'"),
        ("swiglu", False, "swiglu=False"),
        ("swiglu", None, "swiglu=False"),  # not recorded: Megatron's default, GELU
        ("squared_relu", True, "squared_relu=True"),
        ("position_embedding_type", "learned_absolute", "position_embedding_type='learned_absolute'"),
        ("rotary_percent", 0.5, "rotary_percent=0.5"),
        ("num_experts", 8, "num_experts=8"),
        ("hybrid_override_pattern", "M*M*", "hybrid_override_pattern='M*M*'"),
    ],
)
def test_architectures_encore_does_not_implement_are_refused_by_name(profile, tmp_path, field, value, shown):
    directory = with_saved_args(profile.backbone_dir, tmp_path / "ckpt", **{field: value})
    with pytest.raises(mb.CheckpointArgsError) as refused:
        mb.load_gpt(profile.backbone, directory, causal=True, device="cpu")
    implemented = mb.IMPLEMENTED_ARGS[shown.partition("=")[0]][0]
    assert f"{shown} (Encore implements {shown.partition('=')[0]}={implemented!r})" in str(refused.value)


def test_several_wrong_fields_are_all_named(profile, tmp_path):
    directory = with_saved_args(
        profile.backbone_dir, tmp_path / "ckpt", rotary_interleaved=True, apply_layernorm_1p=True
    )
    with pytest.raises(mb.CheckpointArgsError, match="rotary_interleaved=True.*apply_layernorm_1p=True"):
        mb.load_gpt(profile.backbone, directory, causal=True, device="cpu")


def test_megatron_defaults_fill_fields_a_checkpoint_does_not_record(profile):
    """As load_args_from_checkpoint + validate_args: no GQA flag means one KV group per head, no kv_channels
    means hidden/heads, no FFN size means SwiGLU's 4h*2/3 rounded down to 64, no RoPE base means 10000."""
    args = mb.checkpoint_args(mb.build_gpt(profile.backbone, causal=True, device="cpu"))
    for name in ("group_query_attention", "kv_channels", "ffn_hidden_size", "rotary_base"):
        delattr(args, name)
    spec = mb.spec_from_args(args, profile.backbone)
    assert (spec.num_query_groups, spec.head_dim, spec.ffn_hidden_size, spec.rotary_base) == (4, 16, 128, 10_000)
    args.num_attention_heads = 6
    with pytest.raises(mb.CheckpointArgsError, match="hidden_size=64 is not a multiple of num_attention_heads=6"):
        mb.spec_from_args(args, profile.backbone)
    assert mb.spec_from_args(None, profile.backbone) == profile.backbone  # no saved args: the profile's


def test_vocabulary_mismatch_is_named_before_weights_are_read(profile, tmp_path):
    mb.write_tiny_checkpoint(dataclasses.replace(profile.backbone, vocab_size=640), tmp_path, causal=True, seed=1)
    with pytest.raises(
        mb.CheckpointArgsError,
        match=r"embedding.word_embeddings.weight is \[640, 64\] in the "
        r"checkpoint but the model needs \[576, 64\]",
    ):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")


def test_missing_checkpoint_is_a_clear_error(profile, tmp_path):
    with pytest.raises(FileNotFoundError):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")


def test_reference_vocabularies_hold_every_audio_id():
    """130,304 and 193,792 exactly (the reference sets padded_vocab_size to these, no padding): the text ids,
    then 2 or 64 codebook windows of 1,024 ids."""
    khala = load_profile("khala", "/nonexistent")
    assert (khala.backbone.vocab_size, khala.superres.vocab_size) == (130_304, 193_792)
    assert khala.audio_token_offset(2) == khala.backbone.vocab_size
    assert khala.audio_token_offset(64) == khala.superres.vocab_size


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
        mb.load_gpt(profile.superres, profile.superres_dir, causal=False, device="cpu")
    )
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
    torch.testing.assert_close(
        bidirectional.logits(bidirectional.input_embeddings[ids], window), full[:, window], rtol=0, atol=1e-5
    )


@pytest.mark.slow  # two child processes (~7 s here)
def test_two_processes_initialize_at_once_without_colliding():
    """Two workers on one machine: the in-process store needs no port, so both must come up."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch.distributed as dist; from app.pipeline.music.megatron_backend import init_parallel_state;"
        "init_parallel_state(); init_parallel_state(); print(dist.get_world_size())"
    )
    root = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
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
