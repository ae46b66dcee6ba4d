"""Requests and their sequences: the engine's bookkeeping, plain Python.

A Request holds one prompt and ``n`` Sequences (one per completion). A
Sequence's tokens are its prompt followed by what it generated; its KV lives in
the blocks of its block table, and ``num_computed_tokens`` of its tokens are
already in the cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from lorapool.outputs import RequestMetrics
from lorapool.protocol import LoRARequest, SamplingParams

# a token not yet read back (async scheduling's step in flight holds it on the device):
# never reaches the model or the sampler as such (``async_scheduling.fill_places``,
# ``penalties.apply_penalties``'s ``pending``)
PLACEHOLDER = -1


class SequenceStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PromptAndOutput:
    """A prompt and what was generated after it, as one list: ``token_ids`` holds both,
    its first ``num_prompt_tokens`` the prompt (``SamplingRow`` shares a sequence's)."""

    __slots__ = ()
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Sequence(PromptAndOutput):
    """One completion of a request: its tokens, KV blocks and finish state."""

    def __init__(self, seq_id: int, request: Request, index: int, token_ids: list[int]):
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)  # prompt + output
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict] = []
        self.num_preemptions = 0
        self.detokenizer: Any = None  # set by the engine's output processor
        self.num_sent_tokens = 0  # output tokens already in a streamed output
        self.sent_text = ""  # output text already streamed (CUMULATIVE, FINAL_ONLY only)
        self.guide: Any = None  # a structured output's grammar state (engine.guide.Guide)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def lora_int_id(self) -> int:
        """The adapter id, 0 for the base model."""
        return self.request.lora_int_id

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preempted: its KV is dropped and will be recomputed from its tokens."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request.request_id}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )


@dataclass
class Request:
    """One add_request call: a prompt, its sampling params, adapter and sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None
    arrival_time: float = field(default_factory=time.time)
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    error: str | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    max_tokens: int = 16  # params.max_tokens resolved against the model length
    resumed_token_ids: list[int] = field(default_factory=list)  # generated elsewhere, streamed
    guided: bool = False  # has a structured output (its sequences carry a Guide)
    argmax_only: bool = False  # takes the raw argmax: sampler.argmax_only, n == 1, no grammar
    device_only: bool = False  # samples on the device alone, nothing read back: no grammar
    tenant: str = ""  # whose share of the engine it runs in ("": the default tenant)
    weight: float = 1.0  # the tenant's weight (engine.fair_share)
    priority: int = 0  # vLLM's: lower first, among its tenant's requests

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = RequestMetrics(
                arrival_time=self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids)
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) != self.params.n:
            return False
        if len(seqs) == 1:
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.is_finished for s in seqs)

    @property
    def needs_fork(self) -> bool:
        """n > 1 and the first sequence is about to sample its first token."""
        return self.params.n > 1 and len(self.seqs) == 1
