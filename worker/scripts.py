"""Lua scripts of the worker: fenced chunk appends and fenced lease renewal.

Fencing: a worker writes for an entry only while XPENDING names it as the
entry's consumer. Another worker that claims the entry (XAUTOCLAIM) takes that
name away, so a paused worker that wakes up can neither append nor renew.
Chunk log entry ids are ``0-<seq + 1>``, and an append whose seq is not past
the log's last one is refused, so a log never holds a duplicate or a gap-filler
out of order.
"""

# KEYS: requests, out, abort, job, audit, dead
# ARGV: group, entry, consumer, seq (-1: no chunk), chunk, final (0/1), audit ('' none),
#       ttl, dead ('' none), reason, dead stream's MAXLEN (approximate)
# Returns -1 (not the owner), -2 (seq already in the log), else 1 if abort is asked, 0.
APPEND = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then return -1 end
local seq = tonumber(ARGV[4])
if seq >= 0 then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if #last > 0 and tonumber(string.match(last[1][1], '-(%d+)$')) > seq then return -2 end
  redis.call('XADD', KEYS[2], '0-' .. (seq + 1), 'data', ARGV[5])
  redis.call('PUBLISH', KEYS[2], ARGV[5])
end
if ARGV[6] == '1' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[1], ARGV[2])
  if ARGV[7] ~= '' then redis.call('XADD', KEYS[5], '*', 'data', ARGV[7]) end
  if ARGV[9] ~= '' then
    redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[11], '*', 'data', ARGV[9],
               'reason', ARGV[10], 'entry', ARGV[2], 'worker', ARGV[3])
  end
  if seq >= 0 then
    redis.call('EXPIRE', KEYS[2], ARGV[8])
    redis.call('HSET', KEYS[4], 'status', ARGV[9] ~= '' and 'failed' or 'finished')
    redis.call('EXPIRE', KEYS[4], ARGV[8])
    redis.call('DEL', KEYS[3])
  end
  return 0
end
return redis.call('EXISTS', KEYS[3])
"""

# KEYS: requests. ARGV: group, consumer, idle_ms (0: renew), entry ids...
# Resets the idle time of the entries this consumer still owns; returns those it lost.
RENEW = """
local lost = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= ARGV[2] then
    table.insert(lost, ARGV[i])
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
  end
end
return lost
"""
