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
from lorapool.lifecycle.marker import JobLost, NoWorker
from lorapool.lifecycle.rate_limits import RateState
from lorapool.openai.errors import APIError
from lorapool.openai.limits import PoolLimits
from lorapool.openai.serving import OpenAIServing, PoolAccess, ServingConfig
from lorapool.protocol import FieldError
from lorapool.records.adapter import ModelIdentity
from lorapool.records.chunk import Chunk, Delta
from lorapool.records.heartbeat import Heartbeat

BASE = ModelIdentity("base-m", "ab" * 32)
CHAT = b'{"model": "base-m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'


class Handle:
    def __init__(self, request_id: str):
        self.request_id = request_id


class MemoryPool:
    """A pool of one base model, no adapters and ``backlog`` waiting jobs, whose every
    job answers "Hello" in two chunks; a tenant's minute holds ``requests_left``
    requests; ``wait`` (an exception or None, the client gone) ends a wait for
    results."""

    def __init__(
        self,
        limits: PoolLimits | None = None,
        refuse: Exception | None = None,
        requests_left: int = 100,
        backlog: int = 0,
        wait: Exception | str | None = "",
    ):
        self.log: list[str] = []
        self.limits, self.refuse = limits or PoolLimits(), refuse
        self.requests_left, self.waiting, self.wait = requests_left, backlog, wait
        self.enqueued: list[tuple] = []

    async def base_model(self):
        return BASE

    async def adapter(self, name: str):
        self.log.append("adapter")
        return None

    async def live_workers(self):
        self.log.append("limits")
        limits = self.limits
        return [Heartbeat(name="w", model=BASE.name, max_model_len=limits.max_model_len,
                          max_logprobs=limits.max_logprobs,
                          kv_capacity_tokens=limits.kv_capacity_tokens)]  # fmt: skip

    async def backlog(self) -> int:
        self.log.append("backlog")
        return self.waiting

    async def has_webhook_secret(self, tenant: str) -> bool:
        return tenant == "signed"

    async def take_rate(self, tenant, rpm, tpm, requests: int, tokens: int) -> RateState:
        self.log.append("rate")
        taken = requests <= self.requests_left
        self.requests_left -= requests if taken else 0
        return RateState(taken, 0.0 if taken else 6.0, rpm, tpm, self.requests_left, 1.0, 0, 0)

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

    async def results(self, handles, timeout_s, gone):
        if isinstance(self.wait, Exception):
            raise self.wait
        if self.wait is None:
            return None
        outputs = []
        for handle in handles:
            first, last = self._chunks(handle.request_id)
            whole = Chunk(request_id=handle.request_id, seq=1, finished=True,
                          outputs=[Delta(text="Hello", token_ids=[1, 2], finish_reason="stop")],
                          prompt="hi", prompt_token_ids=first.prompt_token_ids)  # fmt: skip
            outputs.append(whole.to_output())
        return outputs

    async def chunks(self, handles):
        for job, handle in enumerate(handles):
            first, last = self._chunks(handle.request_id)
            yield job, first
            if isinstance(self.wait, Exception):
                raise self.wait
            yield job, last


class Door:
    def __init__(self, pool: MemoryPool):
        self.pool, self.released, self.headers = pool, 0, None

    def hold(self):
        self.pool.log.append("hold")
        return self

    def release(self) -> None:
        self.released += 1

    def rated(self, headers) -> None:
        self.headers = headers


def serve(pool: MemoryPool) -> OpenAIServing:
    return OpenAIServing(pool, ServingConfig(max_prompts=8, tool_call_parser="hermes"))


async def _reply(kind: str, body: bytes, caller: Principal, pool=None, serving=None) -> dict:
    serving = serving or serve(pool or MemoryPool())
    parsed = await serving.parse(kind, body)
    submitted = await serving.submit(parsed, kind, caller, Door(serving.pool))
    return await serving.reply(submitted, caller)


def test_a_chat_reply_is_what_the_openai_client_reads():
    caller = Principal(tenant="acme", key_id="k1", rpm=10)
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
    assert pool.log == ["limits", "rate", "enqueue"]  # no hold: it waits; no backlog bound
    assert pool.requests_left == 99  # one taken from the minute


def test_a_completion_of_two_prompts_has_a_choice_each():
    body = b'{"model": "base-m", "prompt": ["a", "b"], "max_tokens": 4}'
    reply = Completion.model_validate(asyncio.run(_reply("completion", body, Principal())))
    assert [c.text for c in reply.choices] == ["Hello", "Hello"]
    assert [c.index for c in reply.choices] == [0, 1]


def test_a_stream_takes_its_hold_after_the_limits_and_before_the_rate_check():
    pool = MemoryPool()
    serving, caller, door = serve(pool), Principal(tenant="t", rpm=100), Door(pool)

    async def run():
        json_mode = b', "response_format": {"type": "json_object"}'
        parsed = await serving.parse("chat", CHAT[:-1] + b', "stream": true' + json_mode + b"}")
        submitted = await serving.submit(parsed, "chat", caller, door)
        return submitted, [event async for event in serving.events(submitted, caller)]

    submitted, events = asyncio.run(run())
    assert pool.log == ["limits", "hold", "rate", "grammar", "enqueue"]
    assert door.headers["x-ratelimit-remaining-requests"] == "99"  # onto the answer
    chunks = [ChatCompletionChunk.model_validate(e) for e in events]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert submitted.hold is not None and submitted.hold.released == 0  # the response's now


@pytest.mark.parametrize("failing", ["rate", "enqueue"])
def test_a_refused_stream_gives_its_hold_back(failing):
    path = "sampling_params.logprobs"
    refusal = FieldError(f"{path} must be at most 2, got 3", field=path)
    spent = failing == "rate"  # the tenant's minute is spent
    pool = MemoryPool(refuse=refusal if failing == "enqueue" else None, requests_left=1 - spent)
    door, serving = Door(pool), serve(pool)

    async def run():
        top = b', "logprobs": true, "top_logprobs": 3'
        parsed = await serving.parse("chat", CHAT[:-1] + b', "stream": true' + top + b"}")
        await serving.submit(parsed, "chat", Principal(tenant="t", rpm=1), door)

    with pytest.raises(APIError) as caught:
        asyncio.run(run())
    assert door.released == 1
    if failing == "rate":  # 429 with the headers that say when to come back
        assert caught.value.status == 429 and caught.value.code == "rate_limit_exceeded"
        assert caught.value.headers["Retry-After"] == "6" and door.headers is None
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


@pytest.mark.parametrize(
    "model, caller, status, asked",
    [
        ("base-m", Principal(adapters=frozenset()), None, []),  # the base model: no read
        ("sql-lora", Principal(), 404, ["adapter"]),  # not in the registry
        ("sql-lora", Principal(adapters=frozenset({"other"})), 404, []),  # not the key's
        ("a b", Principal(), 404, []),  # no adapter can have that name
        ("a\x00b", Principal(), 400, []),
    ],
)
def test_a_model_is_resolved_by_its_name_and_the_key(model, caller, status, asked):
    pool = MemoryPool()
    try:
        found, error = asyncio.run(serve(pool).resolve(model, caller)), None
    except APIError as exc:
        found, error = None, exc
    assert found is None and pool.log == asked
    assert (error and error.status) == status and (error is None or error.param == "model")


def test_a_full_backlog_refuses_before_any_job():
    pool = MemoryPool(backlog=5)
    serving = OpenAIServing(pool, ServingConfig(max_backlog=5, retry_after_s=3))
    with pytest.raises(APIError) as caught:
        asyncio.run(_reply("chat", CHAT, Principal(), pool, serving))
    assert caught.value.status == 429 and caught.value.code == "backlog_full"
    assert caught.value.headers == {"Retry-After": "3"} and "enqueue" not in pool.log


def test_a_submit_that_can_never_fit_is_a_400_without_taking_the_minute():
    serving = serve(MemoryPool())
    pool = serving.pool
    caller = Principal(tenant="t", rpm=5, tpm=100)
    with pytest.raises(APIError) as caught:
        asyncio.run(serving.check_rate(caller, 6, None))
    assert (caught.value.status, caught.value.code) == (400, "exceeds_rate_limit")
    params = asyncio.run(serving.parse("chat", CHAT)).params  # max_tokens 4
    greedy = asyncio.run(serving.parse("chat", CHAT.replace(b": 4}", b": 60}"))).params
    with pytest.raises(APIError) as caught:
        asyncio.run(serving.check_rate(caller, 2, greedy))
    assert caught.value.param == "max_tokens" and "rate" not in pool.log
    headers = asyncio.run(serving.check_rate(caller, 2, params))
    assert headers["x-ratelimit-remaining-requests"] == "98" and pool.log == ["rate"]


def test_a_webhook_needs_its_tenants_secret():
    serving = serve(MemoryPool())
    url = "https://93.184.215.14/hook"  # an address: nothing to resolve
    asyncio.run(serving.check_webhook(url, Principal(tenant="signed")))
    with pytest.raises(APIError) as caught:
        asyncio.run(serving.check_webhook(url, Principal(tenant="acme")))
    assert caught.value.param == "on_finish" and "webhook-secret acme" in caught.value.message
    with pytest.raises(APIError) as caught:
        asyncio.run(serving.check_webhook("http://127.0.0.1/hook", Principal(tenant="signed")))
    assert caught.value.code == "invalid_url"


@pytest.mark.parametrize(
    "wait, status, code, says",
    [
        (NoWorker(["acme~j1"], 300.0), 503, "no_worker", "within 300s; it stays queued as job j1"),
        (JobLost("acme~j1"), 503, "job_lost", "j1"),
        (TimeoutError(), 504, None, "no result within 600s"),
        (None, 499, None, "the client closed the request"),
    ],
)
def test_a_wait_without_a_result_is_answered_with_the_jobs_as_the_client_knows_them(
    wait, status, code, says
):
    pool, caller = MemoryPool(wait=wait), Principal(tenant="acme")
    with pytest.raises(APIError) as caught:
        asyncio.run(_reply("chat", CHAT, caller, pool))
    assert (caught.value.status, caught.value.code) == (status, code)
    assert says in caught.value.message and "acme~" not in caught.value.message
    if code == "no_worker":
        assert caught.value.headers == {"Retry-After": "1"}


def test_a_stream_whose_job_was_lost_ends_with_its_error():
    pool, caller = MemoryPool(wait=JobLost("acme~j1")), Principal(tenant="acme")
    serving = serve(pool)

    async def run():
        parsed = await serving.parse("chat", CHAT[:-1] + b', "stream": true}')
        submitted = await serving.submit(parsed, "chat", caller, Door(pool))
        return [event async for event in serving.events(submitted, caller)]

    events = asyncio.run(run())
    assert events[-1]["error"]["code"] == "job_lost" and "acme~" not in str(events[-1])


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
