"""The backlog index: each queue's outstanding work, kept up to date by the transitions that move tracks, so
that an ETA or a routing decision reads a few sums instead of every open track.

What a track adds: its cost (song or audio seconds, in thousandths) in one *class*, `kind:index`, "this many
cost units still need every stage of `kind` from stage `index` on" (running:S and waiting:S from S; a queued
track from its first unfinished stage). Seconds come later, on read, from the queue's learned rates
(app/eta.py), so a rate that changes never needs the index rebuilt. Every track is in one *group*, in the order
the worker takes them: `r` running, `w` waiting for its next stage, then `q0`, `q1`, `q2`: queued, by priority
rank (app/priority.py); within a group by submission order (`seq`).

Per queue `q` (under the prefix `{p}`):
  {p}:queue:{q}:backlog                 hash "job:track" -> "group|class|milli|seq": what the track added, so
                                        that taking it out removes exactly that (also after its job expired)
  {p}:queue:{q}:backlog:sums            hash "group|class" -> milli: the totals
  {p}:queue:{q}:backlog:tree:{g}|{c}    hash: a Fenwick tree over seq of that group and class (node -> milli):
                                        the units ahead of a track in its own group, in O(log seq)
  {p}:queue:{q}:running                 zset "job:track" by seq: the running tracks, whose elapsed time the
                                        ETA reads from their hashes (the first few: a worker runs one batch)
Each field is deleted when it reaches zero, so a queue whose tracks all ended holds no backlog keys at all.

The write side (BACKLOG_WRITE) is Lua that the transition script (app/lifecycle.py) includes and runs in the
same atomic step as the move; the read side (READ_BACKLOG) answers, in one round trip, the sums, the running
heads and the position of the tracks asked for.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple, Sequence

import redis

FENWICK_SIZE = 2 ** 40  # seq stays below it (app/priority.RANK_SPAN already assumes fewer than 10**12)
GROUP_ORDER = {"r": 0, "w": 1, "q0": 2, "q1": 3, "q2": 4}

# Needs, from the script that includes it: STAGES (kind -> stage names) and RANK / DEFAULT_RANK (app/lifecycle.py).
BACKLOG_WRITE = f"local FENWICK_SIZE = {FENWICK_SIZE}\n" + r"""
-- ---- the backlog index (app/backlog.py): write side ----
local function backlog_key(P, q) return P .. ':queue:' .. q .. ':backlog' end
local function lowbit(i, from)  -- the largest power of two dividing i (at least `from`)
  local b = from or 1
  while i % (2 * b) == 0 do b = 2 * b end
  return b
end
local function hincr_or_drop(key, field, delta)
  if redis.call('HINCRBY', key, field, string.format('%.0f', delta)) == 0 then redis.call('HDEL', key, field) end
end
local function tree_add(tree, i, delta)  -- Fenwick update at index i
  local b = lowbit(i)
  while i <= FENWICK_SIZE do
    hincr_or_drop(tree, string.format('%.0f', i), delta)
    i = i + b
    b = lowbit(i, b)
  end
end
local function track_parts(m)  -- the job key and the track index of a "job:track" member
  local cut = string.find(m, ':[^:]*$')
  return string.sub(m, 1, cut - 1), string.sub(m, cut + 1)
end
-- What the ETA reads of a running track, after its entry: "|started_at|progress" (its stage's start from the
-- stages JSON, '' when it does not say).
local function running_extras(stages, stage, progress)
  local ok, decoded = pcall(cjson.decode, stages or '{}')
  local run = ok and type(decoded) == 'table' and decoded[stage]
  local began = ''
  if type(run) == 'table' and type(run.started_at) == 'number' then began = string.format('%.17g', run.started_at) end
  return '|' .. began .. '|' .. (progress or '0')
end
local function backlog_add(P, q, m, group, cls, milli, seq, extras)
  local base = backlog_key(P, q)
  redis.call('HSET', base, m, group .. '|' .. cls .. '|' .. string.format('%.0f', milli) .. '|' ..
             string.format('%.0f', seq) .. extras)
  if milli ~= 0 then
    tree_add(base .. ':tree:' .. group .. '|' .. cls, seq, milli)
    hincr_or_drop(base .. ':sums', group .. '|' .. cls, milli)
  end
  if group == 'r' then redis.call('ZADD', P .. ':queue:' .. q .. ':running', seq, m) end
end
-- Take a track out of q's backlog: exactly what it added (nothing when it added nothing).
local function backlog_leave(P, q, m)
  local base = backlog_key(P, q)
  local entry = redis.call('HGET', base, m)
  if not entry then return end
  local group, cls, milli, seq = string.match(entry, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)')
  milli, seq = tonumber(milli), tonumber(seq)
  if milli ~= 0 then
    tree_add(base .. ':tree:' .. group .. '|' .. cls, seq, -milli)
    hincr_or_drop(base .. ':sums', group .. '|' .. cls, -milli)
  end
  redis.call('HDEL', base, m)
  if group == 'r' then redis.call('ZREM', P .. ':queue:' .. q .. ':running', m) end
end
-- Put a track into q's backlog as its hash now says (status, stages, cost, seq, progress; its job's kind and
-- priority).
local function backlog_enter(P, q, m)
  local job_id, track = track_parts(m)
  local job_key = P .. ':job:' .. job_id
  local h = redis.call('HMGET', job_key .. ':track:' .. track, 'status', 'stages', 'cost', 'seq', 'progress')
  local j = redis.call('HMGET', job_key, 'kind', 'priority')
  local names = STAGES[j[1] or '']
  if not h[1] or not names then return end
  local i = string.find(h[1], ':', 1, true)
  local state, stage = h[1], ''
  if i then state, stage = string.sub(h[1], 1, i - 1), string.sub(h[1], i + 1) end
  local group
  if state == 'running' then group = 'r' elseif state == 'waiting' then group = 'w'
  elseif state == 'queued' then group = 'q' .. (RANK[j[2] or ''] or DEFAULT_RANK)
  else return end
  local index = #names - 1  -- every stage finished: the last (what a restart would run)
  if group == 'r' or group == 'w' then
    for n, name in ipairs(names) do if name == stage then index = n - 1 end end
  else
    local done = cjson.decode(h[2] or '{}')
    for n = #names, 1, -1 do
      local s = done[names[n]]
      if type(s) ~= 'table' or not s.finished_at or s.finished_at == cjson.null then index = n - 1 end
    end
  end
  local milli = math.floor(tonumber(h[3] or '0') * 1000 + 0.5)
  local extras = group == 'r' and running_extras(h[2], stage, h[5]) or ''
  backlog_add(P, q, m, group, j[1] .. ':' .. index, milli, tonumber(h[4] or '0'), extras)
end
-- A running track that stays where it is but started again or reported progress: its entry's extras anew.
local function backlog_touch(P, q, m)
  local base = backlog_key(P, q)
  local entry = redis.call('HGET', base, m)
  local head = entry and string.match(entry, '^(r|[^|]*|[^|]*|[^|]*)')
  if not head then return end
  local job_id, track = track_parts(m)
  local h = redis.call('HMGET', P .. ':job:' .. job_id .. ':track:' .. track, 'status', 'stages', 'progress')
  local stage = string.match(h[1] or '', '^running:(.*)$')
  if stage then redis.call('HSET', base, m, head .. running_extras(h[2], stage, h[3])) end
end
"""

# Read side. Needs nothing from the includer.
BACKLOG_READ = r"""
-- ---- the backlog index (app/backlog.py): read side ----
local function flat_to_table(flat) local t = {}; for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end; return t end
local function is_open(status) return status ~= '' and status ~= 'done' and status ~= 'failed' and status ~= 'canceled' end
-- A track's place on q: its entry and, per class of its group, the units of the tracks up to it (itself
-- included) in that group; false when it is not in q's backlog.
local function backlog_position(P, q, m, sums)
  local base = P .. ':queue:' .. q .. ':backlog'
  local entry = redis.call('HGET', base, m)
  if not entry then return false end
  local group, seq = string.match(entry, '^([^|]*)|[^|]*|[^|]*|([^|]*)')
  local nodes, i, b = {}, tonumber(seq), 1
  while i > 0 do
    while i % (2 * b) == 0 do b = 2 * b end
    nodes[#nodes + 1] = string.format('%.0f', i)
    i = i - b
  end
  local ahead = {}
  if #nodes == 0 then return {entry, ahead} end
  for field, _ in pairs(sums) do
    local g, cls = string.match(field, '^([^|]*)|(.*)$')
    if g == group then
      local total = 0
      for _, value in ipairs(redis.call('HMGET', base .. ':tree:' .. field, unpack(nodes))) do
        if value then total = total + tonumber(value) end
      end
      ahead[cls] = total
    end
  end
  return {entry, ahead}
end
-- Reads for an estimate: the learned rates; per queue (once each) its sums, the entries of its first `heads`
-- running tracks (by seq) and, with `entries`, every track's entry; per job its tracks' status, queue and place.
local function backlog_reader(P, heads, entries)
  local out = {rates = redis.call('HGETALL', P .. ':throughput'), queues = {}, jobs = {}}
  local reader = {out = out}
  function reader.queue(q)
    if out.queues[q] then return out.queues[q] end
    local base = P .. ':queue:' .. q .. ':backlog'
    local rows = {}
    local running = heads > 0 and redis.call('ZRANGE', P .. ':queue:' .. q .. ':running', 0, heads - 1) or {}
    if #running > 0 then
      for n, entry in ipairs(redis.call('HMGET', base, unpack(running))) do
        if entry then rows[#rows + 1] = {running[n], entry} end
      end
    end
    out.queues[q] = {sums = flat_to_table(redis.call('HGETALL', base .. ':sums')), running = rows}
    if entries then out.queues[q].entries = flat_to_table(redis.call('HGETALL', base)) end
    return out.queues[q]
  end
  -- one track of a job, from its hash's status and queue
  function reader.track(job_id, index, status, q)
    local tracks = out.jobs[job_id] or {}
    out.jobs[job_id] = tracks
    local row = {status or '', q or '', false, tonumber(index)}
    if is_open(row[1]) and row[2] ~= '' then
      row[3] = backlog_position(P, row[2], job_id .. ':' .. index, reader.queue(row[2]).sums)
    end
    tracks[#tracks + 1] = row
  end
  function reader.job(job_id)  -- every track of a job, read here
    local job_key = P .. ':job:' .. job_id
    out.jobs[job_id] = {}
    for index = 0, tonumber(redis.call('HGET', job_key, 'num_tracks') or '0') - 1 do
      local h = redis.call('HMGET', job_key .. ':track:' .. index, 'status', 'queue')
      if h[1] then reader.track(job_id, index, h[1], h[2]) end
    end
  end
  return reader
end
"""

_READ_SCRIPT = BACKLOG_READ + r"""
-- ARGV: prefix, running heads per queue, queues (comma-separated), job ids (comma-separated), '1' for entries
local reader = backlog_reader(ARGV[1], tonumber(ARGV[2]), ARGV[5] == '1')
for q in string.gmatch(ARGV[3], '[^,]+') do reader.queue(q) end
for job_id in string.gmatch(ARGV[4], '[^,]+') do reader.job(job_id) end
return cjson.encode(reader.out)
"""


class Entry(NamedTuple):
    """What one track adds to its queue's backlog (a running track's entry also says when its stage started
    and its progress)."""

    group: str
    cls: str      # "kind:index": every stage of kind from index on
    milli: int    # cost units, in thousandths
    seq: int
    started_at: float | None = None
    progress: float = 0.0

    @property
    def rank(self) -> tuple[int, int]:
        """Where the worker takes it: by group, then submission order."""
        return GROUP_ORDER.get(self.group, len(GROUP_ORDER)), self.seq


class RunningRow(NamedTuple):
    """A running track as the ETA reads it: its entry."""

    member: str
    entry: Entry


class QueueBacklog(NamedTuple):
    sums: dict[tuple[str, str], int]          # (group, class) -> milli
    running: list[RunningRow]                 # the first running tracks, by seq
    entries: dict[str, Entry] | None = None   # every track's entry (only when asked for)


class Position(NamedTuple):
    entry: Entry
    ahead: dict[str, int]   # class -> milli of the tracks of its group up to it, itself included


class TrackView(NamedTuple):
    """One track of a job as the backlog read saw it."""

    status: str
    queue: str
    position: Position | None
    track: int


class BacklogRead(NamedTuple):
    rates: dict[str, str]
    queues: dict[str, QueueBacklog]
    jobs: dict[str, list[TrackView]]


def parse_entry(value: str) -> Entry:
    group, cls, milli, seq, *extras = value.split("|")
    if not extras:
        return Entry(group, cls, int(milli), int(seq))
    began, progress = extras
    return Entry(group, cls, int(milli), int(seq), float(began) if began else None, float(progress or 0))


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []  # cjson writes an empty table as {}


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _queue(raw: dict[str, Any]) -> QueueBacklog:
    sums = {tuple(name.split("|", 1)): int(value) for name, value in _dict(raw.get("sums")).items()}
    entries = raw.get("entries")
    return QueueBacklog(sums, [RunningRow(m, parse_entry(e)) for m, e in _list(raw.get("running"))],  # type: ignore[arg-type]
                        None if entries is None else {m: parse_entry(v) for m, v in _dict(entries).items()})


def _track(raw: list) -> TrackView:
    status, queue, position, track = raw
    place = Position(parse_entry(position[0]), {c: int(v) for c, v in _dict(position[1]).items()}) \
        if position else None
    return TrackView(status, queue, place, int(track))


def parse(raw: dict[str, Any]) -> BacklogRead:
    """The read side's JSON (alone, or inside the job read: app/lifecycle.Lifecycle.read_job)."""
    flat = _list(raw.get("rates"))
    return BacklogRead(rates=dict(zip(flat[0::2], flat[1::2])),
                       queues={q: _queue(_dict(v)) for q, v in _dict(raw.get("queues")).items()},
                       jobs={job_id: [_track(t) for t in _list(v)] for job_id, v in _dict(raw.get("jobs")).items()})


class BacklogReader:
    """The read script, registered once per client."""

    def __init__(self, client: redis.Redis, prefix: str):
        self.prefix = prefix
        self._script = client.register_script(_READ_SCRIPT)

    def read(self, queues: Sequence[str] = (), job_ids: Sequence[str] = (), heads: int = 8,
             entries: bool = False) -> BacklogRead:
        """The rates; per queue in `queues` (and every queue a track of `job_ids` is on) its sums and first
        `heads` running tracks (with `entries`: every track's entry); per job its tracks' places."""
        names = [q for q in queues if q and "," not in q]
        reply = self._script(keys=[], args=[self.prefix, str(heads), ",".join(names), ",".join(job_ids),
                                            "1" if entries else "0"])
        return parse(json.loads(reply))
