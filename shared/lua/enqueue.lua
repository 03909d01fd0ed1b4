-- Enqueue one job atomically.  The caller gives its API-key hash, never a tier: the tier and the
-- score are decided here.  (Producers whose ACL may not write the queue use check + submit.)
-- KEYS: 1 job, 2 counts, 3 wake, 4 idempotency key (ignored unless ARGV[5] == '1'), 5 unused (intake),
--       6 queue, 7 key registry copy, 8 policy copy, 9 deferred, 10 expiring, 11 webhooks (9-11 are needed
--       only with ARGV 7-9), 12..17 the fair-share keys (ModelKeys.fair_keys: rings high, normal, low,
--       fair jobs, fair state, usage; a caller older than fair shares gives 8 or 11 keys, and its jobs
--       are taken by score alone: pick.lua, with no quota)
-- ARGV: 1 id, 2 request (msgpack), 3 sha256 of the API key ('' for none), 4 tier floor ('' for none),
--       5 use idempotency key ('1'/'0'), 6 idempotency ttl (s), 7 run_at, 8 expires_at (epoch seconds,
--       '' or absent for none), 9 webhook URL ('' or absent for none): _life.lua
-- Returns {status, job id, score | reason, server time};
-- status in ok | duplicate | overload | exists | invalid_id | invalid_idempotency_key | unauthorized |
-- unsynced (no policy copy in this slot yet) | invalid_time (expires_at already past, or not after run_at) |
-- quota (the key's daily tokens are used up: the third element is the seconds until the next UTC day)
local id = ARGV[1]
-- a job id is 32 lowercase hex digits (pull and admit take no other: a job under any other id
-- would wait for ever, queued for nobody)
if not mlxq_is_job_id(id) then return {'invalid_id', id, '', ''} end
if redis.call('EXISTS', KEYS[8]) == 0 then return {'unsynced', id, '', ''} end
local life, bad = mlxq_life(ARGV[7], ARGV[8], ARGV[9])
if not life then return {'invalid_time', id, bad, ''} end
if (life.run_at or life.expires_at or life.webhook) and #KEYS < 11 then
  return {'invalid_time', id, 'run_at, expires_at and webhook need keys 9-11 (deferred, expiring, webhooks)', ''}
end
local tier, why = mlxq_tier(KEYS[7], KEYS[8], ARGV[3], ARGV[4])
if not tier then return {'unauthorized', id, why, ''} end
if ARGV[5] == '1' then
  -- the key is scoped to the caller's API key (ModelKeys.idempotency): one named for another scope
  -- would find, or squat, another producer's job
  if not string.find(KEYS[4], ':idem:' .. redis.sha1hex('idem:' .. ARGV[3]) .. ':', 1, true) then
    return {'invalid_idempotency_key', id, '', ''}
  end
  -- (a stale key, whose job's record is gone, counts as absent: it names the new job below)
  local existing = mlxq_live_job(KEYS[1], id, redis.call('GET', KEYS[4]))
  if existing then return {'duplicate', existing, '', ''} end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  -- the same request again (a client retry after a lost reply): the same job, not an error, and
  -- before the bound (a retry told "overload" would drop a job that is queued all the same)
  local f = redis.pcall('HMGET', KEYS[1], 'req', 'score', 'queued_at')
  if type(f) == 'table' and not f.err and f[1] == ARGV[2] then return {'ok', id, f[2] or '', f[3] or ''} end
  return {'exists', id, '', ''}
end
local queued = tonumber(redis.call('HGET', KEYS[2], 'queued:' .. tier) or '0')
local maxq = tonumber(redis.call('HGET', KEYS[8], 'max_queued') or '') or 10000
if queued >= maxq then
  return {'overload', id, tostring(queued), ''}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
-- quotas: a key whose daily tokens are used up is refused until the next day
local fk = #KEYS >= 17 and {KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17]}
if fk then
  local retry = mlxq_over_quota(fk[6], KEYS[8], mlxq_fair_group(ARGV[3]), now)
  if retry then return {'quota', id, tostring(retry), string.format('%.6f', now)} end
end
local score = now + mlxq_offset(KEYS[8], tier)
-- the first write (the queue, or the deferred set): a caller without write access fails here, having
-- changed nothing
local deferred = life.run_at and life.run_at > now
if deferred then
  score = life.run_at + mlxq_offset(KEYS[8], tier)
  redis.call('ZADD', KEYS[9], life.run_at, id)
else
  redis.call('ZADD', KEYS[6], score, id)
  redis.call('HINCRBY', KEYS[2], 'queued:' .. tier, 1)
end
redis.call('HINCRBY', KEYS[2], 'submitted', 1)
-- fair shares: the job joins its key's group at its tier; a deferred one only when promote.lua queues
-- it (indexed while it waits, a pick would find it not queued and drop it), its group kept till then
if fk and deferred then
  mlxq_fair_defer(fk, mlxq_fair_group(ARGV[3]), id)
elseif fk then
  mlxq_fair_add(fk, tier, mlxq_fair_group(ARGV[3]), score, id)
end
redis.call('HSET', KEYS[1], 'req', ARGV[2], 'tier', tier, 'score', string.format('%.6f', score),
  'status', 'queued', 'attempts', '0', 'queued_at', string.format('%.6f', now), 'admitted', '1')
if ARGV[5] == '1' then
  redis.call('SET', KEYS[4], id, 'EX', tonumber(ARGV[6]))
  redis.call('HSET', KEYS[1], 'idem', KEYS[4])
end
mlxq_life_set(life, KEYS[1], KEYS[10], KEYS[11], id, now, ARGV[3])
if deferred then return {'ok', id, string.format('%.6f', score), string.format('%.6f', now)} end
mlxq_wake(KEYS[3])
return {'ok', id, string.format('%.6f', score), string.format('%.6f', now)}
