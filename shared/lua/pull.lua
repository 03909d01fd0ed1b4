-- Take up to N jobs, highest priority (lowest score) first, and lease them.
-- KEYS: 1 queue, 2 inflight, 3 counts, 4 dead, 5 deadinfo
-- ARGV: 1 n, 2 lease (s), 3 worker id, 4 job key prefix
-- Returns a list of {id, kind, req, attempt, tier, score, queued_at, resume, now}
-- kind 'job' is leased to this worker; 'garbage' was moved to the dead-letter set.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local nowstr = string.format('%.6f', now)
local popped = redis.call('ZPOPMIN', KEYS[1], tonumber(ARGV[1]))
local out = {}
for i = 1, #popped, 2 do
  local id = popped[i]
  local jk = ARGV[4] .. id
  local status = redis.call('HGET', jk, 'status')
  if not status then
    redis.call('ZADD', KEYS[4], now, id)
    redis.call('HSET', KEYS[5], id, 'queue member with no job record')
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
