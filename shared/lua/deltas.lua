-- Append token deltas to their jobs' durable streams and publish them, fenced on the lease owner:
-- a worker that lost a job's lease (it hung past the lease, and another worker resumed the job)
-- writes nothing, so a job's stream holds exactly one delta for each stretch of its output.
-- KEYS: three per delta: job, events, job channel
-- ARGV: 1 ttl (s), 2 publish command (PUBLISH | SPUBLISH on a cluster), then three per delta:
--       owner token, delta (msgpack), unused
-- Each delta sets the stream's TTL again: the record outlives a run longer than the TTL (it was set
-- by an attempt's first delta only). Queued again, the stream has none (requeue.lua, reap.lua).
-- Returns the ids of the jobs whose deltas were refused (lease lost, or a job key or events key
-- that is not a hash / a stream: clobbered, as a lost lease; pcall, so that one such job never
-- fails the call, which carries the deltas of every job of the step).
local owners, seen, refused = {}, {}, {}
local function refuse(jk)
  owners[jk] = false
  if not seen[jk] then
    seen[jk] = true
    table.insert(refused, jk)
  end
end
for i = 1, #KEYS / 3 do
  local jk, ek, ch = KEYS[i * 3 - 2], KEYS[i * 3 - 1], KEYS[i * 3]
  local owner, payload = ARGV[i * 3], ARGV[i * 3 + 1]
  if owners[jk] == nil then
    local o = redis.pcall('HGET', jk, 'owner')
    owners[jk] = type(o) == 'string' and o or false
  end
  if owners[jk] == owner then
    local r = redis.pcall('XADD', ek, '*', 'd', payload)
    if type(r) == 'table' and r.err then
      refuse(jk)
    else
      redis.call(ARGV[2], ch, payload)
      redis.call('EXPIRE', ek, tonumber(ARGV[1]))
    end
  else
    refuse(jk)
  end
end
return refused
