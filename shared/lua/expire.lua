-- The expiry sweep (the reaper runs it): end as 'expired' each job never started whose expires_at has
-- passed, wherever it waits (the queue, the deferred set, the intake list), so that a job nobody pulls
-- still ends and its caller hears of it. pull.lua checks the same where it takes a job (_life.lua).
-- An expired job leaves fair shares (_fair.lua) with its index entry and its group, as it ends.
-- KEYS: 1 expiring, 2 queue, 3 deferred, 4 counts, 5 sched, 6..11 the fair-share keys
--       (ModelKeys.fair_keys), then four per id, in ARGV order: job, events, done list, job channel
-- ARGV: 1 ttl (s), 2 publish command (PUBLISH | SPUBLISH on a cluster), 3.. the ids the caller read at
--       the head of the expiring set (one not yet due is left there)
-- Returns the number of jobs expired. A member whose job started or ended leaves the set.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local nowstr = string.format('%.6f', now)
local fk = {KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]}
local n = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local at = tonumber(redis.call('ZSCORE', KEYS[1], id) or '')
  if at and at <= now then
    redis.call('ZREM', KEYS[1], id)
    local base = 11 + (i - 3) * 4
    local jk, ek, dk, ch = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]
    local st = redis.pcall('HGET', jk, 'status')
    if st == 'queued' and mlxq_is_expired(jk, now) then
      if redis.call('ZREM', KEYS[2], id) == 1 then
        local sd = mlxq_sched(KEYS[5], id)
        redis.call('HINCRBY', KEYS[4], 'queued:' .. (sd and sd.tier or redis.call('HGET', jk, 'tier') or 'normal'), -1)
      end
      redis.call('ZREM', KEYS[3], id)
      mlxq_fair_drop(fk, id)
      mlxq_expire(ARGV[2], jk, ek, dk, ch, tonumber(ARGV[1]), KEYS[4], KEYS[5], id, nowstr)
      n = n + 1
    end
  end
end
return n
