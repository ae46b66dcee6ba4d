"""A 3-shard pool on a 3-master Redis Cluster uses every master (it left 0/17/36 keys on
them when a shard's tag fell where its CRC16 did), and `lorapool status` says which
node holds each shard and its load."""

import os
import uuid

import pytest
from click.testing import CliRunner

from lorapool.cli.main import cli
from lorapool.connection import connect
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster_url():
    url = os.environ.get("LORAPOOL_TEST_CLUSTER_URL")
    if not url:
        pytest.skip("no LORAPOOL_TEST_CLUSTER_URL (a Redis Cluster node; .ci/redis-cluster)")
    return url


def test_three_shards_spread_over_three_masters(cluster_url):
    prefix = f"test-spread-{uuid.uuid4().hex[:8]}"
    conn = connect(cluster_url)
    keys = Keys(prefix, 3)
    try:
        masters = conn.get_primaries()
        if len(masters) != 3:
            pytest.skip(f"the cluster has {len(masters)} masters, the test wants 3")
        producer = Producer(conn, prefix=prefix, shards=3)
        ids = [f"r{i}" for i in range(60)]
        producer.submit_many([f"job {i}" for i in ids], SamplingParams(max_tokens=2), None, ids)
        per_node = {}
        for node in masters:
            client = conn.get_redis_connection(node)
            per_node[f"{node.host}:{node.port}"] = sum(1 for _ in client.scan_iter(keys.pattern))
        assert all(count > 0 for count in per_node.values()), per_node
        assert min(per_node.values()) >= max(per_node.values()) / 3, per_node
        shown = CliRunner().invoke(
            cli, ["status", "--redis-url", cluster_url, "--prefix", prefix, "--shards", "3"],
            terminal_width=200,
        )  # fmt: skip
        assert shown.exit_code == 0, shown.output
        rows = [line for line in shown.output.splitlines() if f"{prefix}:" in line and "-" in line]
        nodes = {n for n in per_node if any(n in row for row in rows)}
        assert nodes == set(per_node), shown.output  # each shard's node, all three
        queued = sum(producer.redis.xlen(view.requests) for view in keys.shard_views)
        assert queued == 60
    finally:
        for key in list(conn.scan_iter(keys.pattern)):
            conn.delete(key)
        conn.close()
