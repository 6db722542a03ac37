-- devicemq: store records of one exclusive compacted queue ($ECQ, broker/ecq.py).
--
-- KEYS[1] {cid}_ecq_pending  sorted set: key -> seq, not yet acknowledged
-- KEYS[2] {cid}_ecq_log      sorted set: key -> seq, latest of every key (rewind)
-- KEYS[3] {cid}_ecq_values   hash: key -> message value (persistence/format.py)
-- KEYS[4] {cid}_ecq_times    sorted set: key -> publish time, ms (retention)
-- KEYS[5] {cid}_ecq_seq      the last sequence number handed out
-- KEYS[6] {cid}_ecq_seen     hash: <producer>:<partition> -> last record seq stored
-- KEYS[7], KEYS[8] _ecq_acked, _ecq_inflight (not used here)
-- KEYS[9] _ecq_claims        a group queue's claims (persistence/lua/group_claim.lua)
-- KEYS[10] _ecq_tokens (not used here)
-- KEYS[11] _ecq_bytes        the bytes of the values KEYS[3] holds
-- KEYS[12] _ecq_full         set for FULL_MS once a record was refused: publishers
--                            are refused before Kafka meanwhile; deleted once a
--                            record fits, an entry is acknowledged (queue_ack.lua)
--                            or the queue is purged
-- KEYS[13] (optional) the store's durability counter, the last ARGV then the
-- highest value Redis acknowledged for it: below it, Redis lost acknowledged
-- writes and nothing is stored ({'lost', counter}; see save_batch.lua); else
-- the counter is counted up after the save and returned fourth, so that losing
-- this save shows as the counter going back.
-- ARGV[1] now (ms)  ARGV[2] retention (ms)  ARGV[3] most keys kept (0: no limit)
-- ARGV[4] most bytes of values kept (0: no limit)  ARGV[5] what a record that
-- would take the queue over ARGV[4] does: 'refuse' ($ECQ: acknowledged entries,
-- kept only for a rewind, leave first, oldest first; if that is not room enough
-- the record is not stored) or 'oldest' (a group queue: the oldest entries
-- leave, as a device session's trim; a record larger than the limit on its own
-- is not stored)
-- then per record: seen name, record seq (0: unnamed), key, value, publish time (ms).
-- An empty key (a group queue's record, broker/group_queue.py) is the entry's seq:
-- nothing is compacted there.
--
-- A newer value of a key replaces the older one (compaction): its sequence
-- number is returned as replaced when the older was still unacknowledged.
-- Returns {results, removed, bytes}: per record {seq, replaced} ({-1, 0}: a
-- duplicate of a record stored before; {-2, 0}: refused, over the byte limit);
-- removed = flat {key, seq, pending(0/1), why} for entries retention (why 1),
-- the key limit (why 2) or the byte limit (why 3) took out; bytes: the bytes
-- of the values kept after the save.

local last_arg = #ARGV
if KEYS[13] then
  local fence = tonumber(redis.call('GET', KEYS[13]) or '0')
  if fence < tonumber(ARGV[last_arg]) then return {'lost', tostring(fence)} end
  last_arg = last_arg - 1
end

local pending, log, values, times, counter, seen = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local now, retention, max_keys = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local max_bytes, refuse = tonumber(ARGV[4]), ARGV[5] == 'refuse'
local results, removed = {}, {}
local refused, stored = 0, 0
local FULL_MS = 60000  -- as queue_store.py FULL_MS

-- The byte count; a queue stored before it was kept has it counted once here.
local bytes = tonumber(redis.call('GET', KEYS[11]) or '-1')
if bytes < 0 then
  bytes = 0
  for _, key in ipairs(redis.call('HKEYS', values)) do
    bytes = bytes + redis.call('HSTRLEN', values, key)
  end
end

local function remove(key, why)
  local seq = redis.call('ZSCORE', log, key)
  local was_pending = redis.call('ZREM', pending, key)
  bytes = bytes - redis.call('HSTRLEN', values, key)
  redis.call('ZREM', log, key)
  redis.call('ZREM', times, key)
  redis.call('HDEL', values, key)
  redis.call('HDEL', KEYS[9], key)  -- a group queue's claim on it, if any
  removed[#removed + 1] = key
  removed[#removed + 1] = tonumber(seq or '0')
  removed[#removed + 1] = was_pending
  removed[#removed + 1] = why
end

-- Entries past retention leave (at most 1000 a call).
local function expire()
  if retention <= 0 then return end
  local old = redis.call('ZRANGEBYSCORE', times, '-inf', '(' .. (now - retention), 'LIMIT', 0, 1000)
  for _, key in ipairs(old) do remove(key, 1) end
end
-- With a byte limit, first: what retention takes is room for the records.
if max_bytes > 0 then expire() end

-- Make ``want`` bytes of room by removing acknowledged entries, oldest first
-- ('refuse'): a bounded walk of the log, shared by the records of this call;
-- entries still pending are never taken for room.
local walked, walk_left = 0, 2000
local function room_from_acknowledged(want)
  local freed = 0
  while freed < want and walk_left > 0 do
    local refs = redis.call('ZRANGE', log, walked, walked + 99)
    if #refs == 0 then walk_left = 0 break end
    for _, key in ipairs(refs) do
      walk_left = walk_left - 1
      if redis.call('ZSCORE', pending, key) then
        walked = walked + 1  -- stays: the walk goes past it
      else
        local before = bytes
        remove(key, 3)
        freed = freed + before - bytes
        if freed >= want then break end
      end
      if walk_left <= 0 then break end
    end
  end
end

-- Make ``want`` bytes of room by removing the oldest entries ('oldest').
local function room_from_oldest(want)
  local freed = 0
  while freed < want do
    local oldest = redis.call('ZRANGE', log, 0, 0)
    if #oldest == 0 then break end
    local before = bytes
    remove(oldest[1], 3)
    freed = freed + before - bytes
  end
end

-- Does a value of ``size`` bytes under ``key`` fit (making room if it may)?
local function fits(key, size)
  if max_bytes <= 0 then return true end
  local older = key ~= '' and redis.call('HSTRLEN', values, key) or 0
  local over = bytes + size - older - max_bytes
  if over <= 0 then return true end
  if size > max_bytes then return false end
  if refuse then room_from_acknowledged(over) else room_from_oldest(over) end
  older = key ~= '' and redis.call('HSTRLEN', values, key) or 0
  return bytes + size - older <= max_bytes
end

for i = 6, last_arg, 5 do
  local name, record_seq, key, value, published = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local last = tonumber(redis.call('HGET', seen, name) or '0')
  if record_seq > 0 and record_seq <= last then
    results[#results + 1] = {-1, 0}
  elseif not fits(key, #value) then
    -- Refused: read again, it is a duplicate (refused once, for good).
    if record_seq > 0 then redis.call('HSET', seen, name, record_seq) end
    results[#results + 1] = {-2, 0}
    refused = refused + 1
  else
    stored = stored + 1
    if record_seq > 0 then redis.call('HSET', seen, name, record_seq) end
    local seq = redis.call('INCR', counter)
    if key == '' then key = tostring(seq) end  -- a group queue's entry: named by its seq
    local older = redis.call('ZSCORE', pending, key)
    bytes = bytes + #value - redis.call('HSTRLEN', values, key)
    redis.call('ZADD', pending, seq, key)
    redis.call('ZADD', log, seq, key)
    redis.call('HSET', values, key, value)
    redis.call('ZADD', times, published, key)
    results[#results + 1] = {seq, tonumber(older or '0')}
  end
end

if redis.call('HLEN', seen) > 64 then
  -- Bounded: forget the producers that started longest ago (lowest ids), as
  -- save_batch.lua does for sessions.
  local fields = redis.call('HKEYS', seen)
  table.sort(fields, function(a, b)
    return tonumber(a:match('^(%d+)')) < tonumber(b:match('^(%d+)'))
  end)
  for j = 1, #fields - 64 do redis.call('HDEL', seen, fields[j]) end
end
expire()
if max_keys > 0 then
  local over = redis.call('ZCARD', log) - max_keys
  if over > 0 then
    for _, key in ipairs(redis.call('ZRANGE', log, 0, over - 1)) do remove(key, 2) end
  end
end
if bytes < 0 or redis.call('HLEN', values) == 0 then bytes = 0 end
redis.call('SET', KEYS[11], bytes)
if refused > 0 then
  redis.call('SET', KEYS[12], 1, 'PX', FULL_MS)
elseif stored > 0 then
  redis.call('DEL', KEYS[12])
end
if KEYS[13] then return {results, removed, bytes, redis.call('INCR', KEYS[13])} end
return {results, removed, bytes}
