"""Models resident in a worker process, and the policy that decides when they are freed.

`keep_loaded`: every model stays resident across jobs. `one_shot`: only what `resident` names stays (for
music: tokenizer and backbone, as the reference backend does); the rest is freed after its stage.
Load counts are kept so a job record can say which models a stage had to load.
"""

from __future__ import annotations

import gc
import threading
from collections import Counter
from typing import Any, Callable


class ModelCache:
    def __init__(self, mode: str, resident: frozenset[str]):
        if mode not in ("keep_loaded", "one_shot"):
            raise ValueError(f"runtime mode must be keep_loaded or one_shot, not {mode!r}")
        self.mode = mode
        self.resident = resident
        self.load_counts: Counter[str] = Counter()
        self._models: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, name: str, load: Callable[[], Any], loaded: list[str] | None = None) -> Any:
        """The model called `name`, loading it with `load()` if absent (and noting that in `loaded`)."""
        with self._lock:
            if name not in self._models:
                self._models[name] = load()
                self.load_counts[name] += 1
                if loaded is not None:
                    loaded.append(name)
            return self._models[name]

    def after_stage(self, names: list[str]) -> None:
        """Free `names` unless the runtime mode keeps them."""
        if self.mode == "keep_loaded":
            return
        self.free([n for n in names if n not in self.resident])

    def free(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self._models.pop(name, None)
        release_memory()


def release_memory(collect: bool = True) -> None:
    """Hand cached CUDA blocks back so the next job (or process) can use them. `collect` also runs the
    cycle collector (~0.25 s with the models loaded): needed after an exception, whose traceback keeps
    frames and their tensors alive, or after freeing models; a stage that returned normally frees its
    tensors by reference counting."""
    if collect:
        gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def device_report() -> dict[str, object]:
    """The device this process computes on, and free/total memory when it is a GPU."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {"device": "cpu"}
    free, total = torch.cuda.mem_get_info()
    return {
        "device": f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})",
        "gpu_free_bytes": free,
        "gpu_total_bytes": total,
    }
