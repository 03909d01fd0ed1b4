-- A job's life of its own (PROTOCOL.md, "Jobs with a life of their own"): run_at (it waits in the
-- deferred set until then), expires_at (not started by then, it ends 'expired' and never runs) and a
-- webhook URL (the sender calls it once the job ends). The caller's values, checked here against the
-- server's clock; each only delays, ends or reports the caller's own job, so a producer under the ACL
-- recipe may write them into its own record (admit.lua reads them from there).
-- at_admit: a worker admits what a producer submitted: no refusal for an expiry that passed since
-- (the job is indexed, and ends expired at its pull or the sweep)
local function mlxq_life(run_at, expires_at, webhook, at_admit)
  local function epoch(s, what)
    if not s or s == '' then return nil end  -- (HMGET gives false for a field not there)
    local x = tonumber(s)
    if not x or x ~= x or x <= 0 or x >= 1e11 then return nil, what .. ' is not a time in epoch seconds' end
    return x
  end
  local ra, why = epoch(run_at, 'run_at')
  if why then return nil, why end
  local ea
  ea, why = epoch(expires_at, 'expires_at')
  if why then return nil, why end
  if ea and not at_admit then
    local t = redis.call('TIME')
    if ea <= tonumber(t[1]) + tonumber(t[2]) / 1000000 then return nil, 'expires_at is already past' end
    if ra and ea <= ra then return nil, 'expires_at is not after run_at' end
  end
  return {run_at = ra, expires_at = ea, webhook = (webhook and webhook ~= '') and webhook or nil}
end

-- Record them in the job hash, and index an expiry (for the reaper's sweep) and a webhook (for the
-- sender, with 'whk': the key's field in the secrets hash, sha1 of its sha256, 'anonymous' for none).
local function mlxq_life_set(life, jk, expiring_key, webhooks_key, id, now, key_hash)
  if life.run_at then redis.call('HSET', jk, 'run_at', string.format('%.6f', life.run_at)) end
  if life.expires_at then
    redis.call('HSET', jk, 'expires_at', string.format('%.6f', life.expires_at))
    redis.call('ZADD', expiring_key, life.expires_at, id)
  end
  if life.webhook then
    redis.call('HSET', jk, 'webhook', life.webhook, 'whk', key_hash ~= '' and redis.sha1hex(key_hash) or 'anonymous')
    redis.call('ZADD', webhooks_key, now, id)
  end
end

-- A job never started whose expires_at is past (a job that ran once and was handed back is not
-- expired: it started)
local function mlxq_is_expired(jk, now)
  local f = redis.call('HMGET', jk, 'expires_at', 'started_at')
  local at = tonumber(f[1] or '')
  return at ~= nil and at <= now and not f[2]
end

-- End a queued job past its expires_at (pull.lua where it is taken, expire.lua's sweep): 'expired'.
-- The caller has taken it out of the queue or deferred set and fixed its queued count.
local function mlxq_expire(publish, jk, ek, dk, ch, ttl, counts, sk, id, nowstr)
  local err = 'expired: not started by its expires_at (' .. (redis.call('HGET', jk, 'expires_at') or '?') .. ')'
  redis.call('HSET', jk, 'status', 'expired', 'error', err, 'finished_at', nowstr)
  redis.call('HDEL', jk, 'resume')
  redis.call('HDEL', sk, id)
  redis.call('HINCRBY', counts, 'expired', 1)
  redis.call('HINCRBY', counts, 'processed', 1)
  mlxq_end_record(publish, jk, ek, dk, ch, ttl, 'f', 'error', 'e', err)
end
