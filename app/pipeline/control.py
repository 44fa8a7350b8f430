"""What a running stage gets from whoever runs it: a way to report progress and a way to learn it must stop.

Pipeline code stays free of Celery and Redis: the task layer builds a StageControl that writes progress to
the job record and checks the job's cancel flag; tests build one from plain callables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class Canceled(Exception):
    """Raised inside a stage's loop when its job was canceled."""


@dataclass
class StageControl:
    """Progress sink + cancel probe handed to every stage function.

    `report(fraction, detail)` takes progress in 0..1 and a human detail such as "1200/2584 tokens".
    `cancel_requested()` returns True once the job was canceled; `check()` turns that into `Canceled`.
    """

    report: Callable[[float, str], None] = field(default=lambda fraction, detail: None)
    cancel_requested: Callable[[], bool] = field(default=lambda: False)

    def check(self) -> None:
        if self.cancel_requested():
            raise Canceled("canceled")

    def step(self, done: int, total: int, unit: str) -> None:
        """Report `done/total unit` and stop if the job was canceled. Call once per loop iteration."""
        self.report(done / total if total else 1.0, f"{done}/{total} {unit}")
        self.check()

    def part(self, start: float, end: float, label: str) -> "StageControl":
        """A control for one phase of a stage: its progress maps to start..end of the stage's."""
        return StageControl(
            report=lambda fraction, detail: self.report(start + fraction * (end - start), f"{label}: {detail}"),
            cancel_requested=self.cancel_requested,
        )
