"""The safe trim of a job stream: only the entries every worker is done with.

An operator's ``XTRIM ... MAXLEN`` removes entries that are queued or running as well
(issue 31 row B: their requests then end with an error, or, queued, are never run).
``SAFE_TRIM`` removes only what lies before the oldest pending entry (none pending: up
to the last delivered one), as APPEND does after each final, so the group's lag, the
autoscaling signal, stays known. ``lorapool trim`` runs it on every stream of the pool.
"""

from __future__ import annotations

from lorapool.connection import register_script
from lorapool.lifecycle.keys import WORKERS_GROUP, Keys

# KEYS: a job stream. ARGV: the group. Returns how many entries were removed (0: the
# stream or its group does not exist).
SAFE_TRIM = """
local summary = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if summary.err then return 0 end
local minid = summary[2]
if not minid then
  for _, fields in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local info = {}
    for j = 1, #fields, 2 do info[fields[j]] = fields[j + 1] end
    if info['name'] == ARGV[1] then
      local ms, seq = string.match(info['last-delivered-id'], '(%d+)-(%d+)')
      minid = ms .. '-' .. string.format('%d', tonumber(seq) + 1)
    end
  end
end
if not minid then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', '=', minid)
"""


def safe_trim(connection, keys: Keys) -> dict[str, int]:
    """``SAFE_TRIM`` on every job stream of every shard: {stream: entries removed}."""
    script = register_script(connection, SAFE_TRIM)
    return {
        stream: int(script(keys=[stream], args=[WORKERS_GROUP]))
        for view in keys.shard_views
        for stream in view.streams
    }
