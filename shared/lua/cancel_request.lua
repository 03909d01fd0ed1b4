-- Cancel as a producer that may not write the queue: a job still on the intake list ends now;
-- a job in the queue or running is flagged and the workers told on the cancel channel (a worker
-- takes a queued one out: cancel with mode 'worker'; a running one leaves its batch).
-- KEYS: 1 job, 2 events, 3 done list
-- ARGV: 1 id, 2 publish command, 3 cancel channel, 4 job channel, 5 ttl (s)
-- Returns 'cancelled' | 'cancelling' | the job's final status | 'unknown'
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'unknown' end
if status == 'queued' and not redis.call('HGET', KEYS[1], 'admitted') then
  local t = redis.call('TIME')
  local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', now)
  mlxq_end_record(ARGV[2], KEYS[1], KEYS[2], KEYS[3], ARGV[4], tonumber(ARGV[5]), 'f', 'cancelled')
  return 'cancelled'
end
if status == 'queued' or status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  redis.call(ARGV[2], ARGV[3], ARGV[1])
  return 'cancelling'
end
return status
