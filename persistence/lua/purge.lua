-- devicemq: an operator purges a client's backlog: every stored message never
-- sent goes, with its entry; the session stays.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_values (its field 'b' the byte count)
-- Messages marked sent (in flight) stay until the client acknowledges them: their
-- packet ids are taken, and freeing one could let a newer message take it, which
-- the client's late PUBACK would then remove (redis_store.py, "In flight until
-- acknowledged"). A sender holding a purged message in memory finds its entry
-- gone when it marks it (mark_sent.lua) and does not send it.
-- A ref whose entry has expired is dropped as load_page drops it, and not
-- reported: that message expired, it was not purged (the audit tells them apart).
-- Returns the (id, score) pairs removed, flattened, in score order.

local set_key = KEYS[1]
local values_key = KEYS[2]
upgrade(set_key, values_key)
local now = now_ms()
local refs = redis.call('ZRANGE', set_key, 0, -1, 'WITHSCORES')
local removed = {}
local freed = 0
for j = 1, #refs, 2 do
  local entry = redis.call('HGET', values_key, refs[j])
  if not live(entry, now) then
    freed = freed + value_size(entry)
    redis.call('ZREM', set_key, refs[j])
    if entry then redis.call('HDEL', values_key, refs[j]) end
  elseif not entry_sent(entry) then
    freed = freed + value_size(entry)
    redis.call('HDEL', values_key, refs[j])
    redis.call('ZREM', set_key, refs[j])
    removed[#removed + 1] = refs[j]
    removed[#removed + 1] = refs[j + 1]
  end
end
release_bytes(values_key, set_key, freed)
return removed
