-- KEYS: the stage's histogram hash. ARGV: seconds, units, then the labels of the buckets the duration falls in.
-- One step, so that a scrape never sees a run counted in its buckets but not in its sum.
local key, seconds, units = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('HINCRBY', key, ARGV[i], 1) end
redis.call('HINCRBYFLOAT', key, 'sum', ARGV[1])
redis.call('HINCRBY', key, 'count', 1)
if units > 0 then
  redis.call('HINCRBYFLOAT', key, 'units', ARGV[2])
  redis.call('HSET', key, 'last_s_per_unit', string.format('%.9g', seconds / units))
end
