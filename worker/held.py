"""What a worker keeps per entry it holds, and how engine outputs become chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
from msgspec.structs import replace

from lorapool.outputs import RequestMetrics, RequestOutput, logprobs_to_wire
from lorapool.protocol import RequestOutputKind, SamplingParams
from lorapool.records.accumulator import Accumulator
from lorapool.records.adapter import AdapterRecord
from lorapool.records.chunk import Chunk, Delta
from lorapool.records.error_kind import ErrorKind
from lorapool.records.job import Job


class Position(NamedTuple):
    """Where a chunk goes: its seq, the tokens before it, each completion's offset."""

    seq: int
    total: int
    offsets: dict[int, int]  # completion index -> its tokens before the chunk


@dataclass
class Held:
    """One request this worker runs: its entry, job, adapter record and stream position."""

    entry_id: str
    job: Job
    adapter: AdapterRecord | None = None  # registry record, None for the base model
    seq: int = 0  # seq of the next chunk
    total: int = 0  # tokens of all completions already in the log
    offsets: dict[int, int] = field(default_factory=dict)  # per completion index
    resumed_tokens: int = 0  # tokens generated before this worker took over
    kept: Accumulator = field(default_factory=Accumulator)  # the chunks in the log
    stream: str = ""  # the stream its entry came from ('': the interactive one)
    # an append of this run found the job's marker naming this entry: APPEND need not
    # read it for the next chunks (``lifecycle.append``: SKIP)
    fenced: bool = False

    @property
    def request_id(self) -> str:
        return self.job.request_id

    def advance(self, outs: list[RequestOutput]) -> Position:
        """The position of the next chunk, for engine outputs ``outs`` (one or more steps'
        deltas, merged into the chunk by ``merged``); moves past them. O(completions):
        the token counts only, so the worker's thread does not merge."""
        offsets, tokens = {}, 0
        for out in outs:
            for c in out.outputs:
                before = self.offsets.get(c.index, 0)
                offsets.setdefault(c.index, before)
                self.offsets[c.index] = before + len(c.token_ids)
                tokens += len(c.token_ids)
        position = Position(self.seq, self.total, offsets)
        self.seq += 1
        self.total += tokens
        return position

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The original prompt's tokens (the first chunk's)."""
        return self.kept.prompt_token_ids

    def keep(self, chunk: Chunk) -> None:
        """Keep what ``chunk`` holds for the whole output: O(its tokens), no copies of
        what came before. (The sender's thread does this, in chunk order.)"""
        self.kept.add(chunk)

    def take(self, chunk: Chunk) -> None:
        """Account a chunk already in the log (replayed on resume, or an error chunk):
        keep it and move past it."""
        self.keep(chunk)
        for out in chunk.outputs:
            self.offsets[out.index] = chunk.offset_of(out) + len(out.token_ids)
        self.seq = chunk.seq + 1
        self.total = chunk.offset + chunk.num_tokens

    def whole(self) -> Chunk | None:
        """Everything in the log so far as one chunk from offset 0: the record a
        finished request's log is compacted into."""
        return self.kept.whole(self.request_id)


def engine_params(params: SamplingParams) -> SamplingParams:
    """The job's params as the engine runs them: deltas (the client rebuilds its kind)."""
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.DELTA)


def resumed_token_ids(held: Held) -> list[int]:
    """Tokens of ``held`` already in the chunk log: the engine continues after them."""
    first = held.kept.completions.get(0)
    return [] if first is None else list(first.token_ids)


def _chunk(held: Held, seq: int, offset: int, outputs: list, finished: bool, error=None) -> Chunk:
    """A chunk of ``held``: the adapter in full on the first (seq 0) and the last. (The
    sender builds one per request per trip: a Struct built in C, attribute reads.)"""
    lora = held.job.lora_request
    chunk = Chunk(
        request_id=held.job.request_id,
        seq=seq,
        offset=offset,
        outputs=outputs,
        finished=finished,
        error=error,
    )
    if lora is not None:
        chunk.adapter_id = lora.lora_int_id
        if seq == 0 or finished:
            chunk.lora_request = lora
    return chunk


def merged(outs: list[RequestOutput]) -> RequestOutput:
    """One request's deltas of consecutive steps as one (the first, extended in place),
    as ``RequestOutput.add(aggregate=True)`` would; one join per field when each holds
    the same one completion (n = 1, the common case)."""
    out = outs[0]
    if len(outs) == 1:
        return out
    completions = []
    for o in outs:
        if len(o.outputs) != 1 or o.outputs[0].index != out.outputs[0].index:
            for later in outs[1:]:
                out.add(later, aggregate=True)
            return out
        completions.append(o.outputs[0])
    for later in outs[1:]:  # the request's own fields: the latest that says something
        out.finished = out.finished or later.finished
        if later.metrics is not None:
            out.metrics = later.metrics
        if later.error is not None:
            out.error, out.error_kind = later.error, later.error_kind
        if later.worker is not None:
            out.worker = later.worker
        if later.num_cached_tokens is not None:
            out.num_cached_tokens = later.num_cached_tokens
        if later.prompt_logprobs is not None:
            out.prompt_logprobs = later.prompt_logprobs
    first, last = completions[0], completions[-1]
    first.text = "".join([c.text for c in completions])
    first.token_ids = [t for c in completions for t in c.token_ids]
    if any(c.logprobs is not None for c in completions[1:]):
        first.logprobs = [lp for c in completions for lp in (c.logprobs or ())]
    first.cumulative_logprob = last.cumulative_logprob
    first.finish_reason, first.stop_reason = last.finish_reason, last.stop_reason
    for c in completions[1:]:
        if c.lora_request is not None:
            first.lora_request = c.lora_request
    return out


def make_chunk(held: Held, out: RequestOutput, worker: str, position: Position) -> Chunk:
    """The chunk of ``held`` at ``position`` (``Held.advance``) from one engine delta."""
    offsets, seq, finished = position.offsets, position.seq, out.finished
    total = position.total
    outputs = [Delta.of(c, None if (o := offsets[c.index]) == total else o) for c in out.outputs]
    chunk = _chunk(held, seq, total, outputs, finished, out.error)
    if out.error is not None:  # the engine ended it alone (its adapter, its grammar)
        chunk.error_kind = out.error_kind or ErrorKind.REQUEST
    if seq == 0:
        chunk.prompt = held.job.prompt if held.job.prompt is not None else out.prompt
        chunk.prompt_token_ids = list(out.prompt_token_ids or [])
        chunk.prompt_logprobs = logprobs_to_wire(out.prompt_logprobs)
    if finished:
        chunk.worker = worker
        chunk.metrics = _metrics(held, out, position.total)
    return chunk


def _metrics(held: Held, out: RequestOutput, before: int) -> RequestMetrics | None:
    if out.metrics is None:
        return None
    prompt = held.prompt_token_ids
    return replace(
        out.metrics,
        arrival_time=held.job.arrival_time,
        num_prompt_tokens=out.metrics.num_prompt_tokens if prompt is None else len(prompt),
        num_generated_tokens=before + sum(len(c.token_ids) for c in out.outputs),
    )


def error_chunk(
    held: Held, error: str, worker: str, kind: ErrorKind, field: str | None = None
) -> Chunk:
    """A final chunk that fails ``held`` with ``error`` of ``kind`` (carrying its adapter);
    ``field``: the path of the job field a refusal is about, when it names one."""
    n = held.job.sampling_params.n
    outputs = [
        Delta(
            text="",
            token_ids=[],
            index=i,
            offset=None if (o := held.offsets.get(i, 0)) == held.total else o,
            finish_reason="error",
        )
        for i in range(n)
    ]
    chunk = _chunk(held, held.seq, held.total, outputs, True, error)
    chunk.worker, chunk.metrics, chunk.error_kind = worker, _error_metrics(held), kind
    chunk.error_field = field
    if held.seq == 0:
        chunk.prompt, chunk.prompt_token_ids = held.job.prompt, held.job.prompt_token_ids
    return chunk


def _error_metrics(held: Held) -> RequestMetrics:
    """What is known of a request that failed: arrival, end and token counts."""
    prompt = held.prompt_token_ids or held.job.prompt_token_ids or []
    return RequestMetrics(
        arrival_time=held.job.arrival_time or time.time(),
        finished_time=time.time(),
        num_prompt_tokens=len(prompt),
        num_generated_tokens=held.total,
    )
