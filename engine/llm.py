"""LLM: vLLM's offline API, ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec

from lorapool.engine.config import EngineArgs
from lorapool.engine.llm_engine import LLMEngine
from lorapool.outputs import RequestOutput
from lorapool.protocol import LoRARequest, RequestOutputKind, SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    """Generates for a list of prompts at once; engine options as keyword arguments."""

    def __init__(self, model: str, **engine_args: Any):
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the prompts' order.

        ``sampling_params`` and ``lora_request`` are one for all prompts or a
        list with one per prompt (``None`` in the list: the base model).
        """
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        ids = []
        for prompt, p, lora in zip(prompts, params, loras):
            request_id = str(next(self._ids))
            final_only = msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            self.llm_engine.add_request(request_id, prompt, final_only, lora_request=lora)
            ids.append(request_id)
        return self._run(ids)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one or several conversations, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, lora_request)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while wanted - finished.keys():
            for output in self.llm_engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
