"""No head-of-line blocking (issue 31, row D in miniature): a request of many samples
that must wait for KV blocks does not stop the worker from reading and running small
jobs submitted after it, and it finishes too (its wait is bounded).

Real Redis, the real worker loop (``Worker.run_once``), the real engine on the tiny
model with a cache of 28 blocks of 16 tokens:
- "occupier": a 96-token prompt and 300 tokens to generate (6 blocks, growing to 25);
- "big": n=4 samples of a 368-token prompt (23 blocks: it cannot start while the
  occupier runs, but fits once it is done: 23 + 4 blocks);
- three small jobs (1 block each) submitted once the big one waits.
Before the change the worker read nothing while the big one waited (and the scheduler
admitted nothing behind it), so the small ones finished after the occupier.
"""

import time

import pytest

from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone",)
BLOCKS = 28


@pytest.fixture(scope="module")
def engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, num_kv_blocks=BLOCKS, max_num_seqs=8, max_num_batched_tokens=512)
    )
    # the big one starves (nothing goes ahead of it) after this many skipped steps; the
    # default (8) would make the test depend on how many steps the small jobs' read takes
    # on a loaded machine (test_scheduler checks the bound itself)
    engine.scheduler.config.starvation_steps = 64
    return engine


def tokens(n, start):
    return {"prompt_token_ids": [(start + i) % 400 + 10 for i in range(n)]}


def test_small_jobs_run_while_a_big_one_waits_for_blocks(engine, conn, keys, producer, model):
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, lease_s=5, block_ms=10)
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.ensure_group()
    occupier = producer.submit(
        tokens(96, 0), SamplingParams(max_tokens=300, ignore_eos=True), request_id="occupier"
    )
    big = producer.submit(
        tokens(368, 100),
        SamplingParams(n=4, max_tokens=16, ignore_eos=True, seed=1),
        request_id="big",
    )
    deadline = time.monotonic() + 25
    # run until both are in the engine and the big one waits for blocks
    while not ({"occupier", "big"} <= set(engine.requests) and engine.request_counts() == (1, 1)):
        assert time.monotonic() < deadline, "the two first jobs never got into the engine"
        worker.run_once()
    assert engine.block_manager.num_free_blocks < 23  # the big one cannot start yet
    small_params = SamplingParams(max_tokens=8, ignore_eos=True)
    smalls = producer.submit_many(
        [tokens(4, 500 + i) for i in range(3)], small_params, request_ids=["s0", "s1", "s2"]
    )
    finished, held = [], set(worker.held)
    big_admitted_at = None
    while worker.held or engine.has_unfinished_requests() or len(finished) < 5:
        assert time.monotonic() < deadline, f"not all finished in time: {finished}"
        worker.run_once()
        now = set(worker.held)
        finished += sorted(held - now)
        held = now
        if big_admitted_at is None and not any(
            s.request.request_id == "big" for s in engine.scheduler.waiting
        ):
            big_admitted_at = len(finished)
    worker.publisher.flush(wait=True)
    assert sorted(finished[:3]) == ["s0", "s1", "s2"], finished  # before the occupier ended
    assert finished[3:] == ["occupier", "big"], finished
    assert big_admitted_at is not None and big_admitted_at >= 3  # it waited through them
    for handle in smalls:
        assert len(handle.result(timeout=5).outputs[0].token_ids) == 8
    assert len(occupier.result(timeout=5).outputs[0].token_ids) == 300
    out = big.result(timeout=5)
    assert [len(c.token_ids) for c in out.outputs] == [16] * 4
    assert all(c.finish_reason == "length" for c in out.outputs)
