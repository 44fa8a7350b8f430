-- The leases of webhook deliveries handed to Celery (app/adapters/webhooks.py). Each pending message has a
-- record {message, attempt, task} (the Celery task id of its current attempt) and a deadline: when its attempt
-- must have settled, or its next attempt begun. Only the current task may act on a message, so a stale Celery
-- message (kombu restores a killed worker's after its visibility timeout) does nothing.
-- ARGV: prefix, op, then per op:
--   register   id, record (JSON), deadline         a new message, or one the outbox handed out again
--   claim      id, task, deadline                  the current attempt begins: 1, or 0 when `task` is stale
--   settle     id, task                            delivered or given up: forgotten (1), or 0 when stale
--   reschedule id, task, new task, attempt, deadline  a retry: the next attempt is `new task` (1), or 0
--   overdue    now, lease, limit, new task ids...  messages past their deadline, given to new tasks: their
--                                                  records (JSON), each now held by the next of the new ids
local K, op = keys_under(ARGV[1]), ARGV[2]
local pending, data = K.webhook_pending(), K.webhook_pending_data()

local function current(id)
  local raw = redis.call('HGET', data, id)
  return raw and cjson.decode(raw)
end

if op == 'register' then
  redis.call('HSET', data, ARGV[3], ARGV[4])
  redis.call('ZADD', pending, ARGV[5], ARGV[3])
  return 1
end
if op == 'overdue' then
  local now, lease, limit = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local out, next_id = {}, 6
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', pending, '-inf', now, 'LIMIT', 0, limit)) do
    local record = current(id)
    if not record then
      redis.call('ZREM', pending, id)
    elseif ARGV[next_id] then
      record.task = ARGV[next_id]
      next_id = next_id + 1
      local text = cjson.encode(record)
      redis.call('HSET', data, id, text)
      redis.call('ZADD', pending, now + lease, id)
      out[#out + 1] = text
    end
  end
  return out
end

local id, task = ARGV[3], ARGV[4]
local record = current(id)
if not record or record.task ~= task then return 0 end
if op == 'claim' then
  redis.call('ZADD', pending, ARGV[5], id)
elseif op == 'settle' then
  redis.call('HDEL', data, id)
  redis.call('ZREM', pending, id)
elseif op == 'reschedule' then
  record.task, record.attempt = ARGV[5], tonumber(ARGV[6])
  redis.call('HSET', data, id, cjson.encode(record))
  redis.call('ZADD', pending, ARGV[7], id)
else
  return redis.error_reply('unknown op ' .. op)
end
return 1
