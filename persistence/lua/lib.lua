-- devicemq: helpers shared by the scripts below; persistence/redis_store.py puts
-- this file in front of every script it loads.
--
-- A client's stored messages: the sorted set {cid}_messages (member = packet id,
-- score = the client's counter) and the hash {cid}_values, packet id -> entry.
-- An entry is an 8-byte big-endian double, the message's deadline in ms since
-- the epoch (0: none, the entry lives as long as the hash, i.e. the session),
-- then the message value of persistence/format.py (its flags byte is the
-- entry's 10th byte). One hash per client instead of a string per message: a
-- small hash is one listpack, a few bytes per entry beyond the value, where a
-- string key costs its own key, object, expiry and table slots (BENCHMARKS.md,
-- "The fleet's size").

-- Redis's clock, ms since the epoch (the scripts replicate their effects, so
-- reading it is allowed).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function entry_of(deadline, value)
  return struct.pack('>d', deadline) .. value
end

-- The entry still holds a message at ``now`` (false: gone or expired).
local function live(entry, now)
  if not entry then return false end
  local deadline = struct.unpack('>d', entry)
  return deadline == 0 or deadline > now
end

-- Is the entry marked sent (the SENT bit of its value's flags byte)?
local function entry_sent(entry)
  return entry ~= false and entry ~= nil and #entry > 9
    and bit.band(string.byte(entry, 10), 1) == 1
end

-- The entry marked sent: no deadline any more (in flight, it lives as long as
-- the session), the SENT bit set.
local function sent_entry(entry)
  local flags = bit.bor(string.byte(entry, 10), 1)
  return entry_of(0, entry:sub(9, 9) .. string.char(flags) .. entry:sub(11))
end

-- The size of the message an entry holds (its value, as the byte count counts it).
local function value_size(entry)
  if not entry then return 0 end
  return #entry - 8
end

-- Data stored by devicemq before the values hash (up to a7dfed5): one string
-- {cid}_messages_<id> per message, with a TTL of its own (none or the
-- session's once sent), and {cid}_last_packet_id. A client with refs and no
-- values hash is of that layout (the new one deletes a ref with its entry):
-- its strings move into the hash, each unsent one with its remaining TTL as
-- its deadline, a sent one without (it lived as long as the session); a ref
-- whose string is gone had expired and goes. Every script on a client's
-- messages calls this first (the save script only when the set has refs), so
-- both layouts are read, and the old one only once. True when it moved any.
local function upgrade(set_key, values_key)
  if redis.call('EXISTS', values_key) == 1 or redis.call('EXISTS', set_key) == 0 then
    return false
  end
  local refs = redis.call('ZRANGE', set_key, 0, -1)
  local now = now_ms()
  local old = {}
  for i = 1, #refs do
    local key = set_key .. '_' .. refs[i]
    local value = redis.call('GET', key)
    if value then
      local deadline = 0
      if bit.band(string.byte(value, 2), 1) == 0 then
        local pttl = redis.call('PTTL', key)
        if pttl > 0 then deadline = now + pttl end
      end
      redis.call('HSET', values_key, refs[i], entry_of(deadline, value))
      old[#old + 1] = key
    else
      redis.call('ZREM', set_key, refs[i])
    end
    if #old == 500 then
      redis.call('DEL', unpack(old))
      old = {}
    end
  end
  if #old > 0 then redis.call('DEL', unpack(old)) end
  local prefix = set_key:sub(1, -10)  -- '{cid}': set_key is '{cid}_messages'
  if redis.call('EXISTS', values_key) == 1 then
    local bytes = tonumber(redis.call('GET', prefix .. '_bytes') or '0')
    if bytes > 0 then redis.call('HSET', values_key, 'b', string.format('%.0f', bytes)) end
    local pttl = redis.call('PTTL', set_key)
    if pttl > 0 then redis.call('PEXPIRE', values_key, pttl) end
  end
  redis.call('DEL', prefix .. '_last_packet_id', prefix .. '_bytes')
  return true
end

-- The size of the values stored (for the byte limit) is field 'b' of the values
-- hash (absent: 0); a key of its own per client cost more than the count.
-- Take ``freed`` bytes off it; an empty set, or a count gone to 0 or below, is 0.
local function release_bytes(values_key, set_key, freed)
  if freed > 0 then
    if redis.call('ZCARD', set_key) == 0 then
      redis.call('HDEL', values_key, 'b')  -- the last message went (the common case)
      return
    end
    local left = tonumber(redis.call('HGET', values_key, 'b') or '0') - freed
    if left <= 0 then
      redis.call('HDEL', values_key, 'b')
    else
      redis.call('HSET', values_key, 'b', string.format('%.0f', left))
    end
  end
end

-- Delete every stored message of the client (the set and the values hash, or
-- the strings of the layout before); returns how many refs the set held.
local function delete_messages(set_key, values_key)
  if redis.call('EXISTS', values_key) == 1 then
    local count = redis.call('ZCARD', set_key)
    redis.call('DEL', set_key, values_key)
    return count
  end
  local refs = redis.call('ZRANGE', set_key, 0, -1)
  do
    local chunk = {}
    for i = 1, #refs do
      chunk[#chunk + 1] = set_key .. '_' .. refs[i]
      if #chunk == 500 then
        redis.call('DEL', unpack(chunk))
        chunk = {}
      end
    end
    if #chunk > 0 then redis.call('DEL', unpack(chunk)) end
    redis.call('DEL', set_key:sub(1, -10) .. '_last_packet_id')
  end
  redis.call('DEL', set_key, set_key:sub(1, -10) .. '_bytes')
  return #refs
end
