-- The hot cache's lookup (worker.cache). KEYS[1]: the state hash (keys.HOT_STATE); KEYS[2]: the
-- generation the caller takes for the current one (keys.hot_generation); KEYS[3]: the one before
-- it. ARGV: that generation's number, then the cache keys. When another generation is current,
-- only its number comes back ({gen}: the caller asks again with its keys); else {gen, then per
-- cache key its value from the current generation, else from the one before it, else false}.
local gen = tonumber(redis.call('HGET', KEYS[1], 'gen') or '0')
if gen ~= tonumber(ARGV[1]) then return {gen} end
local wanted = {}
for i = 2, #ARGV do wanted[#wanted + 1] = ARGV[i] end
local out = redis.call('HMGET', KEYS[2], unpack(wanted))
local missing, at = {}, {}
for i, v in ipairs(out) do
  if not v then missing[#missing + 1] = wanted[i]; at[#at + 1] = i end
end
if #missing > 0 and gen > 0 then
  local older = redis.call('HMGET', KEYS[3], unpack(missing))
  for j, v in ipairs(older) do out[at[j]] = v end
end
table.insert(out, 1, gen)
return out
