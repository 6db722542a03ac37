-- devicemq: session state and the lifetime of all of a client's keys.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_last_packet_id   KEYS[3] {cid}_last_score
-- KEYS[4] {cid}_last_offset   KEYS[5] {cid}_session
-- ARGV[1] 'save' or 'expire'   ARGV[2] TTL in ms, 0 = no expiry
-- ARGV[3] session state (opaque bytes; 'save' only)
--
-- save:   write the session; with a TTL every key above expires with it,
--         without one they are all made persistent (client connected, or a
--         session that never expires).
-- expire: every key above expires in ARGV[2] ms (client disconnected).
-- Message strings keep their own TTL (message expiry, at most the default).
-- Returns 1 if the session key existed before the call, else 0.

local ttl = tonumber(ARGV[2])
local existed = redis.call('EXISTS', KEYS[5])
if ARGV[1] == 'save' then
  if ttl > 0 then
    redis.call('SET', KEYS[5], ARGV[3], 'PX', ttl)
  else
    redis.call('SET', KEYS[5], ARGV[3])
  end
end
for k = 1, 5 do
  if ttl > 0 then
    redis.call('PEXPIRE', KEYS[k], ttl)
  else
    redis.call('PERSIST', KEYS[k])
  end
end
return existed
