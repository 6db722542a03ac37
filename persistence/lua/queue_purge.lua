-- devicemq: an operator purges a queue ($ECQ) or a group queue's store ($queue),
-- or a group store unused too long expires: every entry goes, acknowledged or
-- not, with the record of what was in flight and a group's claims.
--
-- KEYS[1] _ecq_pending  KEYS[2] _ecq_log  KEYS[3] _ecq_values  KEYS[4] _ecq_times
-- KEYS[5] _ecq_inflight  KEYS[6] _ecq_claims  KEYS[7] _ecq_bytes  KEYS[8] _ecq_full
-- KEYS[9] _ecq_seq  KEYS[10] _ecq_seen  KEYS[11] _ecq_acked  KEYS[12] _ecq_tokens
-- ARGV[1] 'all': KEYS[9..12] go too (nothing of the store is left); else they
-- stay: later entries go on from the last sequence number, a record read again
-- from Kafka is still a duplicate, and members' leases hold.
-- Returns {entries removed (acknowledged ones kept for a rewind too), bytes freed,
-- the pending ones as flat {key, seq, ...}} (the audit hears they were purged).

local entries = redis.call('ZCARD', KEYS[2])
local pending = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local freed = tonumber(redis.call('GET', KEYS[7]) or '0')
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
if ARGV[1] == 'all' then redis.call('DEL', KEYS[9], KEYS[10], KEYS[11], KEYS[12]) end
return {entries, freed, pending}
