-- The hot cache's write (worker.cache). KEYS[1]: the state hash (keys.HOT_STATE); KEYS[2]: the
-- generation the caller takes for the current one (keys.hot_generation); KEYS[3]: the one before
-- it. ARGV: that generation's number, half the budget, ttl, entry overhead, then (cache key,
-- value) pairs. When another generation is current, nothing is written: {0, its number} (the
-- caller asks again with its keys). Else the pairs go into the current generation and their bytes
-- are counted; at half the budget the next generation starts and the one before the current goes
-- (UNLINK: freed off Redis's main thread): {1, the generation now current}.
local gen = tonumber(redis.call('HGET', KEYS[1], 'gen') or '0')
if gen ~= tonumber(ARGV[1]) then return {0, gen} end
local half, ttl, overhead = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local size = 0
for i = 5, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  size = size + #ARGV[i] + #ARGV[i + 1] + overhead
end
redis.call('EXPIRE', KEYS[2], ttl)
local used = redis.call('HINCRBY', KEYS[1], 'bytes', size)
if used >= half then
  gen = gen + 1
  redis.call('HSET', KEYS[1], 'gen', gen, 'bytes', 0)
  redis.call('UNLINK', KEYS[3])
end
redis.call('EXPIRE', KEYS[1], ttl)
return {1, gen}
