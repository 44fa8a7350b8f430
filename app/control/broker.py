"""What Encore reads and removes in kombu's Redis transport: the per-priority lists of a queue, and the
`unacked` hash of deliveries a worker holds (acks_late keeps a message there until its task ends). This is the
one module that knows those structures; the rest of Encore asks it questions about task ids.

Every read is bounded: a list is read SCAN_PAGE messages at a time and `unacked` by HSCAN with COUNT
SCAN_PAGE, so a call moves at most one page of payloads over the wire and holds at most one in memory (plus the
few it was asked to find), whatever the queue's depth. A whole-list LRANGE or an HGETALL of 10,000 queued
messages of ~2 KB each moved 20 MB per call, on the drain, rebalance and restart paths
(bench/broker_scan.py). Lists are read from the tail, where kombu's workers pop (producers LPUSH): the oldest
messages, the ones a drain or a rebalance moves first, are in the first page, and a search stops where it
finds what it looks for."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import redis

from app.adapters.redis_conn import decoded
from app.control.services import Services

# The most payloads one read moves: one LRANGE page, and about one HSCAN batch of `unacked` (Redis may return a
# few more: a hash bucket is returned whole). Encore's first-stage messages are ~2 KB: ~400 KB per read, and
# 50 round trips for a 10,000-message list (its JSON decoding costs more than the round trips on loopback).
SCAN_PAGE = 200


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


def _delivery_id(raw: str) -> str | None:
    """The task id of an `unacked` entry (kombu stores [message, exchange, routing key] as JSON)."""
    try:
        return (json.loads(raw)[0].get("headers") or {}).get("id")
    except (ValueError, IndexError, AttributeError, KeyError):
        return None


def _mentions(text: str, task_ids: Iterable[str]) -> bool:
    """Whether any of `task_ids` appears in `text` at all: a substring test costs a fraction of decoding the
    ~2 KB of JSON, and rules out almost every payload; a match is then confirmed on the decoded headers (an id
    also appears as another message's root_id or correlation_id)."""
    return any(task_id in text for task_id in task_ids)


@dataclass(frozen=True)
class WaitingMessage:
    """A stage's message waiting in a queue: its task name and the track it is for."""

    task: str
    job_id: str
    track: int


def waiting_messages(
    svc: Services, queue: str, transport_options: dict[str, Any], limit: int = 32
) -> list[WaitingMessage]:
    """The first `limit` messages (at most SCAN_PAGE) in `queue`'s top-priority list (where started tracks' later
    stages wait: app/core/priority.py), oldest first; a payload that is not a stage's message is skipped."""
    top = broker_lists(queue, transport_options)[0]
    found = []
    oldest = decoded(svc.redis.lrange(top, -min(limit, SCAN_PAGE), -1))  # pushed on the left, popped on the right
    for payload in reversed(oldest):
        message = _stage_message(payload)
        if message is not None:
            found.append(message)
    return found


def _stage_message(payload: str) -> WaitingMessage | None:
    """A kombu payload's task name and track: Celery's protocol 2 body is [args, kwargs, embed], base64 in the
    Redis transport, and a stage task's one argument is its {"job_id", "track"} (app/tasks/stage.py)."""
    try:
        message = json.loads(payload)
        body = message["body"]
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        ref = json.loads(body)[0][0]
        return WaitingMessage(str((message.get("headers") or {})["task"]), str(ref["job_id"]), int(ref["track"]))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


class BrokerListUnsettled(redis.RedisError):
    """A list kept changing under the reader at its tail faster than one page could be read (never seen: each
    retry needs a pop or a removal between two round trips); the caller's next pass reads it again. A Redis error
    to its callers: the heartbeat's loop tries again, and an HTTP route answers 503, as when Redis is away."""


MAX_RELOCATIONS = 64  # re-anchorings one scan of one list may take before it gives up (BrokerListUnsettled)


def scan_list(client: Any, key: str) -> Iterator[str]:
    """The payloads of the kombu list `key`, oldest first (from the tail, where workers pop), read SCAN_PAGE at
    a time; a payload leaves the page as it is handed out, so at most one page is held.

    The list changes while it is read: a worker pops at the tail, a restore pushes there, a transition removes a
    message anywhere, and each shifts the indexes the next page would be read at, so a page read at the old
    offsets would skip messages. So each page after the first is read together with the last payload of the
    page before (its anchor, whose offset from the tail is known) and checked against it: when the anchor moved,
    LPOS finds it again and the page is read from there; when it is gone (every message read so far was popped,
    or it was removed), the scan starts again from the tail. A message that stays in the list while it is read
    is handed out (some may be handed out twice after a restart); one pushed or removed meanwhile may or may not
    be, as with one LRANGE taken a moment earlier or later."""
    anchor: str | None = None
    depth = 0  # the anchor's offset from the tail (1: the tail itself)
    relocations = 0
    while True:
        if anchor is None:
            page = cast(list[str], client.lrange(key, -SCAN_PAGE, -1))
            last = len(page) < SCAN_PAGE
        else:
            page = cast(list[str], client.lrange(key, -(depth + SCAN_PAGE - 1), -depth))
            if not page or page[-1] != anchor:
                relocations += 1
                if relocations > MAX_RELOCATIONS:
                    raise BrokerListUnsettled(f"{key} changed at its tail {MAX_RELOCATIONS} times while read")
                found = _depth_of(client, key, anchor)
                anchor, depth = (anchor, found) if found is not None else (None, 0)
                continue
            last = len(page) < SCAN_PAGE
            page.pop()  # the anchor, handed out with the page before
        if page:
            anchor, depth = page[0], depth + len(page)
        while page:
            yield page.pop()  # LRANGE lists head to tail: the oldest is last
        if last:  # the head is reached
            return


def _depth_of(client: Any, key: str, payload: str) -> int | None:
    """The offset from the tail of `payload` in `key` now, or None once it left the list."""
    pipe = client.pipeline(transaction=True)  # LPOS and LLEN of the same moment
    pipe.lpos(key, payload, rank=-1)  # searched from the tail: where it was, near the pages already read
    pipe.llen(key)
    position, length = pipe.execute()
    return None if position is None else int(length) - int(position)


def scan_unacked(client: Any, key: str) -> Iterator[tuple[str, str]]:
    """kombu's `unacked` hash as (delivery tag, JSON of [message, exchange, routing key]) pairs, read by HSCAN in
    batches of about SCAN_PAGE; an entry leaves the batch as it is handed out. HSCAN returns every entry that
    stays in the hash while it is scanned; one added or removed meanwhile may or may not be."""
    cursor = 0
    while True:
        cursor, batch = client.hscan(key, cursor, count=SCAN_PAGE)
        while batch:
            yield cast(tuple[str, str], batch.popitem())
        if not cursor:
            return


def _find_messages(client: Any, lists: list[str], task_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
    """task id -> (list key, exact payload) of the first queued message of each of `task_ids` in the lists
    `lists` (in that order, each oldest first); the scan stops once all were found."""
    wanted, found = set(task_ids), {}
    for key in lists if wanted else []:
        for payload in scan_list(client, key):
            if _mentions(payload, wanted) and (task_id := _message_id(payload)) in wanted:
                wanted.discard(task_id)
                found[task_id] = (key, payload)
                if not wanted:
                    return found
    return found


def find_message(client: Any, lists: list[str], task_id: str) -> tuple[str, str] | None:
    """(list key, exact payload) of the queued message of `task_id`, or None once a worker took it."""
    return _find_messages(client, lists, [task_id]).get(task_id)


def drop_messages(svc: Services, lists: list[str], task_ids: list[str]) -> int:
    """Remove the queued messages of `task_ids` from the broker lists `lists`; returns how many went. One scan
    finds them all (the ids of a chain's later stages are in no list yet); they are removed after it, so the
    scan's anchors stay in place."""
    found = _find_messages(svc.redis, lists, task_ids)
    if not found:
        return 0
    pipe = svc.redis.pipeline(transaction=False)
    for key, payload in found.values():
        pipe.lrem(key, 1, payload)  # 0 when a worker took it meanwhile
    return sum(int(count) for count in pipe.execute())


def _unacked_keys(transport_options: dict[str, Any]) -> tuple[str, str]:
    return transport_options.get("unacked_key", "unacked"), transport_options.get("unacked_index_key", "unacked_index")


def drop_unacked(svc: Services, transport_options: dict[str, Any], task_ids: list[str]) -> int:
    """Remove deliveries of `task_ids` from kombu's `unacked` hash and its index (their stage is dead and the
    track was moved): kombu would otherwise restore them after the visibility timeout, as stale messages. The
    whole hash is scanned, a batch at a time: a task id may have more than one delivery there (a message
    restored and delivered again), and every one goes; they are removed after the scan."""
    unacked, index = _unacked_keys(transport_options)
    wanted = set(task_ids)
    if not wanted:
        return 0
    tags = [
        tag for tag, raw in scan_unacked(svc.redis, unacked) if _mentions(raw, wanted) and _delivery_id(raw) in wanted
    ]
    if not tags:
        return 0
    pipe = svc.redis.pipeline(transaction=False)
    pipe.hdel(unacked, *tags)  # fewer when kombu acked one meanwhile
    pipe.zrem(index, *tags)
    return int(pipe.execute()[0])


def messages_present(
    svc: Services, queue: str, transport_options: dict[str, Any], also: list[str] | None = None
) -> set[str]:
    """Ids of the messages of `queue` (and of the queues in `also`) still in the broker, and of every delivery
    not acked yet. The lists are read before `unacked`, as a message moves from one to the other: one a worker
    takes meanwhile is seen in either."""
    lists = [key for name in [queue, *(also or [])] for key in broker_lists(name, transport_options)]
    ids = {_message_id(payload) for key in lists for payload in scan_list(svc.redis, key)}
    unacked, _ = _unacked_keys(transport_options)
    ids.update(_delivery_id(raw) for _, raw in scan_unacked(svc.redis, unacked))
    ids.difference_update((None, ""))  # in place: a copy of 20,000 ids would double the call's peak
    return cast(set[str], ids)
