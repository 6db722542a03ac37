-- devicemq: clean start: delete every key of a client.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_last_packet_id   KEYS[3] {cid}_last_score
-- KEYS[4] {cid}_last_offset   KEYS[5] {cid}_session
-- ARGV[1] ms to keep the Kafka offset record, 0 = delete it too. Keeping it
-- (with a TTL) means a batch from before the clean start, retried by the
-- consumer, is still recognised and not stored into the new session.
-- Returns how many stored messages were deleted.

local set_key = KEYS[1]
local refs = redis.call('ZRANGE', set_key, 0, -1)
local chunk = {}
for i = 1, #refs do
  chunk[#chunk + 1] = set_key .. '_' .. refs[i]
  if #chunk == 500 then
    redis.call('DEL', unpack(chunk))
    chunk = {}
  end
end
if #chunk > 0 then redis.call('DEL', unpack(chunk)) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[5])
local keep = tonumber(ARGV[1])
if keep > 0 then
  redis.call('PEXPIRE', KEYS[4], keep)
else
  redis.call('DEL', KEYS[4])
end
return #refs
