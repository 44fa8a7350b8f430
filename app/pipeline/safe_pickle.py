"""Read a torch checkpoint that may hold arbitrary pickled objects, without running any of them.

A Lightning `.ckpt` keeps, besides its `state_dict`, whatever the training run pickled: hyper-parameters
(plain dicts, Lightning's AttributeDict, omegaconf DictConfigs), callback states (ModelCheckpoint's best
paths and scores), loop and optimizer states, sometimes numpy scalars or paths. `torch.load(weights_only=True)`
refuses such a file; `weights_only=False` would import and call whatever the pickle names (the reference
does that: a checkpoint is then code). Here torch's own unpickler reads the file (storages, mmap), but every
global outside torch's weights-only allowlist resolves to an inert stand-in that only records what it was
given, so nothing named in the file is ever imported or called. Tensors come back as real tensors; the
other objects come back as `Opaque` records, which callers ignore (or read as data: `namespace_of`).

Megatron checkpoints save their training arguments the same way (an argparse Namespace whose fields may hold
any class the training run used), and torch.distributed.checkpoint keeps a plain pickle (`.metadata`) that
torch itself reads with `pickle.load`, holding whatever classes the saving library put there (megatron-core 0.15
stores its own `MCoreSavePlan`s): `load_partly_inert` reads such a file with the globals a caller admits resolved
to the real classes and every other one an inert record.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
from functools import lru_cache
from typing import IO, Any, Callable

import torch
from torch import _weights_only_unpickler


class Opaque(dict):
    """Stands in for a pickled object of a class we do not load: keeps its constructor arguments, its
    items and its state, runs nothing. A dict so that pickled dict subclasses can fill it."""

    pickled_global = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # called for REDUCE; NEWOBJ only uses __new__
        super().__init__()
        self.pickled_args = args
        self.pickled_kwargs = kwargs

    def __setstate__(self, state: Any) -> None:
        self.pickled_state = state

    def append(self, item: Any) -> None:  # pickled list subclasses
        self.setdefault("__items__", []).append(item)

    def extend(self, items: Any) -> None:
        self.setdefault("__items__", []).extend(items)

    def __repr__(self) -> str:
        return f"Opaque({self.pickled_global})"

    # Pickled objects can be dict keys (paths in ModelCheckpoint's best_k_models): hash and compare by identity.
    # dict declares `__hash__ = None` (dicts are unhashable); a subclass may make itself hashable again.
    def __hash__(self) -> int:  # type: ignore[override]
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


@lru_cache(maxsize=None)
def _stand_in(full_name: str) -> type[Opaque]:
    return type(f"Opaque[{full_name}]", (Opaque,), {"pickled_global": full_name})


class _InertUnpickler(pickle.Unpickler):
    """pickle.Unpickler whose globals are torch's weights-only allowlist; anything else is a stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _weights_only_unpickler._get_allowed_globals()
        full_name = f"{module}.{name}"
        if full_name in allowed:
            return allowed[full_name]
        return _stand_in(full_name)


class _InertPickleModule:
    """The `pickle_module` torch.load takes: standard pickle with the inert Unpickler."""

    Unpickler = _InertUnpickler
    load = staticmethod(lambda file, **kwargs: _InertUnpickler(file, **kwargs).load())
    __name__ = "encore_inert_pickle"


def load_inert(source: str | os.PathLike | IO[bytes], *, mmap: bool = True) -> Any:
    """torch.load of `source` (a path, or an open binary file such as a checkpoint's byte item) on the CPU with
    every non-tensor object replaced by an `Opaque` record. `mmap` applies to paths only."""
    is_path = isinstance(source, (str, os.PathLike))
    return torch.load(
        source, map_location="cpu", weights_only=False, mmap=mmap and is_path, pickle_module=_InertPickleModule
    )


def namespace_of(value: Any) -> argparse.Namespace | None:
    """Saved arguments as a Namespace of their fields, whatever they were pickled as: a Namespace (or an inert
    record of one, or of any class whose state is a dict of fields), or a plain dict. None if there are none.
    The fields keep their values, Opaque records included: callers check only the fields they use."""
    if value is None or isinstance(value, argparse.Namespace):
        return value
    if isinstance(value, Opaque):
        state = getattr(value, "pickled_state", None)
        if isinstance(state, tuple) and state and isinstance(state[0], dict):  # (dict, slot state)
            state = state[0]
        fields = state if isinstance(state, dict) else dict(value)
    elif isinstance(value, dict):
        fields = value
    else:
        raise TypeError(f"saved arguments are a {type(value).__name__}, not a set of named fields")
    return argparse.Namespace(**{str(name): field for name, field in fields.items()})


class _PartlyInertUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves the globals `admitted(module, name)` names to the real objects and every other
    global to an inert stand-in, so that a REDUCE of an unknown callable records its arguments and calls nothing."""

    def __init__(self, file: IO[bytes], admitted: Callable[[str, str], bool]):
        super().__init__(file)
        self._admitted = admitted

    def find_class(self, module: str, name: str) -> Any:
        if self._admitted(module, name):
            return super().find_class(module, name)
        return _stand_in(f"{module}.{name}")


def load_partly_inert(source: str | os.PathLike | bytes, admitted: Callable[[str, str], bool]) -> Any:
    """A plain pickle (not a torch.save archive): the globals `admitted` names are the real ones (admit only classes
    whose construction runs nothing but field assignment), every other one an `Opaque` record. A malformed pickle
    raises pickle.UnpicklingError (or the ValueError/EOFError the pickle module raises for it)."""
    if isinstance(source, bytes):
        return _PartlyInertUnpickler(io.BytesIO(source), admitted).load()
    with open(source, "rb") as file:
        return _PartlyInertUnpickler(file, admitted).load()
