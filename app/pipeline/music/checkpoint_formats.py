"""Find a Megatron training checkpoint and read it, in every format Megatron-LM's loader detects, running nothing.

Megatron-LM's `load_checkpoint` reads `<dir>/latest_checkpointed_iteration.txt` ("354000" or "release"), opens
`<dir>/iter_0354000/` or `<dir>/release/`, and tells the format from what it finds there, in this order:
  torch_dist  `metadata.json`: megatron-core's dist checkpoint (a torch.distributed.checkpoint directory of
              sharded tensors, plus `common.pt`: args, iteration, checkpoint_version, content_metadata)
  torch       an `mp_rank_0*` entry: legacy, one torch.save per model-parallel rank; a one-rank load opens
              `mp_rank_00/model_optim_rng.pt` = {"args", "checkpoint_version", "iteration", "model", ...}
  torch_dcp   `.metadata`: torch.distributed.checkpoint.save of that same dict (model tensors under "model.",
              args and iteration as byte items)
Reading the torch_dist tensors is megatron-core's job (megatron_backend.py); this module finds the directory, names
its format, and reads everything else: the non-tensor entries, the legacy and DCP model state dicts, the shapes.

Megatron's own loader unpickles these files in full (a checkpoint is then code). Here nothing pickled is run:
  - torch.save'd objects (common.pt, model_optim_rng.pt, DCP byte items) go through safe_pickle.load_inert, where
    every class outside torch's weights-only allowlist becomes an inert Opaque record;
  - a DCP `.metadata` (a plain pickle that torch reads with pickle.load, for torch_dist as well) is first read
    admitting only torch.distributed.checkpoint's own metadata classes, and refused if it names anything else.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from app.pipeline import safe_pickle

TRACKER_FILE = "latest_checkpointed_iteration.txt"
DIST_MARKER = "metadata.json"  # megatron-core's check_is_distributed_checkpoint
DCP_METADATA = ".metadata"
LEGACY_RANK_PREFIX = "mp_rank_0"  # what Megatron-LM's format detection looks for
LEGACY_FILE = Path("mp_rank_00") / "model_optim_rng.pt"  # tensor rank 0, no pipeline or expert parallelism
COMMON_FILE = "common.pt"
NON_TENSOR_ENTRIES = ("args", "checkpoint_version", "iteration")

Format = Literal["torch_dist", "torch", "torch_dcp"]

# Transformer Engine fuses each pre-norm into the linear after it; Encore's local-spec model keeps it separate.
# (megatron-core's local spec maps the same names for torch_dist, as sharded_state_dict_keys_map.)
_TE_NORM_NAMES = (
    (".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
    (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."),
)


class CheckpointFormatError(ValueError):
    """A directory that holds no checkpoint Megatron-LM's loader would accept, or one Encore cannot read safely."""


@dataclass(frozen=True)
class Checkpoint:
    """One saved iteration: its directory (iter_XXXXXXX/ or release/) and the format found there."""

    path: Path
    format: Format


# --- where and what ---------------------------------------------------------------------------------


def resolve_checkpoint_dir(directory: str | os.PathLike) -> Path:
    """The iteration directory Megatron-LM's loader would open under a save dir (its tracker file names it), or
    `directory` itself when it already is one."""
    directory = Path(directory)
    tracker = directory / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return directory / "release"
        if not re.fullmatch(r"\d+", text):
            raise CheckpointFormatError(f"{tracker} holds {text!r}: neither an iteration number nor 'release'")
        return directory / f"iter_{int(text):07d}"
    if directory.is_dir() and _looks_like_checkpoint(directory):
        return directory
    raise FileNotFoundError(f"no Megatron checkpoint in {directory} (missing {TRACKER_FILE})")


def _looks_like_checkpoint(path: Path) -> bool:
    return (path / DIST_MARKER).is_file() or (path / DCP_METADATA).is_file() or _has_rank_dirs(path)


def _has_rank_dirs(path: Path) -> bool:
    return any(entry.name.startswith(LEGACY_RANK_PREFIX) for entry in path.iterdir())


def detect_format(path: Path) -> Format:
    """Megatron-LM's order: a dist checkpoint, else legacy rank directories, else a plain DCP directory."""
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if (path / DIST_MARKER).is_file():
        return "torch_dist"
    if _has_rank_dirs(path):
        return "torch"
    if (path / DCP_METADATA).is_file():
        return "torch_dcp"
    raise CheckpointFormatError(f"unknown checkpoint format in {path}: no {DIST_MARKER}, mp_rank_0*/ or .metadata")


def locate(directory: str | os.PathLike) -> Checkpoint:
    """The checkpoint a load of `directory` reads, and its format."""
    path = resolve_checkpoint_dir(directory)
    return Checkpoint(path, detect_format(path))


def _legacy_file(path: Path) -> Path:
    file = path / LEGACY_FILE
    if not file.is_file():
        ranks = sorted(entry.name for entry in path.iterdir() if entry.name.startswith(LEGACY_RANK_PREFIX))
        raise CheckpointFormatError(
            f"{path}: a legacy checkpoint without {LEGACY_FILE} (found {', '.join(ranks)}): saved with pipeline or "
            "expert parallelism, which a one-rank load cannot read"
        )
    return file


# --- DCP, read safely ---------------------------------------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.",)
_DCP_EXTRA_GLOBALS = frozenset(
    {"torch.Size", "torch.serialization._get_layout", "collections.OrderedDict"}
    | {f"pathlib.{name}" for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}
)  # (a save records its checkpoint_id, which may be a path)


def _dcp_metadata_global(module: str, name: str) -> bool:
    """What a DCP `.metadata` may name: torch.distributed.checkpoint's classes (dataclasses and enums), torch's
    dtypes, sizes and layouts, paths. Functions of those modules are not admitted: calling one could do anything."""
    full_name = f"{module}.{name}"
    if full_name in _DCP_EXTRA_GLOBALS:
        return True
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return True
    if module.startswith(_DCP_MODULES) and not name.startswith("__"):
        try:
            return isinstance(getattr(importlib.import_module(module), name, None), type)
        except ImportError:
            return False
    return False


def read_dcp_metadata(path: Path) -> Metadata:
    """A DCP directory's `.metadata`, read admitting only DCP's own metadata classes."""
    try:
        metadata = safe_pickle.load_allowlisted(path / DCP_METADATA, _dcp_metadata_global)
    except safe_pickle.RefusedGlobal as refused:
        raise CheckpointFormatError(f"{path / DCP_METADATA}: {refused}; not loading it") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(f"{path / DCP_METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class _SafeReader(FileSystemReader):
    """torch's FileSystemReader, but the metadata comes from read_dcp_metadata (torch's own uses pickle.load)."""

    def __init__(self, path: Path):
        super().__init__(path)
        self._directory = path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self._directory)
        storage_meta = metadata.storage_meta or StorageMeta()  # older saves have none
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _InertBytesPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but byte items (torch.save'd objects) are read inertly (torch's uses
    torch.load(weights_only=False))."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Into the dict the caller passed (set_up_planner may work on a flattened copy of it).
        self.original_state_dict[read_item.dest_index.fqn] = safe_pickle.load_inert(value, mmap=False)


def _read_dcp(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Fill `state` (DCP keys -> preallocated tensors, or None for byte items) from the DCP directory, in this
    process alone (no collectives: every process reads the whole checkpoint)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=_SafeReader(path), planner=_InertBytesPlanner(), no_dist=True)
    return state


def _dcp_byte_entries(path: Path, names: Sequence[str]) -> dict[str, Any]:
    entries = read_dcp_metadata(path).state_dict_metadata
    wanted = {name: None for name in names if isinstance(entries.get(name), BytesStorageMetadata)}
    return _read_dcp(path, wanted) if wanted else {}


def _dcp_model_tensors(path: Path) -> dict[str, Tensor]:
    entries = read_dcp_metadata(path).state_dict_metadata
    state: dict[str, Any] = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    _read_dcp(path, state)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


# --- what a checkpoint holds -------------------------------------------------------------------------


def read_common(checkpoint: Checkpoint) -> dict[str, Any]:
    """The non-tensor entries Megatron saves beside the weights (args, checkpoint_version, iteration; for
    torch_dist also content_metadata), every object of a class outside torch's allowlist an inert record."""
    if checkpoint.format == "torch_dist":
        common = safe_pickle.load_inert(checkpoint.path / COMMON_FILE)
        if not isinstance(common, dict):
            raise CheckpointFormatError(f"{checkpoint.path / COMMON_FILE} holds a {type(common).__name__}, not a dict")
        return dict(common)
    if checkpoint.format == "torch":
        saved = safe_pickle.load_inert(_legacy_file(checkpoint.path))  # mmap: the tensors are not read here
        return {name: value for name, value in saved.items() if name in NON_TENSOR_ENTRIES}
    return _dcp_byte_entries(checkpoint.path, NON_TENSOR_ENTRIES)


def read_model_state(checkpoint: Checkpoint) -> dict[str, Tensor]:
    """The model's state dict from a legacy or DCP checkpoint, under Encore's (megatron-core local spec) names:
    Transformer Engine's fused norm names mapped, wrappers' `module.` prefixes and `_extra_state` dropped."""
    if checkpoint.format == "torch":
        saved = safe_pickle.load_inert(_legacy_file(checkpoint.path))
        if "model" not in saved:
            found = sorted(name for name in saved if str(name).startswith("model"))
            raise CheckpointFormatError(f"{checkpoint.path}: no 'model' entry (found {found or 'none'})")
        state = saved["model"]
    elif checkpoint.format == "torch_dcp":
        state = _dcp_model_tensors(checkpoint.path)
    else:
        raise ValueError("torch_dist tensors are read by megatron-core (megatron_backend.load_checkpoint)")
    return local_spec_names(state)


def local_spec_names(state: dict[str, Any]) -> dict[str, Tensor]:
    """A model state dict as the local-spec GPTModel names it (see read_model_state); non-tensors dropped."""
    return {
        _local_name(key): value
        for key, value in state.items()
        if isinstance(value, Tensor) and not key.endswith("_extra_state")
    }


def _local_name(key: str) -> str:
    while key.startswith("module."):  # DDP / Float16Module wrappers, if a save kept them
        key = key.removeprefix("module.")
    for fused, local in _TE_NORM_NAMES:
        key = key.replace(fused, local)
    return key


def tensor_shapes(checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
    """The stored shape of each model tensor, under local-spec names, read without reading the tensors (legacy:
    memory-mapped)."""
    if checkpoint.format == "torch":
        return {key: tuple(tensor.shape) for key, tensor in read_model_state(checkpoint).items()}
    entries = read_dcp_metadata(checkpoint.path).state_dict_metadata
    prefix = "model." if checkpoint.format == "torch_dcp" else ""
    return {
        _local_name(key.removeprefix(prefix)): tuple(entry.size)
        for key, entry in entries.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
