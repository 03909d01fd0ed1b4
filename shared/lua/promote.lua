-- Queue the deferred jobs whose run_at has come (_life.lua), each at the score its tier gave it at
-- enqueue or admission (run_at + the tier's offset). Queue.pull runs this before it reads the queue:
-- any worker's pull promotes, so the wait is held in Redis alone and survives every process restart.
-- A promoted job joins fair shares here (_fair.lua), under the group its enqueue or admission kept for
-- it (mlxq_fair_defer): from now on it takes its key's turns, counts against its key's cap and is
-- metered for it, as any job queued at once. One queued by a caller older than fair shares has no group
-- and is taken by its score alone (pick.lua).
-- KEYS: 1 deferred, 2 queue, 3 counts, 4 sched, 5 wake, 6..11 the fair-share keys (ModelKeys.fair_keys),
--       then one job key per id, in ARGV order
-- ARGV: the ids the caller read at the head of the deferred set (an id not yet due is left there)
-- Returns the number of jobs queued. A member whose job is gone or no longer queued (cancelled,
-- expired) leaves the set and the fair state, and nothing else.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local fk = {KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]}
local n = 0
for i, id in ipairs(ARGV) do
  local due = tonumber(redis.call('ZSCORE', KEYS[1], id) or '')
  if due and due <= now then
    redis.call('ZREM', KEYS[1], id)
    local f = redis.pcall('HMGET', KEYS[11 + i], 'status', 'tier', 'score')
    if type(f) == 'table' and not f.err and f[1] == 'queued' then
      local sd = mlxq_sched(KEYS[4], id)
      local tier = sd and sd.tier or f[2] or 'normal'
      local score = tonumber(sd and sd.score or f[3] or '') or now
      redis.call('ZADD', KEYS[2], score, id)
      local group = redis.call('HGET', fk[5], 'g:' .. id)
      if group then mlxq_fair_add(fk, tier, group, score, id) end
      redis.call('HINCRBY', KEYS[3], 'queued:' .. tier, 1)
      n = n + 1
    else
      redis.call('HDEL', fk[5], 'g:' .. id)  -- (its group, kept while it waited)
    end
  end
end
if n > 0 then
  mlxq_wake(KEYS[5])
end
return n
