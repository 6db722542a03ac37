-- devicemq: acknowledged (PUBACK / PUBCOMP): remove refs and their entries, for
-- many clients in one call (one per flush of delivery progress, per Redis Cluster
-- slot: persistence/redis_store.py, write_progress).
--
-- For client j (1-based) of ARGV[1] clients: KEYS[2j-1] {cid}_messages,
-- KEYS[2j] {cid}_values (its field 'b' the byte count); after ARGV[1], each client's
-- pair count n, then its n pairs: packet id, score (the score the sender read
-- the message with; 0: not checked). An id whose ref has another score now
-- belongs to a newer message (the one acknowledged was trimmed and its id
-- given on, mark_sent.lua): it is left alone. Returns, per client, how many
-- refs were removed.

local removed_by_client = {}
local at = 2
for j = 1, tonumber(ARGV[1]) do
  local set_key = KEYS[2 * j - 1]
  local values_key = KEYS[2 * j]
  upgrade(set_key, values_key)
  local n = tonumber(ARGV[at])
  local removed = 0
  local freed = 0
  for i = at + 1, at + 2 * n, 2 do
    local id = ARGV[i]
    local want = tonumber(ARGV[i + 1])
    local score = redis.call('ZSCORE', set_key, id)
    if not (want > 0 and score and tonumber(score) ~= want) then
      local entry = redis.call('HGET', values_key, id)
      if redis.call('ZREM', set_key, id) == 1 then
        removed = removed + 1
        freed = freed + value_size(entry)
      end
      if entry then redis.call('HDEL', values_key, id) end
    end
  end
  release_bytes(values_key, set_key, freed)
  removed_by_client[j] = removed
  at = at + 1 + 2 * n
end
return removed_by_client
