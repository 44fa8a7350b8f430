"""The backlog index: each queue's outstanding work, kept up to date by the transitions that move tracks, and
the estimates read from it, so that an ETA or a routing decision reads a few sums instead of every open track.

What a track adds: its cost (song or audio seconds, in thousandths) in one *class*, `kind:index`, "this many
cost units still need every stage of `kind` from stage `index` on" (running:S and waiting:S from S; a queued
track from its first unfinished stage). Seconds come on read, from the queue's learned rates (app/control/eta.py), so a
rate that changes never needs the index rebuilt. Every track is in one *group*, in the order the worker takes
them: `r` running, `w` waiting for its next stage, then `q0`, `q1`, `q2`: queued, by priority rank
(app/core/priority.py); within a group by fair tag (`seq`: submission order within a tenant, round robin
between tenants; app/core/priority.py).

Per queue `q` (under the prefix `{p}`):
  {p}:queue:{q}:backlog        hash "job:track" -> "group|class|milli|seq" (a running track's also
                               "|started_at|progress"): what the track added, so that taking it out removes exactly
                               that (also after its job expired)
  {p}:queue:{q}:backlog:sums   hash "group|class" -> milli: the totals
  {p}:queue:{q}:backlog:tree   hash "group|class|node" -> milli: per group and class a Fenwick tree over seq, the
                               units ahead of a track in its own group in O(log seq)
  {p}:queue:{q}:running        zset "job:track" by seq: the running tracks (the first few are read for their
                               elapsed time: a worker runs one batch at a time)
Each field is deleted when it reaches zero, so a queue whose tracks all ended holds no backlog keys at all.

The estimates (ESTIMATE, Lua, one implementation for every read): a track's finish is the seconds of every track
the worker takes before it and of itself; a track's seconds are its stages' from its class's stage on, at the
queue's rate per cost unit (learned there, else the fleet's mean, else the stage's share of the cost); a running
track among its queue's first `heads` (by seq) counts what its own pace leaves once its progress shows one
(at least 10 %: elapsed x (1 - progress) / progress, whatever its queue learned), before that its stage's estimate
less what already ran (or, past the estimate, what its progress leaves of it); a further running one (left by a dead worker until the reaper restarts
it) counts its whole stage. A job's ETA is its last open track's finish; a queue's seconds are all of its tracks'.
A queue whose GPU worker runs an engine of S slots (`{p}:queue:{q}:slots`, eta.announce_slots) runs its engine stage (ENGINE_STAGES: the music backbone) for S tracks side by side, and
learns that stage's rate from how long a track took in it beside the others (app/tasks/engine.py): the tracks
behind a track wait 1/S of its engine stage (the queue drains S of them at a time), and the track itself waits
its own whole (`own_extra`). Without an engine S is 1 and both are the serial rule above.

The Lua lives in app/control/lua/: backlog_write.lua, the write side, is a chunk of the transition script
(app/control/lifecycle.py) and runs in the same atomic step as the move, after the state machine's tables (STAGES,
RANK, DEFAULT_RANK: lifecycle.lua_tables); estimate.lua, the estimator, a chunk of the job read (a poll's ETA in the
same round trip as its record) and of this module's script (lua/estimates.lua), after STAGES alone
(lifecycle.lua_stages). Both come after `lua_backlog()`, this module's constants, generated.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import redis

from app.control.scripts import script
from app.core.kinds import MUSIC

ENGINE_STAGES = {MUSIC.name: MUSIC.stages[0].name}  # the stage a GPU worker's engine runs for many tracks at once
FENWICK_SIZE = 2**40  # seq stays below it (a fair tag stays below RANK_SPAN, app/core/priority.FAIR_SPAN)
GROUP_ORDER = {"r": 0, "w": 1, "q0": 2, "q1": 3, "q2": 4}


def lua_backlog() -> str:
    """The backlog's constants as Lua locals (FENWICK_SIZE, GROUP_ORDER, ENGINE_STAGE), for the chunks lua/backlog_write.lua and
    lua/estimate.lua."""
    order = ", ".join(f"{group} = {rank}" for group, rank in GROUP_ORDER.items())
    engine = ", ".join(f"{kind} = '{stage}'" for kind, stage in ENGINE_STAGES.items())
    return f"local FENWICK_SIZE = {FENWICK_SIZE}\nlocal GROUP_ORDER = {{{order}}}\nlocal ENGINE_STAGE = {{{engine}}}\n"


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}  # cjson writes an empty table as {}


def _number(value: Any) -> float | None:
    return None if value is False or value is None else float(value)


class Estimates:
    """The estimate script, registered once per client (app/control/jobs.py: each JobStore makes one)."""

    def __init__(self, client: redis.Redis, prefix: str, tables: str):
        self.prefix = prefix
        self._script = script(client, "estimates", tables, lua_backlog(), libraries=("tracks", "estimate"))

    def read(
        self,
        now: float,
        heads: int,
        jobs: Sequence[str] = (),
        queues: Sequence[str] = (),
        work: tuple[str, float] | None = None,
        schedules: Sequence[str] = (),
    ) -> dict[str, Any]:
        """{"jobs": {id: ETA or None}, "queues": {q: (its seconds, a new track of `work`'s seconds there)},
        "schedules": {q: [(member, finish)...] in the worker's order}}, in one round trip."""
        what: dict[str, Any] = {"jobs": list(jobs), "queues": list(queues), "schedules": list(schedules)}
        if work is not None:
            what["kind"], what["cost"] = work[0], repr(float(work[1]))
        raw = json.loads(self._script(keys=[], args=[self.prefix, repr(now), str(heads), json.dumps(what)]))
        return {
            "jobs": {job_id: _number(v) for job_id, v in _dict(raw["jobs"]).items()},
            "queues": {q: (float(v[0]), float(v[1])) for q, v in _dict(raw["queues"]).items()},
            "schedules": {
                q: [(m, float(f)) for m, f in (v if isinstance(v, list) else [])]
                for q, v in _dict(raw["schedules"]).items()
            },
        }
