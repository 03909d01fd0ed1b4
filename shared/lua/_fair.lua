-- Fair shares between API keys within a tier (PROTOCOL.md, "Fair shares"). A job's group is its API
-- key (sha1 of the key's sha256, as in the registry copy) or '-' for jobs without one. Each tier has a
-- ring (ModelKeys.fair_ring: group -> turn) of the groups with indexed jobs; every indexed job is a
-- member '<tier>|<group>|<score>|<id>' of one lexical zset (ModelKeys.fair_jobs), so a group's oldest
-- job is the first of its range. pick.lua serves the group with the lowest turn and moves it on by
-- 1 / its weight: round robin, weighted. Only fixed keys, so every script declares what it touches.
-- KEYS given as a table fk: {ring high, ring normal, ring low, jobs, state, usage} (ModelKeys.fair_keys).
local FAIR_TIERS = {'high', 'normal', 'low'}
local FAIR_RING = {high = 1, normal = 2, low = 3}

local function mlxq_fair_group(key_hash)
  if key_hash == nil or key_hash == '' then return '-' end
  return redis.sha1hex(key_hash)
end

-- Index a job just queued at ``tier`` with ``score``. A group that had no job at the tier joins the
-- ring at the turn last served there, or later if it left with turns in hand (so a key that drains
-- and comes back at once does not jump its round).
-- The job's group is kept (``g:<id>``) for its whole life: its lease counts against the group's cap on
-- jobs in flight, and ends with mlxq_fair_release.
local function mlxq_fair_add(fk, tier, group, score, id)
  local m = tier .. '|' .. group .. '|' .. string.format('%020.6f', score) .. '|' .. id
  redis.call('ZADD', fk[4], 0, m)
  redis.call('HSET', fk[5], 'j:' .. id, m, 'g:' .. id, group)
  local ring = fk[FAIR_RING[tier]]
  -- (a group parked at its cap stays out of the ring until one of its jobs ends)
  if not redis.call('ZSCORE', ring, group) and redis.call('HEXISTS', fk[5], 'p:' .. tier .. ':' .. group) == 0 then
    local v = tonumber(redis.call('HGET', fk[5], 'v:' .. tier)) or 0
    local left = 'f:' .. tier .. ':' .. group
    local f = tonumber(redis.call('HGET', fk[5], left)) or 0
    redis.call('HDEL', fk[5], left)
    redis.call('ZADD', ring, math.max(v, f), group)
  end
end

-- A deferred job (enqueue.lua, admit.lua): only its group is kept until promote.lua queues it and
-- indexes it with mlxq_fair_add (the key hash it came from is not kept: a credential).
local function mlxq_fair_defer(fk, group, id)
  redis.call('HSET', fk[5], 'g:' .. id, group)
end

-- A queued or deferred job that ended without a lease (expired: expire.lua's sweep): its index entry
-- and its group go with it, so no pick meets it. (A cancelled job keeps its entry until a pick drops it.)
local function mlxq_fair_drop(fk, id)
  local m = redis.call('HGET', fk[5], 'j:' .. id)
  if m then redis.call('ZREM', fk[4], m) end
  redis.call('HDEL', fk[5], 'j:' .. id, 'g:' .. id)
end

-- A group at its cap on jobs in flight (policy ``inflight:<group>``, `mlxq keys set --max-inflight`),
-- counting ``more`` jobs about to be leased? ``state``: the fair state hash.
local function mlxq_fair_capped(state, policy, group, more)
  local cap = tonumber(redis.call('HGET', policy, 'inflight:' .. group))
  return cap ~= nil and (tonumber(redis.call('HGET', state, 'run:' .. group)) or 0) + (more or 0) >= cap
end

-- Lease a job of ``group`` (pull.lua): one more in flight for it.
local function mlxq_fair_leased(state, group)
  redis.call('HINCRBY', state, 'run:' .. group, 1)
end

-- A job's lease ended (completion, a requeue, the reaper): one fewer in flight for its group, which,
-- parked at its cap, takes its turns again at every tier where it was parked. ``ended``: the job is
-- over, and its group is forgotten.
local function mlxq_fair_release(fk, policy, id, ended)
  local group = redis.call('HGET', fk[5], 'g:' .. id)
  if not group then return end
  if ended then redis.call('HDEL', fk[5], 'g:' .. id) end
  local run = redis.call('HINCRBY', fk[5], 'run:' .. group, -1)
  if run <= 0 then redis.call('HDEL', fk[5], 'run:' .. group) end
  if mlxq_fair_capped(fk[5], policy, group) then return end
  for ti, tier in ipairs(FAIR_TIERS) do
    local parked = 'p:' .. tier .. ':' .. group
    local turn = redis.call('HGET', fk[5], parked)
    if turn then
      redis.call('HDEL', fk[5], parked)
      redis.call('ZADD', fk[ti], turn, group)
    end
  end
end

-- Usage (ModelKeys.usage): tokens per key per UTC day, as days since 1970-01-01 by the server's clock.
local function mlxq_usage_day(now)
  return tostring(math.floor(now / 86400))
end

-- The seconds until the next day when ``group`` has used its daily token quota on this model (policy
-- ``quota:<group>``, prompt and completion tokens together), else nil.
local function mlxq_over_quota(usage, policy, group, now)
  local quota = tonumber(redis.call('HGET', policy, 'quota:' .. group))
  if not quota then return nil end
  local day = mlxq_usage_day(now) .. '|' .. group .. '|'
  local used = redis.call('HMGET', usage, day .. 'prompt', day .. 'completion')
  if (tonumber(used[1]) or 0) + (tonumber(used[2]) or 0) < quota then return nil end
  return math.max(1, math.ceil(86400 - now % 86400))
end

-- Count a finished job's tokens for its group (before mlxq_fair_release forgets it). The first count of
-- a day (the hash's field 'day' names the last one counted) drops the days older than USAGE_DAYS: one
-- pass over the hash a day, which holds three fields per key per day kept.
local USAGE_DAYS = 92
local function mlxq_meter(fk, id, prompt, completion, now)
  local group = redis.call('HGET', fk[5], 'g:' .. id)
  if not group then return end  -- (queued by a producer older than fair shares)
  local today = mlxq_usage_day(now)
  if redis.call('HGET', fk[6], 'day') ~= today then
    redis.call('HSET', fk[6], 'day', today)
    local keep = tonumber(today) - USAGE_DAYS + 1
    for _, field in ipairs(redis.call('HKEYS', fk[6])) do
      local d = tonumber(string.match(field, '^(%d+)|'))
      if d and d < keep then redis.call('HDEL', fk[6], field) end
    end
  end
  local day = today .. '|' .. group .. '|'
  redis.call('HINCRBY', fk[6], day .. 'prompt', tonumber(prompt) or 0)
  redis.call('HINCRBY', fk[6], day .. 'completion', tonumber(completion) or 0)
  redis.call('HINCRBY', fk[6], day .. 'jobs', 1)
end
