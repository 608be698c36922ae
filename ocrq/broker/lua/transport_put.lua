-- KEYS: the message's list, the queue's wake-up list; ARGV: message, ring cap.
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LPUSH', KEYS[2], 1)
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[2]) - 1)
return 1
