"""Worker registry: each worker's master process writes a heartbeat hash; the stage transitions keep what
its child is running. Routing and /api/v1/status read it (no broadcast `inspect` round trip on every request).

  {p}:workers                 set of every worker name ever seen (so an expired one shows as offline)
  {p}:worker:{name}           hash, expires after 3 missed heartbeats: queue, pid, runtime_mode, device, kinds
                              (served), models_loaded + models_pid (kinds whose models its child has loaded), ...
  {p}:worker:{name}:current   hash while a stage runs (written by the `start` transition, removed when its
                              track leaves that stage): job_id, track, stage, since, pid
  {p}:queue:{q}:live_at       last heartbeat of a worker consuming q (how long a queue has had no consumer)
(key builders: app/core/keys.py)
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from app.adapters.redis_conn import decoded
from app.control.scripts import script
from app.core.keys import Layout

LIVE_AT_TTL_S = 7 * 24 * 3600


class WorkerRegistry:
    def __init__(self, client: redis.Redis, prefix: str = "encore", heartbeat_s: float = 2.0):
        self.redis = client
        self.keys = Layout(prefix)
        self.heartbeat_s = heartbeat_s
        self._record_models = script(client, "record_models")

    def _key(self, name: str) -> str:
        return self.keys.worker(name)

    @property
    def ttl_s(self) -> int:
        return offline_after_s(self.heartbeat_s)

    def heartbeat(self, name: str, info: dict[str, Any]) -> None:
        pipe = self.redis.pipeline()
        pipe.sadd(self.keys.workers, name)
        pipe.hset(self._key(name), mapping={**{k: str(v) for k, v in info.items()}, "last_seen": time.time()})
        pipe.expire(self._key(name), self.ttl_s)
        for queue in consumed_queues(info):
            pipe.set(self._queue_live_key(queue), time.time(), ex=LIVE_AT_TTL_S)
        pipe.execute()
        self._drop_stale_current(name)

    def _drop_stale_current(self, name: str) -> None:
        """A child killed mid-stage (hard limit, OOM, kill -9) cannot clear its own entry, nor take back the
        models it had loaded (its replacement loads them again and says so)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.worker_current(name), "pid")
        pipe.hget(self._key(name), "models_pid")
        current_pid, models_pid = pipe.execute()
        if current_pid and not pid_alive(int(current_pid)):
            self.redis.delete(self.keys.worker_current(name))
        if models_pid and not pid_alive(int(models_pid)):
            self.redis.hdel(self._key(name), "models_loaded", "models_pid")

    def record_models(self, name: str, kinds: list[str], pid: int) -> None:
        """The pool child `pid` has the models of `kinds` loaded (readiness, app/control/readiness.py). The child may
        get here before its master's first heartbeat: the entry then expires like one unless renewed."""
        self._record_models(keys=[self._key(name)], args=[",".join(sorted(kinds)), pid, self.ttl_s])

    def _queue_live_key(self, queue: str) -> str:
        return self.keys.queue_live_at(queue)

    def queue_live_at(self, queue: str) -> float | None:
        """When a worker consuming `queue` last sent a heartbeat (None if not within a week)."""
        value = self.redis.get(self._queue_live_key(queue))
        return float(value) if value else None

    def info(self, name: str) -> dict[str, str]:
        """The worker's heartbeat hash; empty once it missed three heartbeats."""
        return decoded(self.redis.hgetall(self._key(name)))

    def update(self, name: str, **fields: Any) -> None:
        """Fields only the child knows (device, free GPU memory, model loads); kept until the next restart."""
        if self.redis.exists(self._key(name)):
            self.redis.hset(self._key(name), mapping={k: str(v) for k, v in fields.items()})

    def add_up(self, name: str, amounts: dict[str, float], **fields: Any) -> None:
        """Add `amounts` to the worker's running totals in its hash (and set `fields`): counts a child keeps for
        the worker's life, such as its engine's tally (app/tasks/engine.py), gone with the hash."""
        if self.redis.exists(self._key(name)):
            pipe = self.redis.pipeline(transaction=False)
            for field_name, amount in amounts.items():
                pipe.hincrbyfloat(self._key(name), field_name, amount)
            if fields:
                pipe.hset(self._key(name), mapping={k: str(v) for k, v in fields.items()})
            pipe.execute()

    def forget(self, name: str) -> None:
        self.redis.srem(self.keys.workers, name)
        self.redis.delete(self._key(name), self.keys.worker_current(name))

    def workers(self) -> list[dict[str, Any]]:
        """Every known worker with status idle | busy | offline (two round trips, whatever their number)."""
        names = sorted(decoded(self.redis.smembers(self.keys.workers)))
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self._key(name))
            pipe.hgetall(self.keys.worker_current(name))
        replies = pipe.execute()
        return [
            worker_entry(name, info, current)
            for name, info, current in zip(names, replies[0::2], replies[1::2], strict=True)
        ]

    def live_queues(self, workers: list[dict[str, Any]] | None = None) -> list[str]:
        """Queues of live workers, from `workers` when the caller already read them."""
        workers = self.workers() if workers is None else workers
        return sorted({queue for w in workers if w["status"] != "offline" for queue in consumed_queues(w)})


def offline_after_s(heartbeat_s: float) -> int:
    """Seconds without a heartbeat after which a worker is offline (about three missed beats), and so a queue
    with no other consumer has no live worker: its registry entry's TTL, and the ETA's liveness rule."""
    return max(3, int(heartbeat_s * 3 + 1))


def worker_entry(name: str, info: dict[str, str], current: dict[str, str]) -> dict[str, Any]:
    """A worker as routing and the status views see it: status idle | busy | offline, its heartbeat
    fields, and its current stage while live."""
    # Live once its master's heartbeat wrote the entry (a child's model report can come first).
    status = "offline" if not info.get("last_seen") else ("busy" if current else "idle")
    entry: dict[str, Any] = {"name": name, "status": status, **info}
    entry["current"] = (
        {
            "job_id": current["job_id"],
            "track": int(current["track"]),
            "stage": current["stage"],
            "since": float(current["since"]),
        }
        if current and info
        else None
    )
    return entry


def consumed_queues(worker: dict[str, Any]) -> list[str]:
    """The queues a worker's heartbeat lists ("gpu0" or "gpu0,gpu1")."""
    return [queue for queue in str(worker.get("queue", "")).split(",") if queue]


def pid_alive(pid: int) -> bool:
    """Whether a process of this host runs as `pid`. A zombie does not: a killed worker's orphaned child stays one
    until an init that may never reap it does (a container's PID 1 often does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")  # the state follows "(comm)"
    except (OSError, IndexError):  # no /proc (not Linux), or gone meanwhile
        return False
