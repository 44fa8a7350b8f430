-- ARGV: prefix, now, spec (JSON: parts [name...], states [[kind, state]...], stages [[kind, stage]...],
-- lists [suffix...]). What the status page, /metrics and Khala's /status show, in one round trip; each view asks
-- only for the parts it shows (workers, queues, jobs, submitted, stages, rates), so a cheap view stays cheap.
local K, now = keys_under(ARGV[1]), ARGV[2]
local spec = cjson.decode(ARGV[3])
local wanted = {}
for _, part in ipairs(spec.parts) do wanted[part] = true end
local function to_table(flat) local t = {}; for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end; return t end
local out = {workers = {}, queues = {}, jobs = {}, stages = {}}
local known = {}
if wanted.workers or wanted.queues then
  local names = redis.call('SMEMBERS', K.workers())
  table.sort(names)
  for _, name in ipairs(names) do
    local info = to_table(redis.call('HGETALL', K.worker(name)))
    for q in string.gmatch(info.queue or '', '[^,]+') do known[q] = true end
    if wanted.workers then
      local current = to_table(redis.call('HGETALL', K.worker_current(name)))
      out.workers[#out.workers + 1] = {name = name, info = info, current = current}
    end
  end
end
if wanted.queues then
  for _, q in ipairs(redis.call('SMEMBERS', K.queues())) do known[q] = true end
  local draining = {}
  for _, q in ipairs(redis.call('SMEMBERS', K.draining())) do draining[q] = true end
  local queues = {}
  for q, _ in pairs(known) do queues[#queues + 1] = q end
  table.sort(queues)
  for _, q in ipairs(queues) do
    local messages = 0
    for _, suffix in ipairs(spec.lists) do messages = messages + redis.call('LLEN', q .. suffix) end
    out.queues[#out.queues + 1] = {name = q, waiting = redis.call('ZCARD', K.waiting(q)),
      outstanding = redis.call('ZCARD', K.load(q)),
      cost = tonumber(redis.call('GET', K.cost(q)) or '0'), broker_messages = messages,
      draining = draining[q] == true}
  end
  out.unrouted = redis.call('ZCARD', K.unrouted())
end
if wanted.jobs then
  for _, pair in ipairs(spec.states) do
    out.jobs[#out.jobs + 1] = redis.call('ZCOUNT', K.jobs_in_state(pair[1], pair[2]), '(' .. now, '+inf')
  end
end
if wanted.submitted then out.submitted = to_table(redis.call('HGETALL', K.submitted())) end
if wanted.stages then
  for _, pair in ipairs(spec.stages) do
    out.stages[#out.stages + 1] = to_table(redis.call('HGETALL', K.stage_seconds(pair[1], pair[2])))
  end
end
if wanted.rates then out.rates = to_table(redis.call('HGETALL', K.throughput())) end
return cjson.encode(out)
