-- ARGV: prefix, job id, JSON field names (comma-separated); for the ETA too: running heads, now. The job, its
-- tracks with queue positions and their workers' status, the cancel flag (and the job's ETA): one JSON document,
-- built here so that Python parses it once. Track fields stored as JSON are spliced in as they are (cjson would
-- turn their empty lists into {}); hash order is kept.
local K, job_id = keys_under(ARGV[1]), ARGV[2]
local json_field = {}
for name in string.gmatch(ARGV[3], '[^,]+') do json_field[name] = true end
local job_key = K.job(job_id)
local function to_table(flat) local t = {}; for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end; return t end
local job = to_table(redis.call('HGETALL', job_key))
if not job.kind then return false end
local tracks = {}
local states = {}  -- {index, status, queue} of each track, for the ETA
for i = 0, tonumber(job.num_tracks) - 1 do
  local flat = redis.call('HGETALL', K.track(job_id, i))
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
    if t.status == 'queued' then rank = redis.call('ZRANK', K.waiting(t.queue), m)
    elseif t.status == 'parked' then rank = redis.call('ZRANK', K.unrouted(), m) end
    parts[#parts + 1] = '"queue_position":' .. (rank and (rank + 1) or 0)
    local open = not is_terminal(t.status)
    if open and t.worker and t.worker ~= '' then
      local status = 'idle'
      if redis.call('EXISTS', K.worker(t.worker)) == 0 then status = 'offline'
      elseif redis.call('EXISTS', K.worker_current(t.worker)) == 1 then status = 'busy' end
      parts[#parts + 1] = '"worker_status":"' .. status .. '"'
    end
    tracks[#tracks + 1] = '{' .. table.concat(parts, ',') .. '}'
  end
end
local eta = ''
if ARGV[5] and ARGV[5] ~= '' then  -- the job's ETA at time ARGV[5], in this same step (app/control/backlog.py)
  local seconds = estimator(K, tonumber(ARGV[5]), tonumber(ARGV[4])).job_eta(job_id, states)
  eta = ',"eta_s":' .. (seconds and string.format('%.17g', seconds) or 'null')
end
return '{"job":' .. cjson.encode(job) .. ',"tracks":[' .. table.concat(tracks, ',') .. '],"cancel":' ..
  redis.call('EXISTS', K.cancel(job_id)) .. eta .. '}'
