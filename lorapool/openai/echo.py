"""Completions' ``echo``: the prompt before each choice's text, and before its logprobs
(the prompt's own, computed by the worker as ``prompt_logprobs``; its first token has
none, as OpenAI's). A prompt given as token ids is decoded with the pool's tokenizer
(``tokenizer.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorapool.openai.logprobs import echo_logprobs


class Echo:
    """The prompts of one response's jobs, and which choices have had theirs."""

    def __init__(self, decode: Callable[[list[int]], str] | None, top: int):
        self.decode, self.top = decode, top
        self.prompts: dict[int, tuple[str, list[int], list | None]] = {}  # job -> prompt
        self.echoed: set[int] = set()  # choice indexes

    def remember(self, job: int, text: str | None, ids: list[int] | None, positions) -> None:
        """Job ``job``'s prompt, from its first chunk (or its final output)."""
        ids = list(ids or ())
        if text is None:
            text = self.decode(ids) if self.decode is not None and ids else ""
        self.prompts[job] = (text, ids, positions)

    def head(self, job: int, index: int, logprobs: bool) -> tuple[str, dict[str, Any] | None]:
        """(the prompt text, its logprobs) to put before choice ``index``'s first delta;
        ("", None) after that."""
        if index in self.echoed or job not in self.prompts:
            return "", None
        self.echoed.add(index)
        text, ids, positions = self.prompts[job]
        if not logprobs:
            return text, None
        first = self.decode(ids[:1]) if self.decode is not None and ids else ""
        return text, echo_logprobs(ids, positions, self.top, first)
