"""A client of a Redis Cluster made while the node its URL names is away.

redis-py's cluster client learns the slots from that one node in its constructor,
outside any retry: a producer made during a stall of that master failed with
RedisClusterException after one socket timeout, one made while it restarted failed at
once (test_redis_faults' late submit on the cluster layout). ``connect`` and
``connect_async`` ride it out as any call does. On a private 3-master cluster
(tests/support/redis_cluster.py), whose first node is the URL's.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from redis_cluster import private_redis
from redis_server import RedisServer

from lorapool.connection import connect, connect_async
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with private_redis("cluster", tmp_path_factory.mktemp("cluster")) as server:
        yield server


def _later(seconds: float, action) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def test_producer_made_while_its_startup_node_restarts(cluster):
    node = cluster.nodes[0]
    node.kill()
    _later(0.8, node.start)
    started = time.monotonic()
    producer = Producer(cluster.url, shards=cluster.shards)  # refused at first
    handles = producer.submit_many(
        ["a", "b"], SamplingParams(max_tokens=2), request_ids=["r0", "r1"]
    )
    assert [h.enqueued for h in handles] == [True, True]
    assert time.monotonic() - started < 10
    assert producer.redis.hget(producer.keys.job("r0"), "status") == b"queued"
    producer.redis.close()


def test_clients_made_while_their_startup_node_stalls(cluster):
    """A stall past the socket timeout (1 s here, 10 s by default): the first try to
    learn the slots times out, a later one finds the node back."""
    node = cluster.nodes[0]
    node.pause()
    timer = _later(2.5, node.resume)
    try:
        client = connect(cluster.url, socket_timeout=1)
        assert client.set("stalled-sync", 1)
        client.close()
    finally:
        timer.join()

    async def run():
        client = connect_async(cluster.url, socket_timeout=1)
        try:
            return await client.set("stalled-async", 1)
        finally:
            await client.aclose()

    node.pause()
    timer = _later(2.5, node.resume)
    try:
        assert asyncio.run(run())
    finally:
        timer.join()


def test_a_node_without_cluster_mode_is_refused_at_once(tmp_path):
    """What no retry mends is not retried: a standalone server named as a cluster."""
    server = RedisServer(tmp_path).start()
    try:
        started = time.monotonic()
        with pytest.raises(redis.exceptions.RedisClusterException, match="[Cc]luster mode"):
            connect(f"redis+cluster://127.0.0.1:{server.port}/0")
        assert time.monotonic() - started < 2
    finally:
        server.stop()
