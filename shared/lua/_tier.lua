-- The tier and its offset are decided here, in Redis, never taken from the caller: from this
-- model's slot copy of the API-key registry (field sha1(sha256(key)) -> tier | revoked:<tier>)
-- and from the policy an admin stored (`mlxq tiers`).  A floor (bulk, /v1/batch/) only lowers.
local TIER_RANK = {high = 1, normal = 2, low = 3}
local DEFAULT_OFFSETS = {high = 0, normal = 30, low = 300}
local function mlxq_tier(copy_key, policy_key, key_hash, floor)
  local tier
  if key_hash == '' then
    -- a caller without a key: the tier an admin opted in to (`mlxq tiers --anonymous`); unset, the
    -- normal tier while no key is registered (open mode) and refused once one is: keys mean keys
    tier = redis.call('HGET', policy_key, 'anonymous')
    if not tier then
      if redis.call('EXISTS', copy_key) == 1 then
        return nil, 'an API key is required (keys are registered; `mlxq tiers --anonymous normal` serves '
          .. 'callers without one)'
      end
      tier = 'normal'
    end
    if tier == 'refuse' then return nil, 'an API key is required' end
    if not TIER_RANK[tier] then tier = 'normal' end
  else
    local rec = redis.call('HGET', copy_key, redis.sha1hex(key_hash))
    if not rec then
      -- open mode (as vLLM, ollama and mlx-lm's server): while no key is registered at all (the
      -- slot's copy is synced, see the callers' policy check, and empty), any key is normal tier
      if redis.call('EXISTS', copy_key) == 1 then return nil, 'unknown API key' end
      rec = 'normal'
    end
    if string.sub(rec, 1, 7) == 'revoked' then return nil, 'revoked API key' end
    if not TIER_RANK[rec] then return nil, 'API key has no valid tier' end
    tier = rec
  end
  if floor ~= '' then
    if not TIER_RANK[floor] then return nil, 'invalid tier floor' end
    if TIER_RANK[floor] > TIER_RANK[tier] then tier = floor end
  end
  return tier
end
local function mlxq_offset(policy_key, tier)
  local v = tonumber(redis.call('HGET', policy_key, 'offset:' .. tier))
  if v == nil or v ~= v then v = DEFAULT_OFFSETS[tier] end
  return v
end
