"""Multi-LoRA end to end: mixed-adapter batches against PEFT, slots, failures, identity."""

import random

import pytest
from adapters import ALL_TARGETS, build_adapter, peft_greedy
from engine_runs import run_jobs

from lorapool import EngineArgs, LLMEngine, LoRARequest, SamplingParams

# name, rank, targets, lora_alpha, use_rslora
SPECS = [
    ("qv8", 8, ["q_proj", "v_proj"], 16, False),
    ("all16", 16, ALL_TARGETS, 32, False),
    ("all64", 64, ALL_TARGETS, 16, False),
    ("attn16-rs", 16, ["q_proj", "k_proj", "v_proj", "o_proj"], 8, True),
    ("mlp8", 8, ["gate_proj", "up_proj", "down_proj"], 4, False),
    ("kv64", 64, ["k_proj", "v_proj"], 128, False),
    ("od16", 16, ["o_proj", "down_proj"], 16, False),
    ("qgu8", 8, ["q_proj", "gate_proj", "up_proj"], 12, False),
]


def make_adapters(base, root, std=0.1):
    return [
        LoRARequest(
            name,
            i + 1,
            str(
                build_adapter(
                    base, root / name, rank=r, targets=t, alpha=a, use_rslora=rs, seed=i, std=std
                )
            ),
        )
        for i, (name, r, t, a, rs) in enumerate(SPECS)
    ]


@pytest.fixture(scope="module")
def loras(base, tmp_path_factory):
    return make_adapters(base, tmp_path_factory.mktemp("loras"))


def workload(loras, vocab, seed=0, per_adapter=2, num_base=3, max_out=12):
    """(prompt ids, max_tokens, lora_request or None), shuffled; one prompt shared by all."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    jobs = [(shared, max_out, lora) for lora in [None, *loras]]
    for lora in [None] * num_base + list(loras) * per_adapter:
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        jobs.append((prompt, rng.randint(1, max_out), lora))
    rng.shuffle(jobs)
    return jobs


def assert_matches_peft(base, jobs, finals):
    for i, (prompt, max_tokens, lora) in enumerate(jobs):
        out = finals[f"req-{i}"]
        expected = peft_greedy(base, lora and lora.lora_path, prompt, max_tokens)
        assert out.outputs[0].token_ids == expected, f"req-{i} adapter {lora and lora.name}"


def engine_for(base, **kw):
    args = dict(model=str(base), enable_lora=True, max_loras=8, max_lora_rank=64)
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **kw}))


def test_mixed_batch_matches_peft_alone(base, loras):
    jobs = workload(loras, 512, per_adapter=1)
    engine = engine_for(base)
    finals = run_jobs(engine, jobs, every=2)
    assert len(finals) == len(jobs)
    assert_matches_peft(base, jobs, finals)
    prompts = [tuple(job[0]) for job in jobs]
    common = max(prompts, key=prompts.count)  # the prompt every adapter and the base ran
    shared = [
        tuple(finals[f"req-{i}"].outputs[0].token_ids)
        for i, prompt in enumerate(prompts)
        if prompt == common
    ]
    assert len(shared) == 9 and len(set(shared)) >= 6, "adapters barely change the output"


def test_two_slots_six_adapters_in_flight(base, loras):
    jobs = workload(loras[:6], 512, seed=1, per_adapter=2, num_base=2)
    engine = engine_for(base, max_loras=2, max_cpu_loras=3)
    steps, first_step, schedule = [], {}, engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        for item in out.scheduled:
            first_step.setdefault(item.seq.request.request_id, len(steps))
        steps.append(out.lora_ids)
        return out

    engine.scheduler.schedule = recording_schedule
    finals = run_jobs(engine, jobs, every=1)  # job i arrives before step i
    assert len(finals) == len(jobs)
    assert max(len(ids) for ids in steps) <= 2
    assert len(set().union(*steps)) == 6
    assert_matches_peft(base, jobs, finals)
    # The scheduler's bound: (k + 1) * (S + D) steps, k <= 5 other adapters waiting,
    # S = starvation_steps, D = 1 prefill step + at most 12 decode steps.
    bound = 6 * (engine.scheduler.config.starvation_steps + 13)
    waits = [first_step[f"req-{i}"] - i for i in range(len(jobs))]
    assert max(waits) <= bound, waits


def test_unloadable_adapter_fails_only_its_requests(base, loras, tmp_path):
    broken = LoRARequest("broken-lora", 99, str(tmp_path / "missing"))
    jobs = [
        ([5, 6, 7], 6, loras[0]),
        ([8, 9], 6, broken),
        ([10, 11], 6, None),
        ([12, 13, 14], 6, broken),
        ([15], 6, loras[1]),
    ]
    engine = engine_for(base)
    finals = run_jobs(engine, jobs, every=1)
    for i in (1, 3):
        out = finals[f"req-{i}"]
        assert out.outputs[0].finish_reason == "error"
        assert out.lora_request is broken and out.outputs[0].lora_request is broken
        assert "broken-lora" in out.error and "does not exist" in out.error
    ok = {i: jobs[i] for i in (0, 2, 4)}
    for i, (prompt, max_tokens, lora) in ok.items():
        expected = peft_greedy(base, lora and lora.lora_path, prompt, max_tokens)
        assert finals[f"req-{i}"].outputs[0].token_ids == expected


def test_every_output_carries_the_request_lora_object(base, loras):
    jobs = [([5, 6, 7], 8, loras[2]), ([8, 9], 8, None), ([3, 4], 8, loras[3])]
    seen = []
    run_jobs(engine_for(base), jobs, on_output=seen.append)
    by_id = {f"req-{i}": job[2] for i, job in enumerate(jobs)}
    assert len(seen) > len(jobs)
    for out in seen:
        expected = by_id[out.request_id]
        assert out.lora_request is expected
        assert all(c.lora_request is expected for c in out.outputs)


def test_n_samples_share_the_lora_object(base, loras):
    engine = engine_for(base)
    lora = loras[1]
    engine.add_request(
        "n", "hello", SamplingParams(n=3, temperature=0.8, max_tokens=4, seed=1), lora_request=lora
    )
    finals = run_jobs(engine, [])
    assert len(finals["n"].outputs) == 3
    assert all(c.lora_request is lora for c in finals["n"].outputs)


def test_engine_add_pin_list_remove(base, loras, tmp_path):
    engine = engine_for(base, max_loras=2, max_cpu_loras=4)
    assert engine.add_lora(loras[0]) and engine.add_lora(loras[1])
    assert engine.pin_lora(1)
    assert engine.list_loras() == {1, 2}
    assert engine.remove_lora(2) and engine.list_loras() == {1}
    with pytest.raises(ValueError, match="does not exist"):
        engine.add_lora(LoRARequest("nope", 5, str(tmp_path / "nope")))


@pytest.mark.slow
def test_mixed_batch_matches_peft_on_smollm2(smollm2_path, tmp_path_factory):
    loras = make_adapters(smollm2_path, tmp_path_factory.mktemp("smol-loras"), std=0.02)
    jobs = workload(loras, 49152, seed=2, per_adapter=1, num_base=2, max_out=8)
    finals = run_jobs(engine_for(smollm2_path), jobs, every=2)
    assert_matches_peft(smollm2_path, jobs, finals)


def test_base_requests_identical_with_lora_enabled(base, loras):
    jobs = [([5, 6, 7], 6, None), ([8, 9, 10, 11], 6, None)]
    plain = LLMEngine.from_engine_args(EngineArgs(model=str(base)))
    lora = engine_for(base)
    mixed = [*jobs, ([3, 4], 6, loras[1])]
    a, b = run_jobs(plain, jobs), run_jobs(lora, mixed)
    for i in range(len(jobs)):
        assert a[f"req-{i}"].outputs[0].token_ids == b[f"req-{i}"].outputs[0].token_ids
        assert a[f"req-{i}"].outputs[0].cumulative_logprob == pytest.approx(
            b[f"req-{i}"].outputs[0].cumulative_logprob, abs=1e-5
        )
