"""Job priorities: `high | normal | low` order the FIRST stages of jobs; a started job keeps its place.

Two orders follow from a job's priority, both by level first and submission order second:
- the broker's: a chain's first stage is sent with the level's Celery priority, every later stage with
  LATER_STAGE_PRIORITY, above every level (on Redis 0 is the highest; kombu keeps one list per step and a
  worker pops the highest non-empty one), so a started job's next stage still overtakes the first stage of
  any job, whatever its priority: FIFO across stages;
- the bookkeeping's: parked tracks (`{p}:unrouted`, dispatched in that order) and a queue's waiting tracks
  (its queue positions, the order a GPU worker's engine admits them in) are scored `rank * RANK_SPAN + seq` by
  the transition script (app/control/lifecycle.py), where `seq` is the track's *fair tag*.

Fair share between tenants, within a priority (start-time fair queueing by track count): a new track gets the
round `max(now, its tenant's last round + 1)`, where `now` is the round of the latest track that started; its tag
is `round * FAIR_SPAN + (submission counter mod FAIR_SPAN)`. A tenant's tracks keep their submission order (its
rounds only grow), one tenant alone is served FIFO, and a tenant arriving behind another's backlog of 80 tracks
gets the round the queue is at now: its track waits behind one track per tenant that is waiting in that round,
not behind the backlog. Rounds are counted in tracks, not GPU-seconds: a track's cost is known only roughly
before it runs, and a slot of the engine holds one track whatever its length. Ties within a round go by the
counter (wrapping every FAIR_SPAN submissions, which only reorders two tenants' tracks of the same round).
A track also keeps its submission number (`fifo`): a queue whose worker runs no engine orders by it instead, since
that worker takes first stages in the broker's FIFO (lua/backlog_write.lua's place_on; each GPU worker announces
its engine's slots for its queues at its first heartbeat, app/control/eta.announce_slots).
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
FAIR_SPAN = 4096  # tags per fair round: round * FAIR_SPAN + counter stays below RANK_SPAN for 2**27 rounds


def first_stage_priority(level: str) -> int:
    """The Celery message priority of a chain's first stage for a job of `level`."""
    return FIRST_STAGE_PRIORITY.get(level, FIRST_STAGE_PRIORITY[DEFAULT_PRIORITY])
