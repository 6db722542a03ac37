-- devicemq: a session ended (expired, or replaced by a clean start): delete
-- every key of the client and leave a generation tombstone.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_values   KEYS[3] {cid}_last_score
-- KEYS[4] {cid}_seen   KEYS[5] {cid}_session   KEYS[6] {cid}_generation
-- KEYS[7] {cid}_bytes
-- KEYS[8] {cid}_ecq_inflight   KEYS[9] {cid}_ecq_group_writes: what the session
-- had in flight from its queue and from group queues (also when it expired while
-- no broker held it: a restarted broker ends it here, and nothing else would)
-- KEYS[10] {cid}_opens
-- ARGV[1] the generation that ended (0: whatever is stored)
-- ARGV[2] ms to keep the tombstone
-- ARGV[3] for an end by expiry: the resumes the ending broker saw ('' for any
-- other end). A client that resumed the session elsewhere meanwhile (another
-- replica read it while this one's expiry ran: finding 40) counted one more:
-- nothing is deleted and -2 is returned.
--
-- Fenced: if a newer generation was opened meanwhile (elsewhere), nothing is
-- deleted and -1 is returned. Otherwise the generation key becomes one higher
-- than the one that ended, for ARGV[2] ms: records still in Kafka for the
-- ended session carry its generation and are dropped by save_batch.lua, and a
-- new session takes a higher one still (open_session.lua).
-- The score counter (and the packet id that follows it) outlives the session
-- with the tombstone: a delivery-progress write of the ended session retried
-- late (a Redis outage) names (packet id, score) pairs that no message of the
-- next session can have, since its scores go on from here.
-- Returns how many stored messages were deleted.

local ending = tonumber(ARGV[1])
local current = tonumber(redis.call('GET', KEYS[6]) or '0')
if ending > 0 and current > ending then return -1 end
if ARGV[3] ~= '' then
  local opens = redis.call('GET', KEYS[10])
  if opens and opens ~= ARGV[3] then return -2 end
end
local deleted = delete_messages(KEYS[1], KEYS[2])
redis.call('DEL', KEYS[4], KEYS[5], KEYS[7], KEYS[8], KEYS[9], KEYS[10])
local tombstone = math.max(current, ending) + 1
redis.call('SET', KEYS[6], string.format('%.0f', tombstone), 'PX', ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return deleted
