"""How entries reach a worker: READ (the entries peers handed to it, then new ones, no
more than its fair share) and HANDOFF (an entry given to a peer, adapter affinity).

Which entries to read and to whom to hand one is the worker's policy
(``lorapool.worker.intake``); what a read or a handoff does to Redis is here. Each call
touches one shard's streams and handoff lists.
"""

from __future__ import annotations

from lorapool.connection import register_script
from lorapool.lifecycle.keys import WORKERS_GROUP, Keys

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


class Read:
    """``read(keys, consumer, count, live, held, room)``: one READ of the streams of the
    shard of ``keys`` (see the script); each entry as (its stream, entry id, fields,
    handed), in the order read."""

    def __init__(self, connection):
        self._script = register_script(connection, READ)

    def __call__(
        self, keys: Keys, consumer: str, count: int, live: int, held: int, room: int
    ) -> list[tuple[str, bytes, dict, bool]]:
        streams = keys.streams
        reply = self._script(
            keys=[*streams, keys.handoff(consumer)],
            args=[WORKERS_GROUP, consumer, count, live, held, room],
        )
        return [
            (streams[index - 1], entry_id, dict(zip(fields[::2], fields[1::2])), bool(handed))
            for index, entry_id, fields, handed in reply
        ]


class Handoff:
    """``handoff(keys, consumer, list_ttl_s, items)``: HANDOFF of ``items`` (stream ('':
    the interactive one), entry id, peer), all of the shard of ``keys``; how many went."""

    def __init__(self, connection):
        self._script = register_script(connection, HANDOFF)

    def __call__(
        self, keys: Keys, consumer: str, list_ttl_s: int, items: list[tuple[str, str, str]]
    ) -> int:
        streams = list(keys.streams)
        call_keys, args = [], [WORKERS_GROUP, consumer, list_ttl_s]
        for stream, entry_id, peer in items:
            stream = stream or keys.requests
            call_keys += [stream, keys.handoff(peer)]
            args += [entry_id, streams.index(stream) + 1, peer]
        return self._script(keys=call_keys, args=args)
