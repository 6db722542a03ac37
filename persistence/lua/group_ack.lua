-- devicemq: members of a group queue acknowledged entries ($queue).
--
-- KEYS[1] _ecq_pending  KEYS[2] _ecq_log  KEYS[3] _ecq_values  KEYS[4] _ecq_times
-- KEYS[5] _ecq_claims  KEYS[6] _ecq_bytes (the values' bytes: what leaves is taken off)
-- ARGV pairs: key, seq. An entry is done with once any member acknowledged it
-- (one that went to another member meanwhile completes there as a duplicate):
-- it leaves the store. Returns how many were removed.

local removed, freed = 0, 0
for i = 1, #ARGV, 2 do
  local key, seq = ARGV[i], tonumber(ARGV[i + 1])
  local now = redis.call('ZSCORE', KEYS[1], key)
  if now and tonumber(now) == seq then
    removed = removed + redis.call('ZREM', KEYS[1], key)
    freed = freed + redis.call('HSTRLEN', KEYS[3], key)
    redis.call('ZREM', KEYS[2], key)
    redis.call('HDEL', KEYS[3], key)
    redis.call('ZREM', KEYS[4], key)
  end
  redis.call('HDEL', KEYS[5], key)
end
if freed > 0 and redis.call('EXISTS', KEYS[6]) == 1 then
  local left = redis.call('DECRBY', KEYS[6], freed)
  if left < 0 or redis.call('HLEN', KEYS[3]) == 0 then redis.call('SET', KEYS[6], 0) end
end
return removed
