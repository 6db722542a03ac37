-- devicemq: acknowledged (PUBACK / PUBCOMP): remove refs and their strings.
--
-- KEYS[1] {cid}_messages   KEYS[2] {cid}_bytes; ARGV pairs: packet id, score
-- (the score the sender read the message with; 0: not checked). An id whose
-- ref has another score now belongs to a newer message (the one acknowledged
-- was trimmed and its id given on, mark_sent.lua): it is left alone.
-- Returns how many refs were removed.

local set_key = KEYS[1]
local removed = 0
local freed = 0
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  local want = tonumber(ARGV[i + 1])
  local score = redis.call('ZSCORE', set_key, id)
  if not (want > 0 and score and tonumber(score) ~= want) then
    local key = set_key .. '_' .. id
    if redis.call('ZREM', set_key, id) == 1 then
      removed = removed + 1
      freed = freed + redis.call('STRLEN', key)
    end
    redis.call('DEL', key)
  end
end
release_bytes(KEYS[2], set_key, freed)
return removed
