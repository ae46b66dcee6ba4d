"""What apps moving from OpenAI or vLLM read, with the official ``openai`` client (httpx
where it has no method): one choice per streamed chunk, stop_reason, system_fingerprint,
usage details, logit_bias; vLLM's /health, /ping, /version, /tokenize, /detokenize
(against transformers' tokenizer of the model directory)."""

from __future__ import annotations

import httpx
import orjson
import pytest
import vllm_checks

pytestmark = pytest.mark.integration
CHAT = [{"role": "user", "content": "Count with me"}]


def test_streaming_n3_has_one_choice_per_chunk(client, base_name):
    """A client reading ``chunk.choices[0]`` of every chunk sees all three choices, whose
    texts equal the non-streamed call's (same seed)."""
    kw = dict(model=base_name, n=3, max_tokens=10, temperature=1.0, seed=11)
    whole = client.chat.completions.create(messages=CHAT, **kw)
    texts, reasons = {}, {}
    for chunk in client.chat.completions.create(messages=CHAT, stream=True, **kw):
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    completions = client.completions.create(prompt="Once", stream=True, **kw)
    seen = set()
    for chunk in completions:
        assert len(chunk.choices) == 1
        seen.add(chunk.choices[0].index)
    assert seen == {0, 1, 2}


def test_stop_reason_and_fingerprint(client, base_name, producer):
    whole = client.completions.create(
        model=base_name, prompt="The quick", max_tokens=12, temperature=0.0
    )
    text = whole.choices[0].text
    assert len(text) > 3
    stop = text[2:4]
    got = client.completions.create(
        model=base_name, prompt="The quick", max_tokens=12, temperature=0.0, stop=[stop]
    )
    choice = got.choices[0].model_dump()
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert whole.choices[0].model_dump()["stop_reason"] is None
    sha = producer.redis.get(producer.keys.model)
    assert got.system_fingerprint == "fp_" + orjson.loads(sha)["sha256"][:12]
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    streamed = list(
        client.completions.create(
            model=base_name,
            prompt="The quick",
            max_tokens=12,
            temperature=0.0,
            stop=[stop],
            stream=True,
        )
    )
    last = streamed[-1].choices[0].model_dump()
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
    assert all(c.system_fingerprint == got.system_fingerprint for c in streamed)


def test_logit_bias_forces_a_token(client, base_name, gateway):
    got = client.completions.create(
        model=base_name,
        prompt="Hello",
        max_tokens=4,
        temperature=1.0,
        logit_bias={"300": 100},
    )
    ids = httpx.post(
        f"{gateway}/v1/completions",
        json={"model": base_name, "prompt": "Hello", "max_tokens": 4, "logit_bias": {"300": 100},
              "logprobs": 0},
        timeout=60,
    ).json()  # fmt: skip
    assert got.choices[0].text == ids["choices"][0]["text"]
    assert len(set(ids["choices"][0]["logprobs"]["tokens"])) == 1
    bad = httpx.post(
        f"{gateway}/v1/completions",
        json={"model": base_name, "prompt": "Hello", "logit_bias": {"300": 101}},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_health_ping_version(gateway):
    assert httpx.get(f"{gateway}/health").status_code == 200
    assert httpx.get(f"{gateway}/health").content == b""
    assert httpx.get(f"{gateway}/ping").status_code == 200
    assert httpx.post(f"{gateway}/ping").status_code == 200
    from importlib.metadata import version

    assert httpx.get(f"{gateway}/version").json() == {"version": version("lorapool")}


def test_tokenize_and_detokenize_match_transformers(gateway, model, base_name):
    vllm_checks.tokenize_matches_transformers(gateway, model, base_name)


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages"),
        ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", [1, 2], 400, None),
    ],
)
def test_tokenize_refuses_bad_bodies(gateway, route, body, status, param):
    got = httpx.post(f"{gateway}{route}", json=body)
    assert got.status_code == status, got.text
    assert got.json()["error"]["param"] == param
