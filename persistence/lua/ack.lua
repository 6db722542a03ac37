-- devicemq: acknowledged (PUBACK / PUBCOMP): remove refs and their strings.
--
-- KEYS[1] {cid}_messages; ARGV packet ids. Returns how many refs were removed.

local set_key = KEYS[1]
local removed = 0
for i = 1, #ARGV do
  removed = removed + redis.call('ZREM', set_key, ARGV[i])
  redis.call('DEL', set_key .. '_' .. ARGV[i])
end
return removed
