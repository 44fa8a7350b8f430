-- ARGV: prefix, job id, JSON field names (comma-separated); for the ETA too: running heads, now; '1' for a client's
-- view; the tenant asking (empty: an admin, who sees every job; either reply) and the tenant of a job that names
-- none (app/core/tenants.py); with the ETA, ARGV[9]: seconds after which a queue unseen has no live worker.
-- Without the view: the job, its tracks with queue positions and their workers' status, the cancel flag (and the
-- job's ETA): one JSON document, built here so that Python parses it once. With it: the record exactly as a poll
-- answers it (harness/records.public_record is the reference; a parity test holds them together), so the web serves
-- this text as it is, with no parse and no second encoding: from the job's view (lua/job_view.lua, rendered by
-- the writes) and what moves without a write to the job (queue positions, workers' status, the cancel flag,
-- webhook deliveries, the ETA from its cache). Track fields stored as JSON are spliced in as they are (cjson would
-- turn their empty lists into {}); hash order is kept.
local K, job_id = keys_under(ARGV[1]), ARGV[2]
local function to_table(flat) local t = {}; for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end; return t end

-- track i's place in its queue's waiting order, or among the parked tracks (1 first; 0 for a track in neither)
local function queue_position(i, status, queue)
  local m, rank = job_id .. ':' .. i, false
  if status == 'queued' then rank = redis.call('ZRANK', K.waiting(queue), m)
  elseif status == 'parked' then rank = redis.call('ZRANK', K.unrouted(), m) end
  return rank and (rank + 1) or 0
end

-- a worker's status, for a track whose stage runs (or last ran) on it
local function worker_status(worker)
  if redis.call('EXISTS', K.worker(worker)) == 0 then return 'offline' end
  return redis.call('EXISTS', K.worker_current(worker)) == 1 and 'busy' or 'idle'
end

-- Whether every open track's queue has a live worker (one seen within ARGV[9] s): if not, no worker can take
-- the track and the job's ETA is unknown (null), not a number that stays put while nothing runs.
local function queues_live(states, now)
  local window, seen = tonumber(ARGV[9]), {}
  for _, t in ipairs(states) do
    local queue = t[3]
    if not is_terminal(t[2]) and queue ~= '' and seen[queue] == nil then
      local at = tonumber(redis.call('GET', K.queue_live_at(queue)) or '')
      seen[queue] = at ~= nil and now - at <= window
      if not seen[queue] then return false end
    end
  end
  return true
end

-- Whether the job exists and the asking tenant (ARGV[7]; empty or none: anyone) may see it, first, for either
-- reply, by one read that is the same for another tenant's job as for none: any more work for a real id would let
-- another tenant time which ids exist.
local owner = redis.call('HMGET', K.job(job_id), 'tenant', 'kind')
if not owner[2] then return false end
if ARGV[7] and ARGV[7] ~= '' then
  local tenant = owner[1] ~= false and owner[1] ~= '' and owner[1] or ARGV[8]  -- none: older than tenants, the default's
  if tenant ~= ARGV[7] then return false end  -- as if it did not exist
end

if ARGV[6] == '1' then  -- a client's view
  local view_key = K.job_view(job_id)
  local v = to_table(redis.call('HGETALL', view_key))
  if not v.head then  -- written before views existed: rendered now
    if not view_render(K, job_id) then return false end
    v = to_table(redis.call('HGETALL', view_key))
  end
  local tracks, states, displayed, waiting_at = {}, {}, {}, false
  for i = 0, tonumber(v.n) - 1 do
    local meta = v['m' .. i]
    if meta then
      local status, state, queue, worker = unpack(cjson.decode(meta))
      states[#states + 1] = {i, status, queue}
      displayed[#displayed + 1] = state
      local position = queue_position(i, status, queue)
      if state == 'queued' and (not waiting_at or position < waiting_at) then waiting_at = position end
      local parts = {}
      if v['a' .. i] ~= '' then parts[1] = v['a' .. i] end
      parts[#parts + 1] = '"queue_position":' .. position
      if not is_terminal(status) and worker ~= '' then
        parts[#parts + 1] = '"worker_status":"' .. worker_status(worker) .. '"'
      end
      parts[#parts + 1] = v['b' .. i]
      tracks[#tracks + 1] = '{' .. table.concat(parts, ',') .. '}'
    end
  end
  local seconds, fresh = cached_job_eta(K, tonumber(ARGV[5]), tonumber(ARGV[4]), job_id, states, v.eta)
  if fresh then redis.call('HSET', view_key, 'eta', fresh) end
  local live = queues_live(states, tonumber(ARGV[5]))
  if not live then seconds = false end
  local out = {v.head, table.concat(tracks, ','), '],"state":"', overall_of(displayed), '","queue_position":',
    tostring(waiting_at or 0), ',"cancel_requested":',
    redis.call('EXISTS', K.cancel(job_id)) == 1 and 'true' or 'false'}
  if v.hook then
    out[#out + 1] = v.hook .. table.concat(redis.call('LRANGE', K.webhook_deliveries(job_id), 0, -1), ',') .. ']}'
  end
  out[#out + 1] = ',"eta_s":' .. (seconds and string.format('%.1f', seconds) or 'null')
  out[#out + 1] = ',"worker_offline":' .. (live and 'false' or 'true') .. '}'
  return table.concat(out)
end

local json_field = {}
for name in string.gmatch(ARGV[3], '[^,]+') do json_field[name] = true end
local job_key = K.job(job_id)
local job = to_table(redis.call('HGETALL', job_key))
if not job.kind then return false end

local tracks = {}
local states = {}  -- {index, status, queue} of each track, for the ETA
local displayed = {}  -- each track's state as clients see it, for the job's
for i = 0, tonumber(job.num_tracks) - 1 do
  local flat = redis.call('HGETALL', K.track(job_id, i))
  local t = to_table(flat)
  if t.status then
    states[#states + 1] = {i, t.status, t.queue or ''}
    displayed[#displayed + 1] = t.state or ''
    local parts = {}
    for j = 1, #flat, 2 do
      local value = json_field[flat[j]] and flat[j + 1] or cjson.encode(flat[j + 1])
      parts[#parts + 1] = '"' .. flat[j] .. '":' .. value  -- field names are ours: plain identifiers
    end
    parts[#parts + 1] = '"queue_position":' .. queue_position(i, t.status, t.queue)
    if not is_terminal(t.status) and t.worker and t.worker ~= '' then
      parts[#parts + 1] = '"worker_status":"' .. worker_status(t.worker) .. '"'
    end
    tracks[#tracks + 1] = '{' .. table.concat(parts, ',') .. '}'
  end
end
local eta = ''
local seconds = false
if ARGV[5] and ARGV[5] ~= '' then  -- the job's ETA at time ARGV[5], in this same step (app/control/backlog.py)
  seconds = estimator(K, tonumber(ARGV[5]), tonumber(ARGV[4])).job_eta(job_id, states)
  if seconds and not queues_live(states, tonumber(ARGV[5])) then seconds = false end
  eta = ',"eta_s":' .. (seconds and string.format('%.17g', seconds) or 'null')
end
local cancel = redis.call('EXISTS', K.cancel(job_id))
return '{"job":' .. cjson.encode(job) .. ',"tracks":[' .. table.concat(tracks, ',') .. '],"state":"' ..
  overall_of(displayed) .. '","cancel":' .. cancel .. eta .. '}'
