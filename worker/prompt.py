"""What a job asks the engine to continue: its prompt, or its chat under the model's
chat template (applied here, as ``LLM.chat`` does, so the gateway needs no tokenizer)."""

from __future__ import annotations

from typing import Any

from lorapool.lifecycle.wire import Job


def engine_prompt(job: Job, engine: Any) -> str | dict[str, Any]:
    """The prompt ``engine.add_request`` takes for ``job``.

    A chat job's messages go through the engine tokenizer's chat template with the
    generation prompt added, the text then tokenized like any prompt: the same
    tokens ``LLM.chat`` runs. An engine without a tokenizer, or a template that
    refuses the messages, fails this request alone (the worker's ``start``).
    """
    if job.messages is None:
        return job.engine_prompt
    tokenizer = engine.get_tokenizer()
    return tokenizer.apply_chat_template(job.messages, tokenize=False, add_generation_prompt=True)
