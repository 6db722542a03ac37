-- devicemq: helpers shared by the scripts below; persistence/redis_store.py puts
-- this file in front of every script it loads.

-- Is the message string ``key`` marked sent (the SENT bit of its flags byte,
-- persistence/format.py)? A missing string is not.
local function is_sent(key)
  local flags = redis.call('GETRANGE', key, 1, 1)
  return flags ~= '' and bit.band(string.byte(flags), 1) == 1
end

-- Take ``freed`` bytes off the byte count ``bytes_key`` of the set ``set_key``
-- (its TTL kept); an empty set, or a count gone below 0, is 0.
local function release_bytes(bytes_key, set_key, freed)
  if freed > 0 and redis.call('EXISTS', bytes_key) == 1 then
    local left = redis.call('DECRBY', bytes_key, freed)
    if left < 0 or redis.call('ZCARD', set_key) == 0 then redis.call('SET', bytes_key, 0, 'KEEPTTL') end
  end
end

-- Delete every message string of the set ``set_key`` (not the set itself);
-- returns how many refs the set held.
local function delete_messages(set_key)
  local refs = redis.call('ZRANGE', set_key, 0, -1)
  local chunk = {}
  for i = 1, #refs do
    chunk[#chunk + 1] = set_key .. '_' .. refs[i]
    if #chunk == 500 then
      redis.call('DEL', unpack(chunk))
      chunk = {}
    end
  end
  if #chunk > 0 then redis.call('DEL', unpack(chunk)) end
  return #refs
end

