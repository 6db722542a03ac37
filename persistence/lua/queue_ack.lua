-- devicemq: a queue's consumer acknowledged entries ($ECQ).
--
-- KEYS[1] {cid}_ecq_pending  KEYS[2] {cid}_ecq_acked (the highest seq acknowledged)
-- KEYS[3] {cid}_ecq_inflight (packet id -> the entry in flight under it)
-- KEYS[4] {cid}_ecq_full (the queue was at its byte limit: an entry acknowledged
-- may leave to make room now, so writes are taken again)
-- ARGV triples: key, seq, packet id (0: none recorded; its record goes if it is
-- still this entry's: persistence/queue_store.py packs the seq first). A key whose pending seq is
-- another one now was replaced by a newer value (compaction): that one is still
-- to be delivered, left alone. Returns how many entries were removed.

local removed = 0
local highest = tonumber(redis.call('GET', KEYS[2]) or '0')
for i = 1, #ARGV, 3 do
  local seq = tonumber(ARGV[i + 1])
  local now = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if now and tonumber(now) == seq then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
  if seq > highest then highest = seq end
  if ARGV[i + 2] ~= '0' then
    -- This entry's record only: the id may hold another entry's by now (a later
    -- session's, recorded while this acknowledgement waited for Redis).
    local record = redis.call('HGET', KEYS[3], ARGV[i + 2])
    if record and #record >= 8 and struct.unpack('>I8', record) == seq then
      redis.call('HDEL', KEYS[3], ARGV[i + 2])
    end
  end
end
redis.call('SET', KEYS[2], highest)
if removed > 0 then redis.call('DEL', KEYS[4]) end
return removed
