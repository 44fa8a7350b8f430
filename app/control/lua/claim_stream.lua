-- Claim (or refresh) one open event stream in its tenant's set, atomically, so that several events-server processes
-- share one cap: members are scored by the time they expire, and a member not refreshed by then (its process died)
-- is dropped before counting. The set itself expires when no stream refreshes it.
-- ARGV: prefix, tenant, member, now (ms), the member's expiry (ms), the cap, the set's time to live (ms).
-- Returns 1 when the stream holds a slot, 0 when the tenant's open streams already reach the cap.
local K = keys_under(ARGV[1])
local key = K.tenant_streams(ARGV[2])
redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[4])
if not redis.call('ZSCORE', key, ARGV[3]) and redis.call('ZCARD', key) >= tonumber(ARGV[6]) then
  return 0
end
redis.call('ZADD', key, ARGV[5], ARGV[3])
redis.call('PEXPIRE', key, ARGV[7])
return 1
