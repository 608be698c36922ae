-- KEYS[1] progress hash, KEYS[2] job meta. ARGV: window, engine images, images finished (engine
-- + recorded hits and failures), windows kept, ttl, meta field, meta value (JSON). Nothing for a
-- job without meta (unknown, or its keys expired). A new window drops those older than the kept
-- ones (and the oldest beyond the bound, should workers' clocks disagree).
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local window, engine, finished, kept = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if engine > 0 then redis.call('HINCRBY', KEYS[1], 'engine', engine) end
local field = 't' .. window
if finished > 0 then
  if redis.call('HEXISTS', KEYS[1], field) == 0 then
    local windows = {}
    for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
      local n = string.sub(name, 1, 1) == 't' and tonumber(string.sub(name, 2)) or nil
      if n then
        if n <= window - kept then redis.call('HDEL', KEYS[1], name) else table.insert(windows, n) end
      end
    end
    table.sort(windows)
    for i = 1, #windows - kept + 1 do redis.call('HDEL', KEYS[1], 't' .. windows[i]) end
  end
  redis.call('HINCRBY', KEYS[1], field, finished)
end
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('HSETNX', KEYS[2], ARGV[6], ARGV[7])
return 1
