-- Read-only (FCALL_RO, flag no-writes): would this caller's job be accepted now?  For producers
-- whose ACL may not write the queue; ``submit`` then hands the job to the intake list and a
-- worker's ``admit`` decides its tier again.  Under FCALL every declared key needs read and write
-- permission; under FCALL_RO read is enough: the registry copy, policy and counters stay read-only.
-- KEYS: 1 key registry copy, 2 policy copy, 3 counts, 4 usage (optional: ModelKeys.usage, for the quota)
-- ARGV: 1 sha256 of the API key ('' for none), 2 tier floor ('' for none)
-- Returns {status, tier | reason | queued count | seconds until the next day}; status in ok | unauthorized |
-- overload | unsynced | quota
if redis.call('EXISTS', KEYS[2]) == 0 then return {'unsynced', ''} end
local tier, why = mlxq_tier(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
if not tier then return {'unauthorized', why} end
local queued = tonumber(redis.call('HGET', KEYS[3], 'queued:' .. tier) or '0')
local maxq = tonumber(redis.call('HGET', KEYS[2], 'max_queued') or '') or 10000
if queued >= maxq then return {'overload', tostring(queued)} end
if KEYS[4] then
  local t = redis.call('TIME')
  local retry = mlxq_over_quota(KEYS[4], KEYS[2], mlxq_fair_group(ARGV[1]), tonumber(t[1]) + tonumber(t[2]) / 1000000)
  if retry then return {'quota', tostring(retry)} end
end
return {'ok', tier}
