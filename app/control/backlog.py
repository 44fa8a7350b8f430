"""The backlog index: each queue's outstanding work, kept up to date by the transitions that move tracks, and
the estimates read from it, so that an ETA or a routing decision reads a few sums instead of every open track.

What a track adds: its cost (song or audio seconds, in thousandths) in one *class*, `kind:index`, "this many
cost units still need every stage of `kind` from stage `index` on" (running:S and waiting:S from S; a queued
track from its first unfinished stage). Seconds come on read, from the queue's learned rates (app/control/eta.py), so a
rate that changes never needs the index rebuilt. Every track is in one *group*, in the order the worker takes
them: `r` running, `w` waiting for its next stage, then `q0`, `q1`, `q2`: queued, by priority rank
(app/core/priority.py); within a group by submission order (`seq`).

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
track among its queue's first `heads` (by seq) counts its stage's estimate less what already ran (or, past the
estimate, what its progress leaves of it); a further running one (left by a dead worker until the reaper restarts
it) counts its whole stage. A job's ETA is its last open track's finish; a queue's seconds are all of its tracks'.

BACKLOG_WRITE is included by the transition script (app/control/lifecycle.py) and runs in the same atomic step as the
move, after the state machine's tables (STAGES, RANK, DEFAULT_RANK: app/lifecycle.lua_tables); ESTIMATE by the
job read (a poll's ETA in the same round trip as its record) and by this module's script, after STAGES alone
(app/lifecycle.lua_stages).
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import redis

FENWICK_SIZE = 2 ** 40  # seq stays below it (app/priority.RANK_SPAN already assumes fewer than 10**12)
GROUP_ORDER = {"r": 0, "w": 1, "q0": 2, "q1": 3, "q2": 4}

BACKLOG_WRITE = f"local FENWICK_SIZE = {FENWICK_SIZE}\n" + r"""
-- ---- the backlog index (app/control/backlog.py): write side ----
local function backlog_key(P, q) return P .. ':queue:' .. q .. ':backlog' end
local function lowbit(i, from)  -- the largest power of two dividing i (at least `from`)
  local b = from or 1
  while i % (2 * b) == 0 do b = 2 * b end
  return b
end
local function hincr_or_drop(key, field, delta)
  if redis.call('HINCRBY', key, field, string.format('%.0f', delta)) == 0 then redis.call('HDEL', key, field) end
end
local function tree_add(tree, prefix, i, delta)  -- Fenwick update at index i of the tree whose fields start with prefix
  local b = lowbit(i)
  while i <= FENWICK_SIZE do
    hincr_or_drop(tree, prefix .. string.format('%.0f', i), delta)
    i = i + b
    b = lowbit(i, b)
  end
end
local function track_parts(m)  -- the job id and the track index of a "job:track" member
  local cut = string.find(m, ':[^:]*$')
  return string.sub(m, 1, cut - 1), string.sub(m, cut + 1)
end
-- What the ETA reads of a running track after its entry: "|started_at|progress" (its stage's start from the
-- stages JSON, '' when that does not say).
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
    tree_add(base .. ':tree', group .. '|' .. cls .. '|', seq, milli)
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
    tree_add(base .. ':tree', group .. '|' .. cls .. '|', seq, -milli)
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

ESTIMATE = r"""
-- ---- estimates over the backlog index (app/control/backlog.py) ----
local GROUP_ORDER = {r = 0, w = 1, q0 = 2, q1 = 3, q2 = 4}
local function group_order(g) return GROUP_ORDER[g] or 5 end
local function parse_entry(value)
  local group, cls, milli, seq, rest = string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)(.*)$')
  local e = {group = group, cls = cls, milli = tonumber(milli), seq = tonumber(seq), started = '', progress = '0'}
  if rest ~= '' then e.started, e.progress = string.match(rest, '^|([^|]*)|(.*)$') end
  return e
end
local function is_open(status) return status ~= '' and status ~= 'done' and status ~= 'failed' and status ~= 'canceled' end

-- An estimator at time `now` reading the first `heads` running tracks of each queue.
local function estimator(P, now, heads)
  local E = {}
  local per_unit_cache, from_cache, queues = {}, {}, {}
  -- seconds per cost unit of a stage on q: learned there, else the fleet's mean, else its share (every stage of
  -- the kind read at once, in one HMGET)
  function E.per_unit(q, kind, stage)
    local key = q .. '|' .. kind .. '|' .. stage
    if per_unit_cache[key] == nil then
      local names, fields = STAGES[kind], {}
      for _, name in ipairs(names) do
        local fleet = '*|' .. kind .. '|' .. name
        fields[#fields + 1] = q .. '|' .. kind .. '|' .. name
        fields[#fields + 1] = fleet .. '|sum'
        fields[#fields + 1] = fleet .. '|queues'
      end
      local h = redis.call('HMGET', P .. ':throughput', unpack(fields))
      for n, name in ipairs(names) do
        local own, sum, count = tonumber(h[3 * n - 2]), tonumber(h[3 * n - 1]), tonumber(h[3 * n] or '0')
        per_unit_cache[fields[3 * n - 2]] = own or (count > 0 and sum / count) or 1 / #names
      end
    end
    return per_unit_cache[key]
  end
  -- seconds per cost unit of every stage of kind from index (0-based) on
  function E.seconds_from(q, kind, index)
    local key = q .. '|' .. kind .. '|' .. index
    if from_cache[key] == nil then
      local total, names = 0, STAGES[kind]
      for n = index + 1, #names do total = total + E.per_unit(q, kind, names[n]) end
      from_cache[key] = total
    end
    return from_cache[key]
  end
  function E.class_seconds(q, cls, milli)
    local kind, index = string.match(cls, '^(.*):(%d+)$')
    if not STAGES[kind or ''] then return 0 end
    return E.seconds_from(q, kind, tonumber(index)) * milli / 1000
  end
  -- what a running track's elapsed time (or progress) takes off its stage's whole estimate (<= 0)
  function E.correction(q, e)
    local kind, index = string.match(e.cls, '^(.*):(%d+)$')
    local names = STAGES[kind or '']
    if e.group ~= 'r' or not names then return 0 end
    local estimate = E.per_unit(q, kind, names[tonumber(index) + 1]) * (e.milli / 1000)
    local elapsed = e.started ~= '' and math.max(0, now - tonumber(e.started)) or 0
    local progress = math.min(math.max(tonumber(e.progress) or 0, 0), 1)
    return math.max(estimate - elapsed, estimate * (1 - progress)) - estimate
  end
  -- q's sums and its heads (seq, member, correction), read once
  function E.queue(q)
    if queues[q] then return queues[q] end
    local base = P .. ':queue:' .. q .. ':backlog'
    local Q = {sums = {}, heads = {}, base = base}
    local sums = redis.call('HGETALL', base .. ':sums')
    for i = 1, #sums, 2 do Q.sums[sums[i]] = tonumber(sums[i + 1]) end
    local running = heads > 0 and redis.call('ZRANGE', P .. ':queue:' .. q .. ':running', 0, heads - 1) or {}
    if #running > 0 then
      for n, value in ipairs(redis.call('HMGET', base, unpack(running))) do
        if value then
          local e = parse_entry(value)
          Q.heads[#Q.heads + 1] = {e.seq, running[n], E.correction(q, e)}
        end
      end
    end
    queues[q] = Q
    return Q
  end
  function E.queue_seconds(q)
    local Q, total = E.queue(q), 0
    for field, milli in pairs(Q.sums) do total = total + E.class_seconds(q, string.match(field, '|(.*)$'), milli) end
    for _, head in ipairs(Q.heads) do total = total + head[3] end
    return math.max(total, 0)
  end
  -- seconds until track m of q is done (false when it is not in q's backlog)
  function E.finish(q, m)
    local Q = E.queue(q)
    local value = redis.call('HGET', Q.base, m)
    if not value then return false end
    local e = parse_entry(value)
    local rank, total = group_order(e.group), 0
    local nodes, i, b = {}, e.seq, 1  -- the Fenwick nodes whose sum is "up to seq" in e's group
    while i > 0 do
      while i % (2 * b) == 0 do b = 2 * b end
      nodes[#nodes + 1] = string.format('%.0f', i)
      i = i - b
    end
    for field, milli in pairs(Q.sums) do
      local g, cls = string.match(field, '^([^|]*)|(.*)$')
      if group_order(g) < rank then
        total = total + E.class_seconds(q, cls, milli)
      elseif g == e.group and #nodes > 0 then
        local fields = {}
        for n, node in ipairs(nodes) do fields[n] = field .. '|' .. node end
        local ahead = 0
        for _, v in ipairs(redis.call('HMGET', Q.base .. ':tree', unpack(fields))) do
          if v then ahead = ahead + tonumber(v) end
        end
        total = total + E.class_seconds(q, cls, ahead)
      end
    end
    for _, head in ipairs(Q.heads) do  -- the running heads it comes after (itself, when it is one)
      if e.group ~= 'r' or head[1] <= e.seq then total = total + head[3] end
    end
    return math.max(total, 0)
  end
  -- a job's ETA from its tracks ({index, status, queue}): its last open track's finish; 0 when every track
  -- ended; false while an open track is on no queue or not in its queue's backlog
  function E.job_eta(job_id, tracks)
    local eta = 0
    for _, t in ipairs(tracks) do
      if is_open(t[2]) then
        if t[3] == '' then return false end
        local finish = E.finish(t[3], job_id .. ':' .. t[1])
        if not finish then return false end
        eta = math.max(eta, finish)
      end
    end
    return eta
  end
  -- {member, finish} of every track of q, in the worker's order (reads every entry)
  function E.schedule(q)
    local Q, rows, clock, out = E.queue(q), {}, 0, {}
    local flat = redis.call('HGETALL', Q.base)
    for i = 1, #flat, 2 do
      local e = parse_entry(flat[i + 1])
      rows[#rows + 1] = {group_order(e.group), e.seq, flat[i], e}
    end
    table.sort(rows, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
    local corrections = {}
    for _, head in ipairs(Q.heads) do corrections[head[2]] = head[3] end
    for _, row in ipairs(rows) do
      clock = clock + math.max(E.class_seconds(q, row[4].cls, row[4].milli) + (corrections[row[3]] or 0), 0)
      out[#out + 1] = {row[3], string.format('%.17g', clock)}
    end
    return out
  end
  return E
end
local function seconds_text(value) return value and string.format('%.17g', value) or false end
"""

_ESTIMATE_SCRIPT = ESTIMATE + r"""
-- ARGV: prefix, now, running heads per queue, what (JSON: {jobs = [id...], queues = [q...], kind, cost,
-- schedules = [q...]}). Per job its ETA, per queue its seconds (and those of a new track of kind and cost),
-- per schedule queue its tracks' finishes: one JSON object, numbers as text (a Lua number would be truncated).
local P = ARGV[1]
local E = estimator(P, tonumber(ARGV[2]), tonumber(ARGV[3]))
local what = cjson.decode(ARGV[4])
local out = {jobs = {}, queues = {}, schedules = {}}
for _, job_id in ipairs(what.jobs or {}) do
  local job_key = P .. ':job:' .. job_id
  local tracks = {}
  for index = 0, tonumber(redis.call('HGET', job_key, 'num_tracks') or '0') - 1 do
    local h = redis.call('HMGET', job_key .. ':track:' .. index, 'status', 'queue')
    if h[1] then tracks[#tracks + 1] = {index, h[1], h[2] or ''} end
  end
  out.jobs[job_id] = seconds_text(E.job_eta(job_id, tracks))
end
for _, q in ipairs(what.queues or {}) do
  local new = 0
  if what.kind and STAGES[what.kind] then new = E.seconds_from(q, what.kind, 0) * tonumber(what.cost) end
  out.queues[q] = {seconds_text(E.queue_seconds(q)), seconds_text(new)}
end
for _, q in ipairs(what.schedules or {}) do out.schedules[q] = E.schedule(q) end
return cjson.encode(out)
"""


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}  # cjson writes an empty table as {}


def _number(value: Any) -> float | None:
    return None if value is False or value is None else float(value)


class Estimates:
    """The estimate script, registered once per client (app/jobs.JobStore.estimates)."""

    def __init__(self, client: redis.Redis, prefix: str, tables: str):
        self.prefix = prefix
        self._script = client.register_script(tables + _ESTIMATE_SCRIPT)

    def read(self, now: float, heads: int, jobs: Sequence[str] = (), queues: Sequence[str] = (),
             work: tuple[str, float] | None = None, schedules: Sequence[str] = ()) -> dict[str, Any]:
        """{"jobs": {id: ETA or None}, "queues": {q: (its seconds, a new track of `work`'s seconds there)},
        "schedules": {q: [(member, finish)...] in the worker's order}}, in one round trip."""
        what: dict[str, Any] = {"jobs": list(jobs), "queues": list(queues), "schedules": list(schedules)}
        if work is not None:
            what["kind"], what["cost"] = work[0], repr(float(work[1]))
        raw = json.loads(self._script(keys=[], args=[self.prefix, repr(now), str(heads), json.dumps(what)]))
        return {"jobs": {job_id: _number(v) for job_id, v in _dict(raw["jobs"]).items()},
                "queues": {q: (float(v[0]), float(v[1])) for q, v in _dict(raw["queues"]).items()},
                "schedules": {q: [(m, float(f)) for m, f in (v if isinstance(v, list) else [])]
                              for q, v in _dict(raw["schedules"]).items()}}
