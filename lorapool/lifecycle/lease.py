"""A worker's hold on the entries it runs: fenced lease renewal (RENEW), the abort flags
read with it, and taking over entries whose worker stopped renewing (XAUTOCLAIM), with
their chunk logs to resume from.

When to renew and when to claim is the worker's policy (``lorapool.worker``); what a
renewal or a claim does to Redis is here.
"""

from __future__ import annotations

import orjson

from lorapool.connection import register_script
from lorapool.lifecycle.keys import WORKERS_GROUP, Keys
from lorapool.records.chunk import Chunk, decode_chunk
from lorapool.records.job import DATA

_DATA = DATA.encode()

# KEYS: each entry's stream. ARGV: group, consumer, idle_ms (0: renew), the entry ids
# (one per key). Resets the idle time of the entries this consumer still owns; returns
# {the positions (1-based) of those another consumer took, of those that vanished}.
# Vanished: pending to no one (the entry trimmed or deleted and then dropped from the
# group by a claim, the group destroyed or reset, the stream deleted), or still pending
# here while its entry is gone from the stream (XTRIM, XDEL): an operator's doing,
# never another worker's, and its request must end visibly.
RENEW = """
local lost, vanished = {}, {}
for i = 1, #KEYS do
  local entry = ARGV[i + 3]
  local p = redis.pcall('XPENDING', KEYS[i], ARGV[1], entry, entry, 1)
  if p.err or #p == 0 then
    table.insert(vanished, i)
  elseif p[1][2] ~= ARGV[2] then
    table.insert(lost, i)
  elseif #redis.call('XRANGE', KEYS[i], entry, entry) == 0 then
    table.insert(vanished, i)
  else
    redis.call('XCLAIM', KEYS[i], ARGV[1], ARGV[2], 0, entry, 'IDLE', ARGV[3], 'JUSTID')
  end
end
return {lost, vanished}
"""


class Renew:
    """``renew(consumer, idle_ms, streams, entry_ids)``: RENEW of entries of one shard
    (each with its stream); the positions (0-based) of those another consumer took, and
    of those that vanished."""

    def __init__(self, connection):
        self._script = register_script(connection, RENEW)

    def __call__(
        self, consumer: str, idle_ms: int, streams: list[str], entry_ids: list[str]
    ) -> tuple[list[int], list[int]]:
        lost, vanished = self._script(
            keys=streams, args=[WORKERS_GROUP, consumer, idle_ms, *entry_ids]
        )
        return [int(i) - 1 for i in lost], [int(i) - 1 for i in vanished]


def abort_flags(connection, keys: Keys, request_ids: list[str]) -> list:
    """The abort flag of each request (None: not asked), in one MGET (one shard's)."""
    return connection.mget([keys.abort(rid) for rid in request_ids])


def claim_idle(
    connection, stream: str, consumer: str, min_idle_ms: int, count: int
) -> list[tuple[str, dict]]:
    """Up to ``count`` entries of ``stream`` idle past ``min_idle_ms``, claimed for
    ``consumer`` (XAUTOCLAIM): (entry id, fields) of each, deleted ones left out."""
    reply = connection.xautoclaim(
        stream, WORKERS_GROUP, consumer, min_idle_time=min_idle_ms, start_id="0-0", count=count
    )
    return [(entry_id.decode(), fields) for entry_id, fields in reply[1] if fields]


def deliveries(connection, stream: str, entry_id: str) -> int:
    """How many times the group delivered the entry (0: not pending)."""
    info = connection.xpending_range(stream, WORKERS_GROUP, min=entry_id, max=entry_id, count=1)
    return info[0]["times_delivered"] if info else 0


def read_log(connection, keys: Keys, fields: dict) -> list[Chunk]:
    """The chunks already in the chunk log of the entry with ``fields`` (on the shard of
    ``keys``), to resume from; empty when the entry or its log cannot be decoded."""
    try:
        rid = orjson.loads(fields.get(_DATA))["request_id"]
        return [decode_chunk(raw, rid) for raw in connection.lrange(keys.out(rid), 0, -1)]
    except (ValueError, KeyError, TypeError):
        return []
