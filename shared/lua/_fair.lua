-- Fair shares between API keys within a tier (PROTOCOL.md, "Fair shares"). A job's group is its API
-- key (sha1 of the key's sha256, as in the registry copy) or '-' for jobs without one. Each tier has a
-- ring (ModelKeys.fair_ring: group -> turn) of the groups with indexed jobs; every indexed job is a
-- member '<tier>|<group>|<score>|<id>' of one lexical zset (ModelKeys.fair_jobs), so a group's oldest
-- job is the first of its range. pick.lua serves the group with the lowest turn and moves it on by
-- 1 / its weight: round robin, weighted. Only fixed keys, so every script declares what it touches.
-- KEYS given as a table fk: {ring high, ring normal, ring low, jobs, state} (ModelKeys.fair_keys).
local FAIR_TIERS = {'high', 'normal', 'low'}
local FAIR_RING = {high = 1, normal = 2, low = 3}

local function mlxq_fair_group(key_hash)
  if key_hash == nil or key_hash == '' then return '-' end
  return redis.sha1hex(key_hash)
end

-- Index a job just queued at ``tier`` with ``score``. A group that had no job at the tier joins the
-- ring at the turn last served there, or later if it left with turns in hand (so a key that drains
-- and comes back at once does not jump its round).
local function mlxq_fair_add(fk, tier, group, score, id)
  local m = tier .. '|' .. group .. '|' .. string.format('%020.6f', score) .. '|' .. id
  redis.call('ZADD', fk[4], 0, m)
  redis.call('HSET', fk[5], 'j:' .. id, m)
  local ring = fk[FAIR_RING[tier]]
  if not redis.call('ZSCORE', ring, group) then
    local v = tonumber(redis.call('HGET', fk[5], 'v:' .. tier)) or 0
    local left = 'f:' .. tier .. ':' .. group
    local f = tonumber(redis.call('HGET', fk[5], left)) or 0
    redis.call('HDEL', fk[5], left)
    redis.call('ZADD', ring, math.max(v, f), group)
  end
end
