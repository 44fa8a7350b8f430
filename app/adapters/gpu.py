"""Per-GPU memory and utilisation, read through NVML by the worker's master (app/tasks/worker_hooks.py).

NVML is the driver's management library: nvidia-ml-py calls it without creating a CUDA context, so the
master, which forks its pool children and must never initialise CUDA, may read it on every heartbeat. The
readings go into the worker's heartbeat hash (field `gpus`, JSON) and the web's /metrics exposes them
(app/control/metrics.py). Where there is no NVIDIA driver, nvmlInit fails once: the probe stays off, the heartbeat
has no `gpus` field and /metrics has no GPU series.

A worker reports the cards its CUDA_VISIBLE_DEVICES names (indices in NVML's order, which is CUDA's under
CUDA_DEVICE_ORDER=PCI_BUS_ID, or GPU-<uuid> prefixes; parsing stops at the first entry it cannot use, as
CUDA's does), or every card when it is unset or empty (app/core/config.py cannot tell those apart; an unpinned
worker may use any card): one worker per card then reports only its own.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("encore.worker")


class GpuProbe:
    """Reads the visible cards' memory and utilisation; off (reads nothing) where NVML cannot start."""

    def __init__(self, visible_devices: str):
        self.visible_devices = visible_devices
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] | None = None  # (NVML index, handle); None: not started; []: off

    @property
    def available(self) -> bool:
        return bool(self._start())

    def read(self) -> list[dict[str, Any]]:
        """One reading per visible card (a card that fails to answer is left out of this one)."""
        readings = []
        for index, handle in self._start():
            try:
                readings.append(self._reading(index, handle))
            except Exception as exc:  # noqa: BLE001 - NVMLError mostly; a reading must never cost the worker its heartbeat
                log.debug("event=gpu_read_failed gpu=%s error=%s", index, exc)
        return readings

    def heartbeat_fields(self) -> dict[str, str]:
        """What the heartbeat writes: {"gpus": JSON readings}, or nothing on a host without NVML."""
        return {"gpus": json.dumps(self.read())} if self.available else {}

    def _reading(self, index: int, handle: Any) -> dict[str, Any]:
        nvml = self._nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        return {
            "index": index,
            "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
            "name": _text(nvml.nvmlDeviceGetName(handle)),
            "memory_used_bytes": int(memory.used),
            "memory_free_bytes": int(memory.free),
            "memory_total_bytes": int(memory.total),
            "utilization": rates.gpu / 100.0,
        }

    def _start(self) -> list[tuple[int, Any]]:
        if self._handles is None:
            self._handles = []
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handles = self._visible(pynvml)
                log.info("event=gpu_probe cards=%d", len(self._handles))
            except Exception as exc:  # noqa: BLE001 - no driver, no library, no package (pynvml has its own types): a CPU host
                log.info("event=gpu_probe cards=0 reason=%r", str(exc))
        return self._handles

    def _visible(self, nvml: Any) -> list[tuple[int, Any]]:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        return [(index, handles[index]) for index in visible_indices(self.visible_devices, uuids)]


def visible_indices(visible: str, uuids: list[str]) -> list[int]:
    """NVML indices of the cards a CUDA_VISIBLE_DEVICES value names (all when it is empty)."""
    if not visible.strip():
        return list(range(len(uuids)))
    chosen: list[int] = []
    for entry in (part.strip() for part in visible.split(",")):
        index = _index_of(entry, uuids)
        if index is None:
            break
        if index not in chosen:
            chosen.append(index)
    return chosen


def _index_of(entry: str, uuids: list[str]) -> int | None:
    if entry.isdigit():
        return int(entry) if int(entry) < len(uuids) else None
    if entry.startswith("GPU-"):
        matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    return None  # "-1", MIG-…, anything else: CUDA sees nothing from here on


def parse_readings(value: str | None) -> list[dict[str, Any]]:
    """A heartbeat's `gpus` field as readings ([] when absent or unreadable)."""
    try:
        readings = json.loads(value) if value else []
    except ValueError:
        return []
    return [r for r in readings if isinstance(r, dict)] if isinstance(readings, list) else []


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
