-- ARGV: prefix, event, job id, track, now, args (JSON), fields (JSON object of strings), the events stream's length,
--       seconds between a job's progress webhooks
local P, event, job_id, track, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local K = keys_under(P)
local a = cjson.decode(ARGV[6])
local fields = cjson.decode(ARGV[7])
local rule = T[event]
if not rule then return {0, '', 'unknown event ' .. event} end
local job_key = K.job(job_id)
local key = K.track(job_id, track)
local lease_key = K.lease(job_id, track)
local m = job_id .. ':' .. track
local kind = redis.call('HGET', job_key, 'kind')
if not kind then return {0, '', 'no such job'} end
local stage = a.stage or ''
local status = redis.call('HGET', key, 'status') or 'new'
local names = STAGES[kind]

local function split(s) local i = string.find(s, ':', 1, true); if not i then return s, '' end
  return string.sub(s, 1, i - 1), string.sub(s, i + 1) end
local function matches(pattern, s)
  if pattern == 'open' then return s ~= 'new' and not is_terminal(s) end
  if pattern == 'queued@first' then return s == 'queued' and stage == names[first_unfinished(names, redis.call('HGET', key, 'stages')) + 1] end
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
if a.version_is and a.version_is ~= (redis.call('HGET', key, 'version') or '0') then  -- compare and set
  return {0, status, 'the track changed since it was read'}
end
local task_ids = redis.call('HGET', key, 'task_ids') or '[]'
if a.task_id and not string.find(task_ids, '"' .. a.task_id .. '"', 1, true) then
  return {0, status, 'the delivery is not of the track\'s current chain'}
end
if event == 'adopt' and task_ids == '[]' then return {0, status, 'the track has no chain'} end
if event == 'retry' and redis.call('EXISTS', K.cancel(job_id)) == 1 then
  local open = tonumber(redis.call('HGET', job_key, 'n_waiting') or '0') +
               tonumber(redis.call('HGET', job_key, 'n_active') or '0')
  if open > 0 then return {0, status, 'the job is still being canceled'} end
  redis.call('DEL', K.cancel(job_id))  -- a retried job is no longer canceled
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
-- Every death of the track's stage counts once, whoever notices it: the reaper (a `restart`, its lease expired) or
-- the next delivery of the same message (a `start` or the worker's `fail` with `died`: the delivery before it died).
-- A restart past the limit fails the track, counted in deaths (a track can also die by redeliveries in between).
local deaths = tonumber(redis.call('HGET', key, 'deaths') or '0')
local died = event == 'restart' or ((event == 'start' or event == 'fail') and a.died == true)
if event == 'restart' and (restarts >= tonumber(a.max_restarts or '1000000')
                           or deaths >= tonumber(a.max_restarts or '1000000')) then
  target = 'failed'
  fields.error = a.give_up or 'restarted too many times'
  fields.detail = 'failed'
end
if rule.cancel and not is_terminal(target) and redis.call('EXISTS', K.cancel(job_id)) == 1 then
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
  if s == 'created' then redis.call('ZREM', K.created(), m) end
  if s == 'parked' then redis.call('ZREM', K.unrouted(), m) end
  if s == 'queued' then redis.call('ZREM', K.waiting(q), m) end
  if in_load(s) and redis.call('ZREM', K.load(q), m) == 1 then
    redis.call('DECRBY', K.cost(q), milli)
  end
  if in_load(s) then backlog_leave(K, q, m) end
  if split(s) == 'running' then
    local w = redis.call('HGET', key, 'worker') or ''
    local ck = K.worker_current(w)
    if redis.call('HGET', ck, 'job_id') == job_id and redis.call('HGET', ck, 'track') == track then
      redis.call('DEL', ck)
    end
  end
end
-- parked and queued tracks: the job's priority first, then its place on q (the fair tag, or where q's worker runs
-- no engine the submission number: lua/backlog_write.lua's place_on)
local function order(q)
  local rank = tonumber(RANK[redis.call('HGET', job_key, 'priority') or ''] or DEFAULT_RANK)
  return string.format('%.0f', rank * RANK_SPAN + place_on(K, q, seq, redis.call('HGET', key, 'fifo')))
end
local function enter(s, q)
  if s == 'created' then redis.call('ZADD', K.created(), now, m) end
  if s == 'parked' then redis.call('ZADD', K.unrouted(), order(''), m) end
  if s == 'queued' then
    redis.call('ZADD', K.waiting(q), order(q), m)
    redis.call('SADD', K.queues(), q)
  end
  if in_load(s) and redis.call('ZADD', K.load(q), cost, m) == 1 then
    redis.call('INCRBY', K.cost(q), milli)
  end
end

local fifo = nil  -- a new track's submission number
-- a new track's fair tag (app/core/priority.py): its tenant's next round, never behind the round that runs now
local function fair_tag()
  local tenant = redis.call('HGET', job_key, 'tenant') or DEFAULT_TENANT
  local round = math.max(tonumber(redis.call('GET', K.fair_now()) or '0'),
                         tonumber(redis.call('HGET', K.fair_last(), tenant) or '-1') + 1)
  redis.call('HSET', K.fair_last(), tenant, round)
  return round * FAIR_SPAN + fifo % FAIR_SPAN
end

if event == 'submit' then
  fifo = redis.call('INCR', K.seq())
  seq = fair_tag()
  cost = tonumber(a.cost or '0')
  milli = math.floor(cost * 1000 + 0.5)
  redis.call('HSET', key, 'track', track, 'seq', seq, 'fifo', fifo, 'cost', cost, 'queue', '', 'worker', '', 'task_ids', '[]',
             'restarts', 0, 'deaths', 0, 'retries', 0, 'attempts', 0, 'stage', '', 'error', '', 'progress', '0.0', 'artifacts', '[]',
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
if status == 'queued' and tk == 'running' then  -- the fair round now: the latest started track's
  local round = math.floor(tonumber(seq) / FAIR_SPAN)
  if round > tonumber(redis.call('GET', K.fair_now()) or '0') then redis.call('SET', K.fair_now(), round) end
end
if tk == 'running' then
  if event == 'start' or event == 'adopt' then
    redis.call('SET', lease_key, owner, 'PX', a.lease_ms)
    redis.call('HSET', key, 'worker', a.worker)
  end
  if event == 'start' then  -- an adopted track rides along; the worker's current stage is its own track's
    redis.call('HSET', K.worker_current(a.worker), 'job_id', job_id, 'track', track, 'stage', ts,
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
  return overall_state(c)
end
local before_cat, after_cat = category(status), category(target)
local job_before, job_after = nil, nil
if before_cat ~= after_cat then
  local before = overall()
  if before_cat then redis.call('HINCRBY', job_key, 'n_' .. before_cat, -1) end
  redis.call('HINCRBY', job_key, 'n_' .. after_cat, 1)
  local after = overall()
  job_before, job_after = before, after
  local open_before = before_cat == 'waiting' or before_cat == 'active'
  local open_after = after_cat == 'waiting' or after_cat == 'active'
  if open_before ~= open_after then  -- the owner's open tracks (app/control/tenant_limits.py), scored by expiry
    local owned = K.tenant_open(redis.call('HGET', job_key, 'tenant') or DEFAULT_TENANT)
    if open_after then redis.call('ZADD', owned, redis.call('HGET', job_key, 'expires_at'), m)
    else redis.call('ZREM', owned, m) end
  end
  if before ~= after then
    local expires = redis.call('HGET', job_key, 'expires_at')
    if before then redis.call('ZREM', K.jobs_in_state(kind, before), job_id) end
    redis.call('ZADD', K.jobs_in_state(kind, after), expires, job_id)
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
if died then redis.call('HSET', key, 'deaths', deaths + 1) end
if event == 'retry' then
  redis.call('HINCRBY', key, 'retries', 1)
  redis.call('HSET', key, 'restarts', 0, 'deaths', 0, 'worker', '')
end
for name, value in pairs(fields) do redis.call('HSET', key, name, value) end
if (target ~= status or new_queue ~= queue) and in_load(target) then  -- from the hash as it now is
  backlog_enter(K, new_queue, m)
elseif tk == 'running' and (event == 'start' or event == 'adopt' or fields.progress) then
  backlog_touch(K, new_queue, m)  -- started again where it ran, or reported progress
end
local version = redis.call('HINCRBY', key, 'version', 1)
-- the poll's view of the track (lua/job_view.lua), rendered with the write; a job without a view gets it whole
if redis.call('HEXISTS', K.job_view(job_id), 'head') == 1 then view_track(K, job_id, track) else view_render(K, job_id) end

-- the event: appended to the job's stream (replayed to a client that resumes) and published, in this step
local h = redis.call('HMGET', key, 'progress', 'detail', 'error')
local payload = {job_id = job_id, track = tonumber(track), event = event, status = target, state = state,
  stage = new_stage, progress = tonumber(h[1]), detail = h[2], error = h[3], version = version,
  job_state = overall() or 'queued'}
local stream = K.event_stream(job_id)
payload.id = redis.call('XADD', stream, 'MAXLEN', tonumber(ARGV[8] or '1000'), '*', 'data', cjson.encode(payload))
local ttl = redis.call('TTL', job_key)
if ttl > 0 then redis.call('EXPIRE', stream, ttl) end
redis.call('PUBLISH', K.events(job_id), cjson.encode(payload))

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
    local n = redis.call('INCR', K.webhook_seq())
    redis.call('RPUSH', K.webhook_outbox(), cjson.encode({id = 'msg_' .. job_id .. '_' .. n, type = wtype,
      job_id = job_id, at = tonumber(now), data = payload}))
    redis.call('LTRIM', K.webhook_outbox(), -100000, -1)
  end
end
return {result, target, ''}
