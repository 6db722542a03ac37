-- devicemq: claim a client ID or an $ECQ queue for an owner (broker/ownership.py).
--
-- KEYS[1] the claim ({cid}_id_owner or {cid}_ecq_owner: the owner's name)
-- ARGV[1] the owner   ARGV[2] milliseconds the claim lasts from now (0: until
-- released)   ARGV[3] '1': claim it, '0': only ask (an anonymous client)
--
-- Held by another owner: nothing changes; returns {0, holder}. Otherwise it is
-- granted, {1}, and, claimed, the owner holds it from now on for ARGV[2] ms.

local holder = redis.call('GET', KEYS[1])
if holder and (ARGV[3] ~= '1' or holder ~= ARGV[1]) then return {0, holder} end
if ARGV[3] ~= '1' then return {1} end
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
return {1}
