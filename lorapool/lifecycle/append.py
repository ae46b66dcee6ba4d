"""APPEND: a worker's fenced chunk appends, and at a request's end its final record,
ack, audit record and (failed) dead letter, all in one atomic call.

Fencing: a worker writes for an entry only while XPENDING names it as the entry's
consumer. Another worker that claims the entry (XAUTOCLAIM) takes that name away, so a
paused worker that wakes up can neither append nor renew. The consumer is the process's
(``name#incarnation``, ``worker/state.py``), not its ``--name``: a process restarted
under the name of a frozen one is another consumer, and the frozen one, woken, is
refused too. A chunk's index in its log
(a list) is its seq, and an append whose seq the log already holds is taken back (the
length RPUSH returns is past it; no read of the log), so a log never holds a duplicate
or a chunk out of order.

Redis Cluster (``--shards N``, see ``keys``): one call takes the items of one shard (the
publisher makes one call per shard a trip). On a cluster the script runs under
``#!lua`` (``connection.register_script``), which refuses a key of another slot, and
publishes with SPUBLISH (``append_script``).
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import orjson

from lorapool.connection import register_script
from lorapool.lifecycle.keys import WORKERS_GROUP, Keys

# APPEND's results besides 0 and 1 (abort asked): not the owner, seq already in the log,
# the log key holds another type than a list (nothing written for the item), and
# finished with the job's run key holding another type than a hash (an operator's; left
# alone: the whole output stays in the log, kept for the result's TTL)
# the request id is answered (its run key says finished or failed; no run key saying,
# its log ends in a final chunk) or another entry's (the run key names another entry: a
# duplicate XADD of a running request): nothing written, the worker acks this entry
# without output
# the entry is pending to no one (acked already, or removed under the worker by an
# operator: XTRIM, XDEL, a group destroyed, the stream deleted)
NOT_OWNER, DUPLICATE, BAD_LOG, ANSWERED, VANISHED, BAD_MARKER = -1, -2, -3, -4, -5, 2
# A chunk's fence on the job's run key (``Append.fence``): read it (results 0/1), read it
# and say whether this entry holds the run (NAMED added to 0/1: it claimed it, or had),
# or not read it again (this entry held the run at an append of this run: what could
# change it since is fenced by the pending list; see the script)
READ, ASK, SKIP = 0, 1, 2
NAMED = 3
# A run key a chunk claimed (only its ``entry``, until the run ends) expires this long
# after the claim: a worker that dies between claim and end, its entry then never run
# again (trimmed, deleted), leaves it no longer than a finished run's (the default
# result TTL). No run lasts that long: 128k tokens at 30 ms a step take about an hour.
# A run that did would lose only the guard against a second entry of its id.
CLAIMED_TTL_S = 24 * 3600


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
    vanished: bool = False  # final: its entry is pending to no one; written all the same
    fence: int = READ  # a chunk that is not final: READ, ASK or SKIP the marker


def append_call(
    keys: Keys,
    consumer: str,
    dead_max_len: int,
    log_grace_s: int,
    items: list[Append],
    claimed_ttl_s: int = CLAIMED_TTL_S,
) -> dict:
    """The keys and args of one APPEND call for ``items`` (any number, one round trip):
    the script's KEYS/ARGV contract (below), written out here only."""
    call_keys = [keys.audit, keys.dead]
    args: list = [WORKERS_GROUP, consumer, dead_max_len, log_grace_s, claimed_ttl_s]
    for item in items:
        rid = item.request_id
        stream = item.stream or keys.requests
        call_keys += [stream, keys.out(rid), keys.abort(rid), keys.job(rid), keys.run(rid)]
        flag = (2 if item.vanished else 1) if item.final else (0, 3, 4)[item.fence]
        args += [flag, item.entry_id, item.seq, item.chunk]
        if item.final:  # most items are not: 8 values a chunk instead of 13
            args += [item.audit, item.ttl_s, item.dead, item.reason, item.result]
    return {"keys": call_keys, "args": args}


# KEYS: audit, dead, then per item: its stream, out, abort, job (the submission: only
#       its TTL is set at the end), run (the workers' own: lifecycle/run_state.py)
# ARGV: group, consumer, dead stream's MAXLEN (approximate), the log's grace after the
#       final chunk (s), the TTL of a run key a chunk claims (s), then per item: its
#       kind (1: final; 2: final of an entry that vanished, written though it is
#       pending to no one; not final: 0 read the marker, 3 read it and add 3 to the
#       result when it names this entry, 4 do not read it),
#       entry, seq (-1: no chunk), chunk,
#       and when final: audit ('' none), ttl, dead ('' none), reason, result (the whole
#       output)
# Returns per item: -1 (another consumer owns it), -5 (pending to no one: acked, or
# removed by an operator), -2 (seq already in the log), -3 (the log key is
# not a list: nothing written), -4 (a chunk for a request id whose marker says it
# finished, or names another entry, or, no marker saying, whose log ends in a final
# chunk: nothing written), else 1 if abort is asked, 2
# (finished, the run key not a hash, an operator's: left alone), 0; plus 3 for a chunk
# of kind 3 or 4 whose run this entry holds.
# Who ran a request is the run key's (workers' only): the first chunk a run appends
# claims it (``entry``, the key expiring ``CLAIMED_TTL_S`` later unless the run ends
# first); every later chunk of another entry is refused (-4), and so is
# every chunk once the run key says the request ended. The marker (SUBMIT's) is never
# read: a producer may write any of its fields (rows A and B of issue 48), so of two
# entries of one id (a raw XADD of it) the one whose chunk comes first runs it.
# The run key is read for a chunk of kind 4 no more (a worker sends it once an append of
# this run found its entry there): only a final of this entry (this worker's, or, after
# a claim, another's: the pending list then refuses this one) or a worker's ending of an
# entry pending to no one (worker/unread_audit.py) ends it. So one HMGET a run, not one
# a chunk. So a duplicate entry cannot add a second final chunk or a second audit
# record. Where no run key says how the request stands (a job of the first layout, or
# one an operator deleted) the log's last chunk does: one that is final refuses the item (-4),
# and so does no log at all for the error final of an entry pending to no one (a worker
# woken past its lease cannot tell an operator's removal from another worker's finish
# when the marker and the log were deleted since: it must not audit the id again).
# Nothing it writes for an item comes before what could refuse it (a script's writes
# before an error stay): the log's and the marker's types are checked first, and a key
# of another type (a producer may write job and abort keys; anyone may have written
# the log) is that item's result, never an error of the whole call.
APPEND = """
-- RPUSH of a chunk: 1, or 0 when the log already holds this seq (a chunk's index in
-- the log is its seq), -3 when the log key holds another type (the RPUSH refused,
-- nothing written). A log shorter than seq (lost to a Redis that came back empty)
-- takes it all the same: readers wait for the missing seq until the final record,
-- which holds the whole output. Out of memory fails the whole call, so the worker
-- sends the trip again.
local function add_chunk(out, seq, chunk)
  local length = redis.pcall('RPUSH', out, chunk)
  if type(length) == 'table' then
    if string.find(length.err, 'WRONGTYPE', 1, true) then return -3 end
    return redis.error_reply(length.err)
  end
  if length <= seq + 1 then return 1 end
  redis.call('RPOP', out)  -- a trip sent again (rare): one command less for the rest
  return 0
end

-- Drops the entries every worker is done with from the head of the requests stream:
-- those before the oldest pending one (or, none pending, up to the last delivered).
-- XDEL of a finished entry instead would leave a tombstone at or past the group's
-- last-delivered id whenever a short request ends before a longer one taken earlier,
-- and Redis then reports the group's lag, the autoscaling signal, as unknown.
local function trim_done(stream, group)
  local summary = redis.pcall('XPENDING', stream, group)
  if summary.err then return end  -- the stream or its group is gone (an operator's)
  local minid = summary[2]
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

-- Whether the log's last chunk is a final one (no log, or not a list: no).
local function ends_final(out)
  local last = redis.pcall('LINDEX', out, -1)
  if type(last) ~= 'string' then return false end
  local ok, record = pcall(cjson.decode, last)
  return ok and type(record) == 'table' and record['f'] == 1
end

local results, finished = {}, {}
local a, k = 5, 2  -- the ARGV and KEYS read so far
local function ended(s) return s == 'finished' or s == 'failed' end
while a < #ARGV do
  local kind, entry, seq = ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  local final, vanished = kind == '1' or kind == '2', kind == '2'
  local named = kind == '4'
  local chunk, stream, out, abort = ARGV[a + 4], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local job, run = KEYS[k + 4], KEYS[k + 5]
  local audit, ttl, dead, reason, record = '', 0, '', '', ''
  if final then
    audit, ttl, dead, reason = ARGV[a + 5], ARGV[a + 6], ARGV[a + 7], ARGV[a + 8]
    record = ARGV[a + 9]
    a = a + 9
  else
    a = a + 4
  end
  k = k + 5
  local result, added, marker, claim = 0, 1, true, false
  local p = redis.pcall('XPENDING', stream, ARGV[1], entry, entry, 1)
  if p.err then p = {} end  -- the stream or its group is gone
  if #p > 0 and p[1][2] ~= ARGV[2] then
    result = -1
  elseif #p == 0 and not vanished then
    result = -5
  elseif seq >= 0 and not named then
    local m = redis.pcall('HMGET', run, 'status', 'entry')
    if m.err then
      marker, m = false, {false, false}  -- not a hash (an operator's): left alone
    elseif ended(m[1]) or (m[2] and m[2] ~= entry) then
      result = -4
    elseif not m[2] then  -- no run yet: this entry's chunk claims it
      claim = marker
    end
    if result == 0 and not m[1] then
      if ends_final(out) then
        result = -4  -- no marker says so, but the log has its final chunk: answered
      elseif vanished and redis.call('EXISTS', out) == 0 then
        -- pending to no one, and neither a marker nor a log says it runs: another
        -- worker may have finished it before they were deleted (its readers: JobLost)
        result = -4
      end
    end
    named = kind == '3' and marker and (m[2] == entry or claim)
  end
  if result == 0 and seq >= 0 then
    added = add_chunk(out, seq, chunk)
    if type(added) == 'table' then return added end  -- an error reply: the whole call
    if added == 0 then result = -2 elseif added == -3 then result = -3 end
    if result == 0 and claim and not final then
      redis.call('HSET', run, 'entry', entry)
      redis.call('EXPIRE', run, ARGV[5])
    end
  end
  if result == 0 then
    if seq >= 0 then
      redis.call('PUBLISH', out, chunk)
    end
    if final then
      redis.pcall('XACK', stream, ARGV[1], entry)  -- an error: the group is gone
      finished[stream] = true
      if audit ~= '' then redis.call('XADD', KEYS[1], '*', 'data', audit) end
      if dead ~= '' then  -- the fields of a records.dead_letter.DeadLetter
        redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'source', 'worker',
                   'stream', stream, 'entry', entry, 'worker', ARGV[2], 'reason', reason,
                   'data', dead)
      end
      if seq >= 0 then
        -- compaction: the whole output in the run key; the log only for a grace,
        -- for readers following it
        if marker then
          redis.call('EXPIRE', out, math.min(tonumber(ttl), tonumber(ARGV[4])))
          redis.call('HSET', run, 'status', dead ~= '' and 'failed' or 'finished',
                     'result', record, 'entry', entry)
          redis.call('EXPIRE', run, ttl)
          redis.call('EXPIRE', job, ttl)  -- the submission goes with it (any type)
        else  -- not a run key: the log is the only record, for the whole TTL
          redis.call('EXPIRE', out, ttl)
          result = 2
        end
        redis.call('DEL', abort)
      end
    else
      result = redis.call('EXISTS', abort) + (named and 3 or 0)
    end
  end
  results[#results + 1] = result
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


class Appender:
    """``appender(keys, consumer, dead_max_len, log_grace_s, items)``: one APPEND call
    for ``items`` (all on the shard of ``keys``); the result per item (0, 1: abort
    asked, ``NOT_OWNER``, ``DUPLICATE``)."""

    def __init__(self, connection):
        self._script = register_script(connection, append_script(connection))

    def __call__(
        self, keys: Keys, consumer: str, dead_max_len: int, log_grace_s: int, items: list[Append]
    ) -> list[int]:
        return self._script(**append_call(keys, consumer, dead_max_len, log_grace_s, items))


def dead_letter(entry_id: str, dead: bytes, reason: str, stream: str = "") -> Append:
    """The APPEND item that dead-letters an entry whose request is unknown: its ack and
    ``{p}:dead`` record, no chunk (``dead``: see ``dead_payload``)."""
    return Append("-", entry_id, -1, b"", True, dead=dead, reason=reason, stream=stream)


MAX_DEAD_PAYLOAD = 64 << 10


def dead_payload(payload: Any, audited: bool) -> bytes:
    """What a dead letter keeps of an entry's payload.

    When an audit record was written for the request it keeps the prompt, so
    the dead letter keeps only the payload's sha256 and length; otherwise the
    payload itself up to 64 KiB (beyond that, its sha256, length and head).
    """
    if payload is None:
        return b"null"
    raw = payload if isinstance(payload, bytes) else str(payload).encode("utf-8", "replace")
    if not audited and len(raw) <= MAX_DEAD_PAYLOAD:
        return raw
    summary = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    if not audited:
        summary["head"] = raw[:1024].decode("utf-8", "replace")
    return orjson.dumps(summary)
