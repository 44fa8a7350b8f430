"""What a finished stage run costs, recorded once for every way a stage runs (alone, batched, in the engine): the
stage-duration histogram, each owner's GPU-seconds and the queue's learned rate (the ETA and routing read it)."""

from __future__ import annotations

from app.control.eta import learn as learn_stage
from app.control.metrics import observe_stage
from app.control.services import Services
from app.control.tenant_limits import record_gpu_seconds
from app.core.ids import TrackRef
from app.core.kinds import JobKind, Stage


def account_stage(
    svc: Services,
    kind: JobKind,
    stage: Stage,
    queue: str,
    seconds: float,
    costs: dict[TrackRef, float],
    *,
    own: TrackRef,
    cold: bool,
    took_s: float | None = None,
) -> None:
    """`seconds` of `stage` served the tracks in `costs` (each with its cost: song or audio seconds): charged to
    each track's owner in proportion to its cost (all to `own` when no track has a cost), and learned per cost
    unit over all of them; `took_s`, when given, is learned instead: how long a track in the engine took beside
    the others, where `seconds` is its share of the engine (app/control/backlog.py's shared stage)."""
    units = sum(costs.values())
    observe_stage(svc, kind.name, stage.name, seconds, units)
    for ref, cost in costs.items():  # each owner's usage (app/control/tenant_limits.py)
        share = cost / units if units > 0 else (1.0 if ref == own else 0.0)
        if share > 0:
            record_gpu_seconds(svc, ref.job_id, seconds * share)
    learn_stage(svc, queue, kind.name, stage.name, seconds if took_s is None else took_s, units, cold=cold)
