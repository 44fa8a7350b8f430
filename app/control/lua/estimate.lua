-- ---- estimates over the backlog index (app/control/backlog.py) ----
local function group_order(g) return GROUP_ORDER[g] or 5 end
local function parse_entry(value)
  local group, cls, milli, seq, rest = string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)(.*)$')
  local e = {group = group, cls = cls, milli = tonumber(milli), seq = tonumber(seq), started = '', progress = '0'}
  if rest ~= '' then e.started, e.progress = string.match(rest, '^|([^|]*)|(.*)$') end
  return e
end

-- An estimator at time `now` reading the first `heads` running tracks of each queue (K: the script's key table).
local function estimator(K, now, heads)
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
      local h = redis.call('HMGET', K.throughput(), unpack(fields))
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
    local base = K.backlog(q)
    local Q = {sums = {}, heads = {}, base = base, tree = K.backlog_tree(q)}
    local sums = redis.call('HGETALL', K.backlog_sums(q))
    for i = 1, #sums, 2 do Q.sums[sums[i]] = tonumber(sums[i + 1]) end
    local running = heads > 0 and redis.call('ZRANGE', K.running(q), 0, heads - 1) or {}
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
        for _, v in ipairs(redis.call('HMGET', Q.tree, unpack(fields))) do
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
