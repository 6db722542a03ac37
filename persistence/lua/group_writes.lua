-- devicemq: a persistent member's group writes in flight ($queue), recorded with its
-- session under their packet identifiers before they are sent, and forgotten once
-- done with (persistence/group_feed.py, GroupQueues; tests/model/FINDINGS.md,
-- findings 35 and 43). A broker that restarts, or another replica, sends them again
-- under the same identifiers (MQTT-4.4.0-1) and gives those to nothing else
-- meanwhile (MQTT-2.2.1-3).
--
-- KEYS[1] {cid}_ecq_group_writes
-- ARGV[1] the session's generation ('-': no record in this call); then triples, applied
-- in the order given: '+' (record) or '-' (forget), the packet id, the record.
-- Records of a generation older than the hash's change nothing (a late write of an
-- ended session); a newer generation drops the older one's first. A forget removes
-- the packet id only while it still holds that record (one recorded again since,
-- for another write, is left alone). Returns how many were forgotten.

local records = ARGV[1] ~= '-'
if records then
  local gen = redis.call('HGET', KEYS[1], 'gen')
  if gen and tonumber(gen) > tonumber(ARGV[1]) then
    records = false
  elseif gen ~= ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.call('HSET', KEYS[1], 'gen', ARGV[1])
  end
end
local removed = 0
for i = 2, #ARGV, 3 do
  local id, packed = ARGV[i + 1], ARGV[i + 2]
  if ARGV[i] == '+' then
    if records then redis.call('HSET', KEYS[1], id, packed) end
  elseif redis.call('HGET', KEYS[1], id) == packed then
    removed = removed + redis.call('HDEL', KEYS[1], id)
  end
end
return removed
