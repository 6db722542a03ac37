-- devicemq: record that messages are about to be sent (DUP on any later send), for
-- many clients in one call (one per flush of delivery progress, per Redis Cluster
-- slot: persistence/redis_store.py, write_progress).
--
-- For client j (1-based) of ARGV[1] clients: KEYS[2j-1] {cid}_messages,
-- KEYS[2j] {cid}_session; after ARGV[1], each client's pair count n, then its n
-- pairs: packet id, score (the score the sender read the message with; 0: not
-- checked).
-- Sets the SENT bit (0x01 of the flags byte, byte 1 of the value, i.e. bit
-- offset 15). From now on the message may have been seen, so its string lives
-- as long as the session, whatever its own expiry: it goes when the client
-- acknowledges it or the session ends, never before (its packet id stays
-- taken meanwhile). A string that has expired or been trimmed is not
-- recreated and its ref is removed: that message must not be sent. Nor may it
-- when its packet id is now another message's (its ref has another score): a
-- message trimmed while the sender held it in memory freed its id, and a newer
-- one took it; marking (and later acknowledging) that one would lose it.
-- Returns, per client, the (id, score) pairs marked, flattened.

local marked_by_client = {}
local at = 2
for j = 1, tonumber(ARGV[1]) do
  local set_key = KEYS[2 * j - 1]
  local session_ttl = redis.call('PTTL', KEYS[2 * j])
  local n = tonumber(ARGV[at])
  local marked = {}
  for i = at + 1, at + 2 * n, 2 do
    local id = ARGV[i]
    local want = tonumber(ARGV[i + 1])
    local key = set_key .. '_' .. id
    local score = redis.call('ZSCORE', set_key, id)
    if want > 0 and score and tonumber(score) ~= want then
      -- the id belongs to a newer message now: leave it alone
    elseif redis.call('EXISTS', key) == 1 then
      redis.call('SETBIT', key, 15, 1)
      if session_ttl > 0 then
        redis.call('PEXPIRE', key, session_ttl)
      elseif session_ttl == -1 then
        redis.call('PERSIST', key)
      end
      marked[#marked + 1] = id
      marked[#marked + 1] = ARGV[i + 1]
    else
      redis.call('ZREM', set_key, id)
    end
  end
  marked_by_client[j] = marked
  at = at + 1 + 2 * n
end
return marked_by_client
