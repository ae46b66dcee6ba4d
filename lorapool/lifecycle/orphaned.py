"""A request a worker started and never ended whose queue entry is gone (issue 31 Build 2):
its worker stopped (SIGKILL, a lost machine) after writing some chunks, and an operator
removed the entry (``XTRIM``, ``XDEL``, the group destroyed and re-created, ``DEL`` of
the stream); another worker's claim then drops the entry from the pending list without
its request id (``lease.claim_idle``), so no worker will resume it.

Its readers ask the workers to end it, as ``lifecycle.unread`` does for a request no
worker read: a reader whose request's log holds chunks (taken or not: a log an operator
deleted is made again without its head) and has had no new chunk for ``QUIET_S`` asks
``END_UNREAD`` (``log`` 'check'), which pushes the id only if no worker ended the
request, its log does not end in a final chunk and its entry is pending to no one and
not to be read. A worker then checks all of it again, reads the whole log, builds the
output so far as one final record (``orphan_record``: finish_reason "error",
``REASON``) and stores it in the run key with its audit record, in one atomic call
that checks the log did not change since it read it (``worker/unread_audit.py``).
Every reader then gets one final chunk, after exactly the chunks it had, from the
record's rest (``marker.read_back_result``).
"""

from __future__ import annotations

import logging
import time

from msgspec.structs import replace

from lorapool.lifecycle import unread
from lorapool.lifecycle.chunk_log import encode_result
from lorapool.outputs import RequestMetrics
from lorapool.records.accumulator import Accumulator
from lorapool.records.chunk import decode_chunk
from lorapool.records.error_kind import ErrorKind

logger = logging.getLogger(__name__)
QUIET_S = 3.0  # no new chunk this long: a reader asks whether its request was orphaned
REASON = (
    "its queue entry was removed while no live worker held it (an operator's XTRIM, "
    "XDEL, XGROUP DESTROY/SETID or DEL of the job stream after its worker stopped; see "
    "README, operator commands): it ran partially and cannot resume; submit it again"
)


def orphan_record(request_id: str, raws: list[bytes]) -> bytes | None:
    """The final record of a request whose log holds ``raws``: the whole output so far,
    one chunk past the last (finished, the error ``REASON``; completions not finished
    get finish_reason "error"). None when the log is empty, malformed or finished."""
    output = Accumulator()
    try:
        for raw in raws:
            output.add(decode_chunk(raw, request_id))
    except ValueError:
        return None
    whole = output.whole(request_id)
    if whole is None or whole.finished:
        return None
    now = time.time()  # metrics: the latest a chunk had (arrival at least), finished now
    metrics = replace(
        whole.metrics or output.first.metrics or RequestMetrics(arrival_time=now),
        finished_time=now,
    )
    outputs = [
        o if o.finish_reason else replace(o, finish_reason="error", stop_reason=None)
        for o in whole.outputs
    ]
    final = replace(whole, seq=whole.seq + 1, finished=True, outputs=outputs)
    final.metrics, final.error, final.error_kind = metrics, REASON, ErrorKind.REMOVED
    return encode_result(final)


class Quiet:
    """When a reader's request last moved (its cursor's seq), to ask ``END_UNREAD``
    about it only after ``QUIET_S`` without a new chunk (``due``)."""

    def __init__(self):
        self.seq, self.since = -1, time.monotonic()

    def due(self, seq: int) -> bool:
        now = time.monotonic()
        if seq != self.seq:
            self.seq, self.since = seq, now
        return now - self.since >= QUIET_S


def end(end_unread, request_id: str) -> int:
    """Ask the workers to end ``request_id`` if it was orphaned (sync client):
    ``END_UNREAD``'s reply (0: left alone). One round trip."""
    return end_unread(request_id, "check")


async def end_async(end_unread, request_id: str) -> int:
    """``end`` on a redis.asyncio client."""
    return await end_unread(request_id, "check")


def log_ended(request_id: str, ended: int) -> None:
    """The log line of a request a reader ended (``unread.log_ended`` with this REASON)."""
    unread.log_ended(request_id, ended, REASON)
