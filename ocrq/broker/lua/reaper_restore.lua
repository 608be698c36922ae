-- KEYS: unacked, unacked_index, suspects, the lists the messages go back to (n of them), then
-- the held sets. ARGV: now, dead_after, confirm, n, then (tag, entry, the KEYS index of its list,
-- payload) quads
local now, dead_after, confirm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local held = 4 + tonumber(ARGV[4])
local restored = {}
for i = 5, #ARGV, 4 do
  local tag, entry, target, payload = ARGV[i], ARGV[i + 1], KEYS[tonumber(ARGV[i + 2])], ARGV[i + 3]
  local delivered = redis.call('ZSCORE', KEYS[2], tag)
  local orphan = delivered and tonumber(delivered) <= now - dead_after
    and redis.call('HGET', KEYS[1], tag) == entry
  if orphan then
    for k = held, #KEYS do
      if redis.call('SISMEMBER', KEYS[k], tag) == 1 then orphan = false break end
    end
  end
  if not orphan then
    redis.call('HDEL', KEYS[3], tag)
  else
    local first = redis.call('HGET', KEYS[3], tag)
    if not first then
      redis.call('HSET', KEYS[3], tag, now)
    elseif now - tonumber(first) >= confirm then
      redis.call('RPUSH', target, payload)
      redis.call('HDEL', KEYS[1], tag)
      redis.call('ZREM', KEYS[2], tag)
      redis.call('HDEL', KEYS[3], tag)
      restored[#restored + 1] = tag
    end
  end
end
for _, tag in ipairs(redis.call('HKEYS', KEYS[3])) do
  if redis.call('HEXISTS', KEYS[1], tag) == 0 then redis.call('HDEL', KEYS[3], tag) end
end
redis.call('EXPIRE', KEYS[3], 86400)
return restored
