"""Driving an engine through a workload, for tests."""

import random

from oracle import hf_greedy

from lorapool import SamplingParams


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
            params = (
                params_for(i)
                if params_for
                else SamplingParams(temperature=0.0, max_tokens=max_tokens)
            )
            engine.add_request(f"req-{i}", {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step_no += 1
    return finals


def run_jobs(engine, jobs, every=1, on_output=None):
    """Add job i = (prompt, max_tokens, lora) as ``req-{i}`` at step i // every while
    stepping, greedy; returns the final outputs by request id."""
    finals, step_no, pending = {}, 0, list(enumerate(jobs))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] // every <= step_no:
            i, (prompt, max_tokens, lora) = pending.pop(0)
            engine.add_request(
                f"req-{i}",
                {"prompt_token_ids": prompt},
                SamplingParams(temperature=0.0, max_tokens=max_tokens),
                lora_request=lora,
            )
        for out in engine.step():
            if on_output:
                on_output(out)
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


def run_until_finished(engine):
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def engine_tokens(model: str, prompts: list[str], params, max_num_seqs: int) -> list[list[int]]:
    """Each prompt's tokens from an in-process engine of ``model``, in prompt order: what a
    pool of worker processes must give for the same jobs."""
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=max_num_seqs))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finals = run_until_finished(engine)
    return [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))]
