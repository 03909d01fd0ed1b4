-- A job id as new_job_id makes it (mlxq.shared.schemas.JOB_ID): 32 lowercase hex digits. The scripts
-- take no other (enqueue and submit refuse one; pull and admit set one aside).
local function mlxq_is_job_id(s)
  return #s == 32 and not string.find(s, '[^0-9a-f]')
end

-- The job an idempotency key names (``existing``, its value) if that job's record still exists, else
-- nil: a key whose job's record is gone (expired, deleted) is stale and counts as absent (a duplicate
-- reply named a job nobody could read). That record is the one key read that is not declared (the
-- caller cannot know its id): its name is the new job's key ``jk`` with the earlier id in place of
-- ``id``, so it has jk's hash tag (one slot) and the caller's ACL applies to it.
local function mlxq_live_job(jk, id, existing)
  if existing and mlxq_is_job_id(existing)
      and redis.call('EXISTS', string.sub(jk, 1, #jk - #id) .. existing) == 1 then
    return existing
  end
  return nil
end
