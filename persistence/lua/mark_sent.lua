-- devicemq: record that messages were sent at least once (DUP on replay).
--
-- KEYS[1] {cid}_messages; ARGV packet ids. Sets the SENT bit (0x01 of the
-- flags byte, byte 1 of the value, i.e. bit offset 15). SETBIT keeps the
-- key's TTL; a string that has expired or been acked is not recreated.
-- Returns how many were marked.

local set_key = KEYS[1]
local marked = 0
for i = 1, #ARGV do
  local key = set_key .. '_' .. ARGV[i]
  if redis.call('EXISTS', key) == 1 then
    redis.call('SETBIT', key, 15, 1)
    marked = marked + 1
  end
end
return marked
