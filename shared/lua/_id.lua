-- A job id as new_job_id makes it (mlxq.shared.schemas.JOB_ID): 32 lowercase hex digits. The scripts
-- take no other (enqueue and submit refuse one; pull and admit set one aside).
local function mlxq_is_job_id(s)
  return #s == 32 and not string.find(s, '[^0-9a-f]')
end
