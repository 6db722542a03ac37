-- devicemq: store one client's batch of persisted messages (one call per batch).
--
-- KEYS[1] {cid}_messages        sorted set: member = packet id, score = per-client counter
-- KEYS[2] {cid}_last_packet_id  last packet id handed out (1..65535)
-- KEYS[3] {cid}_last_score      last score handed out (never goes backwards)
-- KEYS[4] {cid}_seen            hash: '<producer>:<partition>' -> last seq stored
-- KEYS[5] {cid}_session         session state (only its TTL is read here)
-- KEYS[6] {cid}_generation      generation of the client's current session
-- KEYS[7] {cid}_bytes           size of the values stored
-- Message strings are KEYS[1] .. '_' .. packetId: same hash tag, same slot.
--
-- ARGV[1] limit (1..65535)   ARGV[2] Kafka partition the batch came from
-- ARGV[3] default TTL in ms (how long orphaned keys are kept, see the end)
-- ARGV[4] n   ARGV[5] n quintuples of big-endian doubles: producer, seq,
-- generation, TTL in ms (<= 0: already expired), length of the value
-- ARGV[6] how many of the stored messages to store already marked sent (they
-- go to the waiting client right away, so no separate mark write is needed)
-- ARGV[7] the values (opaque bytes), one after another: one argument instead
-- of n keeps the client's command packing cheap   ARGV[8] byte limit (0: none):
-- the oldest unsent go while the stored values would exceed it, as for limit
--
-- A record is named by (producer, seq); one producer's records reach one
-- partition in order, so a seq at or below the last one stored from that
-- producer through that partition is a duplicate (a retried produce request,
-- or a batch read again after a crash): it is not stored twice. A record of
-- an older generation than the client's session was routed for a session
-- that has ended: it is dropped. Producer 0 / generation 0 mean unknown (old
-- records): never a duplicate, never dropped.
--
-- Packet ids follow the score: id = (score - 1) % 65535 + 1, so they wrap
-- 65535 -> 1 and are never 0. A score whose id is still stored is skipped
-- (the counter moves on, the id is not reused). A stored ref can only clash
-- with a new score if it is 65535 or more steps older: when the oldest ref is
-- younger than that, the per-message check is not needed.
--
-- Over the limit the oldest message never sent is removed: a sent one (SENT
-- bit, or in its PUBREL stage) is in flight to the client, its packet id must
-- stay taken until the client acknowledges it, so it is never trimmed. When
-- every stored message is in flight, the new message itself is not stored.
--
-- KEYS[8] (optional, single Redis or Sentinel's master) this store's durability
-- counter, ARGV[9] the highest value Redis acknowledged for it: a counter
-- below that means Redis lost acknowledged writes (a replica without them took
-- over, a restart from an older file). Nothing is stored then and {'lost',
-- counter} is returned: a record whose save was lost must be saved again when
-- Kafka is read again, and a later record stored first would make it look
-- like a duplicate (its seq below the last one seen).
--
-- Returns {scores, trimmed}: scores[i] is message i's score, 0 when it had
-- already expired, -1 when it was a duplicate, -2 when its session had ended
-- (older generation), -3 when it did not fit (every stored message in flight).
-- trimmed lists the packet ids removed, oldest first, to respect limit.

if KEYS[8] then
  local counter = tonumber(redis.call('GET', KEYS[8]) or '0')
  if counter < tonumber(ARGV[9]) then return {'lost', tostring(counter)} end
end

local set_key = KEYS[1]
local limit = tonumber(ARGV[1])
local partition = ARGV[2]
local default_ttl = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local meta = ARGV[5]
local premark = tonumber(ARGV[6])
local values = ARGV[7]
local max_bytes = tonumber(ARGV[8] or '0')
local value_end = 0

local current_gen = tonumber(redis.call('GET', KEYS[6]) or '0')
local gen_changed = false
local seen = {}
local seen_changed = {}
local last_id = 0
local score = tonumber(redis.call('GET', KEYS[3]) or '0')
-- The counter lives in its own key; should that key ever be lost while refs
-- remain, continue above the highest score still in the set.
local top = redis.call('ZRANGE', set_key, -1, -1, 'WITHSCORES')
if top[2] then
  local top_score = tonumber(top[2])
  if top_score > score then score = top_score end
end
local card = redis.call('ZCARD', set_key)
local bytes = 0
if card > 0 then bytes = tonumber(redis.call('GET', KEYS[7]) or '0') end
local bytes_changed = false
local check = n >= 65535
if card > 0 then
  local oldest = redis.call('ZRANGE', set_key, 0, 0, 'WITHSCORES')
  check = check or tonumber(oldest[2]) + 65535 <= score + n
end

local scores = {}
local trimmed = {}
local stored = 0
local max_ttl = 0
local session_ttl = redis.call('PTTL', KEYS[5])

-- Refs below this rank are sent: the trim skips them.
local rank = 0
local function trim_oldest_unsent()
  while true do
    local ref = redis.call('ZRANGE', set_key, rank, rank)
    if not ref[1] then return nil end
    local key = set_key .. '_' .. ref[1]
    if is_sent(key) then
      rank = rank + 1
    else
      bytes = bytes - redis.call('STRLEN', key)
      bytes_changed = true
      redis.call('ZREM', set_key, ref[1])
      redis.call('DEL', key)
      return tonumber(ref[1])
    end
  end
end

for i = 1, n do
  local producer, seq, generation, ttl, size = struct.unpack('>ddddd', meta, (i - 1) * 40 + 1)
  local value_start = value_end + 1
  value_end = value_end + size
  local field = nil
  local duplicate = false
  if producer > 0 then
    field = string.format('%.0f:%s', producer, partition)
    local last = seen[field]
    if last == nil then
      last = tonumber(redis.call('HGET', KEYS[4], field) or '0')
      seen[field] = last
    end
    duplicate = seq <= last
  end
  if duplicate then
    scores[i] = -1
  elseif generation > 0 and generation < current_gen then
    scores[i] = -2
  else
    if field then
      seen[field] = seq
      seen_changed[field] = true
    end
    if generation > current_gen then
      current_gen = generation  -- the generation record was lost: this one stands
      gen_changed = true
    end
    local too_big = max_bytes > 0 and size > max_bytes
    if ttl > 0 and not too_big then
      -- Make room first: the oldest unsent out.
      while card >= limit or (max_bytes > 0 and card > 0 and bytes + size > max_bytes) do
        local victim = trim_oldest_unsent()
        if not victim then break end
        trimmed[#trimmed + 1] = victim
        card = card - 1
      end
    end
    if ttl <= 0 then
      scores[i] = 0
    elseif card >= limit or (max_bytes > 0 and bytes + size > max_bytes) then
      scores[i] = -3
    else
      -- card < limit <= 65535: at least one packet id is free, the search ends.
      -- Next score and its id, skipping ids still stored.
      repeat
        score = score + 1
        last_id = (score - 1) % 65535 + 1
      until not check or not redis.call('ZSCORE', set_key, last_id)
      local value = values:sub(value_start, value_end)
      local key = set_key .. '_' .. last_id
      if stored < premark then
        -- Marked sent, as mark_sent.lua marks it: it lives as long as the session.
        value = value:sub(1, 1) .. string.char(bit.bor(value:byte(2), 1)) .. value:sub(3)
        if session_ttl > 0 then
          redis.call('SET', key, value, 'PX', session_ttl)
        elseif session_ttl == -1 then
          redis.call('SET', key, value)
        else
          redis.call('SET', key, value, 'PX', ttl)
        end
      else
        redis.call('SET', key, value, 'PX', ttl)
      end
      redis.call('ZADD', set_key, score, last_id)
      card = card + 1
      bytes = bytes + size
      bytes_changed = true
      stored = stored + 1
      if ttl > max_ttl then max_ttl = ttl end
      scores[i] = score
    end
  end
end

if stored > 0 then
  redis.call('SET', KEYS[2], last_id)
  redis.call('SET', KEYS[3], score)
end
if bytes_changed then
  redis.call('SET', KEYS[7], string.format('%.0f', bytes))
end
local any_seen = false
for f in pairs(seen_changed) do
  redis.call('HSET', KEYS[4], f, string.format('%.0f', seen[f]))
  any_seen = true
end
if any_seen and redis.call('HLEN', KEYS[4]) > 64 then
  -- Bounded: forget the producers that started longest ago (lowest ids).
  local fields = redis.call('HKEYS', KEYS[4])
  table.sort(fields, function(a, b)
    return tonumber(a:match('^(%d+)')) < tonumber(b:match('^(%d+)'))
  end)
  for j = 1, #fields - 64 do redis.call('HDEL', KEYS[4], fields[j]) end
end
if gen_changed then
  redis.call('SET', KEYS[6], string.format('%.0f', current_gen))
end

-- The client's keys live as long as its session: while the session key has a
-- TTL (client gone, session expiring) they expire with it; with no session
-- key at all (orphaned data) they last at least as long as the messages just
-- stored, and at least the default TTL, then vanish.
local lifetime_keys = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6], KEYS[7]}
if session_ttl > 0 then
  for _, k in ipairs(lifetime_keys) do redis.call('PEXPIRE', k, session_ttl) end
elseif session_ttl == -2 and (stored > 0 or any_seen or gen_changed or bytes_changed) then
  local keep = default_ttl
  if max_ttl > keep then keep = max_ttl end
  for _, k in ipairs(lifetime_keys) do
    local cur = redis.call('PTTL', k)
    if cur ~= -2 and cur < keep then redis.call('PEXPIRE', k, keep) end
  end
end

return {scores, trimmed}
