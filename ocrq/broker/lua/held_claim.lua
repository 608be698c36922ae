-- KEYS[1]: the held set; ARGV: ttl, then the tags. Replaces the claim (past maxmemory: a claim
-- that lapsed would have a live worker's messages restored and run twice).
redis.call('DEL', KEYS[1])
if #ARGV > 1 then
  redis.call('SADD', KEYS[1], unpack(ARGV, 2))
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return 1
