-- Hand one job to the workers without writing the queue (producers under the ACL recipe; see
-- mlxq.shared.acl).  Nothing here decides priority: a worker's ``admit`` reads the key hash and
-- floor from the record, decides the tier, scores the job at the time of admission and deletes
-- the key hash.
-- KEYS: 1 job, 2 idempotency key (ignored unless ARGV[5] == '1'), 3 intake list, 4 wake list
-- ARGV: 1 id, 2 request (msgpack), 3 sha256 of the API key ('' for none), 4 tier floor ('' for none),
--       5 use idempotency key ('1'/'0'), 6 idempotency ttl (s), 7 run_at, 8 expires_at, 9 webhook
--       (optional, _life.lua: kept in the record, where admit.lua reads them)
-- Under FCALL a declared key needs read permission too: the ACL recipe grants it on the intake and
-- wake lists, and no command that reads a list (its BLPOP is for done lists only, in a selector),
-- so a producer still cannot learn other jobs' ids from the intake list.
-- Returns {status, job id, '', server time}; status in ok | duplicate | exists | invalid_id | invalid_idempotency_key |
-- invalid_time (then the third item says why)
-- a producer older than the library (it named the lists in ARGV) is refused before any write: its
-- job's record was written, then the push failed, and the record stayed queued for no worker
if #KEYS ~= 4 then
  return redis.error_reply('ERR mlxq_submit takes 4 keys (job, idempotency key, intake, wake): '
    .. 'this producer is older than the workers; upgrade it')
end
local id = ARGV[1]
-- a job id is 32 lowercase hex digits (pull and admit take no other: a job under any other id
-- would wait for ever, queued for nobody)
if not mlxq_is_job_id(id) then return {'invalid_id', id, '', ''} end
local life, bad = mlxq_life(ARGV[7], ARGV[8], ARGV[9])
if not life then return {'invalid_time', id, bad, ''} end
if ARGV[5] == '1' then
  -- the key is scoped to the caller's API key (ModelKeys.idempotency): one named for another scope
  -- would find, or squat, another producer's job
  if not string.find(KEYS[2], ':idem:' .. redis.sha1hex('idem:' .. ARGV[3]) .. ':', 1, true) then
    return {'invalid_idempotency_key', id, '', ''}
  end
  -- (a stale key, whose job's record is gone, counts as absent: it names the new job below)
  local existing = mlxq_live_job(KEYS[1], id, redis.call('GET', KEYS[2]))
  if existing then return {'duplicate', existing, '', ''} end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local f = redis.pcall('HMGET', KEYS[1], 'req', 'queued_at')
  if type(f) == 'table' and not f.err and f[1] == ARGV[2] then return {'ok', id, '', f[2] or ''} end
  return {'exists', id, '', ''}
end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('HSET', KEYS[1], 'req', ARGV[2], 'status', 'queued', 'attempts', '0', 'queued_at', now,
  'kh', ARGV[3], 'floor', ARGV[4])
for _, f in ipairs({{'run_at', life.run_at}, {'expires_at', life.expires_at}}) do
  if f[2] then redis.call('HSET', KEYS[1], f[1], string.format('%.6f', f[2])) end
end
if life.webhook then redis.call('HSET', KEYS[1], 'webhook', life.webhook) end
if ARGV[5] == '1' then
  redis.call('SET', KEYS[2], id, 'EX', tonumber(ARGV[6]))
  redis.call('HSET', KEYS[1], 'idem', KEYS[2])
end
redis.call('RPUSH', KEYS[3], id)
redis.call('LPUSH', KEYS[4], '1')  -- (no LTRIM: a producer may not trim; admit.lua keeps it short)
return {'ok', id, '', now}
