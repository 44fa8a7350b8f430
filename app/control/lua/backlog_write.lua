-- ---- the backlog index (app/control/backlog.py): write side. Its functions take the script's key table K
-- (keys_under, app/core/keys.py) and the queue. ----
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
-- Every change of q's members (not of a running track's progress) counts in K.estimate_versions: the poll's cached
-- ETA (lua/estimate.lua's cached_job_eta) holds while the count does.
local function backlog_changed(K, q) redis.call('HINCRBY', K.estimate_versions(), 'q:' .. q, 1) end
local function backlog_add(K, q, m, group, cls, milli, seq, extras)
  local base = K.backlog(q)
  backlog_changed(K, q)
  redis.call('HSET', base, m, group .. '|' .. cls .. '|' .. string.format('%.0f', milli) .. '|' ..
             string.format('%.0f', seq) .. extras)
  if milli ~= 0 then
    tree_add(K.backlog_tree(q), group .. '|' .. cls .. '|', seq, milli)
    hincr_or_drop(K.backlog_sums(q), group .. '|' .. cls, milli)
  end
  if group == 'r' then redis.call('ZADD', K.running(q), seq, m) end
end
-- Take a track out of q's backlog: exactly what it added (nothing when it added nothing).
local function backlog_leave(K, q, m)
  local base = K.backlog(q)
  local entry = redis.call('HGET', base, m)
  if not entry then return end
  backlog_changed(K, q)
  local group, cls, milli, seq = string.match(entry, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)')
  milli, seq = tonumber(milli), tonumber(seq)
  if milli ~= 0 then
    tree_add(K.backlog_tree(q), group .. '|' .. cls .. '|', seq, -milli)
    hincr_or_drop(K.backlog_sums(q), group .. '|' .. cls, -milli)
  end
  redis.call('HDEL', base, m)
  if group == 'r' then redis.call('ZREM', K.running(q), m) end
end
-- A track's place in q's order (app/core/priority.py), from its fair tag `seq` and its submission number `fifo`:
-- the fair tag where q's worker runs the backbone engine (it admits in that order), the submission number where
-- it does not (that worker takes the broker's FIFO, and a queue position says what it does). Parked: the fair tag.
local function place_on(K, q, seq, fifo)
  if q == '' or not fifo or tonumber(redis.call('GET', K.queue_slots(q)) or '1') > 1 then return tonumber(seq) end
  return tonumber(fifo)
end
-- Put a track into q's backlog as its hash now says (status, stages, cost, place, progress; its job's kind and
-- priority).
local function backlog_enter(K, q, m)
  local job_id, track = track_parts(m)
  local job_key = K.job(job_id)
  local h = redis.call('HMGET', K.track(job_id, track), 'status', 'stages', 'cost', 'seq', 'progress', 'fifo')
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
    index = first_unfinished(names, h[2])
  end
  local milli = math.floor(tonumber(h[3] or '0') * 1000 + 0.5)
  local extras = group == 'r' and running_extras(h[2], stage, h[5]) or ''
  backlog_add(K, q, m, group, j[1] .. ':' .. index, milli, place_on(K, q, h[4] or '0', h[6]), extras)
end
-- A running track that stays where it is but started again or reported progress: its entry's extras anew.
local function backlog_touch(K, q, m)
  local base = K.backlog(q)
  local entry = redis.call('HGET', base, m)
  local head = entry and string.match(entry, '^(r|[^|]*|[^|]*|[^|]*)')
  if not head then return end
  local job_id, track = track_parts(m)
  local h = redis.call('HMGET', K.track(job_id, track), 'status', 'stages', 'progress')
  local stage = string.match(h[1] or '', '^running:(.*)$')
  if stage then redis.call('HSET', base, m, head .. running_extras(h[2], stage, h[3])) end
end
