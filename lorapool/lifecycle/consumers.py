"""The consumers of the ``workers`` group that hold nothing and have been quiet: found,
and deleted only while they hold nothing.

Each worker process is a consumer of its own (``name#incarnation``,
``lorapool.worker.state``), so every process that dies leaves one behind: XINFO
CONSUMERS grows with each restart. XGROUP DELCONSUMER removes a consumer together with
its pending entries, which no one could claim again, so the deletion checks, in the
script that deletes, that the consumer holds none. Which consumers are safe to ask
about (their liveness flags, the idle bound) is the worker's policy
(``lorapool.worker.consumers``).
"""

from __future__ import annotations

from lorapool.connection import register_script
from lorapool.lifecycle.keys import WORKERS_GROUP

# KEYS: the stream. ARGV: the group, then consumer names. Deletes each named consumer
# that holds no pending entry of the stream now (XPENDING's form for one consumer) and
# returns the names it deleted. One that holds entries stays: the lease path claims them
# first (XAUTOCLAIM), and a later call deletes it.
DELETE_IDLE = """
local deleted = {}
for i = 2, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i]) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
    table.insert(deleted, ARGV[i])
  end
end
return deleted
"""


def quiet_consumers(connection, stream: str, min_idle_ms: int) -> list[str]:
    """The consumers of ``stream``'s ``workers`` group with no pending entry that have
    not read, claimed or renewed for ``min_idle_ms`` (XINFO CONSUMERS' ``idle``)."""
    return [
        c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
        for c in connection.xinfo_consumers(stream, WORKERS_GROUP)
        if c["pending"] == 0 and c["idle"] >= min_idle_ms
    ]


class DeleteIdle:
    """``delete_idle(stream, consumers)``: DELETE_IDLE; the names it deleted."""

    def __init__(self, connection):
        self._script = register_script(connection, DELETE_IDLE)

    def __call__(self, stream: str, consumers: list[str]) -> list[str]:
        if not consumers:
            return []
        deleted = self._script(keys=[stream], args=[WORKERS_GROUP, *consumers])
        return [name.decode() if isinstance(name, bytes) else name for name in deleted]
