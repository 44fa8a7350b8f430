-- KEYS: a worker's heartbeat hash. ARGV: the kinds whose models its child loaded, that child's pid, the
-- hash's expiry in seconds (set only when it has none: a record before the first heartbeat must still expire).
redis.call('HSET', KEYS[1], 'models_loaded', ARGV[1], 'models_pid', ARGV[2])
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
