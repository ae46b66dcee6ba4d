"""The OpenAI acceptance on a real model: SmolLM2-135M-Instruct, its own chat template
applied by the worker, an adapter built on it. The oracle is LLM.chat / LLM.generate
with the same LoRARequest in this process."""

from __future__ import annotations

import pytest

from lorapool.protocol import SamplingParams
from lorapool.records.adapter import lora_from_record

pytestmark = [pytest.mark.integration, pytest.mark.slow]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model(smollm2_path):
    """The pool's model for this module's fixtures (worker, adapters, oracle)."""
    return str(smollm2_path)


def test_chat_with_smollm2s_template_equals_llm_chat(client, llm, registry):
    lora = lora_from_record(registry["ad-qv"])
    [want] = llm.chat(CHAT, GREEDY, lora_request=lora)
    got = client.chat.completions.create(
        model="ad-qv", messages=CHAT, temperature=0.0, max_tokens=12
    )
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    streamed = client.chat.completions.create(
        model="ad-qv", messages=CHAT, temperature=0.0, max_tokens=12, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == want.outputs[0].text


def test_base_model_completion_equals_generate(client, llm, base_name):
    [want] = llm.generate(["The capital of France is"], GREEDY)
    got = client.completions.create(
        model=base_name, prompt="The capital of France is", temperature=0.0, max_tokens=12
    )
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


@pytest.fixture(scope="module")
def adapter_dirs(model, tmp_path_factory):
    """Three adapters on SmolLM2 (the structured-outputs batch mixes base and three)."""
    from adapters import build_adapter

    targets = {
        "ad-qv": ("q_proj", "v_proj"),
        "ad-mlp": ("gate_proj", "up_proj"),
        "ad-o": ("o_proj", "down_proj"),
    }
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {
        name: build_adapter(model, root / name, rank=8, targets=t, seed=i, std=0.2)
        for i, (name, t) in enumerate(targets.items())
    }


def test_structured_outputs_on_smollm2(client, registry, base_name):
    """The acceptance's structured checks on a real model (structured_checks.py)."""
    import structured_checks as checks

    assert len(checks.parse_batch(client, [base_name, "ad-qv", "ad-mlp", "ad-o"])) == 16
    checks.json_schema_everywhere(client, "ad-o")
    checks.guided_extras(client, "ad-mlp")


def test_tool_calls_on_smollm2(client, base_name):
    import structured_checks as checks

    checks.tool_calls_forced(client, "ad-qv")
    checks.tool_conversation(client, base_name)


def test_tokenize_matches_smollm2s_tokenizer(gateway, model, base_name):
    import vllm_checks

    vllm_checks.tokenize_matches_transformers(gateway, model, base_name)
