-- Release a lock only if it is still the caller's (its token): a holder whose lock expired and was taken by
-- another must not free the new holder's.
-- KEYS: the lock. ARGV: the caller's token.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
