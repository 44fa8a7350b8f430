"""Every checkpoint Megatron-LM's loader accepts loads into both engines: the torch_dist, legacy and DCP formats
(iter_XXXXXXX/ and release/), biased and bias-free linears (and the other switches Encore implements), saved
arguments holding classes no reader knows, and nothing pickled in a checkpoint ever runs.

The checkpoints are written in Megatron-LM's own layout by harness/megatron_layout.py, not by Encore's
save_checkpoint, so the loader is checked against what the reference's training run writes.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing

from app.pipeline.music import checkpoint_formats as formats
from app.pipeline.music import megatron_backend as mb
from app.pipeline.music.stages import load_engine
from app.pipeline.profiles import load_profile
from app.pipeline.safe_pickle import Opaque
from harness.megatron_layout import (
    FORMATS,
    PLANTED,
    Planted,
    class_only_the_writer_knows,
    lay_out_metadata_as_megatron_0_15,
    reference_args,
    save_as_megatron,
    save_legacy_tensor_parallel,
)

torch.set_num_threads(2)
PROMPT = [3, 17, 512, 540, 513, 575]
TOLERANCE = 1e-5  # float32 rounding; a missing bias or a wrong tie shows up as O(0.1)
CPU = torch.device("cpu")
NO_BIAS = mb.Variant(linear_bias=False)
QKV_BIAS_ONLY = mb.Variant(linear_bias=False, qkv_bias=True)
TIED = mb.Variant(tied_embeddings=True)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return load_profile("tiny", tmp_path_factory.mktemp("unused"))


def spec_of(profile, causal: bool):
    return profile.backbone if causal else profile.superres


def source_model(spec, *, causal: bool, seed: int = 7, variant: mb.Variant = mb.KHALA):
    model = mb.build_gpt(spec, causal=causal, device="cpu", dtype=torch.float32, variant=variant)
    mb.init_random_weights(model, seed)
    return model


def reference_logits(model, causal: bool) -> torch.Tensor:
    """The source model's own logits, through Megatron's forward: what a faithful load reproduces exactly."""
    if causal:
        return mb.MegatronCausalLM(model).logits(PROMPT)
    lm = mb.MegatronBidirectionalLM(model)
    return lm.logits(lm.input_embeddings[torch.tensor(PROMPT)])


def engine_logits(lm, causal: bool) -> torch.Tensor:
    if causal:
        return lm.logits(PROMPT)
    return lm.logits(lm.input_embeddings[torch.tensor(PROMPT)])


def assert_loads_faithfully(spec, directory: Path, source, *, causal: bool) -> dict:
    """Both engines load `directory`: Megatron's reproduces the source model's weights and logits exactly, the
    plain-PyTorch one agrees with it to float32 rounding. The engines, for further checks."""
    loaded = mb.load_gpt(spec, directory, causal=causal, device="cpu")
    assert mb.model_spec(loaded) == mb.model_spec(source)
    assert mb.model_variant(loaded) == mb.model_variant(source)
    source_params = dict(source.named_parameters())
    assert set(dict(loaded.named_parameters())) == set(source_params)
    for name, param in loaded.named_parameters():
        assert torch.equal(param, source_params[name]), name
    expected = reference_logits(source, causal)
    assert expected.abs().max() > 0.1  # so that TOLERANCE is small against the logits
    engines = {name: load_engine(name, spec, directory, causal=causal, device=CPU) for name in ("megatron", "torch")}
    assert torch.equal(engine_logits(engines["megatron"], causal), expected)
    torch.testing.assert_close(engine_logits(engines["torch"], causal), expected, rtol=0, atol=TOLERANCE)
    return engines


# --- formats -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["backbone", "superres"])
@pytest.mark.parametrize("ckpt_format", FORMATS)
def test_each_format_loads_into_both_engines(profile, tmp_path, ckpt_format, causal):
    spec = spec_of(profile, causal)
    source = source_model(spec, causal=causal)
    target = save_as_megatron(source, tmp_path, ckpt_format, iteration=354_000)
    assert target.name == "iter_0354000" and (tmp_path / mb.TRACKER_FILE).read_text() == "354000"
    assert formats.locate(tmp_path) == formats.Checkpoint(target, ckpt_format)
    assert_loads_faithfully(spec, tmp_path, source, causal=causal)


@pytest.mark.parametrize("ckpt_format", FORMATS)
def test_release_directory_loads_in_each_format(profile, tmp_path, ckpt_format):
    source = source_model(profile.backbone, causal=True, seed=9)
    target = save_as_megatron(source, tmp_path, ckpt_format, iteration=None)
    assert target == tmp_path / "release" and (tmp_path / mb.TRACKER_FILE).read_text() == "release"
    assert formats.locate(tmp_path) == formats.Checkpoint(target, ckpt_format)
    for directory in (tmp_path, target):  # the save dir, or the iteration directory itself
        loaded = mb.load_gpt(profile.backbone, directory, causal=True, device="cpu")
        assert torch.equal(loaded.output_layer.weight, source.output_layer.weight)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dcp"])
def test_a_transformer_engine_models_fused_norm_names_load(profile, tmp_path, ckpt_format):
    """A model trained with Transformer Engine keeps each pre-norm inside the linear after it
    (`linear_qkv.layer_norm_weight`): the torch_dist path maps those names already, the plain formats too."""
    source = source_model(profile.backbone, causal=True)
    target = save_as_megatron(source, tmp_path, ckpt_format, te_names=True)
    names = set(formats.tensor_shapes(formats.Checkpoint(target, ckpt_format)))
    assert "decoder.layers.0.input_layernorm.weight" in names
    assert_loads_faithfully(profile.backbone, tmp_path, source, causal=True)


def test_a_legacy_checkpoint_missing_a_tensor_names_it(profile, tmp_path):
    source = source_model(profile.backbone, causal=True)
    target = save_as_megatron(source, tmp_path, "torch")
    legacy = target / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(legacy, weights_only=False)  # our own file, written just above
    del saved["model"]["decoder.layers.1.mlp.linear_fc2.bias"]
    torch.save(saved, legacy)
    with pytest.raises(RuntimeError, match=r"missing \['decoder.layers.1.mlp.linear_fc2.bias'\]"):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dcp"])
def test_vocabulary_mismatch_is_named_in_every_format(profile, tmp_path, ckpt_format):
    wrong = dataclasses.replace(profile.backbone, vocab_size=640)
    save_as_megatron(source_model(wrong, causal=True), tmp_path, ckpt_format)
    with pytest.raises(mb.CheckpointArgsError, match=r"embedding.word_embeddings.weight is \[640, 64\]"):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")


def test_what_is_not_a_checkpoint_is_named(tmp_path):
    (tmp_path / mb.TRACKER_FILE).write_text("latest\n")
    with pytest.raises(formats.CheckpointFormatError, match="neither an iteration number nor 'release'"):
        formats.locate(tmp_path)
    (tmp_path / mb.TRACKER_FILE).write_text("12\n")
    (tmp_path / "iter_0000012").mkdir()
    (tmp_path / "iter_0000012" / "notes.txt").write_text("")
    with pytest.raises(formats.CheckpointFormatError, match="unknown checkpoint format"):
        formats.locate(tmp_path)
    (tmp_path / "iter_0000012" / "mp_rank_00_001").mkdir()  # a pipeline-parallel legacy save: not one rank's
    with pytest.raises(formats.CheckpointFormatError, match="a pipeline-parallel legacy save"):
        formats.read_common(formats.locate(tmp_path))


# --- switches the saved arguments set --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["backbone", "superres"])
@pytest.mark.parametrize(
    "variant, ckpt_format",
    [
        (mb.KHALA, "torch_dist"),
        (NO_BIAS, "torch_dist"),
        (NO_BIAS, "torch"),
        (NO_BIAS, "torch_dcp"),
        (QKV_BIAS_ONLY, "torch_dist"),
        (TIED, "torch_dist"),
        (TIED, "torch"),
    ],
    ids=["biased", "bias-free", "bias-free-legacy", "bias-free-dcp", "qkv-bias-only", "tied", "tied-legacy"],
)
def test_each_switch_loads_and_both_engines_agree(profile, tmp_path, variant, ckpt_format, causal):
    spec = spec_of(profile, causal)
    source = source_model(spec, causal=causal, variant=variant)
    save_as_megatron(source, tmp_path, ckpt_format)
    engines = assert_loads_faithfully(spec, tmp_path, source, causal=causal)
    plain = engines["torch"].model
    block = plain.blocks[0]
    assert (block.ffn.down.bias is not None) == variant.linear_bias
    assert (block.attention.out.bias is not None) == variant.linear_bias
    assert (block.attention.qkv.bias is not None) == (variant.linear_bias or variant.qkv_bias)
    assert (plain.output.weight is plain.embedding.weight) == variant.tied_embeddings


def test_saved_switches_are_read_under_megatrons_names(profile):
    model = source_model(profile.backbone, causal=True)
    args = reference_args(model, "torch_dist", add_bias_linear=False, add_qkv_bias=True)
    assert mb.variant_from_args(args) == QKV_BIAS_ONLY
    del args.add_bias_linear
    args.disable_bias_linear = False  # older saves' name for it, inverted
    assert mb.variant_from_args(args).linear_bias is True
    del args.untie_embeddings_and_output_weights  # not recorded: Megatron's default, tied
    assert mb.variant_from_args(args).tied_embeddings is True
    assert mb.variant_from_args(None) == mb.KHALA
    args.add_qkv_bias = "yes"
    with pytest.raises(mb.CheckpointArgsError, match="add_qkv_bias='yes' is not a boolean"):
        mb.variant_from_args(args)


# --- saved arguments, read inertly ------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt_format", FORMATS)
def test_an_argument_of_a_class_no_reader_knows_loads(profile, tmp_path, ckpt_format):
    source = source_model(profile.backbone, causal=True)
    with class_only_the_writer_knows() as value:
        target = save_as_megatron(
            source, tmp_path, ckpt_format, args=reference_args(source, ckpt_format, recompute_granularity=value)
        )
    assert_loads_faithfully(profile.backbone, tmp_path, source, causal=True)
    args = formats.read_common(formats.Checkpoint(target, ckpt_format))["args"]
    assert isinstance(args.pickled_state["recompute_granularity"], Opaque)  # read, as an inert record
    assert args.pickled_state["recompute_granularity"].pickled_global == "megatron_from_the_future.RecomputeGranularity"
    if ckpt_format == "torch_dist":  # megatron-core's own reader stops at it (what Encore used before)
        with pytest.raises(pickle.UnpicklingError):
            dist_checkpointing.load_common_state_dict(str(target))


def test_an_unknown_class_in_a_field_that_changes_the_math_is_refused_by_name(profile, tmp_path):
    source = source_model(profile.backbone, causal=True)
    with class_only_the_writer_knows() as value:
        save_as_megatron(source, tmp_path, "torch", args=reference_args(source, "torch", normalization=value))
    with pytest.raises(
        mb.CheckpointArgsError, match=r"normalization=Opaque\(megatron_from_the_future.RecomputeGranularity\)"
    ):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")


def _load_as_megatron_lm_does(target: Path, ckpt_format: str) -> None:
    """Read the saved arguments the way Megatron-LM's loader (and torch's defaults) would: unpickling in full."""
    if ckpt_format == "torch_dist":
        torch.load(target / "common.pt", weights_only=False)
    elif ckpt_format == "torch":
        torch.load(target / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    else:
        dcp.load({"args": None, "iteration": None}, checkpoint_id=str(target), no_dist=True)


@pytest.mark.parametrize("ckpt_format", FORMATS)
def test_an_argument_whose_unpickling_runs_code_does_not_run(profile, tmp_path, ckpt_format):
    marker = tmp_path / PLANTED
    source = source_model(profile.backbone, causal=True)
    args = reference_args(source, ckpt_format, planted=Planted(marker))
    target = save_as_megatron(source, tmp_path / "ckpt", ckpt_format, args=args)
    marker.unlink(missing_ok=True)  # a save may copy its arguments (deepcopy runs __reduce__ too): start clean
    assert_loads_faithfully(profile.backbone, tmp_path / "ckpt", source, causal=True)
    common = formats.read_common(formats.Checkpoint(target, ckpt_format))
    planted = common["args"].pickled_state["planted"]
    assert planted.pickled_global == "harness.megatron_layout.plant"
    assert planted.pickled_args == (str(marker),)  # recorded, not called
    assert not marker.exists()
    _load_as_megatron_lm_does(target, ckpt_format)  # the payload is live: a full unpickle runs it
    assert marker.exists()


# --- DCP .metadata, as each megatron-core version and torch write it ---------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["backbone", "superres"])
@pytest.mark.parametrize("layout", ["megatron-core 0.16", "megatron-core 0.15"])
def test_torch_dist_metadata_of_each_megatron_core_version_loads_into_both_engines(profile, tmp_path, layout, causal):
    """megatron-core 0.13-0.15 (the Khala reference's trainer: 0.15.0rc6) store `all_local_plans` as their own
    MCoreSavePlan class, plus `mcore_data`; 0.16 stores plain SavePlans. Both load, in both engines."""
    spec = spec_of(profile, causal)
    source = source_model(spec, causal=causal)
    target = save_as_megatron(source, tmp_path, "torch_dist", iteration=354_000)
    if layout == "megatron-core 0.15":
        lay_out_metadata_as_megatron_0_15(target)
        assert b"MCoreSavePlan" in (target / ".metadata").read_bytes()
    assert_loads_faithfully(spec, tmp_path, source, causal=causal)
    metadata = formats.read_dcp_metadata(target)  # only what loading needs is kept
    assert not hasattr(metadata, "all_local_plans") and not hasattr(metadata, "mcore_data")
    assert (
        metadata.state_dict_metadata.keys()
        == pickle.loads((target / ".metadata").read_bytes()).state_dict_metadata.keys()
    )


@pytest.mark.parametrize(
    "ckpt_format, where", [("torch_dist", "mcore_data"), ("torch_dist", "planner_data"), ("torch_dcp", "planner_data")]
)  # (only megatron-core's torch_dist save writes save plans)
def test_a_dcp_metadata_file_that_would_run_code_loads_and_runs_nothing(profile, tmp_path, ckpt_format, where):
    """`.metadata` is a plain pickle torch reads with pickle.load: an object planted in a save plan's
    mcore_data (megatron-core 0.15's layout) or in planner_data is read as an inert record, never called."""
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / PLANTED
    source = source_model(profile.backbone, causal=True)
    target = save_as_megatron(source, tmp_path / "ckpt", ckpt_format)
    if where == "mcore_data":
        lay_out_metadata_as_megatron_0_15(target, planted=Planted(marker))
    else:
        metadata = pickle.loads((target / ".metadata").read_bytes())  # our own file, written just above
        metadata.planner_data = Planted(marker)
        (target / ".metadata").write_bytes(pickle.dumps(metadata))
    marker.unlink(missing_ok=True)
    assert_loads_faithfully(profile.backbone, tmp_path / "ckpt", source, causal=True)
    assert not marker.exists()
    FileSystemReader(str(target)).read_metadata()  # torch's own reader runs it: the payload is live
    assert marker.exists()


def test_a_metadata_entry_that_is_not_what_loading_needs_is_refused_by_name(profile, tmp_path):
    source = source_model(profile.backbone, causal=True)
    target = save_as_megatron(source, tmp_path, "torch_dist")
    original = (target / ".metadata").read_bytes()
    key = "output_layer.weight"

    metadata = pickle.loads(original)
    metadata.state_dict_metadata[key] = Planted(tmp_path / PLANTED)  # an unknown class where a tensor entry goes
    (target / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(
        formats.CheckpointFormatError, match=r"entry 'output_layer.weight' is a harness.megatron_layout.plant"
    ):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")
    assert not (tmp_path / PLANTED).exists()

    metadata = pickle.loads(original)
    index = next(index for index in metadata.storage_data if index.fqn == key)
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="../../etc/passwd")
    (target / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(formats.CheckpointFormatError, match="outside the checkpoint directory"):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")

    (target / ".metadata").write_bytes(original[: len(original) // 2])
    with pytest.raises(formats.CheckpointFormatError, match="not a readable DCP metadata file"):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")


# --- model-parallel saves ----------------------------------------------------------------------------------------


def test_a_tensor_parallel_legacy_save_is_refused_naming_the_parallelism(profile, tmp_path):
    """The reference's own loader reads a TP=2 legacy save silently wrong; Encore names what it is."""
    source = source_model(profile.backbone, causal=True)
    target = save_legacy_tensor_parallel(source, tmp_path, ranks=2)
    assert sorted(entry.name for entry in target.iterdir()) == ["mp_rank_00", "mp_rank_01"]
    for engine in ("megatron", "torch"):
        with pytest.raises(
            formats.CheckpointFormatError, match=r"a tensor-parallel legacy save \(mp_rank_00, mp_rank_01\)"
        ):
            load_engine(engine, profile.backbone, tmp_path, causal=True, device=CPU)


@pytest.mark.parametrize(
    "directories, named",
    [
        (["mp_rank_00_000", "mp_rank_00_001"], "pipeline-parallel"),
        (["mp_rank_00_001"], "pipeline-parallel"),
        (
            ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"],
            "tensor-parallel and pipeline-parallel",
        ),
        (["mp_rank_00_000_000", "mp_rank_00_000_001"], "expert-parallel"),
    ],
)
def test_legacy_rank_directories_name_their_parallelism(tmp_path, directories, named):
    for name in directories:
        (tmp_path / name).mkdir()
    assert formats.parallelism_of_rank_dirs(directories) == named
    with pytest.raises(formats.CheckpointFormatError, match=f"a {named} legacy save"):
        formats.read_common(formats.locate(tmp_path))


@pytest.mark.parametrize(
    "ckpt_format, recorded, named",
    [
        ("torch_dist", {"tensor_model_parallel_size": 2}, r"tensor-parallel \(tensor_model_parallel_size=2\)"),
        ("torch_dcp", {"pipeline_model_parallel_size": 4}, r"pipeline-parallel \(pipeline_model_parallel_size=4\)"),
        (
            "torch",
            {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            "tensor-parallel .* and pipeline-parallel",
        ),
    ],
)
def test_saved_args_recording_model_parallelism_are_refused_by_name(profile, tmp_path, ckpt_format, recorded, named):
    source = source_model(profile.backbone, causal=True)
    save_as_megatron(source, tmp_path, ckpt_format, args=reference_args(source, ckpt_format, **recorded))
    with pytest.raises(mb.CheckpointArgsError, match=named):
        mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")
    save_as_megatron(
        source, tmp_path, ckpt_format, args=reference_args(source, ckpt_format, tensor_model_parallel_size=1)
    )
    mb.load_gpt(profile.backbone, tmp_path, causal=True, device="cpu")  # size 1 recorded: loads
