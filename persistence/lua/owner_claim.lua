-- devicemq: claim a client ID or an $ECQ queue for an owner (broker/ownership.py).
--
-- KEYS[1] the claim ({cid}_id_owner or {cid}_ecq_owner: the owner's name)
-- ARGV[1] the owner   ARGV[2] milliseconds the claim lasts from now (0: until
-- released)   ARGV[3] '1': claim it, '0': only ask (an anonymous client)
-- ARGV[4] '0': the owner may make no new claim (it holds its most already;
-- persistence/owner_store.py), absent or '1': it may
--
-- Held by another owner: nothing changes; returns {0, holder}. Free while no new
-- claim may be made: nothing changes; returns {2}. Otherwise it is granted,
-- {1, new} (new: 1 if the owner did not hold it before), and, claimed, the owner
-- holds it from now on for ARGV[2] ms.

local holder = redis.call('GET', KEYS[1])
if holder and (ARGV[3] ~= '1' or holder ~= ARGV[1]) then return {0, holder} end
if ARGV[3] ~= '1' then return {1, 0} end
if not holder and ARGV[4] == '0' then return {2} end
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
if holder then return {1, 0} end
return {1, 1}
