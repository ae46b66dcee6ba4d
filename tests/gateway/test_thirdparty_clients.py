"""Two clients nobody here wrote, against a real pool (the tiny random model, a worker
process, ``lorapool serve``): litellm (``completion``/``acompletion`` with
``openai/<model>`` and ``api_base``) and langchain-openai (``ChatOpenAI``: ``invoke``,
``stream``, tools, ``with_structured_output``, and its Responses API mode). The oracle
for text is the engine's ``LLM.chat`` in this process with the same adapter and greedy
sampling; a stream's chunks must join to it; tool arguments and structured outputs are
checked by ``jsonschema`` and pydantic.

The packages are the ``clients`` extra (``pip install -e '.[clients]'``). Without them
the module skips, unless ``LORAPOOL_TEST_REQUIRE_CLIENTS`` is set (CI sets it:
``.ci/run`` installs the extra), where it fails instead.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from lorapool.protocol import SamplingParams
from lorapool.records.adapter import lora_from_record

pytestmark = [
    pytest.mark.integration,
    pytest.mark.clients,
    # litellm's own types, built by pydantic at its first call
    pytest.mark.filterwarnings("ignore::UserWarning:pydantic._internal._generate_schema"),
]
# litellm fetches its model price map from GitHub at import unless told to use its own copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
try:
    import litellm
    from langchain_openai import ChatOpenAI
except ImportError as exc:
    if os.environ.get("LORAPOOL_TEST_REQUIRE_CLIENTS"):
        raise ImportError(
            f"LORAPOOL_TEST_REQUIRE_CLIENTS is set and {exc} (extra `clients`)"
        ) from exc
    pytest.skip(f"{exc}: the third-party clients are the `clients` extra", allow_module_level=True)

MAX = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX)
ASK = "Where does the lazy dog sleep?"
SYSTEM = "You answer briefly."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
        "maximum": 14}}, "required": ["zone"], "additionalProperties": False}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time.",
        "parameters": TIME}}  # fmt: skip


class Time(BaseModel):
    zone: int = Field(ge=-12, le=14)
    label: Literal["utc", "local"]


@pytest.fixture(scope="module")
def base(tiny_model_path):
    """The tiny llama with room for a tool's description in its context."""
    return tiny_model_path("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def want(llm, registry) -> str:
    """The engine's greedy reply to MESSAGES through ad-qv."""
    [out] = llm.chat(MESSAGES, GREEDY, lora_request=lora_from_record(registry["ad-qv"]))
    assert out.outputs[0].text  # an empty reply would prove nothing
    return out.outputs[0].text


@pytest.fixture(scope="module")
def via(gateway) -> dict:
    """litellm's arguments that route a call to the pool's OpenAI routes."""
    return {"model": "openai/ad-qv", "api_base": f"{gateway}/v1", "api_key": "unused"}


@pytest.fixture(scope="module")
def chat_model(gateway):
    def make(**kwargs) -> ChatOpenAI:
        return ChatOpenAI(model="ad-qv", base_url=f"{gateway}/v1", api_key="unused",
                          max_retries=0, timeout=120, **kwargs)  # fmt: skip

    return make


# -- litellm --------------------------------------------------------------------------------


def test_litellm_completion_equals_the_engine(via, want):
    got = litellm.completion(messages=MESSAGES, temperature=0.0, max_tokens=MAX, **via)
    assert got.choices[0].message.content == want
    assert got.usage.completion_tokens >= 1


def test_litellm_stream_joins_to_the_same_text(via, want):
    chunks = litellm.completion(
        messages=MESSAGES, temperature=0.0, max_tokens=MAX, stream=True, **via
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_litellm_acompletion_streamed_and_not(via, want):
    async def both() -> tuple[str, str]:
        kwargs = {"messages": MESSAGES, "temperature": 0.0, "max_tokens": MAX, **via}
        whole = await litellm.acompletion(**kwargs)
        stream = await litellm.acompletion(stream=True, **kwargs)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return whole.choices[0].message.content, "".join(parts)

    assert asyncio.run(both()) == (want, want)


def test_litellm_tool_call_and_json_schema(via):
    ask = [{"role": "user", "content": "What time is it?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    got = litellm.completion(messages=ask, tools=[TOOL], tool_choice=named, max_tokens=40, **via)
    [call] = got.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    schema = {"type": "json_schema", "json_schema": {"name": "time", "schema": TIME,
                                                     "strict": True}}  # fmt: skip
    got = litellm.completion(messages=ask, response_format=schema, max_tokens=40, **via)
    jsonschema.validate(json.loads(got.choices[0].message.content), TIME)


# -- langchain-openai -----------------------------------------------------------------------


def test_langchain_invoke_and_stream_equal_the_engine(chat_model, want):
    model = chat_model(temperature=0.0, max_tokens=MAX)
    prompt = [("system", SYSTEM), ("human", ASK)]
    assert model.invoke(prompt).content == want
    assert "".join(chunk.content for chunk in model.stream(prompt)) == want


def test_langchain_tools_and_structured_output(chat_model):
    model = chat_model(max_tokens=40)
    called = model.bind_tools([TOOL], tool_choice="get_time").invoke("What time is it?")
    [call] = called.tool_calls
    assert call["name"] == "get_time"
    jsonschema.validate(call["args"], TIME)
    for method in ("json_schema", "function_calling"):
        parsed = model.with_structured_output(Time, method=method).invoke("What time is it?")
        assert isinstance(parsed, Time), method


def test_langchain_over_the_responses_api(chat_model, want):
    model = chat_model(temperature=0.0, max_tokens=MAX, use_responses_api=True)
    prompt = [("system", SYSTEM), ("human", ASK)]
    assert model.invoke(prompt).text == want
    streamed = "".join(chunk.text for chunk in model.stream(prompt))
    assert streamed == want
