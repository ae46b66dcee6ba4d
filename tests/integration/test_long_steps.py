"""An engine step longer than the lease (a loaded CPU, a huge prefill): the worker's
sender renews the lease during the step, so a peer finds nothing idle to claim and the
worker that runs a request finishes it.

A real Worker around the benchmark's stand-in engine (1.6 s steps, lease 1 s); the
peer is the same XAUTOCLAIM a worker's failover runs, every 0.1 s; the oracle of the
streams is the stand-in's deterministic output.
"""

import threading
import time

import pytest
from standin import load

from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.lease import claim_idle
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")


def test_a_step_longer_than_the_lease_keeps_its_entries(conn, keys, producer):
    bench = load()
    ids = [f"long-{i}" for i in range(3)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    producer.submit_many([{"prompt_token_ids": [1]}] * 3, params, request_ids=ids)
    config = WorkerConfig(
        prefix=keys.prefix,
        shards=keys.shards,
        name="slow",
        burst=True,
        lease_s=1.0,
        audit_key=bench.AUDIT_KEY.encode(),
    )
    worker = Worker(bench.StandInEngine(8, 1.6), conn, config, bench.BASE_MODEL)
    worker.ensure_group()  # on every shard, before the peer looks
    thread = threading.Thread(target=worker.run)
    thread.start()
    stolen = []
    while thread.is_alive():  # a peer's failover: entries idle past the lease are its
        for view in keys.shard_views:
            stolen += claim_idle(conn, view.requests, "peer", 1000, 100)
        time.sleep(0.1)
    thread.join()
    assert stolen == []
    for rid in ids:
        chunks = log_chunks(conn, keys, rid)
        tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(2)]
        assert [c.finished for c in chunks].count(True) == 1
        assert chunks[-1].worker == "slow" and chunks[-1].error is None
