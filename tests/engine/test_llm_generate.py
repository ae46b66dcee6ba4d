"""LLM.generate with adapters: the three modes of seed 004, against PEFT."""

import pytest
from adapters import ALL_TARGETS, build_adapter, peft_greedy

from lorapool import LLM, LoRARequest, SamplingParams

PROMPTS = ["the quick brown fox", "hello world", "a b c d e f g", "lorapool serves adapters"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def loras(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("generate-loras")
    specs = [(8, ["q_proj", "v_proj"]), (16, ALL_TARGETS), (4, ["gate_proj", "down_proj"])]
    return [
        LoRARequest(
            f"g{i}", i + 1, str(build_adapter(base, root / f"g{i}", rank=r, targets=t, seed=20 + i))
        )
        for i, (r, t) in enumerate(specs)
    ]


@pytest.fixture(scope="module")
def llm(base):
    return LLM(model=str(base), enable_lora=True, max_loras=2, max_lora_rank=16)


def params():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def check(base, outputs, per_prompt):
    assert [o.prompt for o in outputs] == PROMPTS
    for out, lora in zip(outputs, per_prompt):
        assert out.finished and out.lora_request is lora
        assert out.outputs[0].lora_request is lora
        expected = peft_greedy(base, lora and lora.lora_path, out.prompt_token_ids, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, f"{out.prompt!r} with {lora}"


def test_one_adapter_for_all_prompts(base, llm, loras):
    outputs = llm.generate(PROMPTS, params(), lora_request=loras[1])
    check(base, outputs, [loras[1]] * len(PROMPTS))
    plain = llm.generate(PROMPTS, params())
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain]


def test_one_adapter_per_prompt(base, llm, loras):
    per_prompt = [loras[0], loras[1], loras[2], loras[0]]  # three adapters, max_loras=2
    check(base, llm.generate(PROMPTS, params(), lora_request=per_prompt), per_prompt)


def test_list_with_none_for_base_model_prompts(base, llm, loras):
    per_prompt = [loras[2], None, loras[0], None]
    check(base, llm.generate(PROMPTS, params(), lora_request=per_prompt), per_prompt)


def test_no_adapter_is_the_base_model(base, llm):
    check(base, llm.generate(PROMPTS, params()), [None] * len(PROMPTS))


@pytest.mark.parametrize("count", [1, 3, 5])
def test_adapter_list_of_the_wrong_length_is_refused(llm, loras, count):
    with pytest.raises(ValueError, match="lora_request has"):
        llm.generate(PROMPTS, params(), lora_request=(loras * 2)[:count])
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued


def test_steps_pad_to_the_rank_of_their_own_adapters(base, loras, monkeypatch):
    llm = LLM(model=str(base), enable_lora=True, max_loras=2, max_lora_rank=16)
    step = llm.llm_engine.lora_manager.step
    ranks = []
    original = step.set
    monkeypatch.setattr(
        step, "set", lambda mapping, rank: ranks.append(rank) or original(mapping, rank)
    )
    llm.generate(PROMPTS[:1], params(), lora_request=loras[1])  # rank 16, stays in its slot
    ranks.clear()
    outputs = llm.generate(PROMPTS, params(), lora_request=[loras[0], None, loras[0], None])
    assert set(llm.llm_engine.lora_manager.slot_ranks.values()) == {8, 16}
    assert ranks and set(ranks) == {8}  # not 16: that adapter is resident but idle
    check(base, outputs, [loras[0], None, loras[0], None])
