"""Queue names. Tracks go to GPU queues (gpu0, gpu1, ...); each GPU queue has a companion, `<queue>.cpu`, that the
CPU-stage worker of the same host consumes (worker_entrypoint.sh starts both), so the stages that need no GPU
(music export, lip-sync prepare and mux) run beside the GPU worker, on its host's scratch, and not in its child.
A companion is never a place to route a track to: a track's queue is always a GPU queue."""

from __future__ import annotations

CPU_SUFFIX = ".cpu"


def cpu_queue_of(queue: str) -> str:
    """The companion queue of GPU queue `queue`."""
    return f"{queue}{CPU_SUFFIX}"


def is_cpu_queue(queue: str) -> bool:
    return queue.endswith(CPU_SUFFIX)
