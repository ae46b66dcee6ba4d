"""The engine end to end with the Triton kernels (interpreted) in place of the reference."""

import random

import pytest

pytestmark = pytest.mark.interpret


def _greedy(path, prompts, **engine_kw):
    from lorapool import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), **engine_kw))
    for i, (prompt, max_tokens) in enumerate(prompts):
        engine.add_request(
            f"r{i}",
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
        )
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [finals[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama"])
def test_greedy_outputs_unchanged_under_the_interpreter(tiny_model_path, monkeypatch, arch):
    path = tiny_model_path(arch)
    rng = random.Random(0)
    prompts = [
        ([rng.randrange(3, 512) for _ in range(n)], m)
        for n, m in [(1, 6), (40, 8), (17, 5), (70, 4)]
    ]
    # Chunked prefill: prompts are split, so attention also runs over cached context.
    engine_kw = dict(block_size=16, max_num_batched_tokens=32, max_num_seqs=4)
    want = _greedy(path, prompts, **engine_kw)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _greedy(path, prompts, **engine_kw) == want


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_layer_kernels_keep_greedy_outputs(tiny_model_path, monkeypatch, arch):
    """The fused layer kernels (qwen3: with its q/k norms fused) change no greedy token."""
    path = tiny_model_path(arch)
    rng = random.Random(2)
    prompts = [([rng.randrange(3, 512) for _ in range(n)], m) for n, m in [(1, 5), (37, 6), (9, 4)]]
    engine_kw = dict(block_size=16, max_num_batched_tokens=32, max_num_seqs=4)
    want = _greedy(path, prompts, **engine_kw)
    from lorapool.kernels import rotary_ops

    launches = []
    rotary = rotary_ops.rotary_write_kv
    monkeypatch.setattr(rotary_ops, "rotary_write_kv", lambda *a: launches.append(1) or rotary(*a))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _greedy(path, prompts, fused_layer_kernels=True, **engine_kw) == want
    assert launches, "the fused kernels did not run"


def _greedy_lora_twice(path, jobs, **engine_kw):
    """Run the mixed-adapter jobs, then again on the same engine (prefix cache warm)."""
    from lorapool import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), **engine_kw))
    results = []
    for round_no in range(2):
        for i, (prompt, max_tokens, lora) in enumerate(jobs):
            engine.add_request(
                f"r{round_no}-{i}",
                {"prompt_token_ids": prompt},
                SamplingParams(temperature=0.0, max_tokens=max_tokens),
                lora_request=lora,
            )
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        results += [
            (
                finals[f"r{round_no}-{i}"].outputs[0].token_ids,
                finals[f"r{round_no}-{i}"].num_cached_tokens,
            )
            for i in range(len(jobs))
        ]
    return results


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_mixed_adapter_batch_unchanged_under_the_interpreter(
    tiny_model_path, tmp_path, monkeypatch, fused
):
    from adapters import ALL_TARGETS, build_adapter

    from lorapool import LoRARequest
    from lorapool.kernels import lora_ops

    path = tiny_model_path("llama")
    loras = [
        LoRARequest(
            f"i{n}", n + 1, str(build_adapter(path, tmp_path / f"i{n}", rank=r, targets=t, seed=n))
        )
        for n, (r, t) in enumerate([(8, ["q_proj", "v_proj"]), (16, ALL_TARGETS)])
    ]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 21, 12)]
    jobs = [
        (prompts[0], 4, loras[0]),
        (prompts[1], 4, None),
        (prompts[1], 3, loras[1]),
        (prompts[2], 4, loras[1]),
    ]
    engine_kw = dict(
        block_size=8,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        enable_prefix_caching=True,
    )
    want = _greedy_lora_twice(path, jobs, **engine_kw)
    assert want[5][1] == 16  # the second round's long prompt came from the cache
    launches = []
    shrink = lora_ops.lora_shrink
    monkeypatch.setattr(lora_ops, "lora_shrink", lambda *a: launches.append(1) or shrink(*a))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _greedy_lora_twice(path, jobs, fused_layer_kernels=fused, **engine_kw) == want
    assert launches, "the Triton LoRA kernels did not run"


def test_live_work_lora_path_changes_no_token(tiny_model_path, tmp_path, monkeypatch):
    """``EngineArgs.lora_live_work``: the two-launch LoRA path gives the tokens of the old
    one and of PEFT, interpreted, over a mix of adapters of two ranks, base requests and
    chunked prefills (several tiles of one adapter)."""
    from adapters import ALL_TARGETS, build_adapter, peft_greedy

    from lorapool import LoRARequest
    from lorapool.kernels import lora_ops

    path = tiny_model_path("llama")
    loras = [
        LoRARequest(
            f"l{n}", n + 1, str(build_adapter(path, tmp_path / f"l{n}", rank=r, targets=t, seed=n))
        )
        for n, (r, t) in enumerate([(4, ["q_proj", "v_proj", "down_proj"]), (16, ALL_TARGETS)])
    ]
    rng = random.Random(2)
    jobs = [
        ([rng.randrange(3, 512) for _ in range(n)], m, lora)
        for n, m, lora in [(5, 4, loras[0]), (19, 3, None), (23, 4, loras[1]), (2, 5, loras[1])]
    ]
    engine_kw = dict(
        block_size=8, max_num_batched_tokens=16, max_num_seqs=4, enable_lora=True, max_loras=2
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    old = _greedy_lora_twice(path, jobs, **engine_kw)
    launches = []
    linear = lora_ops.lora_linear
    monkeypatch.setattr(lora_ops, "lora_linear", lambda *a: launches.append(1) or linear(*a))
    assert _greedy_lora_twice(path, jobs, lora_live_work=True, **engine_kw) == old
    assert launches, "the live-work path did not run"
    for (prompt, max_tokens, lora), (tokens, _) in zip(jobs, old):
        assert tokens == peft_greedy(path, lora and lora.lora_path, prompt, max_tokens)
