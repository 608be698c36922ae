-- KEYS: job meta hash. ARGV: a new epoch (JSON), ttl. The job's epoch (kept if set) and its next
-- part number (ocrq.output.parts).
redis.call('HSETNX', KEYS[1], 'epoch', ARGV[1])
local n = redis.call('HINCRBY', KEYS[1], 'parts', 1)
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return {redis.call('HGET', KEYS[1], 'epoch'), n}
