"""A stage's progress reports, written to its track's record at a bounded rate."""

from __future__ import annotations

import time
from typing import Callable

from app.control.services import Services

PROGRESS_EVERY_S = 0.25


class ThrottledProgress:
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
