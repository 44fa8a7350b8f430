"""The reaper: the one mechanism that gives back work a fault stranded.

Liveness is read from the running stage itself: it holds a lease (app/control/lifecycle.py) that it renews every
ENCORE_LEASE_S / 3 while it runs. Live workers run the reaper from their heartbeat, one at a time under a
Redis lock, over every track not finished on every queue:
- running, and its lease expired (the worker died, was cut off from Redis, or its child was killed without
  a word): canceled at once when a cancel is pending; else restarted (the `restart` transition) from the
  first unfinished stage when the kind keeps its intermediates in the shared artifact store (music), from
  its first stage when they were in the dead worker's local scratch (lip-sync); routed back to its queue
  when that queue has a live consumer, else to the least loaded live queue. A track restarted
  ENCORE_MAX_DELIVERIES times fails with a message instead: something in it may be what kills workers.
- waiting on a queue whose every consumer has been offline longer than ENCORE_REROUTE_AFTER_S: a queued
  track moves with its first message (taken out of the broker atomically, so a worker that comes back cannot
  also run it); a track between stages restarts as above.
- created longer than ENCORE_STALL_AFTER_S ago and never routed (its submitter died): parked.
- of a canceled job, and held by a stage when the cancel came: ended as soon as that lease is gone. This one
  rule the web applies too (`end_dead_cancels`, from app/http/sweeper.py), so a cancel ends a dead stage's
  track even while no worker is live.
- waiting longer than ENCORE_STALL_AFTER_S for a message that is in no broker list and in no worker's hands
  (unacked): a process died between the transition and the send; the message is sent again.
The old chain's messages of a moved track are dropped from the broker lists and from kombu's `unacked`
hash (kombu would restore them after the visibility timeout); should one still come, the stage's start
refuses it: it is not of the track's current chain.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery

from app.adapters.redis_conn import decoded_members, release_lock
from app.control.broker import drop_messages, drop_unacked, messages_present
from app.core.joblog import job_event
from app.core.kinds import KINDS
from app.core.queues import cpu_queue_of
from app.control.lifecycle import QUEUED, parse_member
from app.control.routing import (
    chain_start,
    enqueue_track,
    expected_task_id,
    known_queues,
    pick_queue,
    queue_lists,
    routable_queues,
    resend,
    stretch_lock,
    sweep_lock,
    unroute_waiting,
)
from app.control.scripts import script
from app.control.services import Services
from app.control.workers import pid_alive

log = logging.getLogger("encore.recovery")


def finished_stages(svc: Services, job_id: str, record: dict[str, Any]) -> dict[str, Any]:
    """The stages of a track a new chain may skip: those finished, when the job's kind keeps its
    intermediates in the shared artifact store (else nothing: it starts over)."""
    job = svc.jobs.job(job_id)
    if job is None or not KINDS[job["kind"]].resumable:
        return {}
    return {name: stage for name, stage in record["stages"].items() if stage.get("finished_at")}


def restart_track(
    svc: Services, celery: Celery, job_id: str, track: int, record: dict[str, Any], why: str, back_to: str | None = None
) -> str:
    """Park a started track to run again (the `restart` transition: refused while anyone holds its lease),
    drop its old chain's messages, and route it: to `back_to` when given and live, else where routing picks.
    Returns "restarted", "failed" (too many restarts), "canceled" (a cancel was pending) or "" (left alone: also
    when the track changed since `record` was read, a compare and set on its version: a stage that finished in
    between released its lease with its finish, it did not die; tests/test_recovery.py forces that interleaving)."""
    kept = finished_stages(svc, job_id, record)
    resume = f"after {', '.join(kept)}" if kept else "from its first stage"
    deaths = int(record.get("deaths") or 0) + 1  # this one too: the lease expired
    outcome = svc.jobs.transition(
        "restart",
        job_id,
        track,
        {
            "stages": kept,
            "progress": 0.0,
            "detail": f"restarting {resume}: {why} during {record['stage'] or 'its chain'}",
        },
        max_restarts=svc.settings.max_deliveries,
        **({"version_is": str(record["version"])} if record.get("version") is not None else {}),
        cancel_detail=f"canceled during {record['stage'] or 'its chain'}",
        give_up=f"its stage died {deaths} times ({why}, last on {record['worker'] or record['queue']}); giving up",
    )
    if not outcome:
        return ""
    _drop_chain(svc, celery, record)
    if outcome.status != "parked":
        return "canceled" if outcome.canceled else outcome.status
    live = routable_queues(svc)
    queue = back_to if back_to in live else pick_queue(svc)
    if queue is not None:
        enqueue_track(svc, celery, job_id, track, queue)
    return "restarted"


class RetryRefused(ValueError):
    """A retry that cannot be made: the job is still open, or none of its tracks failed or was canceled."""


class RetryLimit(RetryRefused):
    """A retry past ENCORE_MAX_RETRIES for one of the job's tracks: refused, not queued (each costs GPU time)."""


def retry_job(svc: Services, celery: Celery, job_id: str, max_retries: int | None = None) -> list[int]:
    """Re-run every failed or canceled track of an ended job (the `retry` transition), with its own seed and
    parameters, from its first unfinished stage (music keeps its finished stages' artifacts; lip-sync starts
    over: its intermediates were in a worker's local scratch); routed now, or parked until a worker is live.
    Returns the tracks retried. `max_retries`: the job's tenant's limit (default ENCORE_MAX_RETRIES)."""
    record = svc.jobs.record(job_id)
    if record is None:
        raise KeyError(job_id)
    if record["state"] in ("queued", "running"):
        raise RetryRefused(f"the job is still {record['state']}: retry it once it has ended")
    ended = [t for t in record["tracks"] if t["status"] in ("failed", "canceled")]
    if not ended:
        raise RetryRefused("nothing to retry: every track is done")
    most = svc.settings.max_retries if max_retries is None else max_retries
    spent = [t["track"] for t in ended if int(t.get("retries") or 0) >= most]
    if spent:
        raise RetryLimit(
            f"track {spent[0]} was retried {most} times, the most this tenant may (ENCORE_MAX_RETRIES, or its own limit)"
        )
    retried = []
    for track in ended:
        kept = finished_stages(svc, job_id, track)
        resume = f"after {', '.join(kept)}" if kept else "from its first stage"
        outcome = svc.jobs.transition(
            "retry",
            job_id,
            track["track"],
            {"stages": kept, "progress": 0.0, "error": "", "detail": f"retrying {resume} (was {track['status']})"},
        )
        if outcome:
            retried.append(track["track"])
    for track in retried:
        queue = pick_queue(svc)
        if queue is not None:
            enqueue_track(svc, celery, job_id, track, queue)
    job_event(log, "retried", job_id, tracks=",".join(map(str, retried)))
    return retried


def _drop_chain(svc: Services, celery: Celery, record: dict[str, Any]) -> None:
    """The messages of a track's old chain out of its queue's broker lists and kombu's `unacked` hash."""
    _drop_messages_of(svc, dict(celery.conf.broker_transport_options or {}), record)


def _drop_messages_of(svc: Services, options: dict[str, Any], record: dict[str, Any]) -> None:
    if record["queue"]:
        drop_messages(svc, queue_lists(record["queue"], options), record["task_ids"])
    drop_unacked(svc, options, record["task_ids"])


def end_dead_cancels(svc: Services, transport_options: dict[str, Any], limit: int = 100) -> int:
    """The cancel's lease rule, which any process may apply (the web's sweeper, app/http/sweeper.py, and every
    reaper pass): a canceled job's track that a stage held when the cancel came ends canceled as soon as that
    stage's lease is gone, even while no worker is live to reap it. Returns how many tracks it ended."""
    ended = 0
    for job_id in decoded_members(svc.redis.zrange(svc.jobs.keys.cancels, 0, limit - 1)):
        records, _ = svc.jobs.end_unheld_tracks(job_id)
        for record in records:
            _drop_messages_of(svc, transport_options, record)  # the dead stage's delivery: not restored in an hour
            job_event(log, "canceled", job_id, track=record["track"], queue=record["queue"], reason="no live lease")
        ended += len(records)
    return ended


def release_dead_leases(svc: Services, worker: str) -> int:
    """Drop the leases `worker` holds whose process is gone: called by a worker starting under the same name
    (the name carries the host, so a pid is checked where it ran) for its previous run's stages, which it
    knows are dead without waiting ENCORE_LEASE_S. Returns how many it dropped; the reaper does the rest."""
    released = 0
    for queue in known_queues(svc):
        for value in decoded_members(svc.redis.zrange(svc.jobs.keys.running(queue), 0, -1)):
            job_id, track = parse_member(value)
            owner = svc.jobs.lease(job_id, track)
            holder, _, pid = (owner or "").rpartition("|")
            if owner and holder.split("|")[0] == worker and pid.isdigit() and not pid_alive(int(pid)):
                released += int(
                    script(svc.redis, "release_lock")(keys=[svc.jobs.lease_key(job_id, track)], args=[owner])
                )
    return released


def reap(svc: Services, celery: Celery) -> int:
    """One pass over every unfinished track on every queue (see the module doc); returns how many tracks it
    moved, restarted, resent or ended. One process at a time (a short Redis lock)."""
    lock = sweep_lock(svc, "reap")
    if not lock.acquire(blocking=False):
        return 0
    try:
        acted = 0
        workers = svc.workers.workers()
        live = set(svc.workers.live_queues(workers))
        check_stalls = bool(
            svc.redis.set(
                svc.jobs.keys.lock("stall-check"), "1", nx=True, ex=max(1, int(svc.settings.stall_after_s / 2))
            )
        )
        acted += end_dead_cancels(svc, dict(celery.conf.broker_transport_options or {}))
        for queue in known_queues(svc, workers):
            if not stretch_lock(lock):
                return acted  # this pass outlasted its lock and another process reaps now
            acted += _reap_queue(svc, celery, queue, live, check_stalls)
        return acted + _park_abandoned(svc)  # the heartbeat routes what is parked next
    finally:
        release_lock(lock)


def _park_abandoned(svc: Services) -> int:
    """Tracks created longer than ENCORE_STALL_AFTER_S ago that their submitter never routed (it died in
    between): parked, to be routed like any other."""
    parked = 0
    stale = svc.redis.zrangebyscore(svc.jobs.keys.created, "-inf", time.time() - svc.settings.stall_after_s)
    for value in decoded_members(stale):
        job_id, track = parse_member(value)
        if svc.jobs.transition(
            "park",
            job_id,
            track,
            {"detail": "waiting for a worker (its submitter stopped)"},
            cancel_detail="canceled before it started",
        ):
            job_event(log, "parked", job_id, track=track, reason="never routed", level=logging.WARNING)
            parked += 1
        elif svc.jobs.track(job_id, track) is None:  # expired
            svc.redis.zrem(svc.jobs.keys.created, value)
    return parked


def _queue_dead(svc: Services, queue: str, live: set[str], now: float) -> bool:
    if queue in live or svc.settings.reroute_after_s <= 0:
        return False
    seen = svc.workers.queue_live_at(queue)
    return seen is None or now - seen > svc.settings.reroute_after_s


def _reap_queue(svc: Services, celery: Celery, queue: str, live: set[str], check_stalls: bool) -> int:
    members = decoded_members(svc.redis.zrange(svc.jobs.load_key(queue), 0, -1))
    if not members:
        return 0
    now = time.time()
    dead = _queue_dead(svc, queue, live, now)
    options = dict(celery.conf.broker_transport_options or {})
    moved = unroute_waiting(svc, queue, options) if dead else []  # queued tracks leave with their message
    for value in moved:
        job_id, track = parse_member(value)
        job_event(log, "rerouting", job_id, track=track, queue=queue, reason="worker offline", level=logging.WARNING)
    acted = len(moved)
    present: set[str] | None = None
    for value in members:
        job_id, track = parse_member(value)
        record = svc.jobs.track(job_id, track)
        if record is None:  # its job expired under it: off every set of the queue, its load counted down
            svc.jobs.lifecycle.forget(queue, value)
            continue
        status = record["status"]
        if status.startswith("running:"):
            if svc.jobs.lease(job_id, track) is None:  # restart_track compares the version it read
                acted += _lease_expired(svc, celery, job_id, track, record, queue, live)
        elif dead and record["queue"] == queue:
            outcome = restart_track(svc, celery, job_id, track, record, f"{queue} has no live worker")
            acted += _logged(outcome, job_id, track, queue, "worker offline")
        elif check_stalls and now - float(record["updated_at"]) > svc.settings.stall_after_s:
            if present is None:  # a companion's messages count while its CPU worker lives (else they are lost)
                cpu_queue = cpu_queue_of(queue)
                present = messages_present(svc, queue, options, [cpu_queue] if cpu_queue in live else [])
            acted += _resend_if_lost(svc, celery, job_id, track, record, queue, present)
    return acted


def _unchanged(svc: Services, job_id: str, track: int, record: dict[str, Any]) -> bool:
    """The track is still as `record` showed it (same version): a stage that moved it on since was not lost."""
    current = svc.jobs.track(job_id, track)
    return current is not None and current.get("version") == record.get("version")


def _lease_expired(
    svc: Services, celery: Celery, job_id: str, track: int, record: dict[str, Any], queue: str, live: set[str]
) -> int:
    stage = record["stage"] or "its stage"
    if svc.jobs.cancel_requested(job_id):
        ended = svc.jobs.cancel(job_id, track, f"canceled during {stage} (its stage had stopped)")
        if ended:
            _drop_chain(svc, celery, record)  # the dead stage's delivery would come back after the timeout
            job_event(log, "canceled", job_id, track=track, queue=queue, reason="no live lease")
        return int(ended)
    outcome = restart_track(
        svc, celery, job_id, track, record, f"the lease of {record['worker'] or 'its worker'} expired", back_to=queue
    )
    return _logged(outcome, job_id, track, queue, "lease expired", stage=stage)


def _logged(outcome: str, job_id: str, track: int, queue: str, reason: str, **extra: Any) -> int:
    if outcome:
        event = {"restarted": "restarting"}.get(outcome, outcome)
        job_event(
            log,
            event,
            job_id,
            track=track,
            queue=queue,
            reason=reason,
            level=logging.ERROR if outcome == "failed" else logging.WARNING,
            **extra,
        )
    return int(bool(outcome))


def _resend_if_lost(
    svc: Services, celery: Celery, job_id: str, track: int, record: dict[str, Any], queue: str, present: set[str]
) -> int:
    job = svc.jobs.job(job_id)
    if job is None or record["queue"] != queue or not record["task_ids"]:
        return 0
    kind = KINDS[job["kind"]]
    stage = chain_start(kind, record) if record["status"] == QUEUED else record["stage"]
    expected = expected_task_id(kind, record, stage)
    if expected is None or expected in present or not _unchanged(svc, job_id, track, record):
        return 0  # its message is there, or the track moved on since its record was read (it was not lost)
    if resend(svc, celery, job_id, track, record, queue):
        job_event(
            log,
            "resent",
            job_id,
            track=track,
            queue=queue,
            stage=stage,
            task_id=expected,
            reason="its message was in no broker list and not delivered",
            level=logging.WARNING,
        )
        return 1
    return 0
