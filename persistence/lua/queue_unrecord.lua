-- devicemq: forget entries recorded in flight that never went out ($ECQ): their
-- connection ended while the record was being written, and they are taken again
-- under other packet ids.
--
-- KEYS[1] {cid}_ecq_inflight
-- ARGV pairs: packet id, the record written for it. A packet id recorded again
-- since (another entry under it) is left alone. Returns how many were removed.

local removed = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    removed = removed + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return removed
