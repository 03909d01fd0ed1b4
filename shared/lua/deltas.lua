-- Append token deltas to their jobs' durable streams and publish them, fenced on the lease owner:
-- a worker that lost a job's lease (it hung past the lease, and another worker resumed the job)
-- writes nothing, so a job's stream holds exactly one delta for each stretch of its output.
-- KEYS: three per delta: job, events, job channel
-- ARGV: 1 ttl (s), 2 publish command (PUBLISH | SPUBLISH on a cluster), then three per delta:
--       owner token, delta (msgpack), '1' when it is its attempt's first delta (the stream gets its TTL)
-- Returns the ids of the jobs whose deltas were refused (lease lost).
local owners, seen, refused = {}, {}, {}
for i = 1, #KEYS / 3 do
  local jk, ek, ch = KEYS[i * 3 - 2], KEYS[i * 3 - 1], KEYS[i * 3]
  local owner, payload, first = ARGV[i * 3], ARGV[i * 3 + 1], ARGV[i * 3 + 2]
  if owners[jk] == nil then owners[jk] = redis.call('HGET', jk, 'owner') end
  if owners[jk] == owner then
    redis.call('XADD', ek, '*', 'd', payload)
    redis.call(ARGV[2], ch, payload)
    if first == '1' then redis.call('EXPIRE', ek, tonumber(ARGV[1])) end
  elseif not seen[jk] then
    seen[jk] = true
    table.insert(refused, jk)
  end
end
return refused
