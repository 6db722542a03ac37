-- devicemq: store one client's batch of persisted messages (one call per batch).
--
-- KEYS[1] {cid}_messages        sorted set: member = packet id, score = per-client counter
-- KEYS[2] {cid}_last_packet_id  last packet id handed out (1..65535)
-- KEYS[3] {cid}_last_score      last score handed out (never goes backwards)
-- KEYS[4] {cid}_last_offset     hash: Kafka partition -> last offset stored
-- KEYS[5] {cid}_session         session state (only its TTL is read here)
-- Message strings are KEYS[1] .. '_' .. packetId: same hash tag, same slot.
--
-- ARGV[1] limit (1..65535)   ARGV[2] partition
-- ARGV[3] default TTL in ms (how long orphaned keys are kept, see the end)
-- ARGV[4] n   ARGV[5] n triples of big-endian doubles: Kafka offset, TTL in
-- ms (<= 0: already expired), length of the value   ARGV[6] how many of the
-- stored messages to store already marked sent (they go to the waiting
-- client right away, so no separate mark write is needed)   ARGV[7] the
-- values (opaque bytes), one after another: one argument instead of n keeps
-- the client's command packing cheap
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
-- Returns {scores, trimmed}: scores[i] is message i's score, 0 when it had
-- already expired, -1 when its offset was already stored (a replayed batch),
-- -3 when it did not fit (every stored message in flight, see above).
-- trimmed lists the packet ids removed, oldest first, to respect limit.

local set_key = KEYS[1]
local limit = tonumber(ARGV[1])
local partition = ARGV[2]
local default_ttl = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local meta = ARGV[5]
local premark = tonumber(ARGV[6])
local values = ARGV[7]
local value_end = 0

local last_offset = tonumber(redis.call('HGET', KEYS[4], partition) or '-1')
local start_offset = last_offset
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
    local flags = redis.call('GETRANGE', key, 1, 1)
    if flags ~= '' and bit.band(string.byte(flags), 1) == 1 then
      rank = rank + 1
    else
      redis.call('ZREM', set_key, ref[1])
      redis.call('DEL', key)
      return tonumber(ref[1])
    end
  end
end
for i = 1, n do
  local offset, ttl, size = struct.unpack('>ddd', meta, (i - 1) * 24 + 1)
  local value_start = value_end + 1
  value_end = value_end + size
  if offset <= last_offset then
    scores[i] = -1
  else
    last_offset = offset
    if ttl <= 0 then
      scores[i] = 0
    else
      -- Make room first: the oldest unsent out.
      while card >= limit do
        local victim = trim_oldest_unsent()
        if not victim then break end
        trimmed[#trimmed + 1] = victim
        card = card - 1
      end
    end
    if ttl <= 0 then
      -- already expired: nothing to store
    elseif card >= limit then
      scores[i] = -3
    else
      -- card < limit <= 65535: at least one packet id is free, the search ends.
      -- Next score and its id, skipping ids still stored.
      repeat
        score = score + 1
        last_id = (score - 1) % 65535 + 1
      until not check or not redis.call('ZSCORE', set_key, last_id)
      local value = values:sub(value_start, value_end)
      if stored < premark then
        -- Marked sent, as mark_sent.lua marks it: it lives as long as the session.
        value = value:sub(1, 1) .. string.char(bit.bor(value:byte(2), 1)) .. value:sub(3)
        if session_ttl > 0 then
          redis.call('SET', set_key .. '_' .. last_id, value, 'PX', session_ttl)
        elseif session_ttl == -1 then
          redis.call('SET', set_key .. '_' .. last_id, value)
        else
          redis.call('SET', set_key .. '_' .. last_id, value, 'PX', ttl)
        end
      else
        redis.call('SET', set_key .. '_' .. last_id, value, 'PX', ttl)
      end
      redis.call('ZADD', set_key, score, last_id)
      card = card + 1
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
if last_offset ~= start_offset then
  redis.call('HSET', KEYS[4], partition, last_offset)
end

-- The client's keys live as long as its session: while the session key has a
-- TTL (client gone, session expiring) they expire with it; with no session
-- key at all (orphaned data) they last at least as long as the messages just
-- stored, and at least the default TTL, then vanish.
if session_ttl > 0 then
  for k = 1, 4 do redis.call('PEXPIRE', KEYS[k], session_ttl) end
elseif session_ttl == -2 and (stored > 0 or last_offset ~= start_offset) then
  local keep = default_ttl
  if max_ttl > keep then keep = max_ttl end
  for k = 1, 4 do
    local cur = redis.call('PTTL', KEYS[k])
    if cur ~= -2 and cur < keep then redis.call('PEXPIRE', KEYS[k], keep) end
  end
end

return {scores, trimmed}
