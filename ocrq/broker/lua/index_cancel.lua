-- KEYS: images hash, counts hash, meta hash. ARGV: image ids. A cancelled job's images that
-- have not started become "x" (cancelled): queued ones (in a message or not) and retrying ones
-- (their retry message is skipped when it comes); running and final ones are left as they are.
-- Returns how many were cancelled.
if redis.call('HEXISTS', KEYS[3], 'cancelled') == 0 then return 0 end
local n = 0
for i = 1, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    local head = string.sub(v, 1, 1)
    local was = false
    if head == 'q' then was = 'queued'
    elseif head == 'p' then
      was = 'queued'
      redis.call('HINCRBY', KEYS[2], 'published', -1)
    elseif head == '{' then
      local st = cjson.decode(v)['status']
      if st == 'retrying' or st == 'queued' then was = st end
    end
    if was then
      redis.call('HSET', KEYS[1], ARGV[i], 'x')
      redis.call('HINCRBY', KEYS[2], was, -1)
      redis.call('HINCRBY', KEYS[2], 'cancelled', 1)
      n = n + 1
    end
  end
end
return n
