-- Append token deltas to their jobs' durable streams and publish them, fenced on the lease owner:
-- a worker that lost a job's lease (it hung past the lease, and another worker resumed the job)
-- writes nothing, so a job's stream holds exactly one delta for each stretch of its output.
-- Each delta carries its sequence number, from one counter of its worker process (which only
-- grows); the job hash keeps the owner and number of the last one written (field 'sent'), and a
-- delta of that owner numbered no higher was written already and is skipped: a worker that sends a
-- call again because its reply was lost (the call had landed) appends and publishes nothing twice.
-- KEYS: three per delta: job, events, job channel
-- ARGV: 1 publish command (PUBLISH | SPUBLISH on a cluster), then three per delta:
--       owner token, delta (msgpack), sequence number ('' for none: never skipped)
-- The stream has no TTL while its job lives (queued, running: as the job hash); every end of the
-- job sets it (complete.lua, _end.lua; pull.lua and reap.lua for a record that vanished). It was set
-- by an attempt's first delta, and ran out under a job that waited or ran past it.
-- Returns the ids of the jobs whose deltas were refused (lease lost, or a job key or events key
-- that is not a hash / a stream: clobbered, as a lost lease; pcall, so that one such job never
-- fails the call, which carries the deltas of every job of the step). A write the server refuses
-- for itself (OOM, MISCONF) fails the call with that error instead (see below).
local owners, sent, seen, refused = {}, {}, {}, {}
local function server_not_now(err)
  local code = string.match(err, '^(%u+)')
  return code == 'OOM' or code == 'MISCONF' or code == 'BUSY' or code == 'NOREPLICAS' or code == 'READONLY'
    or code == 'LOADING' or code == 'TRYAGAIN' or code == 'CLUSTERDOWN' or code == 'MASTERDOWN'
end
local function refuse(jk)
  owners[jk] = false
  if not seen[jk] then
    seen[jk] = true
    table.insert(refused, jk)
  end
end
for i = 1, #KEYS / 3 do
  local jk, ek, ch = KEYS[i * 3 - 2], KEYS[i * 3 - 1], KEYS[i * 3]
  local owner, payload, seq = ARGV[i * 3 - 1], ARGV[i * 3], tonumber(ARGV[i * 3 + 1])
  if owners[jk] == nil then
    local f = redis.pcall('HMGET', jk, 'owner', 'sent')
    owners[jk] = type(f) == 'table' and not f.err and f[1] or false
    if owners[jk] then
      local o, n = string.match(f[2] or '', '^(.*) (%d+)$')
      sent[jk] = o == owners[jk] and tonumber(n) or -1
    end
  end
  if owners[jk] == owner then
    if not (seq and seq <= sent[jk]) then  -- (written already: a resend)
      local r = redis.pcall('XADD', ek, '*', 'd', payload)
      if type(r) == 'table' and r.err then
        -- the server's own trouble (OOM at maxmemory, MISCONF after a failed save, ...), not the
        -- job's: the call fails with it and the worker sends it again later; what this call wrote
        -- before is numbered in 'sent', so the resend skips it. Any other error is this job's own
        -- (an events key that is not a stream, or a stream at its last possible id: its producer
        -- may write it): its deltas are refused, as a lost lease, and the other jobs' go on.
        if server_not_now(r.err) then return redis.error_reply(r.err) end
        refuse(jk)
      else
        if seq then
          local h = redis.pcall('HSET', jk, 'sent', owner .. ' ' .. ARGV[i * 3 + 1])
          if type(h) == 'table' and h.err then
            redis.call('XDEL', ek, r)  -- unrecorded, it would be appended again by the resend
            return redis.error_reply(h.err)
          end
          sent[jk] = seq
        end
        redis.call(ARGV[1], ch, payload)
      end
    end
  else
    refuse(jk)
  end
end
return refused
