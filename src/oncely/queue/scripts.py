"""Lua scripts of the stream worker, each one atomic on the server.

``XACK`` takes no consumer name, so acknowledging, dead-lettering and lease
renewal first confirm through ``XPENDING … <consumer>`` that this consumer
still owns the entry: a worker whose lease was taken over must not finish
the new owner's delivery. A script's keys all belong to one workflow and
share its ``{<name>}`` hash tag.
"""

from __future__ import annotations

# KEYS: stream, index. ARGV: group, consumer, then (entry id, job id) pairs.
# Returns the entry ids acknowledged (those this consumer still owned).
ACK = """
local acked = {}
for i = 3, #ARGV, 2 do
  local id, job = ARGV[i], ARGV[i + 1]
  if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) > 0 then
    redis.call('XACK', KEYS[1], ARGV[1], id)
    if job ~= '' and redis.call('HGET', KEYS[2], job) == id then
      redis.call('HDEL', KEYS[2], job)
    end
    acked[#acked + 1] = id
  end
end
return acked
"""

# KEYS: stream, dead, index. ARGV: group, consumer, entry id, job id,
# dead-stream maxlen, then field/value pairs of the dead entry.
DEAD_LETTER = """
local id, job = ARGV[3], ARGV[4]
if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) == 0 then return 0 end
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(fields))
redis.call('XACK', KEYS[1], ARGV[1], id)
if job ~= '' and redis.call('HGET', KEYS[3], job) == id then redis.call('HDEL', KEYS[3], job) end
return 1
"""

# KEYS: stream, cancelled. ARGV: group, consumer, then (entry id, job id)
# pairs. XCLAIM … JUSTID with min-idle 0 resets the idle time without
# counting a delivery; only for entries this consumer still owns. Returns
# the ids renewed, and the job ids among them that were cancelled.
RENEW = """
local renewed, cancelled = {}, {}
for i = 3, #ARGV, 2 do
  local id, job = ARGV[i], ARGV[i + 1]
  if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    renewed[#renewed + 1] = id
    if job ~= '' and redis.call('ZSCORE', KEYS[2], job) then cancelled[#cancelled + 1] = job end
  end
end
return {renewed, cancelled}
"""

# KEYS: stream, index. ARGV: group, consumer, then (entry id, job id) pairs
# this consumer just claimed. An entry whose job the index names with
# another entry (a newer message: the job waited, and was enqueued again on
# resuming, while this one stayed pending under a worker that died) or as
# delayed is superseded: acknowledged here, never run. Returns those ids.
DROP_SUPERSEDED = """
local dropped = {}
for i = 3, #ARGV, 2 do
  local id, job = ARGV[i], ARGV[i + 1]
  local current = redis.call('HGET', KEYS[2], job)
  if current and current ~= id
      and #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) > 0 then
    redis.call('XACK', KEYS[1], ARGV[1], id)
    dropped[#dropped + 1] = id
  end
end
return dropped
"""

# KEYS: cancelled. ARGV: job id, how long a cancel is remembered (ms).
# Running deliveries hear of a cancel at their next lease renewal; older
# cancels are forgotten (PostgreSQL keeps the record).
ANNOUNCE_CANCEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
return 1
"""

# KEYS: stream, index, delayed, delayed messages, cooling, then the waiting
# set of each model the job waits for. ARGV: group, consumer, entry id, job
# id, delay ms, the message fields as a JSON object, then (with waiting
# sets) "<scope> <job id>" and the models' names.
# A transient failure: the entry leaves the stream (owner-checked XACK) and
# waits in the delayed set until the server's clock passes its due time. The
# index says "delayed", so the reconciler knows the job is not lost. A job
# waiting for models' cooldowns is in their waiting sets too, at its due
# time, for the workers to let out sooner (RELEASE).
DEFER = """
local id, job = ARGV[3], ARGV[4]
if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2]) == 0 then return 0 end
local t = redis.call('TIME')
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], id)
redis.call('HSET', KEYS[2], job, 'delayed')
redis.call('ZADD', KEYS[3], due, job)
redis.call('HSET', KEYS[4], job, ARGV[6])
for i = 6, #KEYS do
  redis.call('ZADD', KEYS[i], due, ARGV[7])
  redis.call('HSET', KEYS[5], 'm:' .. ARGV[i + 2], 1)
end
return 1
"""

# KEYS: stream, index, delayed, delayed messages, cooling. ARGV: how many at
# most. Moves every due job back into the stream, atomically: XADD, index,
# and out of the delayed set. Returns how many moved, then the models that
# delayed jobs wait for (RELEASE lets them out).
PROMOTE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, job in ipairs(due) do
  local raw = redis.call('HGET', KEYS[4], job)
  redis.call('ZREM', KEYS[3], job)
  redis.call('HDEL', KEYS[4], job)
  if raw then
    local args = {}
    for k, v in pairs(cjson.decode(raw)) do
      args[#args + 1] = k
      args[#args + 1] = tostring(v)
    end
    redis.call('HSET', KEYS[2], job, redis.call('XADD', KEYS[1], '*', unpack(args)))
  end
end
local out = {#due}
for _, field in ipairs(redis.call('HKEYS', KEYS[5])) do
  if string.sub(field, 1, 2) == 'm:' then out[#out + 1] = string.sub(field, 3) end
end
return out
"""

# KEYS: delayed, cooling, the model's waiting set. ARGV: the model, spread
# ms, probe gap ms, then each scope cooling the model with 1 when its probe
# may go now, else 0 ('*': the fleet's).
# Lets out the jobs waiting for the model (docs/model-routing.md, "The
# cooldown"): every one whose scope and the fleet no longer cool it, due at
# once, spread over the spread so that they do not come back in one burst;
# and, per scope whose probe may go, the one waiting longest, to make it
# (at most one per probe gap: the job needs a moment to reach the model).
# A member whose job is no longer delayed to the time it waited for (it
# came back, or was delayed again for something else) is forgotten, and so
# is the model once nobody waits for it. Returns how many were let out.
RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local model = ARGV[1]
local cooling = {}
for i = 4, #ARGV, 2 do cooling[ARGV[i]] = ARGV[i + 1] == '1' end
local fleet = cooling['*']
local free, probes = {}, {}
local waiting = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
for i = 1, #waiting, 2 do
  local member, at = waiting[i], tonumber(waiting[i + 1])
  local cut = string.find(member, ' ', 1, true)
  local scope, job = string.sub(member, 1, cut - 1), string.sub(member, cut + 1)
  local due = tonumber(redis.call('ZSCORE', KEYS[1], job) or '-1')
  local mine = cooling[scope]
  if due ~= at then
    redis.call('ZREM', KEYS[3], member)
  elseif mine == nil and fleet == nil then
    free[#free + 1] = {member, job, due}
  elseif mine ~= false and fleet ~= false then
    -- The scope it would probe: its tenant's first, as the cooldown admits.
    local s = mine ~= nil and scope or '*'
    if probes[s] == nil then probes[s] = {member, job, due} end
  end
end
local function out(w, at)
  if w[3] > at then redis.call('ZADD', KEYS[1], at, w[2]) end
  redis.call('ZREM', KEYS[3], w[1])
end
for i, w in ipairs(free) do
  out(w, now + math.floor(tonumber(ARGV[2]) * (i - 1) / #free))
end
local sent = #free
for s, w in pairs(probes) do
  local field = 'p:' .. s .. ':' .. model
  if tonumber(redis.call('HGET', KEYS[2], field) or '0') <= now then
    redis.call('HSET', KEYS[2], field, now + tonumber(ARGV[3]))
    out(w, now)
    sent = sent + 1
  end
end
if redis.call('ZCARD', KEYS[3]) == 0 then
  redis.call('HDEL', KEYS[2], 'm:' .. model)
  for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
    local rest = string.sub(field, 3)
    local cut = string.find(rest, ':', 1, true)
    if string.sub(field, 1, 2) == 'p:' and cut and string.sub(rest, cut + 1) == model then
      redis.call('HDEL', KEYS[2], field)
    end
  end
end
return sent
"""
