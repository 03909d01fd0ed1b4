-- Finish a job, fenced on the lease owner: a worker that lost its lease writes nothing.
-- KEYS: 1 job, 2 inflight, 3 counts, 4 events, 5 done list, 6 job channel (declared for cluster routing),
--       7 sched (the job's entry, if admitted, ends with it), 8 policy copy, 9..14 the fair-share keys
--       (ModelKeys.fair_keys: its key's jobs in flight and usage, _fair.lua)
-- ARGV: 1 id, 2 owner token, 3 status (done|failed|cancelled), 4 result (msgpack),
--       5 ttl (s), 6 final delta (msgpack, may be ''), 7 publish command (PUBLISH | SPUBLISH on a cluster),
--       8 prompt tokens, 9 completion tokens (counted for the job's API key: ModelKeys.usage)
-- Returns 1, or 0 when the lease was lost (a job key that is not a hash counts as lost: pcall).
-- An events stream or done list of another type (clobbered) is skipped: the result is in the hash.
-- The stream, final delta included, is then compacted into the record's 'events' field and deleted
-- (_compact.lua), in this call: a reader finds either the whole stream or the whole record. The
-- lease's write fence ('sent') and intake flag ('admitted') go too: nothing is written after this.
-- So do the fields the result's stats repeat (queued_at, started_at, attempts, worker, tier) and the
-- queue score: a field costs its job ~60 bytes for a day, and a finished job is read by its result.
local owner = redis.pcall('HGET', KEYS[1], 'owner')
if type(owner) ~= 'string' or owner ~= ARGV[2] then return 0 end
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'result', ARGV[4], 'finished_at', now)
redis.call('HDEL', KEYS[1], 'owner', 'cancel', 'resume', 'sent', 'admitted',
  'queued_at', 'started_at', 'score', 'attempts', 'worker', 'tier')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
-- fair shares and usage: the job's tokens counted for its key, and one fewer of its jobs in flight
if KEYS[14] then
  local fk = {KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13], KEYS[14]}
  mlxq_meter(fk, ARGV[1], ARGV[8], ARGV[9], tonumber(t[1]) + tonumber(t[2]) / 1000000)
  mlxq_fair_release(fk, KEYS[8], ARGV[1], true)
end
redis.call('HINCRBY', KEYS[3], 'running', -1)
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
redis.call('HINCRBY', KEYS[3], 'processed', 1)
local ttl = tonumber(ARGV[5])
redis.call('EXPIRE', KEYS[1], ttl)
if ARGV[6] ~= '' then
  redis.pcall('XADD', KEYS[4], '*', 'd', ARGV[6])
  redis.call(ARGV[7], KEYS[6], ARGV[6])
end
local events = mlxq_compact(KEYS[4], ARGV[4])
if events then
  redis.call('HSET', KEYS[1], 'events', events)
  redis.call('DEL', KEYS[4])
end
redis.call('EXPIRE', KEYS[4], ttl)
redis.pcall('RPUSH', KEYS[5], '1')
redis.call('EXPIRE', KEYS[5], ttl)
return 1
