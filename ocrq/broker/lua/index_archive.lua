-- KEYS: images hash, counts hash, failed zset, meta hash, finishing flag, feed hash, the events
-- hash and their due zset (ocrq.jobs.events). ARGV: the job's total when its export began, the job's
-- name, now. A job with a webhook (its meta's ``webhook``) archived for the first time since
-- its last new work gets its terminal event (job.completed / job.failed: some images failed /
-- job.cancelled; batch.completed / batch.cancelled) in the outbox.
-- Archives the job when it is finished and its export was asked for since its last new work
-- (submit and reprocess clear the flag), and the export covers every image: the per-image keys
-- and its submissions go (UNLINK: freed off Redis's main thread),
-- meta and counts stay. -1: images came in while the export ran without a submission (a chunk
-- whose records Redis lost, redelivered): that export is stale.
local c = redis.call('HMGET', KEYS[2], 'total', 'done', 'failed', 'cancelled')
local total, done, failed = tonumber(c[1] or '0'), tonumber(c[2] or '0'), tonumber(c[3] or '0')
local cancelled = tonumber(c[4] or '0')
if done + failed + cancelled < total or redis.call('EXISTS', KEYS[5]) == 0 then return 0 end
if total ~= tonumber(ARGV[1]) then return -1 end
local first = redis.call('HEXISTS', KEYS[4], 'archived') == 0
redis.call('HSET', KEYS[4], 'archived', '1')
redis.call('UNLINK', KEYS[1], KEYS[3], KEYS[6])
local url = redis.call('HGET', KEYS[4], 'webhook')
if first and url then
  -- the job's terminal event, in the outbox (ocrq.jobs.events) in the same step as its state
  local n = redis.call('HINCRBY', KEYS[4], 'terminal', 1)
  local kind = 'job'
  local object = redis.call('HGET', KEYS[4], 'object')
  if object and cjson.decode(object) == 'batch' then kind = 'batch' end
  local what = 'completed'
  if redis.call('HEXISTS', KEYS[4], 'cancelled') == 1 then what = 'cancelled'
  elseif failed > 0 and kind == 'job' then what = 'failed' end
  local id = ARGV[2] .. '#' .. n
  redis.call('HSET', KEYS[7], id, cjson.encode({id = id, type = kind .. '.' .. what, job = ARGV[2],
    url = cjson.decode(url), created = tonumber(ARGV[3]), attempts = 0}))
  redis.call('ZADD', KEYS[8], ARGV[3], id)
end
return 1
