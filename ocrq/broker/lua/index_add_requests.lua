-- KEYS: counts hash. ARGV: store puts, gets.
redis.call('HINCRBY', KEYS[1], 'store_puts', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'store_gets', ARGV[2])
return 1
