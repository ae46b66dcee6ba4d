"""Ending the requests readers asked the workers to end (issues 31 and 48).

A reader that finds a request's queue entry removed before any worker read it
(``lifecycle/unread.py``), or a run whose worker stopped partway and whose entry is gone
(``lifecycle/orphaned.py``), pushes its id on its shard's ``unread-ended`` list: readers
hold no audit key and may write neither the run key nor the audit stream. Each worker's
upkeep takes a few ids from there every second (``record_ended``) and ends each itself:
the final error record in the request's run key (every reader gets it as one final
chunk) and one signed audit record, finish_reason "error", with a log line naming the
cause.

Whatever the list holds (anyone with a producer's rights may push to it), what ends a
request and what its record says come from what only workers write, read again in the
atomic call that writes them (``END_RUNS``): the run key (no worker ended it; the entry
a worker's first chunk claimed), the chunk log (none: it never ran, and its record has
no output; one not ending in a final chunk: the output so far, read by this worker, the
log unchanged since) and the job streams (the entry pending to no worker in any of them,
and not still to be read). The marker (a producer's) gives only the entry of a job no
worker took, and the stream it was queued on for the cause's wording; a never-run
record's times are when the worker ended it (no worker saw the job arrive), its prompt
and parameters absent (no worker read them). Exactly one record a request: the run key
says it ended in the same call, and a request ended once is never ended, run or
submitted again while its result lives (``lifecycle/append.py``, ``submit.py``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis

from lorapool.connection import register_script
from lorapool.lifecycle import orphaned
from lorapool.lifecycle.chunk_log import decode_result
from lorapool.lifecycle.keys import PRIORITIES, WORKERS_GROUP, Keys
from lorapool.lifecycle.unread import CAUSES, REASON, unread_record
from lorapool.records.audit import AuditRecord, Metrics, Output, encode_audit_record

if TYPE_CHECKING:
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)
BATCH = 32  # ids taken from a shard's list in one upkeep
EVERY_S = 1.0  # how often a worker's upkeep reads the lists: readers wait this long

# KEYS: the shard's ended list, its audit stream, its job streams (``Keys.streams``),
# then per request: its marker, its chunk log, its run key.
# ARGV: mode ('check' or 'end'), group, the number of job streams, the log's grace (s),
# the result's TTL (s), the time, the streams' priorities in their order, then per
# request: its id, and with 'end' the cause and log length 'check' gave, its final
# record, its signed audit record.
# 'check': per request, {id, cause, log length} when it is to be ended (the cause one of
# ``CAUSES``), else the id off the list (refused, listed). 'end': per request, only if
# 'check' would say the same now: the run key failed with the final record (and when),
# the audit record, the log kept only for the grace, the id off the list (recorded).
# Returns {to end (check) or recorded (end), refused}.
END_RUNS = """
local n = tonumber(ARGV[3])
local function examine(marker, log, run)
  local r = redis.pcall('HMGET', run, 'status', 'entry')
  if r.err or r[1] then return nil end  -- ended already (or an operator's key)
  local m = redis.pcall('HMGET', marker, 'entry', 'priority')
  if m.err then m = {false, false} end
  local entry = r[2] or m[1]
  if not entry or not string.match(entry, '^%d+%-%d+$') then return nil end
  local length = redis.pcall('LLEN', log)
  if type(length) ~= 'number' then return nil end
  if length > 0 then
    local last = redis.call('LINDEX', log, -1)
    local ok, record = pcall(cjson.decode, last)
    if ok and type(record) == 'table' and record['f'] == 1 then return nil end
  end
  local stream = KEYS[3]
  for i = 1, n do
    local p = redis.pcall('XPENDING', KEYS[2 + i], ARGV[2], entry, entry, 1)
    if p.err == nil and #p > 0 then return nil end  -- a worker holds it
    if ARGV[6 + i] == m[2] then stream = KEYS[2 + i] end
  end
  local found = redis.pcall('XRANGE', stream, entry, entry)
  if found.err then return 'stream-type', length end
  if #found == 0 then
    return redis.call('EXISTS', stream) == 1 and 'entry' or 'stream', length
  end
  local delivered = nil
  for _, fields in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for j = 1, #fields, 2 do info[fields[j]] = fields[j + 1] end
    if info['name'] == ARGV[2] then delivered = info['last-delivered-id'] end
  end
  if not delivered then return nil end  -- workers make the group again from the start
  local ems, eseq = string.match(entry, '^(%d+)%-(%d+)$')
  local dms, dseq = string.match(delivered, '^(%d+)%-(%d+)$')
  ems, eseq, dms, dseq = tonumber(ems), tonumber(eseq), tonumber(dms), tonumber(dseq)
  if ems > dms or (ems == dms and eseq > dseq) then return nil end  -- still to be read
  return 'group', length, entry
end
local good, refused = {}, {}
local k, a = 3 + n, 7 + n
local ending = ARGV[1] == 'end'
while k < #KEYS do
  local id = ARGV[a]
  local cause, length = examine(KEYS[k], KEYS[k + 1], KEYS[k + 2])
  if not ending then
    if cause then
      good[#good + 1] = {id, cause, length}
    elseif redis.call('LREM', KEYS[1], 0, id) > 0 then
      refused[#refused + 1] = id
    end
    a = a + 1
  else
    if cause == ARGV[a + 1] and length == tonumber(ARGV[a + 2])
       and redis.call('LREM', KEYS[1], 0, id) > 0 then
      redis.call('HSET', KEYS[k + 2], 'status', 'failed', 'result', ARGV[a + 3],
                 'ended', ARGV[6], 'cause', cause)
      redis.call('EXPIRE', KEYS[k + 2], ARGV[5])
      redis.call('XADD', KEYS[2], '*', 'data', ARGV[a + 4])
      if length > 0 then redis.call('EXPIRE', KEYS[k + 1], ARGV[4]) end
      good[#good + 1] = id
    end
    a = a + 5
  end
  k = k + 3
end
return {good, refused}
"""


def record_ended(state: WorkerState) -> int:
    """End up to ``BATCH`` requests of each shard's list; how many were ended (and
    audited). Run by the worker's upkeep; Redis errors go to its loop (logged, retried)."""
    script = register_script(state.redis, END_RUNS)
    views = state.keys.shard_views
    with state.redis.pipeline(transaction=False) as pipe:
        for view in views:
            pipe.lrange(view.unread_ended, 0, BATCH - 1)
        replies = pipe.execute(raise_on_error=False)
    recorded = 0
    for view, raw in zip(views, replies):
        if isinstance(raw, redis.ResponseError):  # a producer's SET of it: WRONGTYPE
            logger.warning(
                "worker %s: %s holds another type than a list (%s): requests readers ask "
                "to end are not ended until it is deleted",
                state.name,
                view.unread_ended,
                raw,
            )
            continue
        if isinstance(raw, Exception):
            raise raw
        ids = _ids(state, view, raw)
        if ids:
            recorded += _end(state, script, view, ids)
    return recorded


def _ids(state: WorkerState, view: Keys, raw: list[bytes]) -> list[str]:
    """The request ids of ``raw`` (once each); what is not one (not UTF-8: no request's
    id) is taken off the list at once, or it would hold a place there for good."""
    ids = []
    for item in dict.fromkeys(raw):
        try:
            ids.append(item.decode())
        except UnicodeDecodeError:
            logger.warning(
                "worker %s: %r on %s is no request id", state.name, item, view.unread_ended
            )
            state.redis.lrem(view.unread_ended, 0, item)
    return ids


def _call(state: WorkerState, script, view: Keys, mode: str, per_request: list) -> list:
    keys = [view.unread_ended, view.audit, *view.streams]
    config = state.config
    args = [mode, WORKERS_GROUP, len(PRIORITIES), config.log_grace_s, config.result_ttl_s]
    args += [time.time(), *PRIORITIES]
    for rid, *values in per_request:
        keys += [view.job(rid), view.out(rid), view.run(rid)]
        args += [rid, *values]
    return script(keys=keys, args=args)


def _end(state: WorkerState, script, view: Keys, ids: list[str]) -> int:
    found, refused = _call(state, script, view, "check", [[rid] for rid in ids])
    for rid in refused:
        logger.warning(
            "worker %s: %s on %s is not a request to end (a worker ended, runs or holds "
            "it, it is still to be read, or it was never submitted): left alone",
            state.name,
            rid.decode("utf-8", "replace"),
            view.unread_ended,
        )
    ending = []
    for rid, cause, length in found:
        rid, cause = rid.decode("utf-8", "replace"), cause.decode()
        final, record = _records(state, view, rid, cause, int(length))
        if final is not None:
            ending.append([rid, cause, int(length), final, record])
        else:
            logger.warning(
                "worker %s: %s's chunk log is no run's (malformed): not ended", state.name, rid
            )
            state.redis.lrem(view.unread_ended, 0, rid)
    if not ending:
        return 0
    recorded, _ = _call(state, script, view, "end", ending)
    for rid in recorded:
        rid = rid.decode("utf-8", "replace")
        cause = next(e[1] for e in ending if e[0] == rid)
        logger.error(
            "worker %s: ended request %s for its readers: %s; audit record written",
            state.name,
            rid,
            error_of(cause, ran=any(e[2] for e in ending if e[0] == rid)),
        )
    return len(recorded)


def _records(
    state: WorkerState, view: Keys, rid: str, cause: str, length: int
) -> tuple[bytes | None, bytes]:
    """The final record and the signed audit record of ending ``rid``: never run
    (``length`` 0: no output), or the ``length`` chunks its log holds, read now (the
    call that ends it checks the length again). None: a log that is no run's."""
    if length == 0:
        final = unread_record(rid, REASON)
    else:
        final = orphaned.orphan_record(rid, state.redis.lrange(view.out(rid), 0, length - 1))
        if final is None:
            return None, b""
    record = audit_record(state, rid, final, error_of(cause, ran=length > 0))
    return final, encode_audit_record(record, state.config.audit_key, state.config.prefix)


def audit_record(state: WorkerState, request_id: str, final: bytes, error: str) -> AuditRecord:
    """The audit record of a request a worker ended for its readers, from the final
    record it built (``final``): finish_reason "error" and ``error``; one completion
    with no tokens for one never run (times: now), or the output and times its log held."""
    whole = decode_result(final, request_id)
    outputs = tuple(
        Output(o.index, o.text, tuple(o.token_ids), finish_reason=o.finish_reason or "error")
        for o in whole.outputs
    )
    now = time.time()
    metrics = whole.metrics
    prompt = list(whole.prompt_token_ids or [])
    return AuditRecord(
        request_id=request_id,
        worker=state.name,
        base_model=state.base_model,
        metrics=Metrics(
            arrival_time=metrics.arrival_time if metrics else now,
            finished_time=metrics.finished_time if metrics and metrics.finished_time else now,
            num_prompt_tokens=len(prompt),
            num_generated_tokens=sum(len(o.token_ids) for o in outputs),
        ),
        prompt_token_ids=tuple(prompt),
        outputs=outputs,
        error=error,
    )


def error_of(cause: str, ran: bool) -> str:
    """The record's error: why it could not run or go on, and what the worker found."""
    reason = orphaned.REASON if ran else REASON
    found = CAUSES.get(cause)
    return reason if found is None else f"{reason}; found: {found}"
