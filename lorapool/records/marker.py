"""A job's two hashes (issue 48): its marker, the submission, and its run.

``JobMarker`` is ``{p}:job:<id>``: SUBMIT writes it and every role that submits may
write it, so nothing a worker writes, a reader is told or an audit record says is taken
from it (its entry only tells a worker where to look for a job no worker took).
``JobRun`` is ``{p}:run:<id>``: the workers' alone (producers, the gateway and the RQ
workers may read it, never write it): the entry a worker took the job from, claimed by
the run's first chunk; at its end its ``status`` and final record (``result``); for a
request a worker ended for its readers, when (``ended``) and why (``cause``).

These Structs are the hashes' field names and ``JobStatus`` their statuses, in one
place: the Lua scripts that write and read them (``lifecycle.submit``, ``append``,
``unread``, ``run_state``, ``worker/unread_audit.py``) are checked against them
(tests/unit/test_job_status.py). Redis holds them as hashes of strings, so each field
is a string (or bytes for the final record) or missing. Torch-free.
"""

from __future__ import annotations

from enum import Enum

import msgspec


class JobStatus(str, Enum):
    """A job's status as readers see it: ``queued`` from its submission until its run
    ends, then ``finished`` or ``failed`` (a named error, the run's own or a worker's
    for a request that could not run)."""

    QUEUED = "queued"
    FINISHED = "finished"
    FAILED = "failed"


ENDED = (JobStatus.FINISHED.value, JobStatus.FAILED.value)


class JobMarker(msgspec.Struct, kw_only=True, frozen=True):
    """``{p}:job:<id>``, as SUBMIT writes it (producer-writable: never evidence)."""

    status: str | None = None  # 'queued' (a reader asks the run, never this)
    entry: str | None = None  # the job's stream entry id
    submitted: str | None = None  # the submitting call's clock reading (its retry finds it)
    priority: str | None = None  # the stream it was added to (``Keys.streams``)
    output_kind: str | None = None  # ``RequestOutputKind`` its readers stream
    on_finish: str | None = None  # a batch's callback (``batch/callbacks.py``)


class JobRun(msgspec.Struct, kw_only=True, frozen=True):
    """``{p}:run:<id>``, as workers write it (their keys alone)."""

    status: str | None = None  # a ``JobStatus`` once ended; none while it runs
    entry: str | None = None  # the entry the run's first chunk claimed
    result: bytes | None = None  # the final record the log was compacted into
    ended: str | None = None  # when a worker ended it for its readers (unread)
    cause: str | None = None  # why (``worker/unread_audit.CAUSES``)


MARKER_FIELDS = JobMarker.__struct_fields__
RUN_FIELDS = JobRun.__struct_fields__
RESULT_FIELD = "result"  # the run key's field holding the compacted output


def job_status(ran: bytes | None, submitted: int) -> str | None:
    """A job's status from its run key's ``status`` (``ran``) and whether its marker
    exists: the run's when it ended, else queued while submitted; None: unknown id."""
    if ran is not None and ran.decode("utf-8", "replace") in ENDED:
        return ran.decode()
    return JobStatus.QUEUED.value if submitted or ran is not None else None
