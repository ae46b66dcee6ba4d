"""lorapool's outputs in OpenAI's response shapes: completions, chat completions, their
stream chunks and ``usage``."""

from __future__ import annotations

import time
from typing import Any

from lorapool.gateway.errors import failed_request
from lorapool.gateway.logprobs import chat_logprobs, completion_logprobs
from lorapool.lifecycle.wire import Chunk
from lorapool.outputs import RequestOutput


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def check_failed(output: RequestOutput | Chunk, public_id: str, names=None) -> None:
    """A request that failed on its worker: 500 for an engine fault, else 400 naming the
    parameter (a prompt too long for the model, a token outside its vocabulary), with
    the job id the client knows (``public_id``)."""
    if output.error:
        raise failed_request(output.error, output.request_id, public_id, names)


class Shape:
    """One response's identity and the shape of its choices (completion or chat)."""

    def __init__(
        self,
        kind: str,
        public_id: str,
        model: str,
        n: int,
        top: int = 0,
        public=None,
        names: dict[str, str] | None = None,
    ):
        """``public_id``: the response's id after ``cmpl-`` (never the tenant's name);
        ``public``: a job's request id -> the id its client knows; ``names``: job field ->
        the request's parameter (chat's ``top_logprobs``)."""
        self.chat = kind == "chat"
        self.top = top  # logprobs: the top alternatives per token
        self.chars: dict[int, int] = {}  # per choice: token text streamed (text_offset)
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{public_id}"
        self.model, self.n, self.created = model, n, int(time.time())
        self.public = public or (lambda request_id: request_id)
        self.names = names

    def failed(self, output: RequestOutput | Chunk) -> None:
        """Raises the APIError of a job its worker failed (nothing if it did not)."""
        check_failed(output, self.public(output.request_id), self.names)

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            kind += ".chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The whole non-streaming response of one job per prompt."""
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, output in enumerate(outputs):
            self.failed(output)
            prompt_tokens += len(output.prompt_token_ids or ())
            for c in output.outputs:
                completion_tokens += len(c.token_ids)
                choice = self._choice(i * self.n + c.index, c.text, c.finish_reason)
                choice["logprobs"] = self.logprobs(c.token_ids, c.logprobs)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {
            **self._head(False),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def logprobs(self, token_ids: list[int], logprobs: list | None, offset: int = 0):
        if self.chat:
            return chat_logprobs(token_ids, logprobs, self.top)
        return completion_logprobs(token_ids, logprobs, self.top, offset)

    def role_chunk(self, indexes: range, with_usage: bool) -> dict[str, Any]:
        """Chat streams open with the assistant's role for every choice."""
        choices = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in indexes
        ]
        return self._chunk(choices, with_usage)

    def delta_chunk(self, job: int, chunk: Chunk, with_usage: bool) -> dict[str, Any] | None:
        """The stream chunk of one job's delta (None when it says nothing new)."""
        choices = []
        for out in chunk.outputs:
            if not out["text"] and not out["token_ids"] and out.get("finish_reason") is None:
                continue
            index, reason = job * self.n + out["index"], out.get("finish_reason")
            logprobs = self.logprobs(
                out["token_ids"], out.get("logprobs"), self.chars.get(index, 0)
            )
            if logprobs is not None and not self.chat:  # text_offset counts the tokens' text
                self.chars[index] = self.chars.get(index, 0) + sum(map(len, logprobs["tokens"]))
            choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": reason}
            if self.chat:
                choice["delta"] = {"content": out["text"]} if out["text"] else {}
            else:
                choice["text"] = out["text"]
            choices.append(choice)
        return self._chunk(choices, with_usage) if choices else None

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return {
            **self._head(True),
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def _chunk(self, choices: list, with_usage: bool) -> dict[str, Any]:
        chunk = {**self._head(True), "choices": choices}
        if with_usage:
            chunk["usage"] = None
        return chunk
