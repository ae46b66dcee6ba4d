"""A chunk: one delta of a request's output, as its log ``{p}:out:<id>`` holds it.

One typed definition (``Chunk`` and its per-completion ``Delta``, msgspec Structs) is
what the worker builds, the wire holds and every reader reads: the attribute names
are the code's, the field names on the wire are compact (most of a GPU worker's Redis
memory is chunk logs), and what says nothing is left out (``omit_defaults``).

Chunk: s seq, o offset (omitted: 0), c completions, f finished (1; omitted: not), a
adapter id (omitted: 0), and on the first or final chunk lora, m metrics, w worker, e
error, ek its kind, p prompt, pi prompt ids, pl prompt logprobs. Delta: t text, k
token ids, i index (omitted: 0), o offset (omitted: the chunk's), l logprobs, c
cumulative logprob, f finish reason, r stop reason. The request id is the key's or
channel's, never written. Version 2 (``v``, omitted): the same keys and values the
compact dict before this definition wrote, so readers of either version (the Lua
scripts that look for ``"f": 1`` included) read both. Torch-free.
"""

from __future__ import annotations

import msgspec
from msgspec.structs import replace

from lorapool.records.error_kind import read_kind
from lorapool.records.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    logprobs_from_wire,
    logprobs_to_wire,
)
from lorapool.records.params import LoRARequest

CHUNK_VERSION = 2


class Delta(msgspec.Struct, omit_defaults=True, kw_only=True, gc=False):
    """One completion's part of a chunk: its text and tokens since the last chunk."""

    text: str = msgspec.field(name="t")
    token_ids: list[int] = msgspec.field(name="k")
    index: int = msgspec.field(default=0, name="i")
    # tokens of this completion before the delta; None: the chunk's (n = 1 always)
    offset: int | None = msgspec.field(default=None, name="o")
    logprobs: list | None = msgspec.field(default=None, name="l")  # logprobs_to_wire
    cumulative_logprob: float | None = msgspec.field(default=None, name="c")
    finish_reason: str | None = msgspec.field(default=None, name="f")
    stop_reason: int | str | None = msgspec.field(default=None, name="r")

    @classmethod
    def of(cls, c: CompletionOutput, offset: int | None = None) -> Delta:
        """The delta of an engine's completion output."""
        return cls(
            text=c.text,
            token_ids=list(c.token_ids),
            index=c.index,
            offset=offset,
            logprobs=logprobs_to_wire(c.logprobs),
            cumulative_logprob=c.cumulative_logprob,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def to_output(self, lora: LoRARequest | None) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.cumulative_logprob,
            logprobs_from_wire(self.logprobs),
            self.finish_reason,
            self.stop_reason,
            lora,
        )


class Chunk(msgspec.Struct, omit_defaults=True, kw_only=True, gc=False):
    """One delta of a request's output: what the chunk log holds per step."""

    seq: int = msgspec.field(name="s")  # 0, 1, 2, ... per request, continuing across failover
    offset: int = msgspec.field(default=0, name="o")  # tokens of all completions before it
    outputs: list[Delta] = msgspec.field(name="c")
    finished: bool | int = msgspec.field(default=False, name="f")  # wire: 1; read: a bool
    adapter_id: int = msgspec.field(default=0, name="a")  # 0 = base model
    lora_request: LoRARequest | None = msgspec.field(default=None, name="lora")
    metrics: RequestMetrics | None = msgspec.field(default=None, name="m")
    worker: str | None = msgspec.field(default=None, name="w")
    error: str | None = msgspec.field(default=None, name="e")
    error_kind: str | None = msgspec.field(default=None, name="ek")  # an ErrorKind once read
    # the refused job field's path (``FieldError.field``), when the refusal named one:
    # readers name the request's parameter from it, never from the message's words
    error_field: str | None = msgspec.field(default=None, name="ep")
    prompt: str | None = msgspec.field(default=None, name="p")  # first chunk only
    prompt_token_ids: list[int] | None = msgspec.field(default=None, name="pi")  # first only
    prompt_logprobs: list | None = msgspec.field(default=None, name="pl")  # first, when asked
    version: int = msgspec.field(default=CHUNK_VERSION, name="v")
    request_id: str = ""  # the key's; never on the wire (``encode_chunk``)

    @property
    def num_tokens(self) -> int:
        return sum(len(d.token_ids) for d in self.outputs)

    def offset_of(self, delta: Delta) -> int:
        """Tokens of ``delta``'s completion before it."""
        return self.offset if delta.offset is None else delta.offset

    def to_output(self) -> RequestOutput:
        """This chunk as a delta RequestOutput (completion texts and tokens are deltas)."""
        lora = self.lora_request
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            logprobs_from_wire(self.prompt_logprobs),
            [d.to_output(lora) for d in self.outputs],
            bool(self.finished),
            self.metrics,
            lora,
            error=self.error,
            error_kind=self.error_kind,
            worker=self.worker,
            error_field=self.error_field,
        )


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Chunk)


def encode_chunk(chunk: Chunk) -> bytes:
    """The chunk's compact JSON: without its request id, a completion's offset left out
    where it is the chunk's, and ``"f": 1`` for finished (what APPEND's and END_UNREAD's
    Lua, of this version and the one before, look for)."""
    offset, outputs = chunk.offset, chunk.outputs
    for d in outputs:
        if d.offset == offset:
            outputs = [d if d.offset != offset else replace(d, offset=None) for d in outputs]
            break
    wire = replace(chunk, request_id="", outputs=outputs)
    if chunk.finished:
        wire.finished = 1
    return _ENCODER.encode(wire)


def decode_chunk(payload: bytes | str | None, request_id: str = "") -> Chunk:
    """A validated Chunk of ``request_id``; ValueError naming the problem when malformed."""
    if payload is None:
        raise ValueError("malformed chunk: no 'data' field")
    try:
        chunk = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed chunk of {request_id!r}: {exc}") from None
    if chunk.version != CHUNK_VERSION:
        raise ValueError(
            f"unknown wire version {chunk.version!r} in chunk (this build speaks {CHUNK_VERSION})"
        )
    chunk.request_id, chunk.finished = request_id, bool(chunk.finished)  # older: 1
    if chunk.error is not None:
        chunk.error_kind = read_kind(chunk.error_kind, chunk.error)
    return chunk
