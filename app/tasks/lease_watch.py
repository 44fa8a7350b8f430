"""A running stage's lease thread: renews the leases of every track the run holds (of any job), watches the
cancel flag, and stops the stage (by force after a grace) when it must not go on."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import redis

from app.control.services import Services
from app.core.ids import TrackRef
from app.core.joblog import job_event
from app.tasks.track_moves import release_adopted
from app.tasks.scratch import drop_scratch

log = logging.getLogger("encore.jobs")

CANCEL_POLL_S = 0.2


# What the lease thread rides out: Redis unreachable for a while (a restart, a Sentinel failover). Anything
# else it meets (a bug, an answer it cannot read) means it can no longer keep the lease: it stops the stage.
REDIS_OUTAGES = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class LeaseWatchBroken(RuntimeError):
    """The stage's lease thread failed: the stage stops rather than run on without renewing its lease (the
    reaper would start the same stage again elsewhere)."""


class CancelWatch:
    """In a thread: polls the job's cancel flag and renews the run's leases (its track's and its adopted
    tracks'); hard-kills this process if the work ignores a stop. A renewal that finds the lease gone or
    another's means the track was taken from this stage (it was thought dead): `lost` is set, and the stage
    stops without writing the track, which is no longer its. Redis outages are ridden out for as long as the
    lease lasts; once the lease has gone unrenewed for its whole length the track is as good as taken, and
    `lost` is set too. The cancel it watches is the run's own job's: an adopted track of another job that is
    canceled meanwhile ends when the run finishes or releases it (the `finish` and `release` transitions see the
    pending cancel). Any other error in the thread sets `broken` (and `canceled`): the work stops at its
    next cancel check and the stage fails with LeaseWatchBroken (`raise_if_broken`)."""

    def __init__(
        self,
        svc: Services,
        job_id: str,
        track: int,
        grace_s: float,
        adopted: list[TrackRef] | None = None,
        lease_owner: str = "",
        stage: str = "",
    ):
        self.svc, self.job_id, self.track, self.grace_s = svc, job_id, track, grace_s
        self.adopted = adopted if adopted is not None else []  # filled by the run as it adopts tracks, of any job
        self.lease_owner, self.stage = lease_owner, stage
        self.canceled = threading.Event()
        self.lost = threading.Event()
        self.broken: Exception | None = None
        self.renewed_at = time.monotonic()  # the last renewal that went through (the lease was taken just now)
        self.per_track = False  # see per_track_cancels
        self.lost_refs: set[TrackRef] = set()  # per-track mode: held tracks whose lease was found gone
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"cancel-watch-{job_id[:8]}", daemon=True)

    def __enter__(self) -> "CancelWatch":
        self.renewed_at = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=2)

    def raise_if_broken(self) -> None:
        """LeaseWatchBroken when the thread failed: whatever the work did, it did without a renewed lease."""
        if self.broken is not None:
            raise LeaseWatchBroken(self.failure()) from self.broken

    def failure(self) -> str:
        return (
            f"the stage's lease thread failed ({type(self.broken).__name__}: {self.broken}); "
            "the stage was stopped rather than run on without renewing its lease"
        )

    def per_track_cancels(self) -> None:
        """The run holds tracks of many jobs and handles their cancels itself, track by track (the backbone engine,
        app/tasks/engine.py): from now on the thread renews exactly the tracks in `adopted` (the run's own among
        them while it holds it), never stops the run for its own job's cancel, and a track whose lease was taken
        is set aside in `lost_refs` (the run drops it) instead of stopping the run. A broken thread or a Redis
        outage past the lease still stops everything."""
        self.per_track = True

    def _renew(self) -> bool:
        lease_s = self.svc.settings.lease_s
        if not self.per_track:
            return all(
                self.svc.jobs.renew_lease(ref.job_id, ref.track, self.lease_owner, lease_s) for ref in self.held()
            )
        for ref in self.held():
            if ref not in self.lost_refs and not self.svc.jobs.renew_lease(
                ref.job_id, ref.track, self.lease_owner, lease_s
            ):
                self.lost_refs.add(ref)
                job_event(log, "lease_lost", ref.job_id, track=ref.track, level=logging.ERROR, owner=self.lease_owner)
        return True

    def held(self) -> list[TrackRef]:
        """The tracks this run holds a lease on: its own, then those it adopted (of any job); in per-track mode
        exactly those the run lists in `adopted`."""
        if self.per_track:
            return list(self.adopted)
        return [TrackRef(self.job_id, self.track), *self.adopted]

    def _watch(self) -> None:
        try:
            must_stop = self._poll()
        except Exception as exc:
            self.broken = exc
            log.exception("lease thread of job %s track %s failed", self.job_id, self.track)
            job_event(
                log,
                "lease_watch_broken",
                self.job_id,
                track=self.track,
                level=logging.ERROR,
                owner=self.lease_owner,
                error=repr(exc),
            )
            must_stop = True
        if not must_stop:
            return
        self.canceled.set()
        if self._done.wait(self.grace_s):
            return
        self._hard_kill()

    def _poll(self) -> bool:
        """Renew and watch until the run ends (False) or the stage must stop (True): a cancel, a lost lease."""
        lease_s = self.svc.settings.lease_s
        while not self._done.wait(CANCEL_POLL_S):
            try:
                if self.lease_owner and time.monotonic() - self.renewed_at >= lease_s / 3:
                    if not self._renew():
                        self._lose("lease_lost")
                        return True
                    self.renewed_at = time.monotonic()
                if not self.per_track and self.svc.jobs.cancel_requested(self.job_id):
                    return True
            except REDIS_OUTAGES as exc:
                if self.lease_owner and time.monotonic() - self.renewed_at >= lease_s:
                    self._lose("lease_expired_unrenewed", error=repr(exc))
                    return True
        return False

    def _lose(self, event: str, **fields: Any) -> None:
        self.lost.set()
        job_event(log, event, self.job_id, track=self.track, level=logging.ERROR, owner=self.lease_owner, **fields)

    def _hard_kill(self) -> None:
        """The work ignored the stop for `grace_s`: end this process (the prefork master replaces it) after
        writing what the redelivered message must find: canceled, or failed when the thread broke."""
        job_event(log, "cancel_hard_kill", self.job_id, track=self.track, level=logging.ERROR, pid=os.getpid())
        drop_scratch(self.svc, self.job_id, self.track)
        try:
            if self.broken is not None:
                self.svc.jobs.fail(self.job_id, self.track, self.failure(), owner=self.lease_owner)
                release_adopted(self.svc, self.adopted, self.stage, self.lease_owner)
            elif not self.lost.is_set():
                detail = f"canceled during {self.stage or 'its stage'} (stopped by force)"
                for ref in self.held():
                    self.svc.jobs.cancel(ref.job_id, ref.track, detail, owner=self.lease_owner)
        except Exception:
            log.exception("job %s track %s: could not record the forced stop", self.job_id, self.track)
        os._exit(75)  # the prefork master replaces this child; the redelivered message finds the track ended
