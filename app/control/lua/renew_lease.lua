-- Extend a lease only if it is still the caller's: a stage whose lease expired and was taken must not revive it.
-- KEYS: the lease. ARGV: the caller's owner string, the new expiry in milliseconds.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
