-- Put a running job back in the queue at its original score (preemption, warm shutdown).
-- Fenced on the lease owner. The attempt is given back: it did not fail.
-- With an error (ARGV 4, a worker whose engine raised while it held the job): the attempt counts
-- instead. The job keeps the error and its lease ends now (no owner left, so a heartbeat of that
-- worker still under way cannot renew it), so that reap.lua requeues it, or dead-letters it with
-- that error once it has used max attempts: a job that fails every worker it meets ends in the
-- dead-letter set instead of going round the workers for ever.
-- A job flagged for cancelling (cancel_request.lua, after the worker's last renew) ends cancelled
-- instead: queued again, it would be leased and run by the next worker.
-- An admitted job goes back at the score and tier a worker gave it (sched), never its hash's (which its
-- producer may write: a forged score put it at the head of the queue), and a failure marks it a suspect
-- there too.
-- Requeued, the job's event stream loses its TTL until the job ends (it waited past it, and its
-- resume lost what it had emitted).
-- KEYS: 1 job, 2 inflight, 3 queue, 4 counts, 5 wake, 6 events, 7 done list, 8 job channel, 9 sched,
--       10 policy copy, 11..16 the fair-share keys (ModelKeys.fair_keys: its key's jobs in flight)
-- (with an error the lease has not ended yet: the reaper ends it, and releases it there)
-- ARGV: 1 id, 2 owner token, 3 resume state (msgpack, '' for none), 4 error ('' for none), 5 ttl (s),
--       6 publish command (PUBLISH | SPUBLISH on a cluster)
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return 0 end
local sd = mlxq_sched(KEYS[9], ARGV[1])
if ARGV[4] and ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'error', ARGV[4])
  if sd then mlxq_sched_set(KEYS[9], ARGV[1], sd.tier, sd.score, true) end
  redis.call('HDEL', KEYS[1], 'owner')
  redis.call('ZADD', KEYS[2], 'XX', 0, ARGV[1])
  return 1
end
local f = redis.call('HMGET', KEYS[1], 'score', 'tier', 'cancel')
if sd then f[1], f[2] = sd.score, sd.tier end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[4], 'running', -1)
redis.call('HDEL', KEYS[1], 'owner')
-- fair shares: one fewer in flight for the job's key (the job is over if it was cancelled)
if KEYS[16] then
  mlxq_fair_release({KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16]}, KEYS[10], ARGV[1], f[3] == '1')
end
if f[3] == '1' then
  local t = redis.call('TIME')
  redis.call('HDEL', KEYS[1], 'resume')
  redis.call('HSET', KEYS[1], 'status', 'cancelled',
    'finished_at', string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000))
  redis.call('HINCRBY', KEYS[4], 'cancelled', 1)
  redis.call('HINCRBY', KEYS[4], 'processed', 1)
  redis.call('HDEL', KEYS[9], ARGV[1])
  mlxq_end_record(ARGV[6], KEYS[1], KEYS[6], KEYS[7], KEYS[8], tonumber(ARGV[5]), 'f', 'cancelled')
  return 1
end
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'resume', ARGV[3]) end
redis.call('HSET', KEYS[1], 'status', 'queued')
-- what it emitted so far, which its resume reads, is kept while it waits (as its record: no TTL), however
-- long; the job's end sets the TTL again
redis.call('PERSIST', KEYS[6])
redis.call('ZADD', KEYS[3], tonumber(f[1]), ARGV[1])
redis.call('HINCRBY', KEYS[4], 'queued:' .. (f[2] or 'normal'), 1)
redis.call('HINCRBY', KEYS[4], 'requeued', 1)
mlxq_wake(KEYS[5])
return 1
