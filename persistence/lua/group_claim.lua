-- devicemq: a member of a group queue claims its next entries ($queue,
-- broker/group_queue.py; persistence/group_feed.py).
--
-- KEYS[1] _ecq_pending (key -> seq)  KEYS[2] _ecq_values  KEYS[3] _ecq_times
-- KEYS[4] _ecq_claims (key -> claim token; '-': free, but it may have been seen;
-- '-' then the token: claimed, and it may have been seen before the claim)
-- KEYS[5] _ecq_tokens (claim token -> lease deadline, ms of the Redis clock)
-- ARGV[1] lease (ms)  ARGV[2] the member's claim token  ARGV[3] at most this many
-- ARGV[4] entries published before this time (ms) are past retention: not given
-- (the next save removes them)  ARGV[5] 1: the token's first claim, 0: it claimed
-- before  ARGV[6..] keys to leave out (the member may not take them: too large for
-- it, or its ACL; or it holds them in flight already)
--
-- Walks the pending entries in sequence order and claims those no live claim
-- holds: a claim whose token's lease ran out (its broker died) is free again.
-- Leases run on Redis's clock (TIME), so replicas' clocks need not agree. An
-- entry claimed before (given back after a send, or by a lapsed lease) may
-- have been seen: its dup flag is 1, and its claim keeps that ('-' in front of
-- the token), so a give-back that does not list it (one decided before this
-- claim landed, tests/model/FINDINGS.md finding 34) still leaves it seen
-- (group_release.lua). The token's lease starts (again) now. Tokens never start
-- with '-' (persistence/group_feed.py, GroupQueues.new_token).
-- Returns flat {key, seq, value, dup, ...}, or {'lapsed'}.

local pending, values, times, claims, tokens = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lease, token, n, oldest = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local fresh = ARGV[5] == '1'
local declined = {}
for i = 6, #ARGV do declined[ARGV[i]] = true end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

-- A token that claimed before and whose lease ran out is not brought back: its
-- claims may be other members' now (given with DUP), its member starts anew.
local deadline = redis.call('ZSCORE', KEYS[5], token)
if not fresh and (not deadline or tonumber(deadline) < now) then
  return {'lapsed'}
end
redis.call('ZREMRANGEBYSCORE', tokens, '-inf', '(' .. now)
redis.call('ZADD', tokens, now + lease, token)

local out, found, start, chunk = {}, 0, 0, 500
-- Bounded per call: entries held by other members at the head are skipped, and
-- with tens of thousands held that costs more than it gives.
local scanned_most = 50000
while found < n and start < scanned_most do
  local refs = redis.call('ZRANGE', pending, start, start + chunk - 1, 'WITHSCORES')
  if #refs == 0 then break end
  for i = 1, #refs, 2 do
    local key = refs[i]
    if not declined[key] then
      local claim = redis.call('HGET', claims, key)
      local holder = claim
      if claim and claim:sub(1, 1) == '-' then holder = claim:sub(2) end
      local held = holder and holder ~= '' and redis.call('ZSCORE', tokens, holder)
      if not held then
        local value = redis.call('HGET', values, key)
        local published = tonumber(redis.call('ZSCORE', times, key) or '0')
        if value and published >= oldest then
          if claim then
            redis.call('HSET', claims, key, '-' .. token)  -- seen before: it stays so
          else
            redis.call('HSET', claims, key, token)
          end
          out[#out + 1] = key
          out[#out + 1] = tonumber(refs[i + 1])
          out[#out + 1] = value
          out[#out + 1] = claim and 1 or 0
          found = found + 1
          if found >= n then break end
        end
      end
    end
  end
  start = start + chunk
end
return out
