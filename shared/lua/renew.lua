-- Heartbeat: vouch for this worker, and extend the leases it still owns.
-- KEYS: 1 inflight, 2 beats, then one job key per lease (in the order of the pairs)
-- ARGV: 1 lease (s), 2 worker id ('' : no beat), 3 takeover after (s: how long this beat vouches for
--       the worker), then pairs of (id, owner token)
-- The beat is the worker's own deadline (server time + ARGV 3): any reaper past it takes over the
-- jobs the worker holds (reap.lua). A beat that comes after its deadline had passed is late: the
-- reply says by how much, and renew finds the leases a reaper took meanwhile lost (their owner gone).
-- Returns {lost ids, ids flagged for cancellation, seconds the beat was late ('0': on time or first)}
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local deadline = now + tonumber(ARGV[1])
local late = 0
if ARGV[2] ~= '' then
  local vouched = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[2]))
  if vouched and vouched < now then late = now - vouched end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[2])
end
local lost, cancel = {}, {}
for i = 4, #ARGV, 2 do
  local id = ARGV[i]
  local f = redis.pcall('HMGET', KEYS[(i - 4) / 2 + 3], 'owner', 'cancel')  -- pcall: a clobbered key is a lost lease
  if type(f) ~= 'table' or f.err or f[1] ~= ARGV[i + 1] then
    table.insert(lost, id)
  else
    redis.call('ZADD', KEYS[1], 'XX', deadline, id)
    if f[2] == '1' then table.insert(cancel, id) end
  end
end
return {lost, cancel, string.format('%.3f', late)}
