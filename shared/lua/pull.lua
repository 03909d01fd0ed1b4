-- Take the given queue members (the caller read them with ZRANGE, lowest score first: highest
-- priority first) and lease the jobs among them.  A member another worker took meanwhile is skipped.
-- KEYS: 1 queue, 2 inflight, 3 counts, 4 dead, 5 deadinfo, 6 sched (worker-only tier, score and suspect
--       flag of admitted jobs, _sched.lua), 7 policy copy, 8 fair state (_fair.lua: a job's group and
--       its jobs in flight), then four per member, in ARGV order: job, events, done list, job channel
-- A job whose group (API key) is at its cap on jobs in flight is left in the queue, unleased.
-- ARGV: 1 unused, 2 lease (s), 3 worker id, 4 ttl (s), 5 publish command (PUBLISH | SPUBLISH on a cluster),
--       6.. the members
-- Returns a list of {id, kind, req, attempt, tier, score, queued_at, resume, now, suspect}
-- kind 'job' is leased to this worker; 'garbage' was moved to the dead-letter set. A job flagged for
-- cancelling (cancel_request.lua) ends cancelled here instead of being leased, and one past its
-- expires_at ends expired (_life.lua).
-- suspect: the error a failed worker gave the job back with (requeue.lua with an error), '' if none:
-- the job was in a batch when an engine raised, so the worker runs it alone (PROTOCOL.md section 7).
-- Anything may sit in Redis (bugs, hostile writers): a member that is not a job id, a job key
-- that is not a hash, or a record with unusable fields is moved aside with the reason, never
-- raised as a script error (that would lose the rest of the batch).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local nowstr = string.format('%.6f', now)
local popped = {}
for i = 6, #ARGV do
  local sc = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if sc and redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    table.insert(popped, {ARGV[i], sc, 8 + (i - 6) * 4})
  end
end
local out = {}
local TIERS = {high = true, normal = true, low = true}
-- a decimal number as the worker reads it (Lua's tonumber also takes hex, '0x10', and spaces)
local function decimal(s)
  if not s or #s > 40 or not string.match(s, '^%-?%d+%.?%d*$') and not string.match(s, '^%-?%d*%.?%d+[eE][-+]?%d+$') then
    return nil
  end
  local x = tonumber(s)
  if not x or x ~= x or x == math.huge or x == -math.huge then return nil end
  return x
end
local function malformed(f)
  if f[2] and (#f[2] > 15 or not string.match(f[2], '^%d+$')) then return 'attempts is not a count' end
  if not TIERS[f[3] or 'normal'] then return 'unknown tier' end
  if not decimal(f[4]) then return 'score is not a number' end
  if f[5] and not decimal(f[5]) then return 'queued_at is not a number' end
  return nil
end
for _, entry in ipairs(popped) do
  local id, base = entry[1], entry[3]
  local jk, ek, dk, ch = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]
  local why, status, sd = nil, nil, nil
  if not mlxq_is_job_id(id) then
    why = 'queue member is not a job id (32 hex digits)'
  else
    local ktype = redis.call('TYPE', jk)
    if type(ktype) == 'table' then ktype = ktype['ok'] end
    if ktype == 'none' then
      why = 'queue member with no job record'
    elseif ktype ~= 'hash' then
      why = 'job record is a ' .. tostring(ktype) .. ', not a hash'
    else
      local f = redis.call('HMGET', jk, 'status', 'attempts', 'tier', 'score', 'queued_at')
      sd = mlxq_sched(KEYS[6], id)
      if sd then f[3], f[4] = sd.tier, sd.score end  -- an admitted job's own, not its hash's
      status = f[1]
      if not status then
        why = 'job record without a status'
      elseif status == 'queued' then
        why = malformed(f)
        if why then
          why = 'malformed job record: ' .. why
          local ttl = tonumber(ARGV[4])
          redis.call('HSET', jk, 'status', 'dead', 'error', why, 'finished_at', nowstr)
          redis.call('HDEL', jk, 'owner')
          mlxq_end_record(ARGV[5], jk, ek, dk, ch, ttl, 'f', 'error', 'e', why)
        end
      end
    end
  end
  local group = mlxq_is_job_id(id) and redis.call('HGET', KEYS[8], 'g:' .. id)
  if why then
    if group then redis.call('HDEL', KEYS[8], 'g:' .. id) end  -- (fair shares: the job is over)
    -- an admitted job (so counted) whose record vanished (expired, deleted) or went bad: its count and
    -- its entry go with it (a member forged into the queue has neither)
    local gone = mlxq_is_job_id(id) and mlxq_sched(KEYS[6], id)
    if gone then
      redis.call('HINCRBY', KEYS[3], 'queued:' .. gone.tier, -1)
      redis.call('HDEL', KEYS[6], id)
    end
    -- the stream of a job requeued has no TTL while it waits (requeue.lua): nothing will end it now
    if mlxq_is_job_id(id) then redis.call('EXPIRE', ek, tonumber(ARGV[4])) end
    redis.call('ZADD', KEYS[4], now, id)
    redis.call('HSET', KEYS[5], id, why)
    redis.call('HINCRBY', KEYS[3], 'garbage', 1)
    table.insert(out, {id, 'garbage', '', '0', '', entry[2], '', '', nowstr, ''})
  elseif status ~= 'queued' then
    -- a stale or forged member for a job that is not waiting: never run a job twice
    redis.call('HSET', KEYS[5], id, 'queue member for a job in status ' .. status)
    redis.call('HINCRBY', KEYS[3], 'garbage', 1)
  elseif redis.call('HGET', jk, 'cancel') == '1' then
    -- flagged by a cancel request no worker acted on yet: it ends here and never runs
    redis.call('HSET', jk, 'status', 'cancelled', 'finished_at', nowstr)
    redis.call('HDEL', jk, 'resume')
    redis.call('HINCRBY', KEYS[3], 'queued:' .. (sd and sd.tier or redis.call('HGET', jk, 'tier') or 'normal'), -1)
    redis.call('HDEL', KEYS[6], id)
    redis.call('HINCRBY', KEYS[3], 'cancelled', 1)
    redis.call('HINCRBY', KEYS[3], 'processed', 1)
    if group then redis.call('HDEL', KEYS[8], 'g:' .. id) end
    mlxq_end_record(ARGV[5], jk, ek, dk, ch, tonumber(ARGV[4]), 'f', 'cancelled')
  elseif mlxq_is_expired(jk, now) then
    -- not started by its expires_at (_life.lua): it ends here and never runs (and, as a cancelled job,
    -- leaves fair shares: the pick took its index entry)
    redis.call('HINCRBY', KEYS[3], 'queued:' .. (sd and sd.tier or redis.call('HGET', jk, 'tier') or 'normal'), -1)
    if group then redis.call('HDEL', KEYS[8], 'g:' .. id) end
    mlxq_expire(ARGV[5], jk, ek, dk, ch, tonumber(ARGV[4]), KEYS[3], KEYS[6], id, nowstr)
  elseif group and mlxq_fair_capped(KEYS[8], KEYS[7], group) then
    -- fair shares: its key is at its cap on jobs in flight (another worker leased one since the
    -- pick): it stays queued, and is picked again by its score once one of them ends
    redis.call('ZADD', KEYS[1], entry[2], id)
  else
    if group then mlxq_fair_leased(KEYS[8], group) end
    local tier = sd and sd.tier or redis.call('HGET', jk, 'tier') or 'normal'
    local attempt = redis.call('HINCRBY', jk, 'attempts', 1)
    local owner = ARGV[3] .. ':' .. attempt
    redis.call('HSET', jk, 'status', 'running', 'owner', owner, 'worker', ARGV[3],
      'started_at', nowstr)
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), id)
    redis.call('HINCRBY', KEYS[3], 'queued:' .. tier, -1)
    redis.call('HINCRBY', KEYS[3], 'running', 1)
    local f = redis.call('HMGET', jk, 'req', 'score', 'queued_at', 'resume', 'error')
    if sd then  -- an admitted job: its score and suspect flag as a worker set them
      f[2] = sd.score
      f[5] = sd.suspect and (f[5] or 'a worker failed while it held the job') or nil
    end
    table.insert(out, {id, 'job', f[1] or '', tostring(attempt), tier, f[2] or '', f[3] or '',
      f[4] or '', nowstr, f[5] or ''})
  end
end
return out
