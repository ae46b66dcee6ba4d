"""One request's output accumulated from its delta chunks, in order: what a worker keeps
to compact a finished request's log into one record (``Held``), and what a reader builds
its cumulative outputs from (``OutputAssembler``).

O(a chunk's tokens) per chunk: a completion's text pieces go on a list, its token ids
and logprobs onto flat lists; nothing that came before is copied. The whole is built
when asked: once per request for the final record, once per output for a cumulative
reader (its text joined, its flat lists copied: a memcpy each, never a deep copy).
"""

from __future__ import annotations

import msgspec

from lorapool.records.chunk import Chunk, Delta
from lorapool.records.outputs import CompletionOutput


class Completion:
    """One completion's part of the output: pieces appended per chunk, joined on demand.

    ``last`` is the latest delta as its caller keeps it (a chunk's ``Delta``, or a
    CompletionOutput): its finish and stop reasons and cumulative logprob are the
    completion's."""

    __slots__ = ("index", "token_ids", "pieces", "logprobs", "last")

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.pieces: list[str] = []
        self.logprobs: list | None = None  # None until a delta carries some
        self.last: Delta | CompletionOutput | None = None

    def add(
        self, text: str, token_ids: list[int], logprobs: list | None, last: Delta | CompletionOutput
    ) -> None:
        self.token_ids += token_ids
        self.pieces.append(text)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += logprobs
        self.last = last

    @property
    def text(self) -> str:
        """The whole text so far (joined once; later calls join only what came since)."""
        if len(self.pieces) != 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0]

    def whole(self) -> Delta:
        """The whole completion as one delta from its start (``last`` a ``Delta``)."""
        return msgspec.structs.replace(
            self.last, offset=None, text=self.text, token_ids=self.token_ids, logprobs=self.logprobs
        )


class Accumulator:
    """A request's chunks, kept in order (``add``), and the whole output (``whole``)."""

    def __init__(self):
        self.completions: dict[int, Completion] = {}
        self.first: Chunk | None = None  # the first chunk kept
        self.last: Chunk | None = None  # the latest
        self.prompt: str | None = None  # the first chunk's
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: list | None = None  # the first chunk's, when asked

    def add(self, chunk: Chunk, outputs: list | None = None) -> None:
        """Keep what ``chunk`` holds. ``outputs``: its completions as the caller keeps
        them (a reader's CompletionOutputs); by default the chunk's ``Delta``s."""
        if self.first is None:
            self.first = chunk
        if chunk.prompt_token_ids is not None:
            self.prompt, self.prompt_token_ids = chunk.prompt, list(chunk.prompt_token_ids)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if outputs is None:
            outputs = chunk.outputs
        for out in outputs:
            self.completion(out.index).add(out.text, out.token_ids, out.logprobs, out)
        self.last = chunk

    def completion(self, index: int) -> Completion:
        """Completion ``index`` (created empty on first use)."""
        completion = self.completions.get(index)
        if completion is None:
            completion = self.completions[index] = Completion(index)
        return completion

    def in_order(self) -> list[Completion]:
        """The completions by index."""
        return [c for _, c in sorted(self.completions.items())]

    def whole(self, request_id: str) -> Chunk | None:
        """Everything kept so far as one chunk from offset 0 (kept as ``Delta``s): the
        record a finished request's log is compacted into."""
        if self.first is None:
            return None
        last = self.last
        return Chunk(
            request_id=request_id,
            seq=last.seq,
            offset=0,
            outputs=[c.whole() for c in self.in_order()],
            finished=last.finished,
            lora_request=last.lora_request or self.first.lora_request,
            adapter_id=last.adapter_id,
            metrics=last.metrics,
            worker=last.worker,
            error=last.error,
            error_kind=last.error_kind,
            error_field=last.error_field,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
        )
