-- Cancel a job: a queued one leaves the queue now; a running one is flagged and its
-- worker told on the cancel channel (it leaves the batch at the next step).
-- KEYS: 1 queue, 2 job, 3 counts, 4 events, 5 done list, 6 cancel channel, 7 job channel, 8 sched
--       (optional: the job's entry, if admitted, ends with it), 9 fair state (optional: a queued job's
--       group, _fair.lua, ends with it; its index entry is dropped when a pick meets it)
-- ARGV: 1 id, 2 publish command (PUBLISH | SPUBLISH on a cluster), 3 mode, 4 ttl (s)
--   mode 'queue': workers and trusted clients (producers under the ACL recipe use cancel_request);
--   mode 'worker': a worker acting on a cancel_request message: a flagged queued job only, no publish back.
-- Returns 'cancelled' | 'cancelling' | the job's final status | 'unknown'
local status = redis.call('HGET', KEYS[2], 'status')
if not status then return 'unknown' end
local mode = ARGV[3]
if mode == 'worker' and redis.call('HGET', KEYS[2], 'cancel') ~= '1' then return status end
local function finish()
  local t = redis.call('TIME')
  local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
  redis.call('HSET', KEYS[2], 'status', 'cancelled', 'finished_at', now)
  redis.call('HDEL', KEYS[2], 'resume')
  if KEYS[8] then redis.call('HDEL', KEYS[8], ARGV[1]) end
  if KEYS[9] and status == 'queued' then redis.call('HDEL', KEYS[9], 'g:' .. ARGV[1]) end
  mlxq_end_record(ARGV[2], KEYS[2], KEYS[4], KEYS[5], KEYS[7], tonumber(ARGV[4]), 'f', 'cancelled')
  return 'cancelled'
end
if status == 'queued' then
  if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then  -- in the queue (not still on the intake list)
    local sd = KEYS[8] and mlxq_sched(KEYS[8], ARGV[1])
    local tier = sd and sd.tier or redis.call('HGET', KEYS[2], 'tier') or 'normal'
    redis.call('HINCRBY', KEYS[3], 'queued:' .. tier, -1)
    redis.call('HINCRBY', KEYS[3], 'cancelled', 1)
    redis.call('HINCRBY', KEYS[3], 'processed', 1)
  end
  return finish()
end
if mode == 'worker' then return status end
if status == 'running' then
  redis.call('HSET', KEYS[2], 'cancel', '1')
  redis.call(ARGV[2], KEYS[6], ARGV[1])
  return 'cancelling'
end
return status
