"""Give a crashed worker's interrupted stage back to its queue when the worker starts again.

With acks_late, kombu's Redis transport keeps every delivered message in its `unacked` hash until the task
ends. When a worker's *master* dies (OOM killer, kill -9, node reboot) nobody acks or restores it, and kombu
restores it only once it is older than the visibility timeout (2x the longest hard limit + 10 min, about an
hour): the track would sit in its stage, apparently running, for that long.

One worker consumes each GPU queue, so when a worker starts, a message of its own queue that was delivered
before it started, while no other live worker consumes that queue and the previous process under its name is
gone, was orphaned by that predecessor: it goes back to the head of its queue at once (kombu's own atomic
restore, so it is never both restored and acked). The stage's delivery counter still caps a stage that keeps
killing its worker.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.workers import WorkerRegistry, pid_alive


@dataclass(frozen=True)
class Orphan:
    """An unacked delivery of a task message, as kombu's Redis transport stores it."""

    tag: str
    task_id: str
    task_name: str
    queue: str
    delivered_at: float
    args: tuple[Any, ...]


def unacked_before(channel: Any, queues: set[str], before: float) -> list[Orphan]:
    """Deliveries on `queues` still unacked that were made before `before` (oldest first)."""
    client = channel.client
    orphans = []
    for tag, score in client.zrangebyscore(channel.unacked_index_key, 0, before, withscores=True):
        raw = client.hget(channel.unacked_key, tag)
        if raw is None:  # acked or restored meanwhile
            continue
        payload, _exchange, routing_key = json.loads(raw)
        if routing_key not in queues:
            continue
        orphans.append(_orphan(channel, _text(tag), payload, routing_key, score))
    return orphans


def _orphan(channel: Any, tag: str, payload: dict[str, Any], queue: str, delivered_at: float) -> Orphan:
    headers = payload.get("headers") or {}
    args: tuple[Any, ...] = ()
    try:  # Celery's protocol 2 body: [args, kwargs, embed]
        body = json.loads(channel.decode_body(payload["body"], (payload.get("properties") or {}).get("body_encoding")))
        args = tuple(body[0]) if isinstance(body, list) and body else ()
    except (KeyError, ValueError, TypeError):
        pass
    return Orphan(tag, str(headers.get("id", "")), str(headers.get("task", "")), queue, delivered_at, args)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def why_not_safe(registry: WorkerRegistry, name: str, queues: set[str], own_pid: int) -> str | None:
    """A reason not to touch earlier deliveries, or None when no living process can hold them."""
    previous = registry.info(name)
    previous_pid = int(previous.get("pid") or 0)
    if previous_pid and previous_pid != own_pid and pid_alive(previous_pid):
        return f"the previous {name} (pid {previous_pid}) is still running"
    for worker in registry.workers():
        shared = queues & set(filter(None, str(worker.get("queue", "")).split(",")))
        if worker["name"] != name and worker["status"] != "offline" and shared:
            return f"{worker['name']} also consumes {','.join(sorted(shared))}"
    return None


def restore(channel: Any, orphan: Orphan) -> None:
    """Put the delivery back at the head of its queue, atomically with removing it from `unacked`."""
    channel.qos.restore_by_tag(orphan.tag, leftmost=False)
