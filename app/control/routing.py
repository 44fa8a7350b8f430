"""Put tracks on GPU queues and turn them into Celery chains.

- Each track goes to the live queue where it would be done soonest: the seconds of work outstanding there
  plus its own, both from that queue's learned stage rates (app/control/eta.py), so a slow card gets less work than a
  fast one (with nothing learned yet, seconds are the tracks' cost: song or audio seconds). Picking one track
  at a time spreads a job's tracks across GPUs. With ENCORE_MAX_QUEUED_TRACKS_PER_QUEUE, a queue that holds that
  many open tracks takes none (app/control/quotas.py).
- A track is created, then routed by its submitter (in track order, so a job's tracks reach a queue in
  order); with no live worker it is parked (`{p}:unrouted`) and workers route parked tracks on every
  heartbeat.
- Every signature of a chain carries the queue (a chain-level queue only routes its first step) and a
  priority: the first stage gets its job's level (high 3, normal 6, low 9), later stages the highest (0), so
  a started job's next stage overtakes the first stage of any other job, whatever its priority (FIFO across
  stages), and first stages run by level, then in submission order (app/core/priority.py).
- Parked tracks are dispatched by priority, then fair tag (the order of `{p}:unrouted`, app/core/priority.py).
- A queue that falls idle takes over a track waiting behind a running one elsewhere, or on a queue whose
  worker is offline (`rebalance`, on every worker heartbeat), when the track would be done sooner there: a
  song's second track, a queue whose worker came back after the others, never wait while a live GPU idles. A
  dead worker's running track goes before the tracks that waited behind it (they stay until the reaper has
  restarted it).
- A stage that needs no GPU (`Stage.cpu`: export, prepare, mux) is sent to the queue's companion (`gpu0.cpu`,
  app/core/queues.py) when the host's CPU-stage worker is live, else to the GPU queue (it runs in place there).
- A chain starts at the track's first unfinished stage (a resumed music track skips what it already has);
  its task ids are those of the kind's last stages, so the id a waiting track expects is known.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, cast

from celery import Celery, chain
from redis.exceptions import LockError
from redis.lock import Lock

from app.adapters.redis_conn import decoded, decoded_members, release_lock
from app.control.broker import broker_lists, find_message
from app.control.eta import done_in, finishes, new_track_seconds, queue_seconds
from app.core.joblog import job_event
from app.core.kinds import KINDS, JobKind, first_unfinished
from app.core.queues import cpu_queue_of, is_cpu_queue
from app.control.lifecycle import CREATED, PARKED, QUEUED, member, parse_member
from app.core.priority import DEFAULT_PRIORITY, LATER_STAGE_PRIORITY, first_stage_priority
from app.control.services import Services
from app.control.readiness import worker_readiness
from app.control.workers import consumed_queues

log = logging.getLogger("encore.routing")

SWEEP_LOCK_MIN_S = 5.0  # a sweep lock's shortest timeout (see sweep_lock), whatever the heartbeat


def queue_loads(svc: Services, queues: list[str]) -> dict[str, float]:
    """Seconds of work outstanding per queue, by each queue's learned rates (one round trip)."""
    return queue_seconds(svc, queues)


def known_queues(svc: Services, workers: list[dict] | None = None) -> list[str]:
    """GPU queues that ever had a track or have a live worker (no keyspace scan: this runs on every heartbeat)."""
    workers = svc.workers.workers() if workers is None else workers
    queues = svc.jobs.queues() | {queue for w in workers for queue in consumed_queues(w)}
    return sorted(queue for queue in queues if not is_cpu_queue(queue))


def draining(svc: Services) -> set[str]:
    """Queues an operator drained: no new tracks go there."""
    return decoded(svc.redis.smembers(svc.jobs.keys.draining))


def routable_queues(svc: Services, workers: list[dict] | None = None) -> list[str]:
    """Queues a new track may go to: a GPU queue with a live consumer, not drained by an operator."""
    live = {queue for queue in svc.workers.live_queues(workers) if not is_cpu_queue(queue)}
    return sorted(live - draining(svc))


def companion(svc: Services, queue: str, workers: list[dict] | None = None) -> str | None:
    """Where `queue`'s CPU stages go: its companion queue while a CPU-stage worker consumes it, else None (they
    run in place, on the GPU queue)."""
    cpu_queue = cpu_queue_of(queue)
    return cpu_queue if cpu_queue in svc.workers.live_queues(workers) else None


def queue_lists(queue: str, transport_options: dict[str, Any]) -> list[str]:
    """The broker lists a track of `queue` may have a message in: its own and its companion's."""
    return broker_lists(queue, transport_options) + broker_lists(cpu_queue_of(queue), transport_options)


def pick_queue(svc: Services, workers: list[dict] | None = None, work: tuple[str, float] | None = None) -> str | None:
    """The live, not drained queue with room where a new track (`work`: its kind and cost) would be done
    soonest, its outstanding seconds plus the track's own there (without `work`: the least outstanding seconds);
    ties go to the lowest name."""
    queues = _with_room(svc, routable_queues(svc, workers))
    if not queues:
        return None
    seconds = done_in(svc, queues, work)  # equal estimates tie, whatever the float noise:
    return min(queues, key=lambda q: (round(seconds[q], 6), _queue_number(q)))


def _with_room(svc: Services, queues: list[str]) -> list[str]:
    """The queues holding fewer open tracks than ENCORE_MAX_QUEUED_TRACKS_PER_QUEUE (all of them without it)."""
    cap = svc.settings.max_queued_tracks_per_queue
    if not cap or not queues:
        return queues
    pipe = svc.redis.pipeline(transaction=False)
    for queue in queues:
        pipe.zcard(svc.jobs.keys.load(queue))
    return [queue for queue, held in zip(queues, pipe.execute(), strict=True) if held < cap]


def track_work(svc: Services, job_id: str, track: int) -> tuple[str, float] | None:
    """(kind, cost) of a track: what pick_queue weighs it by."""
    pipe = svc.redis.pipeline(transaction=False)
    pipe.hget(svc.jobs.keys.job(job_id), "kind")
    pipe.hget(svc.jobs.keys.track(job_id, track), "cost")
    kind, cost = pipe.execute()
    return (kind, float(cost or 0)) if kind in KINDS else None


def _queue_number(queue: str) -> tuple[int, str]:
    digits = "".join(ch for ch in queue if ch.isdigit())
    return (int(digits) if digits else 0, queue)


def _chain_offset(kind: JobKind, record: dict[str, Any]) -> int:
    """Index in `kind.stages` of the stage the track's current chain starts with (its ids are those of the
    kind's last stages)."""
    return len(kind.stages) - len(record["task_ids"])


def chain_start(kind: JobKind, record: dict[str, Any]) -> str:
    """The stage a queued track's chain starts with."""
    return kind.stages[_chain_offset(kind, record)].name


def expected_task_id(kind: JobKind, record: dict[str, Any], stage: str) -> str | None:
    """The id of the message a track's chain has for `stage`."""
    ids = record["task_ids"]
    index = [s.name for s in kind.stages].index(stage) - _chain_offset(kind, record)
    return ids[index] if 0 <= index < len(ids) else None


def build_chain(
    celery: Celery,
    kind: JobKind,
    ref: dict,
    queue: str,
    start: int = 0,
    priority: str = DEFAULT_PRIORITY,
    started: bool = False,
    cpu_queue: str | None = None,
) -> tuple[chain, list[str]]:
    """The chain of `kind`'s stages from index `start`, on `queue` (its CPU stages on `cpu_queue` when given),
    with fresh task ids; its first stage (when the chain has it) is sent with `priority`'s level, later ones above
    every level. A `started` track (one that ran before and restarts: its worker died) sends every stage above
    every level: it keeps its place ahead of the jobs queued after it."""
    signatures, task_ids = [], []
    for index, stage in enumerate(kind.stages[start:], start):
        task_id = uuid.uuid4().hex
        message_priority = first_stage_priority(priority) if index == 0 and not started else LATER_STAGE_PRIORITY
        args = (ref,) if index == start else ()
        signatures.append(
            celery.signature(
                stage.task,
                args=args,
                queue=cpu_queue if stage.cpu and cpu_queue else queue,
                priority=message_priority,
                task_id=task_id,
                immutable=False,
            )
        )
        task_ids.append(task_id)
    return chain(*signatures), task_ids


def job_priority(job: dict[str, Any]) -> str:
    """The priority level a job was submitted with (jobs written before priorities were normal)."""
    return str(job["params"].get("priority", DEFAULT_PRIORITY))


def enqueue_track(
    svc: Services, celery: Celery, job_id: str, track: int, queue: str, workers: list[dict] | None = None
) -> bool:
    """Route a created or parked track to `queue` (the `route` transition) and send its chain; a pending cancel ends it
    instead. A process that dies between the two leaves a queued track with no message: the reaper sends it
    again (app/control/recovery.py). `workers`: the registry when the caller read it already."""
    job = svc.jobs.job(job_id)
    record = svc.jobs.track(job_id, track)
    if job is None or record is None or record["status"] not in (CREATED, PARKED):
        return False
    kind = KINDS[job["kind"]]
    workflow, task_ids = build_chain(
        celery,
        kind,
        {"job_id": job_id, "track": track},
        queue,
        first_unfinished(kind, record["stages"]),
        job_priority(job),
        started=int(record.get("restarts") or 0) > 0,
        cpu_queue=companion(svc, queue, workers),
    )
    outcome = svc.jobs.route(job_id, track, queue, task_ids)
    if outcome.canceled:
        job_event(log, "canceled", job_id, track=track, reason="canceled while waiting to be routed")
        return False
    if not outcome:
        return False
    workflow.apply_async()
    job_event(log, "routed", job_id, track=track, queue=queue)
    return True


def resend(svc: Services, celery: Celery, job_id: str, track: int, record: dict[str, Any], queue: str) -> bool:
    """Send a waiting track's next message again, as a new chain from the stage it waits for (its old ids
    are dropped, so the lost message, should it ever come back, is stale)."""
    job = svc.jobs.job(job_id)
    if job is None:
        return False
    kind = KINDS[job["kind"]]
    start = first_unfinished(kind, record["stages"])
    workflow, task_ids = build_chain(
        celery,
        kind,
        {"job_id": job_id, "track": track},
        queue,
        start,
        job_priority(job),
        cpu_queue=companion(svc, queue),
    )
    if not svc.jobs.transition("resend", job_id, track, {"detail": record["detail"]}, task_ids=json.dumps(task_ids)):
        return False
    workflow.apply_async()
    return True


def route_job(svc: Services, celery: Celery, job_id: str, num_tracks: int) -> None:
    """Route every created track of a job now, in order; with no live worker they are parked."""
    work = track_work(svc, job_id, 0)  # a job's tracks are alike
    workers = svc.workers.workers()  # read once for the job: each track is placed by the loads, which move
    for track in range(num_tracks):
        queue = pick_queue(svc, workers, work=work)
        if queue is None:
            if svc.jobs.transition(
                "park", job_id, track, {"detail": "waiting for a worker"}, cancel_detail="canceled before it started"
            ):
                job_event(log, "parked", job_id, track=track, reason="no live worker")
        else:
            enqueue_track(svc, celery, job_id, track, queue, workers)


def dispatch_unrouted(svc: Services, celery: Celery, limit: int = 100) -> int:
    """Route parked tracks, highest priority first and within a level oldest submission first (the order of
    `{p}:unrouted`), while a worker is live; returns how many were routed."""
    routed = 0
    parked = decoded_members(svc.redis.zrange(svc.jobs.keys.unrouted, 0, limit - 1))
    workers = svc.workers.workers() if parked else []  # read once for the pass (it runs on every heartbeat)
    for value in parked:
        job_id, track = parse_member(value)
        queue = pick_queue(svc, workers, work=track_work(svc, job_id, track))
        if queue is None:
            break
        routed += enqueue_track(svc, celery, job_id, track, queue, workers)
    return routed


def sweep_lock(svc: Services, name: str) -> Lock:
    """The lock a periodic pass (the reaper, the rebalance) holds so that one process at a time runs it. It is
    token-checked (never frees another's) and expires three heartbeats after it was last taken or stretched
    (`stretch_lock`): a worker killed mid-pass holds the next pass up by seconds. (It was 60 s: a SIGKILL that
    landed in a reaper's pass left a dead stage's canceled track waiting a minute past its lease.)"""
    return svc.redis.lock(svc.jobs.keys.lock(name), timeout=max(SWEEP_LOCK_MIN_S, 3 * svc.settings.heartbeat_s))


def stretch_lock(lock: Lock) -> bool:
    """Give a long pass's lock its whole timeout again; False when it expired and another took it (the caller
    stops its pass: the other process runs one now)."""
    try:
        lock.reacquire()
    except LockError:
        return False
    return True


def rebalance(svc: Services, celery: Celery) -> int:
    """Give each idle live queue (nothing open on it) the first waiting track of a busy queue (one running a
    stage), when that track would be done sooner on the idle queue than where it waits; returns how many moved.
    The move takes the track's first message out of the broker in the same step (`unroute`), so a worker that
    took it meanwhile keeps it. One process at a time (a short Redis lock)."""
    lock = sweep_lock(svc, "rebalance")
    if not lock.acquire(blocking=False):
        return 0
    try:
        workers = svc.workers.workers()
        ready = {queue for w in workers if _takes_work_now(w) for queue in consumed_queues(w)}
        queues = [queue for queue in _with_room(svc, routable_queues(svc, workers)) if queue in ready]
        idle = [queue for queue in queues if not svc.redis.zcard(svc.jobs.load_key(queue))]
        live = {w["name"] for w in workers if w["status"] != "offline"}
        served = set(svc.workers.live_queues(workers))
        moved = 0
        for queue in idle:
            moved += _take_one_waiting(svc, celery, queue, live, served)
        return moved
    finally:
        release_lock(lock)


def _takes_work_now(worker: dict[str, Any]) -> bool:
    """Live and idle, with its models loaded when it preloads them (a track moved to a worker still loading
    would wait there instead)."""
    if worker["status"] != "idle":
        return False
    return worker.get("preload", "0") in ("0", "") or worker_readiness(worker)["ready"]


def _take_one_waiting(svc: Services, celery: Celery, idle: str, live: set[str], served: set[str]) -> int:
    """The first waiting track of the queues that are busy or lost their worker, moved to `idle` if it is done
    sooner there (the first by priority and fair tag across those queues). A queue with a running track whose
    worker is offline gives nothing yet: that track goes first, when its lease ends and the reaper restarts it
    (its fair tag puts it ahead of the tracks that waited behind it); taking the waiting ones now would run them
    before it."""
    heads: list[tuple[float, str, str]] = []
    for queue in known_queues(svc):
        if queue == idle:
            continue
        running = decoded_members(svc.redis.zrange(svc.jobs.keys.running(queue), 0, -1))
        if _held_by_the_dead(svc, running, live):
            continue
        if not running and queue in served:
            continue  # not busy, and a live worker takes what waits there
        first = cast(list[tuple[Any, float]], svc.redis.zrange(svc.jobs.waiting_key(queue), 0, 0, withscores=True))
        for value, score in first:  # its place: priority rank, then fair tag (app/core/priority.py)
            heads.append((float(score), queue, value.decode() if isinstance(value, bytes) else str(value)))
    for _, donor, value in sorted(heads):
        job_id, track = parse_member(value)
        work = track_work(svc, job_id, track)
        waiting_finish = dict(finishes(svc, [donor]).get(donor, [])).get(value)
        if work is None or waiting_finish is None or new_track_seconds(svc, idle, *work) >= waiting_finish:
            continue
        if _unroute_one(
            svc, celery, donor, job_id, track, f"moving to {idle}: idle while this track waited on {donor}"
        ):
            job_event(log, "rerouting", job_id, track=track, queue=donor, reason=f"{idle} idle")
            return int(enqueue_track(svc, celery, job_id, track, idle))
    return 0


def _held_by_the_dead(svc: Services, running: list[str], live: set[str]) -> bool:
    """Some of these running tracks ("job:track") are held by a worker that is not live (dead, its lease not yet
    expired)."""
    pipe = svc.redis.pipeline(transaction=False)
    for value in running:
        pipe.hget(svc.jobs.keys.track(*parse_member(value)), "worker")
    return any(worker and decoded(worker) not in live for worker in pipe.execute())


def _unroute_one(svc: Services, celery: Celery, queue: str, job_id: str, track: int, detail: str) -> bool:
    """Take one queued track off `queue` with its first message (False when a worker took it meanwhile)."""
    record = svc.jobs.track(job_id, track)
    if record is None or record["status"] != QUEUED or not record["task_ids"]:
        return False
    found = find_message(
        svc.redis, queue_lists(queue, dict(celery.conf.broker_transport_options or {})), record["task_ids"][0]
    )
    return found is not None and bool(
        svc.jobs.transition(
            "unroute", job_id, track, {"detail": detail}, lrem=list(found), cancel_detail="canceled before it started"
        )
    )


def unroute_waiting(svc: Services, queue: str, transport_options: dict[str, Any]) -> list[str]:
    """Take every queued track off `queue` together with its first message (the `unroute` transition removes
    the message atomically, so a worker that took it meanwhile keeps the track). Returns the members moved."""
    lists = queue_lists(queue, transport_options)
    moved = []
    for value in decoded_members(svc.redis.zrange(svc.jobs.waiting_key(queue), 0, -1)):
        job_id, track = parse_member(value)
        record = svc.jobs.track(job_id, track)
        if record is None or record["status"] != QUEUED or not record["task_ids"]:
            continue
        found = find_message(svc.redis, lists, record["task_ids"][0])
        if found is not None and svc.jobs.transition(
            "unroute",
            job_id,
            track,
            {"detail": f"moving: no worker on {queue}"},
            lrem=list(found),
            cancel_detail="canceled before it started",
        ):
            moved.append(member(job_id, track))
    return moved


def drain_queue(svc: Services, celery: Celery, queue: str) -> int:
    """Stop routing to `queue` and move its tracks that have not started to other live queues (parked when
    there is none); its running stage and started tracks finish there. Returns how many tracks moved."""
    svc.redis.sadd(svc.jobs.keys.draining, queue)
    moved = unroute_waiting(svc, queue, dict(celery.conf.broker_transport_options or {}))
    for value in moved:
        job_id, track = parse_member(value)
        job_event(log, "rerouting", job_id, track=track, queue=queue, reason="queue drained")
    dispatch_unrouted(svc, celery)
    return len(moved)


def resume_queue(svc: Services, celery: Celery, queue: str) -> None:
    """Route to `queue` again (parked tracks may go there at once)."""
    svc.redis.srem(svc.jobs.keys.draining, queue)
    dispatch_unrouted(svc, celery)
