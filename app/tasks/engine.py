"""The scheduler half of a GPU worker's in-flight backbone engine (issue 35): tracks of any jobs waiting on the
worker's queue join a running SlotDecoder at each block boundary, leave it alone when they finish, are canceled
or fail, and a finished track goes on through its next stages at once.

One backbone delivery starts the engine and runs it in the worker child while there is work (its own track is
just the first to join; the runner is app/pipeline/music/inflight.py). Between two blocks it:
  1. drops the tracks whose job was canceled (their slot is free for the next block) or whose lease was taken;
  2. puts paused tracks back into free slots, then admits waiting backbone tracks into the free slots, in the
     admission order below, so a track that waits for a slot starts in the block after one frees, whatever else
     the GPU has to do. With every slot taken, a track whose tenant holds fewer slots than its share (the slots
     over the tenants in them) takes one from the tenant that holds the most: that tenant's last admitted track
     is paused (SlotDecoder.pause: its cache and state kept aside in host memory, nothing recomputed or lost)
     and resumes before any waiting track when a slot frees. So tenant B's song starts at the next block, not
     when one of tenant A's songs in the slots ends;
  3. runs other stages here, in this child, from a list of its own: the next stage of each track that finished
     its backbone (superres, decode; export too when no CPU-stage worker is live, else the track is handed to
     it) and any other GPU stage waiting on its queue (a lip-sync, a music track resumed past its backbone),
     which would otherwise wait until the engine emptied. The list is fair between tenants in GPU-seconds (the
     tenant that has had the least in this engine first; within one, a track's next stage right after its last,
     so songs finish one by one and their exports spread out, then arrival order; TenantCharges). While tracks
     are in the slots, the slots and the list each get about half the GPU, counted in seconds (GpuShare), and a
     listed stage waits while a tenant in the slots has had less than its tenant: a newcomer's backbone runs at
     full speed beside another tenant's backlog of follow-ups, and a lip-sync waits for a block or a few;
and ends when no track is left in its slots or its list. Each track's stages are recorded in its own record,
under the run's lease, with its own progress; its tenant is charged its share of each block (a block's time over
the tracks in it), and the ETA learns how long its backbone took beside the others (the blocks it was in;
app/control/backlog.py).

Admission order: the queue's waiting tracks in their queue order, which is the fair order (priority, then each
track's fair tag: round robin between tenants, FIFO within one; app/core/priority.py), so a track's
`queue_position` is its place in line for a slot.

The engine stops admitting, and stops taking other stages from its queue (it drains), when its worker is shutting
down, its queue is drained, a waiting track is one it cannot run (a stage whose work it does not know), or it has
run for half the backbone's soft time limit (the last tracks it admitted must finish before the limit).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from app.adapters import tracing
from app.adapters.celery_app import celery
from app.adapters.tracing import TrackSpan
from app.adapters.redis_conn import decoded, decoded_members
from app.control.broker import waiting_messages
from app.control.lifecycle import Outcome, parse_member
from app.control.routing import companion, resend
from app.control.services import Services
from app.core.ids import TrackRef
from app.core.kinds import KINDS, JobKind, Stage, first_unfinished
from app.core.joblog import job_event
from app.pipeline.control import Canceled, StageControl
from app.pipeline.music.inflight import Block, FinishedTrack, InFlightBackbone, tokens_detail
from app.pipeline.music.stages import BackboneTrack
from app.tasks.accounting import account_stage
from app.tasks.lease_watch import CANCEL_POLL_S, REDIS_OUTAGES, CancelWatch
from app.tasks.progress import ThrottledProgress
from app.tasks.scratch import drop_scratch, stage_workdir
from app.tasks.stage import StageRun
from app.tasks.track_moves import finish_stage, release_adopted

log = logging.getLogger("encore.jobs")

ADMIT_FOR = 0.5  # of the backbone's soft time limit: how long an engine admits new tracks
# A listed stage held back for a tenant in the slots (TenantCharges.may_run) runs anyway after this many blocks in
# a row: a tenant's long song beside another's follow-ups slows them (to about one stage per five blocks), never
# stops them for the whole song
HOLD_BACK_BLOCKS = 4
# A block's most frames while a slot is free (else the decoder's check_every, 32): a track that arrives then joins
# within 8 frames instead of 32 (the tracks of a burst, submitted over a second or so, join nearly together and end
# nearly together: on the 2-CPU shaped bench, 66 frames of 494 were a first wave that joined over two 32-frame
# blocks and the second wave inheriting that stagger); a block's length never changes a track's codes
SHORT_BLOCK_FRAMES = 8
LOOK_PAST = 8  # waiting tracks read past the free slots' count at a boundary: those that start at another stage
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
    waiting_for: str | None = None  # the stage it waits for in the engine's list (its lease is not held meanwhile)
    tenant: str = ""  # its job's tenant (the job's hash; not in the decoded job)
    trace: dict[str, str] = field(default_factory=dict)  # the parent of its next stage's span (tracing.TrackSpan)
    span: TrackSpan | None = None  # its backbone's span while it is in the slots (not the run's own: its delivery's)

    @property
    def cost(self) -> float:
        return float(self.record.get("cost") or 0)

    @property
    def kind(self) -> JobKind:
        return KINDS[str(self.job["kind"])]


@dataclass(frozen=True)
class Pending:
    """A stage the engine runs between blocks: a held track's next stage, or a waiting track's stage (not held
    until its turn comes: the `adopt` transition takes it then)."""

    ref: TrackRef
    stage: str
    tenant: str


def work_of(kind: JobKind, stage_name: str) -> StageWork | None:
    """The work function of a stage, as its Celery task runs it (app/tasks/music.py, lipsync.py)."""
    task = celery.tasks.get(kind.stage(stage_name).task)
    return getattr(task, "work", None)


class GpuShare:
    """How the engine's GPU time goes between its slots (blocks) and its list of other stages while both have work:
    about half each, counted in seconds. `balance` is the seconds the list ran beyond its half; the list may run a
    stage while it is not positive. A block earns the list as many seconds as it took, but the list's credit never
    exceeds one block: time the slots ran alone (nothing was listed) is not owed later. A stage longer than a block
    (a lip-sync) therefore runs, then the blocks catch up before the next one: the slots never get less than about
    half, however long the listed stages are."""

    def __init__(self) -> None:
        self.balance = 0.0

    def list_may_run(self) -> bool:
        return self.balance <= 0

    def ran_list(self, seconds: float) -> None:
        self.balance += seconds

    def ran_block(self, seconds: float) -> None:
        self.balance = max(self.balance - seconds, -seconds)


class TenantCharges:
    """The GPU-seconds each tenant has had in this engine, for the order of its list and for when the list may run.
    A block is charged in equal parts to the distinct tenants with a track in the slots (it serves each of them
    whole, however many tracks each has there), a listed stage to its tenant. A tenant that appears starts at the
    least charge of the tenants present then (start-time fair queueing: no credit for the time it was away).

    A listed stage may run only while its tenant has had no more than every tenant in the slots: with one tenant
    this never holds the list back (GpuShare then splits the time), but with tenant A's follow-ups listed and
    tenant B's song in the slots beside A's, the blocks run (serving both) until B has had as much as A, so B's
    backbone runs at nearly full speed instead of half, and A's follow-ups wait: at most HOLD_BACK_BLOCKS blocks
    in a row each, so a long song of B's slows them but never stops them."""

    def __init__(self) -> None:
        self.charged: dict[str, float] = {}

    def join(self, tenants: set[str]) -> None:
        """Tenants present now (in the slots or the list): a new one starts at the least charge among them."""
        floor = min((self.charged[tenant] for tenant in tenants if tenant in self.charged), default=0.0)
        for tenant in tenants:
            self.charged.setdefault(tenant, floor)

    def charge(self, tenant: str, seconds: float) -> None:
        self.charged[tenant] = self.charged.get(tenant, 0.0) + seconds

    def charge_block(self, tenants: set[str], seconds: float) -> None:
        for tenant in tenants:
            self.charge(tenant, seconds / len(tenants))

    def of(self, tenant: str) -> float:
        return self.charged.get(tenant, 0.0)

    def may_run(self, tenant: str, in_slots: set[str]) -> bool:
        return all(self.of(tenant) <= self.of(other) for other in in_slots)


@dataclass
class EngineTally:
    """Where an engine run's time went, added up in its worker's heartbeat hash (`engine_*` fields, WorkerRegistry.
    add_up: an operator's and the bench's view of how full the slots were): runs, blocks, frames, the rows the
    model ran on over them (batched mode runs the tiles in use only), block seconds, slot-seconds of the tracks in
    them (the slots' mean fill is slot_s / (slots x block_s)), and the seconds spent
    between blocks at boundaries (admitting, prefills included) and running listed stages."""

    blocks: int = 0
    frames: int = 0
    rows: int = 0  # rows the model ran on over the frames: rows / frames is the mean reach of a frame
    block_s: float = 0.0
    slot_s: float = 0.0
    boundary_s: float = 0.0
    list_s: float = 0.0

    def amounts(self) -> dict[str, float]:
        return {f"engine_{name}": float(value) for name, value in vars(self).items()} | {"engine_runs": 1.0}


class BackboneEngine:
    """One engine run in a worker child (module docstring)."""

    def __init__(
        self,
        run: StageRun,
        watch: CancelWatch,
        runner: InFlightBackbone,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run, self.watch, self.runner, self.clock = run, watch, runner, clock
        self.svc = run.svc
        self.held: dict[TrackRef, Held] = {}
        self.progress: dict[TrackRef, ThrottledProgress] = {}
        self.pending: list[Pending] = []  # the other stages to run here, in arrival order (module docstring, 3)
        self.charges = TenantCharges()  # the list's order, and when it may run beside the slots
        self.blocks_held_back = 0  # blocks run in a row while the list had stages (see HOLD_BACK_BLOCKS)
        self.refused: set[tuple[TrackRef, str]] = set()  # listed stages whose track had moved on when taken
        self.share = GpuShare()
        self.started = clock()
        soft, _ = self.svc.settings.time_limits.get(BACKBONE, (None, 3600.0))
        self.admit_until = self.started + ADMIT_FOR * (soft if soft is not None else 3600.0)
        self.admitted = 0
        self.joined: dict[TrackRef, int] = {}  # the order tracks joined the slots in (1, 2, ...)
        self.loads_recorded = 0  # how many of the run's model loads a finished backbone has recorded
        self.tally = EngineTally()

    def _event(self, event: str, ref: TrackRef, level: int = logging.INFO, **fields: Any) -> None:
        """A job event of one held track, naming this engine's queue and worker."""
        job_event(
            log, event, ref.job_id, track=ref.track, queue=self.run.queue, worker=self.run.worker, level=level, **fields
        )

    # -- the loop -------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Run until no track is left in the slots or the list; on an error, the tracks still held go back to wait
        (the run's own fails through the stage's usual path)."""
        self.watch.per_track_cancels()
        own = self.run.ref
        record = self.svc.jobs.track(*own)
        job = self.svc.jobs.job(own.job_id)
        if record is None or job is None:
            raise Canceled("the track's record is gone")
        self._hold(Held(own, job, record, tenant=self._tenant_of(own), trace=tracing.current_carrier()))
        try:
            self._join(self.held[own])
            while True:  # until a boundary leaves nothing to do (it admits and takes stages before it looks)
                started = self.clock()
                self._boundary()
                listed = self.clock()
                self._run_pending()
                self.tally.boundary_s += listed - started
                self.tally.list_s += self.clock() - listed
                if self.runner.keys:
                    in_slots = self._slot_tenants()
                    filled = len(self.runner.keys)
                    block = self.runner.step(SHORT_BLOCK_FRAMES if self.runner.free else None)
                    self.tally.blocks += 1
                    self.tally.frames += block.frames
                    self.tally.rows += block.rows
                    self.tally.block_s += block.seconds
                    self.tally.slot_s += filled * block.seconds
                    self.share.ran_block(block.seconds)
                    self.charges.charge_block(in_slots, block.seconds)
                    self.blocks_held_back += 1 if self.pending else 0
                    self._after_block(block)
                elif not self.pending and not self.runner.paused:
                    break
        except BaseException:
            self._give_back()
            raise
        finally:
            self.runner.close()
            self._add_up_tally()
        self.run.info.update(engine_slots=self.runner.slots, engine_tracks=self.admitted)
        self.run.handed_on = True

    def _add_up_tally(self) -> None:
        """The run's tally into its worker's hash: a view for operators, so an outage then costs the view only,
        never the run's outcome (its tracks are already handed on or given back)."""
        try:
            self.svc.workers.add_up(self.run.worker, self.tally.amounts(), engine_slots=self.runner.slots)
        except REDIS_OUTAGES as exc:
            log.warning("engine tally not recorded: %s", exc)

    def _boundary(self) -> None:
        self.watch.raise_if_broken()
        if self.watch.lost.is_set():  # every lease unrenewed past its length: nothing here is ours any more
            raise Canceled("leases lost")
        self._drop_lost()
        self._drop_canceled()
        self._resume_paused()  # admitting or not: they are running tracks
        if self._admitting():
            self._take_waiting()

    def _admitting(self) -> bool:
        if self.clock() >= self.admit_until:
            return False
        pipe = self.svc.redis.pipeline(transaction=False)
        pipe.hget(self.svc.workers.keys.worker(self.run.worker), "stopping")
        pipe.sismember(self.svc.jobs.keys.draining, self.run.queue)
        stopping, draining = pipe.execute()
        return not stopping and not draining

    # -- tracks joining -------------------------------------------------------------------------------------
    def _take_waiting(self) -> None:
        """Waiting backbone tracks into the free slots (the queue's fair order), and the stages waiting on the
        queue that this child can run onto the engine's list (a CPU stage only while the host has no CPU-stage
        worker live: it takes them)."""
        cpu_worker_live = companion(self.svc, self.run.queue) is not None
        options = dict(celery.conf.broker_transport_options or {})
        for message in waiting_messages(self.svc, self.run.queue, options):  # later stages of started tracks
            task = celery.tasks.get(message.task)
            kind, stage = getattr(task, "kind", None), getattr(task, "stage", None)
            if isinstance(kind, JobKind) and isinstance(stage, Stage) and stage.name != BACKBONE:
                if not (stage.cpu and cpu_worker_live):
                    self._list_waiting(TrackRef(message.job_id, message.track), kind, stage.name)
        self._admit_waiting(cpu_worker_live)

    def _admit_waiting(self, cpu_worker_live: bool) -> None:
        """Take the head of the queue's waiting tracks (the fair order): backbone tracks into the free slots (or
        into one made free for a tenant short of its share: `_make_room`), a track that starts at another stage
        onto the list, up to the first track the engine cannot run."""
        svc = self.svc
        head = decoded_members(svc.redis.zrange(svc.jobs.waiting_key(self.run.queue), 0, self.runner.free + LOOK_PAST))
        refs = [TrackRef(*parse_member(value)) for value in head]
        pipe = svc.redis.pipeline(transaction=False)
        for ref in refs:
            pipe.hmget(svc.jobs.keys.job(ref.job_id), ["kind", "tenant"])
            pipe.hget(svc.jobs.keys.track(ref.job_id, ref.track), "stages")
        answers = pipe.execute()
        for index, ref in enumerate(refs):
            kind_name, tenant = (decoded(value) or "" for value in answers[2 * index])
            kind = KINDS.get(kind_name)
            if kind is None:
                break  # gone meanwhile, or a kind this worker does not know: it waits for its own message
            # the adopt transition's own rule (queued@first): a queued track runs its first unfinished stage
            stage = kind.stages[first_unfinished(kind, json.loads(answers[2 * index + 1] or "{}"))]
            if kind is self.run.kind and stage.name == BACKBONE:
                if self.runner.free or self._make_room(ref, tenant):
                    self._adopt(ref, tenant)
            elif stage.cpu and cpu_worker_live:
                continue  # the host's CPU-stage worker takes it
            elif not self._list_waiting(ref, kind, stage.name):
                break  # one the engine cannot run: it runs when the engine drains, and so does all behind it

    def _make_room(self, ref: TrackRef, tenant: str) -> bool:
        """With every slot taken: when the waiting track's tenant holds fewer slots than its share (the slots over
        the tenants in them, it included; at least one) and another tenant holds more than its share (and more
        than one), pause that tenant's last admitted track (its state kept aside, nothing lost: it resumes first
        when a slot frees) and say a slot is free. So tenant B's song starts at the next block boundary, not
        after one of tenant A's songs ends, and A's other songs go on. At most as many tracks are paused as the
        engine has slots (their KV caches wait in host memory)."""
        if len(self.runner.paused) >= self.runner.slots:
            return False
        running = [key for key in self.runner.keys if key in self.held]
        counts = Counter(self.held[key].tenant for key in running)
        share = max(1, self.runner.slots // len(set(counts) | {tenant}))
        if counts[tenant] >= share:
            return False
        most, held_slots = max(counts.items(), key=lambda item: (item[1], item[0]), default=(tenant, 0))
        if most == tenant or held_slots <= share:
            return False
        victim = max((key for key in running if self.held[key].tenant == most), key=lambda key: self.joined[key])
        self.runner.pause(victim)
        self.svc.jobs.report(
            victim.job_id,
            victim.track,
            self.run.lease_owner,
            detail="paused in the engine: its slot serves another tenant's song for now; it resumes where it left",
        )
        self._event("engine_paused", victim, for_job=ref.job_id, paused=len(self.runner.paused))
        return True

    def _resume_paused(self) -> None:
        """Paused tracks back into the free slots, in the order they left, before any waiting track joins."""
        for ref in [key for key in self.runner.paused if isinstance(key, TrackRef)]:
            if not self.runner.free:
                return
            self.runner.resume(ref)
            self._event("engine_resumed", ref, paused=len(self.runner.paused))

    def _list_waiting(self, ref: TrackRef, kind: JobKind, stage_name: str) -> bool:
        """Put a waiting track's stage on the engine's list (once); False when this child cannot run it (its work is
        unknown here)."""
        if ref in self.held or (ref, stage_name) in self.refused or any(item.ref == ref for item in self.pending):
            return True
        if work_of(kind, stage_name) is None:
            return False
        self.pending.append(Pending(ref, stage_name, self._tenant_of(ref)))
        return True

    def _tenant_of(self, ref: TrackRef) -> str:
        return decoded(self.svc.redis.hget(self.svc.jobs.keys.job(ref.job_id), "tenant")) or ""

    def _adopt(self, ref: TrackRef, tenant: str) -> None:
        if not self._take(ref, BACKBONE, "backbone in the engine"):
            return  # taken meanwhile (another GPU's rebalance, its own message), or canceled
        read = self.svc.jobs.held_track(*ref)
        if read is None:
            return
        record, job, trace = read
        held = Held(ref, job, record, tenant=tenant, trace=trace)
        self._hold(held)
        self._record_start(held, BACKBONE)
        held.span = TrackSpan(held.trace, BACKBONE, ref.job_id, ref.track)
        held.trace = held.span.carrier() or held.trace
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
        self.joined[ref] = self.admitted
        self._event("engine_joined", ref, tracks=len(self.runner.keys))

    def _hold(self, held: Held) -> None:
        self.held[held.ref] = held
        self.progress[held.ref] = ThrottledProgress(self.svc, held.ref.job_id, held.ref.track, self.run.lease_owner)
        self._renew(held.ref)

    def _renew(self, ref: TrackRef) -> None:
        """The lease thread renews the track's lease from now on."""
        if ref not in self.run.adopted:
            self.run.adopted.append(ref)

    def _stop_renewing(self, ref: TrackRef) -> None:
        if ref in self.run.adopted:
            self.run.adopted.remove(ref)
        self.watch.lost_refs.discard(ref)

    def _let_go(self, ref: TrackRef) -> None:
        held = self.held.pop(ref, None)
        self.progress.pop(ref, None)
        self.joined.pop(ref, None)
        if held is not None and held.span is not None:
            held.span.end()
        self._stop_renewing(ref)
        self.pending = [item for item in self.pending if item.ref != ref]
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
                how = f"before {held.waiting_for}" if held.waiting_for else f"during {held.stage}"
                self._end(held, "cancel", f"canceled {how}")

    def _end(self, held: Held, how: str, message: str) -> None:
        """The track ends here (canceled or failed) and leaves the engine; the others go on."""
        ref, owner = held.ref, self.run.lease_owner
        if held.span is not None:
            held.span.end(error=message if how == "fail" else None)
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
        waits again for its message, at the stage it was in (the reaper sends one where none is left); one on
        the list between two stages already waits for its next stage's message."""
        for ref, held in list(self.held.items()):
            if ref != self.run.ref and held.waiting_for is None:
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
                self._go_on(held, BACKBONE)

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
        if held.span is not None:
            held.span.end()
            held.span = None
        return self._record_finish(held, BACKBONE, finished.share_s, loaded, info, took_s=finished.wall_s)

    def _go_on(self, held: Held, done: str) -> None:
        """After stage `done`: the track's next stage goes on the engine's list, or, from the first that needs no
        GPU on, to the host's CPU-stage worker while one is live; a track with no stage left leaves."""
        following = held.kind.next_stage(done)
        if following is None:
            self._let_go(held.ref)
            return
        if following.cpu and self._hand_to_cpu_worker(held, following.name):
            return
        held.waiting_for = following.name
        self._stop_renewing(held.ref)  # `finish` dropped its lease; the next stage's `adopt` takes it again
        # a stage that follows one run from the list goes first in its tenant's line: a track's stages run one
        # after the other, so songs finish one by one and their exports reach the CPU-stage worker spread out, not
        # all at once after every superres; a track just out of the slots joins the line's end, behind what was
        # listed before it (a lip-sync waits for the follow-ups listed before it, not for every one after it)
        entry = Pending(held.ref, following.name, held.tenant)
        if done == BACKBONE:
            self.pending.append(entry)
        else:
            self.pending.insert(0, entry)

    def _hand_to_cpu_worker(self, held: Held, stage_name: str) -> bool:
        """Send the rest of the track's chain (from `stage_name`, which it waits for) to its queue's companion,
        its old messages left stale; False when no CPU-stage worker is live (the stage runs here)."""
        svc, run, ref = self.svc, self.run, held.ref
        if companion(svc, run.queue) is None:
            return False
        record = svc.jobs.track(*ref)
        with tracing.attached(held.trace):  # the message carries the track's own trace, not this delivery's
            if (
                record is None
                or record["status"] != f"waiting:{stage_name}"
                or not resend(svc, celery, *ref, record, run.queue)
            ):
                return False
        self._event("handed_to_cpu_worker", ref, stage=stage_name)
        self._let_go(ref)
        return True

    # -- the other stages, between blocks ---------------------------------------------------------------------
    def _run_pending(self) -> None:
        """Stages from the list (module docstring, 3): while tracks are in the slots, as GpuShare and TenantCharges
        allow; with the slots empty, all of them (and that time is owed to no one but its tenant)."""
        in_slots = self._slot_tenants()  # no track joins or leaves the slots meanwhile
        while self.pending:
            self.charges.join(in_slots | {entry.tenant for entry in self.pending})
            item = self._next_pending()
            fair = self.charges.may_run(item.tenant, in_slots) or self.blocks_held_back >= HOLD_BACK_BLOCKS
            if in_slots and not (self.share.list_may_run() and fair):
                return
            self.blocks_held_back = 0
            self.pending.remove(item)
            started = self.clock()
            self._run_one(item)
            seconds = self.clock() - started
            self.charges.charge(item.tenant, seconds)
            if in_slots:
                self.share.ran_list(seconds)

    def _next_pending(self) -> Pending:
        """The tenant that has had the least GPU time here goes first; within it, the next stage of a track whose
        last stage ran from the list, then the first to arrive."""
        return min(self.pending, key=lambda entry: self.charges.of(entry.tenant))

    def _slot_tenants(self) -> set[str]:
        return {self.held[ref].tenant for ref in self.runner.keys if ref in self.held}

    def _run_one(self, item: Pending) -> None:
        held = self.held.get(item.ref)
        if held is None:  # a waiting track's stage: taken now (it may have moved, been canceled or run meanwhile)
            held = self._take_listed(item)
            if held is None:
                return
        elif not self._take_next(held, item.stage):
            return
        work = work_of(held.kind, item.stage)
        assert work is not None  # listed only with a known work
        if self._run_stage(held, item.stage, work):
            self._go_on(held, item.stage)

    def _take_listed(self, item: Pending) -> Held | None:
        ref = item.ref
        if not self._take(ref, item.stage, f"{item.stage} beside the backbone engine"):
            self.refused.add((ref, item.stage))  # its message, still listed, is not looked at again
            return None
        read = self.svc.jobs.held_track(*ref)
        if read is None:
            return None
        record, job, trace = read
        held = Held(ref, job, record, stage=item.stage, tenant=item.tenant, trace=trace)
        self._hold(held)
        self._event("engine_took_stage", ref, stage=item.stage)
        return held

    def _take_next(self, held: Held, stage_name: str) -> bool:
        """A held track's next stage, under this run's lease again; False when it left meanwhile."""
        ref = held.ref
        taken = self._take(ref, stage_name, f"{stage_name} after the backbone engine")
        if not taken:
            if taken.canceled:
                self._event("canceled", ref, stage=stage_name)
            self._let_go(ref)
            drop_scratch(self.svc, ref.job_id, ref.track)
            return False
        held.waiting_for = None
        self._renew(ref)
        record = self.svc.jobs.track(*ref)
        if record is None:
            self._let_go(ref)
            return False
        held.record, held.stage = record, stage_name
        return True

    def _run_stage(self, held: Held, stage_name: str, work: StageWork) -> bool:
        """One stage of a held track (taken), in this child, recorded as its own stage run would record it."""
        svc, run, ref = self.svc, self.run, held.ref
        self._record_start(held, stage_name)
        stage = held.kind.stage(stage_name)
        workdir = stage_workdir(svc, ref.job_id, ref.track, stage_name)
        report = self.progress[ref] = ThrottledProgress(svc, ref.job_id, ref.track, run.lease_owner)  # a new stage's
        control = StageControl(report=report, cancel_requested=PolledCancel(svc, ref.job_id))
        part = replace(
            run,
            job_id=ref.job_id,
            track=ref.track,
            stage=stage,
            kind=held.kind,
            params=held.job["params"],
            track_params=held.record["params"],
            workdir=workdir,
            control=control,
            loaded=[],
            info={},
            adopted=[],
            handed_on=False,
        )
        span = TrackSpan(held.trace, stage_name, ref.job_id, ref.track)
        held.trace = span.carrier() or held.trace
        started = self.clock()
        try:
            with tracing.attached(held.trace):
                work(part)
        except Canceled:
            self._end(held, "cancel", f"canceled during {stage_name}")
            return False
        except Exception as exc:
            span.end(error=str(exc))
            log.exception("job %s track %s: %s failed in the engine", ref.job_id, ref.track, stage_name)
            self._end(held, "fail", f"{stage_name} failed: {exc}")
            return False
        finally:
            span.end()  # once: after a failure it ended marked as an error already
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
        svc, run, ref, kind = self.svc, self.run, held.ref, held.kind
        stage = kind.stage(stage_name)
        stages = held.record["stages"]
        entry = stages.setdefault(stage_name, {"started_at": time.time(), "worker": run.worker})
        entry.update(
            finished_at=time.time(), duration_s=round(seconds, 3), loaded=loaded, **({"info": info} if info else {})
        )
        account_stage(
            svc,
            kind,
            stage,
            run.queue,
            seconds,
            {ref: held.cost},
            own=ref,
            cold=bool(loaded) and svc.settings.runtime_mode == "keep_loaded",
            took_s=took_s,
        )
        if not finish_stage(svc, kind, ref.job_id, ref.track, stage, stages, run.lease_owner):
            self._let_go(ref)
            drop_scratch(svc, ref.job_id, ref.track)
            return False
        self._event("stage_finished", ref, stage=stage_name, duration_s=f"{seconds:.3f}", in_engine=1)
        if kind.next_stage(stage_name) is None:
            self._event("track_done", ref)
        return True
