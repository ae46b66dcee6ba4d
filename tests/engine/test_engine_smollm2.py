"""The engine on the real SmolLM2-135M-Instruct against transformers' generate."""

import pytest
from engine_runs import assert_matches_transformers, workload

from lorapool import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def requests():
    return workload(7, 16, 49152, max_prompt=300, max_out=12)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_kv_blocks": 24},  # sixteen requests at once need far more than 24 blocks
        {"max_num_batched_tokens": 32, "max_num_seqs": 16},  # every prefill chunked
    ],
    ids=["plain", "preemption", "chunked"],
)
def test_greedy_matches_transformers(smollm2_path, requests, options):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(smollm2_path), **options))
    every = 0 if "num_kv_blocks" in options else 2
    assert_matches_transformers(smollm2_path, engine, requests, every=every)
    if "num_kv_blocks" in options:
        assert engine.scheduler.num_preemptions > 0


def test_delta_stream_of_multibyte_text_merges_to_final(smollm2_path):
    prompt = "Traduis en japonais et ajoute des émojis : « le café est prêt ☕ »"
    merged = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(smollm2_path)))
        chat = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        engine.add_request(
            "m", chat, SamplingParams(temperature=0.7, seed=11, max_tokens=48, output_kind=kind)
        )
        while engine.has_unfinished_requests():
            for out in engine.step():
                if kind in merged:
                    merged[kind].add(out, aggregate=True)
                else:
                    merged[kind] = out
    delta, final = merged[RequestOutputKind.DELTA], merged[RequestOutputKind.FINAL_ONLY]
    assert delta.outputs[0].text == final.outputs[0].text
    assert delta.outputs[0].token_ids == final.outputs[0].token_ids
    assert any(ord(c) > 127 for c in final.outputs[0].text), final.outputs[0].text
