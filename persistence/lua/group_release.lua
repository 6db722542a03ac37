-- devicemq: a member of a group queue leaves: its claims are given back ($queue).
--
-- KEYS[1] _ecq_claims  KEYS[2] _ecq_tokens
-- ARGV[1] the member's claim token; then the keys it sent (another member gets
-- those with DUP: '-' marks them). Claims of the token on keys not sent are
-- dropped. Returns how many claims were given back.

local token = ARGV[1]
local sent = {}
for i = 2, #ARGV do sent[ARGV[i]] = true end
local given = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i + 1] == token then
    if sent[all[i]] then
      redis.call('HSET', KEYS[1], all[i], '-')
    else
      redis.call('HDEL', KEYS[1], all[i])
    end
    given = given + 1
  end
end
redis.call('ZREM', KEYS[2], token)
return given
