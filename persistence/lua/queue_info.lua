-- devicemq: a queue at a glance ($ECQ): {pending, keys kept, last seq, highest acked,
-- oldest pending seq (0: none)}.
--
-- KEYS[1] pending  KEYS[2] log  KEYS[3] seq  KEYS[4] acked

local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {
  redis.call('ZCARD', KEYS[1]),
  redis.call('ZCARD', KEYS[2]),
  tonumber(redis.call('GET', KEYS[3]) or '0'),
  tonumber(redis.call('GET', KEYS[4]) or '0'),
  tonumber(oldest[2] or '0'),
}
