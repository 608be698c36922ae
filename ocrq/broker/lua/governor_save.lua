-- SET the snapshot unless the stored one has seen more batches (then only refresh its TTL).
-- Unreadable stored data is replaced. KEYS[1] snapshot key; ARGV: json, observations, ttl seconds
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, snap = pcall(cjson.decode, cur)
  if ok and type(snap) == 'table' and type(snap['calibration']) == 'table' then
    local stored = tonumber(snap['calibration']['observations'])
    if stored and stored > tonumber(ARGV[2]) then
      redis.call('EXPIRE', KEYS[1], ARGV[3])
      return 0
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return 1
