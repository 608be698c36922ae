-- KEYS: events hash, due zset. ARGV: now, the claim window in seconds, at most this many. Due events (their
-- score has passed) move a window ahead and are returned with their JSON: [id, json, id, json ...]
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(due) do
  local doc = redis.call('HGET', KEYS[1], id)
  if doc then
    redis.call('ZADD', KEYS[2], tonumber(ARGV[1]) + tonumber(ARGV[2]), id)
    out[#out + 1] = id
    out[#out + 1] = doc
  else
    redis.call('ZREM', KEYS[2], id)
  end
end
return out
