"""Where a queued job stands: how many entries of the request stream no worker has
taken yet are ahead of it.

Read in Redis, in one script: the job's entry id (its hash's ``entry``, set at submit),
the ``workers`` group's last-delivered id (``XINFO GROUPS``), then the entries between
the two, at most ``MAX_AHEAD``. Redis has no count of a stream's range short of reading
it, so the cost grows with the position: past ``MAX_AHEAD`` the job's position is not
given (its backlog still is). Streams give ids in order, and a consumer group delivers
them in that order, so the entries after the last delivered one and before the job's
are exactly those ahead of it. A job of the batch stream gets none: workers read it
only with capacity the request stream leaves, so no count of entries places it.
"""

from __future__ import annotations

from lorapool.connection import register_script
from lorapool.lifecycle.keys import WORKERS_GROUP

MAX_AHEAD = 1000

# KEYS: job hash, request stream. ARGV: group, MAX_AHEAD.
# Returns -1: unknown entry or already delivered; -2: more than MAX_AHEAD ahead;
# else the number of undelivered entries ahead of the job.
POSITION_SCRIPT = """
local entry = redis.call('HGET', KEYS[1], 'entry')
if not entry then return -1 end
local start = '-'
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
  local fields = {}
  for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
  if fields['name'] == ARGV[1] then start = '(' .. fields['last-delivered-id'] end
end
local limit = tonumber(ARGV[2])
local range = redis.call('XRANGE', KEYS[2], start, entry, 'COUNT', limit + 1)
if #range == 0 or range[#range][1] ~= entry then
  if #range > limit then return -2 end
  return -1
end
return #range - 1
"""


class QueuePosition:
    """``await position(request_id)``: the job's place in the queue (0: next to be
    taken), or None when it is not waiting there or more than ``MAX_AHEAD`` are ahead."""

    def __init__(self, redis, keys):
        self.keys = keys
        self.script = register_script(redis, POSITION_SCRIPT)

    async def __call__(self, request_id: str) -> int | None:
        keys = [self.keys.job(request_id), self.keys.for_request(request_id).requests]
        ahead = await self.script(keys=keys, args=[WORKERS_GROUP, MAX_AHEAD])
        return None if ahead < 0 else int(ahead)
