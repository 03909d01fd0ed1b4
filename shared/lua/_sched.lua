-- The worker-only scheduling facts of a job a worker admitted from the intake list (the key
-- ModelKeys.sched: job id -> "<tier> <score> <suspect 0|1>"), or nil for a job without them (one a
-- trusted producer enqueued: its job hash holds them, and no producer under the ACL recipe can
-- learn its id). A producer under the ACL recipe may write its own job hash, so what decides
-- priority or runs a job alone is never read from there for an admitted job.
local function mlxq_sched(sk, id)
  local v = redis.call('HGET', sk, id)
  if not v then return nil end
  local tier, score, suspect = string.match(v, '^(%a+) (%S+) ([01])$')
  if not tier then return nil end
  return {tier = tier, score = score, suspect = suspect == '1'}
end

local function mlxq_sched_set(sk, id, tier, score, suspect)
  redis.call('HSET', sk, id, tier .. ' ' .. score .. ' ' .. (suspect and '1' or '0'))
end
