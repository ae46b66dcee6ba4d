"""What a queue worker reads of an engine besides add/step/abort (``worker.engine_api``)
and what its metrics show: capacity, counts, limits, KV-cache and adapter state.

A mixin of ``LLMEngine``: plain reads of its scheduler, block manager and LoRA manager.
"""

from __future__ import annotations

from typing import Any


class EngineStats:
    """The engine's state as a worker and its metrics read it."""

    def capacity(self, ahead: int = 0) -> int:
        """How many new requests to take now: the request slots free (``max_num_seqs``
        requests at most, whatever their ``n``), none when sequences wait and no block
        is free or a waiting one starves (the scheduler then admits nothing ahead of
        it): a request waiting for blocks does not stop the worker from reading others
        that fit, and what cannot run here soon is left to other workers.

        Requests, not sequences: a tenant's request of n=64 samples running here does
        not close the intake to another tenant's job, which the fair-share scheduler
        then admits at the next free sequence slot (``engine.fair_share``). The
        sequences a step runs stay within ``max_num_seqs`` (``Scheduler.fork``).

        ``ahead``: requests taken beyond the slots, to wait here (the worker's read-ahead,
        so that the fair share can pick among them): at most ``max_num_seqs + ahead``
        requests are here after the read.
        """
        free = self.args.max_num_seqs + ahead - len(self.requests)
        scheduler = self.scheduler
        if scheduler.waiting and (self.block_manager.num_free_blocks == 0 or scheduler.starving()):
            return 0
        return max(0, free)

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences; waiting counts those whose grammar compiles."""
        return len(self.scheduler.running), len(self.scheduler.waiting) + len(self.grammars)

    def running_request_ids(self) -> set[str]:
        """The requests in the running batch (those a failed step may have touched)."""
        return {seq.request.request_id for seq in self.scheduler.running}

    def request_limits(self) -> dict[str, int]:
        """The bounds ``add_request`` holds a request to, for a gateway to check first:
        the context, ``max_logprobs`` and the KV cache's token slots (a request's n
        sequences must fit in them together: ``InputProcessor``)."""
        return {
            "max_model_len": self.max_model_len,
            "max_logprobs": self.args.max_logprobs,
            "kv_capacity_tokens": self.block_manager.capacity_tokens,
        }

    def kv_cache_usage(self) -> float:
        """Share (0..1) of the KV cache's blocks held by requests (for metrics)."""
        return 1.0 - self.block_manager.num_free_blocks / self.block_manager.num_blocks

    def lora_state(self) -> dict[str, Any]:
        """Adapter names in device slots and in the CPU cache, and the slot count."""
        loras = self.lora_manager
        if loras is None:
            return {"device": [], "cpu": [], "max_loras": 0}
        names = {i: a.lora_request.lora_name for i, a in loras.cpu.items()}
        device = [names[i] for i in loras.slot_lru if i in names]
        return {"device": device, "cpu": list(names.values()), "max_loras": loras.max_loras}

    @property
    def device_name(self) -> str:
        return str(self.args.resolve_device())

    def step_stats(self) -> dict[str, int]:
        """Counters for metrics: tokens of the last step (vLLM's iteration tokens) and
        preemptions so far."""
        return {
            "num_step_tokens": self.num_step_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
        }

    def cache_config(self) -> dict[str, Any]:
        """The KV cache's configuration (vLLM's ``cache_config_info`` labels)."""
        return {
            "block_size": self.args.block_size,
            "num_gpu_blocks": self.block_manager.num_blocks,
            "enable_prefix_caching": self.args.enable_prefix_caching,
            "cache_dtype": str(self.runner.dtype).removeprefix("torch."),
        }
