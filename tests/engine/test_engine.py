"""The engine end to end against transformers: greedy tokens, logprobs, streaming."""

import pytest
import torch
from engine_runs import assert_matches_transformers, run_staggered, run_until_finished, workload
from oracle import hf_log_softmax

from lorapool import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


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
    chunked = LLMEngine.from_engine_args(
        EngineArgs(model=str(path), max_num_batched_tokens=16, max_num_seqs=16)
    )
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
        sum(completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)), abs=1e-4
    )
    assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        lp = final.prompt_logprobs[pos][prompt[pos]].logprob
        assert lp == pytest.approx(expected[pos - 1, prompt[pos]].item(), abs=1e-4)


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
    for kind in (
        RequestOutputKind.DELTA,
        RequestOutputKind.FINAL_ONLY,
        RequestOutputKind.CUMULATIVE,
    ):
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(path)))
        params = SamplingParams(
            temperature=0.8, seed=3, max_tokens=40, output_kind=kind, ignore_eos=True
        )
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
    assert final.outputs[0].text == engine.tokenizer.decode(
        final.outputs[0].token_ids, skip_special_tokens=True
    )


@pytest.mark.parametrize("cut", [1, 7, 19])
def test_resume_continues_a_seeded_stream_gaplessly(tiny_model_path, cut):
    path = tiny_model_path("llama")
    params = SamplingParams(
        temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    prompt = "Ça coûte 5 € 🐱"
    first = LLMEngine.from_engine_args(EngineArgs(model=str(path)))
    first.add_request("r", prompt, params)
    deltas = [out.outputs[0] for out in iter_outputs(first)]
    tokens = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    streamed_text = "".join(d.text for d in deltas[:cut])  # what the client had at the cut

    second = LLMEngine.from_engine_args(EngineArgs(model=str(path)))
    second.add_request("r", prompt, params, resume_token_ids=tokens[:cut])
    rest = [out.outputs[0] for out in iter_outputs(second)]
    assert [t for d in rest for t in d.token_ids] == tokens[cut:]
    assert streamed_text + "".join(d.text for d in rest) == text
    assert rest[-1].finish_reason == "length"


def iter_outputs(engine):
    while engine.has_unfinished_requests():
        yield from engine.step()


def test_resume_is_validated(tiny_model_path):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_path("llama"))))
    with pytest.raises(ValueError, match="only n=1"):
        engine.add_request("a", "x", SamplingParams(n=2), resume_token_ids=[5])
    with pytest.raises(ValueError, match="leave none"):
        engine.add_request("b", "x", SamplingParams(max_tokens=2), resume_token_ids=[5, 6])
