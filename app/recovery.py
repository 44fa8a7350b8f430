"""Work a dead worker held or was queued to: give it back, or move it to a live worker.

1. A crashed worker's interrupted stage goes back to its queue when the worker starts again.

With acks_late, kombu's Redis transport keeps every delivered message in its `unacked` hash until the task
ends. When a worker's *master* dies (OOM killer, kill -9, node reboot) nobody acks or restores it, and kombu
restores it only once it is older than the visibility timeout (2x the longest hard limit + 10 min, about an
hour): the track would sit in its stage, apparently running, for that long.

One worker consumes each GPU queue, so when a worker starts, a message of its own queue that was delivered
before it started, while no other live worker consumes that queue and the previous process under its name is
gone, was orphaned by that predecessor: it goes back to the head of its queue at once (kombu's own atomic
restore, so it is never both restored and acked). The stage's delivery counter still caps a stage that keeps
killing its worker.

2. When a queue's worker has been offline longer than ENCORE_REROUTE_AFTER_S, its tracks move to live
queues. One that has not started is taken off with its first-stage message, atomically, so a worker that
comes back cannot also run it. One that had started (its worker died mid-track and did not come back)
starts over from its first stage: its next stages would need the dead worker's local scratch. Its old
chain's messages may still be delivered one day (restored from `unacked` when that worker returns); the
stage guard ignores any message that is not of the track's current chain. A track restarted this way more
than ENCORE_MAX_DELIVERIES times fails instead: something in it may be what kills workers.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from app.kinds import KINDS
from app.services import Services
from app.workers import WorkerRegistry, consumed_queues, pid_alive


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
        shared = queues & set(consumed_queues(worker))
        if worker["name"] != name and worker["status"] != "offline" and shared:
            return f"{worker['name']} also consumes {','.join(sorted(shared))}"
    return None


def restore(channel: Any, orphan: Orphan) -> None:
    """Put the delivery back at the head of its queue, atomically with removing it from `unacked`."""
    channel.qos.restore_by_tag(orphan.tag, leftmost=False)


# --- tracks waiting on a queue whose worker is gone ------------------------------------------------------

# Atomically: the track has not started, its first-stage message is still in the broker list (LREM finds
# it, so no worker took it), then it leaves that queue's bookkeeping and is parked for routing again.
_DETACH_QUEUED = """
if redis.call('HGET', KEYS[4], 'state') ~= 'queued' then return 0 end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('HSET', KEYS[4], 'queue', '', 'task_ids', '[]', 'detail', ARGV[3], 'updated_at', ARGV[4])
redis.call('RPUSH', KEYS[5], ARGV[2])
return 1
"""


# Atomically: the track is still open and on `queue`; it leaves the queue's bookkeeping, counts one restart
# and is parked, as a new track, for routing again.
_RESTART_STARTED = """
local state = redis.call('HGET', KEYS[1], 'state')
if (not state) or state == 'done' or state == 'failed' or state == 'canceled' then return -1 end
if redis.call('HGET', KEYS[1], 'queue') ~= ARGV[2] then return -1 end
if redis.call('EXISTS', KEYS[5]) == 1 then return -1 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
local restarts = redis.call('HINCRBY', KEYS[1], 'restarts', 1)
redis.call('HSET', KEYS[1], 'state', 'queued', 'stage', '', 'progress', '0.0', 'running', '0', 'queue', '',
           'task_ids', '[]', 'stages', ARGV[5], 'detail', ARGV[3], 'updated_at', ARGV[4])
redis.call('RPUSH', KEYS[4], ARGV[1])
return restarts
"""


def broker_lists(queue: str, transport_options: dict[str, Any]) -> list[str]:
    """The Redis lists kombu keeps for `queue`, one per priority step (step 0 is the bare name)."""
    sep = transport_options.get("sep", "\x06\x16")
    steps = transport_options.get("priority_steps", [0, 3, 6, 9])
    return [queue if step == 0 else f"{queue}{sep}{step}" for step in steps]


def find_message(client: Any, lists: list[str], task_id: str) -> tuple[str, str] | None:
    """(list key, exact payload) of the queued message of `task_id`, or None once a worker took it."""
    for key in lists:
        for payload in client.lrange(key, 0, -1):
            try:
                headers = json.loads(payload).get("headers") or {}
            except ValueError:
                continue
            if headers.get("id") == task_id:
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


def stranded(svc: Services, queues: list[str], live: set[str], after_s: float, now: float) -> list[str]:
    """Those of `queues` (not in `live`) with open tracks whose consumers have all been offline for more than
    `after_s`."""
    result = []
    for queue in queues:
        if queue in live or not svc.redis.zcard(svc.jobs.load_key(queue)):
            continue
        seen = svc.workers.queue_live_at(queue)
        if seen is None or now - seen > after_s:
            result.append(queue)
    return result


def detach_waiting_tracks(svc: Services, queue: str, transport_options: dict[str, Any],
                          parked_key: str) -> list[str]:
    """Take every not-started track off `queue` (and its message out of the broker), parking it for routing.

    Returns the "job:track" members detached. A track whose message a worker already took stays put.
    """
    broker = svc.redis  # the broker is the job store's Redis (app.celery_app.make_celery)
    detach = broker.register_script(_DETACH_QUEUED)
    lists = broker_lists(queue, transport_options)
    detached = []
    for member in svc.redis.zrange(svc.jobs.waiting_key(queue), 0, -1):
        job_id, _, track = member.rpartition(":")
        record = svc.jobs.track(job_id, int(track))
        if record is None or not record["task_ids"]:
            continue
        found = find_message(broker, lists, record["task_ids"][0])
        if found is None:
            continue
        key, payload = found
        keys = [key, svc.jobs.waiting_key(queue), svc.jobs.load_key(queue), svc.jobs.track_key(job_id, int(track)),
                parked_key]
        if detach(keys=keys, args=[payload, member, f"moving: no worker on {queue}", str(time.time())]) == 1:
            detached.append(member)
    return detached


def finished_stages(svc: Services, job_id: str, record: dict[str, Any]) -> dict[str, Any]:
    """The stages of a track that a new chain may skip: those finished, when the job's kind keeps its
    intermediates in the shared artifact store (else nothing: it starts over)."""
    job = svc.jobs.job(job_id)
    if job is None or not KINDS[job["kind"]].resumable:
        return {}
    return {name: stage for name, stage in record["stages"].items() if stage.get("finished_at")}


def restart_started_tracks(svc: Services, queue: str, parked_key: str,
                           transport_options: dict[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """Park every open track of `queue` that had started and holds no live lease, to run again elsewhere
    (restart_track). Returns (restarted, failed) "job:track" members."""
    waiting = set(svc.redis.zrange(svc.jobs.waiting_key(queue), 0, -1))
    restarted, failed = [], []
    for member in svc.redis.zrange(svc.jobs.load_key(queue), 0, -1):
        if member in waiting:
            continue
        job_id, _, track = member.rpartition(":")
        record = svc.jobs.track(job_id, int(track))
        if record is None:
            svc.redis.zrem(svc.jobs.load_key(queue), member)
            continue
        outcome = restart_track(svc, job_id, int(track), record, queue, parked_key, transport_options,
                                why=f"{record['worker'] or queue} went offline")
        (restarted if outcome == "restarted" else failed if outcome == "failed" else []).append(member)
    return restarted, failed


def restart_track(svc: Services, job_id: str, track: int, record: dict[str, Any], queue: str, parked_key: str,
                  transport_options: dict[str, Any] | None, why: str) -> str:
    """Park one started track of `queue` to run again elsewhere: from its first unfinished stage when its kind
    is resumable (a new chain skips the finished ones), else from its first stage. Refused while anyone holds
    its lease (atomically). A track restarted ENCORE_MAX_DELIVERIES times fails instead: something in it may
    be what kills workers. Returns "restarted", "failed" or "" (left alone)."""
    member = f"{job_id}:{track}"
    restarts = int(record.get("restarts", 0))
    if restarts >= svc.settings.max_deliveries:
        failed = svc.jobs.fail(job_id, track, f"its stage died {restarts + 1} times ({why}, last on "
                                              f"{record['worker'] or queue}); giving up")
        return "failed" if failed else ""
    keys = [svc.jobs.track_key(job_id, track), svc.jobs.waiting_key(queue), svc.jobs.load_key(queue), parked_key,
            svc.jobs.lease_key(job_id, track)]
    kept = finished_stages(svc, job_id, record)
    resume = f"after {', '.join(kept)}" if kept else "from its first stage"
    detail = f"restarting {resume}: {why} during {record['stage'] or 'its chain'}"
    restart = svc.redis.register_script(_RESTART_STARTED)
    if restart(keys=keys, args=[member, queue, detail, str(time.time()), json.dumps(kept)]) <= 0:
        return ""
    if transport_options is not None:  # the old chain's messages would only be stale: out of the broker
        drop_messages(svc, broker_lists(queue, transport_options), record["task_ids"])
        drop_unacked(svc, transport_options, record["task_ids"])
    return "restarted"


def drop_unacked(svc: Services, transport_options: dict[str, Any], task_ids: list[str]) -> int:
    """Remove deliveries of `task_ids` from kombu's `unacked` hash (their stage is dead and the track was
    moved): kombu would otherwise restore them after the visibility timeout, as stale messages."""
    unacked = transport_options.get("unacked_key", "unacked")
    index = transport_options.get("unacked_index_key", "unacked_index")
    wanted, removed = set(task_ids), 0
    for tag, raw in svc.redis.hgetall(unacked).items():
        try:
            headers = json.loads(raw)[0].get("headers") or {}
        except (ValueError, IndexError, AttributeError):
            continue
        if headers.get("id") in wanted:
            removed += svc.redis.hdel(unacked, tag)
            svc.redis.zrem(index, tag)
    return removed
