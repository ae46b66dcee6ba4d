"""A request whose logits turn non-finite ends alone with finish_reason "error".

The adapter's weights are finite (so the load check passes) but so large that
its activations overflow float32; the other requests of the batch, and of the
next batch, must produce the tokens they produce alone (the oracle: the same
engine running each clean request by itself).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from adapters import build_adapter
from safetensors.torch import load_file, save_file

from lorapool import EngineArgs, LLMEngine, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45], [7] * 9]


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("overflow")
    clean = build_adapter(base, root / "clean", rank=4, seed=1)
    huge = build_adapter(
        base, root / "huge", rank=4, seed=2, targets=("gate_proj", "up_proj", "down_proj")
    )
    file = str(Path(huge) / "adapter_model.safetensors")
    scale = {"lora_A": 100.0, "lora_B": 1e38}  # every weight finite; the MLP overflows
    weights = {
        n: t * scale["lora_B" if "lora_B" in n else "lora_A"] for n, t in load_file(file).items()
    }
    save_file(weights, file)
    nan = build_adapter(base, root / "nan", rank=4, seed=3)
    file = str(Path(nan) / "adapter_model.safetensors")
    weights = load_file(file)
    next(t for n, t in sorted(weights.items()) if "lora_B" in n)[0, 0] = float("nan")
    save_file(weights, file)
    return (
        LoRARequest("clean", 1, str(clean)),
        LoRARequest("huge", 2, str(huge)),
        LoRARequest("nan", 3, str(nan)),
    )


MODES = pytest.mark.parametrize(
    "mode",
    [None, "async_output_proc", "async_scheduling"],
    ids=["sync", "async_output", "async_sched"],
)


def engine(base, mode=None):
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=str(base),
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            **({mode: True} if mode else {}),
        )
    )


def run(llm, jobs):
    for rid, prompt, lora in jobs:
        llm.add_request(rid, {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    return done


@MODES
def test_overflowing_and_nan_adapters_fail_alone(base, adapters, mode):
    """The issue's acceptance batch: an adapter whose finite weights overflow (it runs and
    fails) and one with NaN weights (refused at load), next to clean requests."""
    clean, huge, nan = adapters
    solo_engine = engine(base)
    solo = {
        f"{i}-{lora}": run(solo_engine, [("x", p, lora)])["x"].outputs[0].token_ids
        for i, p in enumerate(PROMPTS)
        for lora in (None, clean)
    }
    llm = engine(base, mode)
    mixed = [(f"{i}-{lora}", p, lora) for i, p in enumerate(PROMPTS) for lora in (None, clean)]
    done = run(llm, [*mixed, ("bad", PROMPTS[0], huge), ("nan", PROMPTS[1], nan)])
    bad = done["bad"]
    assert bad.outputs[0].finish_reason == "error"
    assert "non-finite (NaN or Inf)" in bad.error
    refused = done["nan"]
    assert refused.outputs[0].finish_reason == "error" and "'nan'" in refused.error
    for rid, _, _ in mixed:
        assert done[rid].outputs[0].token_ids == solo[rid], rid
    again = run(llm, mixed)  # the next batch reuses the blocks the failed request freed
    for rid, _, _ in mixed:
        assert again[rid].outputs[0].token_ids == solo[rid], rid
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@MODES
@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_last_token_that_overflows_fails_its_request(base, adapters, mode, max_tokens):
    """The overflowing adapter's first token is non-finite; with max_tokens 1 it is also
    the last, which async scheduling knows before it lands (the sequence leaves the
    scheduler then): the request ends with "error" all the same, as with max_tokens 2;
    the clean request beside it ends by length."""
    clean, huge, _ = adapters
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = engine(base, mode)
    for rid, lora in (("bad", huge), ("ok", clean)):
        llm.add_request(rid, {"prompt_token_ids": PROMPTS[0]}, params, lora_request=lora)
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert done["bad"].outputs[0].finish_reason == "error"
    assert "non-finite (NaN or Inf)" in done["bad"].error
    assert done["ok"].outputs[0].finish_reason == "length"
    assert len(done["ok"].outputs[0].token_ids) == max_tokens
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@MODES
def test_sampled_rows_of_an_overflowing_adapter_fail_alone(base, adapters, mode):
    """The sampler's path (temperature, logprobs, n forked): the overflowing request,
    its n samples included, ends with "error"; seeded clean requests beside it keep
    their solo tokens and logprobs."""
    clean, huge, _ = adapters
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=2)
    forked = SamplingParams(temperature=1.0, n=3, max_tokens=8, ignore_eos=True)

    def submit(llm, jobs):
        for rid, prompt, lora, params in jobs:
            llm.add_request(rid, {"prompt_token_ids": prompt}, params, lora_request=lora)
        done = {}
        while llm.has_unfinished_requests():
            done.update({o.request_id: o for o in llm.step() if o.finished})
        return done

    jobs = [
        (f"{i}-{lora}", p, lora, sampled) for i, p in enumerate(PROMPTS) for lora in (None, clean)
    ]
    solo = {job[0]: submit(engine(base), [job])[job[0]].outputs[0] for job in jobs}
    done = submit(engine(base, mode), [*jobs, ("bad", PROMPTS[0], huge, forked)])
    bad = done["bad"]
    assert [o.finish_reason for o in bad.outputs] == ["error"] * 3
    assert "non-finite (NaN or Inf)" in bad.error
    for rid, *_ in jobs:
        got = done[rid].outputs[0]
        assert got.token_ids == solo[rid].token_ids, rid
        for mine, alone in zip(got.logprobs, solo[rid].logprobs, strict=True):  # batch: ulps
            assert mine.keys() == alone.keys(), rid
            assert all(abs(mine[t].logprob - alone[t].logprob) < 1e-4 for t in mine), rid


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_what_free_cache_blocks_hold_never_reaches_a_request(base, poison):
    """A freed block keeps whatever its last request wrote (NaN, Inf): decode padding
    and block tails must not read it. The engine's whole cache is filled with it first."""
    jobs = [(f"r{i}", p, None) for i, p in enumerate(PROMPTS)]
    want = run(engine(base), jobs)
    llm = engine(base)
    for key_cache, value_cache in llm.runner.kv_caches:
        key_cache.fill_(poison)
        value_cache.fill_(poison)
    got = run(llm, jobs)
    for rid, _, _ in jobs:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
        assert got[rid].outputs[0].finish_reason == "length"
