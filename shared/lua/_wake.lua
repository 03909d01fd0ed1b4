-- Wake the workers blocked on a model's wake-up list (BLPOP) once a job is ready to pull. The list
-- is a doorbell, not a queue: a worker pulls from the sorted sets whatever it holds, so a burst of
-- pushes only needs a few entries left, and trimming keeps an idle model's list from growing.
local function mlxq_wake(wk)
  redis.call('LPUSH', wk, '1')
  redis.call('LTRIM', wk, 0, 63)
end
