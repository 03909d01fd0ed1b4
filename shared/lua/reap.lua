-- Requeue jobs whose lease expired (their worker died or hung), at their original score.
-- After max attempts a job goes to the dead-letter set with its last error.
-- Any worker may run this.
-- KEYS: 1 inflight, 2 queue, 3 counts, 4 dead, 5 deadinfo, 6 wake
-- ARGV: 1 max attempts, 2 job key prefix, 3 events key prefix, 4 channel prefix, 5 ttl, 6 limit,
--       7 done-list key prefix, 8 publish command (PUBLISH | SPUBLISH on a cluster)
-- Job keys are built here from the declared prefix: they share the queue's hash slot (see README, scale-out).
-- Returns {requeued, dead, cancelled}
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local nowstr = string.format('%.6f', now)
local ttl = tonumber(ARGV[5])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[6]))
local requeued, dead, cancelled = 0, 0, 0
for _, id in ipairs(expired) do
  local jk = ARGV[2] .. id
  redis.call('ZREM', KEYS[1], id)
  local ktype = redis.call('TYPE', jk)
  if type(ktype) == 'table' then ktype = ktype['ok'] end
  if ktype ~= 'hash' and ktype ~= 'none' then  -- forged: never a script error (it would stop the reaper)
    redis.call('ZADD', KEYS[4], now, id)
    redis.call('HSET', KEYS[5], id, 'in-flight member whose job record is a ' .. tostring(ktype))
    redis.call('HINCRBY', KEYS[3], 'garbage', 1)
  elseif ktype == 'hash' then
    redis.call('HINCRBY', KEYS[3], 'running', -1)
    local f = redis.call('HMGET', jk, 'attempts', 'score', 'tier', 'cancel', 'error')
    local attempts = tonumber(f[1] or '0') or 0
    local score = tonumber(f[2])
    if not score or score ~= score or score == math.huge or score == -math.huge
        or not ({high = true, normal = true, low = true})[f[3] or 'normal'] then
      attempts = tonumber(ARGV[1])  -- cannot be requeued: dead-letter it with the reason
      f[5] = 'malformed job record (score or tier)'
    end
    local ek, ch = ARGV[3] .. id, ARGV[4] .. id
    redis.call('HDEL', jk, 'owner', 'resume')
    if f[4] == '1' then
      redis.call('HSET', jk, 'status', 'cancelled', 'finished_at', nowstr)
      redis.call('HINCRBY', KEYS[3], 'cancelled', 1)
      redis.call('HINCRBY', KEYS[3], 'processed', 1)
      redis.call('XADD', ek, '*', 'f', 'cancelled')
      redis.call('RPUSH', ARGV[7] .. id, '1')
      redis.call('EXPIRE', ARGV[7] .. id, ttl)
      redis.call(ARGV[8], ch, 'sync')
      redis.call('EXPIRE', jk, ttl)
      redis.call('EXPIRE', ek, ttl)
      cancelled = cancelled + 1
    elseif attempts >= tonumber(ARGV[1]) then
      local err = 'lease expired after ' .. attempts .. ' attempts (worker died or hung)'
      if f[5] then err = err .. '; last error: ' .. f[5] end
      redis.call('HSET', jk, 'status', 'dead', 'error', err, 'finished_at', nowstr)
      redis.call('ZADD', KEYS[4], now, id)
      redis.call('HSET', KEYS[5], id, err)
      redis.call('HINCRBY', KEYS[3], 'dead', 1)
      redis.call('HINCRBY', KEYS[3], 'processed', 1)
      redis.call('XADD', ek, '*', 'f', 'error', 'e', err)
      redis.call('RPUSH', ARGV[7] .. id, '1')
      redis.call('EXPIRE', ARGV[7] .. id, ttl)
      redis.call(ARGV[8], ch, 'sync')
      redis.call('EXPIRE', jk, ttl)
      redis.call('EXPIRE', ek, ttl)
      dead = dead + 1
    else
      local tier = f[3] or 'normal'
      redis.call('HSET', jk, 'status', 'queued')
      redis.call('ZADD', KEYS[2], score, id)
      redis.call('HINCRBY', KEYS[3], 'queued:' .. tier, 1)
      redis.call('HINCRBY', KEYS[3], 'requeued', 1)
      redis.call('LPUSH', KEYS[6], '1')
      redis.call('LTRIM', KEYS[6], 0, 63)
      requeued = requeued + 1
    end
  end
end
return {requeued, dead, cancelled}
