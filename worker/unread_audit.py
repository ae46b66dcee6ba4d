"""Audit records of the requests their readers ended unread (issue 31 Build 2).

A reader that finds a request's queue entry removed before any worker read it ends the
request (``lifecycle/unread.py``: a final error record in its marker) and pushes its id
on its shard's ``unread-ended`` list: readers hold no audit key and may not write the
audit stream. Each worker's upkeep takes a few ids from there (``record_ended``) and
writes one signed audit record each, finish_reason "error" and the reader's error, into
the shard's audit stream, with a log line naming the cause.

Exactly one record a request: ``RECORD_UNREAD`` takes an id off the list (``LREM``) and
writes its record in the same atomic call, so of two workers that read the same ids
only one writes each; the marker's ``unread`` flag goes with it, so an id pushed again
writes nothing. The list is pushed to by readers (and so by anyone with a producer's
rights): an id is recorded only if its marker says a reader ended it (``unread``),
the request has no chunk log (no worker wrote for it; or the reader ended a run whose
worker stopped partway, ``lifecycle/orphaned.py``: then the record holds what the log
held) and no worker holds its entry;
anything else is taken off the list and logged, not recorded. What a record holds is
what is left of a job whose entry is gone: its id, when it was submitted and ended, the
error; not its prompt, parameters or metadata (the marker does not keep them).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis

from lorapool.audit_record import (
    AuditRecord,
    BaseModelInfo,
    Metrics,
    Output,
    encode_audit_record,
)
from lorapool.connection import register_script
from lorapool.lifecycle import orphaned
from lorapool.lifecycle.chunk_log import RESULT_FIELD, decode_result
from lorapool.lifecycle.keys import PRIORITIES, WORKERS_GROUP, Keys
from lorapool.lifecycle.unread import CAUSES, REASON

if TYPE_CHECKING:
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)
BATCH = 32  # ids taken from a shard's list in one upkeep

# KEYS: the shard's ended list, its audit stream, its job streams (``Keys.streams``),
# then per request: its marker, its chunk log.
# ARGV: group, the number of job streams, the log's grace (s), the streams' priorities
# in the same order, then per request: its id, its signed audit record.
# Per request: the id off the list (LREM; nothing more unless it was there), then, only
# if the marker (a hash) has ``unread`` and status failed, no log exists (or the reader
# ended a run stopped partway: ``unread_log``) and the entry is pending to no worker:
# the record into the audit stream, ``unread`` off the marker and the log, if any, kept
# only for the grace (its final record is in the marker, as after a compaction).
# Returns {recorded ids, refused ids} (ids no longer on the list: neither).
RECORD_UNREAD = """
local n = tonumber(ARGV[2])
local function ended(marker, log)
  local status = redis.pcall('HGET', marker, 'status')
  if type(status) ~= 'string' or status ~= 'failed' then return false end
  if not redis.call('HGET', marker, 'unread') then return false end
  local ran = redis.call('HGET', marker, 'unread_log')
  if not ran and redis.call('EXISTS', log) == 1 then return false end
  local entry = redis.call('HGET', marker, 'entry')
  local priority = redis.call('HGET', marker, 'priority') or ARGV[4]
  local stream = KEYS[3]
  for i = 1, n do
    if ARGV[3 + i] == priority then stream = KEYS[2 + i] end
  end
  if not entry then return true end
  local p = redis.pcall('XPENDING', stream, ARGV[1], entry, entry, 1)
  if p.err ~= nil then return string.find(p.err, 'NOGROUP', 1, true) ~= nil end
  return #p == 0
end
local recorded, refused = {}, {}
local k, a = 3 + n, 4 + n
while k < #KEYS do
  local id = ARGV[a]
  if redis.call('LREM', KEYS[1], 0, id) > 0 then
    if ended(KEYS[k], KEYS[k + 1]) then
      redis.call('XADD', KEYS[2], '*', 'data', ARGV[a + 1])
      redis.call('HDEL', KEYS[k], 'unread')
      redis.call('EXPIRE', KEYS[k + 1], ARGV[3])  -- a log only where a run stopped
      recorded[#recorded + 1] = id
    else
      refused[#refused + 1] = id
    end
  end
  k, a = k + 2, a + 2
end
return {recorded, refused}
"""


def record_ended(state: WorkerState) -> int:
    """Audit up to ``BATCH`` ended requests of each shard's list; how many were recorded.
    Run by the worker's upkeep; Redis errors go to its loop (logged, retried)."""
    script = register_script(state.redis, RECORD_UNREAD)
    recorded = 0
    for view in state.keys.shard_views:
        try:
            raw = state.redis.lrange(view.unread_ended, 0, BATCH - 1)
        except redis.ResponseError as exc:  # a producer's SET of it: WRONGTYPE
            logger.warning(
                "worker %s: %s holds another type than a list (%s): requests readers end "
                "unread get no audit record until it is deleted",
                state.name,
                view.unread_ended,
                exc,
            )
            continue
        ids = _ids(state, view, raw)
        if ids:
            recorded += _record(state, script, view, ids)
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


def _record(state: WorkerState, script, view: Keys, ids: list[str]) -> int:
    markers = _markers(state, view, ids)
    keys = [view.unread_ended, view.audit, *view.streams]
    args = [WORKERS_GROUP, len(PRIORITIES), state.config.log_grace_s, *PRIORITIES]
    for rid in ids:
        keys += [view.job(rid), view.out(rid)]
        record = unread_record(state, rid, markers[rid])  # signed unless --insecure-no-key:
        args += [rid, encode_audit_record(record, state.config.audit_key, state.config.prefix)]
    recorded, refused = script(keys=keys, args=args)
    for rid in recorded:
        rid = rid.decode("utf-8", "replace")
        logger.error(
            "worker %s: request %s (entry %s) was ended by a reader: %s; audit record written",
            state.name,
            rid,
            markers.get(rid, {}).get("entry"),
            error_of(markers.get(rid, {})),
        )
    for rid in refused:
        logger.warning(
            "worker %s: %s on %s is not a request a reader ended unread (its marker says "
            "otherwise, or a worker ran or holds it): no audit record",
            state.name,
            rid.decode("utf-8", "replace"),
            view.unread_ended,
        )
    return len(recorded)


def _markers(state: WorkerState, view: Keys, ids: list[str]) -> dict[str, dict]:
    """Each id's marker fields the record needs (entry, submitted, unread); {} for a
    marker that is gone or of another type (the script refuses those)."""
    fields = ("entry", "submitted", "unread", "unread_cause", "unread_log", RESULT_FIELD)
    with state.redis.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.hmget(view.job(rid), *fields)
        replies = pipe.execute(raise_on_error=False)
    markers = {}
    for rid, reply in zip(ids, replies):
        values = [] if isinstance(reply, Exception) else reply
        markers[rid] = {f: v for f, v in zip(fields, values) if v is not None}
        for f, v in markers[rid].items():
            if f != RESULT_FIELD:
                markers[rid][f] = v.decode("utf-8", "replace")
    return markers


def unread_record(state: WorkerState, request_id: str, marker: dict[str, str]) -> AuditRecord:
    """The audit record of a request a reader ended unread: finish_reason "error" and
    the reader's error; one completion (index 0) with no tokens, or, for a run stopped
    partway, the output the reader found (``lifecycle.orphaned``); arrival when it was
    submitted, finished when it ended."""
    ended = _time(marker.get("unread")) or time.time()
    prompt, outputs = _output(request_id, marker)
    return AuditRecord(
        request_id=request_id,
        worker=state.name,
        base_model=BaseModelInfo(state.base_model["name"], state.base_model["sha256"]),
        metrics=Metrics(
            arrival_time=_time(marker.get("submitted")) or ended,
            finished_time=ended,
            num_prompt_tokens=len(prompt),
            num_generated_tokens=sum(len(o.token_ids) for o in outputs),
        ),
        outputs=outputs,
        error=error_of(marker),
    )


def _output(request_id: str, marker: dict) -> tuple[list[int], tuple[Output, ...]]:
    """The prompt's token ids and the completions of the reader's final record (a run
    stopped partway), else none and one empty completion (never run, or unreadable)."""
    empty = ([], (Output(0, "", (), finish_reason="error"),))
    if "unread_log" not in marker or RESULT_FIELD not in marker:
        return empty
    try:
        whole = decode_result(marker[RESULT_FIELD], request_id)
        outputs = tuple(
            Output(o.index, o.text, tuple(o.token_ids), finish_reason=o.finish_reason or "error")
            for o in whole.outputs
        )
    except (ValueError, KeyError, TypeError):
        return empty
    return list(whole.prompt_token_ids or []), outputs or empty[1]


def error_of(marker: dict[str, str]) -> str:
    """The record's error: the reader's, and what it found (``CAUSES``) when known."""
    found = CAUSES.get(marker.get("unread_cause", ""))
    reason = orphaned.REASON if "unread_log" in marker else REASON
    return reason if found is None else f"{reason}; found: {found}"


def _time(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
