-- ARGV: prefix, now, running heads per queue, what (JSON: {jobs = [id...], queues = [q...], kind, cost,
-- schedules = [q...]}). Per job its ETA, per queue its seconds (and those of a new track of kind and cost),
-- per schedule queue its tracks' finishes: one JSON object, numbers as text (a Lua number would be truncated).
local K = keys_under(ARGV[1])
local E = estimator(K, tonumber(ARGV[2]), tonumber(ARGV[3]))
local what = cjson.decode(ARGV[4])
local out = {jobs = {}, queues = {}, schedules = {}}
for _, job_id in ipairs(what.jobs or {}) do
  local job_key = K.job(job_id)
  local tracks = {}
  for index = 0, tonumber(redis.call('HGET', job_key, 'num_tracks') or '0') - 1 do
    local h = redis.call('HMGET', K.track(job_id, index), 'status', 'queue')
    if h[1] then tracks[#tracks + 1] = {index, h[1], h[2] or ''} end
  end
  out.jobs[job_id] = seconds_text(E.job_eta(job_id, tracks))
end
for _, q in ipairs(what.queues or {}) do
  local new = 0
  if what.kind and STAGES[what.kind] then  -- a new track's own seconds: its engine stage whole
    local cost = tonumber(what.cost)
    new = E.seconds_from(q, what.kind, 0) * cost + E.own_extra(q, {cls = what.kind .. ':0', milli = cost * 1000})
  end
  out.queues[q] = {seconds_text(E.queue_seconds(q)), seconds_text(new)}
end
for _, q in ipairs(what.schedules or {}) do out.schedules[q] = E.schedule(q) end
return cjson.encode(out)
