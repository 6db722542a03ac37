-- devicemq: store the batches of persisted messages of many clients, one call per
-- consumer poll (per Redis Cluster slot): the cost of a call is paid once per
-- poll, not once per client (BENCHMARKS.md, "The fleet shape").
--
-- For client j (1-based) of c, its keys are KEYS[7(j-1)+1 .. 7(j-1)+7]:
--   1 {cid}_messages        sorted set: member = packet id, score = per-client counter
--   2 {cid}_values          hash: packet id -> entry (deadline and value, lib.lua)
--   3 {cid}_last_score      last score handed out (never goes backwards)
--   4 {cid}_seen            hash: '<producer>:<partition>' -> last seq stored
--   5 {cid}_session         session state (only its TTL is read here)
--   6 {cid}_generation      generation of the client's current session
--   7 {cid}_bytes           (the layout before: the size of the values stored, now
--                           field 'b' of {cid}_values, lib.lua)
-- The last packet id handed out is the last score's (no key of its own).
--
-- ARGV[1] c, the number of clients   ARGV[2] limit (1..65535)   ARGV[3] default TTL
-- in ms (how long orphaned keys are kept, see the end of save_client)   ARGV[4] byte
-- limit (0: none): the oldest unsent go while the stored values would exceed it,
-- as for limit. Then five arguments per client, from ARGV[5 + 5(j-1)]:
--   partition   the Kafka partition the batch came from
--   n           its number of messages
--   meta        n quintuples of big-endian doubles: producer, seq, generation, TTL
--               in ms (<= 0: already expired), length of the value
--   premark     how many of the stored messages to store already marked sent (they
--               go to the waiting client right away, so no separate mark write is
--               needed)
--   values      the values (opaque bytes), one after another: one argument instead
--               of n keeps the command packing cheap
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
-- KEYS[7c+1] (optional, single Redis or Sentinel's master) this store's
-- durability counter, ARGV[5+5c] the highest value Redis acknowledged for it: a
-- counter below that means Redis lost acknowledged writes (a replica without
-- them took over, a restart from an older file). Nothing is stored then and
-- {'lost', counter} is returned: a record whose save was lost must be saved
-- again when Kafka is read again, and a later record stored first would make it
-- look like a duplicate (its seq below the last one seen).
--
-- Returns one reply per client, in order: {scores, trimmed}, where scores[i] is
-- message i's score, 0 when it had already expired, -1 when it was a duplicate,
-- -2 when its session had ended (older generation), -3 when it did not fit
-- (every stored message in flight), and trimmed lists the packet ids removed,
-- oldest first, to respect limit; or {'error', message} when that client's save
-- failed (what it wrote before the failure stays, as with a failed call of its
-- own; the other clients are saved as usual).

local c = tonumber(ARGV[1])
if #KEYS > 7 * c then
  local counter = tonumber(redis.call('GET', KEYS[7 * c + 1]) or '0')
  if counter < tonumber(ARGV[5 + 5 * c]) then return {'lost', tostring(counter)} end
end

local limit = tonumber(ARGV[2])
local default_ttl = tonumber(ARGV[3])
local max_bytes = tonumber(ARGV[4])

-- Redis's clock once per call: every client of a call stores at the same moment.
local now = now_ms()

-- The newest entry a client's save stored: written with the byte count at the end,
-- in one HSET (a fleet's client stores one message per call), and before anything
-- reads the hash; should the client's save fail after storing it, it is written
-- then (what a failed save wrote stays, whole).
local held = {id = nil, entry = nil}
local function write_entry_held(values_key)
  if held.id then
    redis.call('HSET', values_key, held.id, held.entry)
    held.id = nil
  end
end

-- A fleet's client has nothing stored most of the time (each message acknowledged
-- before the next): the calls below are the fewest that case needs (a call from
-- Lua costs about what the command's own work does, BENCHMARKS.md).
local function save_client(k, partition, n, meta, premark, values)
  local set_key = k[1]
  local values_key = k[2]
  local value_end = 0
  local card = redis.call('ZCARD', set_key)
  if card > 0 and upgrade(set_key, values_key) then card = redis.call('ZCARD', set_key) end

  local counters = redis.call('MGET', k[6], k[3])
  local current_gen = tonumber(counters[1] or '0')
  local gen_changed = false
  local seen = {}
  local seen_changed = {}
  local last_id = 0
  local score = tonumber(counters[2] or '0')
  if card > 0 then
    -- The counter lives in its own key; should that key ever be lost while refs
    -- remain, continue above the highest score still in the set.
    local top = redis.call('ZRANGE', set_key, -1, -1, 'WITHSCORES')
    local top_score = tonumber(top[2])
    if top_score > score then score = top_score end
  end
  local bytes = 0
  if card > 0 then bytes = tonumber(redis.call('HGET', values_key, 'b') or '0') end
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
  local session_ttl = redis.call('PTTL', k[5])

  held.id = nil
  local function write_held() write_entry_held(values_key) end

  -- Refs below this rank are sent: the trim skips them.
  local rank = 0
  local function trim_oldest_unsent()
    write_held()
    while true do
      local ref = redis.call('ZRANGE', set_key, rank, rank)
      if not ref[1] then return nil end
      local entry = redis.call('HGET', values_key, ref[1])
      if entry_sent(entry) then
        rank = rank + 1
      else
        bytes = bytes - value_size(entry)
        bytes_changed = true
        redis.call('ZREM', set_key, ref[1])
        redis.call('HDEL', values_key, ref[1])
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
        last = tonumber(redis.call('HGET', k[4], field) or '0')
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
        write_held()
        held.id = last_id
        if stored < premark then
          -- Marked sent, as mark_sent.lua marks it: it lives as long as the session.
          value = value:sub(1, 1) .. string.char(bit.bor(value:byte(2), 1)) .. value:sub(3)
          held.entry = entry_of(0, value)
        else
          held.entry = entry_of(now + ttl, value)
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
    redis.call('SET', k[3], score)
  end
  if bytes_changed and bytes > 0 and card > 0 then
    if held.id then
      redis.call('HSET', values_key, held.id, held.entry, 'b', string.format('%.0f', bytes))
      held.id = nil
    else
      redis.call('HSET', values_key, 'b', string.format('%.0f', bytes))
    end
  else
    write_held()
    if bytes_changed then redis.call('HDEL', values_key, 'b') end
  end
  local any_seen = false
  local seen_added = false
  for f in pairs(seen_changed) do
    if redis.call('HSET', k[4], f, string.format('%.0f', seen[f])) == 1 then seen_added = true end
    any_seen = true
  end
  if seen_added and redis.call('HLEN', k[4]) > 64 then
    -- Bounded: forget the producers that started longest ago (lowest ids).
    local fields = redis.call('HKEYS', k[4])
    table.sort(fields, function(a, b)
      return tonumber(a:match('^(%d+)')) < tonumber(b:match('^(%d+)'))
    end)
    for j = 1, #fields - 64 do redis.call('HDEL', k[4], fields[j]) end
  end
  if gen_changed then
    redis.call('SET', k[6], string.format('%.0f', current_gen))
  end

  -- The client's keys live as long as its session: while the session key has a
  -- TTL (client gone, session expiring) they expire with it; with no session
  -- key at all (orphaned data) they last at least as long as the messages just
  -- stored, and at least the default TTL, then vanish.
  local lifetime_keys = {k[1], k[2], k[3], k[4], k[6]}
  if session_ttl > 0 then
    for _, key in ipairs(lifetime_keys) do redis.call('PEXPIRE', key, session_ttl) end
  elseif session_ttl == -2 and (stored > 0 or any_seen or gen_changed or bytes_changed) then
    local keep = default_ttl
    if max_ttl > keep then keep = max_ttl end
    for _, key in ipairs(lifetime_keys) do
      local cur = redis.call('PTTL', key)
      if cur ~= -2 and cur < keep then redis.call('PEXPIRE', key, keep) end
    end
  end

  return {scores, trimmed}
end

local replies = {}
for j = 1, c do
  local at = 7 * (j - 1)
  local k = {KEYS[at + 1], KEYS[at + 2], KEYS[at + 3], KEYS[at + 4], KEYS[at + 5], KEYS[at + 6], KEYS[at + 7]}
  local a = 5 + 5 * (j - 1)
  local ok, reply = pcall(
    save_client, k, ARGV[a], tonumber(ARGV[a + 1]), ARGV[a + 2], tonumber(ARGV[a + 3]), ARGV[a + 4]
  )
  if ok then
    replies[j] = reply
  else
    pcall(write_entry_held, k[2])
    -- redis.call raises a table {err = ...} in Redis 7, a string before
    replies[j] = {'error', type(reply) == 'table' and tostring(reply.err) or tostring(reply)}
  end
end
return replies
