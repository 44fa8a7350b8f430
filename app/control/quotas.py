"""Back-pressure: caps on open (not ended) tracks, so a flood of submissions is refused instead of queued
without end.

- ENCORE_MAX_QUEUED_TRACKS caps the open tracks in all: created, parked (no live worker) and on any queue;
- ENCORE_MAX_QUEUED_TRACKS_PER_QUEUE caps the open tracks each live, not drained queue holds; a job fits when the
  queues' room, less the tracks still waiting to be routed, takes all its tracks. With no live queue it is not
  applied (the job parks until a worker comes; the total cap still bounds how many do).
A job that would pass a cap is not created: QueueFull carries a Retry-After, the seconds until enough tracks
finish, read from the queues' ETA schedules (app/control/eta.py). The count and the job's write happen under one short
Redis lock, so concurrent submits cannot both take the last room. With no cap set nothing is counted or locked.
"""

from __future__ import annotations

import math
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from app.control.eta import finishes
from app.control.routing import routable_queues
from app.control.scripts import script
from app.control.services import Services

UNKNOWN_WAIT_S = 60  # Retry-After when no schedule says when room comes (every open track parked)
LOCK_S = 5.0  # the lock's expiry (a web process that dies holding it delays admissions this long)
LOCK_WAIT_S = 5.0  # how long a submit waits for the lock before it is refused (Retry-After 1)


class QueueFull(Exception):
    """A submit that would pass a cap on open tracks: refused, retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class OpenTracks:
    unrouted: int  # created (not routed yet) and parked tracks
    on_queue: dict[str, int]  # open tracks per known queue
    live: list[str]  # live, not drained queues (where new tracks can go)

    @property
    def total(self) -> int:
        return self.unrouted + sum(self.on_queue.values())


def caps_enabled(svc: Services) -> bool:
    return bool(svc.settings.max_queued_tracks or svc.settings.max_queued_tracks_per_queue)


@contextmanager
def admission(svc: Services, num_tracks: int) -> Iterator[None]:
    """Check that `num_tracks` more fit under the caps (QueueFull if not), holding the admission lock while the
    caller writes the job, so that the next submit counts them."""
    if not caps_enabled(svc):
        yield
        return
    with short_lock(svc, "admission", QueueFull("busy: other submissions are being admitted; retry", 1)):
        check(svc, num_tracks)
        yield


@contextmanager
def short_lock(svc: Services, name: str, busy: Exception) -> Iterator[None]:
    """Hold the lock `name` (it expires after LOCK_S, should its holder die) while the block runs; `busy` is raised
    when another holds it for longer than LOCK_WAIT_S."""
    key = svc.jobs.keys.lock(name)
    token = secrets.token_hex(8)
    deadline = time.monotonic() + LOCK_WAIT_S
    while not svc.redis.set(key, token, nx=True, px=int(LOCK_S * 1000)):
        if time.monotonic() > deadline:
            raise busy
        time.sleep(0.005)
    try:
        yield
    finally:
        script(svc.redis, "release_lock")(keys=[key], args=[token])


def count_open(svc: Services) -> OpenTracks:
    """Open tracks: those not on a queue, and per queue (its load set holds exactly its open tracks)."""
    live = routable_queues(svc)
    queues = sorted(svc.jobs.queues() | set(live))
    pipe = svc.redis.pipeline(transaction=False)
    pipe.zcard(svc.jobs.keys.created)
    pipe.zcard(svc.jobs.keys.unrouted)
    for queue in queues:
        pipe.zcard(svc.jobs.keys.load(queue))
    created, parked, *loads = pipe.execute()
    return OpenTracks(created + parked, dict(zip(queues, loads, strict=True)), live)


def check(svc: Services, num_tracks: int) -> None:
    """QueueFull when `num_tracks` more would pass a cap."""
    settings = svc.settings
    counts = count_open(svc)
    cap = settings.max_queued_tracks
    if cap and counts.total + num_tracks > cap:
        need = counts.total + num_tracks - cap
        wait = _wait(svc, counts.on_queue, need, lambda queue: 0)
        raise QueueFull(
            f"queue full: {counts.total} tracks are open and the service takes at most {cap}; this job "
            f"has {num_tracks}",
            wait,
        )
    per_queue = settings.max_queued_tracks_per_queue
    if per_queue and counts.live:
        room = sum(max(0, per_queue - counts.on_queue.get(q, 0)) for q in counts.live) - counts.unrouted
        if room < num_tracks:
            live = {q: counts.on_queue.get(q, 0) for q in counts.live}
            wait = _wait(svc, live, num_tracks - room, lambda queue: max(0, live[queue] - per_queue))
            raise QueueFull(
                f"queue full: every GPU queue holds its {per_queue} open tracks (room for "
                f"{max(room, 0)}); this job has {num_tracks}",
                wait,
            )


def _wait(svc: Services, on_queue: dict[str, int], need: int, skip) -> int:
    """Whole seconds until `need` tracks have finished on the queues in `on_queue` whose finishing frees room
    (the first `skip(queue)` finishes on an over-full queue free none), by the queues' ETA schedules."""
    schedules = finishes(svc, on_queue)
    frees = sorted(
        finish for queue in on_queue for finish in sorted(f for _, f in schedules.get(queue, []))[skip(queue) :]
    )
    if need <= 0 or len(frees) < need:
        return UNKNOWN_WAIT_S
    return max(1, math.ceil(frees[need - 1]))
