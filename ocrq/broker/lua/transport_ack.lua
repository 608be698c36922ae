-- KEYS: unacked, unacked_index; ARGV: tag, the delivery's index score. Removes the record only
-- while it is still this delivery's: a message redelivered meanwhile (same tag: kombu's tags are
-- per message) belongs to its new holder, whose record a late ack of the old copy must not erase.
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0
