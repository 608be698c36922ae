-- KEYS: unacked, unacked_index, then the lists to take from in priority order; ARGV: now, then per
-- list '1' to record (a consumer that acks) or '0' (a no-ack consumer: Celery's reply queues).
-- Pops the first message and records it in unacked as kombu's QoS.append does
-- (entry = [message, exchange, routing_key]), in one atomic step. Returns {list, message} or nil.
-- The message is decoded before anything is written (a script error does not roll back writes):
-- one kombu could not parse either is popped and returned unrecorded, as kombu's pop would.
for i = 3, #KEYS do
  local raw = redis.call('LINDEX', KEYS[i], -1)
  if raw then
    local ok, m = pcall(cjson.decode, raw)
    redis.call('RPOP', KEYS[i])
    if ARGV[i - 1] == '1' and ok and type(m) == 'table' and type(m['properties']) == 'table' then
      local props = m['properties']
      local tag = props['delivery_tag']
      local info = props['delivery_info']
      if type(tag) == 'string' and type(info) == 'table' then
        local ex, rk = info['exchange'], info['routing_key']
        if type(ex) ~= 'string' then ex = '' end
        if type(rk) ~= 'string' then rk = '' end
        redis.call('ZADD', KEYS[2], ARGV[1], tag)
        redis.call('HSET', KEYS[1], tag, '[' .. raw .. ', ' .. cjson.encode(ex) .. ', ' .. cjson.encode(rk) .. ']')
      end
    end
    return {KEYS[i], raw}
  end
end
return false
