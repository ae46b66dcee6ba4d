"""Helpers of the async engine tests (tests/engine/test_async_steps.py,
test_async_scheduling.py): engines with an async flag on, and a driver that records
every output each request streamed, to compare with the synchronous engine's."""

from __future__ import annotations

import itertools

from lorapool import EngineArgs, LLMEngine, RequestOutputKind

KINDS = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
# frequent in the tiny byte-level tokenizer's decodes of a random model: stop strings
# that end requests mid-way, sometimes on the step's last allowed token
STOPS = ["a", "e", "o", " ", "t", "in", "er", "!!", "\n"]
run_ids = itertools.count()  # distinct request ids across examples


def make(path, mode: str | None, **kw) -> LLMEngine:
    """An engine with the flag ``mode`` on; None: the synchronous engine."""
    flags = {mode: True} if mode else {}
    return LLMEngine.from_engine_args(EngineArgs(model=str(path), **flags, **kw))


def drive(engine, jobs):
    """Add job i (prompt, params, step to arrive at) while stepping; every output each
    request streamed, in order: (finished, error, per completion (index, text, token
    ids, finish reason, stop reason, logprobs' tokens and ranks)), and apart, the
    logprob values (a batch of another size moves them by float ulps)."""
    engine.abort_request(list(engine.requests))  # a failed example's, while shrinking
    while engine.has_unfinished_requests():
        engine.step()
    streamed: dict[str, list] = {}
    values: dict[str, list] = {}
    pending, step = sorted(jobs, key=lambda j: j[3]), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            rid = out.request_id
            completions = []
            for c in out.outputs:
                ranks = [{t: lp.rank for t, lp in d.items()} for d in c.logprobs or []]
                completions.append(
                    (c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, ranks)
                )
                values.setdefault(rid, []).append(c.cumulative_logprob or 0.0)
                values[rid] += [lp.logprob for d in c.logprobs or [] for lp in d.values()]
            streamed.setdefault(rid, []).append((out.finished, out.error, completions))
        # what finished leaves the scheduler in the step that gave it its last token
        assert all(seq.finish_reason is None for seq in engine.scheduler.running)
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests and not engine._deferred and engine._in_flight is None
    return streamed, values
