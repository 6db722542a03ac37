-- devicemq: a queue at a glance ($ECQ, or a group queue's store): {pending, keys
-- kept, last seq, highest acked, oldest pending seq (0: none), bytes of the values
-- kept}.
--
-- KEYS[1] pending  KEYS[2] log  KEYS[3] seq  KEYS[4] acked  KEYS[5] bytes

local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {
  redis.call('ZCARD', KEYS[1]),
  redis.call('ZCARD', KEYS[2]),
  tonumber(redis.call('GET', KEYS[3]) or '0'),
  tonumber(redis.call('GET', KEYS[4]) or '0'),
  tonumber(oldest[2] or '0'),
  tonumber(redis.call('GET', KEYS[5]) or '0'),
}
