-- devicemq: session state and the lifetime of all of a client's keys.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_values   KEYS[3] {cid}_last_score
-- KEYS[4] {cid}_seen   KEYS[5] {cid}_session   KEYS[6] {cid}_generation
-- KEYS[7] {cid}_bytes
-- ARGV[1] 'save' or 'expire'   ARGV[2] TTL in ms, 0 = no expiry
-- ARGV[3] session state (opaque bytes; 'save' only)
-- ARGV[4] the session's generation (0: unknown, not checked)
--
-- Fenced by generation: a write for an older generation than the client's
-- current one (its session ended, or a newer one was opened elsewhere) does
-- nothing and returns -1.
-- save:   write the session; with a TTL every key above expires with it,
--         without one they are all made persistent (client connected, or a
--         session that never expires).
-- expire: every key above expires in ARGV[2] ms (client disconnected).
-- Entries never sent keep their own deadline (message expiry, at most the
-- default); sent ones have none: they live as long as the values hash, i.e.
-- the session.
-- Returns 1 if the session key existed before the call, else 0.

upgrade(KEYS[1], KEYS[2])
local ttl = tonumber(ARGV[2])
local generation = tonumber(ARGV[4])
local current = tonumber(redis.call('GET', KEYS[6]) or '0')
if generation > 0 and current > generation then return -1 end
local existed = redis.call('EXISTS', KEYS[5])
if generation > current then
  redis.call('SET', KEYS[6], string.format('%.0f', generation))
end
if ARGV[1] == 'save' then
  if ttl > 0 then
    redis.call('SET', KEYS[5], ARGV[3], 'PX', ttl)
  else
    redis.call('SET', KEYS[5], ARGV[3])
  end
end
local function live_as_the_session(key)
  if ttl > 0 then
    redis.call('PEXPIRE', key, ttl)
  else
    redis.call('PERSIST', key)
  end
end
for k = 1, 7 do live_as_the_session(KEYS[k]) end
return existed
