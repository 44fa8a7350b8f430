"""Checkpoints laid out as Megatron-LM's training `save_checkpoint` lays them out, in each format its
`load_checkpoint` detects (megatron/training/checkpointing.py), written here step by step rather than through
Encore's own save_checkpoint, so that the loader is checked against Megatron's layout and not against itself:

  state       generate_state_dict: {"args": Namespace, "checkpoint_version": 3.0, "iteration": N, "model": ...,
              "opt_param_scheduler": {...}, "num_floating_point_operations_so_far": F, "rng_state": [...]}
  torch_dist  dist_checkpointing.save(state with model.sharded_state_dict(...), <iter dir>, content_metadata=...)
  torch       torch.save(state with model.state_dict_for_save_checkpoint(), <iter dir>/mp_rank_00/model_optim_rng.pt)
  torch_dcp   torch.distributed.checkpoint.save(state with state_dict_for_save_checkpoint(), FileSystemWriter(<iter dir>))
  tracker     <dir>/latest_checkpointed_iteration.txt: the iteration, or "release" for <dir>/release/

The saved arguments look like a real training run's: Megatron's own enums and torch dtypes besides the plain
fields, and whatever a test adds (classes no reader knows, objects whose unpickling would run code).
"""

from __future__ import annotations

import argparse
import pickle
import contextlib
import enum
import random
import sys
import types
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.enums import ModelType
from megatron.core.transformer.enums import AttnBackend

from app.pipeline.music import megatron_backend as mb

FORMATS = ("torch_dist", "torch", "torch_dcp")
# What Megatron-LM's save records as content_metadata (_build_sharded_state_dict_metadata, torch >= 2.6).
CONTENT_METADATA = {
    "singleton_local_shards": True,
    "chained_optim_avoid_prefix": True,
    "distrib_optim_sharding_type": "dp_reshardable",
}


def reference_args(model, ckpt_format: str, **extra: Any) -> argparse.Namespace:
    """The training arguments a run of `model` would save: Encore's field list plus the classes the reference's
    Megatron puts there (ModelType, AttnBackend, torch dtypes), plus `extra` (added or overriding)."""
    args = mb.checkpoint_args(model)
    args.ckpt_format = ckpt_format
    args.model_type = ModelType.encoder_or_decoder
    args.attention_backend = AttnBackend.auto
    args.params_dtype = torch.float32
    args.transformer_impl = "local"
    args.use_checkpoint_args = True
    for name, value in extra.items():
        setattr(args, name, value)
    return args


def _training_state(args: argparse.Namespace, iteration: int) -> dict[str, Any]:
    """generate_state_dict's entries besides the model (no optimizer: a --no-save-optim save)."""
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 3e-5, "num_steps": iteration * 8, "decay_style": "cosine"},
        "num_floating_point_operations_so_far": 1.5e15,
    }


def _iteration_dir(root: Path, iteration: int | None) -> Path:
    return root / ("release" if iteration is None else f"iter_{iteration:07d}")


def _write_tracker(root: Path, iteration: int | None) -> None:
    (root / mb.TRACKER_FILE).write_text("release" if iteration is None else str(iteration))


def save_as_megatron(
    model,
    root: Path,
    ckpt_format: str,
    *,
    iteration: int | None = 1000,
    args: argparse.Namespace | None = None,
    te_names: bool = False,
) -> Path:
    """Save `model` under `root` as Megatron-LM would in `ckpt_format` (iteration None: a release); the
    iteration directory. `te_names` (legacy and DCP): name the pre-norms as a Transformer Engine model does."""
    mb.init_parallel_state()
    target = _iteration_dir(root, iteration)
    target.mkdir(parents=True, exist_ok=True)
    state = _training_state(args or reference_args(model, ckpt_format), iteration or 0)
    if ckpt_format == "torch_dist":
        state["model"] = model.sharded_state_dict(metadata=dict(CONTENT_METADATA))
        with mb._cpu_device():  # dist_checkpointing.save synchronizes CUDA: the CPU shim, as Encore's save uses
            dist_checkpointing.save(state, str(target), content_metadata=dict(CONTENT_METADATA))
    elif ckpt_format == "torch":
        state["model"] = _plain_model_state(model, te_names)
        state["rng_state"] = [_rng_state()]
        (target / "mp_rank_00").mkdir(exist_ok=True)
        torch.save(state, target / "mp_rank_00" / "model_optim_rng.pt")
    elif ckpt_format == "torch_dcp":
        state["model"] = _plain_model_state(model, te_names)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target)))
    else:
        raise ValueError(ckpt_format)
    _write_tracker(root, iteration)
    return target


def _plain_model_state(model, te_names: bool) -> dict[str, Any]:
    """state_dict_for_save_checkpoint(), `_extra_state` entries included; with `te_names`, the pre-norm weights
    under Transformer Engine's fused names (TE's LayerNormColumnParallelLinear holds them)."""
    state = dict(model.state_dict_for_save_checkpoint())
    if te_names:
        renamed = {}
        for key, value in state.items():
            key = key.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
            renamed[key.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")] = value
        state = renamed
    return state


def _rng_state() -> dict[str, Any]:
    """get_rng_state's entry for one rank: Python, numpy and torch generator states (numpy objects included)."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }


# --- what a checkpoint's arguments may hold ----------------------------------------------------------------

PLANTED = "planted.txt"


def plant(marker: str) -> str:
    """Create `marker`: what unpickling a Planted object runs."""
    Path(marker).write_text("unpickling ran code\n")
    return marker


class Planted:
    """An argument value whose unpickling calls plant(marker): a stand-in for any code a pickle can run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return plant, (self.marker,)


@contextlib.contextmanager
def class_only_the_writer_knows() -> Iterator[enum.Enum]:
    """A value of an enum from a module that exists only while the checkpoint is written (a newer Megatron's, a
    user's plugin): the loader can neither import it nor find it on any allowlist."""
    module = types.ModuleType("megatron_from_the_future")
    members = enum.Enum("RecomputeGranularity", {"full": 1, "selective": 2}, module=module.__name__)
    module.RecomputeGranularity = members
    sys.modules[module.__name__] = module
    try:
        yield members.selective
    finally:
        del sys.modules[module.__name__]


# --- what older megatron-core versions write, and model-parallel saves ------------------------------------------


def lay_out_metadata_as_megatron_0_15(target: Path, **planted: Any) -> None:
    """Rewrite a torch_dist save's `.metadata` as megatron-core 0.13-0.15's save_state_dict_async_plan lays it out:
    `all_local_plans` holds each rank's `MCoreSavePlan` (a frozen SavePlan dataclass with `mcore_data`, one dict per
    tensor), and the coordinator's planner merges those into `metadata.mcore_data`. megatron-core 0.16 keeps a
    stand-in class under the same name, so pickling an instance of it writes the very global 0.15 wrote; a
    dataclass without slots pickles as (class, its __dict__), which is what is set here. `planted`: more fields
    for each plan's `mcore_data` entries (objects whose unpickling would run code, say)."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlan

    metadata = pickle.loads((target / ".metadata").read_bytes())  # our own file, written just before
    tensor_keys = [key for key, entry in metadata.state_dict_metadata.items() if hasattr(entry, "chunks")]
    plans = []
    for plan in metadata.all_local_plans:  # megatron-core 0.16: plain SavePlans
        old = MCoreSavePlan.__new__(MCoreSavePlan)
        old.__dict__.update(vars(plan))
        old.__dict__["mcore_data"] = {key: dict(planted) for key in tensor_keys}
        plans.append(old)
    assert plans, "a torch_dist save records its local plans"
    metadata.all_local_plans = plans
    metadata.mcore_data = {key: dict(planted) for key in tensor_keys}
    (target / ".metadata").write_bytes(pickle.dumps(metadata))


# Megatron's tensor-parallel split of each weight (ColumnParallelLinear and the vocab-parallel embedding split dim 0,
# RowParallelLinear dim 1); everything else is replicated on every rank.
_TP_SPLIT_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "linear_qkv.weight": 0,
    "linear_qkv.bias": 0,
    "linear_fc1.weight": 0,
    "linear_fc1.bias": 0,
    "linear_proj.weight": 1,
    "linear_fc2.weight": 1,
}


def save_legacy_tensor_parallel(model, root: Path, ranks: int = 2, *, iteration: int = 1000) -> Path:
    """A legacy save as a TP=`ranks` training run writes it: one mp_rank_<tp>/model_optim_rng.pt per tensor rank,
    each holding that rank's slice of every split weight, and args recording tensor_model_parallel_size."""
    mb.init_parallel_state()
    target = _iteration_dir(root, iteration)
    state = dict(model.state_dict_for_save_checkpoint())
    for rank in range(ranks):
        shard = {}
        for key, value in state.items():
            dim = next((d for suffix, d in _TP_SPLIT_DIM.items() if key.endswith(suffix)), None)
            shard[key] = value.chunk(ranks, dim)[rank].clone() if dim is not None and value is not None else value
        saved = _training_state(reference_args(model, "torch", tensor_model_parallel_size=ranks), iteration)
        saved["model"] = shard
        (target / f"mp_rank_{rank:02d}").mkdir(parents=True)
        torch.save(saved, target / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")
    _write_tracker(root, iteration)
    return target
