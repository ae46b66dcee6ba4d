"""The engine end to end with the Triton kernels (interpreted) in place of the reference."""

import random

import pytest


def _greedy(path, prompts, **engine_kw):
    from lorapool import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), **engine_kw))
    for i, (prompt, max_tokens) in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=max_tokens))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [finals[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama"])
def test_greedy_outputs_unchanged_under_the_interpreter(tiny_model_path, monkeypatch, arch):
    path = tiny_model_path(arch)
    rng = random.Random(0)
    prompts = [([rng.randrange(3, 512) for _ in range(n)], m) for n, m in
               [(1, 6), (40, 8), (17, 5), (70, 4)]]
    # Chunked prefill: prompts are split, so attention also runs over cached context.
    engine_kw = dict(block_size=16, max_num_batched_tokens=32, max_num_seqs=4)
    want = _greedy(path, prompts, **engine_kw)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _greedy(path, prompts, **engine_kw) == want
