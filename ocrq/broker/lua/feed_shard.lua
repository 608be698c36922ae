-- KEYS: feed hash, images hash, counts hash, feeding set, job meta hash, then the lists the
-- messages go to and their queues' wake-up lists (keys.queue_ring). ARGV: cursor field, the shard
-- the caller read, the submission's shard count, job name, n ids, ids..., then (the KEYS index of
-- its list, the KEYS index of its wake-up list, message) triples. Publishes the shard's messages and moves the cursor, only if the cursor is
-- still at that shard; marks its images published. A cancelled job's shard publishes nothing: its
-- queued images become "x" (cancelled). Returns how many images were marked, or -1 (fed by
-- someone else).
local at = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if at ~= tonumber(ARGV[2]) then return -1 end
local n = tonumber(ARGV[5])
-- a queued image of the shard becomes published ("p"), or cancelled ("x") when its job is
local cancelled = redis.call('HEXISTS', KEYS[5], 'cancelled') == 1
local mark = cancelled and 'x' or 'p'
local marked = 0
for i = 6, 5 + n do
  local v = redis.call('HGET', KEYS[2], ARGV[i])
  if v and string.sub(v, 1, 1) == 'q' then
    redis.call('HSET', KEYS[2], ARGV[i], mark)
    marked = marked + 1
  end
end
if cancelled then
  if marked > 0 then
    redis.call('HINCRBY', KEYS[3], 'queued', -marked)
    redis.call('HINCRBY', KEYS[3], 'cancelled', marked)
  end
  redis.call('HSET', KEYS[1], ARGV[1], at + 1)
  return 0
end
for i = 6 + n, #ARGV, 3 do
  local ring = KEYS[tonumber(ARGV[i + 1])]
  redis.call('LPUSH', KEYS[tonumber(ARGV[i])], ARGV[i + 2])
  redis.call('LPUSH', ring, 1)
  redis.call('LTRIM', ring, 0, 9999)
end
redis.call('HSET', KEYS[1], ARGV[1], at + 1)
if marked > 0 then redis.call('HINCRBY', KEYS[3], 'published', marked) end
return marked
