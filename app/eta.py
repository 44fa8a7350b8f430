"""Time in seconds: what each queue has learned about its speed, and the estimates built from it.

A track's `cost` is its size in the unit its work grows with: song seconds for music, audio seconds for
lip-sync. Every stage that finishes teaches its queue (one GPU card) how many wall seconds that stage takes per
cost unit: an exponentially weighted mean per (queue, kind, stage) with weight ENCORE_ETA_ALPHA, kept in the
`{p}:throughput` hash, so a slow card is known to be slow. A batched stage (one pass for several tracks of a
song) is learned per track served, so the sum of the tracks' estimates is the batch's time. The same mean is
what /metrics shows as `encore_stage_seconds_per_unit` (app/metrics.py): there is one average.

The work outstanding on each queue is not counted per read: the transitions keep it in the backlog index
(app/backlog.py), cost units per class ("every stage of kind from index on") and per group (running, waiting,
queued by priority), with the sums ahead of each track. One round trip reads the rates, those sums and the
few running tracks, and from them come:
- a track's finish: the seconds of every track the worker takes before it and of itself, the queue's order
  being running and started tracks first, then queued ones by priority, each group in submission order;
- a running track's remaining seconds: its stage's estimate less what already ran (or, past the estimate,
  what its progress leaves of it), plus its later stages. Only a queue's first running tracks, two batches'
  worth (running_heads), are read for their elapsed time: a worker runs one batch at a time, so any further
  one (left by a dead worker until the reaper restarts it) counts its whole stage;
- a job's `eta_s` (its last track's finish) and the seconds a queue has outstanding, which routing compares
  instead of song seconds.
A stage no queue has learned yet counts its share of the cost (so with nothing learned a track's estimate is
its cost, the old load); a queue that has not learned a stage another queue has borrows the fleet's mean.
Reads cost the same whatever the number of jobs (the job's own tracks, a Fenwick lookup each: O(log seq)).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from app.backlog import GROUP_ORDER, BacklogRead, Entry, Position, parse
from app.kinds import KINDS
from app.lifecycle import TERMINAL, member
from app.services import Services

HEADS_PER_BATCH = 2  # running tracks per queue whose elapsed time is read, per track of a batch (two batches)

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
    return parse_rates(svc.redis.hgetall(svc.jobs.keys.throughput))


def parse_rates(raw: dict[str, str] | list[str]) -> dict[tuple[str, str, str], float]:
    """The throughput hash's rates ({queue|kind|stage: value}; its "|n" and "|cold" fields left out)."""
    if isinstance(raw, list):  # HGETALL inside Lua: a flat list
        raw = dict(zip(raw[0::2], raw[1::2]))
    rates = {}
    for name, value in raw.items():
        parts = name.split("|")
        if len(parts) == 3:
            rates[(parts[0], parts[1], parts[2])] = float(value)
    return rates


def running_heads(svc: Services) -> int:
    """How many running tracks per queue (the first by seq) an estimate reads for their elapsed time: a worker
    runs one batch at a time (ENCORE_BATCH_TRACKS); room for two, should two workers share a queue."""
    return HEADS_PER_BATCH * max(1, svc.settings.batch_tracks)


@dataclass
class Estimator:
    """Seconds estimates over one consistent read of the rates and the queues' backlog index."""

    rates: dict[tuple[str, str, str], float]
    backlog: BacklogRead
    now: float = field(default_factory=time.time)
    _from: dict[tuple[str, str, int], float] = field(default_factory=dict)
    _unit: dict[tuple[str, str, str], float] = field(default_factory=dict)
    _heads: dict[str, list[tuple[int, str, float]]] = field(default_factory=dict)

    @classmethod
    def from_read(cls, read: BacklogRead) -> "Estimator":
        return cls(parse_rates(read.rates), read)

    def per_unit(self, queue: str, kind: str, stage: str) -> float:
        """Seconds per cost unit of `stage` on `queue`: learned there, else the fleet's mean, else its share."""
        key = (queue, kind, stage)
        if key not in self._unit:
            own = self.rates.get(key)
            fleet = [rate for (_, k, s), rate in self.rates.items() if k == kind and s == stage] if own is None else []
            self._unit[key] = own if own is not None else \
                sum(fleet) / len(fleet) if fleet else 1.0 / len(KINDS[kind].stages)
        return self._unit[key]

    def stage_seconds(self, queue: str, kind: str, stage: str, cost: float) -> float:
        return self.per_unit(queue, kind, stage) * cost

    def new_track_seconds(self, queue: str, kind: str, cost: float) -> float:
        """What a new track of `kind` and `cost` would take on `queue`, all stages."""
        return self.seconds_from(queue, kind, 0) * cost

    def seconds_from(self, queue: str, kind: str, index: int) -> float:
        """Seconds per cost unit of every stage of `kind` from `index` on, on `queue`."""
        key = (queue, kind, index)
        if key not in self._from:
            self._from[key] = sum(self.per_unit(queue, kind, stage.name) for stage in KINDS[kind].stages[index:])
        return self._from[key]

    def units_seconds(self, queue: str, units: dict[str, int]) -> float:
        """The seconds of `units` ({class "kind:index": thousandths of a cost unit}) on `queue`."""
        total = 0.0
        for cls, milli in units.items():
            kind, _, index = cls.rpartition(":")
            if kind in KINDS and milli:
                total += self.seconds_from(queue, kind, int(index)) * milli / 1000
        return total

    def correction(self, queue: str, entry: Entry) -> float:
        """What a running track's elapsed time (or progress) takes off the whole estimate of its stage (<= 0)."""
        kind, _, index = entry.cls.rpartition(":")
        if entry.group != "r" or kind not in KINDS:
            return 0.0
        estimate = self.stage_seconds(queue, kind, KINDS[kind].stages[int(index)].name, entry.milli / 1000)
        return self._still_running(estimate, entry) - estimate

    def _still_running(self, estimate: float, entry: Entry) -> float:
        """What the running stage has left: its estimate less the time it ran, or, when it overran, what its
        progress leaves of the estimate."""
        elapsed = max(0.0, self.now - entry.started_at) if entry.started_at else 0.0
        progress = min(max(entry.progress, 0.0), 1.0)
        return max(estimate - elapsed, estimate * (1.0 - progress))

    def head_corrections(self, queue: str) -> list[tuple[int, str, float]]:
        """(seq, member, correction) of the queue's first running tracks, the ones read for their elapsed time."""
        if queue not in self._heads:
            held = self.backlog.queues.get(queue)
            self._heads[queue] = [(row.entry.seq, row.member, self.correction(queue, row.entry))
                                  for row in held.running] \
                if held else []
        return self._heads[queue]

    def queue_seconds(self, queue: str) -> float:
        """The seconds of work outstanding on `queue` (what routing compares)."""
        held = self.backlog.queues.get(queue)
        if held is None:
            return 0.0
        units: dict[str, int] = {}
        for (_, cls), milli in held.sums.items():
            units[cls] = units.get(cls, 0) + milli
        total = self.units_seconds(queue, units) + sum(c for _, _, c in self.head_corrections(queue))
        return max(total, 0.0)

    def finish(self, queue: str, member: str, place: Position) -> float:
        """Seconds until the track `member` at `place` on `queue` is done: every track the worker takes before
        it, and itself (a running one's own elapsed time counts even when it is not among the queue's heads)."""
        held = self.backlog.queues.get(queue)
        entry = place.entry
        rank = GROUP_ORDER.get(entry.group, len(GROUP_ORDER))
        units = dict(place.ahead)
        for (group, cls), milli in (held.sums if held else {}).items():
            if GROUP_ORDER.get(group, len(GROUP_ORDER)) < rank:
                units[cls] = units.get(cls, 0) + milli
        heads = self.head_corrections(queue)
        if entry.group == "r":  # the running tracks up to it, itself among them
            corrections = sum(c for seq, _, c in heads if seq <= entry.seq)
            if all(head != member for _, head, _ in heads):
                corrections += self.correction(queue, entry)
        else:
            corrections = sum(c for _, _, c in heads)
        return max(self.units_seconds(queue, units) + corrections, 0.0)

    def job_eta(self, job_id: str) -> float | None:
        """Seconds until the job's last open track is done; 0 when it ended; None while a track is on no queue
        (no live worker) or not in its queue's backlog."""
        times = []
        for track in self.backlog.jobs.get(job_id, []):
            if not track.status or track.status in TERMINAL:
                continue
            if not track.queue or track.position is None:
                return None
            times.append(self.finish(track.queue, member(job_id, track.track), track.position))
        return round(max(times), 1) if times else 0.0

    def schedule(self, queue: str) -> dict[str, float]:
        """{member: seconds until that track is done} for every track on `queue`, in the worker's order (reads
        every entry: only for an estimator made with `entries=True`; the admission caps bound how many)."""
        held = self.backlog.queues.get(queue)
        if held is None or held.entries is None:
            return {}
        corrections = {head: c for _, head, c in self.head_corrections(queue)}
        finish, clock = {}, 0.0
        for value, entry in sorted(held.entries.items(), key=lambda item: item[1].rank):
            kind, _, index = entry.cls.rpartition(":")
            own = self.seconds_from(queue, kind, int(index)) * entry.milli / 1000 if kind in KINDS else 0.0
            clock += max(own + corrections.get(value, 0.0), 0.0)
            finish[value] = clock
        return finish


def estimator(svc: Services, queues: Iterable[str], entries: bool = False) -> Estimator:
    """An Estimator over the learned rates and the backlog of `queues` (one round trip; with `entries`, every
    track's place too, for `schedule`)."""
    names = sorted({q for q in queues if q})
    return Estimator.from_read(svc.jobs.backlog.read(names, heads=running_heads(svc), entries=entries))


def job_etas(svc: Services, records: list[dict[str, Any]]) -> list[float | None]:
    """Each job's `eta_s` (see Estimator.job_eta), from one read of the backlog (none when no track is open on
    a queue)."""
    def on_queue(record: dict[str, Any]) -> bool:
        return any(t["queue"] and t["status"] not in TERMINAL for t in record["tracks"])
    ids = [record["job_id"] for record in records if on_queue(record)]
    estimate = Estimator.from_read(svc.jobs.backlog.read(job_ids=ids, heads=running_heads(svc))) if ids else None
    return [estimate.job_eta(record["job_id"]) if estimate is not None and on_queue(record)
            else 0.0 if all(t["status"] in TERMINAL for t in record["tracks"]) else None for record in records]


def record_with_eta(svc: Services, job_id: str) -> tuple[dict[str, Any] | None, float | None]:
    """A job's record (app/jobs.JobStore.record) and its `eta_s`, in one round trip: what a poll costs."""
    record, raw = svc.jobs.record_with_backlog(job_id, running_heads(svc))
    if record is None or raw is None:
        return record, None
    return record, Estimator.from_read(parse(raw)).job_eta(job_id)


def queue_seconds(svc: Services, queues: list[str]) -> dict[str, float]:
    """Seconds of outstanding work per queue."""
    estimate = estimator(svc, queues)
    return {queue: round(estimate.queue_seconds(queue), 3) for queue in queues}
