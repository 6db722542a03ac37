-- devicemq: a queue's consumer asked for re-delivery from a sequence number ($ECQ).
--
-- KEYS[1] {cid}_ecq_pending  KEYS[2] {cid}_ecq_log
-- ARGV[1] from this seq (inclusive)  ARGV[2] at most this many entries per call.
-- The latest value of every key with seq >= ARGV[1] that retention kept is
-- pending again. Returns {entries made pending, the last seq looked at (0: done)}.

local refs = redis.call('ZRANGEBYSCORE', KEYS[2], ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
local count = 0
for i = 1, #refs, 2 do
  count = count + redis.call('ZADD', KEYS[1], 'NX', refs[i + 1], refs[i])
end
local last = 0
if #refs >= 2 * tonumber(ARGV[2]) then last = tonumber(refs[#refs]) end
return {count, last}
