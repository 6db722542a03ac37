-- devicemq: record that messages are about to be sent (DUP on any later send), for
-- many clients in one call (one per flush of delivery progress, per Redis Cluster
-- slot: persistence/redis_store.py, write_progress).
--
-- For client j (1-based) of ARGV[1] clients: KEYS[2j-1] {cid}_messages,
-- KEYS[2j] {cid}_values; after ARGV[1], each client's pair count n, then its n
-- pairs: packet id, score (the score the sender read the message with; 0: not
-- checked).
-- Sets the SENT bit of the entry's value (lib.lua) and drops its deadline.
-- From now on the message may have been seen, so it lives as long as the
-- session (the values hash does), whatever its own expiry: it goes when the
-- client acknowledges it or the session ends, never before (its packet id
-- stays taken meanwhile). An entry that has expired or been trimmed is not
-- recreated and its ref is removed: that message must not be sent. Nor may it
-- when its packet id is now another message's (its ref has another score): a
-- message trimmed while the sender held it in memory freed its id, and a newer
-- one took it; marking (and later acknowledging) that one would lose it.
-- Returns, per client, the (id, score) pairs marked, flattened.

local marked_by_client = {}
local now = now_ms()
local at = 2
for j = 1, tonumber(ARGV[1]) do
  local set_key = KEYS[2 * j - 1]
  local values_key = KEYS[2 * j]
  upgrade(set_key, values_key)
  local n = tonumber(ARGV[at])
  local marked = {}
  local freed = 0  -- expired entries' bytes leave the count with them
  for i = at + 1, at + 2 * n, 2 do
    local id = ARGV[i]
    local want = tonumber(ARGV[i + 1])
    local score = redis.call('ZSCORE', set_key, id)
    if want > 0 and score and tonumber(score) ~= want then
      -- the id belongs to a newer message now: leave it alone
    else
      local entry = redis.call('HGET', values_key, id)
      if live(entry, now) then
        if not entry_sent(entry) or struct.unpack('>d', entry) ~= 0 then
          redis.call('HSET', values_key, id, sent_entry(entry))
        end
        marked[#marked + 1] = id
        marked[#marked + 1] = ARGV[i + 1]
      else
        redis.call('ZREM', set_key, id)
        if entry then redis.call('HDEL', values_key, id) end
        freed = freed + value_size(entry)
      end
    end
  end
  release_bytes(values_key, set_key, freed)
  marked_by_client[j] = marked
  at = at + 1 + 2 * n
end
return marked_by_client
