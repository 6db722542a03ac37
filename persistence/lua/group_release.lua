-- devicemq: a member of a group queue gives its claims back ($queue).
--
-- KEYS[1] _ecq_claims  KEYS[2] _ecq_tokens
-- ARGV[1] the member's claim token  ARGV[2] 1: every claim of the token (the
-- member left; the token is done with), 0: only the keys that follow
-- then the keys, each followed by 1 if another member must get it with DUP
-- (it was sent, or claimed with DUP) else 0. With ARGV[2] = 1, a claim of the
-- token on a key not listed is dropped (no DUP): the member never had it. A
-- claim of an entry seen before it ('-' then the token, group_claim.lua) goes
-- back seen whatever the list says: the member's list may have been made before
-- that claim landed (tests/model/FINDINGS.md, finding 34).
-- Returns how many claims were given back.

local token, all_of_it = ARGV[1], ARGV[2] == '1'
local dup = {}
for i = 3, #ARGV, 2 do dup[ARGV[i]] = ARGV[i + 1] == '1' end
local given = 0
local seen_claim = '-' .. token
local function give(key, claim)
  if dup[key] or claim == seen_claim then
    redis.call('HSET', KEYS[1], key, '-')
  else
    redis.call('HDEL', KEYS[1], key)
  end
  given = given + 1
end
if all_of_it then
  local claims = redis.call('HGETALL', KEYS[1])
  for i = 1, #claims, 2 do
    local claim = claims[i + 1]
    if claim == token or claim == seen_claim then give(claims[i], claim) end
  end
  redis.call('ZREM', KEYS[2], token)
else
  for key, _ in pairs(dup) do
    local claim = redis.call('HGET', KEYS[1], key)
    if claim == token or claim == seen_claim then give(key, claim) end
  end
end
return given
