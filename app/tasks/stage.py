"""Shared stage machinery: what every pipeline stage does around its work, whatever the pipeline.

A stage task receives {"job_id", "track"} and returns it for the next stage of the chain. Every change it
makes to its track is a transition of app/control/lifecycle.py, made as the holder of the stage's lease. Around the
work:
- start (the `start` transition) only when the delivery is of the track's current chain, the track is open
  and no live stage holds it; a pending cancel ends the track instead; a message delivered more than
  ENCORE_MAX_DELIVERIES times fails it (a stage that keeps killing its worker must not loop forever);
- record worker, timestamps, throttled progress and model loads in the job record;
- renew the lease while the work runs; a renewal that fails means the track was taken from this stage
  (the reaper judged it dead): the stage stops and writes nothing. Redis outages are ridden out while the
  lease lasts (past it, the same stop); any other error of the lease thread stops the stage, which fails
  with LeaseWatchBroken: a stage never runs on unrenewed;
- watch the cancel flag in a thread: the work sees it through StageControl within ~0.2 s; if the work
  has not stopped `cancel_grace_s` later, the child process exits (hard kill) and the master replaces it;
- soft time limit -> failed with a timeout message; hard limit (child killed) -> on_failure in the master;
- any other exception -> failed with the message; the worker takes the next job.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

import redis
from kombu.exceptions import OperationalError
from celery import Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded, TimeLimitExceeded

from app.adapters.celery_app import celery
from app.control.eta import learn as learn_stage
from app.core.joblog import job_event
from app.core.kinds import JobKind, Stage
from app.control.lifecycle import is_open
from app.control.metrics import observe_stage
from app.control.tenant_limits import record_gpu_seconds
from app.pipeline.control import Canceled, StageControl
from app.pipeline.runtime import device_report, release_memory
from app.control.services import Services, services
from app.control.workers import pid_alive

log = logging.getLogger("encore.jobs")

CANCEL_POLL_S = 0.2
PROGRESS_EVERY_S = 0.25


@dataclass
class StageRun:
    """What a stage's work function gets: its job, parameters, a scratch dir, and artifact access."""

    svc: Services
    job_id: str
    track: int
    stage: Stage
    params: dict[str, Any]
    track_params: dict[str, Any]
    workdir: Path
    control: StageControl
    kind: JobKind
    loaded: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # facts about the stage's work, kept in its record
    queue: str = ""
    worker: str = ""
    adopted: list[int] = field(default_factory=list)  # other tracks of the job this run also serves
    lease_owner: str = ""  # this run's lease (jobs.take_lease), also put on the tracks it adopts

    @property
    def scratch(self) -> Path:
        """Worker-local folder shared by the stages of this track (all run on the same queue, hence the
        same worker) for intermediates too big for the artifact store; removed when the track ends."""
        path = track_scratch(self.svc, self.job_id, self.track)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def input(self, name: str) -> Path:
        return self.svc.artifacts.local_path(self.job_id, name)

    def keep(self, name: str, path: Path) -> None:
        """Store an intermediate for the next stage (by reference, never in the Celery message)."""
        self.svc.artifacts.put(self.job_id, name, path, self._ttl())

    def publish(self, name: str, path: Path) -> None:
        """Store a result the client can download, and list it in the track's artifacts."""
        self.keep(name, path)
        record = self.svc.jobs.track(self.job_id, self.track) or {"artifacts": []}
        artifacts = sorted(set(record["artifacts"]) | {name})
        self.svc.jobs.report(self.job_id, self.track, self.lease_owner, artifacts=artifacts)

    def note(self, track: int, **fields: Any) -> None:
        """Facts about one of this run's tracks (its own or an adopted one) for its record."""
        self.svc.jobs.report(self.job_id, track, self.lease_owner, **fields)

    # -- tracks of the same job served by this run (batching) ------------------------------------------
    def adopt_waiting_siblings(self, limit: int) -> list[int]:
        """Take over up to `limit` tracks of this job that wait on this queue for this same stage, so one
        batched pass serves them all. Each one's own message, when it comes, finds the stage done and moves
        on; if this run fails, `release_siblings` puts them back to wait for their own message."""
        job = self.svc.jobs.job(self.job_id)
        adopted: list[int] = []
        for other in range(job["num_tracks"] if job else 0):
            if len(adopted) >= limit:
                break
            if other != self.track and self.svc.jobs.transition(
                "adopt",
                self.job_id,
                other,
                {"detail": f"{self.stage.name} together with track {self.track}", "progress": 0.0},
                stage=self.stage.name,
                queue_is=self.queue,
                owner=self.lease_owner,
                worker=self.worker,
                lease_ms=int(self.svc.settings.lease_s * 1000),
            ):
                adopted.append(other)
                self.adopted.append(other)
        return adopted

    def sibling_params(self, track: int) -> dict[str, Any]:
        record = self.svc.jobs.track(self.job_id, track)
        return record["params"] if record else {}

    def shared_control(self, siblings: list[int]) -> StageControl:
        """This run's control, whose progress also goes to the adopted tracks."""
        if not siblings:
            return self.control
        others = [_Throttled(self.svc, self.job_id, track, self.lease_owner) for track in siblings]

        def report(fraction: float, detail: str) -> None:
            self.control.report(fraction, detail)
            for other in others:
                other(fraction, detail)

        return StageControl(report=report, cancel_requested=self.control.cancel_requested)

    def finish_sibling(self, track: int, started_at: float) -> None:
        """Record this stage done for an adopted track, as `_finish` does for the run's own track."""
        record = self.svc.jobs.track(self.job_id, track)
        if record is None:
            return
        stages = record["stages"]
        now = time.time()
        stages[self.stage.name] = {
            "started_at": started_at,
            "finished_at": now,
            "duration_s": round(now - started_at, 3),
            "worker": self.worker,
            "loaded": [],
            "with_track": self.track,
        }
        finish_stage(self.svc, self.kind, self.job_id, track, self.stage, stages, self.lease_owner)
        job_event(
            log,
            "stage_finished",
            self.job_id,
            track=track,
            queue=self.queue,
            worker=self.worker,
            stage=self.stage.name,
            with_track=self.track,
        )

    def release_siblings(self, tracks: list[int]) -> None:
        """Adopted tracks go back to waiting for their own message (this run failed or was stopped)."""
        release_adopted(self.svc, self.job_id, tracks, self.stage.name, self.lease_owner)

    def _ttl(self) -> float:
        job = self.svc.jobs.job(self.job_id)
        return max(1.0, (job["expires_at"] if job else time.time() + self.svc.settings.job_ttl_s) - time.time())


def finish_stage(
    svc: Services, kind: JobKind, job_id: str, track: int, stage: Stage, stages: dict[str, Any], owner: str
) -> bool:
    """Stage `stage` of the track is done (the `finish` transition): it waits for the next, or is done.
    False when the track is no longer this run's (lease lost) or a pending cancel ended it."""
    following = kind.next_stage(stage.name)
    if following is None:
        drop_scratch(svc, job_id, track)  # first: whoever sees the track done never finds its scratch
    fields = {
        "stages": stages,
        "progress": 1.0 if following is None else 0.0,
        "detail": "done" if following is None else "waiting for the worker",
    }
    outcome = svc.jobs.transition(
        "finish",
        job_id,
        track,
        fields,
        stage=stage.name,
        owner=owner,
        cancel_detail=f"canceled before {following.name if following else 'the end'}",
    )
    if outcome.canceled:
        drop_scratch(svc, job_id, track)
    return outcome.applied and not outcome.canceled


def release_adopted(svc: Services, job_id: str, tracks: list[int], stage: str, owner: str) -> None:
    """Tracks adopted by a run that did not finish wait again for their own message (the `release`
    transition); with a cancel pending they end now (the canceled job's messages were revoked)."""
    for track in tracks:
        svc.jobs.transition(
            "release",
            job_id,
            track,
            {"detail": "queued", "progress": 0.0},
            stage=stage,
            owner=owner,
            cancel_detail=f"canceled during {stage}",
        )


def adopted_by_killed_run(svc: Services, job_id: str, track: int, owner: str) -> list[int]:
    """Other tracks of the job whose lease is the killed run's own: it had adopted them (its child took its
    list of them along)."""
    job = svc.jobs.job(job_id)
    return [
        other
        for other in range(job["num_tracks"] if job else 0)
        if other != track and svc.jobs.lease(job_id, other) == owner
    ]


def track_scratch(svc: Services, job_id: str, track: int) -> Path:
    return svc.settings.worker_cache_dir / "tracks" / f"{job_id}-{track}"


def drop_scratch(svc: Services, job_id: str, track: int) -> None:
    shutil.rmtree(track_scratch(svc, job_id, track), ignore_errors=True)


def sweep_scratch(svc: Services) -> list[str]:
    """Scratch folders of jobs whose record expired (a worker that died mid-track cannot clean up)."""
    root = svc.settings.worker_cache_dir / "tracks"
    removed = []
    for folder in root.iterdir() if root.is_dir() else []:
        job_id = folder.name.split("-")[0]
        if svc.jobs.job(job_id) is None:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def stage_workdir(svc: Services, job_id: str, track: int, stage: str) -> Path:
    """A running stage's own temp folder, under the worker's cache dir and named after its job, track, stage and
    process: removed when the stage ends, and by `sweep_workdirs` when its process was killed first."""
    root = svc.settings.worker_cache_dir / "work"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{job_id}-{track}-{stage}-{os.getpid()}-", dir=root))


def sweep_workdirs(svc: Services) -> list[str]:
    """Temp folders of stages whose process is gone (a killed pool child or worker cannot clean up after itself);
    a folder whose process lives, even one of another worker on this host, is kept."""
    root = svc.settings.worker_cache_dir / "work"
    removed = []
    for folder in root.iterdir() if root.is_dir() else []:
        parts = folder.name.rsplit("-", 2)
        if len(parts) == 3 and parts[1].isdigit() and not pid_alive(int(parts[1])):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


class _Throttled:
    """Writes progress to the job record at most every PROGRESS_EVERY_S, but always the first report that moves
    it (a stage's "Loading ... model" notice at 0 must not hold back its first progress: a stage shorter than
    the window would otherwise show none) and the final 1.0."""

    def __init__(
        self,
        svc: Services,
        job_id: str,
        track: int,
        owner: str,
        every_s: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.svc, self.job_id, self.track, self.owner, self.every_s = svc, job_id, track, owner, every_s
        self.clock = clock
        self.last: float | None = (
            None  # never: monotonic() counts from boot, so 0.0 would be "just now" on a new machine
        )
        self.moved = False

    def __call__(self, fraction: float, detail: str) -> None:
        now = self.clock()
        first_move = fraction > 0 and not self.moved
        if fraction >= 1.0 or first_move or self.last is None or now - self.last >= self.every_s:
            self.last, self.moved = now, self.moved or fraction > 0
            self.svc.jobs.report(
                self.job_id, self.track, self.owner, progress=round(min(max(fraction, 0.0), 1.0), 4), detail=detail
            )


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
    `lost` is set too. Any other error in the thread sets `broken` (and `canceled`): the work stops at its
    next cancel check and the stage fails with LeaseWatchBroken (`raise_if_broken`)."""

    def __init__(
        self,
        svc: Services,
        job_id: str,
        track: int,
        grace_s: float,
        adopted: list[int] | None = None,
        lease_owner: str = "",
        stage: str = "",
    ):
        self.svc, self.job_id, self.track, self.grace_s = svc, job_id, track, grace_s
        self.adopted = adopted if adopted is not None else []  # filled by the run as it adopts tracks
        self.lease_owner, self.stage = lease_owner, stage
        self.canceled = threading.Event()
        self.lost = threading.Event()
        self.broken: Exception | None = None
        self.renewed_at = time.monotonic()  # the last renewal that went through (the lease was taken just now)
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

    def _renew(self) -> bool:
        lease_s = self.svc.settings.lease_s
        return all(
            self.svc.jobs.renew_lease(self.job_id, track, self.lease_owner, lease_s)
            for track in [self.track, *self.adopted]
        )

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
                if self.svc.jobs.cancel_requested(self.job_id):
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
                release_adopted(self.svc, self.job_id, self.adopted, self.stage, self.lease_owner)
            elif not self.lost.is_set():
                for track in [self.track, *self.adopted]:
                    self.svc.jobs.cancel(
                        self.job_id, track, "canceled (stage stopped by force)", owner=self.lease_owner
                    )
        except Exception:
            log.exception("job %s track %s: could not record the forced stop", self.job_id, self.track)
        os._exit(75)  # the prefork master replaces this child; the redelivered message finds the track ended


class StageTask(Task):
    """Base class of every stage task; subclasses are made by `stage_task`."""

    kind: JobKind
    stage: Stage
    work: Callable[[StageRun], None]

    def announce_ignored(self) -> None:
        """Celery sends no final task event for an ignored task: monitors (Flower) would show a stage that a
        cancel, a stale message or a lost lease ended as STARTED for good. It is revoked as far as they can
        tell: say so (`task-revoked`, which Celery's event state turns into REVOKED)."""
        if not self.app.conf.worker_send_task_events:
            return
        try:
            self.send_event("task-revoked", terminated=False, signum=None, expired=False, retry=False)
        except (OSError, OperationalError) as exc:  # only a monitor misses it; the stage's outcome is recorded
            log.warning("event=task_event_unsent task_id=%s reason=%r", self.request.id, exc)

    def run_stage(self, ref: dict[str, Any]) -> dict[str, Any]:
        svc = services()
        job_id, track = ref["job_id"], int(ref["track"])
        worker = self.request.hostname or "unknown"
        record = svc.jobs.track(job_id, track)
        if record is None or not is_open(record["status"]):
            drop_scratch(svc, job_id, track)
            raise Ignore()
        if self.request.id not in record["task_ids"]:  # the track moved; this message is of its old chain
            self._stale(job_id, track, worker, "not of the track's current chain")
        done = record["stages"].get(self.stage.name, {})
        if done.get("finished_at"):  # run already: with another track of the job, or before a redelivery
            job_event(
                log,
                "stage_skipped",
                job_id,
                track=track,
                queue=record["queue"],
                worker=worker,
                stage=self.stage.name,
                reason="already done" + (f" with track {done['with_track']}" if "with_track" in done else ""),
            )
            return ref
        owner = f"{worker}|{self.request.id}|{os.getpid()}"
        steal = self._killed_child_lease(svc, job_id, track, worker)
        deliveries = svc.jobs.count_delivery(self.request.id)
        if deliveries > svc.settings.max_deliveries:
            drop_scratch(svc, job_id, track)
            svc.jobs.fail(job_id, track, _gave_up(self.stage.name, deliveries, record), steal=steal)
            job_event(
                log,
                "failed",
                job_id,
                track=track,
                worker=worker,
                level=logging.ERROR,
                stage=self.stage.name,
                reason="too many deliveries",
            )
            raise Ignore()
        stages = record["stages"]
        stages[self.stage.name] = {"started_at": time.time(), "worker": worker, "attempt": deliveries}
        outcome = svc.jobs.transition(
            "start",
            job_id,
            track,
            {"progress": 0.0, "detail": "starting", "stages": stages, "attempts": deliveries},
            stage=self.stage.name,
            owner=owner,
            steal=steal,
            task_id=self.request.id,
            worker=worker,
            pid=str(os.getpid()),
            lease_ms=int(svc.settings.lease_s * 1000),
            cancel_detail=f"canceled before {self.stage.name}",
        )
        if outcome.canceled:
            drop_scratch(svc, job_id, track)
            job_event(log, "canceled", job_id, track=track, worker=worker, stage=self.stage.name)
            raise Ignore()
        if not outcome:
            self._stale(job_id, track, worker, outcome.reason)
        job = svc.jobs.job(job_id)
        if job is None:  # the job's record expired under its track: nothing to run it for
            self._stale(job_id, track, worker, "the job's record expired")
        job_event(
            log,
            "stage_started",
            job_id,
            track=track,
            queue=record["queue"],
            worker=worker,
            stage=self.stage.name,
            attempt=deliveries,
        )
        started = time.monotonic()
        workdir = stage_workdir(svc, job_id, track, self.stage.name)
        succeeded = False
        watch = CancelWatch(
            svc, job_id, track, svc.settings.cancel_grace_s, [], lease_owner=owner, stage=self.stage.name
        )
        try:
            with watch:
                control = StageControl(
                    report=_Throttled(svc, job_id, track, owner), cancel_requested=watch.canceled.is_set
                )
                run = StageRun(
                    svc,
                    job_id,
                    track,
                    self.stage,
                    job["params"],
                    record["params"],
                    workdir,
                    control,
                    kind=self.kind,
                    queue=record["queue"],
                    worker=worker,
                    adopted=watch.adopted,
                    lease_owner=owner,
                )
                self._work_watched(run, watch)
            succeeded = True
        except Canceled:
            if watch.lost.is_set():  # taken from this stage: the track is someone else's now
                drop_scratch(svc, job_id, track)
                raise Ignore() from None
            drop_scratch(svc, job_id, track)
            svc.jobs.cancel(job_id, track, f"canceled during {self.stage.name}", owner=owner)
            job_event(log, "canceled", job_id, track=track, queue=record["queue"], worker=worker, stage=self.stage.name)
            raise Ignore() from None
        except SoftTimeLimitExceeded:
            soft, _ = svc.settings.time_limits.get(self.stage.name, (None, 0))
            self._fail(svc, job_id, track, worker, f"timed out: {self.stage.name} ran past its {soft:g} s limit", owner)
            raise
        except Exception as exc:
            self._fail(svc, job_id, track, worker, f"{self.stage.name} failed: {exc}", owner)
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            release_memory(collect=not succeeded)
            svc.workers.update(worker, **device_report())
        self._finish(
            svc,
            run,
            stages,
            time.monotonic() - started,
            worker,
            owner,
            watch,
            units=float(record.get("cost") or 0) * (1 + len(run.adopted)),
        )
        return ref

    def _work(self, run: StageRun) -> None:
        type(self).work(run)

    def _work_watched(self, run: StageRun, watch: CancelWatch) -> None:
        """The work, failing with LeaseWatchBroken (never finishing) when its lease thread broke meanwhile."""
        try:
            self._work(run)
        except Canceled:
            watch.raise_if_broken()  # the stop came from the broken thread, not from a cancel
            raise
        watch.raise_if_broken()

    def _stale(self, job_id: str, track: int, worker: str, reason: str) -> NoReturn:
        job_event(
            log,
            "stale_delivery",
            job_id,
            track=track,
            worker=worker,
            level=logging.WARNING,
            stage=self.stage.name,
            task_id=self.request.id,
            reason=repr(reason),
        )
        raise Ignore()

    def _killed_child_lease(self, svc: Services, job_id: str, track: int, worker: str) -> str:
        """The lease this same delivery's previous child left when it was killed on this worker (its master
        gave the message back): this delivery may take it over at once instead of waiting for it to expire."""
        lease = svc.jobs.lease(job_id, track) or ""
        prefix = f"{worker}|{self.request.id}|"
        if not lease.startswith(prefix):
            return ""
        pid = int(lease.rsplit("|", 1)[1] or 0)
        return lease if pid != os.getpid() and not pid_alive(pid) else ""

    def _finish(
        self,
        svc: Services,
        run: StageRun,
        stages: dict,
        seconds: float,
        worker: str,
        owner: str,
        watch: "CancelWatch",
        units: float = 0.0,
    ) -> None:
        """`units`: the cost units the run got through (its track's and those it adopted), for throughput."""
        stages[self.stage.name].update(
            finished_at=time.time(),
            duration_s=round(seconds, 3),
            loaded=run.loaded,
            **({"info": run.info} if run.info else {}),
        )
        observe_stage(svc, self.kind.name, self.stage.name, seconds, units)
        record_gpu_seconds(svc, run.job_id, seconds)  # the owner's usage (app/control/tenant_limits.py)
        learn_stage(
            svc,
            run.queue,
            self.kind.name,
            self.stage.name,
            seconds,
            units,
            cold=bool(run.loaded) and svc.settings.runtime_mode == "keep_loaded",
        )
        if not finish_stage(svc, self.kind, run.job_id, run.track, self.stage, stages, owner):
            job_event(
                log,
                "stage_finished_too_late",
                run.job_id,
                track=run.track,
                worker=worker,
                stage=self.stage.name,
                level=logging.WARNING,
                reason="canceled" if svc.jobs.cancel_requested(run.job_id) else "the lease was lost",
            )
            raise Ignore()  # the chain stops here: the track ended, or is another run's now
        job_event(
            log,
            "stage_finished",
            run.job_id,
            track=run.track,
            queue=run.queue,
            worker=worker,
            stage=self.stage.name,
            duration_s=f"{seconds:.3f}",
            loaded=",".join(run.loaded) or "-",
        )
        if self.kind.next_stage(self.stage.name) is None:
            job_event(log, "track_done", run.job_id, track=run.track, queue=run.queue, worker=worker)

    def _fail(
        self, svc: Services, job_id: str, track: int, worker: str, message: str, owner: str = "", steal: str = ""
    ) -> None:
        drop_scratch(svc, job_id, track)  # first, as for done
        if svc.jobs.fail(job_id, track, message, owner=owner, steal=steal):
            job_event(
                log,
                "failed",
                job_id,
                track=track,
                worker=worker,
                level=logging.ERROR,
                stage=self.stage.name,
                error=repr(message),
            )

    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        """Also runs in the worker's master when a hard time limit killed the child: the master fails the
        track (and gives back the tracks the run had adopted) in the dead child's name."""
        if isinstance(exc, TimeLimitExceeded) and args:
            svc = services()
            _, hard = svc.settings.time_limits.get(self.stage.name, (None, 0))
            job_id, track = args[0]["job_id"], int(args[0]["track"])
            lease = svc.jobs.lease(job_id, track) or ""
            worker, _, rest = lease.partition("|")  # the master's own request context is not the task's
            dead = lease if rest.partition("|")[0] == task_id else ""
            adopted = adopted_by_killed_run(svc, job_id, track, dead) if dead else []
            self._fail(
                svc,
                job_id,
                track,
                worker,
                f"timed out: {self.stage.name} exceeded its hard time limit of {hard:g} s",
                steal=dead,
            )
            release_adopted(svc, job_id, adopted, self.stage.name, dead)


def stage_task(kind: JobKind, stage_name: str, work: Callable[[StageRun], None]) -> StageTask:
    """Register the Celery task for one stage of `kind`, with that stage's time limits."""
    stage = kind.stage(stage_name)
    soft, hard = services().settings.time_limits.get(stage_name, (None, 3600.0))
    base = type(
        f"{kind.name.title()}{stage_name.title()}Task",
        (StageTask,),
        {"kind": kind, "stage": stage, "work": staticmethod(work)},
    )

    def run(self: StageTask, ref: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.run_stage(ref)
        except Ignore:
            self.announce_ignored()
            raise

    run.__doc__ = f"{kind.name} stage {stage_name!r}: see app/tasks/stage.py."
    return celery.task(
        run,
        name=stage.task,
        base=base,
        bind=True,
        time_limit=hard,
        soft_time_limit=soft,
        acks_late=True,
        reject_on_worker_lost=True,
    )


def _gave_up(stage: str, deliveries: int, record: dict[str, Any]) -> str:
    """Why a stage delivered once too often fails its track. Deliveries are counted per message; a restart by
    recovery (the lease expired first) sends a new message, so its interruptions are named apart, and the
    interruptions a client counted add up."""
    restarts = int(record.get("restarts") or 0)
    earlier = f", after {restarts} restart{'s' if restarts != 1 else ''} of the track" if restarts else ""
    return f"{stage} was interrupted {deliveries - 1} times (worker crashed or was killed){earlier}; giving up"
