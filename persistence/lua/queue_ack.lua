-- devicemq: a queue's consumer acknowledged entries ($ECQ).
--
-- KEYS[1] {cid}_ecq_pending  KEYS[2] {cid}_ecq_acked (the highest seq acknowledged)
-- ARGV pairs: key, seq. A key whose pending seq is another one now was replaced
-- by a newer value (compaction): that one is still to be delivered, left alone.
-- Returns how many entries were removed.

local removed = 0
local highest = tonumber(redis.call('GET', KEYS[2]) or '0')
for i = 1, #ARGV, 2 do
  local seq = tonumber(ARGV[i + 1])
  local now = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if now and tonumber(now) == seq then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
  if seq > highest then highest = seq end
end
redis.call('SET', KEYS[2], highest)
return removed
