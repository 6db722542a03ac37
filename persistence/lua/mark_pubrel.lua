-- devicemq: PUBREC received for QoS 2 messages of one client: only their PUBREL
-- stage is left (the 2-byte value of persistence/format.py, pubrel_value), so
-- their payloads' memory is released.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_values   ARGV: packet ids
-- An entry no longer stored (acknowledged, trimmed, expired) is not recreated.
-- The PUBREL stage is in flight: no deadline, it lives as long as the session.
-- The byte count (field 'b') gives back what the entry shrank by: the ack of the
-- PUBREL stage frees only its own size (ack.lua), so a count left at the
-- payload's size stayed inflated while the set held anything, and the byte limit
-- trimmed unsent messages before the values stored reached it.
-- Returns how many entries were rewritten.

upgrade(KEYS[1], KEYS[2])
local pubrel = struct.pack('>d', 0) .. string.char(2, 3)
local done = 0
local freed = 0
for i = 1, #ARGV do
  local entry = redis.call('HGET', KEYS[2], ARGV[i])
  if entry then
    freed = freed + value_size(entry) - value_size(pubrel)
    redis.call('HSET', KEYS[2], ARGV[i], pubrel)
    done = done + 1
  end
end
release_bytes(KEYS[2], KEYS[1], freed)
return done
