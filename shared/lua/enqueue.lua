-- Enqueue one job atomically.
-- KEYS: 1 queue, 2 job, 3 counts, 4 wake, 5 idempotency key (ignored unless ARGV[6] == '1')
-- ARGV: 1 id, 2 request (msgpack), 3 tier, 4 tier offset (s), 5 max queued for the tier,
--       6 use idempotency key ('1'/'0'), 7 idempotency ttl (s)
-- Returns {status, job id, score, server time}; status in ok | duplicate | overload | exists
local id, tier = ARGV[1], ARGV[3]
if ARGV[6] == '1' then
  local existing = redis.call('GET', KEYS[5])
  if existing then return {'duplicate', existing, '', ''} end
end
local queued = tonumber(redis.call('HGET', KEYS[3], 'queued:' .. tier) or '0')
if queued >= tonumber(ARGV[5]) then
  return {'overload', id, tostring(queued), ''}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  -- the same request again (a client retry after a lost reply): the same job, not an error
  local f = redis.pcall('HMGET', KEYS[2], 'req', 'score', 'queued_at')
  if type(f) == 'table' and not f.err and f[1] == ARGV[2] then return {'ok', id, f[2] or '', f[3] or ''} end
  return {'exists', id, '', ''}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local score = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[2], 'req', ARGV[2], 'tier', tier, 'score', string.format('%.6f', score),
  'status', 'queued', 'attempts', '0', 'queued_at', string.format('%.6f', now))
redis.call('ZADD', KEYS[1], score, id)
redis.call('HINCRBY', KEYS[3], 'queued:' .. tier, 1)
redis.call('HINCRBY', KEYS[3], 'submitted', 1)
if ARGV[6] == '1' then
  redis.call('SET', KEYS[5], id, 'EX', tonumber(ARGV[7]))
  redis.call('HSET', KEYS[2], 'idem', KEYS[5])
end
redis.call('LPUSH', KEYS[4], '1')
redis.call('LTRIM', KEYS[4], 0, 63)
return {'ok', id, string.format('%.6f', score), string.format('%.6f', now)}
