-- KEYS[1]: a flag key. ARGV: value, ttl seconds. SET NX EX past maxmemory; 1 if it was set.
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) and 1 or 0
