-- ARGV: prefix, job id, JSON field names (comma-separated); for the ETA too: running heads, now; for a client's
-- view: the download URL base, the track fields clients never see (comma-separated), the tenant asking (empty: an
-- admin, who sees every job) and the tenant of a job that names none (app/core/tenants.py).
-- Without the last two: the job, its tracks with queue positions and their workers' status, the cancel flag (and
-- the job's ETA): one JSON document, built here so that Python parses it once. With them: the record exactly as a
-- poll answers it (app/http/jobs.public_record is the reference; a parity test holds them together), so the web
-- serves this text as it is, with no parse and no second encoding. Track fields stored as JSON are spliced in as
-- they are (cjson would turn their empty lists into {}); hash order is kept.
local K, job_id = keys_under(ARGV[1]), ARGV[2]
local json_field = {}
for name in string.gmatch(ARGV[3], '[^,]+') do json_field[name] = true end
local url_base = ARGV[6]
local public = url_base ~= nil and url_base ~= ''
local hidden = {}
if public then for name in string.gmatch(ARGV[7] or '', '[^,]+') do hidden[name] = true end end
local job_key = K.job(job_id)
local function to_table(flat) local t = {}; for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end; return t end
local job = to_table(redis.call('HGETALL', job_key))
if not job.kind then return false end
if public and ARGV[8] ~= '' and (job.tenant or ARGV[9]) ~= ARGV[8] then return false end  -- as if it did not exist

-- A client's download links from a track's artifacts (app/http/jobs.download_urls): output.mp4, and
-- [track]<n>.mp3|wav with n a plain number below 1000; a later name of the same format wins, in the first's place.
local function downloads(artifacts_json)
  local order, urls = {}, {}
  for _, name in ipairs(cjson.decode(artifacts_json or '[]')) do
    local format, url = nil, nil
    if name == 'output.mp4' then
      format, url = 'mp4', url_base .. job_id .. '/video.mp4'
    else
      local file = string.sub(name, 1, 5) == 'track' and string.sub(name, 6) or name
      local n, ext = string.match(file, '^(%d+)%.(%w+)$')
      if n and #n <= 3 and (n == '0' or string.sub(n, 1, 1) ~= '0') and (ext == 'mp3' or ext == 'wav') then
        format, url = ext, url_base .. job_id .. '/tracks/' .. file
      end
    end
    if format then
      if not urls[format] then order[#order + 1] = format end
      urls[format] = url
    end
  end
  local parts = {}
  for _, format in ipairs(order) do parts[#parts + 1] = '"' .. format .. '":' .. cjson.encode(urls[format]) end
  return '{' .. table.concat(parts, ',') .. '}'
end

local tracks = {}
local states = {}  -- {index, status, queue} of each track, for the ETA
local displayed = {}  -- each track's display state, for the job's overall state
local waiting_at = false  -- the best queue position of a track waiting on a queue
for i = 0, tonumber(job.num_tracks) - 1 do
  local flat = redis.call('HGETALL', K.track(job_id, i))
  local t = to_table(flat)
  if t.status then
    states[#states + 1] = {i, t.status, t.queue or ''}
    displayed[#displayed + 1] = t.state or ''
    local parts = {}
    for j = 1, #flat, 2 do
      if not hidden[flat[j]] then
        local value = json_field[flat[j]] and flat[j + 1] or cjson.encode(flat[j + 1])
        parts[#parts + 1] = '"' .. flat[j] .. '":' .. value  -- field names are ours: plain identifiers
      end
    end
    local m = job_id .. ':' .. i
    local rank = false
    if t.status == 'queued' then rank = redis.call('ZRANK', K.waiting(t.queue), m)
    elseif t.status == 'parked' then rank = redis.call('ZRANK', K.unrouted(), m) end
    local position = rank and (rank + 1) or 0
    parts[#parts + 1] = '"queue_position":' .. position
    if t.state == 'queued' and (not waiting_at or position < waiting_at) then waiting_at = position end
    local open = not is_terminal(t.status)
    if open and t.worker and t.worker ~= '' then
      local status = 'idle'
      if redis.call('EXISTS', K.worker(t.worker)) == 0 then status = 'offline'
      elseif redis.call('EXISTS', K.worker_current(t.worker)) == 1 then status = 'busy' end
      parts[#parts + 1] = '"worker_status":"' .. status .. '"'
    end
    if public then
      local params = cjson.decode(t.params or '{}')
      local seed = type(params) == 'table' and params.seed or nil
      parts[#parts + 1] = '"seed":' .. ((seed == nil or seed == cjson.null) and 'null' or cjson.encode(seed))
      parts[#parts + 1] = '"downloads":' .. downloads(t.artifacts)
    end
    tracks[#tracks + 1] = '{' .. table.concat(parts, ',') .. '}'
  end
end
local eta = ''
local seconds = false
if ARGV[5] and ARGV[5] ~= '' then  -- the job's ETA at time ARGV[5], in this same step (app/control/backlog.py)
  seconds = estimator(K, tonumber(ARGV[5]), tonumber(ARGV[4])).job_eta(job_id, states)
  eta = ',"eta_s":' .. (seconds and string.format('%.17g', seconds) or 'null')
end
local cancel = redis.call('EXISTS', K.cancel(job_id))
if not public then
  return '{"job":' .. cjson.encode(job) .. ',"tracks":[' .. table.concat(tracks, ',') .. '],"cancel":' .. cancel ..
    eta .. '}'
end

-- The job's overall state from its tracks' display states (app/control/jobs.overall_state).
local function overall(names)
  if #names == 0 then return 'failed' end
  local all_queued, seen, kinds = true, {}, 0
  for _, s in ipairs(names) do if s ~= 'queued' then all_queued = false end end
  if all_queued then return 'queued' end
  for _, s in ipairs(names) do
    if not is_terminal(s) then return 'running' end
    if not seen[s] then seen[s] = true; kinds = kinds + 1 end
  end
  if kinds == 1 then return names[1] end
  if seen.done then return 'partial' end
  return seen.canceled and 'canceled' or 'failed'
end

local out = {
  '{"job_id":', cjson.encode(job_id), ',"kind":', cjson.encode(job.kind), ',"params":', job.params,
  ',"num_tracks":', job.num_tracks, ',"created_at":', job.created_at, ',"expires_at":', job.expires_at,
  ',"tracks":[', table.concat(tracks, ','), '],"state":"', overall(displayed), '","queue_position":',
  tostring(waiting_at or 0), ',"cancel_requested":', cancel == 1 and 'true' or 'false',
}
if job.webhook and job.webhook ~= '' then
  local events = {}
  for name in string.gmatch(job.webhook_events or '', '[^,]+') do events[#events + 1] = cjson.encode(name) end
  out[#out + 1] = ',"webhook":{"url":' .. cjson.encode(job.webhook) .. ',"events":[' .. table.concat(events, ',') ..
    '],"deliveries":[' .. table.concat(redis.call('LRANGE', K.webhook_deliveries(job_id), 0, -1), ',') .. ']}'
end
out[#out + 1] = ',"eta_s":' .. (seconds and string.format('%.1f', seconds) or 'null') .. '}'
return table.concat(out)
