-- devicemq: one page of a client's stored messages, in score order.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_last_score   KEYS[3] {cid}_values
-- ARGV[1] after_score (exclusive)   ARGV[2] page size
--
-- Refs whose entry has expired (its deadline passed, lib.lua) are removed, with
-- the entry, here (lazily) and do not count toward the page; their size leaves
-- the byte count. Only messages never sent can expire: a sent one lives as long
-- as the session (mark_sent.lua).
-- Returns {dropped, last_score, id, score, value, id, ...}: last_score is the
-- client's counter when the page was read, so a reader that got a short page
-- knows every message stored later has a higher score.

local set_key = KEYS[1]
local values_key = KEYS[3]
upgrade(set_key, values_key)
local now = now_ms()
local want = tonumber(ARGV[2])
local cursor = '(' .. ARGV[1]
local out = {0, tonumber(redis.call('GET', KEYS[2]) or '0')}
local got = 0
local dropped = 0
local freed = 0  -- expired entries' bytes leave the count (field 'b') with them
while got < want do
  local ask = want - got
  if ask > 500 then ask = 500 end  -- HMGET's arguments: a bounded unpack
  local refs = redis.call('ZRANGE', set_key, cursor, '+inf', 'BYSCORE', 'LIMIT', 0, ask, 'WITHSCORES')
  if #refs == 0 then break end
  local ids = {}
  for j = 1, #refs, 2 do ids[#ids + 1] = refs[j] end
  local entries = redis.call('HMGET', values_key, unpack(ids))
  for j = 1, #refs, 2 do
    local id = refs[j]
    local entry = entries[(j + 1) / 2]
    if live(entry, now) then
      out[#out + 1] = id
      out[#out + 1] = refs[j + 1]
      out[#out + 1] = entry:sub(9)
      got = got + 1
    else
      redis.call('ZREM', set_key, id)
      if entry then redis.call('HDEL', values_key, id) end
      freed = freed + value_size(entry)
      dropped = dropped + 1
    end
    cursor = '(' .. refs[j + 1]
  end
  if #refs < 2 * ask then break end
end
release_bytes(values_key, set_key, freed)
out[1] = dropped
return out
