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
-- refs were removed. The ids go a chunk at a time through variadic commands
-- (ZMSCORE, ZREM, HMGET, HDEL): a replay acknowledges dozens per call.

local CHUNK = 500  -- ids per variadic command: a bounded unpack

local removed_by_client = {}
local at = 2
for j = 1, tonumber(ARGV[1]) do
  local set_key = KEYS[2 * j - 1]
  local values_key = KEYS[2 * j]
  upgrade(set_key, values_key)
  local n = tonumber(ARGV[at])
  local removed = 0
  local gone = {}  -- the ids acknowledged: their entries go too
  local freed_ids = {}  -- those whose ref went with them (their bytes leave the count)
  -- A few commands per chunk of ids rather than a few per id: a call from Lua costs
  -- about what a small command's own work does (BENCHMARKS.md).
  for first = at + 1, at + 2 * n, 2 * CHUNK do
    local last = math.min(first + 2 * CHUNK - 2, at + 2 * n - 1)
    local ids = {}
    for i = first, last, 2 do ids[#ids + 1] = ARGV[i] end
    local scores = redis.call('ZMSCORE', set_key, unpack(ids))
    local refs = {}
    for q = 1, #ids do
      local id = ids[q]
      local want = tonumber(ARGV[first + 2 * q - 1])
      local score = scores[q]
      if not (want > 0 and score and tonumber(score) ~= want) then
        gone[#gone + 1] = id
        if score and not freed_ids[id] then
          freed_ids[id] = true
          refs[#refs + 1] = id
        end
      end
    end
    if #refs > 0 then removed = removed + redis.call('ZREM', set_key, unpack(refs)) end
  end
  if #gone > 0 then
    if removed > 0 and redis.call('ZCARD', set_key) == 0 then
      -- The last ref went (a fleet's client, the common case): the values hash
      -- holds nothing more of the client's, byte count included.
      redis.call('DEL', values_key)
    else
      local freed = 0
      for first = 1, #gone, CHUNK do
        local ids = {unpack(gone, first, math.min(first + CHUNK - 1, #gone))}
        local entries = redis.call('HMGET', values_key, unpack(ids))
        local held = {}
        for q = 1, #ids do
          local entry = entries[q]
          if entry then
            held[#held + 1] = ids[q]
            if freed_ids[ids[q]] then
              freed = freed + value_size(entry)
              freed_ids[ids[q]] = nil  -- counted once, should the id come twice
            end
          end
        end
        if #held > 0 then redis.call('HDEL', values_key, unpack(held)) end
      end
      release_bytes(values_key, set_key, freed)
    end
  end
  removed_by_client[j] = removed
  at = at + 1 + 2 * n
end
return removed_by_client
