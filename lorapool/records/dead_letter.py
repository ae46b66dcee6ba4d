"""A dead letter: an entry the pool gave up on, kept in ``{p}:dead`` with the reason.

Two writers give up on entries: a worker (APPEND writes the letter in the same atomic
call that acks the job's entry: ``append.APPEND``) and the audit writer (a record it
cannot verify, parse or store: ``audit_db/writer.py``). Both write the fields of one
``DeadLetter`` and every reader (the dashboard, tools, tests) reads it with
``decode_dead_letter``, which also reads the letters of the version before this record:
the worker's ``data, reason, entry, worker`` and the audit writer's ``source, stream,
id, reason, data``. Torch-free.
"""

from __future__ import annotations

from typing import Literal

import msgspec

WORKER, AUDIT = "worker", "audit"  # who wrote it (``DeadLetter.source``)


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """One entry given up on. ``data``: the entry's payload or, where an audit record
    keeps the prompt or it is over 64 KiB, a summary of it (``append.dead_payload``)."""

    source: Literal["worker", "audit"]
    entry: str  # its id in ``stream``
    reason: str
    data: bytes
    stream: str | None = None  # the stream it was read from (None: a worker's, older)
    worker: str | None = None  # the consumer that gave up (None: an audit writer, older)

    def fields(self) -> dict[str, str | bytes]:
        """The stream entry's fields (XADD), the ones that say something."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


def decode_dead_letter(fields: dict[bytes, bytes]) -> DeadLetter:
    """The letter a ``{p}:dead`` entry's fields hold (any version); ValueError when they
    do not hold one."""
    text = {
        k.decode(): v if k == b"data" else v.decode("utf-8", "replace") for k, v in fields.items()
    }
    text.setdefault("source", WORKER)  # the worker's letters said nothing of it
    if text["source"] == AUDIT and "entry" not in text and "id" in text:
        text["entry"] = text.pop("id")  # the audit writer's, older
    try:
        return msgspec.convert(text, DeadLetter)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed dead letter: {exc}") from None
