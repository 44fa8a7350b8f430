"""The track state machine and the whole Redis layout: the one place that changes a track's state.

Every key Encore keeps in Redis is named in app/core/keys.py and built by its `Layout`. Every change of a track's state goes through
`Lifecycle.apply`, one Lua script that, atomically: checks the track's current status against the
transition table below, checks who may make it (the holder of the running stage's lease, or anyone when no
lease is live), honours a pending cancel, moves the track between the bookkeeping sets its status implies
(its queue's backlog index among them, app/control/backlog.py), keeps the job-level gauges, bumps the track's
version, appends the change to the job's event stream and publishes it on the job's events channel.

Statuses (the `status` field of a track hash; clients see `state`, derived from it, as before):
  created       written, not routed yet (the submitter routes it once its inputs exist): in {p}:created
  parked        routed nowhere yet (no live worker, or moved off a queue): member of {p}:unrouted
  queued        on a queue, its first stage's message in the broker: in the queue's waiting and load sets
  running:S     stage S runs under a lease {p}:lease:{job}:{track}: in the queue's load set; the worker's
                current stage names it
  waiting:S     the stage before S finished; S's message is on the queue: in the queue's load set
  done | failed | canceled   terminal: in no set; only a `retry` (failed, canceled) changes them again

Layout (prefix `encore` by default; job keys expire with the job):
  {p}:job:{id}                 hash: kind, params, num_tracks, created_at, expires_at, priority (app/core/priority.py),
                               n_waiting/n_active/n_done/n_failed/n_canceled (tracks per category, kept by the
                               transition)
  {p}:job:{id}:track:{i}       hash: status, state, stage, queue, worker, progress, detail, error, task_ids,
                               stages, artifacts, seq, cost, attempts, restarts, version, updated_at, ...
  {p}:cancel:{id}              set once the job was canceled
  {p}:lease:{id}:{i}           the running stage's owner "worker|delivery|pid", expiring unless renewed
  {p}:deliveries:{task id}     how many times a stage message was delivered
  {p}:jobs                     zset of job ids by creation time
  {p}:jobs:{kind}:{state}      zset of job ids in that overall state, scored by expiry (gauges: ZCOUNT)
  {p}:created                  zset of created "job:track" by creation time (the reaper parks any the
                               submitter never routed: it died in between)
  {p}:unrouted                 zset of parked "job:track" by priority, then submission order (the order
                               they are dispatched in)
  {p}:queue:{q}:waiting        zset of queued "job:track" by priority, then submission order (queue positions)
  {p}:queue:{q}:load           zset of "job:track" not finished on q, scored by estimated cost
  {p}:queue:{q}:cost           the sum of that set's scores, in thousandths (the status page's estimated_load)
  {p}:queue:{q}:backlog*       the backlog index: per class and group the cost still to run, and the sums ahead
                               of each track (app/control/backlog.py), kept by the transition: what ETAs and routing read
  {p}:queue:{q}:running        zset of running "job:track" by seq (app/control/backlog.py)
  {p}:queues                   set of every queue a track was assigned to
  {p}:draining                 set of queues an operator drained
  {p}:seq                      submission counter
  {p}:events:{id}              pub/sub channel: every transition of the job's tracks
  {p}:job:{id}:events          stream of the same events (the newest ENCORE_EVENTS_MAXLEN), expiring with the
                               job: its entry ids are the SSE event ids a client resumes from
  {p}:idempotency:{scope}:{h}  "body hash|job id" of a submission made with an Idempotency-Key (app/control/idempotency.py)
  {p}:webhooks:outbox          webhook messages written by the transitions (a transactional outbox), and
  {p}:webhooks:in-flight:{w}   those webhook worker w took; {p}:webhooks:seq their counter;
  {p}:job:{id}:webhooks        the job's delivery attempts (app/adapters/webhooks.py)
  {p}:workers, {p}:worker:{name}, {p}:worker:{name}:current, {p}:queue:{q}:live_at   worker registry
  {p}:metrics:*                stage-duration histograms, submission counters
  {p}:throughput               hash "queue|kind|stage" -> learned seconds per cost unit (+ "|n" samples, "|cold"
                               when it came from a stage that loaded models): the ETA and routing (app/control/eta.py)
  {p}:ratelimit*               the submit routes' per-token rate-limit windows (Flask-Limiter, app/http/ratelimit.py)
  {p}:artifact(s):*            artifacts in the Redis store (app/adapters/artifacts.py)
  {p}:lock:*                   short locks (the reaper; admission under the open-track caps, app/control/quotas.py)

The script builds the keys of the queue a track is on from its hash, so it runs on a standalone Redis or a
Sentinel-managed primary, not on Redis Cluster.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from app.control.backlog import BACKLOG_WRITE, ESTIMATE
from app.core.keys import Layout
from app.core.kinds import KINDS
from app.core.priority import DEFAULT_PRIORITY, RANK, RANK_SPAN

CREATED, PARKED, QUEUED, DONE, FAILED, CANCELED = "created", "parked", "queued", "done", "failed", "canceled"
RUNNING, WAITING = "running", "waiting"
TERMINAL = (DONE, FAILED, CANCELED)


def member(job_id: str, track: int) -> str:
    """How a track is named in the bookkeeping sets."""
    return f"{job_id}:{track}"


def parse_member(value: str) -> tuple[str, int]:
    job_id, _, track = value.rpartition(":")
    return job_id, int(track)


def running(stage: str) -> str:
    return f"{RUNNING}:{stage}"


def waiting(stage: str) -> str:
    return f"{WAITING}:{stage}"


def is_open(status: str | None) -> bool:
    return bool(status) and status not in TERMINAL


@dataclass(frozen=True)
class Transition:
    """One event of the table. Sources and target are patterns:
    `S` is the stage the event names; `*` any stage; `queued@first` queued when S is the first stage its
    chain runs (the kind's first, or the first unfinished one of a resumed track); `open` any non-terminal status; target `next` is waiting:<stage after S>, or done after the last;
    `same` keeps the status (a report). Holder: `lease` = the caller holds the lease; `free` = no live lease
    or the caller holds it (or names the dead one it replaces)."""

    sources: tuple[str, ...]
    target: str
    holder: str
    cancel: bool  # a pending cancel turns it into `canceled` (when the target is not terminal)
    does: str     # what it means, for the README


TRANSITIONS: dict[str, Transition] = {
    "submit": Transition(("new",), CREATED, "free", False, "a new track, routed by its submitter next"),
    "park": Transition((CREATED,), PARKED, "free", True,
                       "no live worker (or its submitter died before routing it): waits for one"),
    "route": Transition((CREATED, PARKED), QUEUED, "free", True,
                        "put on a live queue, its chain's first message sent"),
    "unroute": Transition((QUEUED,), PARKED, "free", True,
                          "taken off a dead or drained queue with its message, before any worker took it"),
    "start": Transition(("queued@first", "waiting:S", "running:S"), "running:S", "free", True,
                        "a delivery of the track's current chain starts stage S and takes the lease "
                        "(from running:S only when the lease is gone or was its own dead child's)"),
    "adopt": Transition(("queued@first",), "running:S", "free", True,
                        "a running first stage takes a waiting sibling track into its batch, under its lease"),
    "report": Transition(("running:*",), "same", "lease", False, "progress, detail, artifacts of the running stage"),
    "finish": Transition(("running:S",), "next", "lease", True, "stage S is done: wait for the next, or done"),
    "release": Transition(("running:S",), QUEUED, "lease", True,
                          "an adopted track goes back to wait for its own message (its batch failed)"),
    "restart": Transition((QUEUED, "waiting:*", "running:*"), PARKED, "free", True,
                          "its stage died (lease expired) or its queue has no consumer: parked to run again "
                          "from its first unfinished stage; failed after ENCORE_MAX_DELIVERIES restarts"),
    "resend": Transition((QUEUED, "waiting:*"), "same", "free", False,
                         "the message it waits for was lost: sent again (a new chain from that stage)"),
    "fail": Transition(("open",), FAILED, "free", False, "its stage failed, timed out, or gave up"),
    "cancel": Transition(("open",), CANCELED, "free", False,
                         "the job was canceled and no live stage will see the flag (or the stage itself stops)"),
    "retry": Transition((FAILED, CANCELED), PARKED, "free", False,
                        "a client re-runs a failed or canceled track (POST /api/v1/jobs/<id>/retry) from its first "
                        "unfinished stage: counted in `retries`, its restart budget fresh, the job's cancel flag "
                        "cleared (refused while a sibling is still being canceled)"),
}

# Track fields stored as JSON (everything else is a plain string). Never decoded by Lua's cjson, which would turn
# every empty list, however deep, into {}: Python parses them, and the read script splices them in raw.
JSON_FIELDS = ("progress", "artifacts", "stages", "task_ids", "seq", "attempts", "track", "cost", "restarts", "retries",
               "song", "version", "params", "updated_at")

# Fields only the script writes; others (detail, progress, error, stages, artifacts, song, attempts) are
# passed by the caller and written with the transition.
STRUCTURAL = ("status", "state", "stage", "queue", "task_ids", "version", "restarts", "retries", "seq", "updated_at",
              "worker", "cost")


def _lua_table(value: Any) -> str:
    """A Python value as a Lua table literal (strings, bools, lists, dicts)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "{" + ", ".join(_lua_table(item) for item in value) + "}"
    return "{" + ", ".join(f"[{json.dumps(k)}] = {_lua_table(v)}" for k, v in value.items()) + "}"


def lua_stages() -> str:
    """Each kind's stage names as the Lua local STAGES: all an estimate needs (app/control/backlog.py)."""
    stages = {kind.name: [stage.name for stage in kind.stages] for kind in KINDS.values()}
    return f"local STAGES = {_lua_table(stages)}\n"


def lua_tables() -> str:
    """The transition table, stages, display states and priority ranks as Lua locals (T, STAGES, DISPLAY,
    STRUCTURAL, RANK, ...), for the scripts that change a track."""
    table = {name: {"sources": list(t.sources), "target": t.target, "holder": t.holder, "cancel": t.cancel}
             for name, t in TRANSITIONS.items()}
    display = {kind.name: {stage.name: stage.state for stage in kind.stages} for kind in KINDS.values()}
    ranks = {level: str(rank) for level, rank in RANK.items()}
    return (f"local T = {_lua_table(table)}\n{lua_stages()}"
            f"local DISPLAY = {_lua_table(display)}\nlocal STRUCTURAL = {_lua_table({f: True for f in STRUCTURAL})}\n"
            f"local RANK = {_lua_table(ranks)}\nlocal RANK_SPAN = {RANK_SPAN}\n"
            f"local DEFAULT_RANK = {RANK[DEFAULT_PRIORITY]}\n")


_TRANSITION = r"""
-- ARGV: prefix, event, job id, track, now, args (JSON), fields (JSON object of strings), the events stream's length,
--       seconds between a job's progress webhooks
local P, event, job_id, track, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local a = cjson.decode(ARGV[6])
local fields = cjson.decode(ARGV[7])
local rule = T[event]
if not rule then return {0, '', 'unknown event ' .. event} end
local job_key = P .. ':job:' .. job_id
local key = job_key .. ':track:' .. track
local lease_key = P .. ':lease:' .. job_id .. ':' .. track
local m = job_id .. ':' .. track
local kind = redis.call('HGET', job_key, 'kind')
if not kind then return {0, '', 'no such job'} end
local stage = a.stage or ''
local status = redis.call('HGET', key, 'status') or 'new'
local names = STAGES[kind]

local function first_unfinished()  -- the stage a (possibly resumed) chain starts with
  local done = cjson.decode(redis.call('HGET', key, 'stages') or '{}')
  for _, name in ipairs(names) do
    if type(done[name]) ~= 'table' or not done[name].finished_at then return name end
  end
  return ''
end
local function is_terminal(s) return s == 'done' or s == 'failed' or s == 'canceled' end
local function split(s) local i = string.find(s, ':', 1, true); if not i then return s, '' end
  return string.sub(s, 1, i - 1), string.sub(s, i + 1) end
local function matches(pattern, s)
  if pattern == 'open' then return s ~= 'new' and not is_terminal(s) end
  if pattern == 'queued@first' then return s == 'queued' and stage == first_unfinished() end
  local pk, ps = split(pattern)
  local sk, ss = split(s)
  if ps == '' then return pattern == s end
  if pk ~= sk then return false end
  if ps == '*' then return true end
  return ps == 'S' and ss == stage
end

local allowed = false
for _, pattern in ipairs(rule.sources) do if matches(pattern, status) then allowed = true end end
if not allowed then return {0, status, event .. ' is not allowed from ' .. status} end
for name, _ in pairs(fields) do
  if STRUCTURAL[name] then return {0, status, name .. ' is written by the state machine only'} end
end

local lease = redis.call('GET', lease_key)
local owner = a.owner or ''
if rule.holder == 'lease' then
  if (not lease) or lease ~= owner then return {0, status, 'the lease is not the caller\'s'} end
elseif lease and lease ~= owner and lease ~= (a.steal or '') then
  return {0, status, 'a live stage holds the lease'}
end
local queue = redis.call('HGET', key, 'queue') or ''
if a.queue_is and a.queue_is ~= queue then return {0, status, 'the track is not on ' .. a.queue_is} end
local task_ids = redis.call('HGET', key, 'task_ids') or '[]'
if a.task_id and not string.find(task_ids, '"' .. a.task_id .. '"', 1, true) then
  return {0, status, 'the delivery is not of the track\'s current chain'}
end
if event == 'adopt' and task_ids == '[]' then return {0, status, 'the track has no chain'} end
if event == 'retry' and redis.call('EXISTS', P .. ':cancel:' .. job_id) == 1 then
  local open = tonumber(redis.call('HGET', job_key, 'n_waiting') or '0') +
               tonumber(redis.call('HGET', job_key, 'n_active') or '0')
  if open > 0 then return {0, status, 'the job is still being canceled'} end
  redis.call('DEL', P .. ':cancel:' .. job_id)  -- a retried job is no longer canceled
end

-- the target
local target = rule.target
local result = 1
if target == 'running:S' then target = 'running:' .. stage
elseif target == 'same' then target = status
elseif target == 'next' then
  target = 'done'
  for i, name in ipairs(names) do if name == stage and names[i + 1] then target = 'waiting:' .. names[i + 1] end end
end
local restarts = tonumber(redis.call('HGET', key, 'restarts') or '0')
if event == 'restart' and restarts >= tonumber(a.max_restarts or '1000000') then
  target = 'failed'
  fields.error = a.give_up or 'restarted too many times'
  fields.detail = 'failed'
end
if rule.cancel and not is_terminal(target) and redis.call('EXISTS', P .. ':cancel:' .. job_id) == 1 then
  target = 'canceled'
  fields.detail = a.cancel_detail or 'canceled'
  result = 2
end
if a.lrem and not is_terminal(target) then  -- the message must still be in the broker (no worker took it)
  if redis.call('LREM', a.lrem[1], 1, a.lrem[2]) == 0 then return {0, status, 'its message was taken'} end
end

-- bookkeeping: leave the old status's sets, enter the new one's
local seq = redis.call('HGET', key, 'seq')
local cost = tonumber(redis.call('HGET', key, 'cost') or '0')
local milli = math.floor(cost * 1000 + 0.5)
local function in_load(s) local k = split(s); return s == 'queued' or k == 'running' or k == 'waiting' end
local function leave(s, q)
  if s == 'created' then redis.call('ZREM', P .. ':created', m) end
  if s == 'parked' then redis.call('ZREM', P .. ':unrouted', m) end
  if s == 'queued' then redis.call('ZREM', P .. ':queue:' .. q .. ':waiting', m) end
  if in_load(s) and redis.call('ZREM', P .. ':queue:' .. q .. ':load', m) == 1 then
    redis.call('DECRBY', P .. ':queue:' .. q .. ':cost', milli)
  end
  if in_load(s) then backlog_leave(P, q, m) end
  if split(s) == 'running' then
    local w = redis.call('HGET', key, 'worker') or ''
    local ck = P .. ':worker:' .. w .. ':current'
    if redis.call('HGET', ck, 'job_id') == job_id and redis.call('HGET', ck, 'track') == track then
      redis.call('DEL', ck)
    end
  end
end
local function order()  -- parked and queued tracks: the job's priority first, then submission order
  local rank = tonumber(RANK[redis.call('HGET', job_key, 'priority') or ''] or DEFAULT_RANK)
  return string.format('%.0f', rank * RANK_SPAN + tonumber(seq))
end
local function enter(s, q)
  if s == 'created' then redis.call('ZADD', P .. ':created', now, m) end
  if s == 'parked' then redis.call('ZADD', P .. ':unrouted', order(), m) end
  if s == 'queued' then
    redis.call('ZADD', P .. ':queue:' .. q .. ':waiting', order(), m)
    redis.call('SADD', P .. ':queues', q)
  end
  if in_load(s) and redis.call('ZADD', P .. ':queue:' .. q .. ':load', cost, m) == 1 then
    redis.call('INCRBY', P .. ':queue:' .. q .. ':cost', milli)
  end
end

if event == 'submit' then
  seq = redis.call('INCR', P .. ':seq')
  cost = tonumber(a.cost or '0')
  milli = math.floor(cost * 1000 + 0.5)
  redis.call('HSET', key, 'track', track, 'seq', seq, 'cost', cost, 'queue', '', 'worker', '', 'task_ids', '[]',
             'restarts', 0, 'retries', 0, 'attempts', 0, 'stage', '', 'error', '', 'progress', '0.0', 'artifacts', '[]',
             'stages', '{}')
  redis.call('EXPIRE', key, redis.call('TTL', job_key))
end
local new_queue = queue
if event == 'route' then new_queue = a.queue end
if target == 'parked' then new_queue = '' end
if target ~= status or new_queue ~= queue then
  leave(status, queue)
  if not is_terminal(target) then enter(target, new_queue) end
end

-- the lease and the worker's current stage
local tk, ts = split(target)
if tk == 'running' then
  if event == 'start' or event == 'adopt' then
    redis.call('SET', lease_key, owner, 'PX', a.lease_ms)
    redis.call('HSET', key, 'worker', a.worker)
  end
  if event == 'start' then  -- an adopted track rides along; the worker's current stage is its own track's
    redis.call('HSET', P .. ':worker:' .. a.worker .. ':current', 'job_id', job_id, 'track', track, 'stage', ts,
               'since', now, 'pid', a.pid or '')
  end
elseif lease then
  redis.call('DEL', lease_key)
end

-- job-level categories, and the job's overall state for the gauges
local function category(s)
  if s == 'new' then return nil end
  if s == 'created' or s == 'parked' or s == 'queued' then return 'waiting' end
  if is_terminal(s) then return s end
  return 'active'
end
local function overall()
  local c = {}
  for _, name in ipairs({'waiting', 'active', 'done', 'failed', 'canceled'}) do
    c[name] = tonumber(redis.call('HGET', job_key, 'n_' .. name) or '0')
  end
  local n = c.waiting + c.active + c.done + c.failed + c.canceled
  if n == 0 then return nil end
  if c.waiting == n then return 'queued' end
  if c.waiting + c.active > 0 then return 'running' end
  if c.done == n then return 'done' end
  if c.failed == n then return 'failed' end
  if c.canceled == n then return 'canceled' end
  if c.done > 0 then return 'partial' end
  if c.canceled > 0 then return 'canceled' end
  return 'failed'
end
local before_cat, after_cat = category(status), category(target)
local job_before, job_after = nil, nil
if before_cat ~= after_cat then
  local before = overall()
  if before_cat then redis.call('HINCRBY', job_key, 'n_' .. before_cat, -1) end
  redis.call('HINCRBY', job_key, 'n_' .. after_cat, 1)
  local after = overall()
  job_before, job_after = before, after
  if before ~= after then
    local expires = redis.call('HGET', job_key, 'expires_at')
    if before then redis.call('ZREM', P .. ':jobs:' .. kind .. ':' .. before, job_id) end
    redis.call('ZADD', P .. ':jobs:' .. kind .. ':' .. after, expires, job_id)
  end
end

-- the track hash
local state, new_stage = target, redis.call('HGET', key, 'stage') or ''
if tk == 'running' or tk == 'waiting' then state, new_stage = DISPLAY[kind][ts], ts
elseif target == 'created' or target == 'parked' or target == 'queued' then state, new_stage = 'queued', '' end
redis.call('HSET', key, 'status', target, 'state', state, 'stage', new_stage, 'queue', new_queue, 'updated_at', now)
if event == 'route' or event == 'resend' then redis.call('HSET', key, 'task_ids', a.task_ids) end
if target == 'parked' then redis.call('HSET', key, 'task_ids', '[]') end
if event == 'restart' and target == 'parked' then redis.call('HSET', key, 'restarts', restarts + 1) end
if event == 'retry' then
  redis.call('HINCRBY', key, 'retries', 1)
  redis.call('HSET', key, 'restarts', 0, 'worker', '')
end
for name, value in pairs(fields) do redis.call('HSET', key, name, value) end
if (target ~= status or new_queue ~= queue) and in_load(target) then  -- from the hash as it now is
  backlog_enter(P, new_queue, m)
elseif tk == 'running' and (event == 'start' or event == 'adopt' or fields.progress) then
  backlog_touch(P, new_queue, m)  -- started again where it ran, or reported progress
end
local version = redis.call('HINCRBY', key, 'version', 1)

-- the event: appended to the job's stream (replayed to a client that resumes) and published, in this step
local h = redis.call('HMGET', key, 'progress', 'detail', 'error')
local payload = {job_id = job_id, track = tonumber(track), event = event, status = target, state = state,
  stage = new_stage, progress = tonumber(h[1]), detail = h[2], error = h[3], version = version,
  job_state = overall() or 'queued'}
local stream = job_key .. ':events'
payload.id = redis.call('XADD', stream, 'MAXLEN', tonumber(ARGV[8] or '1000'), '*', 'data', cjson.encode(payload))
local ttl = redis.call('TTL', job_key)
if ttl > 0 then redis.call('EXPIRE', stream, ttl) end
redis.call('PUBLISH', P .. ':events:' .. job_id, cjson.encode(payload))

-- a webhook, when the job asked for this kind of event: into the outbox in this same step (app/adapters/webhooks.py)
local hook = redis.call('HGET', job_key, 'webhook_events')
if hook and hook ~= '' then
  local wtype = nil
  if job_after and job_after ~= job_before then
    if job_after == 'running' and job_before == 'queued' then wtype = 'start'
    elseif job_after == 'done' then wtype = 'completed'
    elseif job_after == 'failed' or job_after == 'partial' then wtype = 'failed'
    elseif job_after == 'canceled' then wtype = 'canceled' end
  elseif event == 'report' and fields.progress then
    local last = tonumber(redis.call('HGET', job_key, 'webhook_progress_at') or '0')
    if tonumber(now) - last >= tonumber(ARGV[9] or '5') then
      wtype = 'progress'
      redis.call('HSET', job_key, 'webhook_progress_at', now)
    end
  end
  if wtype and string.find(',' .. hook .. ',', ',' .. wtype .. ',', 1, true) then
    local n = redis.call('INCR', P .. ':webhooks:seq')
    redis.call('RPUSH', P .. ':webhooks:outbox', cjson.encode({id = 'msg_' .. job_id .. '_' .. n, type = wtype,
      job_id = job_id, at = tonumber(now), data = payload}))
    redis.call('LTRIM', P .. ':webhooks:outbox', -100000, -1)
  end
end
return {result, target, ''}
"""


_READ_JOB = r"""
-- ARGV: prefix, job id, JSON field names (comma-separated); for the ETA too: running heads, now. The job, its
-- tracks with queue positions and their workers' status, the cancel flag (and the job's ETA): one JSON document,
-- built here so that Python parses it once. Track fields stored as JSON are spliced in as they are (cjson would
-- turn their empty lists into {}); hash order is kept.
local P, job_id = ARGV[1], ARGV[2]
local json_field = {}
for name in string.gmatch(ARGV[3], '[^,]+') do json_field[name] = true end
local job_key = P .. ':job:' .. job_id
local function to_table(flat) local t = {}; for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end; return t end
local job = to_table(redis.call('HGETALL', job_key))
if not job.kind then return false end
local tracks = {}
local states = {}  -- {index, status, queue} of each track, for the ETA
for i = 0, tonumber(job.num_tracks) - 1 do
  local flat = redis.call('HGETALL', job_key .. ':track:' .. i)
  local t = to_table(flat)
  if t.status then
    states[#states + 1] = {i, t.status, t.queue or ''}
    local parts = {}
    for j = 1, #flat, 2 do
      local value = json_field[flat[j]] and flat[j + 1] or cjson.encode(flat[j + 1])
      parts[#parts + 1] = '"' .. flat[j] .. '":' .. value  -- field names are ours: plain identifiers
    end
    local m = job_id .. ':' .. i
    local rank = false
    if t.status == 'queued' then rank = redis.call('ZRANK', P .. ':queue:' .. t.queue .. ':waiting', m)
    elseif t.status == 'parked' then rank = redis.call('ZRANK', P .. ':unrouted', m) end
    parts[#parts + 1] = '"queue_position":' .. (rank and (rank + 1) or 0)
    local open = t.status ~= 'done' and t.status ~= 'failed' and t.status ~= 'canceled'
    if open and t.worker and t.worker ~= '' then
      local status = 'idle'
      if redis.call('EXISTS', P .. ':worker:' .. t.worker) == 0 then status = 'offline'
      elseif redis.call('EXISTS', P .. ':worker:' .. t.worker .. ':current') == 1 then status = 'busy' end
      parts[#parts + 1] = '"worker_status":"' .. status .. '"'
    end
    tracks[#tracks + 1] = '{' .. table.concat(parts, ',') .. '}'
  end
end
local eta = ''
if ARGV[5] and ARGV[5] ~= '' then  -- the job's ETA at time ARGV[5], in this same step (app/control/backlog.py)
  local seconds = estimator(P, tonumber(ARGV[5]), tonumber(ARGV[4])).job_eta(job_id, states)
  eta = ',"eta_s":' .. (seconds and string.format('%.17g', seconds) or 'null')
end
return '{"job":' .. cjson.encode(job) .. ',"tracks":[' .. table.concat(tracks, ',') .. '],"cancel":' ..
  redis.call('EXISTS', P .. ':cancel:' .. job_id) .. eta .. '}'
"""


_FORGET = r"""
-- ARGV: prefix, queue, member. A track whose job expired while it was on the queue: out of every set of the
-- queue, its cost counter lowered by what the load set held for it (its hash, and so its cost, is gone).
local P, q, m = ARGV[1], ARGV[2], ARGV[3]
local score = redis.call('ZSCORE', P .. ':queue:' .. q .. ':load', m)
if score and redis.call('ZREM', P .. ':queue:' .. q .. ':load', m) == 1 then
  redis.call('DECRBY', P .. ':queue:' .. q .. ':cost', math.floor(tonumber(score) * 1000 + 0.5))
end
redis.call('ZREM', P .. ':queue:' .. q .. ':waiting', m)
backlog_leave(P, q, m)
return score and 1 or 0
"""


_SNAPSHOT = r"""
-- ARGV: prefix, now, spec (JSON: states [[kind, state]...], stages [[kind, stage]...], lists [suffix...]).
-- Everything the status page, /metrics and Khala's /status show, in one round trip.
local P, now = ARGV[1], ARGV[2]
local spec = cjson.decode(ARGV[3])
local function to_table(flat) local t = {}; for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end; return t end
local out = {workers = {}, queues = {}, jobs = {}, stages = {}}
local known = {}
local names = redis.call('SMEMBERS', P .. ':workers')
table.sort(names)
for _, name in ipairs(names) do
  local info = to_table(redis.call('HGETALL', P .. ':worker:' .. name))
  local current = to_table(redis.call('HGETALL', P .. ':worker:' .. name .. ':current'))
  out.workers[#out.workers + 1] = {name = name, info = info, current = current}
  for q in string.gmatch(info.queue or '', '[^,]+') do known[q] = true end
end
for _, q in ipairs(redis.call('SMEMBERS', P .. ':queues')) do known[q] = true end
local draining = {}
for _, q in ipairs(redis.call('SMEMBERS', P .. ':draining')) do draining[q] = true end
local queues = {}
for q, _ in pairs(known) do queues[#queues + 1] = q end
table.sort(queues)
for _, q in ipairs(queues) do
  local messages = 0
  for _, suffix in ipairs(spec.lists) do messages = messages + redis.call('LLEN', q .. suffix) end
  out.queues[#out.queues + 1] = {name = q, waiting = redis.call('ZCARD', P .. ':queue:' .. q .. ':waiting'),
    outstanding = redis.call('ZCARD', P .. ':queue:' .. q .. ':load'),
    cost = tonumber(redis.call('GET', P .. ':queue:' .. q .. ':cost') or '0'), broker_messages = messages,
    draining = draining[q] == true}
end
out.unrouted = redis.call('ZCARD', P .. ':unrouted')
for _, pair in ipairs(spec.states) do
  out.jobs[#out.jobs + 1] = redis.call('ZCOUNT', P .. ':jobs:' .. pair[1] .. ':' .. pair[2], '(' .. now, '+inf')
end
out.submitted = to_table(redis.call('HGETALL', P .. ':metrics:submitted'))
for _, pair in ipairs(spec.stages) do
  out.stages[#out.stages + 1] = to_table(redis.call('HGETALL', P .. ':metrics:stage_seconds:' .. pair[1] .. ':' .. pair[2]))
end
out.rates = to_table(redis.call('HGETALL', P .. ':throughput'))
return cjson.encode(out)
"""


@dataclass(frozen=True)
class Outcome:
    """What a transition did: applied, turned into a cancel (a pending cancel won), or refused (why)."""

    applied: bool
    canceled: bool
    status: str
    reason: str = ""

    def __bool__(self) -> bool:
        return self.applied


class Lifecycle:
    """Runs the transition table against one Redis."""

    def __init__(self, client: redis.Redis, layout: Layout, events_maxlen: int = 1000,
                 webhook_progress_s: float = 5.0):
        self.redis = client
        self.layout = layout
        self.events_maxlen = events_maxlen
        self.webhook_progress_s = webhook_progress_s
        self._script = client.register_script(lua_tables() + BACKLOG_WRITE + _TRANSITION)
        self._read_job = client.register_script(lua_stages() + ESTIMATE + _READ_JOB)
        self._forget = client.register_script(lua_tables() + BACKLOG_WRITE + _FORGET)
        self._snapshot = client.register_script(_SNAPSHOT)

    def apply(self, event: str, job_id: str, track: int, args: dict[str, Any] | None = None,
              fields: dict[str, Any] | None = None, client: Any = None) -> Outcome:
        """Make one transition (see TRANSITIONS); `fields` are written with it (non-strings as JSON)."""
        encoded = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (fields or {}).items()}
        argv = [self.layout.prefix, event, job_id, str(track), repr(time.time()),
                json.dumps(args or {}), json.dumps(encoded) if encoded else "{}", str(self.events_maxlen),
                repr(self.webhook_progress_s)]
        reply = self._script(keys=[], args=argv, client=client or self.redis)
        if client is not None and client is not self.redis:
            return Outcome(True, False, "")  # queued in a pipeline: its reply comes with the pipeline's
        code, status, reason = reply
        return Outcome(code > 0, code == 2, _text(status), _text(reason))


    def read_job(self, job_id: str, eta_at: float | None = None, heads: int = 0) -> dict[str, Any] | None:
        """The raw job hash, its track hashes (JSON fields decoded; with queue_position, and worker_status for
        open tracks with a worker) and the cancel flag, in one round trip and one parse. With `eta_at` (a time),
        also `eta_s`: the job's ETA then, reading `heads` running tracks per queue (app/control/backlog.py)."""
        args = [self.layout.prefix, job_id, ",".join(JSON_FIELDS)]
        if eta_at is not None:
            args += [str(heads), repr(eta_at)]
        reply = self._read_job(keys=[], args=args)
        return json.loads(reply) if reply else None

    def forget(self, queue: str, value: str) -> bool:
        """Take a track whose job expired off `queue`: its load set (and cost counter), its waiting set and
        its backlog (app/control/backlog.py). False when the load set did not hold it."""
        return self._forget(keys=[], args=[self.layout.prefix, queue, value]) == 1


    def snapshot(self, states: list[tuple[str, str]], stages: list[tuple[str, str]],
                 list_suffixes: list[str]) -> dict[str, Any]:
        """Workers (with their current stage), queues (depths, load, broker messages, drained), parked
        tracks, jobs per (kind, state) in `states` order, submission counters, the stage histograms of
        `stages` and the learned rates, in one round trip (see app/control/snapshot.py)."""
        spec = {"states": states, "stages": stages, "lists": list_suffixes}
        return json.loads(self._snapshot(keys=[], args=[self.layout.prefix, repr(time.time()), json.dumps(spec)]))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
