"""The pool's tokenizer in the gateway, for vLLM's ``/tokenize`` and ``/detokenize``.

The gateway has no model files: each worker publishes its tokenizer (tokenizer.json,
chat template, special tokens) under ``{p}:tokenizer`` (``worker.pool``), and the
gateway loads it with Hugging Face's ``tokenizers`` (Rust, no torch), imported on the
first call. Chats are rendered with the chat template under jinja2's sandbox, set up
as transformers sets it up (trim_blocks, lstrip_blocks, loop controls, its ``tojson``,
``raise_exception``, ``strftime_now``), tools as the worker renders them
(``lorapool.tool_calls``).
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from typing import Any

import orjson

from lorapool.tool_calls import plain_chat, renders_tools, template_chat


class PoolTokenizer:
    """One published tokenizer record, loaded."""

    def __init__(self, record: dict[str, Any]):
        from tokenizers import Tokenizer

        self.sha256 = record.get("sha256")
        self.tokenizer = Tokenizer.from_str(record["tokenizer"])
        self.chat_template = record.get("chat_template")
        self.special = record.get("special") or {}
        self.clean_up = bool(record.get("clean_up_tokenization_spaces"))
        self._template = None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # the batch call: it releases the GIL (``encode`` holds it: a 1 MiB prompt
        # stalled every other thread, the event loop's too, for ~0.5 s)
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def token_strs(self, ids: list[int]) -> list[str | None]:
        return [self.tokenizer.id_to_token(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        """As transformers' ``decode`` with its defaults (special tokens kept)."""
        text = self.tokenizer.decode_batch([ids], skip_special_tokens=False)[0]
        return _clean_up(text) if self.clean_up else text

    def render(
        self, messages: list[dict[str, Any]], tools: list | None, add_generation_prompt: bool
    ) -> str:
        """The chat as the worker renders it (``worker.prompt.engine_prompt``)."""
        if not isinstance(self.chat_template, str):
            raise ValueError("the pool's tokenizer has no chat template")
        uses_tools = tools or any("tool_calls" in m or m["role"] == "tool" for m in messages)
        extra: dict[str, Any] = {}
        if uses_tools and renders_tools(self.chat_template):
            messages, extra = template_chat(messages), {"tools": tools}
        elif uses_tools:
            messages = plain_chat(messages, tools)
        if self._template is None:
            self._template = _compile(self.chat_template)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special, **extra
        )


def _compile(template: str):
    """The template in jinja2's sandbox as transformers compiles chat templates."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
        text = text.replace(before, after)
    return re.sub(r" (n't|'m|'s|'ve|'re)", r"\1", text)


class TokenizerCache:
    """The pool's PoolTokenizer; its sha256 looked up at most every ``CHECK_S`` (the
    record, megabytes, is read only when a worker published another)."""

    CHECK_S = 5.0

    def __init__(self):
        self._loaded: PoolTokenizer | None = None
        self._checked = -self.CHECK_S

    async def get(self, redis, key: str) -> PoolTokenizer | None:
        if self._loaded is not None and time.monotonic() - self._checked < self.CHECK_S:
            return self._loaded
        sha = await redis.hget(key, "sha256")
        self._checked = time.monotonic()
        if sha is None:
            self._loaded = None
        elif self._loaded is None or self._loaded.sha256 != sha.decode():
            raw = await redis.hget(key, "record")
            self._loaded = None if raw is None else PoolTokenizer(orjson.loads(raw))
        return self._loaded
