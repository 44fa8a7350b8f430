"""Time in seconds: what each queue has learned about its speed, and the estimates built from it.

A track's `cost` is its size in the unit its work grows with: song seconds for music, audio seconds for
lip-sync. Every stage that finishes teaches its queue (one GPU card) how many wall seconds that stage takes per
cost unit: an exponentially weighted mean per (queue, kind, stage), kept in the `{p}:throughput` hash, so a
slow card is known to be slow. A batched stage (one pass for several tracks of a song) is learned per track
served, so the sum of the tracks' estimates is the batch's time.

From those rates and the open tracks on each queue (one Lua round trip) come:
- a track's remaining seconds: its current stage's estimate less what already ran, plus its later stages;
- a queue's schedule: its tracks in the order the worker takes them (running and started tracks first, then
  queued ones in queue order), each with the seconds until it is done;
- a job's `eta_s` (its last track's finish on that schedule) and the seconds a queue has outstanding, which
  routing compares instead of song seconds.
A stage no queue has learned yet counts its share of the cost (so with nothing learned a track's estimate is
its cost, the old load); a queue that has not learned a stage another queue has borrows the fleet's mean.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from app.core.kinds import KINDS
from app.control.lifecycle import RUNNING, TERMINAL, WAITING, member
from app.control.services import Services

DEFAULT_ALPHA = 0.3

_LEARN = r"""
-- KEYS[1]: the throughput hash. ARGV: field, seconds per cost unit, weight of the new sample, cold (1: the
-- stage also loaded models, a one-off that only stands in until a sample without loads comes).
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
local was_cold = redis.call('HGET', KEYS[1], ARGV[1] .. '|cold') == '1'
local sample, alpha, cold = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1'
local new = sample
if old and cold then return tostring(old) end
if old and not was_cold then new = alpha * sample + (1 - alpha) * old end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.17g', new), ARGV[1] .. '|cold', cold and '1' or '0')
redis.call('HINCRBY', KEYS[1], ARGV[1] .. '|n', 1)
return tostring(new)
"""

_READ = r"""
-- ARGV: prefix, queues (comma-separated). The learned rates, and per queue its open tracks with what an
-- estimate needs: member, kind, status, order (queued: its queue position's score; else its seq), cost,
-- progress, stages (the raw JSON), in one round trip.
local P = ARGV[1]
local out = {rates = redis.call('HGETALL', P .. ':throughput'), queues = {}}
for q in string.gmatch(ARGV[2], '[^,]+') do
  local rows = {}
  for _, m in ipairs(redis.call('ZRANGE', P .. ':queue:' .. q .. ':load', 0, -1)) do
    local cut = string.find(m, ':[^:]*$')
    local job_id, track = string.sub(m, 1, cut - 1), string.sub(m, cut + 1)
    local h = redis.call('HMGET', P .. ':job:' .. job_id .. ':track:' .. track, 'status', 'seq', 'cost', 'progress',
                         'stages')
    local kind = redis.call('HGET', P .. ':job:' .. job_id, 'kind')
    if h[1] and kind then
      local order = h[2] or '0'
      if h[1] == 'queued' then order = redis.call('ZSCORE', P .. ':queue:' .. q .. ':waiting', m) or order end
      rows[#rows + 1] = {m, kind, h[1], tostring(order), h[3] or '0', h[4] or '0', h[5] or '{}'}
    end
  end
  out.queues[#out.queues + 1] = {q, rows}
end
return cjson.encode(out)
"""


def field_name(queue: str, kind: str, stage: str) -> str:
    return f"{queue}|{kind}|{stage}"


def learn(svc: Services, queue: str, kind: str, stage: str, seconds: float, cost: float, cold: bool = False,
          alpha: float | None = None) -> float | None:
    """Teach `queue` that `stage` of `kind` took `seconds` for `cost` units (of all the tracks it served);
    returns the new rate (None when the sample says nothing: no queue, no cost)."""
    if not queue or cost <= 0 or seconds < 0 or not math.isfinite(seconds):
        return None
    weight = svc.settings.eta_alpha if alpha is None else alpha
    script = svc.redis.register_script(_LEARN)
    reply = script(keys=[svc.jobs.keys.throughput], args=[field_name(queue, kind, stage), repr(seconds / cost),
                                                          repr(weight), "1" if cold else "0"])
    return float(reply)


def learned(svc: Services) -> dict[tuple[str, str, str], float]:
    """Every learned rate: {(queue, kind, stage): seconds per cost unit} (the per-stage throughput)."""
    return _parse_rates(svc.redis.hgetall(svc.jobs.keys.throughput))


def _parse_rates(raw: dict[str, str] | list[str]) -> dict[tuple[str, str, str], float]:
    if isinstance(raw, list):  # HGETALL inside Lua: a flat list
        raw = dict(zip(raw[0::2], raw[1::2]))
    rates = {}
    for name, value in raw.items():
        parts = name.split("|")
        if len(parts) == 3:
            rates[(parts[0], parts[1], parts[2])] = float(value)
    return rates


@dataclass(frozen=True)
class OpenTrack:
    """One open track on a queue, as an estimate needs it."""

    member: str
    kind: str
    status: str
    order: float
    cost: float
    progress: float
    stages: dict[str, Any]

    @property
    def rank(self) -> tuple[int, float]:
        """Where the worker takes it: the running stage, then started tracks, then queued ones in queue order."""
        group = {RUNNING: 0, WAITING: 1}.get(self.status.partition(":")[0], 2)
        return group, self.order


@dataclass
class Estimator:
    """Seconds estimates over one consistent read of the rates and the queues' open tracks."""

    rates: dict[tuple[str, str, str], float]
    queues: dict[str, list[OpenTrack]]
    now: float = field(default_factory=time.time)
    _schedules: dict[str, dict[str, float]] = field(default_factory=dict)

    def per_unit(self, queue: str, kind: str, stage: str) -> float:
        """Seconds per cost unit of `stage` on `queue`: learned there, else the fleet's mean, else its share."""
        own = self.rates.get((queue, kind, stage))
        if own is not None:
            return own
        fleet = [rate for (_, k, s), rate in self.rates.items() if k == kind and s == stage]
        return sum(fleet) / len(fleet) if fleet else 1.0 / len(KINDS[kind].stages)

    def stage_seconds(self, queue: str, kind: str, stage: str, cost: float) -> float:
        return self.per_unit(queue, kind, stage) * cost

    def new_track_seconds(self, queue: str, kind: str, cost: float) -> float:
        """What a new track of `kind` and `cost` would take on `queue`, all stages."""
        return sum(self.stage_seconds(queue, kind, stage.name, cost) for stage in KINDS[kind].stages)

    def remaining_seconds(self, queue: str, track: OpenTrack) -> float:
        """The work a track has left on `queue`: its running stage's estimate less what ran, then the rest."""
        if track.status in TERMINAL:
            return 0.0
        names = [stage.name for stage in KINDS[track.kind].stages]
        state, _, stage = track.status.partition(":")
        start = names.index(stage) if stage in names else _first_unfinished(names, track.stages)
        left = sum(self.stage_seconds(queue, track.kind, name, track.cost) for name in names[start:])
        if state == RUNNING:
            current = self.stage_seconds(queue, track.kind, stage, track.cost)
            left += self._still_running(current, track, stage) - current
        return max(left, 0.0)

    def _still_running(self, estimate: float, track: OpenTrack, stage: str) -> float:
        """What the running stage has left: its estimate less the time it ran, or, when it overran, what its
        progress leaves of the estimate."""
        began = (track.stages.get(stage) or {}).get("started_at")
        elapsed = max(0.0, self.now - float(began)) if began else 0.0
        progress = min(max(track.progress, 0.0), 1.0)
        return max(estimate - elapsed, estimate * (1.0 - progress))

    def schedule(self, queue: str) -> dict[str, float]:
        """{member: seconds until that track is done} for the queue's open tracks, in the worker's order."""
        if queue not in self._schedules:
            finish, clock = {}, 0.0
            for track in sorted(self.queues.get(queue, []), key=lambda t: t.rank):
                clock += self.remaining_seconds(queue, track)
                finish[track.member] = clock
            self._schedules[queue] = finish
        return self._schedules[queue]

    def queue_seconds(self, queue: str) -> float:
        """The seconds of work outstanding on `queue` (what routing compares)."""
        finishes = self.schedule(queue).values()
        return max(finishes) if finishes else 0.0

    def job_eta(self, record: dict[str, Any]) -> float | None:
        """Seconds until the job's last open track is done; 0 when it ended; None while a track is on no queue
        (no live worker) or not on its queue's schedule."""
        times = []
        for track in record["tracks"]:
            if track["status"] in TERMINAL:
                continue
            finish = self.schedule(track["queue"]).get(member(record["job_id"], track["track"])) \
                if track["queue"] else None
            if finish is None:
                return None
            times.append(finish)
        return round(max(times), 1) if times else 0.0


def _first_unfinished(names: list[str], stages: dict[str, Any]) -> int:
    for index, name in enumerate(names):
        if not (stages.get(name) or {}).get("finished_at"):
            return index
    return len(names) - 1


def estimator(svc: Services, queues: Iterable[str]) -> Estimator:
    """An Estimator over the learned rates and the open tracks of `queues` (one round trip)."""
    names = sorted({q for q in queues if q and "," not in q})
    raw = json.loads(svc.redis.register_script(_READ)(keys=[], args=[svc.jobs.keys.prefix, ",".join(names)]))
    by_queue: dict[str, list[OpenTrack]] = {}
    for entry in raw["queues"] if isinstance(raw["queues"], list) else []:
        queue, rows = entry[0], entry[1] if isinstance(entry[1], list) else []
        by_queue[queue] = [OpenTrack(m, kind, status, float(order), float(cost), float(progress), json.loads(stages))
                           for m, kind, status, order, cost, progress, stages in rows]
    return Estimator(_parse_rates(raw["rates"]), by_queue)


def job_etas(svc: Services, records: list[dict[str, Any]]) -> list[float | None]:
    """Each job's `eta_s` (see Estimator.job_eta), from one read of their queues (none when all have ended)."""
    queues = {t["queue"] for r in records for t in r["tracks"] if t["queue"] and t["status"] not in TERMINAL}
    if not queues:
        return [0.0 if all(t["status"] in TERMINAL for t in r["tracks"]) else None for r in records]
    estimate = estimator(svc, queues)
    return [estimate.job_eta(record) for record in records]


def queue_seconds(svc: Services, queues: list[str]) -> dict[str, float]:
    """Seconds of outstanding work per queue."""
    estimate = estimator(svc, queues)
    return {queue: round(estimate.queue_seconds(queue), 3) for queue in queues}
