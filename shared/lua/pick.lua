-- Choose the next jobs to lease (pull.lua then leases them): across tiers the lowest score (tier
-- offset + age) wins, as ever; within a tier, the job comes from the group (API key) whose turn it is
-- (_fair.lua), oldest first within the group. A chosen job leaves the index here; pull.lua takes it
-- out of the queue (a worker that dies in between leaves it queued and unindexed: see below).
-- A queued job the index does not hold (one put back by a requeue or the reaper, chosen here and not
-- pulled, or queued by a script that does not index) is taken by its score alone, as the queue's
-- head: nothing in the queue waits for ever.
-- KEYS: 1 queue, 2 policy copy (weight:<group>, inflight:<group>), 3 ring high, 4 ring normal, 5 ring low,
--       6 fair jobs, 7 fair state, 8 usage (unread: ModelKeys.fair_keys, declared as they come)
-- ARGV: 1 how many
-- Returns the chosen members of the queue, in order.
local fk = {KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]}
local taken = {}
local chosen = {}  -- group -> jobs this call chose (their leases come at pull)
-- the next job of a tier's ring: {id, score, group, turn, member}; groups found empty leave the
-- ring (keeping their turn), and so do groups at their cap on jobs in flight (parked with their turn,
-- until one of their jobs ends: mlxq_fair_release); a group this call chose enough jobs of to reach
-- its cap is passed over (skip: the ring members at the front passed over so far), not parked, for
-- those jobs may yet not be leased; members no longer queued (cancelled, expired) are dropped
local skip = {0, 0, 0}
local function tier_head(ti)
  local tier, ring = FAIR_TIERS[ti], fk[ti]
  while true do
    local g = redis.call('ZRANGE', ring, skip[ti], skip[ti], 'WITHSCORES')
    if #g == 0 then return nil end
    local group, turn = g[1], tonumber(g[2])
    local prefix = tier .. '|' .. group .. '|'
    local m = redis.call('ZRANGEBYLEX', fk[4], '[' .. prefix, '[' .. prefix .. '~', 'LIMIT', 0, 1)
    if #m > 0 and mlxq_fair_capped(fk[5], KEYS[2], group) then
      redis.call('ZREM', ring, group)
      redis.call('HSET', fk[5], 'p:' .. tier .. ':' .. group, turn)
    elseif #m > 0 and mlxq_fair_capped(fk[5], KEYS[2], group, chosen[group]) then
      skip[ti] = skip[ti] + 1
    elseif #m == 0 then
      redis.call('ZREM', ring, group)
      redis.call('HSET', fk[5], 'f:' .. tier .. ':' .. group, turn)
    else
      local id = string.sub(m[1], -32)
      local indexed = redis.call('HGET', fk[5], 'j:' .. id) == m[1]
      local score = tonumber(redis.call('ZSCORE', KEYS[1], id))
      if indexed and score then return {id = id, score = score, group = group, turn = turn, member = m[1]} end
      redis.call('ZREM', fk[4], m[1])
      if indexed then
        redis.call('HDEL', fk[5], 'j:' .. id)
        if not score then redis.call('HDEL', fk[5], 'g:' .. id) end  -- it ended while queued
      end
    end
  end
end
local qpos = 0
-- the queue's head when the index does not hold it (skipping what this call chose already, and jobs
-- of groups at their cap: at most LOOSE_SCAN of those, past which it waits for the next pick)
local LOOSE_SCAN = 64
local function loose_head()
  while qpos < LOOSE_SCAN do
    local q = redis.call('ZRANGE', KEYS[1], qpos, qpos, 'WITHSCORES')
    if #q == 0 then return nil end
    if not taken[q[1]] then
      if redis.call('HEXISTS', fk[5], 'j:' .. q[1]) == 1 then return nil end
      local group = redis.call('HGET', fk[5], 'g:' .. q[1])
      if not (group and mlxq_fair_capped(fk[5], KEYS[2], group, chosen[group])) then
        return {id = q[1], score = tonumber(q[2]), group = group}
      end
    end
    qpos = qpos + 1
  end
  return nil
end
local out = {}
for _ = 1, tonumber(ARGV[1]) do
  -- (each tier's head afresh: what this call chose may have brought a group to its cap)
  local best, from = loose_head(), 0
  for ti = 1, 3 do
    local h = tier_head(ti)
    if h and (not best or h.score < best.score) then best, from = h, ti end
  end
  if not best then break end
  if from > 0 then
    local tier = FAIR_TIERS[from]
    redis.call('ZREM', fk[4], best.member)
    redis.call('HDEL', fk[5], 'j:' .. best.id)
    redis.call('HSET', fk[5], 'v:' .. tier, best.turn)
    local w = tonumber(redis.call('HGET', KEYS[2], 'weight:' .. best.group))
    if not w or w ~= w or w <= 0 or w == math.huge then w = 1 end
    redis.call('ZADD', fk[from], best.turn + 1 / w, best.group)
  end
  taken[best.id] = true
  if best.group then chosen[best.group] = (chosen[best.group] or 0) + 1 end
  out[#out + 1] = best.id
end
return out
