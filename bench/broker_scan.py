"""What each read of kombu's Redis structures in app/control/broker.py costs with a deep queue, against the
whole-list reads it replaced (kept below, the `whole_list_*` functions, as the in-run baseline): wall time, the
peak Python memory of the call (tracemalloc), its largest single reply and how much it moved in all.

A private redis-server holds --messages of Encore's own first-stage messages on one queue (sent as its chains by
the project's Celery app, at normal priority: all in one list, the deepest a list gets) and --unacked deliveries
held by kombu's Redis channel as an acks_late worker killed with -9 leaves them (the `unacked` hash and its
index). The calls, as Encore makes them (a queue's lists are its own ten priority lists and its companion's ten):
find the oldest message (a drain's or a rebalance's usual target), the newest, a missing one; drop a track's
chain (its first stage queued, its later stages in no list yet) from the lists, and from `unacked`; the ids
present (the reaper's stall check). Both implementations run on the same data in each round, in alternating
order; their answers are checked to agree. Prints JSON (and writes it to --out).

    python bench/broker_scan.py [--messages 10000] [--unacked 10000] [--rounds 5] [--tiny]
                                [--out bench/results/broker_scan_2026-12-05.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import kombu
import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from app.adapters.celery_app import make_celery  # noqa: E402
from app.control import broker  # noqa: E402
from app.control.routing import build_chain, queue_lists  # noqa: E402
from app.control.services import Services, build_services  # noqa: E402
from app.core.config import Settings  # noqa: E402
from app.core.kinds import MUSIC  # noqa: E402
from bench.common import machine_facts, start_redis  # noqa: E402

QUEUE = "gpu0"  # the deep queue
HELD_QUEUE = "gpu1"  # its messages are delivered and never acked: they fill `unacked`


# The baseline: app/control/broker.py's reads before they were paged (one LRANGE 0 -1 of every list, HGETALL or
# HVALS of `unacked`), verbatim but for their names.


def whole_list_find_message(client: Any, lists: list[str], task_id: str) -> tuple[str, str] | None:
    for key in lists:
        for payload in client.lrange(key, 0, -1):
            if broker._message_id(payload) == task_id:
                return key, payload
    return None


def whole_list_drop_messages(svc: Services, lists: list[str], task_ids: list[str]) -> int:
    removed = 0
    for task_id in task_ids:
        found = whole_list_find_message(svc.redis, lists, task_id)
        if found is not None:
            removed += svc.redis.lrem(found[0], 1, found[1])
    return removed


def whole_list_drop_unacked(svc: Services, transport_options: dict[str, Any], task_ids: list[str]) -> int:
    unacked, index = broker._unacked_keys(transport_options)
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


def whole_list_messages_present(
    svc: Services, queue: str, transport_options: dict[str, Any], also: list[str] | None = None
) -> set[str]:
    lists = [key for name in [queue, *(also or [])] for key in broker.broker_lists(name, transport_options)]
    ids = {broker._message_id(p) for key in lists for p in svc.redis.lrange(key, 0, -1)}
    unacked, _ = broker._unacked_keys(transport_options)
    for raw in svc.redis.hvals(unacked):
        try:
            ids.add((json.loads(raw)[0].get("headers") or {}).get("id"))
        except (ValueError, IndexError, AttributeError, KeyError):
            continue
    return {i for i in ids if i}


READS = {"LRANGE", "LPOS", "LLEN", "HSCAN", "HGETALL", "HVALS"}


class RecordingRedis(redis.Redis):
    """A real client that notes, per read of a list or of `unacked`, how many items (list elements, hash entries)
    and bytes its reply held: what a call moved over the wire, read by read (the few writes and the pipelined
    LPOS of a re-anchoring are not counted)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replies: list[tuple[int, int]] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = super().execute_command(*args, **options)
        if str(args[0]).upper() not in READS:
            return reply
        entries = reply[1] if isinstance(reply, tuple) and len(reply) == 2 and isinstance(reply[1], dict) else reply
        if isinstance(entries, dict):
            self.replies.append((len(entries), sum(len(k) + len(v) for k, v in entries.items())))
        elif isinstance(entries, list):
            self.replies.append((len(entries), sum(len(v) for v in entries if isinstance(v, str))))
        else:
            self.replies.append((1, len(entries) if isinstance(entries, str) else 8))
        return reply


def fill(svc: Services, celery: Any, options: dict[str, Any], messages: int, unacked: int) -> dict[str, list[str]]:
    """The queue and the held deliveries; each track's chain ids (its first stage's message sent, the rest not)."""
    chains: dict[str, list[str]] = {"queued": [], "held": []}
    for name, queue, count in (("queued", QUEUE, messages), ("held", HELD_QUEUE, unacked)):
        for number in range(count):
            workflow, task_ids = build_chain(celery, MUSIC, {"job_id": f"{number:032x}", "track": 0}, queue)
            workflow.apply_async()
            chains[name].append(",".join(task_ids))
    with kombu.Connection(svc.settings.redis_url, transport_options=options) as connection:
        held = connection.SimpleQueue(HELD_QUEUE, no_ack=False)
        held.channel.qos.restore_at_shutdown = False  # as a worker killed with -9: its deliveries stay
        for _ in range(unacked):
            held.get(timeout=10)
    return chains


def measure_memory_and_replies(call: Callable[[Services], Any], svc: Services) -> tuple[Any, dict[str, float]]:
    """One call on a recording client under tracemalloc: its answer and what it held and moved."""
    client = RecordingRedis.from_url(svc.settings.redis_url, decode_responses=True)
    recording = replace(svc, redis=client)
    client.ping()  # the connection is made before the measurement
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    answer = call(recording)
    peak = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    client.close()
    largest_items = max((items for items, _ in client.replies), default=0)
    largest_bytes = max((size for _, size in client.replies), default=0)
    return answer, {
        "peak_python_kib": round(peak / 1024, 1),
        "largest_reply_items": largest_items,
        "largest_reply_kib": round(largest_bytes / 1024, 1),
        "read_kib": round(sum(size for _, size in client.replies) / 1024, 1),
        "reads": len(client.replies),
    }


def comparable(answer: Any) -> Any:
    return sorted(answer) if isinstance(answer, set) else answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000, help="queued first-stage messages, in one list")
    parser.add_argument("--unacked", type=int, default=10_000, help="deliveries held in `unacked`")
    parser.add_argument("--rounds", type=int, default=5, help="timed calls per implementation (median)")
    parser.add_argument("--tiny", action="store_true", help="a few pages of each (the test suite's smoke run)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.tiny:
        args.messages, args.unacked, args.rounds = 3 * broker.SCAN_PAGE + 50, broker.SCAN_PAGE + 100, 2
    needed = 2 * (args.rounds + 1)  # tracks dropped: one per implementation per round, and per memory pass
    if args.messages < 2 * needed or args.unacked < 2 * needed:
        parser.error(f"--messages and --unacked: at least {2 * needed} for {args.rounds} rounds")

    root = Path(tempfile.mkdtemp(prefix="broker-scan-"))
    proc, url = start_redis(root)
    try:
        svc = build_services(Settings(redis_url=url, artifact_dir=root / "artifacts"))
        celery = make_celery(svc.settings)
        options = dict(celery.conf.broker_transport_options)
        started = time.perf_counter()
        chains = fill(svc, celery, options, args.messages, args.unacked)
        fill_s = time.perf_counter() - started
        celery.close()
        lists = queue_lists(QUEUE, options)
        queued = [chain.split(",") for chain in chains["queued"]]  # oldest first
        held = [chain.split(",") for chain in chains["held"]]
        # Tracks to drop, from the middle of the queue and of the hash, one per call: each call removes one.
        middle = len(queued) // 2
        to_drop = iter(queued[middle - needed : middle + needed])
        unacked_to_drop = iter(held[len(held) // 2 - needed : len(held) // 2 + needed])

        calls: dict[str, tuple[Callable[[Services], Any], Callable[[Services], Any]]] = {
            "find_oldest": (
                lambda s: broker.find_message(s.redis, lists, queued[0][0]),
                lambda s: whole_list_find_message(s.redis, lists, queued[0][0]),
            ),
            "find_newest": (
                lambda s: broker.find_message(s.redis, lists, queued[-1][0]),
                lambda s: whole_list_find_message(s.redis, lists, queued[-1][0]),
            ),
            "find_missing": (
                lambda s: broker.find_message(s.redis, lists, "0" * 32),
                lambda s: whole_list_find_message(s.redis, lists, "0" * 32),
            ),
            "drop_messages": (
                lambda s: broker.drop_messages(s, lists, next(to_drop)),
                lambda s: whole_list_drop_messages(s, lists, next(to_drop)),
            ),
            "drop_unacked": (
                lambda s: broker.drop_unacked(s, options, next(unacked_to_drop)),
                lambda s: whole_list_drop_unacked(s, options, next(unacked_to_drop)),
            ),
            "messages_present": (
                lambda s: broker.messages_present(s, QUEUE, options, [HELD_QUEUE]),
                lambda s: whole_list_messages_present(s, QUEUE, options, [HELD_QUEUE]),
            ),
        }
        seconds: dict[str, dict[str, list[float]]] = {name: {"paged": [], "whole_list": []} for name in calls}
        agree: dict[str, bool] = dict.fromkeys(calls, True)
        for round_number in range(args.rounds):
            for name, (paged, whole) in calls.items():
                order = [("paged", paged), ("whole_list", whole)]
                answers = {}
                for label, call in order if round_number % 2 == 0 else order[::-1]:
                    began = time.perf_counter()
                    answers[label] = call(svc)
                    seconds[name][label].append(time.perf_counter() - began)
                agree[name] &= comparable(answers["paged"]) == comparable(answers["whole_list"])
        figures: dict[str, dict[str, Any]] = {}
        for name, (paged, whole) in calls.items():
            paged_answer, paged_figures = measure_memory_and_replies(paged, svc)
            whole_answer, whole_figures = measure_memory_and_replies(whole, svc)
            agree[name] &= comparable(paged_answer) == comparable(whole_answer)
            paged_figures["ms"] = round(statistics.median(seconds[name]["paged"]) * 1000, 2)
            whole_figures["ms"] = round(statistics.median(seconds[name]["whole_list"]) * 1000, 2)
            figures[name] = {
                "paged": paged_figures,
                "whole_list_baseline": whole_figures,
                "ratio_paged_to_baseline": {
                    key: round(paged_figures[key] / whole_figures[key], 4) if whole_figures[key] else None
                    for key in ("ms", "peak_python_kib", "largest_reply_kib", "read_kib")
                },
                "ms_per_round": {
                    label: [round(s * 1000, 2) for s in values] for label, values in seconds[name].items()
                },
            }
        payload_sizes = [len(p) for p in svc.redis.lrange(broker.broker_lists(QUEUE, options)[6], 0, 99)]
        report = {
            "benchmark": "broker_scan",
            "machine": {**machine_facts(), "load_average": [round(x, 2) for x in os.getloadavg()]},
            "messages": args.messages,
            "unacked": args.unacked,
            "page": broker.SCAN_PAGE,
            "payload_bytes_median": statistics.median(payload_sizes) if payload_sizes else 0,
            "rounds": args.rounds,
            "fill_s": round(fill_s, 1),
            "agree": agree,
            "calls": figures,
        }
        text = json.dumps(report, indent=1)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
