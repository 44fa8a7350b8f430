"""What Encore reads and removes in kombu's Redis transport: the per-priority lists of a queue, and the
`unacked` hash of deliveries a worker holds (acks_late keeps a message there until its task ends)."""

from __future__ import annotations

import json
from typing import Any

from app.adapters.redis_conn import decoded
from app.control.services import Services


def broker_lists(queue: str, transport_options: dict[str, Any]) -> list[str]:
    """The Redis lists kombu keeps for `queue`, one per priority step (step 0 is the bare name)."""
    sep = transport_options.get("sep", "\x06\x16")
    steps = transport_options.get("priority_steps", [0, 3, 6, 9])
    return [queue if step == 0 else f"{queue}{sep}{step}" for step in steps]


def _message_id(payload: str) -> str | None:
    try:
        return (json.loads(payload).get("headers") or {}).get("id")
    except (ValueError, AttributeError):
        return None


def waiting_tasks(svc: Services, queue: str, transport_options: dict[str, Any], limit: int = 32) -> list[str]:
    """The task names of the first `limit` messages in `queue`'s top-priority list (where started tracks' later
    stages wait: app/core/priority.py), oldest first."""
    top = broker_lists(queue, transport_options)[0]
    names = []
    for payload in decoded(svc.redis.lrange(top, -limit, -1)):  # kombu pushes on the left, pops on the right
        try:
            names.append(str((json.loads(payload).get("headers") or {}).get("task") or ""))
        except (ValueError, AttributeError):
            continue
    return names


def find_message(client: Any, lists: list[str], task_id: str) -> tuple[str, str] | None:
    """(list key, exact payload) of the queued message of `task_id`, or None once a worker took it."""
    for key in lists:
        for payload in client.lrange(key, 0, -1):
            if _message_id(payload) == task_id:
                return key, payload
    return None


def drop_messages(svc: Services, lists: list[str], task_ids: list[str]) -> int:
    """Remove the queued messages of `task_ids` from the broker lists `lists`; returns how many went."""
    removed = 0
    for task_id in task_ids:
        found = find_message(svc.redis, lists, task_id)
        if found is not None:
            removed += svc.redis.lrem(found[0], 1, found[1])
    return removed


def _unacked_keys(transport_options: dict[str, Any]) -> tuple[str, str]:
    return transport_options.get("unacked_key", "unacked"), transport_options.get("unacked_index_key", "unacked_index")


def drop_unacked(svc: Services, transport_options: dict[str, Any], task_ids: list[str]) -> int:
    """Remove deliveries of `task_ids` from kombu's `unacked` hash (their stage is dead and the track was
    moved): kombu would otherwise restore them after the visibility timeout, as stale messages."""
    unacked, index = _unacked_keys(transport_options)
    wanted, removed = set(task_ids), 0
    for tag, raw in svc.redis.hgetall(unacked).items():
        try:
            headers = json.loads(raw)[0].get("headers") or {}
        except (ValueError, IndexError, AttributeError, KeyError):
            continue
        if headers.get("id") in wanted:
            removed += svc.redis.hdel(unacked, tag)
            svc.redis.zrem(index, tag)
    return removed


def messages_present(
    svc: Services, queue: str, transport_options: dict[str, Any], also: list[str] | None = None
) -> set[str]:
    """Ids of the messages of `queue` (and of the queues in `also`) still in the broker, and of every delivery
    not acked yet."""
    lists = [key for name in [queue, *(also or [])] for key in broker_lists(name, transport_options)]
    ids = {_message_id(p) for key in lists for p in decoded(svc.redis.lrange(key, 0, -1))}
    unacked, _ = _unacked_keys(transport_options)
    for raw in svc.redis.hvals(unacked):
        try:
            ids.add((json.loads(raw)[0].get("headers") or {}).get("id"))
        except (ValueError, IndexError, AttributeError, KeyError):
            continue
    return {i for i in ids if i}
