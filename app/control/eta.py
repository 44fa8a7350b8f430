"""Time in seconds: what each queue has learned about its speed, and the estimates built from it.

A track's `cost` is its size in the unit its work grows with: song seconds for music, audio seconds for
lip-sync. Every stage that finishes teaches its queue (one GPU card) how many wall seconds that stage takes per
cost unit: an exponentially weighted mean per (queue, kind, stage) with weight ENCORE_ETA_ALPHA, kept in the
`{p}:throughput` hash, so a slow card is known to be slow. A batched stage (one pass for several tracks of a
song) is learned per track served, so the sum of the tracks' estimates is the batch's time. The same mean is
what /metrics shows as `encore_stage_seconds_per_unit` (app/control/metrics.py): there is one average.

The work outstanding on each queue is not counted per read: the transitions keep it in the backlog index
(app/control/backlog.py, which also states the estimate's rule and computes it, in Lua, next to the data). From it, in
one round trip whatever the number of jobs:
- a job's `eta_s`: its last open track's finish (0 once it ended; None while a track waits for a live worker,
  parked or on a queue no live worker has served for about three heartbeats: the estimate would stand still);
  a poll reads it with the record (record_with_eta);
- the seconds a queue has outstanding, and what a new track would add there: what routing compares instead of
  song seconds (done_in);
- the finish of every track on a queue, for the admission caps' Retry-After (finishes; reads every entry).
A stage no queue has learned yet counts its share of the cost (so with nothing learned a track's estimate is
its cost, the old load); a queue that has not learned a stage another queue has borrows the fleet's mean.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterable

from app.adapters.redis_conn import decoded
from app.control.scripts import script
from app.control.services import Services
from app.core.config import Settings
from app.core.tenants import OPEN_TENANT, Tenant
from app.core.kinds import TERMINAL_STATES
from app.pipeline.music.options import DEFAULT_SLOT_CAP


def field_name(queue: str, kind: str, stage: str) -> str:
    return f"{queue}|{kind}|{stage}"


def learn(
    svc: Services,
    queue: str,
    kind: str,
    stage: str,
    seconds: float,
    cost: float,
    cold: bool = False,
    alpha: float | None = None,
) -> float | None:
    """Teach `queue` that `stage` of `kind` took `seconds` for `cost` units (of all the tracks it served);
    returns the new rate (None when the sample says nothing: no queue, no cost)."""
    if not queue or cost <= 0 or seconds < 0 or not math.isfinite(seconds):
        return None
    weight = svc.settings.eta_alpha if alpha is None else alpha
    args = [field_name(queue, kind, stage), repr(seconds / cost), repr(weight), "1" if cold else "0"]
    reply = script(svc.redis, "learn")(keys=[svc.jobs.keys.throughput, svc.jobs.keys.estimate_versions], args=args)
    return float(reply)


def announce_slots(svc: Services, queue: str, slots: int) -> None:
    """How many tracks `queue`'s worker runs through the backbone at once (its engine's slots; 1 without one),
    said by the worker at its first heartbeat (from its settings) and by each backbone stage (what its child has:
    an engine sized from free memory, or halved on out-of-memory). The queue's order (lua/backlog_write.lua's
    place_on) and the estimates (app/control/backlog.py) follow it. One read when nothing changed; a change counts
    as a change of the rates, so cached ETAs are recomputed. Like the other queue keys it lives as long as the
    deployment."""
    key = svc.jobs.keys.queue_slots(queue)
    if svc.redis.get(key) != str(slots):
        pipe = svc.redis.pipeline(transaction=False)
        pipe.set(key, str(slots))
        pipe.hincrby(svc.jobs.keys.estimate_versions, "rates", 1)
        pipe.execute()


def learned(svc: Services) -> dict[tuple[str, str, str], float]:
    """Every learned rate: {(queue, kind, stage): seconds per cost unit} (the per-stage throughput)."""
    return parse_rates(decoded(svc.redis.hgetall(svc.jobs.keys.throughput)))


def parse_rates(raw: dict[str, str] | list[str]) -> dict[tuple[str, str, str], float]:
    """The throughput hash's rates ({queue|kind|stage: value}; its "|n", "|cold" and fleet fields left out)."""
    if isinstance(raw, list):  # HGETALL inside Lua: a flat list
        raw = dict(zip(raw[0::2], raw[1::2], strict=True))
    rates = {}
    for name, value in raw.items():
        parts = name.split("|")
        if len(parts) == 3:
            rates[(parts[0], parts[1], parts[2])] = float(value)
    return rates


def running_heads(svc: Services) -> int:
    """How many running tracks per queue (the first in its order) an estimate reads for their elapsed time: what
    one GPU worker runs at once, its engine's slots (ENCORE_BACKBONE_SLOTS; when sized from free memory, at most
    DEFAULT_SLOT_CAP), or without the engine one batch (ENCORE_BATCH_TRACKS); any other running track's worker
    died."""
    return max(1, svc.settings.batch_tracks, configured_slots(svc.settings))


def configured_slots(settings: Settings) -> int:
    """The slots a GPU worker's backbone engine gets by its settings (1: no engine; sized from free memory: at most
    DEFAULT_SLOT_CAP, which the engine corrects when it starts): what a worker announces for its queues."""
    if settings.music_engine != "torch" or settings.backbone_slots == 1:
        return 1
    return settings.backbone_slots or DEFAULT_SLOT_CAP


def job_etas(svc: Services, records: list[dict[str, Any]]) -> list[float | None]:
    """Each job's `eta_s` (app/control/backlog.py's rule), from one read (none when no track is open on a queue)."""
    return [eta for eta, _ in job_readings(svc, records)]


def job_readings(svc: Services, records: list[dict[str, Any]]) -> list[tuple[float | None, bool]]:
    """Each job's `eta_s` and `worker_offline` (an open track's queue has had no live worker for
    `offline_after_s`: nothing runs it until one is back, and its ETA is unknown), from one read of the estimates
    and one of the queues' liveness: what read_job.lua answers a poll."""

    def open_on(record: dict[str, Any]) -> set[str]:
        return {t["queue"] for t in record["tracks"] if t["queue"] and t["status"] not in TERMINAL_STATES}

    ids = [record["job_id"] for record in records if open_on(record)]
    etas = svc.jobs.estimates.read(time.time(), running_heads(svc), jobs=ids)["jobs"] if ids else {}
    unserved = _queues_without_worker(svc, records)
    readings: list[tuple[float | None, bool]] = []
    for record in records:
        queues = open_on(record)
        if queues & unserved:
            readings.append((None, True))
        elif queues:
            readings.append((_rounded(etas.get(record["job_id"])), False))
        else:
            ended = all(t["status"] in TERMINAL_STATES for t in record["tracks"])
            readings.append((0.0 if ended else None, False))
    return readings


def _queues_without_worker(svc: Services, records: list[dict[str, Any]]) -> set[str]:
    """The queues of the records' open tracks that no live worker has served for `offline_after_s`: no worker can
    take their tracks, so their jobs' ETA is unknown (the rule read_job.lua applies to a poll)."""
    queues = sorted(
        {
            t["queue"]
            for record in records
            for t in record["tracks"]
            if t["queue"] and t["status"] not in TERMINAL_STATES
        }
    )
    if not queues:
        return set()
    seen = svc.redis.mget([svc.jobs.keys.queue_live_at(queue) for queue in queues])
    now = time.time()
    return {
        queue
        for queue, at in zip(queues, seen, strict=True)
        if at is None or now - float(at) > svc.jobs.offline_after_s
    }


def record_with_eta(svc: Services, job_id: str) -> tuple[dict[str, Any] | None, float | None]:
    """A job's record (app/control/jobs.JobStore.record) and its `eta_s`, in one round trip: what a poll costs."""
    record, eta = svc.jobs.record_with_eta(job_id, time.time(), running_heads(svc))
    return record, _rounded(eta)


def polled_record(svc: Services, job_id: str, viewer: Tenant = OPEN_TENANT) -> str | None:
    """What a poll answers, as JSON text, in one round trip: the record as clients see it (app/control/views.py)
    with its `eta_s`; None for an unknown job or one `viewer` may not see."""
    return svc.jobs.public_record_text(job_id, time.time(), running_heads(svc), viewer)


def _rounded(eta: float | None) -> float | None:
    return None if eta is None else round(eta, 1)


def done_in(svc: Services, queues: Iterable[str], work: tuple[str, float] | None = None) -> dict[str, float]:
    """Per queue, the seconds until a new track of `work` (kind, cost) would be done there: the queue's
    outstanding seconds plus its own (without `work`: the outstanding seconds)."""
    names = sorted({q for q in queues if q})
    read = svc.jobs.estimates.read(time.time(), running_heads(svc), queues=names, work=work)["queues"]
    return {queue: outstanding + own for queue, (outstanding, own) in read.items()}


def queue_seconds(svc: Services, queues: list[str]) -> dict[str, float]:
    """Seconds of outstanding work per queue."""
    seconds = done_in(svc, queues)
    return {queue: round(seconds.get(queue, 0.0), 3) for queue in queues}


def new_track_seconds(svc: Services, queue: str, kind: str, cost: float) -> float:
    """What a new track of `kind` and `cost` would take on `queue`, all stages, at that queue's rates."""
    read = svc.jobs.estimates.read(time.time(), 0, queues=[queue], work=(kind, cost))["queues"]
    return read[queue][1]


def finishes(svc: Services, queues: Iterable[str]) -> dict[str, list[tuple[str, float]]]:
    """Per queue, (member, seconds until it is done) of every track on it, in the worker's order. Reads every
    entry: for the admission caps' Retry-After, which the caps bound."""
    names = sorted({q for q in queues if q})
    return svc.jobs.estimates.read(time.time(), running_heads(svc), schedules=names)["schedules"]
