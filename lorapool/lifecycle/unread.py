"""A queued job whose entry an operator removed before any worker read it (``XTRIM``,
``XDEL``, a consumer group destroyed and re-created at ``$``, ``DEL`` of the stream):
no worker will ever run it, so its readers ask the workers to end it (issues 31 and 48).

A reader that has had nothing from a request yet asks ``END_UNREAD`` on each quiet
poll of its log (at most once per ``ASK_EVERY_S``). The script writes nothing but the
request's id on its shard's ``unread-ended`` list, and only if, at that instant, no
worker ended the request (its run key, ``lifecycle/run_state.py``), it has no chunk log
(no worker wrote for it), no worker holds its entry (in no job stream's pending list)
and no worker can read it (the entry is gone from its stream, or the group delivered
past it). A worker's upkeep takes the ids from there (every second), checks each again
on what only workers write, and ends it itself (``worker/unread_audit.py``): a final
error record in the run key, which every reader of the request gets at its next poll
as one final chunk with ``finish_reason`` "error" naming the cause, and the signed audit
record, both in one atomic call. Readers may not write the run key nor the audit
stream (docs/redis-acl.md): what ends a request and what the trail says of it are the
workers'. With no worker alive, a reader waits for its final record as for any queued
job (its ``timeout``), asking again now and then.

The same script asks for a request a killed worker had begun whose entry is gone
(``lifecycle/orphaned.py``).
"""

from __future__ import annotations

import logging
import time

from lorapool.connection import is_async_client, register_script
from lorapool.lifecycle.chunk_log import encode_result
from lorapool.lifecycle.keys import PRIORITIES, WORKERS_GROUP, Keys
from lorapool.outputs import RequestMetrics
from lorapool.records.chunk import Chunk, Delta
from lorapool.records.error_kind import ErrorKind

logger = logging.getLogger(__name__)
# What a worker found when it ended a request (its run key's ``cause``), as the audit
# record and the worker's log line say it
CAUSES = {
    "entry": "its entry was gone from its job stream (XTRIM or XDEL)",
    "stream": "its job stream no longer existed (DEL of the stream)",
    "stream-type": "its job stream key held another type (SET of the stream key)",
    "group": (
        "its entry was behind the consumer group's last delivered id, held by no worker "
        "(XGROUP SETID, or the group destroyed and re-created at $)"
    ),
}
REASON = (
    "its queue entry was removed before any worker read it (an operator's XTRIM, XDEL, "
    "XGROUP DESTROY/SETID or DEL of the job stream; see README, operator commands): it "
    "was never run; submit it again"
)

ASK_EVERY_S = 5.0  # a reader asks again for a request at most this often
# KEYS: the job's marker, then its shard's job streams (``Keys.streams``).
# ARGV: group, its run key (only read), its chunk log (only read), the shard's ended list
# (``Keys.unread_ended``, only pushed to), the request id, the log it must have ('0':
# none; 'check': one not ending in a final chunk, ``lifecycle.orphaned``), then the
# priorities in the streams' order (a marker without one: the first). The run key, the
# log and the list are named here, not in KEYS, for Redis checks a script's declared keys
# as read and written, and readers' ACL users may only read the first two and only push
# to the list; all are in the marker's slot.
# Returns 0 (left alone: ended by a worker, no entry known, a log exists (or not the one
# asked), pending to a worker, or still to be read), else 1 (the id pushed) or 2 (the list
# holds another type than a list: nothing pushed). Read-only but the RPUSH.
END_UNREAD = """
local function field(key, name)  -- HGET (readers' users have no HMGET); nil: not a hash
  local value = redis.pcall('HGET', key, name)
  if type(value) == 'table' then return nil end
  return value
end
local ran = redis.pcall('HGET', ARGV[2], 'status')
if type(ran) ~= 'boolean' then return 0 end  -- ended, or not a hash
local entry = field(ARGV[2], 'entry') or field(KEYS[1], 'entry')
local priority = field(KEYS[1], 'priority') or ARGV[7]
if not entry or not string.match(entry, '^%d+%-%d+$') then return 0 end
if ARGV[6] == '0' then
  if redis.call('EXISTS', ARGV[3]) == 1 then return 0 end  -- a worker wrote for it
else  -- a run stopped partway: a log not ending in a final chunk
  local last = redis.pcall('LRANGE', ARGV[3], -1, -1)
  if last.err or #last == 0 then return 0 end
  local ok, record = pcall(cjson.decode, last[1])
  if ok and type(record) == 'table' and record['f'] == 1 then return 0 end
end
for i = 2, #KEYS do  -- pending in any job stream: held
  local p = redis.pcall('XPENDING', KEYS[i], ARGV[1], entry, entry, 1)
  if p.err == nil and #p > 0 then return 0 end
  -- no group is no holder; any other refusal (an ACL without XPENDING) tells nothing
  if p.err ~= nil and not string.find(p.err, 'NOGROUP', 1, true)
     and not string.find(p.err, 'WRONGTYPE', 1, true) then return 0 end
end
local stream = KEYS[2]
for i = 7, #ARGV do
  if ARGV[i] == priority then stream = KEYS[i - 5] end
end
local found = redis.pcall('XRANGE', stream, entry, entry)
if found.err == nil and #found > 0 then
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
local pushed = redis.pcall('RPUSH', ARGV[4], ARGV[5])
if type(pushed) == 'table' and pushed.err then
  if not string.find(pushed.err, 'WRONGTYPE', 1, true) then return redis.error_reply(pushed.err) end
  return 2
end
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
    """``end(request_id, log)``: ``END_UNREAD`` for one request (awaitable on a
    redis.asyncio client): 1 when this call asked the workers to end it (logged by the
    caller), 2 when it could not (the list holds another type), else 0. A request asked
    for in the last ``ASK_EVERY_S`` is not asked again (0, no call): with no worker
    alive, the list grows by one id per waiting reader every few seconds, not per poll.
    """

    def __init__(self, connection, keys: Keys):
        self.keys = keys
        self._script = register_script(connection, END_UNREAD)
        self._asked: dict[str, float] = {}
        self._async = is_async_client(connection)

    def __call__(self, request_id: str, log: str = "0"):
        """``log``: '0' for a request with no log, 'check' for one a run began
        (``lifecycle.orphaned``)."""
        now = time.monotonic()
        if now - self._asked.get(request_id, -ASK_EVERY_S) < ASK_EVERY_S:
            return _zero() if self._async else 0
        if len(self._asked) > 10_000:
            self._asked = {r: t for r, t in self._asked.items() if now - t < ASK_EVERY_S}
        keys = self.keys.for_request(request_id)
        reply = self._script(
            keys=[keys.job(request_id), *keys.streams],
            args=[
                WORKERS_GROUP,
                keys.run(request_id),
                keys.out(request_id),
                keys.unread_ended,
                request_id,
                log,
                *PRIORITIES,
            ],
        )
        if self._async:
            return self._asked_async(request_id, reply)
        return self._note(request_id, reply)

    def _note(self, request_id: str, reply: int) -> int:
        if reply == 1:
            self._asked[request_id] = time.monotonic()
        return reply

    async def _asked_async(self, request_id: str, reply) -> int:
        return self._note(request_id, await reply)


async def _zero() -> int:
    return 0


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
    """The log line of a reader that asked the workers to end a request (``EndUnread``
    returned ``ended``: 1, or 2 when its id could not be pushed) for ``reason``."""
    if ended == 2:
        logger.error(
            "request %s: %s, but the pool's unread-ended key holds another type than a "
            "list: no worker can end it (delete the key; docs/redis-acl.md)",
            request_id,
            reason,
        )
        return
    logger.warning("request %s: %s; asked the workers to end it", request_id, reason)
