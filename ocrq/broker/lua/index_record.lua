-- KEYS: images hash, counts hash, the job's failed zset, job meta hash
-- ARGV: now, ttl, mode, owner (the submission's ordinal: ocrq.jobs.feed), the store requests (puts,
-- gets) the call's work made, the result part holding the final images' documents (its number,
-- or ""), then (id, status, cached, doc, engine_s, batch_size) per image.
-- A record is a short marker unless a worker is on the image: "q{owner}" queued, no message yet
-- (the submission's shard is its feed: ocrq.jobs.feed); "p" queued in a message; "d{part}"/"c{part}"
-- done (engine / cache); "f{part}" failed; "x" cancelled (it never ran); running and retrying
-- images hold their ImageRecord JSON (``doc``). A final image's full record is its document, in
-- that part (ocrq.output.parts).
-- A cancelled job (its meta has ``cancelled``): what has not started never runs. A worker's
-- "running" (or "retrying", "queued") for an image that is not running turns it "x" and says 0
-- (the worker skips it); a running image's outcome stands, but a retry becomes "x"; a submit
-- records new images as "x" (no shard line).
-- Modes: "submit" records new images (never resets one) and says which need its submission's
-- shard: new ones, and those it recorded before without publishing them (a resumed submit);
-- "update" (the workers) never rewrites a done image: the first done stands (a chunk run again
-- after a redelivery or a Redis failover cannot replace its result), and leaves an archived job alone (its
-- records left Redis: a stale redelivery is ignored); an image without a record in a job that is
-- not archived (a message from elsewhere) is recorded; "force" (reprocess) writes
-- whatever is there, queued ones as published; "reopen" (reprocess of an archived job) is force
-- for images whose record left with the archive: they were failed ("reopen-cancelled": cancelled).
-- Returns one flag per item: 1 = written (submit: needs a shard line), 0 = left alone.
local now, ttl, mode, owner = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
if tonumber(ARGV[5]) > 0 then redis.call('HINCRBY', KEYS[2], 'store_puts', ARGV[5]) end
if tonumber(ARGV[6]) > 0 then redis.call('HINCRBY', KEYS[2], 'store_gets', ARGV[6]) end
local marks = {d = 'done', c = 'done', f = 'failed', p = 'queued', q = 'queued', x = 'cancelled'}
local part = ARGV[7]
local out = {}
local opened = false
local archived = redis.call('HEXISTS', KEYS[4], 'archived') == 1
local cancelled = redis.call('HEXISTS', KEYS[4], 'cancelled') == 1
for i = 8, #ARGV, 6 do
  local id, st, cached, doc = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local engine_s, batch_size = ARGV[i + 4], tonumber(ARGV[i + 5])
  local old = redis.call('HGET', KEYS[1], id)
  local ost, ocached, opub = false, false, false
  if old then
    local head = string.sub(old, 1, 1)
    if head == '{' then
      local o = cjson.decode(old)
      ost = o['status']
      ocached = o['cached'] == true
    else
      ost = marks[head]
      ocached = head == 'c'
      opub = head == 'p'
    end
  elseif mode == 'reopen' then
    ost = 'failed'
  elseif mode == 'reopen-cancelled' then
    ost = 'cancelled'
  end
  local write = true
  if mode == 'submit' then
    write = (old == false)
    if cancelled then
      st = 'cancelled'
      out[#out + 1] = 0
    else
      out[#out + 1] = ((old == false) or (old == 'q' .. owner)) and 1 or 0
    end
  else
    local flag = nil
    if mode == 'update' and ((old == false and archived) or ost == 'done' or ost == 'cancelled') then
      write = false
    elseif mode == 'update' and cancelled and st ~= 'done' and st ~= 'failed' then
      -- not started (or a retry of one that ran): it never runs
      if ost ~= 'running' or st == 'retrying' then
        st = 'cancelled'
        flag = 0
      end
    end
    out[#out + 1] = flag or (write and 1 or 0)
  end
  if write then
    local value = doc
    if st == 'done' then value = ((cached == '1') and 'c' or 'd') .. part
    elseif st == 'failed' then value = 'f' .. part
    elseif st == 'cancelled' then value = 'x'
    elseif st == 'queued' then value = (mode == 'submit') and ('q' .. owner) or 'p' end
    redis.call('HSET', KEYS[1], id, value)
    if opub then redis.call('HINCRBY', KEYS[2], 'published', -1) end
    if st == 'queued' and mode ~= 'submit' then redis.call('HINCRBY', KEYS[2], 'published', 1) end
    if ost then redis.call('HINCRBY', KEYS[2], ost, -1) else redis.call('HINCRBY', KEYS[2], 'total', 1) end
    redis.call('HINCRBY', KEYS[2], st, 1)
    if ost == 'done' and ocached then redis.call('HINCRBY', KEYS[2], 'cached', -1) end
    if st == 'done' and cached == '1' then redis.call('HINCRBY', KEYS[2], 'cached', 1) end
    if st == 'done' and ost ~= 'done' then
      if engine_s ~= '' then
        redis.call('HINCRBYFLOAT', KEYS[2], 'engine_s', engine_s)
        redis.call('HINCRBY', KEYS[2], 'engine_images', 1)
        if batch_size and batch_size > 0 then redis.call('HINCRBYFLOAT', KEYS[2], 'batches', 1 / batch_size) end
      end
      local last = tonumber(redis.call('HGET', KEYS[2], 'last_done') or '0')
      if tonumber(now) > last then redis.call('HSET', KEYS[2], 'last_done', now) end
    end
    if st == 'failed' then redis.call('ZADD', KEYS[3], now, id)
    elseif ost == 'failed' then redis.call('ZREM', KEYS[3], id) end
    if mode ~= 'update' then opened = true end
  end
end
if opened then redis.call('HDEL', KEYS[4], 'archived') end
-- the part's number is taken: a counter that lost it (a failover) must not hand it out again
if part ~= '' and tonumber(part) > tonumber(redis.call('HGET', KEYS[4], 'parts') or '0') then
  redis.call('HSET', KEYS[4], 'parts', part)
end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[4], ttl)
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('EXPIRE', KEYS[3], ttl) end
return out
