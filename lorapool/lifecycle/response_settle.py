"""A background response's one-way status change (``gateway/responses_background.py``).

A background response is written by two parties that may race: the gateway watching
its job (``in_progress``, then the final response) and ``POST /v1/responses/{id}/cancel``
(``cancelled``), on any replica. ``SETTLE`` replaces the stored record only while its
response is still ``queued`` or ``in_progress``, so a response that has ended
(completed, incomplete, failed or cancelled) is never rewritten: the first ending wins.
"""

from __future__ import annotations

from lorapool.connection import register_script

PENDING = ("queued", "in_progress")

# KEYS: the response's key (Keys.response). ARGV: the new record (orjson {response, ...}).
# Returns 1 when written; 0 when the key is gone or its response has ended. The key
# keeps its expiry (counted from the response's creation).
SETTLE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local status = cjson.decode(raw)['response']['status']
if status ~= 'queued' and status ~= 'in_progress' then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
return 1
"""


class Settle:
    """``SETTLE`` on an asyncio client: ``await settle(key, record) -> bool``."""

    def __init__(self, connection):
        self._script = register_script(connection, SETTLE)

    async def __call__(self, key: str, record: bytes) -> bool:
        return bool(await self._script(keys=[key], args=[record]))
