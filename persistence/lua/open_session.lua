-- devicemq: a client connects to a durable session: resume the stored one, or
-- start a new one with a new generation.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_values   KEYS[3] {cid}_last_score
-- KEYS[4] {cid}_seen   KEYS[5] {cid}_session   KEYS[6] {cid}_generation
-- KEYS[7] {cid}_bytes   KEYS[8] {cid}_opens
-- ARGV[1] 'resume' (clean start 0) or 'new' (clean start 1)
-- ARGV[2] proposed generation (the broker's clock, in ms * 1000)
-- ARGV[3] the new session's state (written for a new session only)
-- ARGV[4] who asks (the owner the session would have)   ARGV[5] '1': a stored
-- session of another owner is refused, '0': not checked
--
-- A stored session bound to another owner (its state's "o"), checked: nothing
-- changes; returns {'refused'}: neither its messages nor its existence are
-- another owner's to take. Resume with a stored session: its resumes are
-- counted (KEYS[8], kept ARGV[6] ms); returns {generation, state, resumes}: an
-- end for its expiry by a replica that saw an earlier count is refused
-- (end_session.lua; tests/model/FINDINGS.md, finding 40). Otherwise a new session: whatever is stored
-- belongs to no live session and is deleted, the generation becomes
-- max(proposed, current + 1) (it only ever grows: records of every earlier
-- session carry a lower one), and the state is written. Returns
-- {generation, false}. The score counter and packet id go on from the
-- ended session's (end_session.lua), so that its late progress writes match
-- nothing of the new one.

local current = tonumber(redis.call('GET', KEYS[6]) or '0')
local stored = redis.call('GET', KEYS[5])
if stored and ARGV[5] == '1' then
  local owner = cjson.decode(stored)['o']
  if type(owner) == 'string' and owner ~= ARGV[4] then return {'refused'} end
end
if ARGV[1] == 'resume' and stored then
  local opens = redis.call('INCR', KEYS[8])
  redis.call('PEXPIRE', KEYS[8], ARGV[6])
  return {string.format('%.0f', current), stored, opens}
end
delete_messages(KEYS[1], KEYS[2])
redis.call('DEL', KEYS[4], KEYS[7], KEYS[8])
local generation = math.max(tonumber(ARGV[2]), current + 1)
local text = string.format('%.0f', generation)
redis.call('SET', KEYS[6], text)
redis.call('SET', KEYS[5], ARGV[3])
return {text, false}
