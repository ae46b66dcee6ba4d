"""Who writes what of a job (issue 48 Build 1): the submission and the run, in two keys.

A job's marker (``Keys.job``) is its submission: SUBMIT writes it (``status`` queued,
``entry``, ``submitted``, ``priority``, ``output_kind``, ``on_finish``) and every role
that submits may write it, so nothing a worker writes, a reader is told or an audit
record says is taken from it (its entry only tells a worker where to look for a job no
worker took: ``worker/unread_audit.py``). Its run (``Keys.run``) is the
workers' alone (docs/redis-acl.md: producers, the gateway and the RQ workers may read
it, never write it): the entry a worker took it from, claimed by the run's first chunk;
at its end its ``status`` and final record (``result``); for a request a worker ended
for its readers (``lifecycle/unread.py``), when (``ended``) and why (``cause``).

The two hashes' fields and ``JobStatus`` are typed in ``records.marker``; this module
is what is done to Redis with them (the layout's move). The Lua scripts' literals are
checked against that record (tests/unit/test_job_status.py).

The first layout kept the run in the marker. A pool moves once (``migrate``, the first
worker of this version to start): the status and final record of each finished marker
go to its run key, and ``Keys.layout`` says '2'; later writes to markers are never read
again. Markers a reader of the first layout ended unread (``unread``) are left as
they are: their ids are on the ended list, and a worker ends them again, as this
layout does (``worker/unread_audit.py``).
"""

from __future__ import annotations

import logging

from lorapool.connection import register_script
from lorapool.lifecycle.keys import Keys

logger = logging.getLogger(__name__)
LAYOUT = "2"


# KEYS: a marker of the first layout, its run key. ARGV: none.
# Returns 1 when it moved the marker's status and final record to the run key (which
# expires with the marker), else 0 (not a hash, no final record, ended unread, or the
# run key exists).
MIGRATE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local m = redis.pcall('HMGET', KEYS[1], 'status', 'result', 'entry', 'unread')
if m.err or not m[2] or m[4] then return 0 end
if m[1] ~= 'finished' and m[1] ~= 'failed' then return 0 end
redis.call('HSET', KEYS[2], 'status', m[1], 'result', m[2])
if m[3] then redis.call('HSET', KEYS[2], 'entry', m[3]) end
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
return 1
"""


def marker_pattern(keys: Keys) -> str:
    """A SCAN pattern of every job marker of the pool (either layout of shards)."""
    if keys.shards:
        return f"{{{keys.prefix}:*}}:job:*"
    return f"{keys.prefix}:job:*"


def request_id_of(keys: Keys, marker: str) -> str:
    """The request id of a marker's key name (``Keys.job``)."""
    rid = marker.split(":job:", 1)[1]
    return rid[1:-1] if not keys.shards else rid


def migrate(connection, keys: Keys) -> int:
    """Move the pool's markers of the first layout to this one, once (see above): the
    number of runs moved. A worker calls it at start; a second worker finds the layout
    key and returns 0 at once."""
    if connection.get(keys.layout) == LAYOUT.encode():
        return 0
    script, moved = register_script(connection, MIGRATE), 0
    for raw in connection.scan_iter(match=marker_pattern(keys), count=1000):
        marker = raw.decode("utf-8", "surrogateescape")
        rid = request_id_of(keys, marker)
        if keys.job(rid) == marker:
            moved += script(keys=[marker, keys.run(rid)])
    connection.set(keys.layout, LAYOUT)
    if moved:
        logger.warning("moved the final records of %s jobs to their run keys (layout 2)", moved)
    return moved
