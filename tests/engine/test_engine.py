"""The engine end to end against transformers: greedy tokens, logprobs, streaming."""

import random

import pytest
import torch
from oracle import hf_greedy, hf_log_softmax

from lorapool import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def workload(seed: int, count: int, vocab: int, max_prompt: int = 300, max_out: int = 24):
    rng = random.Random(seed)
    lengths = [1, max_prompt] + [rng.randint(1, max_prompt) for _ in range(count - 2)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    return [(p, rng.randint(1, max_out)) for p in prompts]


def run_staggered(engine, requests, params_for=None, every: int = 2):
    """Add request i at step i * every / 2 while stepping; returns final outputs by id."""
    finals, step_no, pending = {}, 0, list(enumerate(requests))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] * every // 2 <= step_no:
            i, (prompt, max_tokens) = pending.pop(0)
            params = (params_for(i) if params_for else
                      SamplingParams(temperature=0.0, max_tokens=max_tokens))
            engine.add_request(f"req-{i}", {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step_no += 1
    return finals


def assert_matches_transformers(path, engine, requests, every=2):
    finals = run_staggered(engine, requests, every=every)
    assert len(finals) == len(requests)
    for i, (prompt, max_tokens) in enumerate(requests):
        ours = finals[f"req-{i}"].outputs[0].token_ids
        assert ours == hf_greedy(path, prompt, max_tokens), f"request {i} (prompt {len(prompt)})"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model_path, arch):
    path = tiny_model_path(arch, tie_word_embeddings=arch == "qwen2")
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), block_size=16))
    assert_matches_transformers(path, engine, workload(1, 16, 512))


def test_greedy_matches_with_preemption_and_chunked_prefill(tiny_model_path):
    path = tiny_model_path("llama")
    requests = workload(2, 16, 512, max_out=40)
    # 24 blocks of 16 tokens: one long request fits, sixteen arriving together do not.
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), num_kv_blocks=24))
    assert_matches_transformers(path, engine, requests, every=0)
    assert engine.scheduler.num_preemptions > 0
    chunked = LLMEngine.from_engine_args(EngineArgs(model=str(path), max_num_batched_tokens=16,
                                                    max_num_seqs=16))
    assert_matches_transformers(path, chunked, requests)


def test_logprobs_match_transformers_log_softmax(tiny_model_path):
    path = tiny_model_path("qwen3")
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path)))
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3)
    engine.add_request("lp", {"prompt_token_ids": prompt}, params)
    final = run_until_finished(engine)["lp"]
    completion = final.outputs[0]
    expected = hf_log_softmax(path, prompt + completion.token_ids)
    for step, token in enumerate(completion.token_ids):
        row = expected[len(prompt) - 1 + step]
        top = completion.logprobs[step]
        assert token in top and len(top) in (5, 6)
        for tid, lp in top.items():
            assert lp.logprob == pytest.approx(row[tid].item(), abs=1e-4)
        top5 = torch.topk(row, 5).indices.tolist()
        assert set(top5) <= set(top)
    assert completion.cumulative_logprob == pytest.approx(
        sum(completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)),
        abs=1e-4)
    assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        lp = final.prompt_logprobs[pos][prompt[pos]].logprob
        assert lp == pytest.approx(expected[pos - 1, prompt[pos]].item(), abs=1e-4)


def run_until_finished(engine):
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(tiny_model_path):
    path = tiny_model_path("llama")
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20)
    alone = LLMEngine.from_engine_args(EngineArgs(model=str(path)))
    alone.add_request("s", {"prompt_token_ids": [5, 6, 7, 8]}, seeded)
    expected = run_until_finished(alone)["s"].outputs[0].token_ids

    busy = LLMEngine.from_engine_args(EngineArgs(model=str(path), num_kv_blocks=12))
    requests = workload(3, 12, 512, max_prompt=60)

    def params_for(i):
        return seeded if i == 5 else SamplingParams(temperature=1.0, max_tokens=requests[i][1])
    requests[5] = ([5, 6, 7, 8], 20)
    finals = run_staggered(busy, requests, params_for)
    assert finals["req-5"].outputs[0].token_ids == expected


def test_n_samples_share_the_prompt_and_differ(tiny_model_path):
    path = tiny_model_path("llama")
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path)))
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    engine.add_request("n3", {"prompt_token_ids": list(range(3, 40))}, params)
    engine.step()  # prefill: the first sequence, then the fork
    request = engine.requests["n3"]
    assert len(request.seqs) == 3
    assert request.seqs[1].block_table[0] == request.seqs[0].block_table[0]
    final = run_until_finished(engine)["n3"]
    tokens = [tuple(c.token_ids) for c in final.outputs]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert len(set(tokens)) == 3 and all(len(t) == 12 for t in tokens)


@pytest.mark.parametrize("prompt", ["Ça coûte 5 € — naïve 日本語の文 🐱🚀 fin", "ab"])
def test_delta_stream_merges_to_final_only(tiny_model_path, prompt):
    path = tiny_model_path("llama")
    outputs = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY,
                 RequestOutputKind.CUMULATIVE):
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(path)))
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, output_kind=kind,
                                ignore_eos=True)
        engine.add_request("d", prompt, params)
        merged, count = None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                count += 1
                if merged is None:
                    merged = out
                else:
                    merged.add(out, aggregate=kind == RequestOutputKind.DELTA)
        outputs[kind] = (merged, count)
    final, count = outputs[RequestOutputKind.FINAL_ONLY]
    assert count == 1
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        merged, count = outputs[kind]
        assert count == 40
        assert merged.outputs[0].text == final.outputs[0].text
        assert merged.outputs[0].token_ids == final.outputs[0].token_ids
        assert merged.finished and merged.outputs[0].finish_reason == "length"
    assert final.outputs[0].text == engine.tokenizer.decode(final.outputs[0].token_ids,
                                                            skip_special_tokens=True)
