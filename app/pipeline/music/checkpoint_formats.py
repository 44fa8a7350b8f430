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
  - a DCP `.metadata` (a plain pickle that torch reads with pickle.load, for torch_dist as well) is read with only
    the metadata classes loading needs resolved (torch.distributed.checkpoint's own), anything else it holds
    (megatron-core's save plans, say) as inert records, then checked field by field; megatron-core's torch_dist
    load is handed that reader too (megatron_backend.load_checkpoint).
"""

from __future__ import annotations

import io
import pickle
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
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
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


_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")  # tensor rank, pipeline rank, expert rank


def _legacy_file(path: Path) -> Path:
    """The one-rank legacy file, after refusing a save split across ranks: Megatron-LM names each rank's directory
    mp_rank_<tensor rank>[_<pipeline rank>][_<expert rank>], and a one-rank load would read only the first part."""
    names = sorted(entry.name for entry in path.iterdir() if entry.name.startswith(LEGACY_RANK_PREFIX))
    split = parallelism_of_rank_dirs(names)
    if split:
        raise CheckpointFormatError(
            f"{path}: a {split} legacy save ({', '.join(names)}); Encore loads one-rank saves only: convert it to "
            "tensor and pipeline parallel size 1 (Megatron-LM's tools/checkpoint/convert.py) first"
        )
    file = path / LEGACY_FILE
    if not file.is_file():
        raise CheckpointFormatError(f"{path}: a legacy checkpoint without {LEGACY_FILE} (found {', '.join(names)})")
    return file


def parallelism_of_rank_dirs(names: Sequence[str]) -> str:
    """What splits a legacy save across its rank directories ("tensor-parallel", ...), or "" for a one-rank save."""
    ranks = [match.groups() for match in map(_RANK_DIR.fullmatch, names) if match]
    splits = []
    for label, position in (("tensor-parallel", 0), ("pipeline-parallel", 1), ("expert-parallel", 2)):
        if any(group[position] not in (None, "00", "000") for group in ranks):
            splits.append(label)
    return " and ".join(splits)


# --- DCP, read safely ---------------------------------------------------------------------------------
#
# A `.metadata` is a plain pickle of torch's `Metadata`, plus whatever the saving library hung on it: megatron-core
# 0.13-0.15 add `all_local_plans` (a list of its own `MCoreSavePlan`, a SavePlan subclass) and `mcore_data`; 0.16
# keeps `all_local_plans` as plain SavePlans. Loading needs only the tensor and byte entries and where their bytes
# lie. So the classes that describe those resolve to torch's own (dataclasses and enums whose construction assigns
# fields and runs nothing else); every other global (a plan, Megatron's classes, a callable planted to run code)
# becomes an inert record, and a fresh Metadata is built from the checked entries alone.

_DCP_LOADING_CLASSES = frozenset(
    f"torch.distributed.checkpoint.metadata.{name}"
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
) | {"torch.distributed.checkpoint.filesystem._StorageInfo"}
_DCP_VALUE_GLOBALS = frozenset(
    {"torch.Size", "torch.serialization._get_layout", "collections.OrderedDict"}
    | {f"pathlib.{name}" for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}
)  # (a save records its checkpoint_id, which may be a path)


def _dcp_loading_global(module: str, name: str) -> bool:
    """The globals read_dcp_metadata resolves to the real objects: the classes loading needs, torch's sizes,
    layouts and dtypes, paths. Anything else in the file is read as an inert record."""
    full_name = f"{module}.{name}"
    if full_name in _DCP_LOADING_CLASSES or full_name in _DCP_VALUE_GLOBALS:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def read_dcp_metadata(path: Path) -> Metadata:
    """A DCP directory's `.metadata`, as loading needs it: the tensor and byte entries and where their bytes lie,
    checked field by field. Nothing pickled in the file runs; what loading does not need is not kept."""
    file = path / DCP_METADATA
    try:
        raw = safe_pickle.load_partly_inert(file, _dcp_loading_global)
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, AttributeError, IndexError) as error:
        raise CheckpointFormatError(f"{file}: not a readable DCP metadata file ({error})") from None
    try:
        return _loadable_metadata(raw)
    except _Malformed as malformed:
        raise CheckpointFormatError(f"{file}: {malformed}; not loading it") from None


class _Malformed(ValueError):
    """A `.metadata` entry that is not what torch's reader would need there."""


def _expect(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, safe_pickle.Opaque):  # an Opaque record is also a dict
        found = value.pickled_global if isinstance(value, safe_pickle.Opaque) else type(value).__name__
        raise _Malformed(f"{where} is a {found}, not a {getattr(kind, '__name__', kind)}")
    return value


def _loadable_metadata(raw: Any) -> Metadata:
    _expect(raw, Metadata, "the file")
    entries = _expect(raw.state_dict_metadata, dict, "state_dict_metadata")
    storage = _expect(raw.storage_data, dict, "storage_data")
    for key, entry in entries.items():
        _expect(key, str, "a state_dict_metadata key")
        if not isinstance(entry, BytesStorageMetadata):
            _check_tensor_entry(_expect(entry, TensorStorageMetadata, f"entry {key!r}"), key)
    for index, info in storage.items():
        _check_index(_expect(index, MetadataIndex, "a storage_data key"))
        _check_storage_info(_expect(info, _StorageInfo, f"storage_data[{index.fqn!r}]"), index.fqn)
    version = raw.version if isinstance(getattr(raw, "version", None), str) else None
    return Metadata(state_dict_metadata=entries, storage_data=storage, storage_meta=StorageMeta(), version=version)


def _check_tensor_entry(entry: TensorStorageMetadata, key: str) -> None:
    properties = _expect(entry.properties, TensorProperties, f"entry {key!r}'s properties")
    _expect(properties.dtype, torch.dtype, f"entry {key!r}'s dtype")
    _expect(entry.size, torch.Size, f"entry {key!r}'s size")
    for chunk in _expect(entry.chunks, list, f"entry {key!r}'s chunks"):
        _expect(chunk, ChunkStorageMetadata, f"a chunk of {key!r}")
        _expect(chunk.offsets, torch.Size, f"a chunk of {key!r}'s offsets")
        _expect(chunk.sizes, torch.Size, f"a chunk of {key!r}'s sizes")


def _check_index(index: MetadataIndex) -> None:
    _expect(index.fqn, str, "a storage index's name")
    _expect(index.offset, (torch.Size, type(None)), f"{index.fqn!r}'s storage offset")
    _expect(index.index, (int, type(None)), f"{index.fqn!r}'s storage index")


def _check_storage_info(info: _StorageInfo, fqn: str) -> None:
    relative = _expect(info.relative_path, str, f"{fqn!r}'s file")
    if Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise _Malformed(f"{fqn!r} lies in {relative!r}, outside the checkpoint directory")
    _expect(info.offset, int, f"{fqn!r}'s byte offset")
    _expect(info.length, int, f"{fqn!r}'s byte length")
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors is not None:
        for descriptor in _expect(descriptors, (list, tuple), f"{fqn!r}'s transforms"):
            _expect(descriptor, str, f"a transform of {fqn!r}")


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, but the metadata comes from read_dcp_metadata (torch's own uses pickle.load)."""

    def __init__(self, path: Path):
        super().__init__(path)
        self._directory = path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self._directory)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
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
        dcp.load(state, storage_reader=SafeReader(path), planner=_InertBytesPlanner(), no_dist=True)
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
