"""Lua scripts of the worker: fenced chunk appends and fenced lease renewal.

Fencing: a worker writes for an entry only while XPENDING names it as the
entry's consumer. Another worker that claims the entry (XAUTOCLAIM) takes that
name away, so a paused worker that wakes up can neither append nor renew.
Chunk log entry ids are ``0-<seq + 1>``, and an append whose seq is not past
the log's last one is refused (XADD refuses an id not above the stream's last;
no read of the log), so a log never holds a duplicate or a gap-filler out of
order.

Redis Cluster (``--shards N``, see ``lorapool.lifecycle.keys``): every key one call of these
scripts touches is on one shard, so on one slot: APPEND takes the items of one
shard (the publisher makes one call per shard a trip), RENEW the entries of one
shard, READ and HANDOFF one shard's streams and handoff lists; the producer's
SUBMIT the marker and the stream of the request's shard. On a cluster the scripts
run under ``#!lua`` (``connection.register_script``), which refuses a key of
another slot, and APPEND publishes with SPUBLISH (``append_script``).
"""

from typing import NamedTuple

from lorapool.lifecycle.keys import WORKERS_GROUP, Keys

NOT_OWNER, DUPLICATE = -1, -2  # APPEND's results besides 0 and 1 (abort asked)


class Append(NamedTuple):
    """One entry's part of an APPEND call: a chunk (seq -1: none), and at the end the ack,
    the audit record and (failed) the dead letter."""

    request_id: str  # "-" with seq -1: an entry whose request is unknown
    entry_id: str
    seq: int
    chunk: bytes
    final: bool
    audit: bytes = b""
    ttl_s: int = 0
    dead: bytes = b""
    reason: str = ""
    result: bytes = b""  # final: the whole output, kept in the job's hash
    stream: str = ""  # the stream the entry came from ('': the interactive one)


def append_call(
    keys: Keys, consumer: str, dead_max_len: int, log_grace_s: int, items: list[Append]
) -> dict:
    """The keys and args of one APPEND call for ``items`` (any number, one round trip)."""
    call_keys = [keys.audit, keys.dead]
    args: list = [WORKERS_GROUP, consumer, dead_max_len, log_grace_s]
    for item in items:
        rid = item.request_id
        call_keys += [item.stream or keys.requests, keys.out(rid), keys.abort(rid), keys.job(rid)]
        args += [item.entry_id, item.seq, item.chunk, int(item.final), item.audit, item.ttl_s]
        args += [item.dead, item.reason, item.result]
    return {"keys": call_keys, "args": args}


# KEYS: audit, dead, then per item: its stream, out, abort, job
# ARGV: group, consumer, dead stream's MAXLEN (approximate), the log's grace after the
#       final chunk (s), then per item: entry, seq (-1: no chunk), chunk, final (0/1),
#       audit ('' none), ttl, dead ('' none), reason, result (the whole output, final)
# Returns per item: -1 (not the owner), -2 (seq already in the log), else 1 if abort is
# asked, 0.
APPEND = """
-- XADD of a chunk: true, or false when the log already holds this seq (XADD refuses an
-- id not above the stream's last). Any other refusal (out of memory, a key that is not
-- a stream) fails the whole call, so the worker sends the trip again.
local function add_chunk(out, seq, chunk)
  local ok, err = pcall(redis.call, 'XADD', out, '0-' .. (seq + 1), 'data', chunk)
  if ok then return true end
  local text = type(err) == 'table' and err.err or tostring(err)
  if string.find(text, 'equal or smaller than the target stream top item', 1, true) then
    return false
  end
  return error(err)
end

-- Drops the entries every worker is done with from the head of the requests stream:
-- those before the oldest pending one (or, none pending, up to the last delivered).
-- XDEL of a finished entry instead would leave a tombstone at or past the group's
-- last-delivered id whenever a short request ends before a longer one taken earlier,
-- and Redis then reports the group's lag, the autoscaling signal, as unknown.
local function trim_done(stream, group)
  local minid = redis.call('XPENDING', stream, group)[2]
  if not minid then
    for _, fields in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local info = {}
      for j = 1, #fields, 2 do info[fields[j]] = fields[j + 1] end
      if info['name'] == group then
        local ms, seq = string.match(info['last-delivered-id'], '(%d+)-(%d+)')
        minid = ms .. '-' .. string.format('%d', tonumber(seq) + 1)
      end
    end
  end
  if minid then redis.call('XTRIM', stream, 'MINID', '=', minid) end
end

local results, finished = {}, {}
for i = 0, (#ARGV - 4) / 9 - 1 do
  local a, k = 4 + i * 9, 2 + i * 4
  local entry, seq, final = ARGV[a + 1], tonumber(ARGV[a + 2]), ARGV[a + 4] == '1'
  local audit, ttl, dead = ARGV[a + 5], ARGV[a + 6], ARGV[a + 7]
  local stream, out, abort, job = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local result = 0
  local p = redis.call('XPENDING', stream, ARGV[1], entry, entry, 1)
  if #p == 0 or p[1][2] ~= ARGV[2] then
    result = -1
  elseif seq >= 0 and not add_chunk(out, seq, ARGV[a + 3]) then
    result = -2
  else
    if seq >= 0 then
      redis.call('PUBLISH', out, ARGV[a + 3])
    end
    if final then
      redis.call('XACK', stream, ARGV[1], entry)
      finished[stream] = true
      if audit ~= '' then redis.call('XADD', KEYS[1], '*', 'data', audit) end
      if dead ~= '' then
        redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'data', dead,
                   'reason', ARGV[a + 8], 'entry', entry, 'worker', ARGV[2])
      end
      if seq >= 0 then
        -- compaction: the whole output in the job's hash; the log only for a grace,
        -- for readers following it
        redis.call('EXPIRE', out, math.min(tonumber(ttl), tonumber(ARGV[4])))
        redis.call('HSET', job, 'status', dead ~= '' and 'failed' or 'finished',
                   'result', ARGV[a + 9])
        redis.call('EXPIRE', job, ttl)
        redis.call('DEL', abort)
      end
    else
      result = redis.call('EXISTS', abort)
    end
  end
  results[i + 1] = result
end
for stream in pairs(finished) do trim_done(stream, ARGV[1]) end
return results
"""


def append_script(connection) -> str:
    """``APPEND`` for ``connection``: on a Redis Cluster it publishes each chunk on the
    request's shard channel (SPUBLISH: delivered only within the shard's nodes), else
    on its channel (PUBLISH)."""
    import redis

    if isinstance(connection, redis.RedisCluster):
        return APPEND.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")
    return APPEND


# KEYS: each entry's stream. ARGV: group, consumer, idle_ms (0: renew), the entry ids
# (one per key). Resets the idle time of the entries this consumer still owns; returns
# the positions (1-based) of those it lost.
RENEW = """
local lost = {}
for i = 1, #KEYS do
  local entry = ARGV[i + 3]
  local p = redis.call('XPENDING', KEYS[i], ARGV[1], entry, entry, 1)
  if #p == 0 or p[1][2] ~= ARGV[2] then
    table.insert(lost, i)
  else
    redis.call('XCLAIM', KEYS[i], ARGV[1], ARGV[2], 0, entry, 'IDLE', ARGV[3], 'JUSTID')
  end
end
return lost
"""

# KEYS: the job streams, first to last (``Keys.streams``), then this worker's handoff
# list. ARGV: group, consumer, count, live workers, entries this worker holds, how many
# the streams after the first may give (the batch jobs' room).
# First the entries peers handed to this worker (``HANDOFF``) that it still owns, all
# of them; then up to ``count`` new entries, each stream only with what the ones before
# left of it, and no more than this worker's fair share of the pool's work: the entries
# not yet read plus those pending, over the live workers, less what it holds (at least
# one). Returns {stream's position, id, fields, handed (0/1)}.
READ = """
local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local live, held, room = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local streams = #KEYS - 1
local read = {}
local handed = redis.call('LPOP', KEYS[#KEYS], 1000)
for _, item in ipairs(handed or {}) do
  local i, entry = string.match(item, '^(%d+) (%d+%-%d+)$')
  i = tonumber(i)
  if i and i >= 1 and i <= streams then
    local p = redis.call('XPENDING', KEYS[i], group, entry, entry, 1)
    if #p > 0 and p[1][2] == consumer then
      local e = redis.call('XRANGE', KEYS[i], entry, entry)
      if #e > 0 then table.insert(read, {i, e[1][1], e[1][2], 1}) end
    end
  end
end
if count > 0 and live > 1 then
  local work = 0
  for i = 1, streams do
    if redis.call('EXISTS', KEYS[i]) == 1 then
      for _, fields in ipairs(redis.call('XINFO', 'GROUPS', KEYS[i])) do
        local info = {}
        for j = 1, #fields, 2 do info[fields[j]] = fields[j + 1] end
        if info['name'] == group then
          -- lag unknown (an undelivered entry was deleted): count what is asked
          work = work + (info['lag'] or count) + info['pending']
        end
      end
    end
  end
  count = math.max(1, math.min(count, math.ceil(work / live) - held))
end
for i = 1, streams do
  local n = i == 1 and count or math.min(count, room)
  if n <= 0 then break end
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n,
                           'STREAMS', KEYS[i], '>')
  if reply then
    for _, entry in ipairs(reply[1][2]) do
      table.insert(read, {i, entry[1], entry[2], 0})
    end
    count = count - #reply[1][2]
    if i > 1 then room = room - #reply[1][2] end
  end
end
return read
"""

# KEYS: per entry, its stream and the peer's handoff list. ARGV: group, consumer, the
# lists' TTL (s), then per entry: its id, the stream's position, the peer.
# Gives each entry this worker still owns to the peer (XCLAIM, JUSTID: its delivery
# count stays) and tells the peer (RPUSH to its list); returns how many it gave.
HANDOFF = """
local given = 0
for i = 1, #KEYS / 2 do
  local stream, list = KEYS[2 * i - 1], KEYS[2 * i]
  local entry, position, peer = ARGV[3 * i + 1], ARGV[3 * i + 2], ARGV[3 * i + 3]
  local p = redis.call('XPENDING', stream, ARGV[1], entry, entry, 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', stream, ARGV[1], peer, 0, entry, 'JUSTID')
    redis.call('RPUSH', list, position .. ' ' .. entry)
    redis.call('EXPIRE', list, ARGV[3])
    given = given + 1
  end
end
return given
"""
