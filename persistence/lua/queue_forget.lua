-- devicemq: a persistent session ended: its record of queue entries in flight
-- ($ECQ) goes, unless a later session of the client ID wrote it since.
--
-- KEYS[1] {cid}_ecq_inflight  ARGV[1] the generation of the session that ended.
-- Creates nothing: a session that never consumed a queue leaves no key.

local gen = redis.call('HGET', KEYS[1], 'gen')
if gen and tonumber(gen) <= tonumber(ARGV[1]) then
  return redis.call('DEL', KEYS[1])
end
return 0
