"""Shared stage machinery: what every pipeline stage does around its work, whatever the pipeline.

A stage task receives {"job_id", "track"} and returns it for the next stage of the chain. Around the work:
- refuse to start when the track already ended, the job was canceled, or this message was delivered more
  than ENCORE_MAX_DELIVERIES times (a stage that keeps killing its worker must not loop forever);
- record state, worker, timestamps, throttled progress and model loads in the job record;
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
from typing import Any, Callable

from celery import Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded, TimeLimitExceeded

from app.celery_app import celery
from app.joblog import job_event
from app.kinds import CANCELED, DONE, QUEUED, TERMINAL_STATES, JobKind, Stage
from app.metrics import observe_stage
from app.pipeline.control import Canceled, StageControl
from app.pipeline.runtime import device_report, release_memory
from app.services import Services, services

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
    loaded: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # facts about the stage's work, kept in its record
    kind: JobKind | None = None
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
        self.svc.jobs.update(self.job_id, self.track, artifacts=artifacts)

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
            if other != self.track and self.svc.jobs.claim_waiting(
                    self.job_id, other, self.queue, state=self.stage.state, stage=self.stage.name,
                    worker=self.worker, detail=f"{self.stage.name} together with track {self.track}",
                    lease_owner=self.lease_owner, lease_s=self.svc.settings.lease_s):
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
        others = [_Throttled(self.svc, self.job_id, track) for track in siblings]

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
        stages[self.stage.name] = {"started_at": started_at, "finished_at": now, "duration_s": round(now - started_at, 3),
                                   "worker": self.worker, "loaded": [], "with_track": self.track}
        wait_for_stage(self.svc, self.job_id, track, self.kind.next_stage(self.stage.name), stages)
        self.svc.jobs.release_lease(self.job_id, track, self.lease_owner)
        job_event(log, "stage_finished", self.job_id, track=track, queue=self.queue, worker=self.worker,
                  stage=self.stage.name, with_track=self.track)

    def release_siblings(self, tracks: list[int]) -> None:
        """Adopted tracks go back to waiting for their own message (this run failed or was stopped)."""
        release_adopted(self.svc, self.job_id, tracks, self.stage.name)
        for track in tracks:
            self.svc.jobs.release_lease(self.job_id, track, self.lease_owner)

    def _ttl(self) -> float:
        job = self.svc.jobs.job(self.job_id)
        return max(1.0, (job["expires_at"] if job else time.time() + self.svc.settings.job_ttl_s) - time.time())


def wait_for_stage(svc: Services, job_id: str, track: int, following: Stage, stages: dict[str, Any]) -> None:
    """A stage of the track is done: record it and show the track waiting for `following`."""
    svc.jobs.update(job_id, track, stages=stages, state=following.state, stage=following.name, progress=0.0,
                    detail="waiting for the worker", running="0")


def release_adopted(svc: Services, job_id: str, tracks: list[int], stage: str) -> None:
    """Tracks adopted by a run that did not finish wait again for their own message; on a cancel they end
    now (the canceled job's messages were revoked, so none would come)."""
    canceled = svc.jobs.cancel_requested(job_id)
    for track in tracks:
        record = svc.jobs.track(job_id, track)
        if record is None:
            continue
        if canceled:
            svc.jobs.finish(job_id, track, CANCELED, detail=f"canceled during {stage}")
        elif svc.jobs.update(job_id, track, state=QUEUED, stage="", running="0", progress=0.0, detail="queued"):
            svc.redis.zadd(svc.jobs.waiting_key(record["queue"]), {f"{job_id}:{track}": record["seq"]})


def adopted_by_killed_run(svc: Services, job_id: str, track: int, worker: str, stage: Stage) -> list[int]:
    """Other tracks of the job marked running `stage` on `worker`: a worker runs one stage at a time, so the
    run killed there had adopted them (its child took its own list with it)."""
    job = svc.jobs.job(job_id)
    adopted = []
    for other in range(job["num_tracks"] if job else 0):
        record = svc.jobs.track(job_id, other)
        if other != track and record and record["state"] == stage.state and record.get("running") == "1" \
                and record["worker"] == worker:
            adopted.append(other)
    return adopted


def track_scratch(svc: Services, job_id: str, track: int) -> Path:
    return svc.settings.worker_cache_dir / "tracks" / f"{job_id}-{track}"


def end_track(svc: Services, job_id: str, track: int, state: str, **fields: Any) -> bool:
    """End a track on this worker: its local scratch goes first, so whoever sees the track ended never
    finds its scratch still there."""
    drop_scratch(svc, job_id, track)
    return svc.jobs.finish(job_id, track, state, **fields)


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


class _Throttled:
    """Writes progress to the job record at most every PROGRESS_EVERY_S (and always the final 1.0)."""

    def __init__(self, svc: Services, job_id: str, track: int):
        self.svc, self.job_id, self.track = svc, job_id, track
        self.last = 0.0

    def __call__(self, fraction: float, detail: str) -> None:
        now = time.monotonic()
        if fraction >= 1.0 or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.svc.jobs.update(self.job_id, self.track, progress=round(min(max(fraction, 0.0), 1.0), 4),
                                 detail=detail)


class CancelWatch:
    """In a thread: polls the job's cancel flag and renews the run's leases (its track's and its adopted
    tracks'); hard-kills this process if the work ignores a cancel. A renewal that finds the lease gone or
    another's means the track was taken from this stage (it was thought dead): `lost` is set, and the stage
    stops without writing the track, which is no longer its."""

    def __init__(self, svc: Services, job_id: str, track: int, grace_s: float, adopted: list[int] | None = None,
                 lease_owner: str = ""):
        self.svc, self.job_id, self.track, self.grace_s = svc, job_id, track, grace_s
        self.adopted = adopted if adopted is not None else []  # filled by the run as it adopts tracks
        self.lease_owner = lease_owner
        self.canceled = threading.Event()
        self.lost = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"cancel-watch-{job_id[:8]}", daemon=True)

    def __enter__(self) -> "CancelWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=2)

    def _renew(self) -> bool:
        lease_s = self.svc.settings.lease_s
        return all(self.svc.jobs.renew_lease(self.job_id, track, self.lease_owner, lease_s)
                   for track in [self.track, *self.adopted])

    def _watch(self) -> None:
        renew_every = self.svc.settings.lease_s / 3
        renewed = time.monotonic()
        while not self._done.wait(CANCEL_POLL_S):
            try:
                if self.lease_owner and time.monotonic() - renewed >= renew_every:
                    if not self._renew():
                        self.lost.set()
                        job_event(log, "lease_lost", self.job_id, track=self.track, level=logging.ERROR,
                                  owner=self.lease_owner)
                        break
                    renewed = time.monotonic()
                if self.svc.jobs.cancel_requested(self.job_id):
                    break
            except Exception:  # Redis blip: keep watching (an unrenewed lease is the reaper's to judge)
                continue
        else:
            return
        self.canceled.set()
        if self._done.wait(self.grace_s):
            return
        job_event(log, "cancel_hard_kill", self.job_id, track=self.track, level=logging.ERROR, pid=os.getpid())
        drop_scratch(self.svc, self.job_id, self.track)
        if not self.lost.is_set():
            for track in [self.track, *self.adopted]:
                self.svc.jobs.finish(self.job_id, track, CANCELED, detail="canceled (stage stopped by force)")
        os._exit(75)  # the prefork master replaces this child; the redelivered message sees 'canceled'


class StageTask(Task):
    """Base class of every stage task; subclasses are made by `stage_task`."""

    kind: JobKind
    stage: Stage
    work: Callable[[StageRun], None]

    def run_stage(self, ref: dict[str, Any]) -> dict[str, Any]:
        svc = services()
        job_id, track = ref["job_id"], int(ref["track"])
        worker = self.request.hostname or "unknown"
        self._check_can_start(svc, job_id, track, worker)
        record = svc.jobs.track(job_id, track)
        done = record["stages"].get(self.stage.name, {})
        if done.get("finished_at"):  # run already: with another track of the job, or before a redelivery
            job_event(log, "stage_skipped", job_id, track=track, queue=record["queue"], worker=worker,
                      stage=self.stage.name, reason="already done" + (
                          f" with track {done['with_track']}" if "with_track" in done else ""))
            return ref
        owner = f"{worker}|{self.request.id}|{os.getpid()}"
        if not svc.jobs.take_lease(job_id, track, owner, self.request.id, svc.settings.lease_s):
            job_event(log, "stale_delivery", job_id, track=track, worker=worker, level=logging.WARNING,
                      stage=self.stage.name, task_id=self.request.id, reason="the track moved or ended")
            raise Ignore()
        job = svc.jobs.job(job_id)
        svc.jobs.mark_started(job_id, track, record["queue"])
        stages = record["stages"]
        stages[self.stage.name] = {"started_at": time.time(), "worker": worker, "attempt": record["attempts"]}
        svc.jobs.update(job_id, track, state=self.stage.state, stage=self.stage.name, running="1",
                        worker=worker, progress=0.0, detail="starting", stages=stages)
        svc.workers.set_current(worker, job_id, track, self.stage.name)
        job_event(log, "stage_started", job_id, track=track, queue=record["queue"], worker=worker,
                  stage=self.stage.name, attempt=record["attempts"])
        started = time.monotonic()
        workdir = Path(tempfile.mkdtemp(prefix=f"encore-{job_id[:8]}-{self.stage.name}-"))
        succeeded = False
        watch = CancelWatch(svc, job_id, track, svc.settings.cancel_grace_s, [], lease_owner=owner)
        try:
            with watch:
                control = StageControl(report=_Throttled(svc, job_id, track),
                                       cancel_requested=watch.canceled.is_set)
                run = StageRun(svc, job_id, track, self.stage, job["params"], record["params"], workdir, control,
                               kind=self.kind, queue=record["queue"], worker=worker, adopted=watch.adopted,
                               lease_owner=owner)
                self._work(run)
            succeeded = True
        except Canceled:
            if watch.lost.is_set():  # taken from this stage: the track is someone else's now
                drop_scratch(svc, job_id, track)
                raise Ignore()
            end_track(svc, job_id, track, CANCELED, detail=f"canceled during {self.stage.name}")
            job_event(log, "canceled", job_id, track=track, queue=record["queue"], worker=worker, stage=self.stage.name)
            raise Ignore()
        except SoftTimeLimitExceeded:
            soft, _ = svc.settings.time_limits.get(self.stage.name, (None, 0))
            self._fail(svc, job_id, track, worker, f"timed out: {self.stage.name} ran past its {soft:g} s limit")
            raise
        except Exception as exc:
            self._fail(svc, job_id, track, worker, f"{self.stage.name} failed: {exc}")
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            svc.workers.clear_current(worker)
            release_memory(collect=not succeeded)
            svc.workers.update(worker, **device_report())
            if not succeeded:  # the track ended (failed, canceled) or is no longer this stage's
                svc.jobs.release_lease(job_id, track, owner)
        self._finish(svc, run, stages, time.monotonic() - started, worker)
        svc.jobs.release_lease(job_id, track, owner)  # after the record says it is no longer running
        return ref

    def _work(self, run: StageRun) -> None:
        type(self).work(run)

    def _check_can_start(self, svc: Services, job_id: str, track: int, worker: str) -> None:
        record = svc.jobs.track(job_id, track)
        if record is None or record["state"] in TERMINAL_STATES:
            drop_scratch(svc, job_id, track)
            raise Ignore()
        if self.request.id not in record["task_ids"]:
            job_event(log, "stale_delivery", job_id, track=track, worker=worker, level=logging.WARNING,
                      stage=self.stage.name, task_id=self.request.id)
            raise Ignore()  # the track was moved to another queue; this message belongs to its old chain
        if svc.jobs.cancel_requested(job_id):
            end_track(svc, job_id, track, CANCELED, detail=f"canceled before {self.stage.name}")
            raise Ignore()
        deliveries = svc.jobs.count_delivery(self.request.id)
        svc.jobs.update(job_id, track, attempts=deliveries)
        if deliveries > svc.settings.max_deliveries:
            self._fail(svc, job_id, track, worker,
                       f"{self.stage.name} was interrupted {deliveries - 1} times (worker crashed or was "
                       f"killed); giving up")
            raise Ignore()

    def _finish(self, svc: Services, run: StageRun, stages: dict, seconds: float, worker: str) -> None:
        stages[self.stage.name].update(finished_at=time.time(), duration_s=round(seconds, 3), loaded=run.loaded,
                                       **({"info": run.info} if run.info else {}))
        following = self.kind.next_stage(self.stage.name)
        if following is None:
            end_track(svc, run.job_id, run.track, DONE, stages=stages, progress=1.0, detail="done", running="0")
            job_event(log, "track_done", run.job_id, track=run.track, queue=self._queue(svc, run.job_id, run.track),
                      worker=worker)
        else:
            wait_for_stage(svc, run.job_id, run.track, following, stages)
        observe_stage(svc, self.kind.name, self.stage.name, seconds)
        job_event(log, "stage_finished", run.job_id, track=run.track, queue=self._queue(svc, run.job_id, run.track),
                  worker=worker, stage=self.stage.name, duration_s=f"{seconds:.3f}",
                  loaded=",".join(run.loaded) or "-")

    def _fail(self, svc: Services, job_id: str, track: int, worker: str, message: str) -> None:
        drop_scratch(svc, job_id, track)  # first, as end_track does
        svc.jobs.fail(job_id, track, message)
        job_event(log, "failed", job_id, track=track, queue=self._queue(svc, job_id, track), worker=worker,
                  level=logging.ERROR, stage=self.stage.name, error=repr(message))

    @staticmethod
    def _queue(svc: Services, job_id: str, track: int) -> str:
        record = svc.jobs.track(job_id, track)
        return record["queue"] if record else ""

    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        """Also runs in the worker's master when a hard time limit killed the child."""
        if isinstance(exc, TimeLimitExceeded) and args:
            svc = services()
            _, hard = svc.settings.time_limits.get(self.stage.name, (None, 0))
            job_id, track, worker = args[0]["job_id"], int(args[0]["track"]), self.request.hostname or "unknown"
            self._fail(svc, job_id, track, worker,
                       f"timed out: {self.stage.name} exceeded its hard time limit of {hard:g} s")
            release_adopted(svc, job_id, adopted_by_killed_run(svc, job_id, track, worker, self.stage),
                            self.stage.name)


def stage_task(kind: JobKind, stage_name: str, work: Callable[[StageRun], None]) -> StageTask:
    """Register the Celery task for one stage of `kind`, with that stage's time limits."""
    stage = kind.stage(stage_name)
    soft, hard = services().settings.time_limits.get(stage_name, (None, 3600.0))
    base = type(f"{kind.name.title()}{stage_name.title()}Task", (StageTask,),
                {"kind": kind, "stage": stage, "work": staticmethod(work)})

    def run(self: StageTask, ref: dict[str, Any]) -> dict[str, Any]:
        return self.run_stage(ref)

    run.__doc__ = f"{kind.name} stage {stage_name!r}: see app/tasks/stage.py."
    return celery.task(run, name=stage.task, base=base, bind=True, time_limit=hard, soft_time_limit=soft,
                       acks_late=True, reject_on_worker_lost=True)
