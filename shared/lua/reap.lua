-- Requeue jobs whose lease expired, or whose worker's heartbeat is overdue (takeover: the worker
-- died or hung, and its leases may run for minutes yet), at their original score.
-- After max attempts a job goes to the dead-letter set with its last error. A job requeued after its
-- second expired lease keeps an error, which makes it a suspect (pull.lua): the next worker runs it alone.
-- Any worker may run this.
-- An admitted job's score, tier and suspect flag come from sched (worker-only), never its hash.
-- Taking a job over ends its owner's lease as an expiry does (the owner field goes): a worker judged
-- dead that was only slow finds its writes refused (deltas.lua, complete.lua) and the lease lost at its
-- next renew, and drops the job; the attempt counts, as for a worker that died.
-- KEYS: 1 inflight, 2 queue, 3 counts, 4 dead, 5 deadinfo, 6 wake, 7 sched, 8 beats, 9 policy copy,
--       10..15 the fair-share keys (ModelKeys.fair_keys: the jobs in flight of each job's key), then four per
--       candidate (the caller read in-flight members whose lease looked expired or whose owner's beat
--       looked overdue, in ARGV order): job, events, done list, channel
-- ARGV: 1 max attempts, 2 ttl (s), 3 publish command (PUBLISH | SPUBLISH on a cluster), 4 the count k of
--       workers to forget, 5..4+k those workers (overdue, and holding nothing the caller saw), then
--       the candidates
-- A candidate whose lease is not expired and whose owner's beat is not overdue by the server's clock
-- (renewed meanwhile) is left alone; so is a worker to forget that beat meanwhile.
-- Returns {requeued, dead, cancelled, taken over (of the requeued, dead and cancelled)}
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local nowstr = string.format('%.6f', now)
local ttl = tonumber(ARGV[2])
local forget = tonumber(ARGV[4])
for i = 5, 4 + forget do
  local vouched = tonumber(redis.call('ZSCORE', KEYS[8], ARGV[i]))
  if vouched and vouched <= now then redis.call('ZREM', KEYS[8], ARGV[i]) end
end
-- the job's owner token is '<worker id>:<attempt>' (pull.lua); its worker is judged by its own beat
local function owner_overdue(jk)
  local owner = redis.pcall('HGET', jk, 'owner')
  if type(owner) ~= 'string' then return false end
  local wid = string.match(owner, '^(.+):%d+$')
  local vouched = wid and tonumber(redis.call('ZSCORE', KEYS[8], wid))
  return vouched ~= nil and vouched <= now
end
local requeued, dead, cancelled, taken = 0, 0, 0, 0
local first = 5 + forget
for i = first, #ARGV do
  local id = ARGV[i]
  local base = 15 + (i - first) * 4
  local jk, ek, dk, ch = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]
  local deadline = tonumber(redis.call('ZSCORE', KEYS[1], id))
  local takeover = deadline and deadline > now and owner_overdue(jk)
  if takeover then taken = taken + 1 end
  if deadline and (deadline <= now or takeover) then  -- (renewed meanwhile: left alone)
    redis.call('ZREM', KEYS[1], id)
    -- fair shares: the lease ended, one fewer in flight for the job's key (its group is kept while the
    -- job may be queued again; an ended job's is dropped below)
    mlxq_fair_release({KEYS[10], KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15]}, KEYS[9], id, false)
    local ktype = redis.call('TYPE', jk)
    if type(ktype) == 'table' then ktype = ktype['ok'] end
    local gone = ktype ~= 'hash' and mlxq_sched(KEYS[7], id)
    if gone then  -- an admitted, running job whose record vanished (expired, deleted): it runs no more
      redis.call('HINCRBY', KEYS[3], 'running', -1)
      redis.call('HDEL', KEYS[7], id)
    end
    if ktype ~= 'hash' then
      redis.call('EXPIRE', ek, ttl)  -- nothing will end its stream now
      redis.call('HDEL', KEYS[14], 'g:' .. id)
    end
    if ktype ~= 'hash' and ktype ~= 'none' then  -- forged: never a script error (it would stop the reaper)
      redis.call('ZADD', KEYS[4], now, id)
      redis.call('HSET', KEYS[5], id, 'in-flight member whose job record is a ' .. tostring(ktype))
      redis.call('HINCRBY', KEYS[3], 'garbage', 1)
    elseif ktype == 'hash' then
      redis.call('HINCRBY', KEYS[3], 'running', -1)
      local f = redis.call('HMGET', jk, 'attempts', 'score', 'tier', 'cancel', 'error')
      local sd = mlxq_sched(KEYS[7], id)
      local suspect = f[5] ~= nil and f[5] ~= false
      if sd then f[2], f[3], suspect = sd.score, sd.tier, sd.suspect end
      local attempts = tonumber(f[1] or '0') or 0
      local score = tonumber(f[2])
      if not score or score ~= score or score == math.huge or score == -math.huge
          or not ({high = true, normal = true, low = true})[f[3] or 'normal'] then
        attempts = tonumber(ARGV[1])  -- cannot be requeued: dead-letter it with the reason
        f[5] = 'malformed job record (score or tier)'
      end
      redis.call('HDEL', jk, 'owner', 'resume')
      if f[4] == '1' then
        redis.call('HSET', jk, 'status', 'cancelled', 'finished_at', nowstr)
        redis.call('HINCRBY', KEYS[3], 'cancelled', 1)
        redis.call('HINCRBY', KEYS[3], 'processed', 1)
        redis.call('HDEL', KEYS[7], id)
        redis.call('HDEL', KEYS[14], 'g:' .. id)
        mlxq_end_record(ARGV[3], jk, ek, dk, ch, ttl, 'f', 'cancelled')
        cancelled = cancelled + 1
      elseif attempts >= tonumber(ARGV[1]) then
        local err = 'lease expired after ' .. attempts .. ' attempts (worker died or hung)'
        if f[5] then err = err .. '; last error: ' .. f[5] end
        redis.call('HSET', jk, 'status', 'dead', 'error', err, 'finished_at', nowstr)
        redis.call('ZADD', KEYS[4], now, id)
        redis.call('HSET', KEYS[5], id, err)
        redis.call('HINCRBY', KEYS[3], 'dead', 1)
        redis.call('HINCRBY', KEYS[3], 'processed', 1)
        redis.call('HDEL', KEYS[7], id)
        redis.call('HDEL', KEYS[14], 'g:' .. id)
        mlxq_end_record(ARGV[3], jk, ek, dk, ch, ttl, 'f', 'error', 'e', err)
        dead = dead + 1
      else
        local tier = f[3] or 'normal'
        redis.call('HSET', jk, 'status', 'queued')
        if attempts >= 2 and not suspect then
          -- the second worker in a row that died holding it (a crash the worker could not report,
          -- such as a segfault or the OOM killer): a suspect, which the next worker runs alone
          redis.call('HSET', jk, 'error', 'a worker died or hung while it held the job (attempt ' .. attempts .. ')')
          if sd then mlxq_sched_set(KEYS[7], id, sd.tier, sd.score, true) end
        end
        redis.call('ZADD', KEYS[2], score, id)
        redis.call('PERSIST', ek)  -- kept while it waits, however long (as requeue.lua)
        redis.call('HINCRBY', KEYS[3], 'queued:' .. tier, 1)
        redis.call('HINCRBY', KEYS[3], 'requeued', 1)
        mlxq_wake(KEYS[6])
        requeued = requeued + 1
      end
    end
  end
end
return {requeued, dead, cancelled, taken}
