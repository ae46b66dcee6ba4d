"""``lorapool bench engine --schema-every 4``: what structured outputs cost the requests
that have none.

The same workload runs twice in one engine, alternating (``rounds`` times each):
- *schemas*: every ``every``-th request has a JSON schema (greedy, it ends when its
  JSON does); the others are greedy, exactly their workload lengths;
- *plain*: the same, but the every-``every``-th requests have no schema and generate
  exactly as many tokens as they did under it, so each step batches the same
  sequences as in the schemas run, and only the masks differ.
"Others" are the requests without a schema in both runs: their tokens over the time
until the last of them finished, in wall seconds and in this process's CPU seconds
(every thread's, the mask thread's included: on a machine shared with other jobs the
wall clock moves with their load, the CPU time far less). The masks' own cost comes
from the engine's ``MaskStats``: per mask (one token of one sequence) the time filling
it took in its thread, and the time steps waited for masks after their forward pass.
"""

from __future__ import annotations

import time

from lorapool import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "vaccinated": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "tags", "vaccinated"],
    "additionalProperties": False,
}


def run_schemas(model: str, workload, threads: int, every: int, rounds: int = 2) -> dict:
    import torch

    from lorapool import EngineArgs, LLMEngine

    torch.set_num_threads(threads)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=64, max_num_batched_tokens=2048)
    )
    constrained = set(range(every - 1, len(workload), every))
    schema = StructuredOutputsParams(json=SCHEMA)
    engine.guides.guide(schema)  # the tokenizer's one-time conversion, before any clock
    lengths: dict[int, int] = {}
    results: dict[str, list] = {"schemas": [], "plain": []}
    for r in range(rounds):
        for kind in ("schemas", "plain"):
            params = [_params(i, n, constrained, kind, schema, lengths) for i, (_, n) in
                      enumerate(workload)]  # fmt: skip
            before = _mask_totals(engine)
            run = _drive(engine, workload, params, constrained, f"{kind}{r}-")
            if kind == "schemas":
                lengths.update(run.pop("lengths"))
            else:
                run.pop("lengths")
            run.update(_mask_delta(engine, before))
            results[kind].append(run)
            print(f"  {kind} round {r}: {run}", flush=True)
    return _summary(results, len(constrained), len(workload))


def _params(i, n, constrained, kind, schema, lengths) -> SamplingParams:
    if i not in constrained:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    if kind == "schemas":
        return SamplingParams(temperature=0.0, max_tokens=256, structured_outputs=schema)
    return SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)


def _drive(engine, workload, params, constrained, label) -> dict:
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, ((prompt, _), p) in enumerate(zip(workload, params)):
        engine.add_request(f"{label}{i}", {"prompt_token_ids": prompt}, p)
    others_tokens, others_end, cpu_end, lengths, steps = 0, start, cpu_start, {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        for out in outputs:
            if not out.finished:
                continue
            i = int(out.request_id.removeprefix(label))
            n = len(out.outputs[0].token_ids)
            if i in constrained:
                lengths[i] = n
            else:
                others_tokens += n
                others_end, cpu_end = time.perf_counter(), time.process_time()
    seconds, cpu = others_end - start, cpu_end - cpu_start
    return {
        "others_tokens": others_tokens,
        "others_seconds": round(seconds, 3),
        "others_tokens_per_s": round(others_tokens / seconds, 2),
        "others_cpu_seconds": round(cpu, 3),
        "others_tokens_per_cpu_s": round(others_tokens / cpu, 2),
        "steps": steps,
        "lengths": lengths,
    }


def _mask_totals(engine):
    s = engine.mask_pool.stats
    return s.masks, s.fill_s, s.wait_s


def _mask_delta(engine, before) -> dict:
    masks, fill, wait = (a - b for a, b in zip(_mask_totals(engine), before))
    if not masks:
        return {}
    return {
        "masks": masks,
        "mask_fill_us_per_token": round(fill / masks * 1e6, 1),
        "mask_wait_us_per_token": round(wait / masks * 1e6, 1),
    }


def _summary(results: dict, num_constrained: int, num_requests: int) -> dict:
    best = {k: max(r["others_tokens_per_s"] for r in runs) for k, runs in results.items()}
    masks = [r for r in results["schemas"] if "masks" in r]
    paired = sorted(
        s["others_tokens_per_s"] / p["others_tokens_per_s"]
        for s, p in zip(results["schemas"], results["plain"])
    )  # each round's schemas run against the plain run right after it
    cpu = sorted(
        s["others_tokens_per_cpu_s"] / p["others_tokens_per_cpu_s"]
        for s, p in zip(results["schemas"], results["plain"])
    )
    return {
        "requests": num_requests,
        "with_schema": num_constrained,
        "others_tokens_per_s_plain": best["plain"],
        "others_tokens_per_s_schemas": best["schemas"],
        "ratio_schemas_to_plain": round(best["schemas"] / best["plain"], 3),
        "ratio_median_of_rounds": round(paired[len(paired) // 2], 3),
        "cpu_ratio_median_of_rounds": round(cpu[len(cpu) // 2], 3),
        "cpu_ratios": [round(r, 3) for r in cpu],
        "mask_fill_us_per_token": min(r["mask_fill_us_per_token"] for r in masks),
        "mask_wait_us_per_token": min(r["mask_wait_us_per_token"] for r in masks),
        "runs": results,
    }
