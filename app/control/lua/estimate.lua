-- ---- estimates over the backlog index (app/control/backlog.py) ----
local function group_order(g) return GROUP_ORDER[g] or 5 end
local function parse_entry(value)
  local group, cls, milli, seq, rest = string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)(.*)$')
  local e = {group = group, cls = cls, milli = tonumber(milli), seq = tonumber(seq), started = '', progress = '0'}
  if rest ~= '' then e.started, e.progress = string.match(rest, '^|([^|]*)|(.*)$') end
  return e
end

local function seconds_text(value) return value and string.format('%.17g', value) or false end

-- what a running track's elapsed time at `now` and its progress make of its stage's whole `estimate`: the
-- correction to add (the seconds left less the estimate). Once the stage has shown its pace (progress at least
-- PACE_FROM), what is left is what that pace leaves, elapsed x (1 - progress) / progress, whatever was learned
-- (a stage slower or faster than the last one of its queue is seen as such: a lip-sync at 60 of 106 frames after
-- 159 s has about 120 s left, not the 2 s a learned 4 s estimate leaves); before that, the estimate less the
-- elapsed time, or less the progress made, whichever leaves more.
local PACE_FROM = 0.1
local function elapsed_correction(estimate, e, now)
  local elapsed = e.started ~= '' and math.max(0, now - tonumber(e.started)) or 0
  local progress = math.min(math.max(tonumber(e.progress) or 0, 0), 1)
  if progress >= PACE_FROM and elapsed > 0 then return elapsed * (1 - progress) / progress - estimate end
  return math.max(estimate - elapsed, estimate * (1 - progress)) - estimate
end

-- a backlog class `kind:index`: its kind, its stage index (0-based) and the kind's stage names; nil for an unknown kind
local function class_parts(cls)
  local kind, index = string.match(cls, '^(.*):(%d+)$')
  local names = STAGES[kind or '']
  if not names then return nil end
  return kind, tonumber(index), names
end

-- An estimator at time `now` reading the first `heads` running tracks of each queue (K: the script's key table).
local function estimator(K, now, heads)
  local E = {}
  local per_unit_cache, from_cache, queues, slots_cache = {}, {}, {}, {}
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
  -- how many tracks q's worker runs through its engine stage at once (its engine's slots; 1 without one)
  function E.slots(q)
    if slots_cache[q] == nil then
      slots_cache[q] = math.max(1, tonumber(redis.call('GET', K.queue_slots(q)) or '1') or 1)
    end
    return slots_cache[q]
  end
  -- the part of a stage's seconds that the tracks behind it wait: 1 / slots for the engine's stage (its tracks
  -- run side by side, the queue drains `slots` of them at a time), else all of it
  function E.share(q, kind, stage)
    if ENGINE_STAGE[kind] == stage then return 1 / E.slots(q) end
    return 1
  end
  -- seconds per cost unit of every stage of kind from index (0-based) on, as the tracks behind wait for them
  function E.seconds_from(q, kind, index)
    local key = q .. '|' .. kind .. '|' .. index
    if from_cache[key] == nil then
      local total, names = 0, STAGES[kind]
      for n = index + 1, #names do total = total + E.per_unit(q, kind, names[n]) * E.share(q, kind, names[n]) end
      from_cache[key] = total
    end
    return from_cache[key]
  end
  -- what a track's own finish adds to its class's seconds: the rest of its engine stage, which it runs whole
  -- (beside the others) when it still has it from its class's stage on
  function E.own_extra(q, e)
    local kind, index, names = class_parts(e.cls)
    local engine = kind and ENGINE_STAGE[kind]
    if not engine then return 0 end
    for n = index + 1, #names do
      if names[n] == engine then
        return E.per_unit(q, kind, engine) * (1 - E.share(q, kind, engine)) * e.milli / 1000
      end
    end
    return 0
  end
  function E.class_seconds(q, cls, milli)
    local kind, index = class_parts(cls)
    if not kind then return 0 end
    return E.seconds_from(q, kind, index) * milli / 1000
  end
  -- a running track's whole estimate for its stage (false for a track that does not run)
  function E.head_estimate(q, e)
    local kind, index, names = class_parts(e.cls)
    if e.group ~= 'r' or not kind then return false end
    return E.per_unit(q, kind, names[index + 1]) * (e.milli / 1000)
  end
  -- a head's stage as the tracks behind it wait for it: its share (1 / slots of the engine's stage)
  function E.head_share(q, e)
    local kind, index, names = class_parts(e.cls)
    return kind and E.share(q, kind, names[index + 1]) or 1
  end
  -- what a running head's elapsed time takes off the seconds the tracks behind it wait (`own`: off its own)
  function E.correction(q, e, own)
    local estimate = E.head_estimate(q, e)
    if not estimate then return 0 end
    return elapsed_correction(estimate, e, now) * (own and 1 or E.head_share(q, e))
  end
  function E.head_correction(q, head)  -- head: {seq, member, entry}, its correction kept as head[4]
    if head[4] == nil then head[4] = E.correction(q, head[3]) end
    return head[4]
  end
  -- q's sums and its heads ({seq, member, entry}), read once
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
          Q.heads[#Q.heads + 1] = {e.seq, running[n], e}
        end
      end
    end
    queues[q] = Q
    return Q
  end
  function E.queue_seconds(q)
    local Q, total = E.queue(q), 0
    for field, milli in pairs(Q.sums) do total = total + E.class_seconds(q, string.match(field, '|(.*)$'), milli) end
    for _, head in ipairs(Q.heads) do total = total + E.head_correction(q, head) end
    return math.max(total, 0)
  end
  -- track m of q's finish in two parts: the seconds of the work it waits for (and its own, its engine stage
  -- whole) as if no running track had started yet, and the running heads it comes after (itself, when it is one),
  -- whose elapsed time comes off; false when it is not in q's backlog
  function E.finish_parts(q, m)
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
    local after = {}
    for _, head in ipairs(Q.heads) do
      if e.group ~= 'r' or head[1] <= e.seq then after[#after + 1] = head end
    end
    return total + E.own_extra(q, e), after
  end
  -- the correction of `head` in the finish of track m: the whole of its own, a share of another's
  function E.correction_in(q, head, m)
    if head[2] == m then return E.correction(q, head[3], true) end
    return E.head_correction(q, head)
  end
  -- seconds until track m of q is done (false when it is not in q's backlog)
  function E.finish(q, m)
    local total, after = E.finish_parts(q, m)
    if not total then return false end
    for _, head in ipairs(after) do total = total + E.correction_in(q, head, m) end
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
  -- job_eta's parts: per open track {queue, finish_parts' seconds, {{member, estimate}, ...} of the heads it
  -- comes after} (numbers as exact text); false where job_eta is false
  function E.job_eta_parts(job_id, tracks)
    local parts = {}
    for _, t in ipairs(tracks) do
      if is_open(t[2]) then
        if t[3] == '' then return false end
        local m = job_id .. ':' .. t[1]
        local total, after = E.finish_parts(t[3], m)
        if not total then return false end
        local heads_after = {}
        for n, head in ipairs(after) do
          local share = head[2] == m and 1 or E.head_share(t[3], head[3])
          heads_after[n] = {head[2], seconds_text(E.head_estimate(t[3], head[3])) or '', seconds_text(share)}
        end
        parts[#parts + 1] = {t[3], seconds_text(total), heads_after}
      end
    end
    return parts
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
    for _, head in ipairs(Q.heads) do corrections[head[2]] = E.head_correction(q, head) end
    for _, row in ipairs(rows) do
      clock = clock + math.max(E.class_seconds(q, row[4].cls, row[4].milli) + (corrections[row[3]] or 0), 0)
      local own = E.own_extra(q, row[4])  -- its engine stage whole, beside what comes after it
      if corrections[row[3]] and own > 0 then
        own = own + E.correction(q, row[4], true) - corrections[row[3]]
      end
      out[#out + 1] = {row[3], string.format('%.17g', clock + math.max(own, 0))}
    end
    return out
  end
  return E
end
-- An estimator's job_eta at `now` (the same number) from `cache` (the text this last returned for the job, or
-- nil) while nothing it was built from changed: the members of its queues' backlogs and the learned rates (counted in
-- K.estimate_versions by lua/backlog_write.lua and lua/learn.lua), its open tracks, `heads`. Only the heads'
-- elapsed time and progress are read anew: a poll's ETA costs one read per queue. Returns the ETA and the
-- cache text to keep (nil while `cache` holds). Builds an estimator only when the cache does not hold.
local function cached_job_eta(K, now, heads, job_id, tracks, cache)
  local fields, signature = {'rates'}, {}
  for _, t in ipairs(tracks) do
    if is_open(t[2]) then
      signature[#signature + 1] = t[1] .. '@' .. t[3]
      if t[3] ~= '' then fields[#fields + 1] = 'q:' .. t[3] end
    end
  end
  local versions = redis.call('HMGET', K.estimate_versions(), unpack(fields))
  for n = 1, #fields do versions[n] = versions[n] or '0' end
  local stamp = heads .. '|' .. table.concat(signature, ',') .. '|' .. table.concat(versions, ',')
  local kept = cache and cjson.decode(cache)
  local fresh = nil
  if not (kept and kept[1] == stamp) then
    kept = {stamp, estimator(K, now, heads).job_eta_parts(job_id, tracks)}
    fresh = cjson.encode(kept)
  end
  if not kept[2] then return false, fresh end
  local members = {}  -- per queue, the heads to read
  for _, part in ipairs(kept[2]) do
    local list = members[part[1]] or {}
    for _, head in ipairs(part[3]) do list[#list + 1] = head[1] end
    members[part[1]] = list
  end
  local entries = {}
  for q, list in pairs(members) do
    if #list > 0 then
      local values = redis.call('HMGET', K.backlog(q), unpack(list))
      for n, member in ipairs(list) do entries[q .. '\n' .. member] = values[n] end
    end
  end
  local eta = 0
  for _, part in ipairs(kept[2]) do
    local total = tonumber(part[2])
    for _, head in ipairs(part[3]) do
      local value = entries[part[1] .. '\n' .. head[1]]
      if not value then  -- cannot be while the stamp holds
        return estimator(K, now, heads).job_eta(job_id, tracks), nil
      end
      if head[2] ~= '' then
        total = total + elapsed_correction(tonumber(head[2]), parse_entry(value), now) * tonumber(head[3] or '1')
      end
    end
    eta = math.max(eta, math.max(total, 0))
  end
  return eta, fresh
end
