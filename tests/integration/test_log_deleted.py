"""A chunk log an operator deletes (``DEL``) while its request runs (issue 31
Acceptance, the stateful test's operator actions): the worker goes on and makes the log
again from the next chunk, without the chunks before; the request ends with its final
chunk and the whole output in its marker. Every reader (``JobHandle``, and
``AsyncJobHandle`` through the gateway's ``Follower``) gets that output within seconds of
the end, from the final record, instead of waiting for chunks no one will write again
until the log expires (``log_grace_s``, 60 s) -- what the stateful test found.

Real Redis (both layouts), a real ``Worker`` loop around the stand-in engine.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from pool_layout import async_result
from standin import load

from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
TOKENS = 60
bench = load()


def test_readers_of_a_log_deleted_while_it_ran_get_the_output(conn, keys, producer, pool_url):
    config = WorkerConfig(
        prefix=keys.prefix, shards=keys.shards, name="w", audit_key=bench.AUDIT_KEY.encode()
    )
    worker = Worker(bench.StandInEngine(8, 0.001), conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    try:
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        handle = producer.submit({"prompt_token_ids": [1, 2]}, params, request_id="headless")
        out = keys.for_request("headless").out("headless")
        while conn.llen(out) < 5:
            worker.run_guarded()
        conn.delete(out)  # an operator's DEL while it runs
        while "headless" in worker.held:
            worker.run_guarded()
        chunks = log_chunks(conn, keys, "headless")
        assert chunks[0].seq > 0 and chunks[-1].finished  # made again, without its head
        started = time.monotonic()
        output = handle.result(timeout=30)
        assert time.monotonic() - started < 5
        expected = [bench.token_of("headless", k) for k in range(TOKENS)]
        assert output.finished and output.outputs[0].token_ids == expected
        assert [
            o.token_ids for o in asyncio.run(async_result(pool_url, keys, "headless")).outputs
        ] == [expected]
        assert time.monotonic() - started < 10
    finally:
        worker.teardown()
