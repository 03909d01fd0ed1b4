-- Heartbeat: extend the leases this worker still owns.
-- KEYS: 1 inflight, then one job key per lease (in the order of the pairs)
-- ARGV: 1 lease (s), 2 unused, then pairs of (id, owner token)
-- Returns {lost ids, ids flagged for cancellation}
local t = redis.call('TIME')
local deadline = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
local lost, cancel = {}, {}
for i = 3, #ARGV, 2 do
  local id = ARGV[i]
  local f = redis.pcall('HMGET', KEYS[(i - 1) / 2 + 1], 'owner', 'cancel')  -- pcall: a clobbered key is a lost lease
  if type(f) ~= 'table' or f.err or f[1] ~= ARGV[i + 1] then
    table.insert(lost, id)
  else
    redis.call('ZADD', KEYS[1], 'XX', deadline, id)
    if f[2] == '1' then table.insert(cancel, id) end
  end
end
return {lost, cancel}
