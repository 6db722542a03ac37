-- devicemq: PUBREC received for QoS 2 messages of one client: only their PUBREL
-- stage is left (the 2-byte value of persistence/format.py, pubrel_value), so
-- their payloads' memory is released.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_values   ARGV: packet ids
-- An entry no longer stored (acknowledged, trimmed, expired) is not recreated.
-- The PUBREL stage is in flight: no deadline, it lives as long as the session.
-- Returns how many entries were rewritten.

upgrade(KEYS[1], KEYS[2])
local pubrel = struct.pack('>d', 0) .. string.char(2, 3)
local done = 0
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[i], pubrel)
    done = done + 1
  end
end
return done
