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

The concerns around it live beside it: the lease thread (lease_watch.py), tracks a run serves besides its own,
of any job (adoption.py), the finish/release transitions (track_moves.py), throttled progress (progress.py) and
worker-local folders (scratch.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

from kombu.exceptions import OperationalError
from celery import Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded, TimeLimitExceeded

from app.adapters import tracing
from app.adapters.celery_app import celery
from app.core.joblog import job_event
from app.core.kinds import JobKind, Stage
from app.control.lifecycle import is_open
from app.pipeline.control import Canceled, StageControl
from app.pipeline.runtime import device_report, release_memory
from app.control.services import Services, services
from app.control.workers import pid_alive
from app.core.ids import TrackRef
from app.tasks import adoption
from app.tasks.accounting import account_stage
from app.tasks.lease_watch import CancelWatch
from app.tasks.progress import ThrottledProgress
from app.tasks.scratch import drop_scratch, stage_workdir, track_scratch
from app.tasks.track_moves import finish_stage, release_adopted

log = logging.getLogger("encore.jobs")


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
    adopted: list[TrackRef] = field(default_factory=list)  # other tracks (of any job) this run also serves
    lease_owner: str = ""  # this run's lease (taken by the `start` transition), also put on the tracks it adopts
    watch: CancelWatch | None = None  # the lease thread (the engine switches it to per-track cancels)
    handed_on: bool = False  # the work moved every track it held on itself (the engine): no finish, no chain

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

    def note(self, ref: TrackRef, **fields: Any) -> None:
        """Facts about one of this run's tracks (its own or an adopted one) for its record."""
        self.svc.jobs.report(ref.job_id, ref.track, self.lease_owner, **fields)

    # -- tracks served by this run besides its own (batching; app/tasks/adoption.py) -----------------------
    @property
    def ref(self) -> TrackRef:
        return TrackRef(self.job_id, self.track)

    def adopt_waiting(self, candidates: list[TrackRef], limit: int) -> list[TrackRef]:
        """Take over up to `limit` of `candidates` waiting on this queue for this stage, so one batched pass serves
        them all. Each one's own message, when it comes, finds the stage done and moves on; if this run fails,
        `release_adopted` puts them back to wait for their own message."""
        adopted = adoption.adopt_waiting(
            self.svc,
            candidates,
            limit=limit,
            stage=self.stage.name,
            queue=self.queue,
            owner=self.lease_owner,
            worker=self.worker,
            detail=f"{self.stage.name} together with track {self.track}",
        )
        self.adopted.extend(adopted)  # the lease thread renews what is in this list
        return adopted

    def adopt_waiting_siblings(self, limit: int) -> list[TrackRef]:
        """adopt_waiting among the other tracks of this run's job."""
        return self.adopt_waiting(adoption.job_siblings(self.svc, self.ref), limit)

    def params_of(self, ref: TrackRef) -> dict[str, Any]:
        return adoption.track_params(self.svc, ref)

    def shared_control(self, refs: list[TrackRef]) -> StageControl:
        """This run's control, whose progress also goes to the adopted tracks."""
        return adoption.shared_control(self.svc, self.control, refs, self.lease_owner)

    def finish_adopted(self, ref: TrackRef, started_at: float) -> None:
        """Record this stage done for an adopted track, as `_finish` does for the run's own track."""
        adoption.finish_adopted(
            self.svc,
            self.kind,
            self.stage,
            ref,
            started_at=started_at,
            worker=self.worker,
            owner=self.lease_owner,
            queue=self.queue,
            with_track=self.ref,
        )

    def release_adopted(self, refs: list[TrackRef]) -> None:
        """Adopted tracks go back to waiting for their own message (this run failed or was stopped)."""
        release_adopted(self.svc, refs, self.stage.name, self.lease_owner)

    def _ttl(self) -> float:
        return self.ttl_of(self.ref)

    def ttl_of(self, ref: TrackRef) -> float:
        """How long an intermediate of `ref`'s job must be kept: as long as its job's record."""
        job = self.svc.jobs.job(ref.job_id)
        return max(1.0, (job["expires_at"] if job else time.time() + self.svc.settings.job_ttl_s) - time.time())


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
        """Admit this delivery (`_admit`), run the work under its lease thread (`_run_watched`), record it done."""
        svc = services()
        job_id, track = ref["job_id"], int(ref["track"])
        worker = self.request.hostname or "unknown"
        admitted = self._admit(svc, job_id, track, worker)
        if admitted is None:  # run already (with another track, or before a redelivery): the chain goes on
            return ref
        record, job, stages, owner, deliveries = admitted
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
        run, watch = self._run_watched(svc, TrackRef(job_id, track), job, record, worker, owner)
        if run.handed_on:  # the engine finished, moved on or ended each track it held, this one included
            self.request.chain = None  # so the rest of this delivery's chain is not sent: it is stale
            return ref
        own_cost = float(record.get("cost") or 0)
        self._finish(svc, run, stages, time.monotonic() - started, worker, owner, watch, own_cost)
        return ref

    def _admit(
        self, svc: Services, job_id: str, track: int, worker: str
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], str, int] | None:
        """Start the stage (the `start` transition, taking the track's lease) when this delivery may: the track is
        open, the message is of its current chain, it was not delivered too often, no live stage holds it.
        None when the stage is done already; Ignore (after recording why) when it must not run."""
        record = svc.jobs.track(job_id, track)
        if record is None or not is_open(record["status"]):
            drop_scratch(svc, job_id, track)
            tracing.mark_stale("the track has ended" if record else "the job's record expired")
            raise Ignore()
        if self.request.id not in record["task_ids"]:  # the track moved; this message is of its old chain
            self._stale(job_id, track, worker, "not of the track's current chain")
        done = record["stages"].get(self.stage.name, {})
        if done.get("finished_at"):
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
            tracing.mark_stale("already done")
            return None
        owner = f"{worker}|{self.request.id}|{os.getpid()}"
        steal = self._killed_child_lease(svc, job_id, track, worker)
        deliveries = svc.jobs.count_delivery(self.request.id)
        # Too many deliveries of this message, or (a redelivery) too many deaths of the track in all: the reaper's
        # rule, so that restarts and redeliveries in turn stop where either alone would.
        most = svc.settings.max_deliveries
        if deliveries > most or (deliveries > 1 and int(record.get("deaths") or 0) >= most):
            drop_scratch(svc, job_id, track)
            svc.jobs.fail(job_id, track, _gave_up(self.stage.name, record), steal=steal, died=True)
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
            died=deliveries > 1,  # a redelivery: the delivery before it died (the reaper restarts in a new message)
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
        return record, job, stages, owner, deliveries

    def _run_watched(
        self, svc: Services, ref: TrackRef, job: dict[str, Any], record: dict[str, Any], worker: str, owner: str
    ) -> tuple[StageRun, CancelWatch]:
        """The work in its own workdir, under the lease thread; a cancel, a lost lease, a timeout or an error
        ends the track as it should (and raises), the workdir goes whatever happens."""
        job_id, track = ref
        workdir = stage_workdir(svc, job_id, track, self.stage.name)
        succeeded = False
        watch = CancelWatch(
            svc, job_id, track, svc.settings.cancel_grace_s, [], lease_owner=owner, stage=self.stage.name
        )
        try:
            with watch:
                control = StageControl(
                    report=ThrottledProgress(svc, job_id, track, owner), cancel_requested=watch.canceled.is_set
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
                    watch=watch,
                )
                self._work_watched(run, watch)
            succeeded = True
        except Canceled:
            drop_scratch(svc, job_id, track)
            if watch.lost.is_set():  # taken from this stage: the track is someone else's now
                raise Ignore() from None
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
        return run, watch

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
        tracing.mark_stale(reason)
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
        own_cost: float,
    ) -> None:
        """Record the stage done, and what it cost: the run's seconds are learned per cost unit over every track
        it served, and charged to each track's owner in proportion to that track's cost (tracks of several jobs
        may share a run). `own_cost`: the run's own track's, from the record admission read."""
        costs = {run.ref: own_cost, **{ref: adoption.track_cost(svc, ref) for ref in run.adopted}}
        stages[self.stage.name].update(
            finished_at=time.time(),
            duration_s=round(seconds, 3),
            loaded=run.loaded,
            **({"info": run.info} if run.info else {}),
        )
        account_stage(
            svc,
            self.kind,
            self.stage,
            run.queue,
            seconds,
            costs,
            own=run.ref,
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
            queue = (svc.jobs.track(job_id, track) or {}).get("queue") or ""
            adopted = adoption.adopted_by_killed_run(svc, queue, TrackRef(job_id, track), dead) if dead else []
            self._fail(
                svc,
                job_id,
                track,
                worker,
                f"timed out: {self.stage.name} exceeded its hard time limit of {hard:g} s",
                steal=dead,
            )
            release_adopted(svc, adopted, self.stage.name, dead)


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


def _gave_up(stage: str, record: dict[str, Any]) -> str:
    """Why a stage delivered once too often fails its track: every death of the track's stages, the one that
    brought this delivery included, whether a redelivery or the reaper noticed it (the track's `deaths`), so the
    count is the kills a client made (counted per message it missed the ones before a restart)."""
    deaths = int(record.get("deaths") or 0) + 1
    return (
        f"{stage} was interrupted {deaths} time{'s' if deaths != 1 else ''} (worker crashed or was killed); giving up"
    )
