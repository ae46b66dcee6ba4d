"""A request's output as readers see it: the chunk log while it streams, the one final
record once it is compacted, and the accumulator that turns chunks into RequestOutputs.

A worker appends one chunk per step (or per few steps, under load) to the list
``{p}:out:<id>``: a chunk's index in it is its seq, so a reader reads what follows the
last chunk it has with one LRANGE. (A list, not a stream: Redis 7 preallocates 4 KB for
a stream's first node, more than most requests' whole output; a list grows with what it
holds, ~15 B per chunk besides the chunk.) When the request finishes, the same atomic
call stores the whole output as one compact record in the job's hash (field
``result``, compressed: ``encode_result``) and lets the log expire after a short grace,
so a reader that is following the log reads the final chunk from it, and a reader that
comes later reads everything in one HGET. Torch-free.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import msgspec

from lorapool.outputs import CompletionOutput, RequestOutput, logprobs_from_wire
from lorapool.protocol import RequestOutputKind
from lorapool.records.accumulator import Accumulator, Completion
from lorapool.records.chunk import Chunk, Delta, decode_chunk, encode_chunk

MAX_RECORD_BYTES = 256 << 20  # a compressed record inflates to at most this


def encode_result(whole: Chunk) -> bytes:
    """The final record of a request (``whole``: its output as one chunk): the compact
    chunk, zlib-compressed (RFC 1950, level 1) when that is smaller, as it is past a
    few tokens (ids and text take about half). A compressed record starts with byte
    0x78, a JSON one with ``{``; ``decode_result`` reads both."""
    raw = encode_chunk(whole)
    packed = zlib.compress(raw, 1)
    return packed if len(packed) < len(raw) else raw


def decode_result(payload: bytes | str | None, request_id: str) -> Chunk:
    """The chunk a final record holds (``encode_result``); ValueError when malformed."""
    if isinstance(payload, bytes) and payload.startswith(b"x"):
        inflater = zlib.decompressobj()
        try:
            payload = inflater.decompress(payload, MAX_RECORD_BYTES)
        except zlib.error as exc:
            raise ValueError(f"malformed record of {request_id!r}: {exc}") from None
        if not inflater.eof:
            raise ValueError(
                f"malformed record of {request_id!r}: truncated, or over {MAX_RECORD_BYTES} B"
            )
    return decode_chunk(payload, request_id)


def log_chunks(connection, keys, request_id: str) -> list[Chunk]:
    """The chunks the request's log holds now, in order (sync client; empty when the
    log is gone). For tools, tests and benchmarks: readers follow it with ``Cursor``."""
    return [decode_chunk(raw, request_id) for raw in connection.lrange(keys.out(request_id), 0, -1)]


class LogCompacted(LookupError):
    """The log was compacted before this reader could place itself in it."""


class Cursor:
    """Where one reader is in one request's output: the last chunk read (``seq``; the
    next one is at index ``seq + 1`` of the log) and, per completion, the tokens and
    characters it has been given (to cut the rest out of the final record when the log
    is gone)."""

    def __init__(self, request_id: str, after: int = -1):
        self.request_id = request_id
        self.seq = after
        self.placed = after < 0  # knows every offset since the start
        self.given: dict[int, tuple[int, int]] = {}  # index -> (tokens, characters)
        self.done = False
        self.logged = False  # a read found the log holding chunks (taken or not)

    def take(self, entries: list) -> Iterator[Chunk]:
        """Chunks of the log's ``entries`` (read from index ``seq + 1``), in order, to the
        final one."""
        self.logged = self.logged or bool(entries)
        for raw in entries:
            chunk = decode_chunk(raw, self.request_id)
            if self.accepts(chunk):
                self._give(chunk)
                yield chunk

    def accepts(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` is the next one (not one already given, nor past a gap)."""
        return not self.done and chunk.seq == self.seq + 1

    def give(self, chunk: Chunk) -> Chunk:
        """Move past ``chunk``, the next one (``accepts``)."""
        self._give(chunk)
        return chunk

    def rest(self, payload: bytes | str) -> Iterator[Chunk]:
        """What the final record ``payload`` holds past this cursor, as one chunk."""
        whole = decode_result(payload, self.request_id)
        if whole.seq <= self.seq:
            self.done = True
            return
        if not self.placed:
            raise LogCompacted(
                f"request {self.request_id}: its chunk log was compacted; read the whole "
                f"output (result()) instead of the chunks after {self.seq}"
            )
        offset = sum(tokens for tokens, _ in self.given.values())
        rest = msgspec.structs.replace(
            whole, offset=offset, outputs=[self._cut(o, offset) for o in whole.outputs]
        )
        if self.seq >= 0:  # the first chunk's prompt is not repeated
            rest.prompt = rest.prompt_token_ids = rest.prompt_logprobs = None
        self._give(rest)
        yield rest

    def _give(self, chunk: Chunk) -> None:
        self.seq, self.done = chunk.seq, chunk.finished
        for out in chunk.outputs:
            tokens, chars = self.given.get(out.index, (0, 0))
            self.given[out.index] = (tokens + len(out.token_ids), chars + len(out.text))

    def _cut(self, out: Delta, offset: int) -> Delta:
        """What of completion ``out`` (whole) this reader has not been given."""
        tokens, chars = self.given.get(out.index, (0, 0))
        return msgspec.structs.replace(
            out,
            offset=None if tokens == offset else tokens,
            text=out.text[chars:],
            token_ids=out.token_ids[tokens:],
            logprobs=None if out.logprobs is None else out.logprobs[tokens:],
        )


class OutputAssembler:
    """Turns delta chunks into the RequestOutputs of one ``output_kind``.

    Per chunk it appends the delta to each completion (``Accumulator``: no copies of
    what came before); a cumulative output is built from those, copying only the flat
    text and id lists (a memcpy each), never deep-copying earlier outputs."""

    def __init__(self, kind: RequestOutputKind | str):
        self.kind = RequestOutputKind(kind)
        self.output = Accumulator()
        self.lora = None
        self.prompt_logprobs = None  # decoded from the first chunk, when asked

    def feed(self, chunk: Chunk) -> RequestOutput | None:
        """The output to yield for this chunk, or None (FINAL_ONLY before the end)."""
        delta = chunk.to_output()
        if chunk.lora_request is not None:
            self.lora = delta.lora_request
        self.output.add(chunk, delta.outputs)
        # the full adapter and the prompt of the first chunk, in every output
        delta.lora_request = self.lora
        delta.prompt, delta.prompt_token_ids = self.output.prompt, self.output.prompt_token_ids
        if self.prompt_logprobs is None and self.output.prompt_logprobs is not None:
            self.prompt_logprobs = logprobs_from_wire(self.output.prompt_logprobs)  # once
        delta.prompt_logprobs = self.prompt_logprobs
        for c in delta.outputs:
            c.lora_request = self.lora
        if self.kind == RequestOutputKind.DELTA:
            return delta
        if self.kind == RequestOutputKind.FINAL_ONLY and not chunk.finished:
            return None
        delta.outputs = [_cumulative(c, self.lora) for c in self.output.in_order()]
        return delta


def _cumulative(c: Completion, lora) -> CompletionOutput:
    """Completion ``c`` so far, as a CompletionOutput later chunks do not reach."""
    last: CompletionOutput = c.last
    return CompletionOutput(
        c.index,
        c.text,
        list(c.token_ids),
        last.cumulative_logprob,
        None if c.logprobs is None else list(c.logprobs),
        last.finish_reason,
        last.stop_reason,
        lora,
    )
