"""The gateway over a pool on a real 3-master Redis Cluster in 3 shards: a worker
process and ``lorapool serve`` started with ``--shards 3`` and a ``redis+cluster://``
URL, called with the official ``openai`` client (streamed and not, with an adapter and
without), against the engine's offline API in this process.

Needs ``$LORAPOOL_TEST_CLUSTER_URL``; skipped without it.
"""

from __future__ import annotations

import os
import uuid

import pytest
from gateway_procs import serve, start_worker, stop, wait_until

from lorapool.connection import connect
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.records.adapter import lora_from_record

pytestmark = pytest.mark.integration
SHARDS = "3"
PROMPTS = ["The capital of France is", "Once upon a time", "One two three", "Hello there"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model, adapter_dirs):
    url = os.environ.get("LORAPOOL_TEST_CLUSTER_URL")
    if not url:
        pytest.skip("no LORAPOOL_TEST_CLUSTER_URL (a Redis Cluster node; .ci/redis-cluster)")
    keys = Keys(f"test-gwc-{uuid.uuid4().hex[:10]}", int(SHARDS))
    conn = connect(url)
    producer = Producer(conn, prefix=keys.prefix, shards=keys.shards)
    registry = {name: producer.registry.add(name, path) for name, path in adapter_dirs.items()}
    worker = start_worker(
        url, keys.prefix, model, tmp_path_factory.mktemp("cw"), "--shards", SHARDS
    )
    try:
        wait_until(lambda: conn.hlen(keys.workers) >= 1 or worker.poll() is not None, "start")
        assert worker.poll() is None, "the worker exited"
        gateway, proc = serve(
            url,
            keys.prefix,
            tmp_path_factory.mktemp("cg"),
            "--shards",
            SHARDS,
            path="/readyz?min_workers=1",
        )
        try:
            yield gateway, registry
        finally:
            stop(proc)
    finally:
        stop(worker)
        for key in list(conn.scan_iter(match=keys.pattern)):
            conn.delete(key)
        conn.close()


def test_openai_client_through_a_sharded_pool(cluster, llm, base_name):
    import openai

    gateway, registry = cluster
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    lora = lora_from_record(registry["ad-qv"])
    want_base = llm.generate(PROMPTS, greedy)
    want_lora = llm.generate(PROMPTS, greedy, lora_request=lora)
    assert [w.outputs[0].text for w in want_base] != [w.outputs[0].text for w in want_lora]
    for prompt, base, adapted in zip(PROMPTS, want_base, want_lora):
        got = client.completions.create(
            model=base_name, prompt=prompt, max_tokens=10, temperature=0
        )
        assert got.choices[0].text == base.outputs[0].text
        stream = client.completions.create(
            model="ad-qv", prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == adapted.outputs[0].text
