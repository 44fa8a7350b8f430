"""Put tracks on GPU queues and turn them into Celery chains.

- Each track goes to the live queue with the least outstanding work (estimated cost of tracks queued or
  running there); picking one track at a time spreads a job's tracks across GPUs.
- With no live worker the track waits in `{p}:unrouted`; workers drain that list on every heartbeat.
- Every signature of a chain carries the queue (a chain-level queue only routes its first step) and a
  priority: the first stage is the lowest (9), later stages the highest (0), so a started job's next stage
  overtakes the first stage of any job submitted after it (FIFO across stages).
"""
from __future__ import annotations

import logging
import time
import uuid

from celery import Celery, chain

from app.joblog import job_event
from app.kinds import CANCELED, KINDS, QUEUED, TERMINAL_STATES, JobKind
from app.recovery import detach_waiting_tracks, restart_started_tracks, restart_track, stranded
from app.services import Services
from app.workers import consumed_queues

log = logging.getLogger("encore.routing")

FIRST_STAGE_PRIORITY = 9
LATER_STAGE_PRIORITY = 0


def _unrouted_key(svc: Services) -> str:
    return f"{svc.settings.key_prefix}:unrouted"


def queue_loads(svc: Services, queues: list[str]) -> dict[str, float]:
    loads = {}
    for queue in queues:
        scores = svc.redis.zrange(svc.jobs.load_key(queue), 0, -1, withscores=True)
        loads[queue] = sum(score for _, score in scores)
    return loads


def known_queues(svc: Services, workers: list[dict] | None = None) -> list[str]:
    """Queues that ever had a track or have a live worker (no keyspace scan: this runs on every heartbeat)."""
    workers = svc.workers.workers() if workers is None else workers
    return sorted(svc.jobs.queues() | {queue for w in workers for queue in consumed_queues(w)})


def draining(svc: Services) -> set[str]:
    """Queues an operator drained: no new tracks go there."""
    return set(svc.redis.smembers(_draining_key(svc)))


def _draining_key(svc: Services) -> str:
    return f"{svc.settings.key_prefix}:draining"


def drain_queue(svc: Services, celery: Celery, queue: str) -> int:
    """Stop routing to `queue` and move its tracks that have not started to other live queues (parked when
    there is none); its running stage and started tracks finish there. Returns how many tracks moved."""
    svc.redis.sadd(_draining_key(svc), queue)
    options = dict(celery.conf.broker_transport_options or {})
    moved = detach_waiting_tracks(svc, queue, options, _unrouted_key(svc))
    for member in moved:
        job_id, _, track = member.rpartition(":")
        job_event(log, "rerouting", job_id, track=int(track), queue=queue, reason="queue drained")
    dispatch_unrouted(svc, celery)
    return len(moved)


def resume_queue(svc: Services, celery: Celery, queue: str) -> None:
    """Route to `queue` again (parked tracks may go there at once)."""
    svc.redis.srem(_draining_key(svc), queue)
    dispatch_unrouted(svc, celery)


def pick_queue(svc: Services) -> str | None:
    """The live, not drained queue with the least outstanding estimated work; ties go to the lowest name."""
    queues = sorted(set(svc.workers.live_queues()) - draining(svc))
    if not queues:
        return None
    loads = queue_loads(svc, queues)
    return min(queues, key=lambda q: (loads[q], _queue_number(q)))


def _queue_number(queue: str) -> tuple[int, str]:
    digits = "".join(ch for ch in queue if ch.isdigit())
    return (int(digits) if digits else 0, queue)


def build_chain(celery: Celery, kind: JobKind, ref: dict, queue: str) -> tuple[chain, list[str]]:
    signatures, task_ids = [], []
    for index, stage in enumerate(kind.stages):
        task_id = uuid.uuid4().hex
        priority = FIRST_STAGE_PRIORITY if index == 0 else LATER_STAGE_PRIORITY
        args = (ref,) if index == 0 else ()
        signatures.append(celery.signature(
            stage.task, args=args, queue=queue, priority=priority, task_id=task_id, immutable=False))
        task_ids.append(task_id)
    return chain(*signatures), task_ids


def enqueue_track(svc: Services, celery: Celery, job_id: str, track: int, queue: str) -> None:
    job = svc.jobs.job(job_id)
    record = svc.jobs.track(job_id, track)
    if job is None or record is None or record["state"] != QUEUED:
        return
    if svc.jobs.cancel_requested(job_id):  # canceled while it was parked or being moved: it ends here
        svc.jobs.finish(job_id, track, CANCELED, detail="canceled before it started", progress=0.0)
        job_event(log, "canceled", job_id, track=track, reason="canceled while waiting to be routed")
        return
    kind = KINDS[job["kind"]]
    workflow, task_ids = build_chain(celery, kind, {"job_id": job_id, "track": track}, queue)
    svc.jobs.assign_queue(job_id, track, queue, task_ids, float(record["cost"]))
    workflow.apply_async()
    job_event(log, "routed", job_id, track=track, queue=queue)


def route_job(svc: Services, celery: Celery, job_id: str, num_tracks: int) -> None:
    """Route every track now, or park it until a worker is live."""
    for track in range(num_tracks):
        queue = pick_queue(svc)
        if queue is None:
            svc.redis.rpush(_unrouted_key(svc), f"{job_id}:{track}")
            svc.jobs.update(job_id, track, detail="waiting for a worker")
            job_event(log, "parked", job_id, track=track, reason="no live worker")
        else:
            enqueue_track(svc, celery, job_id, track, queue)


def reroute_stranded(svc: Services, celery: Celery) -> int:
    """Move the open tracks of queues whose worker has been offline > ENCORE_REROUTE_AFTER_S to live queues
    (app/recovery.py); returns how many moved. One process at a time (a short Redis lock)."""
    after_s = svc.settings.reroute_after_s
    lock = f"{svc.settings.key_prefix}:lock:reroute"
    if after_s <= 0 or not svc.redis.set(lock, "1", nx=True, ex=60):
        return 0
    try:
        moved = 0
        options = dict(celery.conf.broker_transport_options or {})
        workers = svc.workers.workers()
        live = set(svc.workers.live_queues(workers))
        for queue in stranded(svc, known_queues(svc, workers), live, after_s, time.time()):
            # started tracks first: they were submitted before the ones still waiting
            restarted, failed = restart_started_tracks(svc, queue, _unrouted_key(svc), options)
            detached = detach_waiting_tracks(svc, queue, options, _unrouted_key(svc))
            for event, members in (("restarting", restarted), ("rerouting", detached), ("failed", failed)):
                for member in members:
                    job_id, _, track = member.rpartition(":")
                    job_event(log, event, job_id, track=int(track), queue=queue, reason="worker offline",
                              level=logging.ERROR if event == "failed" else logging.WARNING)
            moved += len(restarted) + len(detached)
        if moved:
            dispatch_unrouted(svc, celery)
        return moved
    finally:
        svc.redis.delete(lock)


def reap_dead_stages(svc: Services, celery: Celery) -> int:
    """Tracks marked running whose stage holds no lease (its worker died, was cut off from Redis, or its
    child was killed without a word): canceled at once when a cancel is pending, else started again from
    the first unfinished stage on the least loaded live queue (the same one when it has a live consumer),
    counted as a restart (app/recovery.restart_track). Runs from live workers' heartbeats, one at a time."""
    lock = f"{svc.settings.key_prefix}:lock:reap"
    if not svc.redis.set(lock, "1", nx=True, ex=60):
        return 0
    try:
        options = dict(celery.conf.broker_transport_options or {})
        reaped = 0
        for queue in known_queues(svc):
            for member in svc.redis.zrange(svc.jobs.load_key(queue), 0, -1):
                job_id, _, track = member.rpartition(":")
                reaped += _reap(svc, job_id, int(track), queue, options)
        if reaped:
            dispatch_unrouted(svc, celery)
        return reaped
    finally:
        svc.redis.delete(lock)


def _reap(svc: Services, job_id: str, track: int, queue: str, options: dict) -> int:
    record = svc.jobs.track(job_id, track)
    if record is None or record.get("running") != "1" or record["state"] in TERMINAL_STATES:
        return 0
    if svc.jobs.has_lease(job_id, track):
        return 0
    stage = record["stage"] or "its stage"
    if svc.jobs.cancel_requested(job_id):
        if svc.jobs.finish(job_id, track, CANCELED, progress=record["progress"],
                           detail=f"canceled during {stage} (its stage had stopped)"):
            job_event(log, "canceled", job_id, track=track, queue=queue, reason="no live lease")
        return 0
    outcome = restart_track(svc, job_id, track, record, queue, _unrouted_key(svc), options,
                            why=f"the lease of {record['worker'] or 'its worker'} expired")
    if outcome:
        job_event(log, "restarting" if outcome == "restarted" else "failed", job_id, track=track, queue=queue,
                  stage=stage, reason="lease expired", level=logging.ERROR if outcome == "failed" else logging.WARNING)
    return int(outcome == "restarted")


def dispatch_unrouted(svc: Services, celery: Celery, limit: int = 100) -> int:
    """Route parked tracks now that a worker is live; returns how many were routed."""
    routed = 0
    while routed < limit:
        queue = pick_queue(svc)
        if queue is None:
            break
        member = svc.redis.lpop(_unrouted_key(svc))
        if member is None:
            break
        job_id, _, track = member.rpartition(":")
        enqueue_track(svc, celery, job_id, int(track), queue)
        routed += 1
    return routed
