-- ---- a job's view: the poll's reply, rendered by the writes (app/control/views.py says why) ----
-- The hash K.job_view(job_id) holds what a client's poll shows of the job that changes only when the job is
-- written: `head` (the record's first fields, up to `"tracks":[`), `hook` (its webhook's, up to `"deliveries":[`;
-- only for a job that has one), `tenant` (its owner; absent when the job names none), `n` (its number of tracks),
-- and per track n: `m<n>` (JSON [status, state, queue, worker]: what the read needs to add the rest), `a<n>`
-- (its stored fields as JSON, hash order, without VIEW_HIDDEN) and `b<n>` (its seed and download links). The read
-- (read_job.lua) adds what moves without a write to the job: queue positions, workers' status, the cancel flag,
-- webhook deliveries and the ETA, which it caches in the field `eta` (lua/estimate.lua's cached_job_eta).
-- VIEW_JSON, VIEW_HIDDEN and VIEW_URL are generated from Python (app/control/views.lua_view).

-- A client's download links from a track's artifacts (harness/records.download_urls is the reference): output.mp4, and
-- [track]<n>.mp3|wav with n a plain number below 1000; a later name of the same format wins, in the first's place.
local function view_downloads(job_id, artifacts_json)
  local order, urls = {}, {}
  local ok, names = pcall(cjson.decode, artifacts_json or '[]')
  if not ok or type(names) ~= 'table' then names = {} end
  for _, name in ipairs(names) do
    local format, url = nil, nil
    if name == 'output.mp4' then
      format, url = 'mp4', VIEW_URL .. job_id .. '/video.mp4'
    elseif type(name) == 'string' then
      local file = string.sub(name, 1, 5) == 'track' and string.sub(name, 6) or name
      local n, ext = string.match(file, '^(%d+)%.(%w+)$')
      if n and #n <= 3 and (n == '0' or string.sub(n, 1, 1) ~= '0') and (ext == 'mp3' or ext == 'wav') then
        format, url = ext, VIEW_URL .. job_id .. '/tracks/' .. file
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

-- Track i's part of the view, from its hash as it now is (its fields gone when the hash is).
local function view_track(K, job_id, i)
  local view = K.job_view(job_id)
  local flat = redis.call('HGETALL', K.track(job_id, i))
  local t, parts = {}, {}
  for j = 1, #flat, 2 do
    local name, value = flat[j], flat[j + 1]
    t[name] = value
    if not VIEW_HIDDEN[name] then  -- field names are ours: plain identifiers; JSON fields are spliced in as they are
      parts[#parts + 1] = '"' .. name .. '":' .. (VIEW_JSON[name] and value or cjson.encode(value))
    end
  end
  if not t.status then
    redis.call('HDEL', view, 'm' .. i, 'a' .. i, 'b' .. i)
    return
  end
  local ok, params = pcall(cjson.decode, t.params or '{}')
  local seed = ok and type(params) == 'table' and params.seed or nil
  local seed_text = (seed == nil or seed == cjson.null) and 'null' or cjson.encode(seed)
  redis.call('HSET', view, 'm' .. i, cjson.encode({t.status, t.state or '', t.queue or '', t.worker or ''}),
             'a' .. i, table.concat(parts, ','),
             'b' .. i, '"seed":' .. seed_text .. ',"downloads":' .. view_downloads(job_id, t.artifacts))
end

-- The job's part of the view, from its hash; returns its number of tracks (false when the job is gone). The view
-- expires with the job.
local function view_job(K, job_id)
  local view = K.job_view(job_id)
  local flat = redis.call('HGETALL', K.job(job_id))
  local job = {}
  for j = 1, #flat, 2 do job[flat[j]] = flat[j + 1] end
  if not job.kind then return false end
  local n = job.num_tracks or '0'  -- (every job has its fields: a transition must not fail on one that lacks them)
  redis.call('HSET', view, 'head', '{"job_id":' .. cjson.encode(job_id) .. ',"kind":' .. cjson.encode(job.kind) ..
    ',"params":' .. (job.params or 'null') .. ',"num_tracks":' .. n .. ',"created_at":' ..
    (job.created_at or 'null') .. ',"expires_at":' .. (job.expires_at or 'null') .. ',"tracks":[', 'n', n)
  if job.tenant then redis.call('HSET', view, 'tenant', job.tenant) else redis.call('HDEL', view, 'tenant') end
  if job.webhook and job.webhook ~= '' then
    local events = {}
    for name in string.gmatch(job.webhook_events or '', '[^,]+') do events[#events + 1] = cjson.encode(name) end
    redis.call('HSET', view, 'hook', ',"webhook":{"url":' .. cjson.encode(job.webhook) .. ',"events":[' ..
               table.concat(events, ',') .. '],"deliveries":[')
  else
    redis.call('HDEL', view, 'hook')
  end
  local ttl = redis.call('PTTL', K.job(job_id))
  if ttl > 0 then redis.call('PEXPIRE', view, ttl) end
  return tonumber(n)
end

-- The whole view anew: the job's part and every track's, its cached ETA dropped (false when the job is gone).
local function view_render(K, job_id)
  redis.call('DEL', K.job_view(job_id))
  local n = view_job(K, job_id)
  if not n then return false end
  for i = 0, n - 1 do view_track(K, job_id, i) end
  return true
end
