-- devicemq: the backlog of many sessions in one call (app/metrics.py counts it
-- every 5 s when /metrics is served): KEYS are their `{cid}_messages` sorted
-- sets. Returns {messages in all, the most in one}. One reply, where a
-- pipeline of ZCARDs cost the broker a reply to parse per session.
local total, largest = 0, 0
for i = 1, #KEYS do
  local n = redis.call('ZCARD', KEYS[i])
  total = total + n
  if n > largest then largest = n end
end
return {total, largest}
