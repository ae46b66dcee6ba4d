"""A dead letter is one record (``records.dead_letter.DeadLetter``) whoever wrote it:
the letters both writers wrote before it read as it, and what it writes reads back."""

from __future__ import annotations

import pytest

from lorapool.records.dead_letter import DeadLetter, decode_dead_letter

# The fields as main at 89a94dd wrote them (what XRANGE gives back): APPEND's (a worker's)
# and the audit writer's.
OLD_WORKER = {
    b"data": b'{"sha256":"a8db","bytes":125}',
    b"reason": b"unknown adapter 'ghost': register it with `lorapool adapters add ghost PATH`",
    b"entry": b"1795657026896-2",
    b"worker": b"fixture-worker",
}
OLD_AUDIT = {
    b"source": b"audit",
    b"stream": b"lorapool:audit",
    b"id": b"1795657026900-0",
    b"reason": b"unknown record version 99",
    b"data": b"\xff not json",
}


def test_the_letters_of_both_old_writers_read_as_one_record():
    assert decode_dead_letter(OLD_WORKER) == DeadLetter(
        source="worker",
        entry="1795657026896-2",
        reason=OLD_WORKER[b"reason"].decode(),
        data=OLD_WORKER[b"data"],
        worker="fixture-worker",
    )
    assert decode_dead_letter(OLD_AUDIT) == DeadLetter(
        source="audit",
        entry="1795657026900-0",
        reason="unknown record version 99",
        data=b"\xff not json",
        stream="lorapool:audit",
    )


def test_what_a_letter_writes_reads_back_the_same():
    letter = DeadLetter(
        source="audit", entry="1-0", reason="é", data=b"\x00\xff", stream="p:audit", worker="w"
    )
    fields = letter.fields()
    assert set(fields) == {"source", "entry", "reason", "data", "stream", "worker"}
    as_redis = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
    assert decode_dead_letter(as_redis) == letter
    assert "stream" not in DeadLetter(source="worker", entry="1-0", reason="r", data=b"").fields()


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {b"reason": b"r"},
        {**OLD_WORKER, b"source": b"elsewhere"},
        {b"data": b"x", b"entry": b"1"},
    ],
)
def test_fields_that_hold_no_letter_are_a_value_error(fields):
    with pytest.raises(ValueError, match="malformed dead letter"):
        decode_dead_letter(fields)
