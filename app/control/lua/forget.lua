-- ARGV: prefix, queue, member. A track whose job expired while it was on the queue: out of every set of the
-- queue, its cost counter lowered by what the load set held for it (its hash, and so its cost, is gone).
local K, q, m = keys_under(ARGV[1]), ARGV[2], ARGV[3]
local score = redis.call('ZSCORE', K.load(q), m)
if score and redis.call('ZREM', K.load(q), m) == 1 then
  redis.call('DECRBY', K.cost(q), math.floor(tonumber(score) * 1000 + 0.5))
end
redis.call('ZREM', K.waiting(q), m)
backlog_leave(K, q, m)
return score and 1 or 0
