"""app/control/broker.py reads kombu's Redis structures a page at a time: what it finds, drops and reports is what
a whole-list read found, and no single read moves more than one page, against a real redis-server holding Encore's
own first-stage messages (sent as its chains, by the project's Celery app, with no worker consuming) and
deliveries held by kombu's Redis channel the way an acks_late worker holds them (the `unacked` hash and its
index)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import kombu
import pytest
import redis

from app.adapters.celery_app import make_celery
from app.control.broker import (
    SCAN_PAGE,
    broker_lists,
    drop_messages,
    drop_unacked,
    find_message,
    messages_present,
    scan_list,
    waiting_messages,
    WaitingMessage,
)
from app.control.routing import build_chain, queue_lists
from app.control.services import Services, build_services
from app.core.config import Settings
from app.core.kinds import LIPSYNC, MUSIC
from harness.processes import RedisServer

QUEUE = "gpu7"  # its first stages wait at normal priority (the list gpu7:6), a few at high (gpu7:3)
QUEUED = 3 * SCAN_PAGE + 57  # more than three pages
QUEUED_HIGH = 5
HELD_QUEUE = "gpu8"  # its messages are taken by a consumer that never acks: they sit in `unacked`
HELD = SCAN_PAGE + 150  # more than one HSCAN batch
LEFT_ON_HELD_QUEUE = 30
NORMAL_LIST, HIGH_LIST = f"{QUEUE}:6", f"{QUEUE}:3"


@dataclasses.dataclass
class Broker:
    svc: Services
    options: dict[str, Any]
    url: str

    def text_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)


class RecordingRedis(redis.Redis):
    """A real client that notes each command it sends and how many items (list elements, hash entries) the
    reply held: what one call of the adapter moved over the wire, read by read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replies: list[tuple[str, int]] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = super().execute_command(*args, **options)
        if isinstance(reply, (list, dict)):
            items = len(reply)
        elif isinstance(reply, tuple) and len(reply) == 2 and isinstance(reply[1], dict):  # HSCAN: cursor, entries
            items = len(reply[1])
        else:
            items = 1
        self.replies.append((str(args[0]).upper(), items))
        return reply

    def largest(self, command: str) -> int:
        return max((items for name, items in self.replies if name == command), default=0)

    def items_read(self) -> int:
        return sum(items for name, items in self.replies if name in ("LRANGE", "HSCAN"))


def _send_first_stages(celery, queue: str, count: int, priority: str) -> None:
    for number in range(count):
        workflow, _ = build_chain(celery, MUSIC, {"job_id": f"{number:032x}", "track": 0}, queue, priority=priority)
        workflow.apply_async()


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    """A redis-server of this module's own (so that the commands counted are this module's), filled once: the
    tests that remove messages compare with what is there when they start."""
    server = RedisServer(tmp_path_factory.mktemp("broker-redis"), aof=False)
    url = f"{server.url}/0"
    svc = build_services(Settings(redis_url=url, artifact_dir=Path(tmp_path_factory.mktemp("artifacts"))))
    celery = make_celery(svc.settings)
    options = dict(celery.conf.broker_transport_options)
    _send_first_stages(celery, QUEUE, QUEUED, "normal")
    _send_first_stages(celery, QUEUE, QUEUED_HIGH, "high")
    _send_first_stages(celery, HELD_QUEUE, HELD + LEFT_ON_HELD_QUEUE, "normal")
    with kombu.Connection(url, transport_options=options) as connection:
        held = connection.SimpleQueue(HELD_QUEUE, no_ack=False)
        held.channel.qos.restore_at_shutdown = False  # as a worker killed with -9: its deliveries stay
        for _ in range(HELD):
            held.get(timeout=5)  # kombu's BRPOP, then its QoS writes `unacked` and `unacked_index`
    assert svc.redis.hlen(options.get("unacked_key", "unacked")) == HELD
    assert (svc.redis.llen(NORMAL_LIST), svc.redis.llen(HIGH_LIST)) == (QUEUED, QUEUED_HIGH)
    yield Broker(svc, options, url)
    celery.close()
    server.stop()


def _oldest_first(client: redis.Redis, key: str) -> list[str]:
    """The whole list in one read (the test's oracle), oldest (the tail) first."""
    return list(reversed(client.lrange(key, 0, -1)))


def _task_id(payload: str) -> str:
    return json.loads(payload)["headers"]["id"]


def _recording(broker: Broker) -> tuple[Services, RecordingRedis]:
    client = RecordingRedis.from_url(broker.url, decode_responses=True)
    return dataclasses.replace(broker.svc, redis=client), client


def test_find_message_finds_the_oldest_a_middle_and_the_newest_message_and_stops_where_it_finds_one(broker):
    client = broker.text_client()
    lists = queue_lists(QUEUE, broker.options)
    normal = _oldest_first(client, NORMAL_LIST)
    for position in (0, 1, SCAN_PAGE - 1, SCAN_PAGE, len(normal) // 2, 2 * SCAN_PAGE + 1, len(normal) - 1):
        assert find_message(client, lists, _task_id(normal[position])) == (NORMAL_LIST, normal[position]), position
    high = _oldest_first(client, HIGH_LIST)
    assert find_message(client, lists, _task_id(high[-1])) == (HIGH_LIST, high[-1])
    assert find_message(client, lists, "not-a-task-id") is None

    _, recorder = _recording(broker)
    assert find_message(recorder, lists, _task_id(normal[0])) == (NORMAL_LIST, normal[0])
    # The oldest message is in the first page of its list: the lists before it (the high one among them) and
    # one page, not the whole list.
    assert recorder.items_read() <= QUEUED_HIGH + SCAN_PAGE < len(normal)


def test_a_call_reads_at_most_one_page_at_a_time(broker):
    """The old reads (LRANGE 0 -1 of every list, HGETALL or HVALS of `unacked`) moved the whole queue at once."""
    client = broker.text_client()
    normal = _oldest_first(client, NORMAL_LIST)
    lists = queue_lists(QUEUE, broker.options)
    calls = {
        "find the newest": lambda svc: find_message(svc.redis, lists, _task_id(normal[-1])),
        "find a missing id": lambda svc: find_message(svc.redis, lists, "not-a-task-id"),
        "drop missing ids": lambda svc: drop_messages(svc, lists, ["not-a-task-id", "nor-this"]),
        "drop missing deliveries": lambda svc: drop_unacked(svc, broker.options, ["not-a-task-id"]),
        "messages present": lambda svc: messages_present(svc, QUEUE, broker.options, [HELD_QUEUE]),
    }
    for name, call in calls.items():
        svc, recorder = _recording(broker)
        call(svc)
        commands = {command for command, _ in recorder.replies}
        assert not commands & {"HGETALL", "HVALS", "HKEYS"}, (name, commands)
        assert recorder.items_read() > SCAN_PAGE, name  # more than a page in all, never more than one at once:
        assert recorder.largest("LRANGE") <= SCAN_PAGE, (name, recorder.largest("LRANGE"))
        # HSCAN's COUNT is a hint: a hash bucket comes whole, so a batch may pass it by a few entries.
        assert recorder.largest("HSCAN") < min(HELD, 2 * SCAN_PAGE), (name, recorder.largest("HSCAN"))
    assert len(normal) > 3 * SCAN_PAGE  # the lists read above were longer than three pages


def test_drop_messages_removes_exactly_the_given_ones(broker):
    client = broker.text_client()
    normal, high = _oldest_first(client, NORMAL_LIST), _oldest_first(client, HIGH_LIST)
    gone = [normal[0], normal[SCAN_PAGE + 3], normal[-1], high[2]]
    ids = [_task_id(payload) for payload in gone] + ["not-sent-yet"]  # a chain's later stage: in no list
    assert drop_messages(broker.svc, queue_lists(QUEUE, broker.options), ids) == 4
    assert _oldest_first(client, NORMAL_LIST) == [p for p in normal if p not in gone]  # the rest, in order
    assert _oldest_first(client, HIGH_LIST) == [p for p in high if p not in gone]
    assert drop_messages(broker.svc, queue_lists(QUEUE, broker.options), ids) == 0


def test_drop_unacked_removes_exactly_the_given_deliveries_and_their_index_entries(broker):
    client = broker.text_client()
    unacked, index = (
        broker.options.get("unacked_key", "unacked"),
        broker.options.get("unacked_index_key", "unacked_index"),
    )
    before, indexed = client.hgetall(unacked), client.zrange(index, 0, -1, withscores=True)
    assert len(before) == len(indexed) > SCAN_PAGE and set(before) == {tag for tag, _ in indexed}
    by_tag = {tag: json.loads(raw)[0]["headers"]["id"] for tag, raw in before.items()}
    tags = sorted(by_tag)[::97][:3]
    queued_only = _task_id(_oldest_first(client, NORMAL_LIST)[5])  # queued, not delivered: not in `unacked`
    assert drop_unacked(broker.svc, broker.options, [by_tag[tag] for tag in tags] + [queued_only]) == 3
    assert client.hgetall(unacked) == {tag: raw for tag, raw in before.items() if tag not in tags}
    assert client.zrange(index, 0, -1, withscores=True) == [(tag, score) for tag, score in indexed if tag not in tags]
    assert client.llen(NORMAL_LIST) > 0 and _task_id(_oldest_first(client, NORMAL_LIST)[5]) == queued_only


def test_messages_present_is_what_the_whole_list_reads_found(broker):
    client = broker.text_client()
    lists = broker_lists(QUEUE, broker.options) + broker_lists(HELD_QUEUE, broker.options)
    queued = {_task_id(payload) for key in lists for payload in client.lrange(key, 0, -1)}
    held = {json.loads(raw)[0]["headers"]["id"] for raw in client.hvals(broker.options.get("unacked_key", "unacked"))}
    assert len(queued) > 3 * SCAN_PAGE and len(held) > SCAN_PAGE
    assert messages_present(broker.svc, QUEUE, broker.options, [HELD_QUEUE]) == queued | held
    on_the_queue_alone = {_task_id(p) for key in broker_lists(QUEUE, broker.options) for p in client.lrange(key, 0, -1)}
    assert messages_present(broker.svc, QUEUE, broker.options) == on_the_queue_alone | held


def test_a_scan_skips_no_message_while_workers_pop_restore_and_transitions_remove(broker):
    """Between two pages of a scan the list changes at its tail (a worker pops, kombu restores a delivery
    there) and anywhere (an unroute's LREM): offsets read as before would skip the messages the change shifted
    past them. Every message that stays in the list is still read, and the pages read are contiguous."""
    client = broker.text_client()
    key = "scan-under-changes"  # a copy of the normal list: Encore's own payloads, a list of the test's own
    client.delete(key)
    truth = _oldest_first(client, NORMAL_LIST)
    client.lpush(key, *truth)  # LPUSH of the oldest first: the same order
    assert _oldest_first(client, key) == truth

    payloads = scan_list(client, key)
    first = list(islice(payloads, SCAN_PAGE))  # the first page, handed out; the next read is not made yet
    assert first == truth[:SCAN_PAGE]
    popped = client.rpop(key, 7)  # a worker takes the seven oldest
    second = list(islice(payloads, SCAN_PAGE - 1))  # its anchor moved seven places: found again
    assert second == truth[SCAN_PAGE : 2 * SCAN_PAGE - 1]

    client.lrem(key, 1, second[-1])  # a transition removes the anchor itself
    client.rpush(key, "restored")  # kombu restores a delivery at the tail
    client.lpush(key, "new")  # a producer sends one at the head
    rest = list(payloads)

    stayed = [p for p in truth if p not in popped and p != second[-1]]
    assert rest == ["restored", *stayed, "new"]  # its anchor gone, the scan read the list again from the tail
    client.delete(key)


def test_waiting_messages_name_the_task_and_track_of_each_later_stage_oldest_first(broker):
    """The engine (app/tasks/engine.py) runs stages waiting in its queue's top-priority list between two blocks:
    waiting_messages reads each one's task and track from the message Celery sent (a chain resumed at superres, a
    lip-sync at its GPU stage), oldest first, and skips a payload that is not a stage's."""
    celery = make_celery(broker.svc.settings)
    queue = "gpu9"
    sent = [(MUSIC, 1, f"{1:032x}", 0), (LIPSYNC, 1, f"{2:032x}", 0), (MUSIC, 2, f"{3:032x}", 1)]
    for kind, start, job_id, track in sent:
        workflow, _ = build_chain(celery, kind, {"job_id": job_id, "track": track}, queue, start=start)
        workflow.apply_async()
    broker.svc.redis.lpush(queue, "not a message")
    try:
        found = waiting_messages(broker.svc, queue, broker.options)
        expected = [WaitingMessage(kind.stages[start].task, job_id, track) for kind, start, job_id, track in sent]
        assert found == expected
        assert waiting_messages(broker.svc, queue, broker.options, limit=2) == expected[:2]
    finally:
        broker.svc.redis.delete(queue)
        celery.close()
