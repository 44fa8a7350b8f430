"""Tracks a stage run serves besides its own: it adopts waiting tracks (of any job) so one batched pass serves
them all, reports their progress, finishes or hands them back, and, after a kill, finds what the dead run held.

An adopted track's lease is the run's own owner string; its own message, when it comes, finds the stage done
(or, after a release, runs it). Nothing here assumes the tracks share a job: each is a (job, track) pair.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from app.control.lifecycle import member, parse_member
from app.control.services import Services
from app.core.ids import TrackRef
from app.core.joblog import job_event
from app.core.kinds import JobKind, Stage
from app.pipeline.control import StageControl
from app.tasks.progress import ThrottledProgress
from app.tasks.track_moves import finish_stage

log = logging.getLogger("encore.jobs")


def job_siblings(svc: Services, own: TrackRef) -> list[TrackRef]:
    """The other tracks of `own`'s job: today's candidates for adoption (a song's tracks share a prompt)."""
    job = svc.jobs.job(own.job_id)
    return [TrackRef(own.job_id, other) for other in range(job["num_tracks"] if job else 0) if other != own.track]


def adopt_waiting(
    svc: Services,
    candidates: Iterable[TrackRef],
    *,
    limit: int,
    stage: str,
    queue: str,
    owner: str,
    worker: str,
    detail: str,
) -> list[TrackRef]:
    """Take over up to `limit` of `candidates` that wait on `queue` for `stage` (the `adopt` transition: only a
    track no one runs, on that queue, at that stage, moves); the ones taken, in the order given."""
    adopted: list[TrackRef] = []
    for ref in candidates:
        if len(adopted) >= limit:
            break
        if svc.jobs.transition(
            "adopt",
            ref.job_id,
            ref.track,
            {"detail": detail, "progress": 0.0},
            stage=stage,
            queue_is=queue,
            owner=owner,
            worker=worker,
            lease_ms=int(svc.settings.lease_s * 1000),
        ):
            adopted.append(ref)
    return adopted


def shared_control(svc: Services, control: StageControl, refs: list[TrackRef], owner: str) -> StageControl:
    """`control`, whose progress also goes (throttled) to each adopted track's record."""
    if not refs:
        return control
    others = [ThrottledProgress(svc, ref.job_id, ref.track, owner) for ref in refs]

    def report(fraction: float, detail: str) -> None:
        control.report(fraction, detail)
        for other in others:
            other(fraction, detail)

    return StageControl(report=report, cancel_requested=control.cancel_requested)


def finish_adopted(
    svc: Services,
    kind: JobKind,
    stage: Stage,
    ref: TrackRef,
    *,
    started_at: float,
    worker: str,
    owner: str,
    queue: str,
    with_track: TrackRef,
) -> None:
    """Record the stage done for an adopted track, as the run does for its own."""
    record = svc.jobs.track(ref.job_id, ref.track)
    if record is None:
        return
    stages = record["stages"]
    now = time.time()
    stages[stage.name] = {
        "started_at": started_at,
        "finished_at": now,
        "duration_s": round(now - started_at, 3),
        "worker": worker,
        "loaded": [],
        "with_track": with_track.track if with_track.job_id == ref.job_id else member(*with_track),
    }
    finish_stage(svc, kind, ref.job_id, ref.track, stage, stages, owner)
    job_event(
        log,
        "stage_finished",
        ref.job_id,
        track=ref.track,
        queue=queue,
        worker=worker,
        stage=stage.name,
        with_track=member(*with_track),
    )


def adopted_by_killed_run(svc: Services, queue: str, own: TrackRef, owner: str) -> list[TrackRef]:
    """The tracks a killed run had adopted (its child took its list of them along): those running on its queue,
    of any job, whose lease is the dead run's own. Bounded by the queue's running tracks."""
    members: list[str] = svc.redis.zrange(svc.jobs.keys.running(queue), 0, -1)  # type: ignore[assignment]
    running = [TrackRef(*parse_member(value)) for value in members]
    return [ref for ref in running if ref != own and svc.jobs.lease(ref.job_id, ref.track) == owner]


def track_params(svc: Services, ref: TrackRef) -> dict[str, Any]:
    record = svc.jobs.track(ref.job_id, ref.track)
    return record["params"] if record else {}


def track_cost(svc: Services, ref: TrackRef) -> float:
    record = svc.jobs.track(ref.job_id, ref.track)
    return float(record.get("cost") or 0) if record else 0.0
