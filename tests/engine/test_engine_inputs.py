"""Bad input: a ValueError naming the problem at add_request, the others unaffected."""

import pytest

from lorapool import EngineArgs, LLMEngine, LoRARequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_model_path("llama")), max_logprobs=5)
    )


BAD_PARAMS = [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n must be"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
]


@pytest.mark.parametrize("kwargs, match", BAD_PARAMS)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def bad_requests():
    return [
        ("too-long", {"prompt_token_ids": [5] * 512}, SamplingParams(), "model's context is 512"),
        ("empty", "", SamplingParams(), "prompt is empty"),
        ("empty-ids", {"prompt_token_ids": []}, SamplingParams(), "prompt is empty"),
        ("bad-ids", {"prompt_token_ids": [5, 99999]}, SamplingParams(), "vocabulary"),
        ("lp", "hello", SamplingParams(logprobs=6), "logprobs=6 exceeds the limit"),
        ("plp", "hello", SamplingParams(prompt_logprobs=9), "prompt_logprobs=9 exceeds"),
        ("params", "hello", {"temperature": 0}, "params must be SamplingParams"),
    ]


def test_bad_requests_are_refused_and_the_others_keep_going(engine):
    good = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("good-1", "a fine prompt", good)
    engine.step()
    for request_id, prompt, params, match in bad_requests():
        with pytest.raises(ValueError, match=match):
            engine.add_request(request_id, prompt, params)
        assert request_id not in engine.requests
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("good-1", "again", good)
    with pytest.raises(ValueError, match="enable_lora"):
        engine.add_request("lora", "hi", good, lora_request=LoRARequest("a", 1, "/nowhere"))
    engine.add_request("good-2", "another prompt", good)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert sorted(finals) == ["good-1", "good-2"]
    assert all(len(o.outputs[0].token_ids) == 6 for o in finals.values())


def test_abort_gives_a_final_abort_output(engine):
    engine.add_request("gone", "abort me", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("gone")
    outs = engine.step()
    assert [o.request_id for o in outs] == ["gone"]
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("when", ["before-any-step", "after-fork"])
def test_ending_an_n_request_ends_every_sample(engine, when):
    engine.add_request("n3", "three samples", SamplingParams(n=3, seed=2, max_tokens=40))
    if when == "after-fork":
        engine.step()
        assert len(engine.requests["n3"].seqs) == 3
    engine.abort_request("n3")
    (final,) = engine.step()
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert {c.finish_reason for c in final.outputs} == {"abort"}
    assert not engine.has_unfinished_requests()
