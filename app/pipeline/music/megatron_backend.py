"""Everything megatron-core specific: process-group setup, the Khala GPT, its checkpoints, two engines.

The model is Megatron's own GPTModel (local spec, no Transformer Engine) so it loads a real Khala
`torch_dist` checkpoint unchanged. Megatron assumes CUDA in a few places; the shims for those are
collected in one section below: device placement is redirected only around CPU models' calls, and the
process uses Megatron's inference RNG tracker. CUDA models run Megatron's code as it is.

Checkpoint layout (Megatron training's, which `--load` reads):
    <dir>/latest_checkpointed_iteration.txt      "354000" or "release"
    <dir>/iter_0354000/  (or <dir>/release/)      a dist checkpoint: .metadata, __*_*.distcp,
                                                  common.pt (args, iteration), metadata.json
with the model's sharded state dict under the top-level key "model". Saves write that format; loads also read
the legacy (`mp_rank_00/model_optim_rng.pt`) and plain torch.distributed.checkpoint formats Megatron-LM's
loader accepts (checkpoint_formats.py finds and reads them, running nothing pickled in them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies import torch as torch_strategies
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import GlobalMemoryBuffer

from app.pipeline import safe_pickle
from app.pipeline.music import checkpoint_formats as formats
from app.pipeline.profiles import TransformerSpec

TRACKER_FILE = formats.TRACKER_FILE
resolve_checkpoint_dir = formats.resolve_checkpoint_dir  # where callers found it before checkpoint_formats
CHECKPOINT_VERSION = 3.0
# What Megatron training (torch >= 2.6) records as `content_metadata` and builds the sharded state
# dict with: one key per layer, SwiGLU fc1 split into `_w`/`_v` halves.
SAVE_CONTENT_METADATA = {"singleton_local_shards": True, "chained_optim_avoid_prefix": True}

_init_pid: int | None = None


# ---------------------------------------------------------------------------------------------------
# CPU shims: megatron-core has no CPU path. Everything CPU-specific is here; CUDA runs stock code.
#  1. RNG tracker: the default tracker swaps CUDA RNG state around attention dropout, which needs
#     CUDA. init_parallel_state installs the inference tracker instead (a stock option, Megatron's
#     --inference-rng-tracker: dropout is off in inference anyway). The tracker is per process, so
#     it is used on every device; that keeps CPU and CUDA models usable side by side in a process.
#  2. Device placement: Megatron allocates on torch.cuda.current_device() in GlobalMemoryBuffer
#     (attention scratch), Attention._allocate_memory (StaticInferenceContext's KV cache),
#     RotaryEmbedding.get_emb (moves inv_freq) and dist_checkpointing's save (a status tensor), and
#     the save calls torch.cuda.synchronize(). `_cpu_device()` wraps each CPU forward and save:
#     inside it current_device() names the CPU, synchronize() does nothing, and the attention
#     scratch buffer is a CPU one (so CPU and CUDA scratch never mix). It patches process state,
#     so run one model call at a time per process (a Celery worker task is one thread).
# (Megatron's default causal mask is built on "cuda" too; the engines always pass an explicit mask,
# the same on every device, so that needs no shim.)
# ---------------------------------------------------------------------------------------------------

_cpu_scratch = GlobalMemoryBuffer()


@contextlib.contextmanager
def _cpu_device() -> Iterator[None]:
    """Shim 2: while active, Megatron's CUDA device lookups, syncs and scratch resolve to the CPU."""
    saved = torch.cuda.synchronize, torch.cuda.current_device, parallel_state._GLOBAL_MEMORY_BUFFER
    torch.cuda.synchronize = lambda device=None: None
    # A device name where torch's returns an index: Megatron only passes it on as a device. Set with setattr
    # because it deliberately does not match torch's signature.
    setattr(torch.cuda, "current_device", lambda: "cpu")  # noqa: B010 - see above
    parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_scratch
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device, parallel_state._GLOBAL_MEMORY_BUFFER = saved


def _device_shims(device: torch.device) -> contextlib.AbstractContextManager:
    """The CPU shim for a model on `device`; nothing at all for CUDA."""
    return _cpu_device() if device.type == "cpu" else contextlib.nullcontext()


def _model_device(model: GPTModel) -> torch.device:
    return next(model.parameters()).device


# --- process group ---------------------------------------------------------------------------------


def init_parallel_state(seed: int = 0) -> None:
    """Make this process a 1-rank Megatron world (TP=1, PP=1). Idempotent.

    The store is an in-process HashStore: no port or file, so worker processes never collide.
    Call it in the process that runs the model (a forked child must call it itself; a process
    group inherited through fork does not work and is refused here).
    """
    global _init_pid
    if dist.is_initialized():
        if _init_pid is not None and _init_pid != os.getpid():
            raise RuntimeError(
                "torch.distributed was initialized before fork; call "
                "init_parallel_state() in the worker child, not in its parent"
            )
    else:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _init_pid = os.getpid()
    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)  # shim 1


def release_scratch() -> None:
    """Free what Megatron keeps between calls: attention scratch (the largest [heads, T, T] seen)
    and the RoPE tables RotaryEmbedding.forward memoizes per sequence length (32 kept)."""
    _cpu_scratch.buffer.clear()
    if parallel_state._GLOBAL_MEMORY_BUFFER is not None:
        parallel_state._GLOBAL_MEMORY_BUFFER.buffer.clear()
    RotaryEmbedding.forward.cache_clear()


# --- model -----------------------------------------------------------------------------------------


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPU (as Khala serves), fp32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@dataclasses.dataclass(frozen=True)
class Variant:
    """The saved-argument switches Encore runs either way, beside the shape (TransformerSpec). Both engines
    implement each: megatron-core by its config, torch_engine.py by the same flags read from the model.

    linear_bias: Megatron's add_bias_linear (off with --disable-bias-linear): a bias on all four linears.
    qkv_bias: add_qkv_bias: a bias on the QKV projection alone, whatever linear_bias says.
    tied_embeddings: not untie_embeddings_and_output_weights: the output layer reuses the input embedding.
    """

    linear_bias: bool = True
    qkv_bias: bool = False
    tied_embeddings: bool = False


KHALA = Variant()  # Khala's own: biased linears, untied embeddings


def build_gpt(
    spec: TransformerSpec,
    *,
    causal: bool,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    variant: Variant = KHALA,
) -> GPTModel:
    """Khala's decoder: GQA, RoPE, RMSNorm, SwiGLU, with linear bias and untied embeddings unless `variant` says
    otherwise; uninitialized.

    `causal=False` gives the full-attention model of super-resolution (Khala switches its layers to
    padding masks; without padding that is no mask at all).
    """
    init_parallel_state()
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=variant.linear_bias,
        add_qkv_bias=variant.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # weights come from a checkpoint (or write_tiny_checkpoint)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if not causal:
        layer_spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_sequence_length,
        share_embeddings_and_output_weights=variant.tied_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rotary_base,
    )
    return model.to(device).eval().requires_grad_(False)


def init_random_weights(model: GPTModel, seed: int) -> None:
    """Deterministic stand-in weights: N(0, 0.02) matrices and biases, norms near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # fills in order of named_parameters, on the CPU generator
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.02
            base = 1.0 if name.endswith("layernorm.weight") else 0.0
            param.copy_(base + noise)


# --- checkpoints -----------------------------------------------------------------------------------
#
# A Megatron save records the training arguments (an argparse.Namespace in common.pt, or in the legacy file,
# or as a DCP byte item). The reference starts Megatron with --use-checkpoint-args, so its model is built from
# those: `load_args_from_checkpoint` takes the fields below from the checkpoint, and for a field the checkpoint
# lacks keeps its own command-line default. What it never reads from a checkpoint (norm epsilon, forced to 1e-6
# on its command line; RoPE scaling; QK layernorm; the vocabulary, which it sets to exactly 130304 / 193792)
# comes from the profile here too, whatever the checkpoint says. The arguments are read inertly
# (checkpoint_formats.py): a field holding a class Encore does not know is an Opaque record, harmless unless
# it is one of the fields below, which are then refused by name.

# Fields that change the math, with the only value Encore implements, and Megatron's default for a
# checkpoint that does not record the field. (Linear biases and tied embeddings: either value, variant_from_args.)
IMPLEMENTED_ARGS: dict[str, tuple[object, object]] = {  # name: (implemented, Megatron's default)
    "position_embedding_type": ("rope", "learned_absolute"),
    "rotary_percent": (1.0, 1.0),
    "rotary_interleaved": (False, False),
    "normalization": ("RMSNorm", "LayerNorm"),
    "apply_layernorm_1p": (False, False),
    "swiglu": (True, False),
    "squared_relu": (False, False),
    "num_experts": (None, None),
    "hybrid_override_pattern": (None, None),
    "is_hybrid_model": (False, False),
    "spec": (None, None),
    "heterogeneous_layers_config_path": (None, None),
    "heterogeneous_layers_config_encoded_json": (None, None),
}
MEGATRON_ROTARY_BASE = 10_000  # --rotary-base default


class CheckpointArgsError(ValueError):
    """A checkpoint whose recorded architecture Encore cannot run (or cannot read)."""


def _saved(args: argparse.Namespace, name: str, default: object = None) -> Any:
    """A field as load_args_from_checkpoint would leave it: the checkpoint's value unless that is None (of
    whatever type the training run saved; callers convert it)."""
    if name == "add_bias_linear" and hasattr(args, "disable_bias_linear"):  # Megatron's one-off conversion
        return not _flag(args, "disable_bias_linear", False)
    if name == "position_embedding_type" and getattr(args, "use_rotary_position_embeddings", False) is True:
        return "rope"  # validate_args: the legacy RoPE switch wins
    value = getattr(args, name, None)
    return default if value is None or (isinstance(value, list) and not value) else value


def _flag(args: argparse.Namespace, name: str, default: bool) -> bool:
    """A boolean field; anything else (an unknown class's record included) is refused by name."""
    value = getattr(args, name, None)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointArgsError(f"saved argument {name}={value!r} is not a boolean")
    return value


def _number(args: argparse.Namespace, name: str, default: object = None) -> Any:
    """A numeric field (int, or a float with an integral value); None when absent and no default."""
    value = _saved(args, name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise CheckpointArgsError(f"saved argument {name}={value!r} is not a whole number")
    return int(value)


def _same(value: object, implemented: object) -> bool:
    if implemented is None:
        return value is None or (isinstance(value, (str, list, tuple)) and not value)
    if isinstance(implemented, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) == implemented
    return value == implemented  # an Opaque record equals only itself


def variant_from_args(saved: argparse.Namespace | None, *, source: str = "checkpoint") -> Variant:
    """The switches a checkpoint's saved args set, under Megatron's names (older saves' disable_bias_linear
    included); for a switch it does not record, Megatron's default: biased linears, no QKV-only bias, tied
    embeddings. No args at all (not a Megatron training save): Khala's own."""
    if saved is None:
        return KHALA
    try:
        linear = _saved(saved, "add_bias_linear", True)
        if not isinstance(linear, bool):
            raise CheckpointArgsError(f"saved argument add_bias_linear={linear!r} is not a boolean")
        return Variant(
            linear_bias=linear,
            qkv_bias=_flag(saved, "add_qkv_bias", False),
            tied_embeddings=not _flag(saved, "untie_embeddings_and_output_weights", False),
        )
    except CheckpointArgsError as error:
        raise CheckpointArgsError(f"{source}: {error}") from None


def spec_from_args(
    saved: argparse.Namespace | None, base: TransformerSpec, *, source: str = "checkpoint"
) -> TransformerSpec:
    """The model a checkpoint's saved args describe: its architecture, with the profile's vocabulary, norm
    epsilon and position limit. No args (not a Megatron training save): the profile's own architecture."""
    if saved is None:
        return base
    wrong = [
        f"{name}={_saved(saved, name, default)!r} (Encore implements {name}={implemented!r})"
        for name, (implemented, default) in IMPLEMENTED_ARGS.items()
        if not _same(_saved(saved, name, default), implemented)
    ]
    if wrong:
        raise CheckpointArgsError(f"{source}: cannot run this architecture: " + "; ".join(wrong))
    try:
        return _shape_from_args(saved, base)
    except CheckpointArgsError as error:
        raise CheckpointArgsError(f"{source}: {error}") from None


def _shape_from_args(saved: argparse.Namespace, base: TransformerSpec) -> TransformerSpec:
    missing = [name for name in ("num_layers", "hidden_size", "num_attention_heads") if _saved(saved, name) is None]
    if missing:
        raise CheckpointArgsError(f"saved args lack {', '.join(missing)}")
    hidden, heads = _number(saved, "hidden_size"), _number(saved, "num_attention_heads")
    grouped = _flag(saved, "group_query_attention", False)
    groups = _number(saved, "num_query_groups", 1) if grouped else heads
    ffn = _number(saved, "ffn_hidden_size")
    if ffn is None:  # Megatron's validate_args: SwiGLU keeps the parameter count of a 4h MLP, in multiples of 64
        ffn = int((4 * hidden * 2 / 3) / 64) * 64
    kv_channels = _number(saved, "kv_channels")
    if kv_channels is None and hidden % heads:
        raise CheckpointArgsError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    if heads % groups:
        raise CheckpointArgsError(f"num_attention_heads={heads} is not a multiple of num_query_groups={groups}")
    return dataclasses.replace(
        base,
        num_layers=_number(saved, "num_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        kv_channels=kv_channels if kv_channels is not None else hidden // heads,
        rotary_base=_number(saved, "rotary_base", MEGATRON_ROTARY_BASE),
    )


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What a checkpoint's saved args say to build: the shape and the switches."""

    spec: TransformerSpec
    variant: Variant


def _saved_args(common: dict[str, Any], source: str) -> argparse.Namespace | None:
    try:
        return safe_pickle.namespace_of(common.get("args"))
    except TypeError as error:
        raise CheckpointArgsError(f"{source}: {error}") from None


def checkpoint_architecture(directory: str | os.PathLike, base: TransformerSpec) -> Architecture:
    """The model stored under `directory` (see spec_from_args, variant_from_args), checked against the tensors'
    stored shapes so that a vocabulary mismatch is named before any weight is read."""
    init_parallel_state()
    checkpoint = formats.locate(directory)
    source = str(checkpoint.path)
    saved = _saved_args(formats.read_common(checkpoint), source)
    _refuse_model_parallel(saved, source)
    architecture = Architecture(spec_from_args(saved, base, source=source), variant_from_args(saved, source=source))
    _check_vocabulary(checkpoint, architecture.spec)
    return architecture


PARALLEL_ARGS = {  # saved argument: what it splits
    "tensor_model_parallel_size": "tensor-parallel",
    "pipeline_model_parallel_size": "pipeline-parallel",
    "expert_model_parallel_size": "expert-parallel",
}


def _refuse_model_parallel(saved: argparse.Namespace | None, source: str) -> None:
    """A save recorded as split across model-parallel ranks is refused by name, in every format: Encore builds
    and loads one rank (TP=1, PP=1). (The reference's own loader loads a TP=2 legacy save silently wrong.)"""
    if saved is None:
        return
    try:
        split = [
            f"{label} ({name}={size})" for name, label in PARALLEL_ARGS.items() if (size := _number(saved, name, 1)) > 1
        ]
    except CheckpointArgsError as error:
        raise CheckpointArgsError(f"{source}: {error}") from None
    if split:
        raise CheckpointArgsError(
            f"{source}: a {' and '.join(split)} save; Encore loads one-rank saves only: convert it to tensor and "
            "pipeline parallel size 1 (Megatron-LM's tools/checkpoint/convert.py) first"
        )


def _check_vocabulary(checkpoint: formats.Checkpoint, spec: TransformerSpec) -> None:
    shapes = formats.tensor_shapes(checkpoint)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        expected = (spec.vocab_size, spec.hidden_size)
        if key in shapes and shapes[key] != expected:
            raise CheckpointArgsError(
                f"{checkpoint.path}: {key} is {list(shapes[key])} in the checkpoint but the model needs "
                f"{list(expected)} (vocabulary {spec.vocab_size}, as the reference builds it, by hidden size "
                f"{spec.hidden_size})"
            )


def checkpoint_spec(directory: str | os.PathLike, base: TransformerSpec) -> TransformerSpec:
    """The shape of the model stored under `directory` (checkpoint_architecture without the switches)."""
    return checkpoint_architecture(directory, base).spec


def model_spec(model: GPTModel) -> TransformerSpec:
    """The TransformerSpec a built model has (what load_gpt read from its checkpoint)."""
    c = model.config
    return TransformerSpec(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_query_groups,
        ffn_hidden_size=c.ffn_hidden_size,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        rotary_base=int(model.rotary_base),
        norm_epsilon=c.layernorm_epsilon,
        kv_channels=c.kv_channels,
    )


def model_variant(model: GPTModel) -> Variant:
    """The switches a built model has."""
    return Variant(
        linear_bias=model.config.add_bias_linear,
        qkv_bias=model.config.add_qkv_bias,
        tied_embeddings=model.share_embeddings_and_output_weights,
    )


def checkpoint_args(model: GPTModel) -> argparse.Namespace:
    """The Megatron training arguments describing `model`, under Megatron's own names: every field
    load_args_from_checkpoint reads, and the others a training run of this model would have set."""
    c = model.config
    return argparse.Namespace(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.ffn_hidden_size,
        seq_length=4096,
        num_attention_heads=c.num_attention_heads,
        group_query_attention=True,
        num_query_groups=c.num_query_groups,
        kv_channels=c.kv_channels,
        max_position_embeddings=model.max_sequence_length,
        position_embedding_type="rope",
        add_position_embedding=True,
        use_rotary_position_embeddings=False,
        rotary_base=int(model.rotary_base),
        rotary_percent=model.rotary_percent,
        rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=False,
        add_bias_linear=c.add_bias_linear,
        add_qkv_bias=c.add_qkv_bias,
        squared_relu=False,
        swiglu=True,
        untie_embeddings_and_output_weights=not model.share_embeddings_and_output_weights,
        apply_layernorm_1p=False,
        normalization="RMSNorm",
        norm_epsilon=c.layernorm_epsilon,
        qk_layernorm=False,
        apply_query_key_layer_scaling=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        hybrid_override_pattern=None,
        spec=None,
        hybrid_attention_ratio=0.0,
        hybrid_mlp_ratio=0.0,
        num_experts=None,
        moe_layer_freq=1,
        moe_ffn_hidden_size=None,
        moe_router_topk=2,
        is_hybrid_model=False,
        heterogeneous_layers_config_path=None,
        heterogeneous_layers_config_encoded_json=None,
        tokenizer_type="NullTokenizer",
        vocab_size=model.vocab_size,
        padded_vocab_size=model.vocab_size,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        ckpt_format="torch_dist",
        bf16=c.bf16,
        fp16=c.fp16,
        micro_batch_size=1,
        seed=1234,
    )


def save_checkpoint(model: GPTModel, directory: str | os.PathLike, *, iteration: int = 1) -> Path:
    """Write `model` as Megatron training would: <dir>/iter_XXXXXXX/ plus the tracker file.

    Saving uses multiprocessing (a spawned manager, forked writers): not from a daemonic process.
    """
    init_parallel_state()
    directory = Path(directory)
    target = directory / f"iter_{iteration:07d}"
    target.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.sharded_state_dict(metadata=dict(SAVE_CONTENT_METADATA)),
        "args": checkpoint_args(model),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
    }
    with _device_shims(_model_device(model)):
        dist_checkpointing.save(state, str(target), content_metadata=dict(SAVE_CONTENT_METADATA))
    (directory / TRACKER_FILE).write_text(str(iteration))
    return target


class _PreloadedCommon(TorchCommonLoadStrategy):
    """megatron-core's common-state strategy, but answering with the common state already read inertly
    (checkpoint_formats.read_common): its own reads common.pt with torch.load, which refuses (or, unsafely
    configured, runs) any class outside the allowlist."""

    def __init__(self, common: dict[str, Any]):
        super().__init__()
        self._common = common

    def load_common(self, checkpoint_dir: Union[str, Path]) -> dict[str, Any]:
        return dict(self._common)


class _InertMetadataStrategy(TorchDistLoadShardedStrategy):
    """megatron-core's torch_dist load, but every DCP reader it opens reads `.metadata` through
    checkpoint_formats.SafeReader (its own reads it with pickle.load: megatron-core 0.15's saves name its
    MCoreSavePlan there, and any save may name a class whose unpickling runs code). megatron-core creates its
    readers through a module function, so that function is swapped for the duration of the load; one load at a
    time per process, as for the CPU shims."""

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        saved = torch_strategies._get_filesystem_reader
        torch_strategies._get_filesystem_reader = lambda directory, cache_metadata=False: formats.SafeReader(
            Path(directory)
        )
        try:
            return super().load(sharded_state_dict, checkpoint_dir)
        finally:
            torch_strategies._get_filesystem_reader = saved


def load_checkpoint(model: GPTModel, directory: str | os.PathLike) -> None:
    """Load weights from a Megatron save dir (real Khala or ours, any of the three formats) into `model`, any
    dtype/device.

    torch_dist: the sharded state dict is built with the checkpoint's own content metadata, so both per-layer
    (Megatron >= 0.14 default) and stacked-layer keys load. Transformer Engine checkpoints load too: the local
    spec maps its norms to TE's fused names (checkpoint_formats does the same for the other formats); TE's
    `_extra_state` is not read.
    """
    init_parallel_state()
    checkpoint = formats.locate(directory)
    if checkpoint.format == "torch_dist":
        _load_dist(model, checkpoint)
    else:
        _load_plain(model, checkpoint)


def _load_dist(model: GPTModel, checkpoint: formats.Checkpoint) -> None:
    path = str(checkpoint.path)
    formats.read_dcp_metadata(checkpoint.path)  # a malformed .metadata is named before any model is built
    common = formats.read_common(checkpoint)
    metadata = common.get("content_metadata")
    sharded = model.sharded_state_dict(metadata=dict(metadata) if isinstance(metadata, dict) else {})
    sharded = {k: v for k, v in sharded.items() if not k.endswith("._extra_state")}
    try:
        loaded = dist_checkpointing.load(
            {"model": sharded},
            path,
            sharded_strategy=_InertMetadataStrategy(),
            common_strategy=_PreloadedCommon(common),
        )
    except CheckpointException as error:  # a BaseException: would slip past `except Exception`
        raise RuntimeError(f"cannot load checkpoint {path}: {error}") from None
    model.load_state_dict(loaded["model"], strict=True)


def _load_plain(model: GPTModel, checkpoint: formats.Checkpoint) -> None:
    """A legacy or DCP model state dict into `model`: every tensor the model has must be there, nothing more."""
    state = formats.read_model_state(checkpoint)
    result = model.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if not key.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"cannot load checkpoint {checkpoint.path} ({checkpoint.format}): "
            f"missing {missing or 'nothing'}, unexpected {result.unexpected_keys or 'nothing'}"
        )


def write_tiny_checkpoint(
    spec: TransformerSpec, directory: str | os.PathLike, *, causal: bool, seed: int, variant: Variant = KHALA
) -> Path:
    """Random weights (same for the same seed) saved in the real checkpoint layout."""
    model = build_gpt(spec, causal=causal, device="cpu", dtype=torch.float32, variant=variant)
    init_random_weights(model, seed)
    return save_checkpoint(model, directory)


def load_gpt(
    spec: TransformerSpec,
    directory: str | os.PathLike,
    *,
    causal: bool,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> GPTModel:
    """Build the model the checkpoint under `directory` records (its saved args; `spec` gives the vocabulary,
    norm epsilon and position limit, and the architecture of a checkpoint without args) and fill it."""
    architecture = checkpoint_architecture(directory, spec)
    model = build_gpt(architecture.spec, causal=causal, device=device, dtype=dtype, variant=architecture.variant)
    load_checkpoint(model, directory)
    return model


def load_causal_lm(
    spec: TransformerSpec, directory: str | os.PathLike, *, device: torch.device | str, dtype: torch.dtype | None = None
) -> "MegatronCausalLM":
    """The backbone engine: a causal model loaded from `directory`."""
    return MegatronCausalLM(load_gpt(spec, directory, causal=True, device=device, dtype=dtype))


def load_bidirectional_lm(
    spec: TransformerSpec, directory: str | os.PathLike, *, device: torch.device | str, dtype: torch.dtype | None = None
) -> "MegatronBidirectionalLM":
    """The super-resolution engine: a non-causal model loaded from `directory`."""
    return MegatronBidirectionalLM(load_gpt(spec, directory, causal=False, device=device, dtype=dtype))


# --- engines ---------------------------------------------------------------------------------------


def _output_weight(model: GPTModel) -> Tensor:
    """The output projection: the input embedding itself when the model ties them (its output layer then has
    no weight of its own)."""
    if model.share_embeddings_and_output_weights:
        return model.embedding.word_embeddings.weight
    return model.output_layer.weight


def _causal_mask(length: int, device: torch.device) -> Tensor:
    """Megatron's convention: True marks a masked (future) position; shape [1, 1, T, T]."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]


class MegatronCausalLM:
    """CausalLM over a Megatron GPTModel with StaticInferenceContext as the KV cache."""

    def __init__(self, model: GPTModel):
        self.model = model.eval()
        self.vocab_size = model.vocab_size
        self.device = _model_device(model)
        self._context: StaticInferenceContext | None = None

    def reset(self, max_len: int) -> None:
        if max_len > self.model.max_sequence_length:
            raise ValueError(f"{max_len} positions exceed the model's {self.model.max_sequence_length}")
        self._context = None  # drop the old cache before allocating the new one
        self._context = StaticInferenceContext(max_batch_size=1, max_sequence_length=max_len)

    def _forward(self, ids: Tensor, start: int, mask: Tensor | None, context: StaticInferenceContext | None) -> Tensor:
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        with _device_shims(self.device):
            return self.model(ids, positions, mask, inference_context=context, runtime_gather_output=True)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> Tensor:
        context = self._require_fresh_context()
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        logits = self._forward(tokens, 0, _causal_mask(tokens.shape[1], self.device), context)
        context.increment_sequence_len_offset(tokens.shape[1])
        context.enable_decode_mode()
        return logits[0, -1].float()

    @torch.inference_mode()
    def decode(self, token_id: int) -> Tensor:
        context = self._context
        if context is None or context.sequence_len_offset == 0:
            raise RuntimeError("decode() needs prefill() first")
        tokens = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        logits = self._forward(tokens, context.sequence_len_offset, None, context)
        context.increment_sequence_len_offset(1)
        return logits[0, -1].float()

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> Tensor:
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        return self._forward(tokens, 0, _causal_mask(tokens.shape[1], self.device), None)[0].float()

    def release(self) -> None:
        self._context = None
        release_scratch()

    def _require_fresh_context(self) -> StaticInferenceContext:
        if self._context is None:
            raise RuntimeError("call reset(max_len) before prefill()")
        if self._context.sequence_len_offset:
            raise RuntimeError("prefill() needs a fresh cache: call reset(max_len) first")
        return self._context


class MegatronBidirectionalLM:
    """BidirectionalLM over a Megatron GPTModel built with causal=False.

    Runs embeddings -> decoder (with its final norm) -> a slice of the output layer, as Khala's
    super-resolution does, instead of GPTModel.forward's full-vocabulary projection.
    """

    def __init__(self, model: GPTModel):
        self.model = model.eval()
        self.vocab_size = model.vocab_size
        self.device = _model_device(model)

    @property
    def input_embeddings(self) -> Tensor:
        return self.model.embedding.word_embeddings.weight

    @torch.inference_mode()
    def logits(self, embeddings: Tensor, vocab: slice | None = None) -> Tensor:
        length = embeddings.shape[0]
        hidden_states = embeddings.to(self.device, self.model.config.params_dtype)[:, None]
        with _device_shims(self.device):
            rotary = self.model.rotary_pos_emb(length)
            hidden = self.model.decoder(hidden_states=hidden_states, attention_mask=None, rotary_pos_emb=rotary)
        weight = _output_weight(self.model)
        if vocab is not None:
            weight = weight[vocab]
        return (hidden[:, 0] @ weight.t()).float()

    def release(self) -> None:
        release_scratch()
