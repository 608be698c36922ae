-- KEYS: (meta, counts, submitting) of each job. One line a job: whether its meta has archived,
-- cancelled, created; its _STATE_COUNTS; whether a submission is being written (read-only, one
-- round trip and one short reply for a batch of jobs, where a pipeline parses ten replies a job)
local out = {}
for i = 1, #KEYS, 3 do
  local m = redis.call('HMGET', KEYS[i], 'archived', 'cancelled', 'created')
  local c = redis.call('HMGET', KEYS[i + 1], 'total', 'done', 'failed', 'cancelled', 'running', 'retrying')
  local line = {}
  for j = 1, 3 do line[j] = m[j] and '1' or '0' end
  for j = 1, 6 do line[3 + j] = c[j] or '0' end
  line[10] = redis.call('EXISTS', KEYS[i + 2])
  out[#out + 1] = table.concat(line, ',')
end
return out
