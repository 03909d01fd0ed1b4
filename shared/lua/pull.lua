-- Take up to N jobs, highest priority (lowest score) first, and lease them.
-- KEYS: 1 queue, 2 inflight, 3 counts, 4 dead, 5 deadinfo
-- ARGV: 1 n, 2 lease (s), 3 worker id, 4 job key prefix, 5 events key prefix, 6 channel prefix, 7 ttl (s),
--       8 done-list key prefix, 9 publish command (PUBLISH | SPUBLISH on a cluster)
-- Job keys are built here from the declared prefix: they share the queue's hash slot (see README, scale-out).
-- Returns a list of {id, kind, req, attempt, tier, score, queued_at, resume, now}
-- kind 'job' is leased to this worker; 'garbage' was moved to the dead-letter set.
-- Anything may sit in Redis (bugs, hostile writers): a member that is not a job id, a job key
-- that is not a hash, or a record with unusable fields is moved aside with the reason, never
-- raised as a script error (that would lose the rest of the popped batch).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local nowstr = string.format('%.6f', now)
local popped = redis.call('ZPOPMIN', KEYS[1], tonumber(ARGV[1]))
local out = {}
local TIERS = {high = true, normal = true, low = true}
local function malformed(f)
  if f[2] and (#f[2] > 15 or not string.match(f[2], '^%d+$')) then return 'attempts is not a count' end
  if not TIERS[f[3] or 'normal'] then return 'unknown tier' end
  local sc = tonumber(f[4])
  if not sc or sc ~= sc or sc == math.huge or sc == -math.huge then return 'score is not a number' end
  if f[5] and not tonumber(f[5]) then return 'queued_at is not a number' end
  return nil
end
for i = 1, #popped, 2 do
  local id = popped[i]
  local jk = ARGV[4] .. id
  local why, status = nil, nil
  if #id ~= 32 or string.find(id, '[^0-9a-f]') then
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
      status = f[1]
      if not status then
        why = 'job record without a status'
      elseif status == 'queued' then
        why = malformed(f)
        if why then
          why = 'malformed job record: ' .. why
          local ek, ttl = ARGV[5] .. id, tonumber(ARGV[7])
          redis.call('HSET', jk, 'status', 'dead', 'error', why, 'finished_at', nowstr)
          redis.call('HDEL', jk, 'owner')
          redis.call('XADD', ek, '*', 'f', 'error', 'e', why)
          redis.call('RPUSH', ARGV[8] .. id, '1')
          redis.call('EXPIRE', ARGV[8] .. id, ttl)
          redis.call(ARGV[9], ARGV[6] .. id, 'sync')
          redis.call('EXPIRE', jk, ttl)
          redis.call('EXPIRE', ek, ttl)
        end
      end
    end
  end
  if why then
    redis.call('ZADD', KEYS[4], now, id)
    redis.call('HSET', KEYS[5], id, why)
    redis.call('HINCRBY', KEYS[3], 'garbage', 1)
    table.insert(out, {id, 'garbage', '', '0', '', popped[i + 1], '', '', nowstr})
  elseif status ~= 'queued' then
    -- a stale or forged member for a job that is not waiting: never run a job twice
    redis.call('HSET', KEYS[5], id, 'queue member for a job in status ' .. status)
    redis.call('HINCRBY', KEYS[3], 'garbage', 1)
  else
    local tier = redis.call('HGET', jk, 'tier') or 'normal'
    local attempt = redis.call('HINCRBY', jk, 'attempts', 1)
    local owner = ARGV[3] .. ':' .. attempt
    redis.call('HSET', jk, 'status', 'running', 'owner', owner, 'worker', ARGV[3],
      'started_at', nowstr)
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), id)
    redis.call('HINCRBY', KEYS[3], 'queued:' .. tier, -1)
    redis.call('HINCRBY', KEYS[3], 'running', 1)
    local f = redis.call('HMGET', jk, 'req', 'score', 'queued_at', 'resume')
    table.insert(out, {id, 'job', f[1] or '', tostring(attempt), tier, f[2] or '', f[3] or '',
      f[4] or '', nowstr})
  end
end
return out
