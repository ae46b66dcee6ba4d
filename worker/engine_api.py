"""What a worker needs of an engine: the whole surface it drives.

``LLMEngine`` implements it (its reads in ``engine/engine_stats.py``); so does
the stand-in for a GPU engine (``benchmarks/standin_engine.py``), which is how
the queue path is measured at GPU step rates on a machine without one, and
tests/unit/test_engine_interface.py holds both to it. The worker reaches nothing
else of the engine (no scheduler, no engine args) and probes for nothing: an
engine without a tokenizer, adapters or a KV cache says so through these methods.
"""

from __future__ import annotations

from typing import Any, Protocol

from lorapool.adapter_config import AdapterIdentity
from lorapool.outputs import RequestOutput
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records.adapter import AdapterRecord


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
        **share: Any,
    ) -> None:
        """Queue a request (outputs come as deltas); ValueError names what is wrong.
        ``share``: ``tenant`` and ``tenant_weight`` for a job with a tenant only
        (``worker.prompt.tenant_share``; an engine may ignore them)."""

    def step(self) -> list[RequestOutput]:
        """Advance every running request; the outputs of those that advanced."""

    def abort_request(self, request_id: str | list[str]) -> None:
        """End requests now (each gets a final output with finish_reason 'abort')."""

    def expect_lora(
        self, lora_request: LoRARequest, registered: AdapterRecord
    ) -> AdapterIdentity | None:
        """Load the adapter (if not loaded) only if its files are the registered ones
        (weights and config hashes); its identity as loaded, which the audit record
        carries (None: an engine that loads no files). ValueError saying what changed."""

    def has_unfinished_requests(self) -> bool: ...

    def capacity(self, ahead: int = 0) -> int:
        """How many new requests to take now (free sequence slots, and ``ahead`` more to
        wait beyond them; 0 while a waiting one starves or no block is free)."""

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences."""

    def running_request_ids(self) -> set[str]:
        """The requests of the running batch: those a step that raises fails."""

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (a ``transformers`` one: chat templates, the gateway's
        ``/tokenize``), or None for an engine without one (its chat jobs fail)."""

    def lora_state(self) -> dict[str, Any]:
        """{"device": [adapter names in device slots, least recently used first],
        "cpu": [names in the CPU cache], "max_loras": slots} (all empty: no adapters)."""

    def kv_cache_usage(self) -> float | None:
        """Share (0..1) of the KV cache's blocks in use; None: no KV cache to report."""

    def request_limits(self) -> dict[str, int]:
        """The bounds ``add_request`` holds a request to, for the gateway to check first
        ({"max_model_len", "max_logprobs", "kv_capacity_tokens"}; {}: none said)."""

    def step_stats(self) -> dict[str, int]:
        """Counters of the last step for metrics ({"num_step_tokens",
        "num_preemptions"}; {}: none kept)."""

    def cache_config(self) -> dict[str, Any] | None:
        """The KV cache's configuration (vLLM's ``cache_config_info``), or None."""
