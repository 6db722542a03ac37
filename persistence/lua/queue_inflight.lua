-- devicemq: entries of a queue ($ECQ) about to be sent to a persistent session,
-- recorded under their packet identifiers before they go (a broker that restarts
-- re-sends them under the same ones, MQTT-4.4.0-1).
--
-- KEYS[1] {cid}_ecq_inflight
-- ARGV[1] the session's generation; then pairs: packet id, the entry (seq, key,
-- value, packed by persistence/queue_store.py). Entries of an older generation
-- (an ended session's) are dropped first; a late write of an older generation
-- changes nothing (returns 0).

local gen = redis.call('HGET', KEYS[1], 'gen')
if gen and tonumber(gen) > tonumber(ARGV[1]) then return 0 end
if gen ~= ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'gen', ARGV[1])
end
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
