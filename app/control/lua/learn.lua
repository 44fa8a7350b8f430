-- KEYS[1]: the throughput hash; KEYS[2]: the estimates' versions (a new rate ends every cached ETA).
-- ARGV: field (queue|kind|stage), seconds per cost unit, weight of the new sample, cold (1: the stage also loaded
-- models, a one-off that only stands in until a sample without loads comes).
local RATE_SPREAD = 2  -- a sample counts as at most twice, or half, the mean it updates
-- Also keeps the fleet's sum and count of the (kind, stage) rates ("*|kind|stage|sum" and "|queues"), so an
-- estimate reads the mean a queue borrows without reading every queue's rates.
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
local was_cold = redis.call('HGET', KEYS[1], ARGV[1] .. '|cold') == '1'
local sample, alpha, cold = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1'
local new = sample
if old and cold then return tostring(old) end
if old and not was_cold then  -- one run moves the mean by at most alpha * (SPREAD - 1): a slow moment (the card
  -- shared with other work) does not make the queue look slow for long; a lasting change is learned over runs
  local bounded = math.min(math.max(sample, old / RATE_SPREAD), old * RATE_SPREAD)
  new = alpha * bounded + (1 - alpha) * old
end
local fleet = '*|' .. string.match(ARGV[1], '^[^|]*|(.*)$')
if not redis.call('HGET', KEYS[1], fleet .. '|queues') then  -- first count (or rates learned before the count)
  local sum, n, suffix = 0, 0, '|' .. string.match(ARGV[1], '^[^|]*|(.*)$')
  local flat = redis.call('HGETALL', KEYS[1])
  for i = 1, #flat, 2 do
    local name = flat[i]
    if string.sub(name, 1, 1) ~= '*' and string.sub(name, -#suffix) == suffix and
       not string.find(string.sub(name, 1, #name - #suffix), '|', 1, true) then
      sum, n = sum + tonumber(flat[i + 1]), n + 1
    end
  end
  redis.call('HSET', KEYS[1], fleet .. '|sum', string.format('%.17g', sum), fleet .. '|queues', n)
end
redis.call('HINCRBYFLOAT', KEYS[1], fleet .. '|sum', string.format('%.17g', new - (old or 0)))
if not old then redis.call('HINCRBY', KEYS[1], fleet .. '|queues', 1) end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.17g', new), ARGV[1] .. '|cold', cold and '1' or '0')
redis.call('HINCRBY', KEYS[1], ARGV[1] .. '|n', 1)
redis.call('HINCRBY', KEYS[2], 'rates', 1)
return tostring(new)
