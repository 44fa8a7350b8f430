"""Job priorities: `high | normal | low` order the FIRST stages of jobs; a started job keeps its place.

Two orders follow from a job's priority, both by level first and submission order second:
- the broker's: a chain's first stage is sent with the level's Celery priority, every later stage with
  LATER_STAGE_PRIORITY, above every level (on Redis 0 is the highest; kombu keeps one list per step and a
  worker pops the highest non-empty one), so a started job's next stage still overtakes the first stage of
  any job, whatever its priority: FIFO across stages;
- the bookkeeping's: parked tracks (`{p}:unrouted`, dispatched in that order) and a queue's waiting tracks
  (its queue positions) are scored `rank * RANK_SPAN + seq` by the transition script (app/control/lifecycle.py).
The levels sit on kombu's default priority steps (0, 3, 6, 9), so they keep their order with those too.
"""

from __future__ import annotations

from typing import Literal

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[str, ...] = ("high", "normal", "low")
DEFAULT_PRIORITY: Priority = "normal"

LATER_STAGE_PRIORITY = 0
FIRST_STAGE_PRIORITY = {"high": 3, "normal": 6, "low": 9}
RANK = {level: index for index, level in enumerate(PRIORITIES)}
RANK_SPAN = 10**12  # more submissions than a Redis will ever count; rank * span + seq stays exact in a double


def first_stage_priority(level: str) -> int:
    """The Celery message priority of a chain's first stage for a job of `level`."""
    return FIRST_STAGE_PRIORITY.get(level, FIRST_STAGE_PRIORITY[DEFAULT_PRIORITY])
