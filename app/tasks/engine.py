"""The scheduler half of a GPU worker's in-flight backbone engine (issue 35): tracks of any jobs waiting on the
worker's queue join a running SlotDecoder at each block boundary, leave it alone when they finish, are canceled
or fail, and a finished track goes on through its next stages at once.

One backbone delivery starts the engine and runs it in the worker child while there is work (its own track is
just the first to join; the runner is app/pipeline/music/inflight.py). Between two blocks it:
  1. drops the tracks whose job was canceled (their slot is free for the next block) or whose lease was taken;
  2. lets each track that finished its backbone in the last block go on at once: its superres, decode and
     export run here, one track after the other, before the next block (a finished track's stages are a small
     share of a song's GPU time, about 13 % on an H200 at Khala sizes, and running them first finishes songs
     soonest; docs/performance.md);
  3. admits waiting backbone tracks into the free slots, in the admission order below;
and ends when no track is left. Each track's stages are recorded in its own record, under the run's lease, with
its own progress; its tenant is charged its share of each block (a block's time over the tracks in it), and the
ETA learns how long its backbone took beside the others (the blocks it was in; app/control/backlog.py).

Admission order: the queue's waiting tracks in their queue order, which is the fair order (priority, then each
track's fair tag: round robin between tenants, FIFO within one; app/core/priority.py), so a track's
`queue_position` is its place in line for a slot. The engine takes them up to the first track it cannot take
(another kind, or a music track resuming past its backbone): that one runs when the engine drains, so no other
work waits behind an engine that keeps admitting.

The engine stops admitting (and drains) when its worker is shutting down, its queue is drained, another GPU stage
waits on its queue (a lip-sync: it runs as soon as the engine's tracks are through, not after a music backlog), or
it has run for half the backbone's soft time limit (the last tracks it admitted must finish before the limit).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from app.adapters.celery_app import celery
from app.adapters.redis_conn import decoded, decoded_members
from app.control.broker import waiting_tasks
from app.control.lifecycle import Outcome, parse_member
from app.control.routing import companion, resend
from app.control.services import Services
from app.core.ids import TrackRef
from app.core.kinds import first_unfinished
from app.core.joblog import job_event
from app.pipeline.control import Canceled, StageControl
from app.pipeline.music.inflight import Block, FinishedTrack, InFlightBackbone, tokens_detail
from app.pipeline.music.stages import BackboneTrack
from app.tasks.accounting import account_stage
from app.tasks.lease_watch import CANCEL_POLL_S, CancelWatch
from app.tasks.progress import ThrottledProgress
from app.tasks.scratch import drop_scratch, stage_workdir
from app.tasks.stage import StageRun
from app.tasks.track_moves import finish_stage, release_adopted

log = logging.getLogger("encore.jobs")

ADMIT_FOR = 0.5  # of the backbone's soft time limit: how long an engine admits new tracks
BACKBONE = "backbone"

StageWork = Callable[[StageRun], None]


class PolledCancel:
    """A job's cancel flag for a stage's StageControl, read from Redis at most every CANCEL_POLL_S."""

    def __init__(self, svc: Services, job_id: str, clock: Callable[[], float] = time.monotonic):
        self.svc, self.job_id, self.clock = svc, job_id, clock
        self.checked_at: float | None = None
        self.canceled = False

    def __call__(self) -> bool:
        now = self.clock()
        if not self.canceled and (self.checked_at is None or now - self.checked_at >= CANCEL_POLL_S):
            self.checked_at, self.canceled = now, self.svc.jobs.cancel_requested(self.job_id)
        return self.canceled


@dataclass
class Held:
    """A track the engine holds, in its backbone or in one of its later stages."""

    ref: TrackRef
    job: dict[str, Any]
    record: dict[str, Any]
    stage: str = BACKBONE
    workdir: Path | None = None  # its backbone's temp folder while it is in the engine

    @property
    def cost(self) -> float:
        return float(self.record.get("cost") or 0)


class BackboneEngine:
    """One engine run in a worker child (module docstring). `follow_ups`: the stages after the backbone, in
    order, each with its work function (app/tasks/music.py's)."""

    def __init__(
        self,
        run: StageRun,
        watch: CancelWatch,
        runner: InFlightBackbone,
        follow_ups: Sequence[tuple[str, StageWork]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run, self.watch, self.runner, self.follow_ups, self.clock = run, watch, runner, follow_ups, clock
        self.svc = run.svc
        self.held: dict[TrackRef, Held] = {}
        self.progress: dict[TrackRef, ThrottledProgress] = {}
        self.started = clock()
        soft, _ = self.svc.settings.time_limits.get(BACKBONE, (None, 3600.0))
        self.admit_until = self.started + ADMIT_FOR * (soft if soft is not None else 3600.0)
        self.admitted = 0
        self.loads_recorded = 0  # how many of the run's model loads a finished backbone has recorded

    def _event(self, event: str, ref: TrackRef, level: int = logging.INFO, **fields: Any) -> None:
        """A job event of one held track, naming this engine's queue and worker."""
        job_event(
            log, event, ref.job_id, track=ref.track, queue=self.run.queue, worker=self.run.worker, level=level, **fields
        )

    # -- the loop -------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Run until no track is left; on an error, the tracks still held go back to wait (the run's own fails
        through the stage's usual path)."""
        self.watch.per_track_cancels()
        own = self.run.ref
        record = self.svc.jobs.track(*own)
        job = self.svc.jobs.job(own.job_id)
        if record is None or job is None:
            raise Canceled("the track's record is gone")
        self._hold(Held(own, job, record))
        try:
            self._join(self.held[own])
            while True:  # until a boundary leaves no track in the engine (it admits before it looks)
                self._boundary()
                if not self.runner.keys:
                    break
                self._after_block(self.runner.step())
        except BaseException:
            self._give_back()
            raise
        finally:
            self.runner.close()
        self.run.info.update(engine_slots=self.runner.slots, engine_tracks=self.admitted)
        self.run.handed_on = True

    def _boundary(self) -> None:
        self.watch.raise_if_broken()
        if self.watch.lost.is_set():  # every lease unrenewed past its length: nothing here is ours any more
            raise Canceled("leases lost")
        self._drop_lost()
        self._drop_canceled()
        if self.runner.free and self._admitting():
            self._admit_waiting()

    def _admitting(self) -> bool:
        if self.clock() >= self.admit_until:
            return False
        pipe = self.svc.redis.pipeline(transaction=False)
        pipe.hget(self.svc.workers.keys.worker(self.run.worker), "stopping")
        pipe.sismember(self.svc.jobs.keys.draining, self.run.queue)
        stopping, draining = pipe.execute()
        return not stopping and not draining and not self._other_gpu_work_waits()

    def _other_gpu_work_waits(self) -> bool:
        """A started track's GPU stage that the engine does not run (a lip-sync, a music track's superres resumed
        elsewhere) waits on this queue: the engine drains so that it runs next, instead of waiting behind an
        engine that keeps admitting. Backbone messages are the engine's own business (it takes those tracks from
        the waiting set; their messages are dropped as stale)."""
        options = dict(celery.conf.broker_transport_options or {})
        backbone = self.run.kind.stage(BACKBONE).task
        return any(name and name != backbone for name in waiting_tasks(self.svc, self.run.queue, options))

    # -- tracks joining -------------------------------------------------------------------------------------
    def _admit_waiting(self) -> None:
        """Take the head of the queue's waiting tracks (the fair order) into the free slots, up to the first track
        the engine cannot take."""
        svc = self.svc
        head = decoded_members(svc.redis.zrange(svc.jobs.waiting_key(self.run.queue), 0, self.runner.free - 1))
        refs = [TrackRef(*parse_member(value)) for value in head]
        pipe = svc.redis.pipeline(transaction=False)
        for ref in refs:
            pipe.hget(svc.jobs.keys.job(ref.job_id), "kind")
            pipe.hget(svc.jobs.keys.track(ref.job_id, ref.track), "stages")
        answers = pipe.execute()
        for index, ref in enumerate(refs):
            kind, stages = answers[2 * index], answers[2 * index + 1]
            # the adopt transition's own rule (queued@first): the track's first unfinished stage is the backbone
            if decoded(kind) != self.run.kind.name or first_unfinished(self.run.kind, json.loads(stages or "{}")):
                break  # the engine cannot take it: it runs when the engine drains, and so does all behind it
            self._adopt(ref)

    def _adopt(self, ref: TrackRef) -> None:
        if not self._take(ref, BACKBONE, "backbone in the engine"):
            return  # taken meanwhile (another GPU's rebalance, its own message), or canceled
        record, job = self.svc.jobs.track(*ref), self.svc.jobs.job(ref.job_id)
        if record is None or job is None:
            return
        held = Held(ref, job, record)
        self._hold(held)
        self._record_start(held, BACKBONE)
        self._join(held)

    def _take(self, ref: TrackRef, stage: str, detail: str) -> Outcome:
        """The `adopt` transition: the track, waiting on this queue for `stage`, runs it under this run's lease."""
        run = self.run
        return self.svc.jobs.transition(
            "adopt",
            ref.job_id,
            ref.track,
            {"detail": detail, "progress": 0.0},
            stage=stage,
            queue_is=run.queue,
            owner=run.lease_owner,
            worker=run.worker,
            lease_ms=int(self.svc.settings.lease_s * 1000),
        )

    def _join(self, held: Held) -> None:
        """Prefill the track into a free slot; a track whose prompt cannot run fails alone."""
        ref = held.ref
        held.workdir = stage_workdir(self.svc, ref.job_id, ref.track, BACKBONE)
        out = held.workdir / f"track{ref.track}.coarse.pt"
        try:
            self.runner.admit(ref, BackboneTrack(held.job["params"], int(held.record["params"]["seed"]), out))
        except (ValueError, KeyError) as exc:
            self._end(held, "fail", f"backbone failed: {exc}")
            return
        self.admitted += 1
        self._event("engine_joined", ref, tracks=len(self.runner.keys))

    def _hold(self, held: Held) -> None:
        self.held[held.ref] = held
        self.progress[held.ref] = ThrottledProgress(self.svc, held.ref.job_id, held.ref.track, self.run.lease_owner)
        if held.ref not in self.run.adopted:
            self.run.adopted.append(held.ref)  # the lease thread renews it from now on

    def _let_go(self, ref: TrackRef) -> None:
        held = self.held.pop(ref, None)
        self.progress.pop(ref, None)
        if ref in self.run.adopted:
            self.run.adopted.remove(ref)
        self.watch.lost_refs.discard(ref)
        if ref in self.runner:
            self.runner.drop(ref)
        if held is not None and held.workdir is not None:
            shutil.rmtree(held.workdir, ignore_errors=True)

    # -- tracks leaving -------------------------------------------------------------------------------------
    def _drop_lost(self) -> None:
        """Tracks whose lease renewal failed: dropped unless the lease is ours after all (the renewal fell
        between a stage's finish and the next stage's adopt)."""
        for ref in list(self.watch.lost_refs):
            if self.svc.jobs.lease(*ref) == self.run.lease_owner:
                self.watch.lost_refs.discard(ref)
            elif ref in self.held:
                self._event("engine_lost", ref, logging.WARNING)
                self._let_go(ref)

    def _drop_canceled(self) -> None:
        jobs = sorted({ref.job_id for ref in self.held})
        pipe = self.svc.redis.pipeline(transaction=False)
        for job_id in jobs:
            pipe.exists(self.svc.jobs.keys.cancel(job_id))
        canceled = {job_id for job_id, flag in zip(jobs, pipe.execute(), strict=True) if flag}
        for ref, held in list(self.held.items()):
            if ref.job_id in canceled:
                self._end(held, "cancel", f"canceled during {held.stage}")

    def _end(self, held: Held, how: str, message: str) -> None:
        """The track ends here (canceled or failed) and leaves the engine; the others go on."""
        ref, owner = held.ref, self.run.lease_owner
        self._let_go(ref)
        drop_scratch(self.svc, ref.job_id, ref.track)
        if how == "cancel":
            self.svc.jobs.cancel(ref.job_id, ref.track, message, owner=owner)
            self._event("canceled", ref, stage=held.stage)
        else:
            self.svc.jobs.fail(ref.job_id, ref.track, message, owner=owner)
            self._event("failed", ref, logging.ERROR, stage=held.stage)

    def _give_back(self) -> None:
        """After an error of the engine itself: every track still held (but the run's own, which the stage fails)
        waits again for its message, at the stage it was in (the reaper sends one where none is left)."""
        for ref, held in list(self.held.items()):
            if ref != self.run.ref:
                release_adopted(self.svc, [ref], held.stage, self.run.lease_owner)
            self._let_go(ref)

    # -- after a block ----------------------------------------------------------------------------------------
    def _after_block(self, block: Block) -> None:
        for ref, (frames, expected) in block.progress.items():
            if ref in self.progress:
                self.progress[ref](*tokens_detail(frames, expected))
        for finished in block.finished:
            held = self.held.get(finished.key)  # type: ignore[call-overload]
            if held is not None and self._finish_backbone(held, finished):
                self._go_on(held)

    def _finish_backbone(self, held: Held, finished: FinishedTrack) -> bool:
        svc, ref = self.svc, held.ref
        assert held.workdir is not None
        name = f"track{ref.track}.coarse.pt"
        svc.artifacts.put(ref.job_id, name, held.workdir / name, self.run.ttl_of(ref))
        shutil.rmtree(held.workdir, ignore_errors=True)
        held.workdir = None
        self.run.note(ref, song=finished.song)
        info = {"prompt_tokens": finished.prompt_tokens, "frames": finished.song["frames"], "in_engine": True}
        loaded = self.run.loaded[self.loads_recorded :]  # the loads made since, recorded by the first track after
        self.loads_recorded = len(self.run.loaded)
        return self._record_finish(held, BACKBONE, finished.share_s, loaded, info, took_s=finished.wall_s)

    def _go_on(self, held: Held) -> None:
        """The track's next stages, here and now (module docstring, point 2); from the first that needs no GPU on,
        on the host's CPU-stage worker while one is live."""
        for stage_name, work in self.follow_ups:
            if self.run.kind.stage(stage_name).cpu and self._hand_to_cpu_worker(held, stage_name):
                return
            if not self._run_stage(held, stage_name, work):
                return
        self._let_go(held.ref)

    def _hand_to_cpu_worker(self, held: Held, stage_name: str) -> bool:
        """Send the rest of the track's chain (from `stage_name`, which it waits for) to its queue's companion,
        its old messages left stale; False when no CPU-stage worker is live (the stage runs here)."""
        svc, run, ref = self.svc, self.run, held.ref
        if companion(svc, run.queue) is None:
            return False
        record = svc.jobs.track(*ref)
        if (
            record is None
            or record["status"] != f"waiting:{stage_name}"
            or not resend(svc, celery, *ref, record, run.queue)
        ):
            return False
        self._event("handed_to_cpu_worker", ref, stage=stage_name)
        self._let_go(ref)
        return True

    def _run_stage(self, held: Held, stage_name: str, work: StageWork) -> bool:
        """One later stage of a held track, in this child, recorded as its own stage run would record it."""
        svc, run, ref = self.svc, self.run, held.ref
        taken = self._take(ref, stage_name, f"{stage_name} after the backbone engine")
        if not taken:
            if taken.canceled:
                self._event("canceled", ref, stage=stage_name)
            self._let_go(ref)
            drop_scratch(svc, ref.job_id, ref.track)
            return False
        self.watch.lost_refs.discard(ref)  # the lease is ours again (a renewal may have met it between stages)
        held.stage = stage_name
        record = svc.jobs.track(*ref)
        if record is None:
            self._let_go(ref)
            return False
        held.record = record
        self._record_start(held, stage_name)
        stage = run.kind.stage(stage_name)
        workdir = stage_workdir(svc, ref.job_id, ref.track, stage_name)
        report = self.progress[ref] = ThrottledProgress(svc, ref.job_id, ref.track, run.lease_owner)  # a new stage's
        control = StageControl(report=report, cancel_requested=PolledCancel(svc, ref.job_id))
        part = replace(
            run,
            job_id=ref.job_id,
            track=ref.track,
            stage=stage,
            params=held.job["params"],
            track_params=record["params"],
            workdir=workdir,
            control=control,
            loaded=[],
            info={},
            adopted=[],
            handed_on=False,
        )
        started = self.clock()
        try:
            work(part)
        except Canceled:
            self._end(held, "cancel", f"canceled during {stage_name}")
            return False
        except Exception as exc:
            log.exception("job %s track %s: %s failed in the engine", ref.job_id, ref.track, stage_name)
            self._end(held, "fail", f"{stage_name} failed: {exc}")
            return False
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return self._record_finish(held, stage_name, self.clock() - started, part.loaded, part.info)

    # -- a stage's record -------------------------------------------------------------------------------------
    def _record_start(self, held: Held, stage_name: str) -> None:
        stages = held.record["stages"]
        stages[stage_name] = {"started_at": time.time(), "worker": self.run.worker, "in_engine": True}
        self.svc.jobs.report(held.ref.job_id, held.ref.track, self.run.lease_owner, stages=stages)
        self._event("stage_started", held.ref, stage=stage_name, in_engine=1)

    def _record_finish(
        self,
        held: Held,
        stage_name: str,
        seconds: float,
        loaded: list[str],
        info: dict[str, Any],
        took_s: float | None = None,
    ) -> bool:
        """Stage done for the track (the `finish` transition) and its seconds accounted (`took_s`: how long a
        backbone took beside the others, what the ETA learns); False when the track left meanwhile (canceled, or
        its lease taken)."""
        svc, run, ref = self.svc, self.run, held.ref
        stage = run.kind.stage(stage_name)
        stages = held.record["stages"]
        entry = stages.setdefault(stage_name, {"started_at": time.time(), "worker": run.worker})
        entry.update(
            finished_at=time.time(), duration_s=round(seconds, 3), loaded=loaded, **({"info": info} if info else {})
        )
        account_stage(
            svc,
            run.kind,
            stage,
            run.queue,
            seconds,
            {ref: held.cost},
            own=ref,
            cold=bool(loaded) and svc.settings.runtime_mode == "keep_loaded",
            took_s=took_s,
        )
        if not finish_stage(svc, run.kind, ref.job_id, ref.track, stage, stages, run.lease_owner):
            self._let_go(ref)
            drop_scratch(svc, ref.job_id, ref.track)
            return False
        self._event("stage_finished", ref, stage=stage_name, duration_s=f"{seconds:.3f}", in_engine=1)
        if run.kind.next_stage(stage_name) is None:
            self._event("track_done", ref)
        return True
