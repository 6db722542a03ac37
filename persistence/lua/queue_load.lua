-- devicemq: the next unacknowledged entries of a queue ($ECQ), in sequence order.
--
-- KEYS[1] {cid}_ecq_pending  KEYS[2] {cid}_ecq_values  KEYS[3] {cid}_ecq_seq
-- KEYS[4] {cid}_ecq_times
-- ARGV[1] after this seq  ARGV[2] at most this many  ARGV[3] entries published
-- before this time (ms) are past retention: not given (the next save removes
-- them, and reports them).
-- Returns {last seq handed out, {key, seq, value, ...}}; an entry whose value is
-- gone is skipped.

local refs = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
local oldest = tonumber(ARGV[3])
local out = {}
for i = 1, #refs, 2 do
  local value = redis.call('HGET', KEYS[2], refs[i])
  local published = tonumber(redis.call('ZSCORE', KEYS[4], refs[i]) or '0')
  if value and published >= oldest then
    out[#out + 1] = refs[i]
    out[#out + 1] = tonumber(refs[i + 1])
    out[#out + 1] = value
  end
end
return {tonumber(redis.call('GET', KEYS[3]) or '0'), out}
