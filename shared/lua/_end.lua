-- End a job's durable record where no worker result comes (refused, malformed, cancelled, dead):
-- the final event (the XADD field/value pairs given), the done-list wake-up, the TTLs, and a
-- 'sync' on the job's channel so a live subscriber re-reads the record.
local function mlxq_end_record(publish, jk, ek, dk, ch, ttl, ...)
  redis.call('XADD', ek, '*', ...)
  redis.call('RPUSH', dk, '1')
  redis.call('EXPIRE', dk, ttl)
  redis.call(publish, ch, 'sync')
  redis.call('EXPIRE', jk, ttl)
  redis.call('EXPIRE', ek, ttl)
end
