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

local CHUNK = 500  -- ids per variadic command: a bounded unpack

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
  local dropped = {}  -- ids of expired entries removed (counted once)
  -- A few commands per chunk of ids rather than a few per id (ack.lua).
  for first = at + 1, at + 2 * n, 2 * CHUNK do
    local last = math.min(first + 2 * CHUNK - 2, at + 2 * n - 1)
    local ids = {}
    local wants = {}
    for i = first, last, 2 do
      ids[#ids + 1] = ARGV[i]
      wants[#wants + 1] = ARGV[i + 1]
    end
    local scores = redis.call('ZMSCORE', set_key, unpack(ids))
    local asked = {}  -- positions of the ids whose message is still theirs
    for q = 1, #ids do
      local want = tonumber(wants[q])
      local score = scores[q]
      -- An id that belongs to a newer message now is left alone.
      if not (want > 0 and score and tonumber(score) ~= want) then asked[#asked + 1] = q end
    end
    if #asked > 0 then
      local names = {}
      for a = 1, #asked do names[a] = ids[asked[a]] end
      local entries = redis.call('HMGET', values_key, unpack(names))
      local updates = {}
      local expired = {}
      local held = {}
      for a = 1, #asked do
        local id = names[a]
        local entry = entries[a]
        if live(entry, now) then
          if not entry_sent(entry) or struct.unpack('>d', entry) ~= 0 then
            updates[#updates + 1] = id
            updates[#updates + 1] = sent_entry(entry)
          end
          marked[#marked + 1] = id
          marked[#marked + 1] = wants[asked[a]]
        elseif not dropped[id] then
          dropped[id] = true
          expired[#expired + 1] = id
          if entry then held[#held + 1] = id end
          freed = freed + value_size(entry)
        end
      end
      if #updates > 0 then redis.call('HSET', values_key, unpack(updates)) end
      if #expired > 0 then redis.call('ZREM', set_key, unpack(expired)) end
      if #held > 0 then redis.call('HDEL', values_key, unpack(held)) end
    end
  end
  release_bytes(values_key, set_key, freed)
  marked_by_client[j] = marked
  at = at + 1 + 2 * n
end
return marked_by_client
