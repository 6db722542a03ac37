-- devicemq: acknowledged (PUBACK / PUBCOMP): remove refs and their strings.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_bytes; ARGV packet ids.
-- Returns how many refs were removed.

local set_key = KEYS[1]
local removed = 0
local freed = 0
for i = 1, #ARGV do
  local key = set_key .. '_' .. ARGV[i]
  if redis.call('ZREM', set_key, ARGV[i]) == 1 then
    removed = removed + 1
    freed = freed + redis.call('STRLEN', key)
  end
  redis.call('DEL', key)
end
if freed > 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  local left = redis.call('DECRBY', KEYS[2], freed)
  if left < 0 or redis.call('ZCARD', set_key) == 0 then redis.call('SET', KEYS[2], 0, 'KEEPTTL') end
end
return removed
