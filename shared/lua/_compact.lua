-- Compact a finished job's event stream into its record (complete.lua, in the call that writes the
-- final delta). A stream costs at least 4 KiB (Redis preallocates a node) and repeats the text and
-- token ids, which the result holds already; what the result lacks is where each delta began and
-- ended. So each delta is written here as just that: the bytes of its text (and reasoning, and
-- tool-call arguments) and its count of token ids, the slices of the result it covers; the
-- counters it carries (n, c, s, rc, k, po) follow from the deltas before it, and its logprobs,
-- tool calls and seed are the result's. mlxq.shared.replay expands the record back, delta for
-- delta (PROTOCOL.md, section 4: "A finished job's record").
-- Every delta is checked against the result while it is compacted: a stream the record could not
-- replay exactly (a gap, an overlap, a terminal event, text the result does not hold) is left as it
-- is (nil is returned).
local function mlxq_utf8_len(s)
  local _, cont = string.gsub(s, '[\128-\191]', '')
  return #s - cont
end

local function mlxq_same(a, b)
  if type(a) ~= type(b) then return false end
  if type(a) ~= 'table' then return a == b end
  for k, v in pairs(a) do
    if not mlxq_same(v, b[k]) then return false end
  end
  for k in pairs(b) do
    if a[k] == nil then return false end
  end
  return true
end

-- the keys of a delta that the record derives (the others are kept as they are: f, e, xn, ...)
local MLXQ_DERIVED = {a = 1, s = 1, n = 1, c = 1, t = 1, i = 1, lp = 1, r = 1, rc = 1, tc = 1, k = 1,
                      pi = 1, pn = 1, pa = 1, po = 1, x = 1, sd = 1}

-- One delta as the record keeps it: an integer for the common one (one token id, text, nothing
-- else: its text's bytes, times 16 plus its sample when the job's deltas carry samples), else a map
-- of what differs; nil when it is not the result's next slice of its sample.
local function mlxq_compact_delta(st, d)
  local x = d.x
  if x ~= nil and (type(x) ~= 'number' or x < 0) then return nil end
  local lane = x or 0
  local R = st.samples and st.samples[lane + 1] or (lane == 0 and st.res) or nil
  if type(R) ~= 'table' then return nil end
  local L = st.lanes[lane]
  if not L then
    L = {n = 0, c = 0, tb = 0, rc = 0, rb = 0, s = 0, k = 0, call = -1, po = 0, pb = 0}
    st.lanes[lane] = L
  end
  local t, ids = d.t, d.i
  if type(t) ~= 'string' or type(ids) ~= 'table' or type(d.a) ~= 'number'
      or d.n ~= L.n or d.c ~= L.c or d.s ~= L.s + 1 then return nil end
  if type(R.text) ~= 'string' or string.sub(R.text, L.tb + 1, L.tb + #t) ~= t then return nil end
  if #ids > 0 and type(R.token_ids) ~= 'table' then return nil end
  for j = 1, #ids do
    if R.token_ids[L.n + j] ~= ids[j] then return nil end
  end
  local out, plain = {}, true
  if #ids ~= 1 then out.i, plain = #ids, false end
  if d.a ~= st.a then out.a, st.a, plain = d.a, d.a, false end
  if d.lp ~= nil then
    if type(d.lp) ~= 'table' or #d.lp ~= #ids or type(R.logprobs) ~= 'table' then return nil end
    for j = 1, #ids do
      if not mlxq_same(d.lp[j], R.logprobs[L.n + j]) then return nil end
    end
    out.lp, plain = 1, false
  end
  if d.r ~= nil then
    local r = d.r
    if type(r) ~= 'string' or d.rc ~= L.rc or type(R.reasoning) ~= 'string'
        or string.sub(R.reasoning, L.rb + 1, L.rb + #r) ~= r then return nil end
    out.r, plain = #r, false
    L.rc, L.rb = L.rc + mlxq_utf8_len(r), L.rb + #r
  elseif d.rc ~= nil then
    return nil
  end
  if d.tc ~= nil or d.pn ~= nil then
    if d.k ~= L.k then return nil end
    plain = false
  elseif d.k ~= nil then
    return nil
  end
  local calls = R.tool_calls
  if d.tc ~= nil then
    if type(d.tc) ~= 'table' or #d.tc == 0 or type(calls) ~= 'table' then return nil end
    for j = 1, #d.tc do
      if not mlxq_same(d.tc[j], calls[L.k + j]) then return nil end
    end
    out.tc, L.k = #d.tc, L.k + #d.tc
  end
  if d.pn ~= nil then
    local pa = d.pa
    if type(pa) ~= 'string' then return nil end
    if L.call ~= L.k then L.call, L.po, L.pb, L.pi, L.pn = L.k, 0, 0, nil, nil end
    if d.po ~= L.po then return nil end
    -- a call cut short (length, cancel) is in no result: its arguments' pieces stay as they were
    local call = type(calls) == 'table' and calls[L.k + 1]
    local fn = type(call) == 'table' and call['function']
    local args = type(fn) == 'table' and fn.arguments
    if type(args) == 'string' and string.sub(args, L.pb + 1, L.pb + #pa) == pa then
      out.pa = #pa
    else
      out.pa, out.po = pa, d.po
    end
    if d.pi ~= L.pi then
      if d.pi == nil then return nil end
      out.pi, L.pi = d.pi, d.pi
    end
    if d.pn ~= L.pn then out.pn, L.pn = d.pn, d.pn end
    L.po, L.pb = L.po + mlxq_utf8_len(pa), L.pb + #pa
  elseif d.pi ~= nil or d.pa ~= nil or d.po ~= nil then
    return nil
  end
  if d.sd ~= nil then
    -- (a 64-bit seed is no exact Lua number: the record says "the seed of the result's stats")
    local stats = st.res.stats
    if type(stats) ~= 'table' or stats.seed ~= d.sd then return nil end
    out.sd, plain = 1, false
  end
  for key, v in pairs(d) do
    if not MLXQ_DERIVED[key] then out[key], plain = v, false end
  end
  if st.xmode then
    if x == nil or x > 15 then plain = false else out.x = x end
  end
  L.n, L.c, L.tb, L.s = L.n + #ids, L.c + mlxq_utf8_len(t), L.tb + #t, L.s + 1
  if plain then return st.xmode and #t * 16 + x or #t end
  if #t > 0 then out.t = #t end
  if next(out) == nil then out.t = 0 end  -- (an empty table packs as a list)
  return out
end

-- A result's token ids as a list: the record keeps them as a string, one UTF-8 character an id
-- (mlxq.shared.codec.pack_ids: code point = id, ids from 0xD800 up shifted by 0x800); nil for a
-- string that is no such thing.
local function mlxq_ids(v)
  if type(v) ~= 'string' then return v end
  local ids, p, n = {}, 1, #v
  while p <= n do
    local b = string.byte(v, p)
    local len, cp = 1, b
    if b >= 0xF0 then len, cp = 4, b - 0xF0
    elseif b >= 0xE0 then len, cp = 3, b - 0xE0
    elseif b >= 0xC0 then len, cp = 2, b - 0xC0
    elseif b >= 0x80 then return nil end
    if p + len - 1 > n then return nil end
    for q = p + 1, p + len - 1 do cp = cp * 64 + string.byte(v, q) - 0x80 end
    ids[#ids + 1] = cp >= 0xD800 and cp - 0x800 or cp
    p = p + len
  end
  return ids
end

-- The record of stream ``ek`` checked against ``packed_result`` (the result, msgpack): the packed
-- record, or nil to keep the stream. The record is a list: 1 (its version), 1 when the deltas carry
-- samples (else 0), then one element per stream entry: a compacted delta (an integer or a map), or
-- a list of them (a payload of several samples' deltas).
local function mlxq_compact(ek, packed_result)
  local okr, res = pcall(cmsgpack.unpack, packed_result)
  if not okr or type(res) ~= 'table' then return nil end
  local raw = redis.pcall('XRANGE', ek, '-', '+')
  if type(raw) ~= 'table' or raw.err or #raw == 0 then return nil end
  local payloads, xmode = {}, false
  for i, e in ipairs(raw) do
    local f = e[2]
    if #f ~= 2 or f[1] ~= 'd' then return nil end  -- a terminal event, or another writer's entry
    local ok, p = pcall(cmsgpack.unpack, f[2])
    if not ok or type(p) ~= 'table' then return nil end
    local list = p[1] ~= nil
    local ds = list and p or {p}
    for _, d in ipairs(ds) do
      if type(d) ~= 'table' then return nil end
      if d.x ~= nil then xmode = true end
    end
    payloads[i] = {list, ds}
  end
  local samples = type(res.samples) == 'table' and res.samples[1] ~= nil and res.samples or nil
  res.token_ids = mlxq_ids(res.token_ids)
  for _, out in ipairs(samples or {}) do
    if type(out) == 'table' then out.token_ids = mlxq_ids(out.token_ids) end
  end
  local st = {res = res, samples = samples, lanes = {}, a = 1, xmode = xmode}
  local out = {1, xmode and 1 or 0}
  for _, pl in ipairs(payloads) do
    local enc = {}
    for j, d in ipairs(pl[2]) do
      enc[j] = mlxq_compact_delta(st, d)
      if enc[j] == nil then return nil end
    end
    out[#out + 1] = pl[1] and enc or enc[1]
  end
  return cmsgpack.pack(out)
end
