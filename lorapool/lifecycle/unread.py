"""A queued job whose entry an operator removed before any worker read it (``XTRIM``,
``XDEL``, a consumer group destroyed and re-created at ``$``, ``DEL`` of the stream):
no worker will ever run it, so its readers end it (issue 31 Build 2).

A reader that has had nothing from a request yet asks ``END_UNREAD`` on each quiet
poll of its log. The script ends the request only if, at that instant, its marker still
says ``queued``, it has no chunk log (no worker wrote for it), no worker holds its entry
(not in the group's pending list) and no worker can read it (the entry is gone from its
stream, or the group delivered past it). Then it stores a final error record in the
marker and marks it ``failed``, as a compacted run does: every reader of the request
(this one at once, the others at their next poll) gets one final chunk with
``finish_reason`` "error" naming the cause. A worker that took the entry after all (a
group re-created at ``0``) finds the marker answered and writes nothing.

Its audit record (finish_reason "error", the same error) is a worker's to write: the
audit trail holds what workers sign with their key, which readers do not hold, and the
producer and gateway roles may not write the audit stream (docs/redis-acl.md). So the
script also flags the marker (``unread``: when it ended it) and pushes the request id
on its shard's ``unread-ended`` list, the one key of the workers' that readers may
write (push only); a worker's upkeep takes the ids from there, checks each again and
writes one signed record each (``worker/unread_audit.py``). A request ends once: the
script re-checks all of the above atomically, and a second call finds it failed.

The same script ends a request a killed worker had begun whose entry is gone, given
the log as its reader read it (``lifecycle/orphaned.py``).
"""

from __future__ import annotations

import logging
import time

from lorapool.connection import register_script
from lorapool.lifecycle.chunk import Chunk, Delta
from lorapool.lifecycle.chunk_log import encode_result
from lorapool.lifecycle.error_kind import ErrorKind
from lorapool.lifecycle.keys import PRIORITIES, WORKERS_GROUP, Keys
from lorapool.outputs import RequestMetrics

logger = logging.getLogger(__name__)
# What END_UNREAD found (the marker's ``unread_cause``), as the audit record and the
# worker's log line say it
CAUSES = {
    "entry": "its entry was gone from its job stream (XTRIM or XDEL)",
    "stream": "its job stream no longer existed (DEL of the stream)",
    "stream-type": "its job stream key held another type (SET of the stream key)",
    "group": (
        "its entry was behind the consumer group's last delivered id, held by no worker "
        "(XGROUP SETID, or the group destroyed and re-created at $)"
    ),
}
RESULT_TTL_S = 24 * 3600  # the ended marker's TTL: the workers' default --result-ttl
REASON = (
    "its queue entry was removed before any worker read it (an operator's XTRIM, XDEL, "
    "XGROUP DESTROY/SETID or DEL of the job stream; see README, operator commands): it "
    "was never run; submit it again"
)

# KEYS: the job's marker, then its shard's job streams (``Keys.streams``).
# ARGV: group, the final record, its TTL (s), the job's chunk log (only read), the
# shard's ended list (``Keys.unread_ended``, only pushed to), the request id, the time,
# the log it must have ('0': none; n: n chunks, the last not final, ``lifecycle.orphaned``;
# 'check': any such log, and nothing written: -1 where it would end it), then the
# priorities in the streams' order (a marker without one: the first). The log
# and the list are named here, not in KEYS, for Redis checks a script's declared keys as
# read and written, and readers' ACL users may only read logs and only push to the list;
# both are in the marker's slot.
# Returns 0 (left alone: not queued, not a hash, a log exists (or not the one asked),
# pending to a worker, or still to be read), else 1 (ended: the marker failed with the
# record, the id pushed)
# or 2 (ended, but the list holds another type than a list: no audit record).
# Read-only until every check has passed; RPUSH, HSET and EXPIRE then. The marker keeps
# what was found (``unread_cause``, one of ``CAUSES``) for the audit record, and for a
# run stopped partway its log's length (``unread_log``).
END_UNREAD = """
local status = redis.pcall('HGET', KEYS[1], 'status')
if type(status) ~= 'string' or status ~= 'queued' then return 0 end
local entry = redis.call('HGET', KEYS[1], 'entry')
local priority = redis.call('HGET', KEYS[1], 'priority') or ARGV[9]
if not entry or not string.match(entry, '^%d+%-%d+$') then return 0 end
local expect = ARGV[8]
if expect == '0' then
  if redis.call('EXISTS', ARGV[4]) == 1 then return 0 end  -- a worker wrote for it
else  -- a run stopped partway: a log of ARGV[8] chunks (any: 'check') not ending final
  local last = redis.pcall('LRANGE', ARGV[4], -1, -1)
  if last.err or #last == 0 then return 0 end
  local ok, record = pcall(cjson.decode, last[1])
  if ok and type(record) == 'table' and record['f'] == 1 then return 0 end
  if expect ~= 'check' then  -- no chunk since the reader read it (LRANGE: its ACL's)
    local n = tonumber(expect)
    if #redis.call('LRANGE', ARGV[4], n, n) > 0 then return 0 end
    if #redis.call('LRANGE', ARGV[4], n - 1, n - 1) == 0 then return 0 end
  end
end
local stream = KEYS[2]
for i = 9, #ARGV do
  if ARGV[i] == priority then stream = KEYS[i - 7] end
end
-- a stream key of another type (an operator's SET): the queue and the entry are gone
local found = redis.pcall('XRANGE', stream, entry, entry)
local cause = 'stream-type'  -- what was found, for the workers' audit record
if found.err == nil then
  cause = 'group'
  if #found == 0 then cause = redis.call('EXISTS', stream) == 1 and 'entry' or 'stream' end
  local p = redis.pcall('XPENDING', stream, ARGV[1], entry, entry, 1)
  if p.err == nil and #p > 0 then return 0 end  -- a worker holds it
  -- no group is no holder; any other refusal (an ACL without XPENDING) tells nothing
  if p.err ~= nil and not string.find(p.err, 'NOGROUP', 1, true) then return 0 end
  if #found > 0 then
    local delivered = nil
    for _, fields in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local info = {}
      for j = 1, #fields, 2 do info[fields[j]] = fields[j + 1] end
      if info['name'] == ARGV[1] then delivered = info['last-delivered-id'] end
    end
    -- no group: workers make it again reading from the start, so it will be read
    if not delivered then return 0 end
    local ems, eseq = string.match(entry, '^(%d+)%-(%d+)$')
    local dms, dseq = string.match(delivered, '^(%d+)%-(%d+)$')
    ems, eseq, dms, dseq = tonumber(ems), tonumber(eseq), tonumber(dms), tonumber(dseq)
    if ems > dms or (ems == dms and eseq > dseq) then return 0 end  -- still to be read
  end
end
if expect == 'check' then return -1 end
-- the push first: a user whose ACL refuses it (rules older than the doc's) writes
-- nothing; a list key of another type (a producer's SET) loses the audit record only
local pushed = redis.pcall('RPUSH', ARGV[5], ARGV[6])
if type(pushed) == 'table' and pushed.err then
  if not string.find(pushed.err, 'WRONGTYPE', 1, true) then return redis.error_reply(pushed.err) end
  pushed = nil
end
redis.call('HSET', KEYS[1], 'status', 'failed', 'result', ARGV[2], 'unread', ARGV[7],
           'unread_cause', cause)
if expect ~= '0' then redis.call('HSET', KEYS[1], 'unread_log', expect) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if pushed == nil then return 2 end
return 1
"""


def unread_record(request_id: str, reason: str) -> bytes:
    """The final record of a request that never ran: one completion (index 0) with
    ``finish_reason`` "error" and no tokens, and ``reason`` as the request's error."""
    now = time.time()
    chunk = Chunk(
        request_id=request_id,
        seq=0,
        outputs=[Delta(text="", token_ids=[], finish_reason="error")],
        finished=True,
        metrics=RequestMetrics(arrival_time=now, finished_time=now),
        error=reason,
        error_kind=ErrorKind.REMOVED,
    )
    return encode_result(chunk)


class EndUnread:
    """``end(request_id)``: ``END_UNREAD`` for one request (awaitable on a redis.asyncio
    client): 1 when this call ended it (logged as a warning by the caller), else 0."""

    def __init__(self, connection, keys: Keys):
        self.keys = keys
        self._script = register_script(connection, END_UNREAD)

    def __call__(self, request_id: str, log: int | str = 0, record: bytes | None = None):
        """``log``/``record``: a run stopped partway (``lifecycle.orphaned``)."""
        keys = self.keys.for_request(request_id)
        return self._script(
            keys=[keys.job(request_id), *keys.streams],
            args=[
                WORKERS_GROUP,
                record or (b"" if log == "check" else unread_record(request_id, REASON)),
                RESULT_TTL_S,
                keys.out(request_id),
                keys.unread_ended,
                request_id,
                time.time(),
                log,
                *PRIORITIES,
            ],
        )


_refusals = [0]  # how many refusals this process has had (the first is a warning)


def log_refused(request_id: str, exc: Exception) -> None:
    """The log line of a reader whose Redis user may not run ``END_UNREAD`` (ACL rules
    older than docs/redis-acl.md's): it wrote nothing, and the reader waits as before.
    A warning the first time in a process, then at debug level (readers poll often)."""
    _refusals[0] += 1
    logger.log(
        logging.WARNING if _refusals[0] == 1 else logging.DEBUG,
        "request %s: could not check whether its queue entry was removed unread (%s); "
        "its reader's Redis user needs the rules of docs/redis-acl.md",
        request_id,
        exc,
    )


def log_ended(request_id: str, ended: int = 1, reason: str = REASON) -> None:
    """The log line of a request a reader ended (``EndUnread`` returned ``ended``: 1, or
    2 when its id could not be pushed for the workers' audit record) for ``reason``."""
    logger.warning("request %s ended: %s", request_id, reason)
    if ended == 2:
        logger.error(
            "request %s: no audit record will be written for it: the pool's unread-ended "
            "key holds another type than a list (delete it; docs/redis-acl.md)",
            request_id,
        )
