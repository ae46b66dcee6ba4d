"""A reader's view of a chunk log: chunks read, then the rest cut out of the final
record once the log is compacted, joined, equal the whole output; the accumulator's
cumulative outputs equal the joined deltas at every chunk."""

import zlib

import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorapool.lifecycle.chunk_log import (
    Cursor,
    LogCompacted,
    OutputAssembler,
    decode_result,
    encode_result,
)
from lorapool.records.accumulator import Accumulator
from lorapool.records.chunk import Chunk, Delta, encode_chunk

_PROMPT = {"prompt": "p", "prompt_token_ids": [7]}
piece = st.tuples(st.text(max_size=4), st.lists(st.integers(0, 50_000), max_size=3))


def _chunks(steps: list[list[tuple[str, list[int]]]], n: int) -> list[Chunk]:
    """A log: per step, one piece per completion; the last step finishes them."""
    offsets, total, log = [0] * n, 0, []
    for seq, pieces in enumerate(steps):
        final = seq == len(steps) - 1
        outputs = []
        for i, (text, ids) in enumerate(pieces):
            out = Delta(text=text, token_ids=ids, index=i, offset=offsets[i])
            out.logprobs = [[[t, -1.0, 1, "x"]] for t in ids]
            out.finish_reason = "length" if final else None
            outputs.append(out)
            offsets[i] += len(ids)
        first = _PROMPT if not seq else {}
        chunk = Chunk(request_id="r", seq=seq, offset=total, outputs=outputs, finished=final)
        log.append(msgspec.structs.replace(chunk, adapter_id=2, **first))
        total += sum(len(ids) for _, ids in pieces)
    return log


def _whole(log: list[Chunk], n: int) -> Chunk:
    """The final record, built independently of the code under test: plain joins."""
    outputs = []
    for i in range(n):
        outs = [c.outputs[i] for c in log]
        outputs.append(
            Delta(
                index=i,
                text="".join(o.text for o in outs),
                token_ids=[t for o in outs for t in o.token_ids],
                logprobs=[lp for o in outs for lp in o.logprobs],
                finish_reason="length",
            )
        )
    whole = Chunk(request_id="r", seq=log[-1].seq, outputs=outputs, finished=True, adapter_id=2)
    return msgspec.structs.replace(whole, **_PROMPT)


def _entries(log: list[Chunk]) -> list:
    return [encode_chunk(c) for c in log]  # the log: a list, a chunk at index seq


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 3),
    steps=st.integers(1, 8),
    data=st.data(),
)
def test_chunks_then_the_rest_of_the_record_join_to_the_whole(n, steps, data):
    pieces = data.draw(
        st.lists(st.lists(piece, min_size=n, max_size=n), min_size=steps, max_size=steps)
    )
    log = _chunks(pieces, n)
    whole = _whole(log, n)
    seen = data.draw(st.integers(0, len(log)))  # chunks read before the log was compacted
    cursor = Cursor("r")
    got = list(cursor.take(_entries(log[:seen])))
    # a record as workers store it (compressed) or as JSON: both read the same
    encode = data.draw(st.sampled_from([encode_result, encode_chunk]))
    got += list(cursor.rest(encode(whole)))
    assert cursor.done and got[-1].finished
    assert [c.seq for c in got] == sorted({c.seq for c in got})  # in order, no repeat
    for i in range(n):
        outs = [o for c in got for o in c.outputs if o.index == i]
        assert "".join(o.text for o in outs) == whole.outputs[i].text
        assert [t for o in outs for t in o.token_ids] == whole.outputs[i].token_ids
        assert [lp for o in outs for lp in o.logprobs] == whole.outputs[i].logprobs
    cumulative = [OutputAssembler("cumulative").feed(c) for c in [whole]][0]
    assembler = OutputAssembler("cumulative")
    outputs = [assembler.feed(c) for c in got]
    final = outputs[-1]
    assert [c.text for c in final.outputs] == [c.text for c in cumulative.outputs]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in cumulative.outputs]
    assert (final.prompt, final.prompt_token_ids, final.finished) == ("p", [7], True)


def test_cumulative_outputs_are_snapshots():
    """An output handed out earlier does not change when later chunks arrive."""
    log = _chunks([[("ab", [1, 2])], [("cd", [3])], [("e", [4])]], 1)
    assembler = OutputAssembler("cumulative")
    first = assembler.feed(log[0])
    rest = [assembler.feed(c) for c in log[1:]]
    assert (first.outputs[0].text, first.outputs[0].token_ids) == ("ab", [1, 2])
    assert (rest[-1].outputs[0].text, rest[-1].outputs[0].token_ids) == ("abcde", [1, 2, 3, 4])
    assert len(first.outputs[0].logprobs) == 2


def test_a_reader_started_midway_cannot_cut_a_compacted_log():
    log = _chunks([[("ab", [1])], [("cd", [2])], [("e", [3])]], 1)
    whole = encode_chunk(_whole(log, 1))
    with pytest.raises(LogCompacted, match="compacted"):
        list(Cursor("r", after=0).rest(whole))
    assert list(Cursor("r", after=2).rest(whole)) == []  # it has everything already


def test_the_compact_record_says_only_what_is_not_default():
    log = _chunks([[("ab", [1])], [("cd", [2])]], 1)
    log[0].outputs[0].logprobs = None
    record = orjson.loads(encode_chunk(log[1]))
    assert b',"f":1,' in encode_chunk(log[1])  # not true: what APPEND's Lua looks for
    assert record == {
        "s": 1,
        "o": 1,
        "c": [{"t": "cd", "k": [2], "l": [[[2, -1.0, 1, "x"]]], "f": "length"}],
        "f": 1,  # what APPEND's Lua looks for
        "a": 2,
    }


def test_a_long_record_is_stored_compressed_and_reads_back_whole():
    text = [(f" word{i}", [1000 + i]) for i in range(96)]
    whole = _whole(_chunks([[piece] for piece in text], 1), 1)
    raw, record = encode_chunk(whole), encode_result(whole)
    assert record[:1] == b"x" and len(record) < len(raw) * 0.7  # zlib's header byte
    assert encode_chunk(decode_result(record, "r")) == raw
    short = Chunk(request_id="r", seq=0, outputs=[Delta(text="a", token_ids=[1])], finished=True)
    assert encode_result(short) == encode_chunk(short)  # nothing to gain: left as JSON


@pytest.mark.parametrize(
    "payload, problem",
    [
        (zlib.compress(b'{"s": 0')[:-3], "truncated"),
        (b"x\x01garbage", "malformed record"),
        (zlib.compress(b"[1, 2]"), "Expected `object`"),
    ],
)
def test_a_broken_record_says_what_is_wrong(payload, problem):
    with pytest.raises(ValueError, match=problem):
        decode_result(payload, "r")


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3), steps=st.integers(1, 8), data=st.data())
def test_one_accumulator_keeps_the_whole_output_for_the_worker_and_the_readers(n, steps, data):
    """The worker's record (``Held.keep``/``whole``) and a reader's cumulative outputs
    (``OutputAssembler``) both come from ``Accumulator``: each equals the plain joins of
    the deltas so far, at every chunk."""
    pieces = data.draw(
        st.lists(st.lists(piece, min_size=n, max_size=n), min_size=steps, max_size=steps)
    )
    log = _chunks(pieces, n)
    kept, assembler = Accumulator(), OutputAssembler("cumulative")
    for k, chunk in enumerate(log):
        kept.add(chunk)
        output = assembler.feed(chunk)
        for i, completion in enumerate(output.outputs):
            outs = [c.outputs[i] for c in log[: k + 1]]
            assert completion.text == "".join(o.text for o in outs)
            assert completion.token_ids == [t for o in outs for t in o.token_ids]
            assert len(completion.logprobs) == len(completion.token_ids)
    assert encode_chunk(kept.whole("r")) == encode_chunk(_whole(log, n))
