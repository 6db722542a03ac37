-- devicemq: an operator purges a client's backlog: every stored message never
-- sent goes, with its string; the session stays.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_bytes
-- Messages marked sent (in flight) stay until the client acknowledges them: their
-- packet ids are taken, and freeing one could let a newer message take it, which
-- the client's late PUBACK would then remove (redis_store.py, "In flight until
-- acknowledged"). A sender holding a purged message in memory finds its string
-- gone when it marks it (mark_sent.lua) and does not send it.
-- A ref whose string has expired is dropped as load_page drops it, and not
-- reported: that message expired, it was not purged (the audit tells them apart).
-- Returns the (id, score) pairs removed, flattened, in score order.

local set_key = KEYS[1]
local refs = redis.call('ZRANGE', set_key, 0, -1, 'WITHSCORES')
local removed = {}
local freed = 0
for j = 1, #refs, 2 do
  local key = set_key .. '_' .. refs[j]
  if redis.call('EXISTS', key) == 0 then
    redis.call('ZREM', set_key, refs[j])
  elseif not is_sent(key) then
    freed = freed + redis.call('STRLEN', key)
    redis.call('DEL', key)
    redis.call('ZREM', set_key, refs[j])
    removed[#removed + 1] = refs[j]
    removed[#removed + 1] = refs[j + 1]
  end
end
release_bytes(KEYS[2], set_key, freed)
return removed
