"""What a job asks the engine to continue: its prompt, or its chat under the model's
chat template (applied here, as ``LLM.chat`` does, so the gateway needs no tokenizer)."""

from __future__ import annotations

from typing import Any

from lorapool.lifecycle.wire import Job
from lorapool.tool_calls import plain_chat, renders_tools, template_chat


def engine_prompt(job: Job, engine: Any) -> str | dict[str, Any]:
    """The prompt ``engine.add_request`` takes for ``job``.

    A chat job's messages go through the engine tokenizer's chat template with the
    generation prompt added, the text then tokenized like any prompt: the same
    tokens ``LLM.chat`` runs. Tools, tool calls and tool results go to a template that
    renders them (``tools=``, vLLM's way); a template without a place for them gets
    them as text (``lorapool.tool_calls.plain_chat``). An engine without a tokenizer,
    or a template that refuses the messages, fails this request alone (the worker's
    ``start``).
    """
    if job.messages is None:
        return job.engine_prompt
    tokenizer = engine.get_tokenizer()
    messages, extra = job.messages, {}
    uses_tools = job.tools or any("tool_calls" in m or m["role"] == "tool" for m in messages)
    if uses_tools and renders_tools(tokenizer.chat_template):
        messages, extra = template_chat(messages), {"tools": job.tools}
    elif uses_tools:
        messages = plain_chat(messages, job.tools)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **extra
    )
