-- Admit jobs from the intake list (enqueued by producers that may not write the queue): the tier
-- is decided again from the job's key hash and floor, and the score from the time of admission
-- (nothing a producer wrote into its own job record can raise its priority).  Workers run this
-- before each pull and on each heartbeat.
-- KEYS: 1 intake, 2 queue, 3 counts, 4 key registry copy, 5 policy copy, 6 wake, 7 sched (worker-only:
--       the tier and score given here, _sched.lua), 8 deferred, 9 expiring, 10 webhooks (_life.lua),
--       11..16 the fair-share keys (ModelKeys.fair_keys), then four per id (the caller read the ids with
--       LRANGE, in ARGV order): job, events, done list, job channel
-- A job is admitted once: one that has an entry in sched is queued or running already, whatever
-- its hash says (its producer may write it: pushed again, it inflated the queue's counters).
-- ARGV: 1 ttl (s), 2 publish command (PUBLISH | SPUBLISH on a cluster), 3.. the ids at the head of intake
-- An id is taken only while it is still at the head (another worker may have admitted it).
-- Returns {admitted, refused}
if redis.call('EXISTS', KEYS[5]) == 0 then return {0, 0} end  -- no policy copy yet: a worker is starting
local ids = {}
for i = 3, #ARGV do
  if redis.call('LINDEX', KEYS[1], 0) ~= ARGV[i] then break end
  redis.call('LPOP', KEYS[1])
  ids[#ids + 1] = ARGV[i]
end
if #ids == 0 then return {0, 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local nowstr = string.format('%.6f', now)
local ttl = tonumber(ARGV[1])
local fk = {KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16]}
local admitted, refused = 0, 0
for i, id in ipairs(ids) do
  local base = 16 + (i - 1) * 4
  local jk, ek, dk, ch = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]
  if mlxq_is_job_id(id) then
    local ktype = redis.call('TYPE', jk)
    if type(ktype) == 'table' then ktype = ktype['ok'] end
    if ktype == 'hash' then
      local f = redis.call('HMGET', jk, 'status', 'admitted', 'kh', 'floor')
      if f[1] == 'queued' and not f[2] and redis.call('HEXISTS', KEYS[7], id) == 0 then
        local tier, why = mlxq_tier(KEYS[4], KEYS[5], f[3] or '', f[4] or '')
        if tier then
          -- the bound a producer's check applies (max_queued), with room for the producers that
          -- passed their check before these admissions: a producer that skips check stops here
          local queued = tonumber(redis.call('HGET', KEYS[3], 'queued:' .. tier) or '0') or 0
          local maxq = tonumber(redis.call('HGET', KEYS[5], 'max_queued') or '') or 10000
          if queued >= 2 * maxq then
            tier, why = nil, 'the ' .. tier .. ' queue is full (' .. queued .. ' waiting; the bound is ' .. maxq .. ')'
          elseif mlxq_over_quota(fk[6], KEYS[5], mlxq_fair_group(f[3]), now) then
            tier, why = nil, "the API key's daily token quota is used up"
          end
        end
        if tier then
          local score = now + mlxq_offset(KEYS[5], tier) + i * 0.000001
          -- a job's life (_life.lua), as its producer recorded it: a run_at ahead waits in the deferred set
          local lf = redis.call('HMGET', jk, 'run_at', 'expires_at', 'webhook')
          local life = mlxq_life(lf[1], lf[2], lf[3], true) or {}
          if life.run_at and life.run_at > now then score = life.run_at + mlxq_offset(KEYS[5], tier) end
          redis.call('HSET', jk, 'tier', tier, 'score', string.format('%.6f', score), 'admitted', '1')
          mlxq_sched_set(KEYS[7], id, tier, string.format('%.6f', score), false)
          redis.call('HDEL', jk, 'kh')  -- the key hash is a credential: kept no longer than needed
          -- fair shares: the job joins its key's group at its tier; a deferred one when promote.lua
          -- queues it (enqueue.lua says why)
          if life.run_at and life.run_at > now then
            redis.call('ZADD', KEYS[8], life.run_at, id)
            mlxq_fair_defer(fk, mlxq_fair_group(f[3]), id)
          else
            redis.call('ZADD', KEYS[2], score, id)
            mlxq_fair_add(fk, tier, mlxq_fair_group(f[3]), score, id)
            redis.call('HINCRBY', KEYS[3], 'queued:' .. tier, 1)
          end
          -- (run_at is recorded already: a producer wrote it)
          mlxq_life_set({expires_at = life.expires_at, webhook = life.webhook}, jk, KEYS[9], KEYS[10], id, now, f[3] or '')
          redis.call('HINCRBY', KEYS[3], 'submitted', 1)
          admitted = admitted + 1
        else
          local err = 'refused at admission: ' .. why
          redis.call('HSET', jk, 'status', 'failed', 'error', err, 'finished_at', nowstr)
          redis.call('HDEL', jk, 'kh')
          mlxq_end_record(ARGV[2], jk, ek, dk, ch, ttl, 'f', 'error', 'e', err)
          redis.call('HINCRBY', KEYS[3], 'refused', 1)
          refused = refused + 1
        end
      end
    end
  end
end
if admitted > 0 then
  mlxq_wake(KEYS[6])
end
return {admitted, refused}
