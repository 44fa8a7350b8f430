"""The transitions a stage run makes on the tracks it holds, its own and adopted ones alike: a stage finished
(the track waits for its next stage, or is done), and an adopted track handed back."""

from __future__ import annotations

from typing import Any

from app.control.services import Services
from app.core.ids import TrackRef
from app.core.kinds import JobKind, Stage
from app.tasks.scratch import drop_scratch


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


def release_adopted(svc: Services, refs: list[TrackRef], stage: str, owner: str) -> None:
    """Tracks adopted by a run that did not finish (of any job) wait again for their own message (the `release`
    transition); with a cancel pending they end now (the canceled job's messages were revoked)."""
    for ref in refs:
        svc.jobs.transition(
            "release",
            ref.job_id,
            ref.track,
            {"detail": "queued", "progress": 0.0},
            stage=stage,
            owner=owner,
            cancel_detail=f"canceled during {stage}",
        )
