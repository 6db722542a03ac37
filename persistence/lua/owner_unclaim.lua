-- devicemq: take back a queue claim that passed its owner's ecq.max_queues_per_owner
-- (two replicas claiming new queues of one owner at once: persistence/owner_store.py).
--
-- KEYS[1] the claim ({cid}_ecq_owner)   ARGV[1] the owner
--
-- Deleted only if that owner still holds it; returns 1 if it was.

if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
