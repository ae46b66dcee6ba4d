"""lorapool's outputs in OpenAI's response shapes: completions, chat completions, their
stream chunks and ``usage``.

Streams carry one choice per chunk (OpenAI's and vLLM's: a client reading
``chunk.choices[0]`` sees every choice of ``n > 1``). Choices carry vLLM's
``stop_reason`` (the stop string or token id that ended them); responses carry a
``system_fingerprint`` naming the pool's base model weights; a chat with tools gets
``tool_calls`` (``tools.py``, streamed by ``tool_stream.py``).
"""

from __future__ import annotations

import time
from typing import Any

from lorapool.openai.echo import Echo
from lorapool.openai.errors import failed_request
from lorapool.openai.legacy import legacy_delta
from lorapool.openai.logprobs import (
    chat_logprobs,
    completion_logprobs,
    joined,
    prompt_logprobs_json,
)
from lorapool.openai.tool_stream import ToolStream
from lorapool.openai.tools import ToolRequest
from lorapool.outputs import RequestOutput
from lorapool.records.adapter import ModelIdentity
from lorapool.records.chunk import Chunk


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


def check_failed(output: RequestOutput | Chunk, public_id: str, names=None) -> None:
    """A request that failed on its worker: 500 for an engine fault, else 400 naming the
    parameter (a prompt too long for the model, a token outside its vocabulary), with
    the job id the client knows (``public_id``)."""
    if output.error:
        raise failed_request(
            output.error, output.error_kind, output.request_id, public_id, names,
            path=output.error_field,
        )  # fmt: skip


def fingerprint(base: ModelIdentity | None) -> str | None:
    """``fp_`` and the first 12 hex digits of the base model's weights sha256."""
    return f"fp_{base.sha256[:12]}" if base is not None and base.sha256 else None


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
        *,
        tools: ToolRequest | None = None,
        system_fingerprint: str | None = None,
        echo: Echo | None = None,
    ):
        """``public_id``: the response's id after ``cmpl-`` (never the tenant's name);
        ``public``: a job's request id -> the id its client knows; ``names``: job field ->
        the request's parameter (chat's ``top_logprobs``); ``tools``: a chat's tools."""
        self.chat = kind == "chat"
        self.top = top  # logprobs: the top alternatives per token
        self.tools = tools
        self.streams: dict[int, ToolStream] = {}  # per choice, with tools
        self.chars: dict[int, int] = {}  # per choice: token text streamed (text_offset)
        self.chars_prompt: set[int] = set()  # choices whose prompt_logprobs were sent
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{public_id}"
        self.model, self.n, self.created = model, n, int(time.time())
        self.fingerprint = system_fingerprint
        self.echo = echo  # completions' echo (None: off)
        self.public = public or (lambda request_id: request_id)
        self.names = names

    def failed(self, output: RequestOutput | Chunk) -> None:
        """Raises the APIError of a job its worker failed (nothing if it did not)."""
        check_failed(output, self.public(output.request_id), self.names)

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            kind += ".chunk"
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        head["system_fingerprint"] = self.fingerprint
        return head

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The whole non-streaming response of one job per prompt."""
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        prompt_logprobs = None
        for i, output in enumerate(outputs):
            self.failed(output)
            prompt_tokens += len(output.prompt_token_ids or ())
            cached += (output.metrics and output.metrics.num_cached_tokens) or 0
            prompt_logprobs = prompt_logprobs_json(output.prompt_logprobs)
            if self.echo is not None:
                self.echo.remember(
                    i, output.prompt, output.prompt_token_ids, output.prompt_logprobs
                )
            for c in output.outputs:
                completion_tokens += len(c.token_ids)
                index = i * self.n + c.index
                head, head_logprobs = self._echo_head(i, index, c.logprobs is not None)
                choice = self._choice(index, head + c.text, c.finish_reason)
                logprobs = self.logprobs(c.token_ids, c.logprobs, len(head))
                choice["logprobs"] = joined(head_logprobs, logprobs)
                choice["stop_reason"] = c.stop_reason
                if not self.chat and prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        body = {**self._head(False), "choices": choices}
        if self.chat and prompt_logprobs is not None:  # vLLM's place for a chat's
            body["prompt_logprobs"] = prompt_logprobs
        return {**body, "usage": usage(prompt_tokens, completion_tokens, cached)}

    def _echo_head(self, job: int, index: int, logprobs: bool) -> tuple[str, dict | None]:
        if self.echo is None:
            return "", None
        return self.echo.head(job, index, logprobs)

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish_reason}
        if not self.chat:
            choice["text"] = text
            return choice
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, calls = self.tools.reply(text)
            message["content"] = content
            if calls and self.tools.legacy:
                message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
            elif calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
            choice["finish_reason"] = self.tools.finish_reason(finish_reason, calls)
        choice["message"] = message
        return choice

    def logprobs(self, token_ids: list[int], logprobs: list | None, offset: int = 0):
        if self.chat:
            return chat_logprobs(token_ids, logprobs, self.top)
        return completion_logprobs(token_ids, logprobs, self.top, offset)

    def role_chunks(self, indexes: range, with_usage: bool) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role, a chunk for each choice."""
        return [
            self._chunk(
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                },
                with_usage,
            )
            for i in indexes
        ]

    def delta_chunks(self, job: int, chunk: Chunk, with_usage: bool) -> list[dict[str, Any]]:
        """The stream chunks of one job's delta: one per choice that says something new."""
        chunks = []
        if self.echo is not None and chunk.prompt_token_ids is not None:
            self.echo.remember(job, chunk.prompt, chunk.prompt_token_ids, chunk.prompt_logprobs)
        for out in chunk.outputs:
            if not out.text and not out.token_ids and out.finish_reason is None:
                continue
            index, reason = job * self.n + out.index, out.finish_reason
            head, head_logprobs = self._echo_head(job, index, out.logprobs is not None)
            offset = self.chars.get(index, len(head))
            logprobs = self.logprobs(out.token_ids, out.logprobs, offset)
            if logprobs is not None and not self.chat:  # text_offset counts the tokens' text
                self.chars[index] = offset + sum(map(len, logprobs["tokens"]))
            logprobs = joined(head_logprobs, logprobs)
            choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                choice["stop_reason"] = out.stop_reason
            if self.chat:
                choice["delta"] = self._delta(index, out.text, choice)
            else:
                choice["text"] = head + out.text
                if chunk.prompt_logprobs is not None and index not in self.chars_prompt:
                    self.chars_prompt.add(index)
                    choice["prompt_logprobs"] = prompt_logprobs_json(chunk.prompt_logprobs)
            chunks.append(self._chunk(choice, with_usage))
        return chunks

    def _delta(self, index: int, text: str, choice: dict[str, Any]) -> dict[str, Any]:
        if self.tools is None:
            return {"content": text} if text else {}
        stream = self.streams.setdefault(index, ToolStream(self.tools))
        content, calls = stream.feed(text)
        if choice["finish_reason"] is not None:
            more_content, more_calls = stream.finish()
            content, calls = content + more_content, calls + more_calls
            choice["finish_reason"] = self.tools.finish_reason(choice["finish_reason"], stream.sent)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls and self.tools.legacy:
            if (call := legacy_delta(calls)) is not None:
                delta["function_call"] = call
        elif calls:
            delta["tool_calls"] = calls
        return delta

    def usage_chunk(self, prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage(prompt, completion, cached)}

    def _chunk(self, choice: dict[str, Any], with_usage: bool) -> dict[str, Any]:
        chunk = {**self._head(True), "choices": [choice]}
        if with_usage:
            chunk["usage"] = None
        return chunk
