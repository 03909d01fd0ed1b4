-- Queue the deferred jobs whose run_at has come (_life.lua), each at the score its tier gave it at
-- enqueue or admission (run_at + the tier's offset). Queue.pull runs this before it reads the queue:
-- any worker's pull promotes, so the wait is held in Redis alone and survives every process restart.
-- KEYS: 1 deferred, 2 queue, 3 counts, 4 sched, 5 wake, then one job key per id, in ARGV order
-- ARGV: the ids the caller read at the head of the deferred set (an id not yet due is left there)
-- Returns the number of jobs queued. A member whose job is gone or no longer queued (cancelled,
-- expired) leaves the set and nothing else.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = 0
for i, id in ipairs(ARGV) do
  local due = tonumber(redis.call('ZSCORE', KEYS[1], id) or '')
  if due and due <= now then
    redis.call('ZREM', KEYS[1], id)
    local f = redis.pcall('HMGET', KEYS[5 + i], 'status', 'tier', 'score')
    if type(f) == 'table' and not f.err and f[1] == 'queued' then
      local sd = mlxq_sched(KEYS[4], id)
      local tier = sd and sd.tier or f[2] or 'normal'
      local score = tonumber(sd and sd.score or f[3] or '') or now
      redis.call('ZADD', KEYS[2], score, id)
      redis.call('HINCRBY', KEYS[3], 'queued:' .. tier, 1)
      n = n + 1
    end
  end
end
if n > 0 then
  redis.call('LPUSH', KEYS[5], '1')
  redis.call('LTRIM', KEYS[5], 0, 63)
end
return n
