"""The engine's adapters: vLLM's LoRA methods (``add_lora``, ``remove_lora``, ...) and
the step's activation of the adapters its sequences want.

A mixin of ``LLMEngine``: calls on its LoRA manager, block manager and requests.
"""

from __future__ import annotations

from typing import Any

from lorapool.adapter_config import AdapterIdentity
from lorapool.engine.lora.manager import LoRAManager, adapter_key
from lorapool.engine.scheduler import SchedulerOutput
from lorapool.protocol import LoRARequest
from lorapool.records.errors import FieldError


class EngineAdapters:
    """The adapters of an engine started with ``enable_lora``."""

    def _activate_loras(self, scheduled: SchedulerOutput) -> None:
        """Adapters of the step into device slots; requests of one that fails to load fail."""
        wanted = [item.seq.request.lora_request for item in scheduled.scheduled]
        errors = self.lora_manager.activate(r for r in wanted if r is not None)
        if not errors:
            return
        for request in list(self.requests.values()):
            error = request.lora_request and errors.get(adapter_key(request.lora_request))
            if error:
                self.fail_request(request.request_id, str(error))
        scheduled.scheduled = [
            s for s in scheduled.scheduled if s.seq.request.request_id in self.requests
        ]

    # --- adapters (vLLM's names) -------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and validate an adapter ahead of its requests; raises AdapterError."""
        return self._loras().add_lora(lora_request)

    def expect_lora(self, lora_request: LoRARequest, registered: Any) -> AdapterIdentity:
        """Check now that ``lora_request``'s adapter files are ``registered``'s (the
        registry's record: weights sha256, config sha256, ``adapter_config``), loading
        it when the CPU cache has room; its identity, which every later load must match.

        Raises AdapterError saying what changed since registration (the request fails
        alone, before it runs); a later load that finds other files fails that
        adapter's requests with the same message.
        """
        return self._loras().check(lora_request, registered)

    def remove_lora(self, lora_id: int) -> bool:
        self.block_manager.forget_adapter(lora_id)  # the id may come back with other weights
        return self._loras().remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._loras().pin_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self._loras().list_loras()

    def _loras(self) -> LoRAManager:
        if self.lora_manager is None:  # a request naming an adapter is refused for it
            raise FieldError(
                "LoRA is not enabled: start the engine with enable_lora=True", field="adapter"
            )
        return self.lora_manager
