"""Chunks coalesce under load (``WorkerConfig.max_chunk_rate``) and only then: the real
Worker around the benchmark's stand-in engine, on both layouts.

Oracle: the stand-in's tokens are a fixed function of (request id, position)
(``token_of``): every log read back must hold exactly them, in order, whatever the
chunking; how many tokens a chunk holds is what the policy decides.
"""

from statistics import mean

import pytest
from standin import load

from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.publisher import MAX_BEHIND

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
TOKENS = 40
# Steps this long leave a round trip time to spare even on a loaded machine (one
# that outlasts a step merges steps whatever the rate: the sender is still busy).
STEP_S = 0.05


def run(conn, keys, producer, requests: int, step_s: float, rate: int) -> list[list[int]]:
    """Tokens per chunk of each request's log, after a burst worker ran them all."""
    bench = load()
    ids = [f"c{i}" for i in range(requests)]
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    producer.submit_many([{"prompt_token_ids": [1, 2]}] * requests, params, request_ids=ids)
    config = WorkerConfig(
        prefix=keys.prefix,
        shards=keys.shards,
        burst=True,
        audit_key=bench.AUDIT_KEY.encode(),
        max_chunk_rate=rate,
    )
    Worker(bench.StandInEngine(64, step_s), conn, config, bench.BASE_MODEL).run()
    sizes = []
    for rid in ids:
        chunks = log_chunks(conn, keys, rid)
        tokens = [t for chunk in chunks for out in chunk.outputs for t in out.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(TOKENS)], rid
        assert [chunk.seq for chunk in chunks] == list(range(len(chunks)))
        assert [chunk.finished for chunk in chunks].count(True) == 1 and chunks[-1].finished
        sizes.append([chunk.num_tokens for chunk in chunks])
    return sizes


def test_a_busy_worker_writes_several_steps_in_a_chunk(conn, keys, producer):
    # 32 chunks a trip at 100 chunks/s: a trip every 320 ms, past MAX_BEHIND 50 ms steps
    sizes = run(conn, keys, producer, 32, STEP_S, 100)
    flat = [n for request in sizes for n in request]
    assert max(flat) <= MAX_BEHIND  # the bound on a token's delay
    assert mean(flat) > MAX_BEHIND - 1  # nearly every chunk as late as allowed
    # a first chunk does not wait for the rate (time to first token)
    assert mean([request[0] for request in sizes]) < 1.5, sizes


def test_a_light_pool_writes_every_step(conn, keys, producer):
    # 4 chunks a trip at 3,000 chunks/s: due after 1.3 ms, long before the next 50 ms
    # step. (A round trip that outlasts a step still merges steps: on a loaded machine.)
    sizes = run(conn, keys, producer, 4, STEP_S, 3000)
    assert mean([n for request in sizes for n in request]) < 1.5, sizes


def test_without_a_rate_a_busy_worker_writes_every_step(conn, keys, producer):
    sizes = run(conn, keys, producer, 32, STEP_S, 0)  # the busy pool above, no rate
    assert mean([n for request in sizes for n in request]) < 1.5, sizes
