-- devicemq: a broker's members of a group queue still hold their claims ($queue).
--
-- KEYS[1] _ecq_tokens (claim token -> lease deadline, ms of the Redis clock)
-- ARGV[1] lease (ms), then the tokens. A token whose lease ran out stays gone
-- (its claims may be another member's now); the others' leases start again.

local clock = redis.call('TIME')
local deadline = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) + tonumber(ARGV[1])
local renewed = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], deadline, ARGV[i])
    renewed = renewed + 1
  end
end
return renewed
