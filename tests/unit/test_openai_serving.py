"""``OpenAIServing`` over a pool held in memory: its collaborator, implementing
``PoolAccess`` (the gateway's ``Pool`` is the real one: ``test_gateway_pool_is_pool_access``
pins that it has what the protocol names; the gateway's tests run the real path). The
replies are read back by the official openai client's own models (the oracle of their
shape); the steps' order and the hold's fate are what the gateway promises."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion

from lorapool.gateway.auth import Principal
from lorapool.openai.errors import APIError
from lorapool.openai.limits import PoolLimits
from lorapool.openai.serving import OpenAIServing, PoolAccess, ServingConfig
from lorapool.protocol import FieldError
from lorapool.records.adapter import ModelIdentity
from lorapool.records.chunk import Chunk, Delta

BASE = ModelIdentity("base-m", "ab" * 32)
CHAT = b'{"model": "base-m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'


class Handle:
    def __init__(self, request_id: str):
        self.request_id = request_id


class MemoryPool:
    """A pool of one base model whose every job answers "Hello" in two chunks."""

    def __init__(self, limits: PoolLimits | None = None, refuse: Exception | None = None):
        self.log: list[str] = []
        self.limits, self.refuse = limits or PoolLimits(), refuse
        self.enqueued: list[tuple] = []

    async def base_model(self):
        return BASE

    async def resolve_model(self, model: str, caller):
        self.log.append("resolve")
        if model != BASE.name:
            raise APIError(404, f"the model {model!r} does not exist", "model")
        return None

    async def pool_limits(self) -> PoolLimits:
        self.log.append("limits")
        return self.limits

    async def compile_grammar(self, constraint) -> None:
        self.log.append("grammar")

    async def decoder(self):
        return None

    async def enqueue(self, prompts, params, lora, request_ids, metadata, priority, on_finish):
        self.log.append("enqueue")
        if self.refuse is not None:
            raise self.refuse
        self.enqueued.append((request_ids, metadata, priority))
        return [Handle(rid) for rid in request_ids]

    def _chunks(self, rid: str) -> list[Chunk]:
        first = Chunk(request_id=rid, seq=0, outputs=[Delta(text="Hel", token_ids=[1])],
                      prompt="hi", prompt_token_ids=[5, 6])  # fmt: skip
        final = Delta(text="lo", token_ids=[2], finish_reason="stop")
        return [first, Chunk(request_id=rid, seq=1, offset=1, outputs=[final], finished=True)]

    async def results(self, handles, gone, caller):
        outputs = []
        for handle in handles:
            first, last = self._chunks(handle.request_id)
            whole = Chunk(request_id=handle.request_id, seq=1, finished=True,
                          outputs=[Delta(text="Hello", token_ids=[1, 2], finish_reason="stop")],
                          prompt="hi", prompt_token_ids=first.prompt_token_ids)  # fmt: skip
            outputs.append(whole.to_output())
        return outputs

    async def chunks(self, handles, caller):
        for job, handle in enumerate(handles):
            for chunk in self._chunks(handle.request_id):
                yield job, chunk


class Door:
    def __init__(self, pool: MemoryPool, rate_error: APIError | None = None):
        self.pool, self.rate_error, self.released = pool, rate_error, 0

    def hold(self):
        self.pool.log.append("hold")
        return self

    def release(self) -> None:
        self.released += 1

    async def check_rate(self, requests: int, params) -> None:
        self.pool.log.append("rate")
        if self.rate_error is not None:
            raise self.rate_error


def serve(pool: MemoryPool) -> OpenAIServing:
    return OpenAIServing(pool, ServingConfig(max_prompts=8, tool_call_parser="hermes"))


async def _reply(kind: str, body: bytes, caller: Principal, pool=None) -> dict:
    serving = serve(pool or MemoryPool())
    parsed = await serving.parse(kind, body)
    submitted = await serving.submit(parsed, kind, caller, Door(serving.pool))
    return await serving.reply(submitted, caller)


def test_a_chat_reply_is_what_the_openai_client_reads():
    caller = Principal(tenant="acme", key_id="k1")
    pool = MemoryPool()
    body = asyncio.run(_reply("chat", CHAT, caller, pool))
    reply = ChatCompletion.model_validate(body)
    assert reply.choices[0].message.content == "Hello"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == 2 and reply.usage.completion_tokens == 2
    assert reply.system_fingerprint == "fp_" + "ab" * 6
    [(ids, metadata, priority)] = pool.enqueued
    assert ids[0].startswith("acme~") and metadata["tenant"] == "acme"
    assert reply.id == "chatcmpl-" + ids[0].split("~", 1)[1]  # never the tenant's name
    assert pool.log == ["resolve", "limits", "rate", "enqueue"]  # no hold: it waits


def test_a_completion_of_two_prompts_has_a_choice_each():
    body = b'{"model": "base-m", "prompt": ["a", "b"], "max_tokens": 4}'
    reply = Completion.model_validate(asyncio.run(_reply("completion", body, Principal())))
    assert [c.text for c in reply.choices] == ["Hello", "Hello"]
    assert [c.index for c in reply.choices] == [0, 1]


def test_a_stream_takes_its_hold_after_the_limits_and_before_the_rate_check():
    pool = MemoryPool()
    serving, caller = serve(pool), Principal()

    async def run():
        json_mode = b', "response_format": {"type": "json_object"}'
        parsed = await serving.parse("chat", CHAT[:-1] + b', "stream": true' + json_mode + b"}")
        submitted = await serving.submit(parsed, "chat", caller, Door(pool))
        return submitted, [event async for event in serving.events(submitted, caller)]

    submitted, events = asyncio.run(run())
    assert pool.log == ["resolve", "limits", "hold", "rate", "grammar", "enqueue"]
    chunks = [ChatCompletionChunk.model_validate(e) for e in events]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert submitted.hold is not None and submitted.hold.released == 0  # the response's now


@pytest.mark.parametrize("failing", ["rate", "enqueue"])
def test_a_refused_stream_gives_its_hold_back(failing):
    path = "sampling_params.logprobs"
    refusal = FieldError(f"{path} must be at most 2, got 3", field=path)
    pool = MemoryPool(refuse=refusal if failing == "enqueue" else None)
    door = Door(pool, APIError(429, "over") if failing == "rate" else None)
    serving = serve(pool)

    async def run():
        top = b', "logprobs": true, "top_logprobs": 3'
        parsed = await serving.parse("chat", CHAT[:-1] + b', "stream": true' + top + b"}")
        await serving.submit(parsed, "chat", Principal(), door)

    with pytest.raises(APIError) as caught:
        asyncio.run(run())
    assert door.released == 1
    if failing == "enqueue":  # the job boundary's refusal names the request's parameter
        assert caught.value.status == 400 and caught.value.param == "top_logprobs"
        assert caught.value.message == "top_logprobs must be at most 2, got 3"


def test_the_pool_bounds_are_checked_before_any_job():
    pool = MemoryPool(PoolLimits(max_model_len=3))
    with pytest.raises(APIError) as caught:
        asyncio.run(_reply("chat", CHAT, Principal(), pool))
    assert caught.value.status == 400 and caught.value.param == "max_tokens"
    assert "enqueue" not in pool.log
    with pytest.raises(APIError) as caught:
        asyncio.run(_reply("chat", CHAT.replace(b"base-m", b"nope"), Principal(), pool))
    assert caught.value.status == 404


def test_gateway_pool_is_pool_access():
    """The gateway's Pool has every member of the protocol, async where it is, with its
    parameters: a renamed or dropped method fails here, not at a request."""
    from lorapool.gateway.pool import Pool

    for name, member in vars(PoolAccess).items():
        if name.startswith("_") or not callable(member):
            continue
        real = getattr(Pool, name)
        assert inspect.iscoroutinefunction(real) == inspect.iscoroutinefunction(member), name
        wanted = list(inspect.signature(member).parameters)
        assert list(inspect.signature(real).parameters)[: len(wanted)] == wanted, name
