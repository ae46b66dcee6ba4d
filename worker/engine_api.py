"""What a worker needs of an engine: the whole surface it drives.

``LLMEngine`` implements it; so does the benchmark's stand-in for a GPU engine
(``benchmarks/queue_gpu.py``), which is how the queue path is measured at GPU
step rates on a machine without one. The worker reaches nothing else of the
engine (no scheduler, no engine args).
"""

from __future__ import annotations

from typing import Any, Protocol

from lorapool.outputs import RequestOutput
from lorapool.protocol import LoRARequest, SamplingParams


class EngineInterface(Protocol):
    device_name: str  # for ``lorapool status``

    # As the worker calls it: every argument given, the last three by keyword
    # (an engine may default them, as ``LLMEngine`` does).
    def add_request(
        self,
        request_id: str,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        *,
        arrival_time: float,
        lora_request: LoRARequest | None,
        resume_token_ids: list[int],
    ) -> None:
        """Queue a request (outputs come as deltas); ValueError names what is wrong."""

    def step(self) -> list[RequestOutput]:
        """Advance every running request; the outputs of those that advanced."""

    def abort_request(self, request_id: str | list[str]) -> None:
        """End requests now (each gets a final output with finish_reason 'abort')."""

    def expect_lora_weights(self, lora_request: LoRARequest, sha256: str) -> None:
        """Load the adapter only if its weights hash to ``sha256``."""

    def has_unfinished_requests(self) -> bool: ...

    def capacity(self) -> int:
        """How many new requests to take now (free sequence slots; 0 while a waiting
        one starves or no block is free)."""

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences."""

    def running_request_ids(self) -> set[str]:
        """The requests of the running batch: those a step that raises fails."""
